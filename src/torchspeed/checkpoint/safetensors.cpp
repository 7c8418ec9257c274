// safetensors encoding and decoding, and atomic file replacement.
#include "torchspeed/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "torchspeed/runtime/error.h"

namespace torchspeed::checkpoint {
namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kByte: return "U8";
    default: TS_CHECK(false, "safetensors: unsupported dtype ", t);
  }
}

at::ScalarType dtype_from(const std::string& s, const std::string& file) {
  if (s == "F32") return at::kFloat;
  if (s == "F64") return at::kDouble;
  if (s == "BF16") return at::kBFloat16;
  if (s == "F16") return at::kHalf;
  if (s == "I64") return at::kLong;
  if (s == "I32") return at::kInt;
  if (s == "U8") return at::kByte;
  TS_CHECK(false, file, ": unsupported safetensors dtype '", s, "'");
}

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = (dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TS_CHECK(fd >= 0, "cannot write '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      TS_CHECK(false, "writing '", tmp, "' failed after ", done, " of ", bytes.size(), " bytes: ", err);
    }
    done += static_cast<size_t>(w);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    ::unlink(tmp.c_str());
    TS_CHECK(false, "cannot replace '", path, "': ", err);
  }
  fsync_path(dir.string(), O_RDONLY | O_DIRECTORY);
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> contiguous;
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    TS_CHECK(!header.contains(name), "safetensors: tensor name '", name, "' appears twice");
    at::Tensor c = t.detach().cpu().contiguous();
    const int64_t bytes = c.numel() * static_cast<int64_t>(c.element_size());
    header[name] = {{"dtype", dtype_name(c.scalar_type())}, {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    contiguous.push_back(c);
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::string out;
  out.reserve(8 + h.size() + static_cast<size_t>(offset));
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  out += h;
  for (const auto& c : contiguous) out.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  write_file_atomic(path, out);
}

const at::Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  TS_CHECK(false, "safetensors file has no tensor '", name, "'");
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "cannot open '", path, "': ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  TS_CHECK(data.size() >= 8, path, ": truncated (", data.size(), " bytes, no header length)");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(data[i])) << (8 * i);
  TS_CHECK(n <= data.size() - 8, path, ": header length ", n, " at offset 0 exceeds the file size ", data.size());
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(data.substr(8, n));
  } catch (const std::exception& e) {
    TS_CHECK(false, path, ": corrupt header at offset 8: ", e.what());
  }
  SafetensorsFile f;
  const size_t base = 8 + n;
  std::vector<std::pair<int64_t, std::string>> order;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, val] : v.items()) f.metadata[k] = val.is_string() ? val.get<std::string>() : val.dump();
      continue;
    }
    order.emplace_back(v.at("data_offsets").at(0).get<int64_t>(), name);
  }
  std::sort(order.begin(), order.end());
  for (const auto& [begin, name] : order) {
    const auto& v = header[name];
    const at::ScalarType dt = dtype_from(v.at("dtype").get<std::string>(), path);
    std::vector<int64_t> shape = v.at("shape").get<std::vector<int64_t>>();
    const int64_t end = v.at("data_offsets").at(1).get<int64_t>();
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dt));
    TS_CHECK(begin >= 0 && end - begin == bytes, path, ": tensor '", name, "' has ", end - begin,
             " bytes for shape and dtype needing ", bytes);
    TS_CHECK(base + static_cast<size_t>(end) <= data.size(), path, ": tensor '", name, "' ends at offset ",
             base + end, " past the end of the file (", data.size(), " bytes): truncated");
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dt));
    std::memcpy(t.data_ptr(), data.data() + base + begin, static_cast<size_t>(bytes));
    f.tensors.emplace_back(name, t);
  }
  return f;
}

}  // namespace torchspeed::checkpoint
