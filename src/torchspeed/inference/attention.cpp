#include "torchspeed/inference/attention.h"

#include <ATen/Parallel.h>
// GCC 12 warns about the "undefined" vectors inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "torchspeed/inference/simd.h"
#include "torchspeed/base/error.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace torchspeed::inference {

namespace {
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// A cached key or value row in 64-byte chunks, widened to fp32 in registers. bf16: a chunk is 32
// elements; its even elements are the low halves of its 32-bit words shifted up, its odd ones
// the high halves masked, one ALU operation each and no shuffle (the query and the output are
// split the same way). fp32: a chunk is 16 elements, loaded as is.
template <class KT>
struct Chunks;
template <>
struct Chunks<float> {
  static constexpr int kElems = 16, kParts = 1;
  TS_AVX512 static void load(const float* p, __m512* v) { v[0] = _mm512_loadu_ps(p); }
  TS_AVX512 static void split(const float* x, __m512* v) { v[0] = _mm512_loadu_ps(x); }
  TS_AVX512 static void join(const __m512* v, float* out) { _mm512_storeu_ps(out, v[0]); }
};
template <>
struct Chunks<uint16_t> {
  static constexpr int kElems = 32, kParts = 2;
  TS_AVX512 static void load(const uint16_t* p, __m512* v) {
    const __m512i r = _mm512_loadu_si512(p);
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
    v[1] = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // 32 fp32 elements -> (even, odd)
  TS_AVX512 static void split(const float* x, __m512* v) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    v[0] = _mm512_permutex2var_ps(a, even, b);
    v[1] = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
  }
  // (even, odd) -> 32 fp32 elements in order
  TS_AVX512 static void join(const __m512* v, float* out) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(v[0], lo, v[1]));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(v[0], _mm512_add_epi32(lo, _mm512_set1_epi32(8)), v[1]));
  }
};

// int8 rows (their scale applied to the score and the value's weight, not here): 16 elements per
// chunk, converted in order.
template <>
struct Chunks<int8_t> {
  static constexpr int kElems = 16, kParts = 1;
  TS_AVX512 static void load(const int8_t* p, __m512* v) {
    v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  TS_AVX512 static void split(const float* x, __m512* v) { v[0] = _mm512_loadu_ps(x); }
  TS_AVX512 static void join(const __m512* v, float* out) { _mm512_storeu_ps(out, v[0]); }
};

// bf16 rows whose head_dim is an odd multiple of 16: 16 elements per chunk, widened in order.
struct Bf16Chunks16 {
  static constexpr int kElems = 16, kParts = 1;
  TS_AVX512 static void load(const uint16_t* p, __m512* v) {
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  TS_AVX512 static void split(const float* x, __m512* v) { v[0] = _mm512_loadu_ps(x); }
  TS_AVX512 static void join(const __m512* v, float* out) { _mm512_storeu_ps(out, v[0]); }
};

// The sums of 16 vectors' lanes, one per lane: v[i] must hold key kSlot[i]'s products, so lane m
// of the result is key m's score (a fixed tree of adds: the same bits for a key wherever it is).
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
TS_AVX512 inline __m512 reduce16(const __m512* v) {
  __m512 r[8], s[4];
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD));
  }
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(s[0], s[2]), _mm512_unpackhi_ps(s[0], s[2]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(s[1], s[3]), _mm512_unpackhi_ps(s[1], s[3]));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
}

// One (sequence, head), NC chunks (C) of head_dim. Scores 16 keys at a time: each key's products
// in one vector (one FMA chain over the chunks), the 16 vectors summed lane-wise by one tree
// (reduce16) instead of a reduction each; softmax 16 scores at a time; then the weighted sum of
// values with two sets of accumulators (even and odd positions, added at the end) so that the
// FMA latency does not bound it. head_dim is a template parameter so that the accumulators can
// live in registers (up to head_dim 128; beyond, the compiler spills some).
// int8 rows (KT int8_t): ks / vs hold each slot's scale at slots[j] * srow (the row's KV head
// already added); a key's 16-score group is multiplied by its keys' scales, a value's weight by
// its scale.
template <class KT, class C, int NC>
TS_AVX512 void head_avx512(const float* q, const KT* keys, const KT* values, const int64_t* slots, int64_t L,
                           int64_t row, float scale, float* p, float* o, const float* ks, const float* vs, int64_t srow) {
  constexpr bool kInt8 = std::is_same_v<KT, int8_t>;
  constexpr int P = C::kParts, E = C::kElems;
  __m512 qv[NC][P];
  for (int c = 0; c < NC; ++c) {
    C::split(q + E * c, qv[c]);
    for (int k = 0; k < P; ++k) qv[c][k] = _mm512_mul_ps(qv[c][k], _mm512_set1_ps(scale));
  }
  // Cache lines of the key (then value) rows this many positions ahead are requested early:
  // the rows are scattered over the cache's blocks, where the hardware prefetcher loses track.
  constexpr int64_t ahead = 16;
  constexpr int64_t lines = (E * NC * static_cast<int64_t>(sizeof(KT)) + 63) / 64;
  auto prefetch = [&](const KT* base, int64_t j) {
    if (j < L) {
      const char* r = reinterpret_cast<const char*>(base + slots[j] * row);
      for (int64_t c = 0; c < lines; ++c) _mm_prefetch(r + 64 * c, _MM_HINT_T0);
    }
  };
  for (int64_t j = 0; j < std::min(ahead, L); ++j) prefetch(keys, j);
  alignas(64) __m512 acc[16];
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    for (int m = 0; m < 16; ++m) {
      const int64_t j = j0 + m;
      if (j >= L) {
        acc[kSlot[m]] = _mm512_setzero_ps();
        continue;
      }
      prefetch(keys, j + ahead);
      const KT* k = keys + slots[j] * row;
      __m512 kv[P];
      C::load(k, kv);
      __m512 a = _mm512_mul_ps(qv[0][0], kv[0]);
      for (int x = 1; x < P; ++x) a = _mm512_fmadd_ps(qv[0][x], kv[x], a);
      for (int c = 1; c < NC; ++c) {
        C::load(k + E * c, kv);
        for (int x = 0; x < P; ++x) a = _mm512_fmadd_ps(qv[c][x], kv[x], a);
      }
      acc[kSlot[m]] = a;
    }
    const __mmask16 m = L - j0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - j0)) - 1u);
    if constexpr (kInt8) {
      alignas(64) float sc[16] = {};
      for (int64_t i = 0; i < std::min<int64_t>(16, L - j0); ++i) sc[i] = ks[slots[j0 + i] * srow];
      _mm512_mask_storeu_ps(p + j0, m, _mm512_mul_ps(reduce16(acc), _mm512_load_ps(sc)));
    } else {
      _mm512_mask_storeu_ps(p + j0, m, reduce16(acc));
    }
  }
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < L; j += 16) {
    const __mmask16 m = L - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - j)) - 1u);
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, p + j));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sv = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; j += 16) {
    const __mmask16 m = L - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - j)) - 1u);
    const __m512 e = simd::exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), mx));
    _mm512_mask_storeu_ps(p + j, m, e);
    sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(m, e));
  }
  for (int64_t j = 0; j < std::min(ahead, L); ++j) prefetch(values, j);
  const float inv = 1.0f / _mm512_reduce_add_ps(sv);
  __m512 o0[NC][P], o1[NC][P];
  for (int c = 0; c < NC; ++c) {
    for (int x = 0; x < P; ++x) o0[c][x] = o1[c][x] = _mm512_setzero_ps();
  }
  auto accumulate = [&](int64_t j, __m512(&ov)[NC][P]) TS_AVX512 {
    prefetch(values, j + ahead);
    const KT* v = values + slots[j] * row;
    const __m512 w = _mm512_set1_ps(kInt8 ? p[j] * inv * vs[slots[j] * srow] : p[j] * inv);
    for (int c = 0; c < NC; ++c) {
      __m512 vv[P];
      C::load(v + E * c, vv);
      for (int x = 0; x < P; ++x) ov[c][x] = _mm512_fmadd_ps(w, vv[x], ov[c][x]);
    }
  };
  int64_t j = 0;
  for (; j + 2 <= L; j += 2) {
    accumulate(j, o0);
    accumulate(j + 1, o1);
  }
  if (j < L) accumulate(j, o0);
  for (int c = 0; c < NC; ++c) {
    for (int x = 0; x < P; ++x) o0[c][x] = _mm512_add_ps(o0[c][x], o1[c][x]);
    C::join(o0[c], o + E * c);
  }
}

// head_avx512 for this head_dim with chunks C (NC up to 16), or false.
template <class KT, class C>
TS_AVX512 bool head_dispatch_c(int64_t nc, const float* q, const KT* keys, const KT* values, const int64_t* slots,
                               int64_t L, int64_t row, float scale, float* p, float* o, const float* ks, const float* vs,
                               int64_t srow) {
  switch (nc) {
#define TS_HEAD_CASE(n) \
  case n: head_avx512<KT, C, n>(q, keys, values, slots, L, row, scale, p, o, ks, vs, srow); return true;
    TS_HEAD_CASE(1) TS_HEAD_CASE(2) TS_HEAD_CASE(3) TS_HEAD_CASE(4) TS_HEAD_CASE(5) TS_HEAD_CASE(6) TS_HEAD_CASE(7)
    TS_HEAD_CASE(8) TS_HEAD_CASE(9) TS_HEAD_CASE(10) TS_HEAD_CASE(11) TS_HEAD_CASE(12) TS_HEAD_CASE(13)
    TS_HEAD_CASE(14) TS_HEAD_CASE(15) TS_HEAD_CASE(16)
#undef TS_HEAD_CASE
    default: return false;
  }
}

// head_dim a multiple of 16 up to 256: fp32 in chunks of 16; bf16 in chunks of 32 (even/odd
// halves), or of 16 when head_dim is an odd multiple of 16. Otherwise false.
template <class KT>
TS_AVX512 bool head_dispatch(int64_t hd, const float* q, const KT* keys, const KT* values, const int64_t* slots,
                             int64_t L, int64_t row, float scale, float* p, float* o, const float* ks, const float* vs,
                             int64_t srow) {
  if (hd % 16 != 0 || hd > 256) return false;
  if constexpr (std::is_same_v<KT, float> || std::is_same_v<KT, int8_t>) {
    return head_dispatch_c<KT, Chunks<KT>>(hd / 16, q, keys, values, slots, L, row, scale, p, o, ks, vs, srow);
  } else if (hd % 32 == 0) {
    return head_dispatch_c<KT, Chunks<uint16_t>>(hd / 32, q, keys, values, slots, L, row, scale, p, o, ks, vs, srow);
  } else {
    return head_dispatch_c<KT, Bf16Chunks16>(hd / 16, q, keys, values, slots, L, row, scale, p, o, ks, vs, srow);
  }
}

using simd::widen;

template <class KT>
void decode_attention_t(const DecodeAttentionItem* items, int64_t n_items, const KT* keys, const KT* values,
                        int64_t heads, int64_t kv_heads, int64_t hd, float scale, const float* key_scales = nullptr,
                        const float* value_scales = nullptr) {
  constexpr bool kInt8 = std::is_same_v<KT, int8_t>;
  const int64_t tasks = n_items * heads;
  const int64_t row = kv_heads * hd, group = heads / kv_heads;
  at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> p;
    for (int64_t t = b; t < e; ++t) {
      const DecodeAttentionItem& it = items[t / heads];
      const int64_t h = t % heads;
      const int64_t kvh = h / group;  // grouped-query attention: the query group's KV head
      const float* q = it.q + h * hd;
      p.resize(static_cast<size_t>(it.length));
      const float* ks = kInt8 ? key_scales + kvh : nullptr;
      const float* vs = kInt8 ? value_scales + kvh : nullptr;
      if (have_avx512() && head_dispatch<KT>(hd, q, keys + kvh * hd, values + kvh * hd, it.slots, it.length, row, scale,
                                             p.data(), it.out + h * hd, ks, vs, kv_heads)) {
        continue;
      }
      float mx = -INFINITY;
      for (int64_t j = 0; j < it.length; ++j) {
        const KT* k = keys + it.slots[j] * row + kvh * hd;
        float s = 0.0f;
        for (int64_t c = 0; c < hd; ++c) s += q[c] * widen(k[c]);
        if constexpr (kInt8) s *= ks[it.slots[j] * kv_heads];
        s *= scale;
        p[static_cast<size_t>(j)] = s;
        mx = std::max(mx, s);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < it.length; ++j) {
        const float ex = std::exp(p[static_cast<size_t>(j)] - mx);
        p[static_cast<size_t>(j)] = ex;
        sum += ex;
      }
      float* o = it.out + h * hd;
      for (int64_t c = 0; c < hd; ++c) o[c] = 0.0f;
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < it.length; ++j) {
        const float w = kInt8 ? p[static_cast<size_t>(j)] * inv * vs[it.slots[j] * kv_heads] : p[static_cast<size_t>(j)] * inv;
        const KT* v = values + it.slots[j] * row + kvh * hd;
        for (int64_t c = 0; c < hd; ++c) o[c] += w * widen(v[c]);
      }
    }
  });
}
}  // namespace

void decode_attention(const DecodeAttentionItem* items, int64_t n_items, const void* keys, const void* values,
                      KVType type, int64_t heads, int64_t kv_heads, int64_t hd, float scale, const float* key_scales,
                      const float* value_scales) {
  switch (type) {
    case KVType::kFP32:
      decode_attention_t(items, n_items, static_cast<const float*>(keys), static_cast<const float*>(values), heads,
                         kv_heads, hd, scale);
      break;
    case KVType::kBF16:
      decode_attention_t(items, n_items, static_cast<const uint16_t*>(keys), static_cast<const uint16_t*>(values), heads,
                         kv_heads, hd, scale);
      break;
    case KVType::kInt8:
      TS_INTERNAL_ASSERT(key_scales && value_scales, "decode_attention: an int8 cache needs its scales");
      decode_attention_t(items, n_items, static_cast<const int8_t*>(keys), static_cast<const int8_t*>(values), heads,
                         kv_heads, hd, scale, key_scales, value_scales);
      break;
  }
}

}  // namespace torchspeed::inference
