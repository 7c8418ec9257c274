// The file formats of the io/ floor (safetensors, atomic writes, CRC-32C) under the names the
// checkpoint layer and its users have always given them (checkpoint::NamedTensors, ...).
#pragma once

#include "torchspeed/io/crc32c.h"
#include "torchspeed/io/safetensors.h"

namespace torchspeed::checkpoint {

using io::check_plain_name;
using io::crc32c;
using io::crc32c_combine;
using io::FileDigest;
using io::kMaxSafetensorsHeader;
using io::fsync_dir;
using io::load_safetensors;
using io::NamedTensors;
using io::SafetensorsFile;
using io::SafetensorsReader;
using io::save_safetensors;
using io::save_safetensors_streamed;
using io::StreamedTensor;
using io::StreamedTensors;
using io::StreamSink;
using io::write_file_atomic;

}  // namespace torchspeed::checkpoint
