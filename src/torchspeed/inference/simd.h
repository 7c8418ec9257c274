// Small pieces the serving kernels share (internal: included by inference/*.cpp only, after
// <immintrin.h>).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace torchspeed::inference::simd {

// One stored element as fp32: fp32 as is, bf16 bits shifted into the high half, int8 converted.
inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float widen(int8_t v) { return static_cast<float>(v); }

// The 16 accumulators of a 4 x 4 tile, each reduced to its (row, channel) output.
__attribute__((target("avx512f"))) inline void store_4x4(float* out, int64_t ldo, __m512 a00, __m512 a01, __m512 a02,
                                                          __m512 a03, __m512 a10, __m512 a11, __m512 a12, __m512 a13,
                                                          __m512 a20, __m512 a21, __m512 a22, __m512 a23, __m512 a30,
                                                          __m512 a31, __m512 a32, __m512 a33) {
  const __m512 a[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}, {a30, a31, a32, a33}};
  for (int r = 0; r < 4; ++r) {
    for (int j = 0; j < 4; ++j) out[r * ldo + j] = _mm512_reduce_add_ps(a[r][j]);
  }
}

// 32 int8 weights as bf16: every integer in [-127, 127] is exact in bf16's 8-bit significand.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512bh int8_to_bh(__m256i b) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lo in lanes 0-15, hi in 16-31: the order of k
}

// e^x for x <= 0, 16 lanes: x = n ln2 + f with |f| <= ln2 / 2 (ln2 split in two for an exact
// n ln2), e^f by its degree-6 Taylor polynomial (relative error under 2e-7), times 2^n by
// scalef, which also takes lanes below e^-87 to zero.
__attribute__((target("avx512f"))) inline __m512 exp_le0(__m512 x) {
  // Below -104 the result is 0 anyway; clamping keeps n small enough for f to stay exact (and
  // -inf from becoming NaN). max_ps returns its second operand, x, when x is NaN.
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The software prefetch of the one- and two-row kernels: requests the cache lines of
// [p, p + bytes) (at least one line). The hardware prefetcher alone leaves one or two rows'
// weight streams waiting on memory (Note [bf16 dot products]).
inline void prefetch_lines(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes || b == 0; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

}  // namespace torchspeed::inference::simd
