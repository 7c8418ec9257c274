// SIMD reduction kernels. The AVX-512 paths are chosen at run time (target attributes, so the
// library still runs on CPUs without AVX-512); bf16 rounding is round-to-nearest-even with
// NaN -> 0x7FC0, bit-identical to c10::BFloat16's conversion, and fp16 uses the hardware's
// IEEE conversion, identical to c10::Half's.
#include "torchspeed/comm/detail/reduce_kernels.h"

// GCC 12 warns falsely inside its own AVX-512 intrinsic headers (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "torchspeed/base/error.h"

namespace torchspeed::comm::detail {
namespace {

// max/min propagate NaN (as at::maximum does): a NaN gradient must not vanish in a reduction.
template <typename T, typename Acc>
Acc combine(ReduceOp op, Acc a, Acc b) {
  switch (op) {
    case ReduceOp::kMax: return (a != a || b != b) ? a + b : (a < b ? b : a);
    case ReduceOp::kMin: return (a != a || b != b) ? a + b : (b < a ? b : a);
    default: return a + b;
  }
}

// Generic path: T loaded as Acc, reduced, stored once.
template <typename T, typename Acc>
void reduce_generic(ReduceOp op, const void* const* pieces_v, int p, int64_t n, void* out_v,
                    int64_t begin = 0) {
  const T* const* pieces = reinterpret_cast<const T* const*>(pieces_v);
  T* out = static_cast<T*>(out_v);
  for (int64_t i = begin; i < n; ++i) {
    Acc acc = static_cast<Acc>(pieces[0][i]);
    for (int j = 1; j < p; ++j) acc = combine<T, Acc>(op, acc, static_cast<Acc>(pieces[j][i]));
    if (op == ReduceOp::kAvg) acc = acc / static_cast<Acc>(p);
    out[i] = static_cast<T>(acc);
  }
}

bool has_avx512() {
  static const bool v = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return v;
}

__attribute__((target("avx512f"))) inline __m512 vcombine(ReduceOp op, __m512 a, __m512 b) {
  if (op != ReduceOp::kMax && op != ReduceOp::kMin) return _mm512_add_ps(a, b);
  __m512 r = op == ReduceOp::kMax ? _mm512_max_ps(a, b) : _mm512_min_ps(a, b);
  // _mm512_max_ps drops a NaN in its first operand; propagate it like the scalar path.
  return _mm512_mask_add_ps(r, _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), a, b);
}

__attribute__((target("avx512f"))) inline __m512 load_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx512f"))) inline void store_bf16(uint16_t* p, __m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

__attribute__((target("avx512f"))) inline __m512 load_fp16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

__attribute__((target("avx512f"))) inline void store_fp16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <bool kBf16>
__attribute__((target("avx512f"))) void reduce_half_avx512(ReduceOp op, const void* const* pv,
                                                           int p, int64_t n, void* out_v) {
  const uint16_t* const* pieces = reinterpret_cast<const uint16_t* const*>(pv);
  uint16_t* out = static_cast<uint16_t*>(out_v);
  const __m512 divisor = _mm512_set1_ps(static_cast<float>(p));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 acc = kBf16 ? load_bf16(pieces[0] + i) : load_fp16(pieces[0] + i);
    for (int j = 1; j < p; ++j) {
      const uint16_t* src = pieces[j] + i;
      acc = vcombine(op, acc, kBf16 ? load_bf16(src) : load_fp16(src));
    }
    if (op == ReduceOp::kAvg) acc = _mm512_div_ps(acc, divisor);
    if (kBf16) store_bf16(out + i, acc); else store_fp16(out + i, acc);
  }
  if (kBf16) {
    reduce_generic<c10::BFloat16, float>(op, pv, p, n, out_v, i);
  } else {
    reduce_generic<c10::Half, float>(op, pv, p, n, out_v, i);
  }
}

__attribute__((target("avx512f"))) void reduce_f32_avx512(ReduceOp op, const void* const* pv,
                                                          int p, int64_t n, void* out_v) {
  const float* const* pieces = reinterpret_cast<const float* const*>(pv);
  float* out = static_cast<float*>(out_v);
  const __m512 divisor = _mm512_set1_ps(static_cast<float>(p));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 acc = _mm512_loadu_ps(pieces[0] + i);
    for (int j = 1; j < p; ++j) acc = vcombine(op, acc, _mm512_loadu_ps(pieces[j] + i));
    if (op == ReduceOp::kAvg) acc = _mm512_div_ps(acc, divisor);
    _mm512_storeu_ps(out + i, acc);
  }
  reduce_generic<float, float>(op, pv, p, n, out_v, i);
}

template <typename T>
void divide_generic(T* data, int64_t n, int divisor) {
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(static_cast<float>(data[i]) / divisor);
}

}  // namespace

void reduce_pieces(at::ScalarType dtype, ReduceOp op, const void* const* pieces, int p,
                   int64_t n, void* out) {
  switch (dtype) {
    case at::kBFloat16:
      if (has_avx512()) return reduce_half_avx512<true>(op, pieces, p, n, out);
      return reduce_generic<c10::BFloat16, float>(op, pieces, p, n, out);
    case at::kHalf:
      if (has_avx512()) return reduce_half_avx512<false>(op, pieces, p, n, out);
      return reduce_generic<c10::Half, float>(op, pieces, p, n, out);
    case at::kFloat:
      if (has_avx512()) return reduce_f32_avx512(op, pieces, p, n, out);
      return reduce_generic<float, float>(op, pieces, p, n, out);
    case at::kDouble: return reduce_generic<double, double>(op, pieces, p, n, out);
    case at::kInt: return reduce_generic<int32_t, int32_t>(op, pieces, p, n, out);
    case at::kLong: return reduce_generic<int64_t, int64_t>(op, pieces, p, n, out);
    case at::kByte: return reduce_generic<uint8_t, uint32_t>(op, pieces, p, n, out);
    default: TS_INTERNAL_ASSERT(false, "reduce_pieces: unsupported dtype ", dtype);
  }
}

void divide_inplace(at::ScalarType dtype, void* data, int64_t n, int divisor) {
  switch (dtype) {
    case at::kFloat: {
      float* d = static_cast<float*>(data);
      const float f = static_cast<float>(divisor);
      for (int64_t i = 0; i < n; ++i) d[i] /= f;
      return;
    }
    case at::kDouble: {
      double* d = static_cast<double*>(data);
      for (int64_t i = 0; i < n; ++i) d[i] /= divisor;
      return;
    }
    case at::kBFloat16: return divide_generic(static_cast<c10::BFloat16*>(data), n, divisor);
    case at::kHalf: return divide_generic(static_cast<c10::Half*>(data), n, divisor);
    default: TS_INTERNAL_ASSERT(false, "divide_inplace: unsupported dtype ", dtype);
  }
}

}  // namespace torchspeed::comm::detail
