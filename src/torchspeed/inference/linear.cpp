// Note [Serving linear kernels]
// Decode multiplies a few activation rows by every weight matrix: it is bound by the bytes of
// weights read, not by arithmetic. The row kernel reads each weight row once for all the rows
// of the batch (in groups of up to 4, the weight row staying in L1 between groups), widens
// bf16 (a 16-bit shift) or int8 (sign extension, then one scale per output channel after the
// dot product) to fp32 in registers and accumulates in fp32 with AVX-512 FMAs, threads splitting
// the output channels. Each (row, output) dot product is computed by the same instruction
// sequence whatever the number of rows, so a request's decode tokens get the same bits alone or
// batched with 15 others. Many rows (prefill chunks) are compute-bound: they dequantize the
// weight once and use the BLAS GEMM. CPUs without AVX-512 get a portable loop.
#include "torchspeed/inference/linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
// GCC 12 warns about the "undefined" vectors inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "torchspeed/runtime/error.h"

namespace torchspeed::inference {

WeightFormat parse_weight_format(const std::string& s) {
  if (s == "fp32") return WeightFormat::kFP32;
  if (s == "bf16") return WeightFormat::kBF16;
  if (s == "int8") return WeightFormat::kInt8;
  TS_CHECK(false, "weight format \"", s, "\" is not one of fp32, bf16, int8");
  return WeightFormat::kFP32;
}

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFP32: return "fp32";
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kInt8: return "int8";
  }
  return "?";
}

ServingLinear::ServingLinear(const at::Tensor& weight, const at::Tensor& bias, WeightFormat format)
    : format_(format), in_(weight.size(1)), out_(weight.size(0)) {
  TS_CHECK(weight.dim() == 2, "a linear weight must be 2-D, got ", weight.sizes());
  at::Tensor w = weight.detach().to(at::kFloat).contiguous();
  switch (format) {
    case WeightFormat::kFP32: w_ = w.clone(); break;
    case WeightFormat::kBF16: w_ = w.to(at::kBFloat16).contiguous(); break;
    case WeightFormat::kInt8: {
      scale_ = (w.abs().amax(1) / 127.0).clamp_min(1e-12).contiguous();
      w_ = (w / scale_.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar).contiguous();
      break;
    }
  }
  if (bias.defined()) bias_ = bias.detach().to(at::kFloat).contiguous().clone();
}

int64_t ServingLinear::weight_bytes() const {
  return w_.nbytes() + (scale_.defined() ? scale_.nbytes() : 0) + (bias_.defined() ? bias_.nbytes() : 0);
}

at::Tensor ServingLinear::dense_weight() const {
  switch (format_) {
    case WeightFormat::kFP32: return w_;
    case WeightFormat::kBF16: return w_.to(at::kFloat);
    case WeightFormat::kInt8: return w_.to(at::kFloat) * scale_.unsqueeze(1);
  }
  return w_;
}

namespace {

#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

TS_AVX512 inline __m512 load_w(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
TS_AVX512 inline __m512 load_w(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
TS_AVX512 inline __m512 load_w(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// out[r] = dot(x + r * K, w) for R rows; the same instructions for each row whatever R is.
// Four accumulators per row (consecutive 16-wide blocks rotate over them) hide the FMA latency
// even for one row; they are summed in a fixed order at the end.
template <class WT, int R>
TS_AVX512 void dot_rows_avx512(const float* x, int64_t K, const WT* w, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int u = 0; u < 4; ++u) {
      const __m512 wv = load_w(w + k + 16 * u, static_cast<__mmask16>(0xFFFF));
      for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k + 16 * u), wv, acc[r][u]);
    }
  }
  for (int u = 0; k < K; ++u, k += 16) {
    const __mmask16 m = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 wv = load_w(w + k, m);
    for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * K + k), wv, acc[r][u]);
  }
  for (int r = 0; r < R; ++r) {
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
  }
}

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float widen(int8_t v) { return static_cast<float>(v); }

template <class WT, int R>
void dot_rows_portable(const float* x, int64_t K, const WT* w, float* out) {
  for (int r = 0; r < R; ++r) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * widen(w[k]);
    out[r] = s;
  }
}

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

template <class WT>
void rows_kernel_t(const float* x, int64_t rows, int64_t K, int64_t N, const WT* w, const float* scale, float* y) {
  const bool avx = have_avx512();
  // Enough outputs per task that a thread streams long runs of weight rows.
  const int64_t grain = std::max<int64_t>(16, N / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
    float out[4];
    for (int64_t o = b; o < e; ++o) {
      const WT* wr = w + o * K;
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t R = std::min<int64_t>(4, rows - m0);
        const float* xr = x + m0 * K;
        if (avx) {
          switch (R) {
            case 4: dot_rows_avx512<WT, 4>(xr, K, wr, out); break;
            case 3: dot_rows_avx512<WT, 3>(xr, K, wr, out); break;
            case 2: dot_rows_avx512<WT, 2>(xr, K, wr, out); break;
            default: dot_rows_avx512<WT, 1>(xr, K, wr, out); break;
          }
        } else {
          switch (R) {
            case 4: dot_rows_portable<WT, 4>(xr, K, wr, out); break;
            case 3: dot_rows_portable<WT, 3>(xr, K, wr, out); break;
            case 2: dot_rows_portable<WT, 2>(xr, K, wr, out); break;
            default: dot_rows_portable<WT, 1>(xr, K, wr, out); break;
          }
        }
        const float s = scale ? scale[o] : 1.0f;
        for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + o] = out[r] * s;
      }
    }
  });
}

}  // namespace

void ServingLinear::rows_kernel(const float* x, int64_t rows, float* y) const {
  switch (format_) {
    case WeightFormat::kFP32: rows_kernel_t(x, rows, in_, out_, w_.data_ptr<float>(), nullptr, y); break;
    case WeightFormat::kBF16:
      rows_kernel_t(x, rows, in_, out_, reinterpret_cast<const uint16_t*>(w_.data_ptr()), nullptr, y);
      break;
    case WeightFormat::kInt8:
      rows_kernel_t(x, rows, in_, out_, w_.data_ptr<int8_t>(), scale_.data_ptr<float>(), y);
      break;
  }
}

void ServingLinear::add_bias(at::Tensor& y) const {
  if (bias_.defined()) y.add_(bias_);
}

at::Tensor ServingLinear::forward(const at::Tensor& x_in, int64_t row_kernel_rows, bool with_bias) const {
  TS_INTERNAL_ASSERT(x_in.dim() == 2 && x_in.size(1) == in_, "serving linear expects [rows, ", in_, "], got ",
                     x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, out_}, x.options());
  const int64_t kr = M <= kRowKernelMaxRows ? M : std::min(std::max<int64_t>(row_kernel_rows, 0), M);
  if (kr > 0) rows_kernel(x.data_ptr<float>(), kr, y.data_ptr<float>());
  if (kr < M) {
    at::Tensor yr = y.narrow(0, kr, M - kr);
    at::mm_out(yr, x.narrow(0, kr, M - kr), dense_weight().t());
  }
  if (with_bias) add_bias(y);
  return y;
}

}  // namespace torchspeed::inference
