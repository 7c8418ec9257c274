// safetensors files (the format Python's safetensors/Transformers read): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then
// the raw little-endian tensor bytes. Tensors are written from and read into their own memory
// (no staging copy), with a CRC-32C of the whole file computed on the way. An atomic write goes
// to a temporary file in the same folder, is fsynced and renamed over the target, so a failed
// save never damages the previous file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torchspeed::io {

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

// Tensors whose bytes a producer writes in pieces instead of tensors held whole in memory (state
// that lives on disk and is larger than the memory a save may use). They follow the in-memory
// tensors in the file. `produce` is called once with a sink; sink(i, data, bytes) appends the
// next `bytes` of tensor i: each tensor's bytes arrive in order, different tensors may
// interleave (each is written at its own offset, and the file's CRC-32C is combined from the
// parts). Every byte of every tensor must arrive, or the save fails.
struct StreamedTensor {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
using StreamSink = std::function<void(size_t tensor, const void* data, size_t bytes)>;
struct StreamedTensors {
  std::vector<StreamedTensor> tensors;
  std::function<void(const StreamSink&)> produce;
};
FileDigest save_safetensors_streamed(const std::string& path, const NamedTensors& tensors, const StreamedTensors& streamed,
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

// A safetensors file read in ranges (pread), never whole: for partitions too large for the
// memory a load may use. With `expected`, the whole file's size and CRC-32C are checked first in
// one streaming pass (4 MiB at a time), so nothing is returned from a damaged file.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path, const FileDigest* expected = nullptr);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t offset = 0, bytes = 0;  // in the file
  };
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  const Entry& entry(const std::string& name) const;  // errors name the file and tensor
  // Bytes [begin, begin + n) of tensor `name` into dst.
  void read(const std::string& name, int64_t begin, int64_t n, void* dst) const;
  at::Tensor tensor(const std::string& name) const;  // the whole tensor
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::map<std::string, Entry> entries_;
};

// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync of the folder).
void write_file_atomic(const std::string& path, const std::string& bytes);

// fsync of a folder, so that renames and new entries in it are durable.
void fsync_dir(const std::string& dir);

// Names read from files (a tag in `latest`, a shard in manifest.json or a Hugging Face index)
// are joined into paths as one entry of a folder. Refuses, naming `source` (the file the name
// came from) and the name: an empty name, "." or "..", one holding '/' (an absolute path, or
// '..' components reaching outside the folder) or a NUL byte (the system would open a shorter
// name than the one checked).
void check_plain_name(const std::string& name, const std::string& source, const char* what);

// The largest header a safetensors file may declare: the Rust implementation's MAX_HEADER_SIZE
// (100 MB), so that a damaged or hostile length cannot make a reader allocate and parse
// gigabytes.
inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

}  // namespace torchspeed::io
