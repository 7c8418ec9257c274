// OneBitAllReduce (Note [1-bit all-reduce] in compressed.h): the all-to-all of phase 1 is one
// send and one receive per peer; scales and the server's signs are all-gathered.
#include "torchspeed/comm/compressed.h"

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "torchspeed/base/error.h"

namespace torchspeed::comm {
namespace {
constexpr int kSignTag = 7301;
constexpr int64_t kGrainBytes = 1 << 13;  // bytes of sign bits per parallel task (64 Ki elements)

// Bytes in MSB-first order from a 16-bit AVX-512 mask (element k in bit k), and back.
struct BitReverse {
  uint8_t t[256];
  BitReverse() {
    for (int v = 0; v < 256; ++v) {
      int r = 0;
      for (int k = 0; k < 8; ++k) r |= ((v >> k) & 1) << (7 - k);
      t[v] = static_cast<uint8_t>(r);
    }
  }
};
const BitReverse kRev;

// Bytes [b, e) of the sign bits of x (elements [8b, 8e)), and x - scale * sgn(x) written into
// `error` (which may be x itself).
void compress_scalar(const float* x, int64_t b, int64_t e, float scale, float* error, uint8_t* bits) {
  for (int64_t byte = b; byte < e; ++byte) {
    unsigned v = 0;
    for (int k = 0; k < 8; ++k) {
      const float xi = x[8 * byte + k];
      const bool pos = xi >= 0.0f;
      v |= static_cast<unsigned>(pos) << (7 - k);
      error[8 * byte + k] = xi - (pos ? scale : -scale);
    }
    bits[byte] = static_cast<uint8_t>(v);
  }
}

template <bool kAdd>
void expand_scalar(const uint8_t* bits, int64_t b, int64_t e, float scale, float* out) {
  for (int64_t byte = b; byte < e; ++byte) {
    const unsigned v = bits[byte];
    for (int k = 0; k < 8; ++k) {
      const float s = (v >> (7 - k)) & 1u ? scale : -scale;
      if constexpr (kAdd) {
        out[8 * byte + k] += s;
      } else {
        out[8 * byte + k] = s;
      }
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void compress_avx512(const float* x, int64_t b, int64_t e, float scale,
                                                        float* error, uint8_t* bits) {
  const __m512 zero = _mm512_setzero_ps(), pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
  int64_t byte = b;
  for (; byte + 2 <= e; byte += 2) {
    const __m512 v = _mm512_loadu_ps(x + 8 * byte);
    const __mmask16 m = _mm512_cmp_ps_mask(v, zero, _CMP_GE_OQ);
    _mm512_storeu_ps(error + 8 * byte, _mm512_sub_ps(v, _mm512_mask_blend_ps(m, neg, pos)));
    bits[byte] = kRev.t[m & 0xFF];
    bits[byte + 1] = kRev.t[m >> 8];
  }
  compress_scalar(x, byte, e, scale, error, bits);
}

template <bool kAdd>
__attribute__((target("avx512f"))) void expand_avx512(const uint8_t* bits, int64_t b, int64_t e, float scale,
                                                      float* out) {
  const __m512 pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
  int64_t byte = b;
  for (; byte + 2 <= e; byte += 2) {
    const __mmask16 m = static_cast<__mmask16>(kRev.t[bits[byte]] | (kRev.t[bits[byte + 1]] << 8));
    const __m512 q = _mm512_mask_blend_ps(m, neg, pos);
    float* o = out + 8 * byte;
    if constexpr (kAdd) {
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), q));
    } else {
      _mm512_storeu_ps(o, q);
    }
  }
  expand_scalar<kAdd>(bits, byte, e, scale, out);
}
bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}
#endif

// The sign bits of x (n a multiple of 8) and x - scale * sgn(x) into `error` (may be x).
void compress(const float* x, int64_t n, float scale, float* error, uint8_t* bits) {
  at::parallel_for(0, n / 8, kGrainBytes, [&](int64_t b, int64_t e) {
#if defined(__x86_64__)
    if (has_avx512()) return compress_avx512(x, b, e, scale, error, bits);
#endif
    compress_scalar(x, b, e, scale, error, bits);
  });
}

// out[i] (+)= (bit ? scale : -scale) over n elements (a multiple of 8).
template <bool kAdd>
void expand(const uint8_t* bits, int64_t n, float scale, float* out) {
  at::parallel_for(0, n / 8, kGrainBytes, [&](int64_t b, int64_t e) {
#if defined(__x86_64__)
    if (has_avx512()) return expand_avx512<kAdd>(bits, b, e, scale, out);
#endif
    expand_scalar<kAdd>(bits, b, e, scale, out);
  });
}

// x = error + buffer over the buffer's elements (the padding keeps its error), written into
// `error`; returns ||x||^2.
double compensate(float* error, const float* buffer, int64_t numel, int64_t padded) {
  return at::parallel_reduce(
      0, padded, int64_t{1} << 16, 0.0,
      [&](int64_t b, int64_t e, double acc) {
        double s = 0.0;
        for (int64_t i = b; i < e; ++i) {
          const float x = i < numel ? error[i] + buffer[i] : error[i];
          error[i] = x;
          s += static_cast<double>(x) * x;
        }
        return acc + s;
      },
      [](double a, double b) { return a + b; });
}
}  // namespace

OneBitAllReduce::OneBitAllReduce(CommunicatorPtr comm, int64_t numel) : comm_(std::move(comm)), numel_(numel) {
  TS_CHECK(comm_, "OneBitAllReduce needs a communicator");
  TS_CHECK(numel >= 0, "OneBitAllReduce: negative size ", numel);
  const int64_t n = comm_->size();
  const int64_t unit = n * (n * 8 / std::gcd<int64_t>(n, 8));  // N x lcm(N, 8), DeepSpeed's padding
  padded_ = (numel + unit - 1) / unit * unit;
  chunk_ = padded_ / n;
  worker_error_ = at::zeros({padded_}, at::kFloat);
  server_error_ = at::zeros({chunk_}, at::kFloat);
}

void OneBitAllReduce::reset_errors() {
  worker_error_.zero_();
  server_error_.zero_();
}

void OneBitAllReduce::run(const at::Tensor& buffer) {
  TS_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous() && buffer.numel() == numel_,
           comm_->describe("1-bit all_reduce"), ": expected a contiguous float32 buffer of ", numel_,
           " elements, got ", buffer.numel(), " ", buffer.scalar_type());
  const int n = comm_->size(), r = comm_->rank();
  if (numel_ == 0) return;
  // 1. Worker: compensate, scale, signs; this rank's error.
  float* x = worker_error_.data_ptr<float>();  // x is built in place of the error it replaces
  const float s_w = static_cast<float>(
      std::sqrt(compensate(x, buffer.data_ptr<float>(), numel_, padded_) / static_cast<double>(padded_)));
  const int64_t chunk_bytes = chunk_ / 8;
  at::Tensor signs = at::empty({padded_ / 8}, at::kByte);
  compress(x, padded_, s_w, x, signs.data_ptr<uint8_t>());
  // Phase 1: chunk j of every rank's signs to rank j; every rank's scale to all.
  at::Tensor recv = at::empty({n * chunk_bytes}, at::kByte);
  recv.narrow(0, r * chunk_bytes, chunk_bytes).copy_(signs.narrow(0, r * chunk_bytes, chunk_bytes));
  std::vector<WorkPtr> works;
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    works.push_back(comm_->recv_async(recv.narrow(0, j * chunk_bytes, chunk_bytes), j, kSignTag));
    works.push_back(comm_->send_async(signs.narrow(0, j * chunk_bytes, chunk_bytes), j, kSignTag));
  }
  at::Tensor scales = at::empty({n}, at::kFloat);
  for (auto& w : works) w->wait();
  comm_->all_gather(at::full({1}, s_w, at::kFloat), scales);
  // 2. Server for chunk r: the average of the workers' compressed chunks, compensated.
  float* yp = server_error_.data_ptr<float>();  // y is built in place of the server error
  const float* sc = scales.data_ptr<float>();
  for (int j = 0; j < n; ++j) {
    expand<true>(recv.data_ptr<uint8_t>() + j * chunk_bytes, chunk_, sc[j] / static_cast<float>(n), yp);
  }
  const float s_s = static_cast<float>(std::sqrt(compensate(yp, nullptr, 0, chunk_) / static_cast<double>(chunk_)));
  at::Tensor server_signs = at::empty({chunk_bytes}, at::kByte);
  compress(yp, chunk_, s_s, yp, server_signs.data_ptr<uint8_t>());
  // Phase 2: every server's signs and scale.
  at::Tensor all_signs = at::empty({n * chunk_bytes}, at::kByte);
  at::Tensor server_scales = at::empty({n}, at::kFloat);
  comm_->all_gather(server_signs, all_signs);
  comm_->all_gather(at::full({1}, s_s, at::kFloat), server_scales);
  // 3. The result, unpadded.
  // Straight into the buffer; the padding's chunk tail goes to a scratch copy.
  const float* ss = server_scales.data_ptr<float>();
  float* dst = buffer.data_ptr<float>();
  for (int j = 0; j < n; ++j) {
    const int64_t begin = j * chunk_, len = std::min(chunk_, numel_ - begin);
    if (len <= 0) break;
    const uint8_t* bits = all_signs.data_ptr<uint8_t>() + j * chunk_bytes;
    const int64_t whole = len / 8 * 8;
    expand<false>(bits, whole, ss[j], dst + begin);
    if (whole < len) {
      float tail[8];
      expand<false>(bits + whole / 8, 8, ss[j], tail);
      std::copy(tail, tail + (len - whole), dst + begin + whole);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// QuantizedReduceScatter (Note [Quantized reduce-scatter] in compressed.h)

namespace {
constexpr int kQuantTag = 7302;
}  // namespace

QuantizedReduceScatter::QuantizedReduceScatter(CommunicatorPtr comm) : comm_(std::move(comm)) {
  TS_CHECK(comm_, "QuantizedReduceScatter: null communicator");
  const int p = comm_->size(), r = comm_->rank(), h = comm_->hierarchy_hosts();
  if (h > 1 && p % h == 0 && p / h > 1) {
    hosts_ = h;
    local_ = p / h;
    intra_ = comm_->split(r / local_, r, comm_->name() + ".qgz_host");
    inter_ = comm_->split(r % local_, r, comm_->name() + ".qgz_across");
  } else {
    hosts_ = p;
    inter_ = comm_;
  }
}

void QuantizedReduceScatter::encode(const float* x, int64_t n, uint8_t* wire) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  float* scales = reinterpret_cast<float*>(wire);  // wire is at least 4-byte aligned (see run)
  uint8_t* q = wire + 4 * blocks;
  std::fill(q, q + (n + 1) / 2, uint8_t{0x88});  // an odd tail's missing half decodes to 0
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      float amax = 0.0f;
      bool finite = true;  // (std::max drops a NaN: it is tested on its own)
      for (int64_t i = lo; i < hi; ++i) {
        finite = finite && std::isfinite(x[i]);
        amax = std::max(amax, std::fabs(x[i]));
      }
      if (!finite) {  // an overflow (fp16 loss scaling): the block decodes to NaN, so it is seen
        scales[b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float scale = amax / 7.0f;
      scales[b] = scale;
      // In double: 1 / scale overflows float for blocks below ~2e-38.
      const double inv = scale > 0.0f ? 1.0 / static_cast<double>(scale) : 0.0;
      for (int64_t i = lo; i < hi; ++i) {
        const double t = std::clamp(static_cast<double>(x[i]) * inv, -7.0, 7.0);
        const uint8_t nib = static_cast<uint8_t>(static_cast<int>(std::nearbyint(t)) + 8);  // 1..15
        uint8_t& byte = q[i / 2];
        byte = (i % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0) | nib) : static_cast<uint8_t>((byte & 0x0F) | (nib << 4));
      }
    }
  });
}

void QuantizedReduceScatter::decode_add(const uint8_t* wire, int64_t n, float* y) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const float* scales = reinterpret_cast<const float*>(wire);
  const uint8_t* q = wire + 4 * blocks;
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      const float scale = scales[b];
      for (int64_t i = lo; i < hi; ++i) {
        const int nib = (i % 2 == 0) ? (q[i / 2] & 0x0F) : (q[i / 2] >> 4);
        y[i] += static_cast<float>(nib - 8) * scale;
      }
    }
  });
}

// The op's stages, advanced whenever the Work is polled or waited for: (0) the intra-host
// reduce-scatters in flight; (1) the quantized rows in flight across hosts; (2) decoded, done.
class QuantizedReduceScatterWork final : public Work {
 public:
  QuantizedReduceScatterWork(CommunicatorPtr inter, at::Tensor rows, at::Tensor out, ReduceOp op, int64_t ranks,
                             std::vector<WorkPtr> intra)
      : Work({out}), inter_(std::move(inter)), rows_(std::move(rows)), out_(std::move(out)), op_(op), ranks_(ranks),
        works_(std::move(intra)) {
    advance();
  }
  void wait() override {
    while (stage_ < 2) {
      for (auto& w : works_) w->wait();
      advance();
    }
  }
  bool is_completed() override {
    advance();
    return stage_ == 2;
  }
  std::exception_ptr exception() const override {
    for (const auto& w : works_)
      if (auto e = w->exception()) return e;
    return nullptr;
  }

 private:
  void advance() {
    while (stage_ < 2) {
      for (auto& w : works_)
        if (!w->is_completed()) return;  // (throws the op's failure)
      works_.clear();
      if (stage_ == 0) send_rows(); else finish();
      ++stage_;
    }
  }
  void send_rows() {
    const int64_t H = rows_.size(0), c = rows_.size(1), me = inter_->rank();
    const int64_t wb = (QuantizedReduceScatter::wire_bytes(c) + 3) / 4 * 4;  // every row's scales 4-byte aligned
    sendbuf_ = at::empty({H, wb}, at::kByte);
    recvbuf_ = at::empty({H, wb}, at::kByte);
    for (int64_t h = 0; h < H; ++h) {
      if (h != me) QuantizedReduceScatter::encode(rows_[h].data_ptr<float>(), c, sendbuf_[h].data_ptr<uint8_t>());
    }
    for (int64_t h = 0; h < H; ++h) {
      if (h == me) continue;
      works_.push_back(inter_->recv_async(recvbuf_[h], static_cast<int>(h), kQuantTag));
      works_.push_back(inter_->send_async(sendbuf_[h], static_cast<int>(h), kQuantTag));
    }
  }
  void finish() {
    const int64_t H = rows_.size(0), c = rows_.size(1), me = inter_->rank();
    out_.copy_(rows_[me]);
    float* y = out_.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h) {
      if (h != me) QuantizedReduceScatter::decode_add(recvbuf_[h].data_ptr<uint8_t>(), c, y);
    }
    if (op_ == ReduceOp::kAvg) out_.div_(static_cast<double>(ranks_));
    rows_ = sendbuf_ = recvbuf_ = at::Tensor();
  }

  CommunicatorPtr inter_;
  at::Tensor rows_, out_, sendbuf_, recvbuf_;
  ReduceOp op_;
  int64_t ranks_;
  std::vector<WorkPtr> works_;  // the stage's ops in flight
  int stage_ = 0;
};

void QuantizedReduceScatter::run(const at::Tensor& in, const at::Tensor& out, ReduceOp op) { run_async(in, out, op)->wait(); }

WorkPtr QuantizedReduceScatter::run_async(const at::Tensor& in, const at::Tensor& out, ReduceOp op) {
  TS_CHECK(in.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && in.is_contiguous() && out.is_contiguous(),
           "quantized reduce-scatter takes contiguous fp32 tensors, got ", in.scalar_type(), " and ", out.scalar_type());
  TS_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "quantized reduce-scatter: only sum and avg");
  const int64_t p = comm_->size(), c = out.numel();
  TS_CHECK(in.numel() == p * c, "quantized reduce-scatter: input has ", in.numel(), " elements, expected ", p, " x ", c);
  const int64_t H = hosts_, L = local_;
  // Step 1: rows[h] = this host's sum of chunk (h, l) (l = this rank's local index).
  at::Tensor rows;
  std::vector<WorkPtr> works;
  if (intra_) {
    rows = at::empty({H, c}, in.options());
    const at::Tensor blocks = in.view({H, L * c});
    for (int64_t h = 0; h < H; ++h) works.push_back(intra_->reduce_scatter_async(blocks[h], rows[h], ReduceOp::kSum));
  } else {
    rows = in.view({H, c});
  }
  // Step 2 (the Work's): across hosts, quantized.
  return std::make_shared<QuantizedReduceScatterWork>(inter_, rows, out, op, p, std::move(works));
}

// ---------------------------------------------------------------------------------------------
// Int8Blocks (Note [Quantized all-gather] in compressed.h)

namespace {
template <typename T>
void encode_blocks(const T* x, int64_t n, uint8_t* wire) {
  const int64_t blocks = (n + Int8Blocks::kBlock - 1) / Int8Blocks::kBlock;
  float* scales = reinterpret_cast<float*>(wire);
  auto* q = reinterpret_cast<int8_t*>(wire + 4 * blocks);
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * Int8Blocks::kBlock, hi = std::min(n, lo + Int8Blocks::kBlock);
      float amax = 0.0f;
      bool finite = true;  // (std::max drops a NaN: it is tested on its own)
      for (int64_t i = lo; i < hi; ++i) {
        const float v = static_cast<float>(x[i]);
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
      }
      if (!finite) {
        scales[b] = std::numeric_limits<float>::quiet_NaN();
        std::fill(q + lo, q + hi, int8_t{0});
        continue;
      }
      const float scale = amax / 127.0f;
      scales[b] = scale;
      const float inv = scale > 0.0f && std::isfinite(1.0f / scale) ? 1.0f / scale : 0.0f;
      if (inv == 0.0f && scale > 0.0f) {  // a block below ~1e-36: in double
        const double dinv = 1.0 / static_cast<double>(scale);
        for (int64_t i = lo; i < hi; ++i)
          q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<double>(x[i]) * dinv), -127.0, 127.0));
        continue;
      }
      for (int64_t i = lo; i < hi; ++i)
        q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[i]) * inv), -127.0f, 127.0f));
    }
  });
}

template <typename T>
void decode_blocks(const uint8_t* wire, int64_t n, T* y) {
  const int64_t blocks = (n + Int8Blocks::kBlock - 1) / Int8Blocks::kBlock;
  const float* scales = reinterpret_cast<const float*>(wire);
  const auto* q = reinterpret_cast<const int8_t*>(wire + 4 * blocks);
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * Int8Blocks::kBlock, hi = std::min(n, lo + Int8Blocks::kBlock);
      const float scale = scales[b];
      for (int64_t i = lo; i < hi; ++i) y[i] = static_cast<T>(static_cast<float>(q[i]) * scale);
    }
  });
}
}  // namespace

void Int8Blocks::encode(const at::Tensor& x, uint8_t* wire) {
  TS_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
           "int8 block quantization takes a contiguous fp32 or bf16 tensor, got ", x.scalar_type());
  TS_CHECK(reinterpret_cast<uintptr_t>(wire) % 4 == 0, "int8 block quantization: the wire buffer is not 4-byte aligned");
  const int64_t n = x.numel();
  uint8_t* end = wire + wire_bytes(n);
  std::fill(wire + 4 * ((n + kBlock - 1) / kBlock) + n, end, uint8_t{0});  // the padding: deterministic bytes
  if (x.scalar_type() == at::kFloat) encode_blocks(x.data_ptr<float>(), n, wire);
  else encode_blocks(x.data_ptr<at::BFloat16>(), n, wire);
}

void Int8Blocks::decode(const uint8_t* wire, const at::Tensor& out) {
  TS_CHECK(out.is_contiguous() && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
           "int8 block dequantization writes a contiguous fp32 or bf16 tensor, got ", out.scalar_type());
  if (out.scalar_type() == at::kFloat) decode_blocks(wire, out.numel(), out.data_ptr<float>());
  else decode_blocks(wire, out.numel(), out.data_ptr<at::BFloat16>());
}

}  // namespace torchspeed::comm
