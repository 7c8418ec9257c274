// IDX reading: a file written here round-trips; truncated, mis-typed and corrupt files are errors
// naming the file and offset; the Fashion-MNIST that Debian ships loads with the right shapes.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "torchspeed/data/idx.h"
#include "torchspeed/base/error.h"

using namespace torchspeed::data;

namespace {
std::string tmp(const std::string& name) { return (std::filesystem::temp_directory_path() / name).string(); }

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

std::string idx_bytes(std::vector<uint32_t> dims, const std::string& data) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((d >> shift) & 0xFF));
  }
  return s + data;
}

void expect_error(const std::string& path, const std::string& needle) {
  try {
    read_idx(path);
    FAIL() << "expected an error containing " << needle;
  } catch (const torchspeed::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << "the error names the file";
  }
}
}  // namespace

TEST(Idx, RoundTripsGzipAndPlainFiles) {
  std::string data;
  for (int i = 0; i < 24; ++i) data.push_back(static_cast<char>(i * 10));
  write_gz(tmp("ts_ok.idx.gz"), idx_bytes({2, 3, 4}, data));
  std::ofstream(tmp("ts_ok.idx"), std::ios::binary) << idx_bytes({2, 3, 4}, data);
  for (const auto& p : {tmp("ts_ok.idx.gz"), tmp("ts_ok.idx")}) {
    at::Tensor t = read_idx(p);
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 3, 4}));
    EXPECT_EQ(t[1][2][3].item<int>(), 230);
  }
}

TEST(Idx, BadFilesAreClearErrors) {
  write_gz(tmp("ts_trunc.idx.gz"), idx_bytes({2, 3, 4}, std::string(20, 'x')));
  expect_error(tmp("ts_trunc.idx.gz"), "data ends at offset 36 but the header's dimensions need 40 bytes");
  write_gz(tmp("ts_magic.idx.gz"), "PK\x03\x04junk");
  expect_error(tmp("ts_magic.idx.gz"), "offset 0: not an IDX file");
  std::string floats = idx_bytes({2}, "abcdefgh");
  floats[2] = 0x0D;
  write_gz(tmp("ts_type.idx.gz"), floats);
  expect_error(tmp("ts_type.idx.gz"), "offset 2: element type");
  // A gzip stream cut in the middle.
  write_gz(tmp("ts_cut.idx.gz"), idx_bytes({1000}, std::string(1000, 'z')));
  std::filesystem::resize_file(tmp("ts_cut.idx.gz"), 20);
  expect_error(tmp("ts_cut.idx.gz"), "ts_cut.idx.gz");
  expect_error("/nonexistent/x-idx3-ubyte.gz", "does not exist");
}

TEST(Idx, FashionMnistLoads) {
  auto test = load_fashion_mnist(kFashionMnistDir, /*train=*/false);
  EXPECT_EQ(test.images.sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(test.labels.size(0), 10000);
  EXPECT_EQ(test.labels.min().item<int64_t>(), 0);
  EXPECT_EQ(test.labels.max().item<int64_t>(), 9);
  EXPECT_LE(test.images.max().item<float>(), 1.0f);
  EXPECT_GT(test.images.mean().item<float>(), 0.1f);
}
