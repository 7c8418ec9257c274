// Note [bf16 dot products]
// On a CPU with AVX512-BF16, a bf16 weight need not be widened at all: VDPBF16PS multiplies 32
// bf16 pairs and adds them into 16 fp32 lanes in one instruction, twice the multiply-adds of an
// fp32 FMA. The activation row is rounded to bf16 once (round to nearest even, as PyTorch's
// bf16 cast), the products are exact in fp32 and accumulate in fp32, the output stays fp32: the
// only rounding added against the fp32 path is that of each linear's input, the one bf16
// serving applies everywhere (transformers in bf16 also rounds every output and the residual).
// The tiles are those of Note [Serving linear kernels], except that one or two rows go four
// channels at a time (one channel's accumulator is a chain of dependent VDPBF16PS, four run
// side by side) and request the weights about 6 KB ahead; more rows go in 4 x 4 tiles. Every
// (row, channel) is one accumulator over k in order and one reduction, so a row gets the same bits alone, batched, or inside a prompt chunk of any length; prompt
// chunks use the same kernel (it outruns oneDNN's bf16 GEMM with its fp32 output here, see
// `torchspeed bench serve`), so chunking does not change a token either.
// int8 weights (one scale per output channel) go through the same tiles: an integer in
// [-127, 127] is exact in bf16, so widening it to bf16 loses nothing, the product with the
// rounded input is exact in fp32, and the scale multiplies the fp32 sum. The rounding is the
// bf16 path's (the input's), and int8 gets the bf16 rate for every row count instead of fp32
// FMAs for decode rows and a dequantized fp32 GEMM for prompt chunks.
#include "torchspeed/inference/linear_bf16.h"

#include <ATen/Parallel.h>
// GCC 12 warns about the "undefined" vectors inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "torchspeed/inference/blocks.h"
#include "torchspeed/inference/simd.h"

#include <algorithm>
#include <vector>

#include "torchspeed/base/error.h"

namespace torchspeed::inference {

bool have_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
}

namespace {

#define TS_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

// x (fp32, K) -> bf16 padded with zeros to Kp (a multiple of 32), round to nearest even.
TS_BF16 void round_row(const float* x, int64_t K, int64_t Kp, uint16_t* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k))));
  }
  if (k < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1u);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k))));
    k += 16;
  }
  for (; k < Kp; ++k) out[k] = 0;
}

TS_BF16 inline __m512bh load_bh(const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
TS_BF16 inline __m512bh load_bh(const uint16_t* p, __mmask32 m) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p));
}
using simd::int8_to_bh;
TS_BF16 inline __m512bh load_bh(const int8_t* p) { return int8_to_bh(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
TS_BF16 inline __m512bh load_bh(const int8_t* p, __mmask32 m) { return int8_to_bh(_mm256_maskz_loadu_epi8(m, p)); }

// out[r * ldo + j] = dot(x + r * Kp, w + j * K), R rows by J channels, k in steps of 32. The
// rounded rows are zero past K; the weights are masked there (their row stride is K).
// `Ahead` > 0: each step also requests the weights `Ahead` tiles further on (the J channels'
// rows are contiguous, so that is the same offset Ahead * J * K elements on), one step's bytes
// per step. The hardware prefetcher alone leaves one or two rows' streams waiting on memory:
// measured here, the 1-row int8 kernel streams 10 GB/s without and 15 with (bf16 15 -> 19,
// fp32 17 -> 19, the plain read 17-19).
template <int R, int J, class WT, int Ahead = 0>
TS_BF16 void tile(const uint16_t* x, int64_t Kp, int64_t K, const WT* w, float* out, int64_t ldo) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  [[maybe_unused]] const char* ahead = reinterpret_cast<const char*>(w + Ahead * J * K);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if constexpr (Ahead > 0) {
      constexpr int64_t step_bytes = J * 32 * static_cast<int64_t>(sizeof(WT));
      simd::prefetch_lines(ahead + k * J * static_cast<int64_t>(sizeof(WT)), step_bytes);
    }
    __m512bh wv[J];
    for (int j = 0; j < J; ++j) wv[j] = load_bh(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_bh(x + r * Kp + k);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
    __m512bh wv[J];
    for (int j = 0; j < J; ++j) wv[j] = load_bh(w + j * K + k, m);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_bh(x + r * Kp + k);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) out[r * ldo + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

// The 4 x 4 tile with named accumulators (GCC keeps an array of 16 on the stack); the same
// instruction sequence per (row, channel) as `tile`. `Prefetch`: the first group of rows over
// these channels also requests the next 4 channels' weights, one cache line per channel per
// step, so that streaming them from memory overlaps this tile's arithmetic.
template <bool Prefetch>
TS_BF16 void tile_4x4(const uint16_t* x, int64_t Kp, int64_t K, const uint16_t* w, float* out, int64_t ldo) {
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
         a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  auto step = [&](const __m512bh w0, const __m512bh w1, const __m512bh w2, const __m512bh w3, int64_t k) TS_BF16 {
    __m512bh xv = load_bh(x + k);
    a00 = _mm512_dpbf16_ps(a00, xv, w0); a01 = _mm512_dpbf16_ps(a01, xv, w1);
    a02 = _mm512_dpbf16_ps(a02, xv, w2); a03 = _mm512_dpbf16_ps(a03, xv, w3);
    xv = load_bh(x + Kp + k);
    a10 = _mm512_dpbf16_ps(a10, xv, w0); a11 = _mm512_dpbf16_ps(a11, xv, w1);
    a12 = _mm512_dpbf16_ps(a12, xv, w2); a13 = _mm512_dpbf16_ps(a13, xv, w3);
    xv = load_bh(x + 2 * Kp + k);
    a20 = _mm512_dpbf16_ps(a20, xv, w0); a21 = _mm512_dpbf16_ps(a21, xv, w1);
    a22 = _mm512_dpbf16_ps(a22, xv, w2); a23 = _mm512_dpbf16_ps(a23, xv, w3);
    xv = load_bh(x + 3 * Kp + k);
    a30 = _mm512_dpbf16_ps(a30, xv, w0); a31 = _mm512_dpbf16_ps(a31, xv, w1);
    a32 = _mm512_dpbf16_ps(a32, xv, w2); a33 = _mm512_dpbf16_ps(a33, xv, w3);
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if constexpr (Prefetch) {
      for (int j = 4; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k), _MM_HINT_T0);
    }
    step(load_bh(w + k), load_bh(w + K + k), load_bh(w + 2 * K + k), load_bh(w + 3 * K + k), k);
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
    step(load_bh(w + k, m), load_bh(w + K + k, m), load_bh(w + 2 * K + k, m), load_bh(w + 3 * K + k, m), k);
  }
  simd::store_4x4(out, ldo, a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33);
}

template <int J>
TS_BF16 void rows_over(const uint16_t* x, int64_t rows, int64_t Kp, int64_t K, const uint16_t* w, float* y, int64_t N) {
  int64_t m0 = 0;
  for (; m0 + 4 <= rows; m0 += 4) {
    if constexpr (J == 4) {
      if (m0 == 0) tile_4x4<true>(x + m0 * Kp, Kp, K, w, y + m0 * N, N);
      else tile_4x4<false>(x + m0 * Kp, Kp, K, w, y + m0 * N, N);
    }
    else tile<4, J>(x + m0 * Kp, Kp, K, w, y + m0 * N, N);
  }
  switch (rows - m0) {
    case 3: tile<3, J>(x + m0 * Kp, Kp, K, w, y + m0 * N, N); break;
    case 2: tile<2, J>(x + m0 * Kp, Kp, K, w, y + m0 * N, N); break;
    case 1: tile<1, J>(x + m0 * Kp, Kp, K, w, y + m0 * N, N); break;
    default: break;
  }
}

// Rows in groups whose rounded activations stay in L2 beside a block of weights.
constexpr int64_t kRowGroup = 64;

// One or two rows (the weight bytes bound the time), four channels at a time: one channel's
// accumulator is a chain of dependent VDPBF16PS (K / 32 of them, each waiting for the last),
// four channels run four chains side by side. Each (row, channel) keeps its own accumulator
// and instruction sequence, so its bits are those of a single-channel tile.
template <class WT>
TS_BF16 void few_rows(const uint16_t* xb, int64_t rows, int64_t Kp, int64_t K, const WT* w, int64_t o0, int64_t o1,
                      float* y, int64_t N) {
  // int8 rows are half as long in bytes as bf16 ones: request two tiles ahead for about the
  // same distance (6 KB at K 768).
  constexpr int kAhead = sizeof(WT) == 1 ? 2 : 1;
  int64_t o = o0;
  for (; o + 4 <= o1; o += 4) {
    if (rows == 2) tile<2, 4, WT, kAhead>(xb, Kp, K, w + o * K, y + o, N);
    else tile<1, 4, WT, kAhead>(xb, Kp, K, w + o * K, y + o, N);
  }
  for (; o < o1; ++o) {
    if (rows == 2) tile<2, 1>(xb, Kp, K, w + o * K, y + o, N);
    else tile<1, 1>(xb, Kp, K, w + o * K, y + o, N);
  }
}

TS_BF16 void block(const uint16_t* xb, int64_t rows, int64_t Kp, int64_t K, const uint16_t* w, int64_t o0, int64_t o1,
                   float* y, int64_t N) {
  if (rows <= 2) return few_rows(xb, rows, Kp, K, w, o0, o1, y, N);
  for (int64_t g = 0; g < rows; g += kRowGroup) {
    const int64_t gr = std::min(kRowGroup, rows - g);
    int64_t o = o0;
    for (; o + 4 <= o1; o += 4) rows_over<4>(xb + g * Kp, gr, Kp, K, w + o * K, y + g * N + o, N);
    for (; o < o1; ++o) rows_over<1>(xb + g * Kp, gr, Kp, K, w + o * K, y + g * N + o, N);
  }
}

// int8 weights: one or two rows widen them inside the tile (the weight bytes bound the time);
// more rows widen each group of 4 channels once into bf16 (exact), then run the bf16 tiles
// over it while it sits in L1. Both give every (row, channel) the same bf16 operands and the
// same instruction sequence, so a row's bits do not depend on the row count; the per-channel
// scale multiplies the fp32 sum.
TS_BF16 void block_int8(const uint16_t* xb, int64_t rows, int64_t Kp, int64_t K, const int8_t* w, const float* scale,
                        int64_t o0, int64_t o1, float* y, int64_t N, std::vector<uint16_t>& wb) {
  if (rows <= 2) {
    few_rows(xb, rows, Kp, K, w, o0, o1, y, N);
  } else {
    wb.resize(static_cast<size_t>(4 * Kp));
    for (int64_t o = o0; o < o1;) {
      const int64_t J = o + 4 <= o1 ? 4 : 1;
      for (int64_t j = 0; j < J; ++j) {
        const int8_t* src = w + (o + j) * K;
        uint16_t* dst = wb.data() + j * K;
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) _mm512_storeu_si512(dst + k, reinterpret_cast<__m512i>(load_bh(src + k)));
        if (k < K) {
          const __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
          _mm512_mask_storeu_epi16(dst + k, m, reinterpret_cast<__m512i>(load_bh(src + k, m)));
        }
      }
      for (int64_t g = 0; g < rows; g += kRowGroup) {
        const int64_t gr = std::min(kRowGroup, rows - g);
        if (J == 4) rows_over<4>(xb + g * Kp, gr, Kp, K, wb.data(), y + g * N + o, N);
        else rows_over<1>(xb + g * Kp, gr, Kp, K, wb.data(), y + g * N + o, N);
      }
      o += J;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = o0; o < o1; ++o) y[r * N + o] *= scale[o];
  }
}

}  // namespace

void round_rows_bf16(const float* x, int64_t rows, int64_t K, int64_t Kp, uint16_t* out) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) round_row(x + r * K, K, Kp, out + r * Kp);
  });
}

namespace {
// Rounds each row to bf16 once (zero-padded to a multiple of 32), then hands the threads blocks
// of output channels (`channel_block`) as they ask for them (`dynamic_blocks`):
// run(xb, Kp, o0, o1).
template <class F>
void over_channel_blocks(const float* x, int64_t rows, int64_t K, int64_t N, const F& run, int64_t align = 32) {
  TS_INTERNAL_ASSERT(have_bf16_dot(), "bf16 dot products need AVX512-BF16");
  if (rows <= 0 || N <= 0) return;  // (a step whose prompt chunks want no logits has no head rows)
  const int64_t Kp = (K + align - 1) / align * align;
  std::vector<uint16_t> xb(static_cast<size_t>(rows * Kp));
  round_rows_bf16(x, rows, K, Kp, xb.data());
  const int64_t blk = channel_block(rows);
  dynamic_blocks((N + blk - 1) / blk, [&](int64_t b) { run(xb.data(), Kp, b * blk, std::min(N, (b + 1) * blk)); });
}
}  // namespace

void bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const uint16_t* w, float* y,
                   const OutputStage& stage) {
  over_channel_blocks(x, rows, K, N, [&](const uint16_t* xb, int64_t Kp, int64_t o0, int64_t o1) {
    block(xb, rows, Kp, K, w, o0, o1, y, N);
    stage.apply(y, rows, N, o0, o1);
  });
}

void int8_bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const int8_t* w, const float* scale, float* y,
                        const OutputStage& stage) {
  over_channel_blocks(x, rows, K, N, [&](const uint16_t* xb, int64_t Kp, int64_t o0, int64_t o1) {
    thread_local std::vector<uint16_t> wb;  // this thread's widened weights
    block_int8(xb, rows, Kp, K, w, scale, o0, o1, y, N, wb);
    stage.apply(y, rows, N, o0, o1);
  });
}

namespace {

// Note [4-bit weights]
// Q4_0 and Q4_1 weights (ggml's: groups of 32 along k, an fp16 scale d per group and for Q4_1 an
// fp16 minimum m, values d (q - 8) or d q + m for q in [0, 15]; quantize_q4 in linear.cpp) are
// multiplied as bf16: each weight's value is bf16(d (q - 8)) (the product is exact in fp32: 11
// significant bits times 4) or bf16(d q + m) (one fp32 rounding, of the add), and a step of 64 k
// builds it in registers from 32 bytes of nibbles with one table lookup per 32 (VPERMW over the
// 16 values of each group, made from d and m by one multiply or FMA and one conversion). Two groups share 32 bytes: byte j holds k = j of the first
// group in its low nibble and k = j of the second in its high one, so one zero-extension gives
// both groups' indices. One or two rows multiply the weights as they are built (4.5 bits a
// weight read per token instead of bf16's 16); more rows build 4 channels' bf16 rows once into
// a scratch row and run the bf16 tiles over it. Both give each (row, channel) the same bf16
// operands in the same order as `tile` over the built rows, so a row's bits do not depend on
// the batch.
// `m`: the groups' minimums (Q4_1), or null (Q4_0).
TS_BF16 inline void q4_pair(const uint8_t* qs, const uint16_t* d, const uint16_t* m, __m512bh& lo, __m512bh& hi) {
  const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
  const __m512i ilo = _mm512_and_si512(w16, _mm512_set1_epi16(0x0F));
  const __m512i ihi = _mm512_or_si512(_mm512_srli_epi16(w16, 4), _mm512_set1_epi16(0x10));
  __m512 t0, t1;
  if (m == nullptr) {
    const __m512 qm8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    t0 = _mm512_mul_ps(qm8, _mm512_set1_ps(_cvtsh_ss(d[0])));
    t1 = _mm512_mul_ps(qm8, _mm512_set1_ps(_cvtsh_ss(d[1])));
  } else {  // d q is exact, so the FMA rounds as d * q + m does
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    t0 = _mm512_fmadd_ps(q, _mm512_set1_ps(_cvtsh_ss(d[0])), _mm512_set1_ps(_cvtsh_ss(m[0])));
    t1 = _mm512_fmadd_ps(q, _mm512_set1_ps(_cvtsh_ss(d[1])), _mm512_set1_ps(_cvtsh_ss(m[1])));
  }
  const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(t1, t0));  // group 0 in lanes 0-15
  lo = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(ilo, table));
  hi = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(ihi, table));
}

// The R rows (1 or 2) of xb [R, Kp] against J channels of Q4_0 weights, each built in registers.
template <int R, int J>
TS_BF16 void q4_tile(const uint16_t* xb, int64_t Kp, const uint8_t* qs, const uint16_t* d, const uint16_t* m, float* out,
                     int64_t ldo) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const int64_t qrow = Kp / 2, drow = Kp / 32;
  for (int64_t k = 0; k < Kp; k += 64) {
    // The next J channels' nibbles at the same k: their stream overlaps this tile's arithmetic.
    for (int j = 0; j < J; ++j) _mm_prefetch(reinterpret_cast<const char*>(qs + (J + j) * qrow + k / 2), _MM_HINT_T0);
    __m512bh lo[J], hi[J];
    for (int j = 0; j < J; ++j) {
      q4_pair(qs + j * qrow + k / 2, d + j * drow + k / 32, m ? m + j * drow + k / 32 : nullptr, lo[j], hi[j]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh x0 = load_bh(xb + r * Kp + k), x1 = load_bh(xb + r * Kp + k + 32);
      for (int j = 0; j < J; ++j) {
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x0, lo[j]);
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x1, hi[j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) out[r * ldo + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

TS_BF16 void q4_build_row(const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t Kp, uint16_t* out) {
  for (int64_t k = 0; k < Kp; k += 64) {
    __m512bh lo, hi;
    q4_pair(qs + k / 2, d + k / 32, m ? m + k / 32 : nullptr, lo, hi);
    _mm512_storeu_si512(out + k, reinterpret_cast<__m512i>(lo));
    _mm512_storeu_si512(out + k + 32, reinterpret_cast<__m512i>(hi));
  }
}

TS_BF16 void block_q4(const uint16_t* xb, int64_t rows, int64_t Kp, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                      int64_t o0, int64_t o1, float* y, int64_t N, std::vector<uint16_t>& wb) {
  const int64_t qrow = Kp / 2, drow = Kp / 32;
  auto mins = [&](int64_t o) { return m ? m + o * drow : nullptr; };
  if (rows <= 2) {
    int64_t o = o0;
    for (; o + 4 <= o1; o += 4) {
      if (rows == 2) q4_tile<2, 4>(xb, Kp, qs + o * qrow, d + o * drow, mins(o), y + o, N);
      else q4_tile<1, 4>(xb, Kp, qs + o * qrow, d + o * drow, mins(o), y + o, N);
    }
    for (; o < o1; ++o) {
      if (rows == 2) q4_tile<2, 1>(xb, Kp, qs + o * qrow, d + o * drow, mins(o), y + o, N);
      else q4_tile<1, 1>(xb, Kp, qs + o * qrow, d + o * drow, mins(o), y + o, N);
    }
    return;
  }
  wb.resize(static_cast<size_t>(4 * Kp));
  for (int64_t o = o0; o < o1;) {
    const int64_t J = o + 4 <= o1 ? 4 : 1;
    for (int64_t j = 0; j < J; ++j) q4_build_row(qs + (o + j) * qrow, d + (o + j) * drow, mins(o + j), Kp, wb.data() + j * Kp);
    for (int64_t g = 0; g < rows; g += kRowGroup) {
      const int64_t gr = std::min(kRowGroup, rows - g);
      if (J == 4) rows_over<4>(xb + g * Kp, gr, Kp, Kp, wb.data(), y + g * N + o, N);
      else rows_over<1>(xb + g * Kp, gr, Kp, Kp, wb.data(), y + g * N + o, N);
    }
    o += J;
  }
}

}  // namespace

void q4_bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const uint8_t* qs, const uint16_t* d,
                      const uint16_t* m, float* y, const OutputStage& stage) {
  over_channel_blocks(
      x, rows, K, N,
      [&](const uint16_t* xb, int64_t Kp, int64_t o0, int64_t o1) {
        thread_local std::vector<uint16_t> wb;  // this thread's built weights
        block_q4(xb, rows, Kp, qs, d, m, o0, o1, y, N, wb);
        stage.apply(y, rows, N, o0, o1);
      },
      kQ4Align);
}

}  // namespace torchspeed::inference
