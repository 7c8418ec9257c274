// safetensors files (the format Python's safetensors/Transformers read): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then
// the raw little-endian tensor bytes. Writes are atomic: a temporary file in the same folder,
// fsynced, then renamed over the target, so a failed save never damages the previous file.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace torchspeed::checkpoint {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  NamedTensors tensors;  // in file order
  std::map<std::string, std::string> metadata;
  const at::Tensor& at(const std::string& name) const;
};

// Errors name the file and, for a corrupt file, the offset or tensor.
SafetensorsFile load_safetensors(const std::string& path);

// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync of the folder).
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace torchspeed::checkpoint
