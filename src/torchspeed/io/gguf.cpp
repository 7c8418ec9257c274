// GGUF: header, metadata, tensor table and ggml's block formats (see gguf.h).
#include "torchspeed/io/gguf.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <limits>

#include "torchspeed/base/error.h"

namespace torchspeed::io::gguf {
namespace {

constexpr uint64_t kMaxCount = uint64_t{1} << 24;    // keys, tensors, array elements
constexpr uint64_t kMaxString = uint64_t{1} << 26;   // one string's bytes
constexpr int64_t kMaxElements = int64_t{1} << 40;   // one tensor's elements

struct BlockFormat {
  int64_t block;  // values per block
  int64_t bytes;  // bytes per block
};

bool format_of(uint32_t type, BlockFormat& f) {
  switch (static_cast<Type>(type)) {
    case Type::kF32: f = {1, 4}; return true;
    case Type::kF16: f = {1, 2}; return true;
    case Type::kBF16: f = {1, 2}; return true;
    case Type::kQ4_0: f = {32, 18}; return true;
    case Type::kQ4_1: f = {32, 20}; return true;
    case Type::kQ8_0: f = {32, 34}; return true;
    case Type::kQ4_K: f = {256, 144}; return true;
    case Type::kQ5_K: f = {256, 176}; return true;
    case Type::kQ6_K: f = {256, 210}; return true;
  }
  return false;
}

// Reads values at a cursor, every read checked against the end.
struct Cursor {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  const std::string& source;
  void need(uint64_t n, const char* what) const {
    TS_CHECK(n <= size - pos, source, ": truncated at offset ", pos, ": ", what, " needs ", n, " bytes, ", size - pos,
             " remain");
  }
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const size_t at = pos;
    const uint64_t n = get<uint64_t>(what);
    TS_CHECK(n <= kMaxString, source, ": at offset ", at, ": ", what, " claims a string of ", n, " bytes");
    need(n, what);
    std::string s(reinterpret_cast<const char*>(data + pos), static_cast<size_t>(n));
    pos += static_cast<size_t>(n);
    return s;
  }
};

// GGUF's value types.
enum : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32v = 6, kBool = 7, kString = 8, kArray = 9,
  kU64 = 10, kI64 = 11, kF64 = 12,
};

nlohmann::json scalar(Cursor& c, uint32_t type, const std::string& key) {
  switch (type) {
    case kU8: return c.get<uint8_t>(key.c_str());
    case kI8: return c.get<int8_t>(key.c_str());
    case kU16: return c.get<uint16_t>(key.c_str());
    case kI16: return c.get<int16_t>(key.c_str());
    case kU32: return c.get<uint32_t>(key.c_str());
    case kI32: return c.get<int32_t>(key.c_str());
    case kF32v: return static_cast<double>(c.get<float>(key.c_str()));
    case kBool: {
      const uint8_t b = c.get<uint8_t>(key.c_str());
      TS_CHECK(b <= 1, c.source, ": at offset ", c.pos - 1, ": key \"", key, "\": a bool of value ", int{b});
      return b == 1;
    }
    case kString: return c.str(key.c_str());
    case kU64: return c.get<uint64_t>(key.c_str());
    case kI64: return c.get<int64_t>(key.c_str());
    case kF64: return c.get<double>(key.c_str());
    default: break;
  }
  TS_CHECK(false, c.source, ": at offset ", c.pos, ": key \"", key, "\" has value type ", type, ", which GGUF does not define");
  return nullptr;
}

uint64_t min_size(uint32_t type) {
  switch (type) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32v: return 4;
    case kString: return 8;
    default: return 8;
  }
}

float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

}  // namespace

const char* type_name(uint32_t type) {
  switch (static_cast<Type>(type)) {
    case Type::kF32: return "F32";
    case Type::kF16: return "F16";
    case Type::kBF16: return "BF16";
    case Type::kQ4_0: return "Q4_0";
    case Type::kQ4_1: return "Q4_1";
    case Type::kQ8_0: return "Q8_0";
    case Type::kQ4_K: return "Q4_K";
    case Type::kQ5_K: return "Q5_K";
    case Type::kQ6_K: return "Q6_K";
  }
  static const char* const others[] = {nullptr, nullptr, nullptr, nullptr, "Q4_2", "Q4_3", "Q5_0", "Q5_1", nullptr,
                                       "Q8_1", "Q2_K", "Q3_K", nullptr, nullptr, nullptr, "Q8_K", "IQ2_XXS", "IQ2_XS",
                                       "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32",
                                       "I64", "F64", "IQ1_M"};
  if (type < sizeof(others) / sizeof(others[0]) && others[type]) return others[type];
  return "an unknown type";
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Header parse_header(const uint8_t* data, size_t size, uint64_t file_size, const std::string& source) {
  Cursor c{data, size, 0, source};
  const uint32_t magic = c.get<uint32_t>("the magic");
  TS_CHECK(magic == 0x46554747u, source, ": not a GGUF file (the first four bytes are not \"GGUF\")");
  Header h;
  h.version = c.get<uint32_t>("the version");
  TS_CHECK(h.version == 2 || h.version == 3, source, ": GGUF version ", h.version,
           " is not supported (2 and 3 are; version 1 predates 64-bit counts; a huge number is a big-endian file)");
  const uint64_t n_tensors = c.get<uint64_t>("the tensor count");
  const uint64_t n_kv = c.get<uint64_t>("the metadata count");
  TS_CHECK(n_tensors <= kMaxCount && n_kv <= kMaxCount, source, ": ", n_tensors, " tensors and ", n_kv,
           " metadata keys claimed: more than the reader accepts (", kMaxCount, ")");
  for (uint64_t i = 0; i < n_kv; ++i) {
    const size_t at = c.pos;
    const std::string key = c.str("a metadata key");
    const uint32_t type = c.get<uint32_t>("a value type");
    nlohmann::json v;
    if (type == kArray) {
      const uint32_t et = c.get<uint32_t>("an array's element type");
      const uint64_t n = c.get<uint64_t>("an array's length");
      TS_CHECK(et != kArray, source, ": at offset ", at, ": key \"", key, "\" is an array of arrays, which the reader does not take");
      TS_CHECK(n <= kMaxCount && n * min_size(et) <= size - c.pos, source, ": at offset ", at, ": key \"", key,
               "\" claims ", n, " elements, more than the file holds");
      v = nlohmann::json::array();
      v.get_ref<nlohmann::json::array_t&>().reserve(static_cast<size_t>(n));
      for (uint64_t k = 0; k < n; ++k) v.push_back(scalar(c, et, key));
    } else {
      v = scalar(c, type, key);
    }
    TS_CHECK(!h.metadata.contains(key), source, ": at offset ", at, ": key \"", key, "\" appears twice");
    h.metadata[key] = std::move(v);
  }
  if (h.metadata.contains("general.alignment")) {
    const auto& a = h.metadata["general.alignment"];
    TS_CHECK(a.is_number_unsigned() && a.get<uint64_t>() > 0 && a.get<uint64_t>() <= (1u << 20) &&
                 (a.get<uint64_t>() & (a.get<uint64_t>() - 1)) == 0,
             source, ": general.alignment ", a.dump(), " is not a power of two up to 1 MiB");
    h.alignment = a.get<uint64_t>();
  }
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const size_t at = c.pos;
    TensorInfo t;
    t.name = c.str("a tensor name");
    const uint32_t n_dims = c.get<uint32_t>("a tensor's dimension count");
    TS_CHECK(n_dims >= 1 && n_dims <= 4, source, ": at offset ", at, ": tensor \"", t.name, "\" has ", n_dims,
             " dimensions (1 to 4)");
    std::vector<int64_t> ne;
    int64_t numel = 1;
    for (uint32_t k = 0; k < n_dims; ++k) {
      const uint64_t d = c.get<uint64_t>("a tensor dimension");
      TS_CHECK(d >= 1 && d <= static_cast<uint64_t>(kMaxElements) && static_cast<int64_t>(d) <= kMaxElements / numel, source,
               ": at offset ", at, ": tensor \"", t.name, "\" has dimension ", d, " (elements beyond ", kMaxElements, ")");
      numel *= static_cast<int64_t>(d);
      ne.push_back(static_cast<int64_t>(d));
    }
    t.shape.assign(ne.rbegin(), ne.rend());
    t.type = c.get<uint32_t>("a tensor type");
    t.offset = c.get<uint64_t>("a tensor offset");
    BlockFormat f{};
    TS_CHECK(format_of(t.type, f), source, ": tensor \"", t.name, "\" is ", type_name(t.type), " (type ", t.type,
             "), which torchspeed does not read (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)");
    TS_CHECK(ne[0] % f.block == 0, source, ": tensor \"", t.name, "\": its rows of ", ne[0], " values are not whole ",
             type_name(t.type), " blocks of ", f.block);
    t.bytes = numel / f.block * f.bytes;
    TS_CHECK(t.offset % h.alignment == 0, source, ": tensor \"", t.name, "\" starts at data offset ", t.offset,
             ", not a multiple of the alignment ", h.alignment);
    h.tensors.push_back(std::move(t));
  }
  h.data_offset = (c.pos + h.alignment - 1) / h.alignment * h.alignment;
  TS_CHECK(h.data_offset <= file_size, source, ": the header ends at ", c.pos, " but the file has ", file_size, " bytes");
  const uint64_t data_bytes = file_size - h.data_offset;
  for (const TensorInfo& t : h.tensors) {
    TS_CHECK(t.offset <= data_bytes && static_cast<uint64_t>(t.bytes) <= data_bytes - t.offset, source, ": tensor \"",
             t.name, "\" (", t.bytes, " bytes at data offset ", t.offset, ") runs past the end of the file (",
             data_bytes, " bytes of data)");
  }
  return h;
}

void dequantize(uint32_t type, const uint8_t* src, int64_t bytes, int64_t n, float* y, const std::string& what) {
  BlockFormat f{};
  TS_CHECK(format_of(type, f), what, ": type ", type_name(type), " is not dequantized");
  TS_CHECK(n % f.block == 0 && bytes == n / f.block * f.bytes, what, ": ", n, " values of ", type_name(type), " need ",
           n / f.block * f.bytes, " bytes, got ", bytes);
  const int64_t nb = n / f.block;
  switch (static_cast<Type>(type)) {
    case Type::kF32: std::memcpy(y, src, static_cast<size_t>(n) * 4); return;
    case Type::kF16:
      for (int64_t i = 0; i < n; ++i) y[i] = half(src + 2 * i);
      return;
    case Type::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        y[i] = static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
      }
      return;
    case Type::kQ4_0:  // d (f16), 16 bytes of nibbles: low nibbles are values 0-15, high 16-31
      for (int64_t b = 0; b < nb; ++b, src += 18, y += 32) {
        const float d = half(src);
        for (int j = 0; j < 16; ++j) {
          y[j] = static_cast<float>((src[2 + j] & 0xF) - 8) * d;
          y[j + 16] = static_cast<float>((src[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case Type::kQ4_1:  // d, m (f16), nibbles: value = q d + m
      for (int64_t b = 0; b < nb; ++b, src += 20, y += 32) {
        const float d = half(src), m = half(src + 2);
        for (int j = 0; j < 16; ++j) {
          y[j] = static_cast<float>(src[4 + j] & 0xF) * d + m;
          y[j + 16] = static_cast<float>(src[4 + j] >> 4) * d + m;
        }
      }
      return;
    case Type::kQ8_0:  // d (f16), 32 int8
      for (int64_t b = 0; b < nb; ++b, src += 34, y += 32) {
        const float d = half(src);
        for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(src[2 + j])) * d;
      }
      return;
    case Type::kQ4_K:  // d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
      for (int64_t b = 0; b < nb; ++b, src += 144) {
        const float d = half(src), dmin = half(src + 2);
        const uint8_t* sc = src + 4;
        const uint8_t* q = src + 16;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
          uint8_t s, m;
          scale_min_k4(is, sc, s, m);
          const float d1 = d * s, m1 = dmin * m;
          scale_min_k4(is + 1, sc, s, m);
          const float d2 = d * s, m2 = dmin * m;
          for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
          for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
        }
      }
      return;
    case Type::kQ5_K:  // d, dmin, 12 scale bytes, 32 bytes of fifth bits, 128 bytes of nibbles
      for (int64_t b = 0; b < nb; ++b, src += 176) {
        const float d = half(src), dmin = half(src + 2);
        const uint8_t* sc = src + 4;
        const uint8_t* qh = src + 16;
        const uint8_t* ql = src + 48;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
          uint8_t s, m;
          scale_min_k4(is, sc, s, m);
          const float d1 = d * s, m1 = dmin * m;
          scale_min_k4(is + 1, sc, s, m);
          const float d2 = d * s, m2 = dmin * m;
          for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
          for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
          u1 = static_cast<uint8_t>(u1 << 2);
          u2 = static_cast<uint8_t>(u2 << 2);
        }
      }
      return;
    case Type::kQ6_K:  // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (f16)
      for (int64_t b = 0; b < nb; ++b, src += 210) {
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const auto* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = half(src + 208);
        for (int n128 = 0; n128 < 256; n128 += 128, y += 128, ql += 64, qh += 32, sc += 8) {
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
            y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
            y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
            y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
          }
        }
      }
      return;
  }
}

File::File(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TS_CHECK(fd >= 0, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < 8) {
    ::close(fd);
    TS_CHECK(false, path, ": not a GGUF file (", st.st_size, " bytes)");
  }
  size_ = static_cast<size_t>(st.st_size);
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  TS_CHECK(m != MAP_FAILED, path, ": cannot map ", size_, " bytes: ", std::strerror(errno));
  map_ = static_cast<const uint8_t*>(m);
  try {
    header_ = parse_header(map_, size_, size_, path);
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(map_), size_);
    throw;
  }
}

File::~File() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
}

const TensorInfo* File::find(const std::string& name) const {
  for (const TensorInfo& t : header_.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

at::Tensor File::tensor(const TensorInfo& t) const {
  at::Tensor out = at::empty(t.shape, at::kFloat);
  dequantize(t.type, map_ + header_.data_offset + t.offset, t.bytes, t.numel(), out.data_ptr<float>(),
             concat(path_, ": tensor \"", t.name, "\""));
  return out;
}

int64_t File::integer(const std::string& key) const {
  TS_CHECK(has(key), path_, ": metadata key \"", key, "\" is missing");
  const auto& v = header_.metadata.at(key);
  TS_CHECK(v.is_number_integer(), path_, ": metadata key \"", key, "\" is not an integer: ", v.type_name());
  return v.get<int64_t>();
}

double File::number(const std::string& key) const {
  TS_CHECK(has(key), path_, ": metadata key \"", key, "\" is missing");
  const auto& v = header_.metadata.at(key);
  TS_CHECK(v.is_number(), path_, ": metadata key \"", key, "\" is not a number: ", v.type_name());
  return v.get<double>();
}

std::string File::string(const std::string& key) const {
  TS_CHECK(has(key), path_, ": metadata key \"", key, "\" is missing");
  const auto& v = header_.metadata.at(key);
  TS_CHECK(v.is_string(), path_, ": metadata key \"", key, "\" is not a string: ", v.type_name());
  return v.get<std::string>();
}

bool is_gguf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace torchspeed::io::gguf
