// safetensors encoding and decoding (streamed, checksummed), and atomic file replacement.
#include "torchspeed/io/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "torchspeed/io/crc32c.h"
#include "torchspeed/base/error.h"

namespace torchspeed::io {
namespace {

constexpr size_t kChunk = size_t{4} << 20;  // checksum a chunk while it is still in cache

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

// A file descriptor that closes itself; writes and reads that retry short transfers and name
// the file and offset when they fail.
class File {
 public:
  File(const std::string& path, int flags) : path_(path) {
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    TS_CHECK(fd_ >= 0, "cannot open '", path, "' for ", (flags & O_WRONLY) ? "writing" : "reading", ": ",
             std::strerror(errno));
  }
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  void write(const void* data, size_t n, uint32_t& crc) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const size_t len = std::min(n, kChunk);
      crc = crc32c(crc, p, len);
      size_t done = 0;
      while (done < len) {
        const ssize_t w = ::write(fd_, p + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        TS_CHECK(w > 0, "writing '", path_, "' failed at offset ", offset_ + static_cast<int64_t>(done), ": ",
                 w < 0 ? std::strerror(errno) : "no progress");
        done += static_cast<size_t>(w);
      }
      offset_ += static_cast<int64_t>(len);
      p += len;
      n -= len;
    }
  }

  // Reads exactly n bytes; a short file is "truncated".
  void read(void* data, size_t n, uint32_t& crc) {
    char* p = static_cast<char*>(data);
    while (n > 0) {
      const size_t len = std::min(n, kChunk);
      size_t done = 0;
      while (done < len) {
        const ssize_t r = ::read(fd_, p + done, len - done);
        if (r < 0 && errno == EINTR) continue;
        TS_CHECK(r >= 0, "reading '", path_, "' failed at offset ", offset_ + static_cast<int64_t>(done), ": ",
                 std::strerror(errno));
        TS_CHECK(r > 0, path_, ": truncated: the file ends at offset ", offset_ + static_cast<int64_t>(done),
                 " but its header describes ", offset_ + static_cast<int64_t>(n), " bytes or more");
        done += static_cast<size_t>(r);
      }
      crc = crc32c(crc, p, len);
      offset_ += static_cast<int64_t>(len);
      p += len;
      n -= len;
    }
  }

  // Writes n bytes at `offset`, leaving the sequential position alone.
  void write_at(const void* data, size_t n, int64_t offset) {
    const char* p = static_cast<const char*>(data);
    size_t done = 0;
    while (done < n) {
      const ssize_t w = ::pwrite(fd_, p + done, n - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
      if (w < 0 && errno == EINTR) continue;
      TS_CHECK(w > 0, "writing '", path_, "' failed at offset ", offset + static_cast<int64_t>(done), ": ",
               w < 0 ? std::strerror(errno) : "no progress");
      done += static_cast<size_t>(w);
    }
  }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

  void sync() { TS_CHECK(::fsync(fd_) == 0, "fsync of '", path_, "' failed: ", std::strerror(errno)); }
  void close() {
    const int fd = fd_;
    fd_ = -1;
    TS_CHECK(::close(fd) == 0, "closing '", path_, "' failed: ", std::strerror(errno));
  }
  int64_t size() const {
    struct stat st {};
    TS_CHECK(::fstat(fd_, &st) == 0, "cannot stat '", path_, "': ", std::strerror(errno));
    return static_cast<int64_t>(st.st_size);
  }
  int64_t offset() const { return offset_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t offset_ = 0;
};

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

std::string temp_name(const std::filesystem::path& target) {
  const auto dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  return (dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
}

// Writes through `write(path)` into a temporary file, then renames it over `path`.
template <typename Fn>
auto replace_atomically(const std::string& path, Fn&& write) {
  const std::filesystem::path target(path);
  const std::string tmp = temp_name(target);
  try {
    auto result = write(tmp);
    TS_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot replace '", path, "': ", std::strerror(errno));
    fsync_dir(target.has_parent_path() ? target.parent_path().string() : ".");
    return result;
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

// One tensor's header entry, checked before anything is allocated: a dtype we read, a shape of
// sizes >= 0 whose byte count fits in int64 (multiplied in order, as Python's safetensors
// does), and data_offsets [begin, end] with end - begin equal to that byte count.
struct HeaderEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;
};

int64_t header_int(const nlohmann::json& v, const std::string& file, const std::string& name,
                   const char* what) {
  TS_CHECK(
      v.is_number_integer() && (v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t{INT64_MAX}
                                                       : v.get<int64_t>() >= 0),
      file, ": header entry '", name, "': ", what, " must be an integer in [0, 2^63), found ",
      v.dump());
  return v.get<int64_t>();
}

HeaderEntry header_entry(const std::string& name, const nlohmann::json& v,
                         const std::string& file) {
  TS_CHECK(
      v.is_object() && v.contains("data_offsets") && v.contains("dtype") && v.contains("shape"),
      file, ": header entry '", name, "' needs dtype, shape and data_offsets");
  const auto& dtype = v["dtype"];
  const auto& shape = v["shape"];
  const auto& offsets = v["data_offsets"];
  TS_CHECK(dtype.is_string(), file, ": header entry '", name, "': dtype must be a string, found ",
           dtype.dump());
  TS_CHECK(shape.is_array(), file, ": header entry '", name, "': shape must be a list, found ",
           shape.dump());
  TS_CHECK(offsets.is_array() && offsets.size() == 2, file, ": header entry '", name,
           "': data_offsets must be a list [begin, end], found ", offsets.dump());
  HeaderEntry e{name, dtype_from(dtype.get<std::string>(), file), {}, 0, 0};
  int64_t bytes = static_cast<int64_t>(c10::elementSize(e.dtype));
  for (const auto& d : shape) {
    e.shape.push_back(header_int(d, file, name, "each size of shape"));
    TS_CHECK(!__builtin_mul_overflow(bytes, e.shape.back(), &bytes), file, ": header entry '", name,
             "': shape ", shape.dump(), " holds 2^63 bytes or more");
  }
  e.begin = header_int(offsets[0], file, name, "data_offsets[0]");
  e.end = header_int(offsets[1], file, name, "data_offsets[1]");
  TS_CHECK(e.begin <= e.end && e.end - e.begin == bytes, file, ": header entry '", name,
           "': data_offsets ", offsets.dump(), " do not span the ", bytes,
           " bytes its shape and dtype need");
  return e;
}

}  // namespace

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TS_CHECK(fd >= 0, "cannot open folder '", dir, "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  TS_CHECK(rc == 0, "fsync of folder '", dir, "' failed: ", std::strerror(errno));
}

void check_plain_name(const std::string& name, const std::string& source, const char* what) {
  TS_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
               name.find('\0') == std::string::npos,
           source, ": ", what, " ", nlohmann::json(name).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
           " is not a plain file name (empty, '.', '..', a '/' or a NUL byte): refused, a name read from a file ",
           "never reaches outside its folder");
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  replace_atomically(path, [&](const std::string& tmp) {
    File f(tmp, O_WRONLY | O_CREAT | O_TRUNC);
    uint32_t crc = 0;
    f.write(bytes.data(), bytes.size(), crc);
    f.sync();
    f.close();
    return 0;
  });
}

FileDigest save_safetensors(const std::string& path, const NamedTensors& tensors,
                            const std::map<std::string, std::string>& metadata, bool atomic) {
  return save_safetensors_streamed(path, tensors, StreamedTensors{}, metadata, atomic);
}

FileDigest save_safetensors_streamed(const std::string& path, const NamedTensors& tensors,
                                     const StreamedTensors& streamed, const std::map<std::string, std::string>& metadata,
                                     bool atomic) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> contiguous;
  int64_t offset = 0;
  auto describe = [&](const std::string& name, at::ScalarType dtype, const std::vector<int64_t>& shape) {
    TS_CHECK(!header.contains(name), "safetensors: tensor name '", name, "' appears twice");
    int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t d : shape) bytes *= d;
    header[name] = {{"dtype", dtype_name(dtype)}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    return bytes;
  };
  for (const auto& [name, t] : tensors) {
    at::Tensor c = t.detach().cpu().contiguous();
    describe(name, c.scalar_type(), c.sizes().vec());
    contiguous.push_back(c);
  }
  const int64_t in_memory = offset;
  std::vector<int64_t> stream_begin, stream_bytes;
  for (const auto& s : streamed.tensors) {
    stream_begin.push_back(offset);
    stream_bytes.push_back(describe(s.name, s.dtype, s.shape));
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const int64_t base = 8 + static_cast<int64_t>(h.size());
  auto write = [&](const std::string& file) {
    File f(file, O_WRONLY | O_CREAT | O_TRUNC);
    uint32_t crc = 0;
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((static_cast<uint64_t>(h.size()) >> (8 * i)) & 0xFF);
    f.write(len, 8, crc);
    f.write(h.data(), h.size(), crc);
    for (const auto& c : contiguous) f.write(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size(), crc);
    if (!streamed.tensors.empty()) {
      // Each streamed tensor at its own offset, checksummed on its own; the parts' CRCs are
      // combined in file order (crc32c_combine).
      const size_t n = streamed.tensors.size();
      std::vector<int64_t> done(n, 0);
      std::vector<uint32_t> part_crc(n, 0);
      TS_INTERNAL_ASSERT(streamed.produce, "streamed tensors without a producer");
      streamed.produce([&](size_t i, const void* data, size_t bytes) {
        TS_INTERNAL_ASSERT(i < n, "streamed tensor ", i, " of ", n);
        TS_CHECK(done[i] + static_cast<int64_t>(bytes) <= stream_bytes[i], file, ": streamed tensor '",
                 streamed.tensors[i].name, "' was given more than its ", stream_bytes[i], " bytes");
        f.write_at(data, bytes, base + stream_begin[i] + done[i]);
        part_crc[i] = crc32c(part_crc[i], data, bytes);
        done[i] += static_cast<int64_t>(bytes);
      });
      for (size_t i = 0; i < n; ++i) {
        TS_CHECK(done[i] == stream_bytes[i], file, ": streamed tensor '", streamed.tensors[i].name, "' got ", done[i],
                 " of its ", stream_bytes[i], " bytes");
        crc = crc32c_combine(crc, part_crc[i], static_cast<uint64_t>(stream_bytes[i]));
      }
    }
    TS_INTERNAL_ASSERT(f.offset() == base + in_memory, "safetensors writer position");
    f.sync();
    const FileDigest d{base + offset, crc};
    TS_CHECK(f.size() == d.bytes, file, ": ", f.size(), " bytes written, ", d.bytes, " expected");
    f.close();
    return d;
  };
  return atomic ? replace_atomically(path, write) : write(path);
}

const at::Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  TS_CHECK(false, "safetensors file has no tensor '", name, "'");
}

namespace {
// A file's header, checked: the tensors tile the data bytes exactly, in offset order.
struct Header {
  std::vector<HeaderEntry> entries;  // by offset
  std::map<std::string, std::string> metadata;
  int64_t base = 0;  // file offset of the first data byte
};

// Reads the header of `f` (a file of `size` bytes, read from offset 0), extending `crc`.
Header read_header(File& f, int64_t size, const std::string& path, uint32_t& crc) {
  TS_CHECK(size >= 8, path, ": truncated (", size, " bytes, no header length)");
  unsigned char len[8];
  f.read(len, 8, crc);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  TS_CHECK(n <= static_cast<uint64_t>(size - 8), path, ": header length ", n, " at offset 0 exceeds the file size ",
           size);
  TS_CHECK(n <= kMaxSafetensorsHeader, path, ": header length ", n, " at offset 0 exceeds the ", kMaxSafetensorsHeader,
           " bytes safetensors allows: not a safetensors file or a damaged one");
  std::string text(n, '\0');
  f.read(text.data(), n, crc);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TS_CHECK(false, path, ": corrupt header at offset 8: ", e.what());
  }
  TS_CHECK(header.is_object(), path, ": the header at offset 8 is not a JSON object");
  Header out;
  out.base = 8 + static_cast<int64_t>(n);
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, val] : v.items()) out.metadata[k] = val.is_string() ? val.get<std::string>() : val.dump();
      continue;
    }
    out.entries.push_back(header_entry(name, v, path));
  }
  // By offset; empty tensors at the same offset stay in name order (the header's).
  std::stable_sort(out.entries.begin(), out.entries.end(),
                   [](const HeaderEntry& a, const HeaderEntry& b) { return a.begin < b.begin; });
  int64_t pos = 0;  // data bytes described so far
  for (const HeaderEntry& e : out.entries) {
    TS_CHECK(e.begin == pos, path, ": tensor '", e.name, "' starts at data offset ", e.begin,
             " but the previous one ends at ", pos, " (overlapping or with a hole)");
    TS_CHECK(e.end <= size - out.base, path, ": tensor '", e.name, "' ends at offset ", out.base, " + ", e.end,
             " past the end of the file (", size, " bytes): truncated");
    pos = e.end;
  }
  TS_CHECK(out.base + pos == size, path, ": ", size - out.base - pos, " bytes after the last tensor (offset ",
           out.base + pos, "): not a safetensors file or a damaged one");
  return out;
}

void check_size(const std::string& path, int64_t size, const FileDigest* expected) {
  if (!expected) return;
  TS_CHECK(size == expected->bytes, path, ": ", size < expected->bytes ? "truncated" : "wrong size", ": ", size,
           " bytes, the checkpoint manifest says ", expected->bytes);
}

void check_crc(const std::string& path, uint32_t crc, const FileDigest* expected) {
  if (!expected) return;
  TS_CHECK(crc == expected->crc32c, path, ": checksum mismatch (CRC-32C ", hex32(crc), ", the manifest says ",
           hex32(expected->crc32c), "): the file is corrupt");
}
}  // namespace

SafetensorsFile load_safetensors(const std::string& path, const FileDigest* expected) {
  File f(path, O_RDONLY);
  const int64_t size = f.size();
  check_size(path, size, expected);
  uint32_t crc = 0;
  Header h = read_header(f, size, path, crc);
  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  for (const HeaderEntry& e : h.entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    f.read(t.data_ptr(), static_cast<size_t>(e.end - e.begin), crc);
    out.tensors.emplace_back(e.name, t);
  }
  out.digest = {size, crc};
  check_crc(path, crc, expected);
  return out;
}

SafetensorsReader::SafetensorsReader(std::string path, const FileDigest* expected) : path_(std::move(path)) {
  File f(path_, O_RDONLY);
  const int64_t size = f.size();
  check_size(path_, size, expected);
  uint32_t crc = 0;
  Header h = read_header(f, size, path_, crc);
  if (expected) {  // the data bytes, streamed through one buffer
    std::vector<char> buf(kChunk);
    for (int64_t left = size - f.offset(); left > 0;) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(left, static_cast<int64_t>(kChunk)));
      f.read(buf.data(), n, crc);
      left -= static_cast<int64_t>(n);
    }
    check_crc(path_, crc, expected);
  }
  for (const HeaderEntry& e : h.entries) entries_[e.name] = {e.dtype, e.shape, h.base + e.begin, e.end - e.begin};
  fd_ = f.release();
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsReader::Entry& SafetensorsReader::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  TS_CHECK(it != entries_.end(), path_, ": no tensor '", name, "'");
  return it->second;
}

void SafetensorsReader::read(const std::string& name, int64_t begin, int64_t n, void* dst) const {
  const Entry& e = entry(name);
  TS_CHECK(begin >= 0 && n >= 0 && begin + n <= e.bytes, path_, ": bytes [", begin, ", ", begin + n, ") of tensor '",
           name, "' requested; it has ", e.bytes);
  char* p = static_cast<char*>(dst);
  int64_t done = 0;
  while (done < n) {
    const int64_t at = e.offset + begin + done;
    const ssize_t r = ::pread(fd_, p + done, static_cast<size_t>(n - done), static_cast<off_t>(at));
    if (r < 0 && errno == EINTR) continue;
    TS_CHECK(r >= 0, "reading '", path_, "' failed at offset ", at, ": ", std::strerror(errno));
    TS_CHECK(r > 0, path_, ": truncated: the file ends at offset ", at, " inside tensor '", name, "'");
    done += r;
  }
}

at::Tensor SafetensorsReader::tensor(const std::string& name) const {
  const Entry& e = entry(name);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  read(name, 0, e.bytes, t.data_ptr());
  return t;
}

}  // namespace torchspeed::io
