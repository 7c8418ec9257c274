// GGUF out: what `torchspeed convert --format gguf` writes, so that a model trained or fine-tuned
// here runs in llama.cpp (and what builds on it: ollama, LM Studio, llama-cpp-python). A decoder
// with RMSNorm, SwiGLU and rotary positions becomes llama.cpp's "llama" architecture (Llama,
// Mistral, SmolLM), "qwen2" (q/k/v biases) or "qwen3" (q/k norms), with llama.cpp's tensor names,
// its q/k row permutation for "llama", and the tokenizer and chat template in the metadata. GPT-2
// (learned positions, LayerNorm, tanh-approximated GELU, biases) becomes llama.cpp's "gpt2".
// Weights in F32, F16, BF16, Q8_0 (ggml's block layout: 32 int8 and an fp16 scale, as
// llama.cpp's quantize_row_q8_0_ref computes it), Q4_0 or Q4_1 (32 nibbles and an fp16 scale, and
// for Q4_1 an fp16 minimum, as quantize_row_q4_{0,1}_ref; the embedding and output matrices in
// Q8_0); norms and biases stay F32 as llama.cpp keeps them.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/gguf.h"

namespace torchspeed::checkpoint::gguf {

// A metadata value with its GGUF type.
using Value = std::variant<uint32_t, int32_t, float, bool, std::string, uint64_t, std::vector<std::string>,
                           std::vector<int32_t>, std::vector<float>>;
using Metadata = std::vector<std::pair<std::string, Value>>;

// `n` fp32 values as `type`'s bytes (F32, F16, BF16, Q8_0, Q4_0, Q4_1; n a multiple of 32 for the blocks).
std::string encode(Type type, const float* x, int64_t n);

// A GGUF v3 file from metadata and tensors (fp32 in torch's shape, each stored as its type),
// written atomically. Returns the file's size.
struct OutTensor {
  std::string name;
  at::Tensor data;
  Type type;
};
int64_t write(const std::string& path, const Metadata& metadata, const std::vector<OutTensor>& tensors);

// The llama.cpp architecture and metadata of a model section (our names); refused by key: a
// model llama.cpp's decoders do not compute as we do (the exact GELU, a bias the architecture has
// no place for, llama3/yarn rope scaling).
std::string architecture_of(const nlohmann::json& model_section);

// Writes `params` (our names) of a model with `model_section` as a GGUF model of `type` (2-D
// weights; 1-D tensors stay F32; a row width that is not a multiple of 32 falls back to F16 for
// Q8_0, as llama.cpp's converter does), with `tokenizer` metadata (tokenizer.ggml.*, the chat
// template) appended. Returns the file's size.
int64_t save_gguf(const std::string& path, const NamedTensors& params, const nlohmann::json& model_section, Type type,
                  const std::string& name, const Metadata& tokenizer);

}  // namespace torchspeed::checkpoint::gguf
