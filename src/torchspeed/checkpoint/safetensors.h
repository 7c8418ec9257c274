// safetensors files (the format Python's safetensors/Transformers read): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then
// the raw little-endian tensor bytes. Tensors are written from and read into their own memory
// (no staging copy), with a CRC-32C of the whole file computed on the way. An atomic write goes
// to a temporary file in the same folder, is fsynced and renamed over the target, so a failed
// save never damages the previous file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace torchspeed::checkpoint {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Size and CRC-32C of a whole file.
struct FileDigest {
  int64_t bytes = 0;
  uint32_t crc32c = 0;
};

// atomic=false writes `path` in place (for files inside a folder that is itself renamed into
// place once complete); the file is fsynced either way.
FileDigest save_safetensors(const std::string& path, const NamedTensors& tensors,
                            const std::map<std::string, std::string>& metadata = {}, bool atomic = true);

struct SafetensorsFile {
  NamedTensors tensors;  // in file order
  std::map<std::string, std::string> metadata;
  FileDigest digest;
  const at::Tensor& at(const std::string& name) const;
};

// Errors name the file and, for a corrupt file, the offset or tensor. With `expected`, a file of
// another size ("truncated") or checksum ("corrupt") is refused before anything is returned.
SafetensorsFile load_safetensors(const std::string& path, const FileDigest* expected = nullptr);

// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync of the folder).
void write_file_atomic(const std::string& path, const std::string& bytes);

// fsync of a folder, so that renames and new entries in it are durable.
void fsync_dir(const std::string& dir);

}  // namespace torchspeed::checkpoint
