// OneBitAllReduce (Note [1-bit all-reduce] in compressed.h): the all-to-all of phase 1 is one
// send and one receive per peer; scales and the server's signs are all-gathered.
#include "torchspeed/comm/compressed.h"

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "torchspeed/runtime/error.h"

namespace torchspeed::comm {
namespace {
constexpr int kSignTag = 7301;
constexpr int64_t kGrainBytes = 1 << 13;  // bytes of sign bits per parallel task (64 Ki elements)

// ||x||^2 in double.
double sum_sq(const float* x, int64_t n) {
  return at::parallel_reduce(
      0, n, int64_t{1} << 16, 0.0,
      [&](int64_t b, int64_t e, double acc) {
        double s = 0.0;
        for (int64_t i = b; i < e; ++i) s += static_cast<double>(x[i]) * x[i];
        return acc + s;
      },
      [](double a, double b) { return a + b; });
}

// e = x - scale * sgn(x), and the sign bits of x; n a multiple of 8.
void compress(const float* x, int64_t n, float scale, float* error, uint8_t* bits) {
  at::parallel_for(0, n / 8, kGrainBytes, [&](int64_t b, int64_t e) {
    for (int64_t byte = b; byte < e; ++byte) {
      const float* xs = x + 8 * byte;
      float* es = error + 8 * byte;
      unsigned v = 0;
      for (int k = 0; k < 8; ++k) {
        const bool pos = xs[k] >= 0.0f;
        v |= static_cast<unsigned>(pos) << (7 - k);
        es[k] = xs[k] - (pos ? scale : -scale);
      }
      bits[byte] = static_cast<uint8_t>(v);
    }
  });
}

// out[i] (+)= (bit ? scale : -scale) over n elements (a multiple of 8).
template <bool kAdd>
void expand(const uint8_t* bits, int64_t n, float scale, float* out) {
  at::parallel_for(0, n / 8, kGrainBytes, [&](int64_t b, int64_t e) {
    for (int64_t byte = b; byte < e; ++byte) {
      const unsigned v = bits[byte];
      float* o = out + 8 * byte;
      for (int k = 0; k < 8; ++k) {
        const float s = (v >> (7 - k)) & 1u ? scale : -scale;
        if constexpr (kAdd) {
          o[k] += s;
        } else {
          o[k] = s;
        }
      }
    }
  });
}
}  // namespace

void pack_signs(const float* x, int64_t n, uint8_t* out) {
  TS_INTERNAL_ASSERT(n % 8 == 0, "pack_signs needs a multiple of 8 elements, got ", n);
  for (int64_t b = 0; b < n / 8; ++b) {
    uint8_t v = 0;
    for (int k = 0; k < 8; ++k) v = static_cast<uint8_t>(v | ((x[8 * b + k] >= 0.0f ? 1u : 0u) << (7 - k)));
    out[b] = v;
  }
}

void unpack_signs(const uint8_t* bits, int64_t n, float scale, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = (bits[i / 8] >> (7 - i % 8)) & 1u ? scale : -scale;
}

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
  at::Tensor x = worker_error_.clone();  // the padding's error stays; the buffer adds to the rest
  x.narrow(0, 0, numel_).add_(buffer);
  const float* xp = x.data_ptr<float>();
  const float s_w = static_cast<float>(std::sqrt(sum_sq(xp, padded_) / static_cast<double>(padded_)));
  const int64_t chunk_bytes = chunk_ / 8;
  at::Tensor signs = at::empty({padded_ / 8}, at::kByte);
  compress(xp, padded_, s_w, worker_error_.data_ptr<float>(), signs.data_ptr<uint8_t>());
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
  at::Tensor y = server_error_.clone();
  float* yp = y.data_ptr<float>();
  const float* sc = scales.data_ptr<float>();
  for (int j = 0; j < n; ++j) {
    expand<true>(recv.data_ptr<uint8_t>() + j * chunk_bytes, chunk_, sc[j] / static_cast<float>(n), yp);
  }
  const float s_s = static_cast<float>(std::sqrt(sum_sq(yp, chunk_) / static_cast<double>(chunk_)));
  at::Tensor server_signs = at::empty({chunk_bytes}, at::kByte);
  compress(yp, chunk_, s_s, server_error_.data_ptr<float>(), server_signs.data_ptr<uint8_t>());
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

}  // namespace torchspeed::comm
