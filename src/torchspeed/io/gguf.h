// GGUF, llama.cpp's model file (version 2 and 3), read with our own reader: the header's
// metadata (key -> typed value, kept as JSON), the tensor table, and the tensors dequantized to
// fp32 from F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks (ggml's layouts). The
// file format only: checkpoint/gguf.h makes a model of it, data/ reads its tokenizer.
//
// The reader trusts nothing: every count, length, dimension and offset is checked against the
// bytes that remain and against sane caps before anything is allocated or read, and an error
// names the file, the offset and the key or tensor (fuzz/fuzz_gguf.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace torchspeed::io::gguf {

// ggml's tensor types that the reader dequantizes (ggml.h's enum values).
enum class Type : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};
const char* type_name(uint32_t type);  // "Q4_K", or "type 7" for one the reader does not know

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // torch order: GGUF's dimensions reversed (rows first)
  uint32_t type = 0;
  uint64_t offset = 0;         // from the start of the data section
  int64_t bytes = 0;
  int64_t numel() const;
};

struct Header {
  uint32_t version = 0;
  nlohmann::json metadata = nlohmann::json::object();  // strings as bytes (not checked as UTF-8)
  std::vector<TensorInfo> tensors;
  uint64_t data_offset = 0;  // where the data section starts in the file
  uint64_t alignment = 32;
};

// The header of `size` bytes at `data` (the whole file, or a prefix holding the header); tensor
// extents are checked against `file_size`. `source` names the file in errors.
Header parse_header(const uint8_t* data, size_t size, uint64_t file_size, const std::string& source);

// n values of a row of blocks of `type` at `src` (`bytes` of them) into `out`; n must be a
// multiple of the type's block size and `bytes` exactly its size.
void dequantize(uint32_t type, const uint8_t* src, int64_t bytes, int64_t n, float* out, const std::string& what);

// A GGUF file, its header parsed and its bytes mapped read-only.
class File {
 public:
  explicit File(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  const Header& header() const { return header_; }
  const std::string& path() const { return path_; }
  const TensorInfo* find(const std::string& name) const;
  // The tensor dequantized to fp32, in torch's shape.
  at::Tensor tensor(const TensorInfo& t) const;
  // Metadata helpers; errors name the file and key.
  bool has(const std::string& key) const { return header_.metadata.contains(key); }
  int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;
  std::string string(const std::string& key) const;

 private:
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  Header header_;
};

// Whether `path` is a GGUF file (its first four bytes).
bool is_gguf(const std::string& path);

}  // namespace torchspeed::io::gguf
