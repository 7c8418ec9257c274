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

// The software prefetch of the one- and two-row kernels: requests the cache lines of
// [p, p + bytes) (at least one line). The hardware prefetcher alone leaves one or two rows'
// weight streams waiting on memory (Note [bf16 dot products]).
inline void prefetch_lines(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes || b == 0; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

}  // namespace torchspeed::inference::simd
