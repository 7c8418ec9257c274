// IDX decoding through zlib (gzread reads plain files too).
#include "torchspeed/data/idx.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "torchspeed/base/error.h"

namespace torchspeed::data {

at::Tensor read_idx(const std::string& path) {
  TS_CHECK(std::filesystem::exists(path), "IDX file '", path, "' does not exist",
           path.find("fashion-mnist") != std::string::npos ? " (install it: apt-get install dataset-fashion-mnist)" : "");
  gzFile f = gzopen(path.c_str(), "rb");
  TS_CHECK(f, "cannot open '", path, "'");
  std::vector<unsigned char> bytes;
  unsigned char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) bytes.insert(bytes.end(), buf, buf + n);
  int err = 0;
  const char* msg = gzerror(f, &err);
  const std::string error = err != Z_OK && err != Z_STREAM_END ? std::string(msg) : std::string();
  gzclose(f);
  TS_CHECK(n == 0 && error.empty(), path, ": corrupt compressed data after ", bytes.size(), " bytes: ", error);
  TS_CHECK(bytes.size() >= 4, path, ": truncated at offset ", bytes.size(), " (no IDX header)");
  TS_CHECK(bytes[0] == 0 && bytes[1] == 0, path, ": offset 0: not an IDX file (magic ",
           static_cast<int>(bytes[0]), " ", static_cast<int>(bytes[1]), ")");
  TS_CHECK(bytes[2] == 0x08, path, ": offset 2: element type 0x", std::hex, static_cast<int>(bytes[2]),
           " is not unsigned byte (0x08)");
  const int dims = bytes[3];
  TS_CHECK(dims >= 1 && dims <= 4, path, ": offset 3: ", dims, " dimensions");
  TS_CHECK(bytes.size() >= 4 + 4 * static_cast<size_t>(dims), path, ": truncated in the dimensions at offset ", bytes.size());
  std::vector<int64_t> shape;
  int64_t total = 1;
  for (int d = 0; d < dims; ++d) {
    const unsigned char* p = bytes.data() + 4 + 4 * d;
    const int64_t v = (int64_t{p[0]} << 24) | (p[1] << 16) | (p[2] << 8) | p[3];
    shape.push_back(v);
    total *= v;
  }
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  TS_CHECK(bytes.size() - header == static_cast<size_t>(total), path, ": data ends at offset ", bytes.size(),
           " but the header's dimensions need ", header + total, " bytes (truncated or corrupt)");
  at::Tensor t = at::empty(shape, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data() + header, static_cast<size_t>(total));
  return t;
}

ImageDataset load_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = dir + (train ? "/train" : "/t10k");
  at::Tensor images = read_idx(prefix + "-images-idx3-ubyte.gz");
  at::Tensor labels = read_idx(prefix + "-labels-idx1-ubyte.gz");
  TS_CHECK(images.dim() == 3 && labels.dim() == 1 && images.size(0) == labels.size(0), prefix,
           ": images ", images.sizes(), " and labels ", labels.sizes(), " do not match");
  return {images.unsqueeze(1).to(at::kFloat).div_(255.0), labels.to(at::kLong)};
}

}  // namespace torchspeed::data
