// A llama.cpp GGUF model (architectures llama, mistral, qwen2, qwen3) as our model description
// and parameter names (load_gguf), with the q/k row permutation llama.cpp's converter applies to
// Llama-architecture files undone. The file format itself is io/gguf.h, whose names this
// namespace also carries.
#pragma once

#include <string>

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/io/gguf.h"

namespace torchspeed::checkpoint::gguf {

using io::gguf::dequantize;
using io::gguf::File;
using io::gguf::Header;
using io::gguf::is_gguf;
using io::gguf::parse_header;
using io::gguf::TensorInfo;
using io::gguf::Type;
using io::gguf::type_name;

// config {"model": section, "gguf": {tokenizer and chat template metadata}}, parameters in fp32
// with our names.
Model load_gguf(const std::string& path);

}  // namespace torchspeed::checkpoint::gguf
