// Note [Serving linear kernels]
// Decode multiplies a few activation rows by every weight matrix: one or two rows are bound by
// the bytes of weights read, a dozen by loads and FMAs. The row kernel widens bf16 (a 16-bit
// shift) or int8 (sign extension; one scale per output channel after the dot product) to fp32
// in registers and accumulates in fp32 with AVX-512 FMAs, threads splitting the output channels
// in blocks of 64 whose weights stay in L2 while the rows pass over them. One or two rows go
// one channel at a time (one weight stream: 41 GB/s here against 28 for four streams), asking
// for the weights about 6 KB ahead (the hardware prefetcher alone left the stream waiting); more
// go in tiles of 4 rows x 4 channels, so each weight vector serves 4 rows and each activation
// vector 4 channels (102 GFLOP/s at 16 rows on 2 cores, MKL's sgemm 68). At 16 rows fp32
// weights are still bound by their bytes: the same tiles over int8 weights (a quarter of the
// bytes, the same FMAs) run at 171 GFLOP/s against fp32's 111 (12 layers of d 768, 16 ms
// against 25). Every (row, channel)
// dot product is one accumulator over k in order, then one reduction, in every tile shape, so a
// request's decode tokens get the same bits alone or batched with 15 others. Many rows (prefill chunks) are compute-bound: they dequantize the
// weight once and use the BLAS GEMM. CPUs without AVX-512 get a portable loop.
#include "torchspeed/inference/linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
// GCC 12 warns about the "undefined" vectors inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "torchspeed/inference/blocks.h"
#include "torchspeed/inference/simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "torchspeed/checkpoint/gguf_writer.h"
#include "torchspeed/inference/linear_bf16.h"
#include "torchspeed/base/error.h"

namespace torchspeed::inference {

WeightFormat parse_weight_format(const std::string& s) {
  if (s == "fp32") return WeightFormat::kFP32;
  if (s == "bf16") return WeightFormat::kBF16;
  if (s == "int8") return WeightFormat::kInt8;
  if (s == "q4_0") return WeightFormat::kQ4_0;
  if (s == "q4_1") return WeightFormat::kQ4_1;
  TS_CHECK(false, "weight format \"", s, "\" is not one of fp32, bf16, int8, q4_0, q4_1");
  return WeightFormat::kFP32;
}

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFP32: return "fp32";
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kInt8: return "int8";
    case WeightFormat::kQ4_0: return "q4_0";
    case WeightFormat::kQ4_1: return "q4_1";
  }
  return "?";
}

Q4Weights quantize_q4(const at::Tensor& weight, bool with_min) {
  TS_CHECK(weight.dim() == 2, "quantize_q4: a 2-D weight, got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), Kp = (K + kQ4Align - 1) / kQ4Align * kQ4Align;
  at::Tensor w = at::zeros({N, Kp}, at::kFloat);
  w.narrow(1, 0, K).copy_(weight.detach().to(at::kFloat));
  Q4Weights q{at::empty({N, Kp / 2}, at::kByte), at::empty({N, Kp / 32}, at::kShort),
              with_min ? at::empty({N, Kp / 32}, at::kShort) : at::Tensor()};
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = q.qs.data_ptr<uint8_t>();
  int16_t* dp = q.d.data_ptr<int16_t>();
  int16_t* mp = with_min ? q.m.data_ptr<int16_t>() : nullptr;
  // ggml's blocks from the GGUF writer's encoder (quantize_row_q4_{0,1}_ref), repacked: a block
  // is d (fp16), for Q4_1 m (fp16), then 16 bytes whose low nibbles are k 0-15, high 16-31.
  const auto type = with_min ? checkpoint::gguf::Type::kQ4_1 : checkpoint::gguf::Type::kQ4_0;
  const int64_t block = with_min ? 20 : 18, G = Kp / 32;
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    uint8_t nib[64];
    for (int64_t o = b; o < e; ++o) {
      const std::string blocks = checkpoint::gguf::encode(type, wp + o * Kp, Kp);
      for (int64_t g = 0; g < G; ++g) {
        const auto* blk = reinterpret_cast<const uint8_t*>(blocks.data()) + g * block;
        std::memcpy(dp + o * G + g, blk, 2);
        if (with_min) std::memcpy(mp + o * G + g, blk + 2, 2);
        const uint8_t* qs = blk + block - 16;
        uint8_t* half = nib + 32 * (g % 2);
        for (int j = 0; j < 16; ++j) {
          half[j] = qs[j] & 15;
          half[16 + j] = qs[j] >> 4;
        }
        if (g % 2 == 1) {  // a pair of groups: byte j holds the first's k j low, the second's high
          for (int j = 0; j < 32; ++j) qp[o * (Kp / 2) + (g / 2) * 32 + j] = static_cast<uint8_t>(nib[j] | (nib[32 + j] << 4));
        }
      }
    }
  });
  return q;
}

at::Tensor dequantize_q4(const Q4Weights& q, int64_t K) {
  const int64_t N = q.qs.size(0), Kp = q.qs.size(1) * 2;
  TS_CHECK(q.qs.scalar_type() == at::kByte && q.d.scalar_type() == at::kShort && q.d.size(0) == N && q.d.size(1) * 32 == Kp &&
               K <= Kp && Kp % kQ4Align == 0 && (!q.m.defined() || q.m.sizes() == q.d.sizes()),
           "dequantize_q4: qs ", q.qs.sizes(), ", d ", q.d.sizes(), " do not pack ", K, " columns");
  const at::Tensor b = q.qs.to(at::kInt).view({N, Kp / 64, 32});
  const at::Tensor nib = at::cat({b.bitwise_and(15), b.bitwise_right_shift(4)}, 2).view({N, Kp / 32, 32}).to(at::kFloat);
  const at::Tensor d = q.d.view(at::kHalf).to(at::kFloat).unsqueeze(2);
  // Q4_0: (q - 8) * d, exact in fp32. Q4_1: q * d + m, one fp32 rounding (q * d is exact). Then
  // the one rounding to bf16, as the kernels' table.
  const at::Tensor v = q.m.defined() ? (nib * d).add_(q.m.view(at::kHalf).to(at::kFloat).unsqueeze(2)) : (nib - 8) * d;
  return v.to(at::kBFloat16).to(at::kFloat).view({N, Kp}).narrow(1, 0, K).contiguous();
}

ServingLinear::ServingLinear(const at::Tensor& weight, const at::Tensor& bias, WeightFormat format, bool bf16_dot,
                             bool amx)
    : format_(format), bf16_dot_(bf16_dot && format != WeightFormat::kFP32 && have_bf16_dot()),
      // (4-bit weights stay out of the tiles: decode reads them in 4 bits, Note [4-bit weights])
      amx_(bf16_dot_ && amx && have_amx() && format != WeightFormat::kQ4_0 && format != WeightFormat::kQ4_1) {
  // The kernels take [out, in] and the bias's length from the weight: a bias of another length
  // would be read past its end (OutputStage).
  TS_CHECK(weight.defined() && weight.dim() == 2, "a linear weight must be 2-D, got ",
           weight.defined() ? weight.sizes() : at::IntArrayRef{});
  TS_CHECK(c10::isFloatingType(weight.scalar_type()), "a linear weight must be floating point, got ", weight.scalar_type());
  in_ = weight.size(1);
  out_ = weight.size(0);
  TS_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out_ && c10::isFloatingType(bias.scalar_type())),
           "a linear bias must be floating point [", out_, "] for a weight [", out_, ", ", in_, "], got ",
           bias.defined() ? bias.sizes() : at::IntArrayRef{}, " ", bias.defined() ? c10::toString(bias.scalar_type()) : "");
  at::Tensor w = weight.detach().to(at::kFloat).contiguous();
  switch (format) {
    case WeightFormat::kFP32: w_ = w.clone(); break;
    case WeightFormat::kBF16: w_ = w.to(at::kBFloat16).contiguous(); break;
    case WeightFormat::kInt8: {
      scale_ = (w.abs().amax(1) / 127.0).clamp_min(1e-12).contiguous();
      w_ = (w / scale_.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar).contiguous();
      break;
    }
    case WeightFormat::kQ4_0:
    case WeightFormat::kQ4_1: {
      Q4Weights q = quantize_q4(w, format == WeightFormat::kQ4_1);
      if (bf16_dot_) {
        w_ = q.qs;
        q4_d_ = q.d;
        q4_m_ = q.m;
      } else {
        w_ = dequantize_q4(q, in_).to(at::kBFloat16).contiguous();  // exact: the values are bf16
      }
      break;
    }
  }
  if (amx_) {
    w_ = amx_pack(w_);
    if (format == WeightFormat::kInt8) sums_ = amx_channel_sums(w_);
  }
  if (bias.defined()) bias_ = bias.detach().to(at::kFloat).contiguous().clone();
}

int64_t ServingLinear::weight_bytes() const {
  return w_.nbytes() + (scale_.defined() ? scale_.nbytes() : 0) + (sums_.defined() ? sums_.nbytes() : 0) +
         (q4_d_.defined() ? q4_d_.nbytes() : 0) + (q4_m_.defined() ? q4_m_.nbytes() : 0) + (bias_.defined() ? bias_.nbytes() : 0);
}

at::Tensor ServingLinear::dense_weight() const {
  const at::Tensor w = amx_ ? amx_unpack(w_, out_, in_) : w_;
  switch (format_) {
    case WeightFormat::kFP32: return w;
    case WeightFormat::kBF16: return w.to(at::kFloat);
    case WeightFormat::kInt8: return w.to(at::kFloat) * scale_.unsqueeze(1);
    case WeightFormat::kQ4_0:
    case WeightFormat::kQ4_1: return q4_d_.defined() ? dequantize_q4({w_, q4_d_, q4_m_}, in_) : w.to(at::kFloat);
  }
  return w;
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

// out[r * ldo + j] = dot(x + r * K, w + j * K) for a tile of R rows and J output channels: each
// weight vector is widened once for the R rows, each x vector loaded once for the J channels.
// Every (row, channel) pair has one accumulator running over k in order and one final
// reduction, so its bits are the same whatever tile computed it.
// `Ahead` > 0 (one or two rows, one channel): each step also requests the weights `Ahead`
// channels further on, a cache line per 64 bytes read, as the bf16 tiles do (Note [bf16 dot
// products]): one row's stream of fp32 weights 17 GB/s without, 19 with, the plain read 17-19.
template <class WT, int R, int J, int Ahead = 0>
TS_AVX512 void dot_tile_avx512(const float* x, int64_t K, const WT* w, float* out, int64_t ldo) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  [[maybe_unused]] const char* ahead = reinterpret_cast<const char*>(w + Ahead * J * K);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if constexpr (Ahead > 0) {
      constexpr int64_t step_bytes = J * 16 * static_cast<int64_t>(sizeof(WT));
      if (step_bytes >= 64 || (k * static_cast<int64_t>(sizeof(WT))) % 64 == 0) {
        simd::prefetch_lines(ahead + k * J * static_cast<int64_t>(sizeof(WT)), step_bytes);
      }
    }
    __m512 wv[J];
    for (int j = 0; j < J; ++j) wv[j] = load_w(w + j * K + k, static_cast<__mmask16>(0xFFFF));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[J];
    for (int j = 0; j < J; ++j) wv[j] = load_w(w + j * K + k, m);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + k);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) out[r * ldo + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

using simd::widen;

template <class WT>
void dot_tile_portable(const float* x, int64_t R, int64_t K, const WT* w, int64_t J, float* out, int64_t ldo) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < J; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * widen(w[j * K + k]);
      out[r * ldo + j] = s;
    }
  }
}

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

// The 4 x 4 tile spelled out: GCC keeps a 16-accumulator array on the stack (a store per FMA),
// named variables stay in registers. Same arithmetic per (row, channel) as the template.
// `Prefetch`: the first rows over these channels also request the next 4 channels' weights
// (as in Note [bf16 dot products]), so streaming them from memory overlaps the arithmetic.
template <class WT, bool Prefetch>
TS_AVX512 void dot_tile_4x4(const float* x, int64_t K, const WT* w, float* out, int64_t ldo) {
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
         a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  auto step = [&](int64_t k, __mmask16 m) TS_AVX512 {
    const __m512 w0 = load_w(w + k, m), w1 = load_w(w + K + k, m), w2 = load_w(w + 2 * K + k, m),
                 w3 = load_w(w + 3 * K + k, m);
    __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
    a00 = _mm512_fmadd_ps(xv, w0, a00); a01 = _mm512_fmadd_ps(xv, w1, a01);
    a02 = _mm512_fmadd_ps(xv, w2, a02); a03 = _mm512_fmadd_ps(xv, w3, a03);
    xv = _mm512_maskz_loadu_ps(m, x + K + k);
    a10 = _mm512_fmadd_ps(xv, w0, a10); a11 = _mm512_fmadd_ps(xv, w1, a11);
    a12 = _mm512_fmadd_ps(xv, w2, a12); a13 = _mm512_fmadd_ps(xv, w3, a13);
    xv = _mm512_maskz_loadu_ps(m, x + 2 * K + k);
    a20 = _mm512_fmadd_ps(xv, w0, a20); a21 = _mm512_fmadd_ps(xv, w1, a21);
    a22 = _mm512_fmadd_ps(xv, w2, a22); a23 = _mm512_fmadd_ps(xv, w3, a23);
    xv = _mm512_maskz_loadu_ps(m, x + 3 * K + k);
    a30 = _mm512_fmadd_ps(xv, w0, a30); a31 = _mm512_fmadd_ps(xv, w1, a31);
    a32 = _mm512_fmadd_ps(xv, w2, a32); a33 = _mm512_fmadd_ps(xv, w3, a33);
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if constexpr (Prefetch) {
      if (sizeof(WT) == 4 || k % (64 / sizeof(WT)) == 0) {
        for (int j = 4; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k), _MM_HINT_T0);
      }
    }
    step(k, static_cast<__mmask16>(0xFFFF));
  }
  if (k < K) step(k, static_cast<__mmask16>((1u << (K - k)) - 1u));
  simd::store_4x4(out, ldo, a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33);
}

// Every row against channels [o, e): tiles of 4 channels (then single ones), each passed over
// by the rows 4 at a time while its weights sit in L1.
template <class WT, int J>
TS_AVX512 void channel_tile(const float* x, int64_t rows, int64_t K, const WT* w, float* y, int64_t N) {
  int64_t m0 = 0;
  for (; m0 + 4 <= rows; m0 += 4) {
    if constexpr (J == 4) {
      if (m0 == 0) dot_tile_4x4<WT, true>(x + m0 * K, K, w, y + m0 * N, N);
      else dot_tile_4x4<WT, false>(x + m0 * K, K, w, y + m0 * N, N);
    }
    else dot_tile_avx512<WT, 4, J>(x + m0 * K, K, w, y + m0 * N, N);
  }
  switch (rows - m0) {
    case 3: dot_tile_avx512<WT, 3, J>(x + m0 * K, K, w, y + m0 * N, N); break;
    case 2: dot_tile_avx512<WT, 2, J>(x + m0 * K, K, w, y + m0 * N, N); break;
    case 1: dot_tile_avx512<WT, 1, J>(x + m0 * K, K, w, y + m0 * N, N); break;
    default: break;
  }
}

template <class WT>
TS_AVX512 void tile_rows(const float* x, int64_t rows, int64_t K, const WT* w, int64_t o, int64_t e, float* y, int64_t N) {
  for (; o + 4 <= e; o += 4) channel_tile<WT, 4>(x, rows, K, w + o * K, y + o, N);
  for (; o < e; ++o) channel_tile<WT, 1>(x, rows, K, w + o * K, y + o, N);
}

template <class WT>
void rows_kernel_t(const float* x, int64_t rows, int64_t K, int64_t N, const WT* w, const float* scale, float* y,
                   const OutputStage& stage) {
  const bool avx = have_avx512();
  const int64_t block = channel_block(rows);
  dynamic_blocks((N + block - 1) / block, [&](int64_t blk) {
    const int64_t o0 = blk * block, o1 = std::min(N, o0 + block);
    if (!avx) {
      dot_tile_portable<WT>(x, rows, K, w + o0 * K, o1 - o0, y + o0, N);
    } else if (rows <= 2) {
      // One or two rows are bound by the weight bytes: one channel at a time streams best.
      constexpr int kAhead = 8 / sizeof(WT);  // channels: 2 fp32, 4 bf16, 8 int8 rows (6 KB at K 768)
      for (int64_t o = o0; o < o1; ++o) {
        if (rows == 2) dot_tile_avx512<WT, 2, 1, kAhead>(x, K, w + o * K, y + o, N);
        else dot_tile_avx512<WT, 1, 1, kAhead>(x, K, w + o * K, y + o, N);
      }
    } else {
      tile_rows<WT>(x, rows, K, w, o0, o1, y, N);
    }
    if (scale) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = o0; o < o1; ++o) y[r * N + o] *= scale[o];
      }
    }
    stage.apply(y, rows, N, o0, o1);
  });
}

TS_AVX512 void layer_norm_row_avx512(const float* x, int64_t d, const float* w, const float* b, float eps, float* out) {
  __m512 s = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= d; k += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(x + k));
  const __mmask16 tail = static_cast<__mmask16>((1u << (d - k)) - 1u);
  if (k < d) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(tail, x + k));
  const float mean = _mm512_reduce_add_ps(s) / static_cast<float>(d);
  const __m512 mv = _mm512_set1_ps(mean);
  __m512 q = _mm512_setzero_ps();
  for (k = 0; k + 16 <= d; k += 16) {
    const __m512 c = _mm512_sub_ps(_mm512_loadu_ps(x + k), mv);
    q = _mm512_fmadd_ps(c, c, q);
  }
  if (k < d) {
    const __m512 c = _mm512_maskz_sub_ps(tail, _mm512_maskz_loadu_ps(tail, x + k), mv);
    q = _mm512_fmadd_ps(c, c, q);
  }
  const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(q) / static_cast<float>(d) + eps));
  for (k = 0; k + 16 <= d; k += 16) {
    const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + k), mv), rstd);
    _mm512_storeu_ps(out + k, _mm512_fmadd_ps(c, _mm512_loadu_ps(w + k), _mm512_loadu_ps(b + k)));
  }
  if (k < d) {
    const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + k), mv), rstd);
    _mm512_mask_storeu_ps(out + k, tail, _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(tail, w + k), _mm512_maskz_loadu_ps(tail, b + k)));
  }
}

void layer_norm_row_portable(const float* x, int64_t d, const float* w, const float* b, float eps, float* out) {
  float s = 0.0f;
  for (int64_t k = 0; k < d; ++k) s += x[k];
  const float mean = s / static_cast<float>(d);
  float q = 0.0f;
  for (int64_t k = 0; k < d; ++k) q += (x[k] - mean) * (x[k] - mean);
  const float rstd = 1.0f / std::sqrt(q / static_cast<float>(d) + eps);
  for (int64_t k = 0; k < d; ++k) out[k] = (x[k] - mean) * rstd * w[k] + b[k];
}


// GELU on 16 lanes. erf(z) = 1 - t p(t) e^(-z^2) with t = 1 / (1 + 0.3275911 |z|) and the
// degree-5 polynomial of Abramowitz & Stegun 7.1.26 (error under 1.5e-7; torch's vectorized erf
// is the same formula); tanh(u) = (1 - e^(-2|u|)) / (1 + e^(-2|u|)), sign restored.
TS_AVX512 inline __m512 gelu16(__m512 x, bool tanh_form) {
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  if (tanh_form) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    const __m512 au = _mm512_abs_ps(u);
    const __m512 e = simd::exp_le0(_mm512_mul_ps(_mm512_set1_ps(-2.0f), au));
    __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    th = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th),
                                             _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(INT32_MIN))));
    return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, th));
  }
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  const __m512 az = _mm512_abs_ps(z);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), az, one));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  const __m512 e = simd::exp_le0(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, z)));
  __m512 erf = _mm512_fnmadd_ps(_mm512_mul_ps(t, p), e, one);  // erf(|z|)
  erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(erf),
                                            _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(INT32_MIN))));
  return _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, erf));
}

TS_AVX512 void activate_avx512(float* y, int64_t rows, int64_t N, int64_t o0, int64_t o1, bool tanh_form) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * N;
    for (int64_t o = o0; o < o1; o += 16) {
      const __mmask16 m = o1 - o >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (o1 - o)) - 1u);
      _mm512_mask_storeu_ps(row + o, m, gelu16(_mm512_maskz_loadu_ps(m, row + o), tanh_form));
    }
  }
}
}  // namespace

Activation activation_for_gelu(const char* approximate) {
  const std::string a = approximate;
  TS_CHECK(a == "none" || a == "tanh", "gelu approximate must be \"none\" or \"tanh\", got \"", a, "\"");
  return a == "tanh" ? Activation::kGeluTanh : Activation::kGelu;
}

void activate(float* y, int64_t rows, int64_t N, int64_t o0, int64_t o1, Activation act) {
  if (act == Activation::kNone || rows <= 0 || o1 <= o0) return;
  const bool tanh_form = act == Activation::kGeluTanh;
  if (have_avx512()) {
    activate_avx512(y, rows, N, o0, o1, tanh_form);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = o0; o < o1; ++o) {
      float& v = y[r * N + o];
      v = tanh_form ? 0.5f * v * (1.0f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)))
                    : 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
    }
  }
}

void layer_norm_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1);
  TS_INTERNAL_ASSERT(x.is_contiguous() && out.is_contiguous() && x.scalar_type() == at::kFloat &&
                         out.scalar_type() == at::kFloat && out.sizes() == x.sizes() && w.numel() == d && b.numel() == d,
                     "layer_norm_rows: x ", x.sizes(), ", out ", out.sizes());
  const float* xp = x.data_ptr<float>();
  const float *wp = w.data_ptr<float>(), *bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool avx = have_avx512();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (avx) layer_norm_row_avx512(xp + r * d, d, wp, bp, static_cast<float>(eps), op + r * d);
      else layer_norm_row_portable(xp + r * d, d, wp, bp, static_cast<float>(eps), op + r * d);
    }
  });
}

void rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1);
  TS_INTERNAL_ASSERT(x.is_contiguous() && out.is_contiguous() && x.scalar_type() == at::kFloat &&
                         out.scalar_type() == at::kFloat && out.sizes() == x.sizes() && w.numel() == d &&
                         w.scalar_type() == at::kFloat,
                     "rms_norm_rows: x ", x.sizes(), ", out ", out.sizes());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * d;
      float* o = op + r * d;
      double ss = 0.0;  // a sum of squares in double: no accumulation error to speak of at any d
      for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(d)) + static_cast<float>(eps));
      for (int64_t i = 0; i < d; ++i) o[i] = wp[i] * (xr[i] * inv);
    }
  });
}

void ServingLinear::rows_kernel(const float* x, int64_t rows, float* y, const OutputStage& stage) const {
  switch (format_) {
    case WeightFormat::kFP32: rows_kernel_t(x, rows, in_, out_, w_.data_ptr<float>(), nullptr, y, stage); break;
    case WeightFormat::kBF16:
    case WeightFormat::kQ4_0:  // (without bf16 dot products their values are kept as bf16)
    case WeightFormat::kQ4_1:
      rows_kernel_t(x, rows, in_, out_, reinterpret_cast<const uint16_t*>(w_.data_ptr()), nullptr, y, stage);
      break;
    case WeightFormat::kInt8:
      rows_kernel_t(x, rows, in_, out_, w_.data_ptr<int8_t>(), scale_.data_ptr<float>(), y, stage);
      break;
  }
}

void ServingLinear::add_bias(at::Tensor& y) const {
  if (bias_.defined()) y.add_(bias_);
}

at::Tensor ServingLinear::forward(const at::Tensor& x, int64_t row_kernel_rows, bool add_bias, Activation act) const {
  return run(x, row_kernel_rows, add_bias, nullptr, act);
}

void ServingLinear::forward_add(const at::Tensor& x, int64_t row_kernel_rows, at::Tensor& residual) const {
  TS_INTERNAL_ASSERT(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 2 &&
                         residual.size(0) == x.size(0) && residual.size(1) == out_,
                     "serving linear: residual must be contiguous fp32 [", x.size(0), ", ", out_, "], got ",
                     residual.sizes());
  run(x, row_kernel_rows, true, residual.data_ptr<float>(), Activation::kNone);
}

at::Tensor ServingLinear::run(const at::Tensor& x_in, int64_t row_kernel_rows, bool with_bias, float* residual,
                              Activation act) const {
  TS_INTERNAL_ASSERT(x_in.dim() == 2 && x_in.size(1) == in_, "serving linear expects [rows, ", in_, "], got ",
                     x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, out_}, x.options());
  const OutputStage stage{with_bias && bias_.defined() ? bias_.data_ptr<float>() : nullptr, residual, act};
  if (amx_) {  // every row, prompt chunks too: see Note [AMX tiles]
    const bool int8 = format_ == WeightFormat::kInt8;
    amx_dot_rows(x.data_ptr<float>(), M, in_, out_, w_, int8 ? scale_.data_ptr<float>() : nullptr,
                 int8 ? sums_.data_ptr<int32_t>() : nullptr, y.data_ptr<float>(), stage);
    return y;
  }
  if (bf16_dot_) {  // every row, prompt chunks too: see Note [bf16 dot products]
    if (format_ == WeightFormat::kQ4_0 || format_ == WeightFormat::kQ4_1) {
      q4_bf16_dot_rows(x.data_ptr<float>(), M, in_, out_, w_.data_ptr<uint8_t>(),
                       reinterpret_cast<const uint16_t*>(q4_d_.data_ptr<int16_t>()),
                       q4_m_.defined() ? reinterpret_cast<const uint16_t*>(q4_m_.data_ptr<int16_t>()) : nullptr,
                       y.data_ptr<float>(), stage);
    } else if (format_ == WeightFormat::kInt8) {
      int8_bf16_dot_rows(x.data_ptr<float>(), M, in_, out_, w_.data_ptr<int8_t>(), scale_.data_ptr<float>(),
                         y.data_ptr<float>(), stage);
    } else {
      bf16_dot_rows(x.data_ptr<float>(), M, in_, out_, reinterpret_cast<const uint16_t*>(w_.data_ptr()),
                    y.data_ptr<float>(), stage);
    }
    return y;
  }
  const int64_t kr = M <= kRowKernelMaxRows ? M : std::min(std::max<int64_t>(row_kernel_rows, 0), M);
  if (kr > 0) rows_kernel(x.data_ptr<float>(), kr, y.data_ptr<float>(), stage);
  if (kr < M) {
    at::Tensor yr = y.narrow(0, kr, M - kr);
    at::mm_out(yr, x.narrow(0, kr, M - kr), dense_weight().t());
    at::parallel_for(0, M - kr, 16, [&](int64_t b, int64_t e) {
      const OutputStage rest{stage.bias, residual ? residual + (kr + b) * out_ : nullptr, act};
      rest.apply(yr.data_ptr<float>() + b * out_, e - b, out_, 0, out_);
    });
  }
  return y;
}

}  // namespace torchspeed::inference
