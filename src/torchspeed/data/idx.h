// IDX files (MNIST, Fashion-MNIST), gzip-compressed or plain: a big-endian magic (0x08 = ubyte,
// then the number of dimensions), the dimensions, then the data. Errors name the file and the
// offset of what is wrong.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace torchspeed::data {

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// A uint8 tensor with the file's dimensions.
at::Tensor read_idx(const std::string& path);

struct ImageDataset {
  at::Tensor images;  // [N, 1, 28, 28] float32 in [0, 1]
  at::Tensor labels;  // [N] int64
};

// Fashion-MNIST's train (60,000) or test (10,000) split from `dir`.
ImageDataset load_fashion_mnist(const std::string& dir, bool train);

}  // namespace torchspeed::data
