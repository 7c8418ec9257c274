#include "torchspeed/inference/attention.h"

#include <ATen/Parallel.h>
// GCC 12 warns about the "undefined" vectors inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "torchspeed/inference/simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace torchspeed::inference {

namespace {
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

TS_AVX512 inline __m512 load_kv(const float* p) { return _mm512_loadu_ps(p); }
TS_AVX512 inline __m512 load_kv(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// e^x for x <= 0, 16 lanes: x = n ln2 + f with |f| <= ln2 / 2 (ln2 split in two for an exact
// n ln2), e^f by its degree-6 Taylor polynomial (relative error under 2e-7), times 2^n by
// scalef, which also takes lanes below e^-87 to zero.
TS_AVX512 inline __m512 exp_le0(__m512 x) {
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

// One (sequence, head) with head_dim a multiple of 16. Scores four keys at a time (four
// independent FMA chains, one reduction each), softmax 16 scores at a time, then the weighted
// sum of values 16 lanes at a time. Keys and values are fp32 or bf16 (widened in registers).
template <class KT>
TS_AVX512 void head_avx512(const float* q, const KT* keys, const KT* values, const int64_t* slots, int64_t L,
                           int64_t row, int64_t hd, float scale, float* p, float* o) {
  __m512 qv[16];  // head_dim <= 256
  const int64_t nv = hd / 16;
  for (int64_t c = 0; c < nv; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
  // Cache lines of the key (then value) rows this many positions ahead are requested early:
  // the rows are scattered over the cache's blocks, where the hardware prefetcher loses track.
  constexpr int64_t ahead = 8;
  const int64_t lines = (hd * static_cast<int64_t>(sizeof(KT)) + 63) / 64;
  auto prefetch = [&](const KT* base, int64_t j) {
    if (j < L) {
      const char* r = reinterpret_cast<const char*>(base + slots[j] * row);
      for (int64_t c = 0; c < lines; ++c) _mm_prefetch(r + 64 * c, _MM_HINT_T0);
    }
  };
  for (int64_t j = 0; j < std::min(ahead, L); ++j) prefetch(keys, j);
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) {
    for (int64_t a = 0; a < 4; ++a) prefetch(keys, j + ahead + a);
    const KT* k0 = keys + slots[j] * row;
    const KT* k1 = keys + slots[j + 1] * row;
    const KT* k2 = keys + slots[j + 2] * row;
    const KT* k3 = keys + slots[j + 3] * row;
    __m512 a0 = _mm512_mul_ps(qv[0], load_kv(k0)), a1 = _mm512_mul_ps(qv[0], load_kv(k1)),
           a2 = _mm512_mul_ps(qv[0], load_kv(k2)), a3 = _mm512_mul_ps(qv[0], load_kv(k3));
    for (int64_t c = 1; c < nv; ++c) {
      a0 = _mm512_fmadd_ps(qv[c], load_kv(k0 + 16 * c), a0);
      a1 = _mm512_fmadd_ps(qv[c], load_kv(k1 + 16 * c), a1);
      a2 = _mm512_fmadd_ps(qv[c], load_kv(k2 + 16 * c), a2);
      a3 = _mm512_fmadd_ps(qv[c], load_kv(k3 + 16 * c), a3);
    }
    p[j] = _mm512_reduce_add_ps(a0);
    p[j + 1] = _mm512_reduce_add_ps(a1);
    p[j + 2] = _mm512_reduce_add_ps(a2);
    p[j + 3] = _mm512_reduce_add_ps(a3);
  }
  for (; j < L; ++j) {
    const KT* k = keys + slots[j] * row;
    __m512 acc = _mm512_mul_ps(qv[0], load_kv(k));
    for (int64_t c = 1; c < nv; ++c) acc = _mm512_fmadd_ps(qv[c], load_kv(k + 16 * c), acc);
    p[j] = _mm512_reduce_add_ps(acc);
  }
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (j = 0; j < L; j += 16) {
    const __mmask16 m = L - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - j)) - 1u);
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, p + j));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sv = _mm512_setzero_ps();
  for (j = 0; j < L; j += 16) {
    const __mmask16 m = L - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (L - j)) - 1u);
    const __m512 e = exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), mx));
    _mm512_mask_storeu_ps(p + j, m, e);
    sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(m, e));
  }
  for (j = 0; j < std::min(ahead, L); ++j) prefetch(values, j);
  const float inv = 1.0f / _mm512_reduce_add_ps(sv);
  __m512 ov[16];
  for (int64_t c = 0; c < nv; ++c) ov[c] = _mm512_setzero_ps();
  for (j = 0; j < L; ++j) {
    prefetch(values, j + ahead);
    const KT* v = values + slots[j] * row;
    const __m512 w = _mm512_set1_ps(p[j] * inv);
    for (int64_t c = 0; c < nv; ++c) ov[c] = _mm512_fmadd_ps(w, load_kv(v + 16 * c), ov[c]);
  }
  for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(o + 16 * c, ov[c]);
}

using simd::widen;

template <class KT>
void decode_attention_t(const DecodeAttentionItem* items, int64_t n_items, const KT* keys, const KT* values,
                        int64_t heads, int64_t hd, float scale) {
  const int64_t tasks = n_items * heads;
  const int64_t row = heads * hd;
  at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> p;
    for (int64_t t = b; t < e; ++t) {
      const DecodeAttentionItem& it = items[t / heads];
      const int64_t h = t % heads;
      const float* q = it.q + h * hd;
      p.resize(static_cast<size_t>(it.length));
      if (hd % 16 == 0 && hd <= 256 && have_avx512()) {
        head_avx512<KT>(q, keys + h * hd, values + h * hd, it.slots, it.length, row, hd, scale, p.data(), it.out + h * hd);
        continue;
      }
      float mx = -INFINITY;
      for (int64_t j = 0; j < it.length; ++j) {
        const KT* k = keys + it.slots[j] * row + h * hd;
        float s = 0.0f;
        for (int64_t c = 0; c < hd; ++c) s += q[c] * widen(k[c]);
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
        const float w = p[static_cast<size_t>(j)] * inv;
        const KT* v = values + it.slots[j] * row + h * hd;
        for (int64_t c = 0; c < hd; ++c) o[c] += w * widen(v[c]);
      }
    }
  });
}
}  // namespace

void decode_attention(const DecodeAttentionItem* items, int64_t n_items, const void* keys, const void* values,
                      bool bf16, int64_t heads, int64_t hd, float scale) {
  if (bf16) {
    decode_attention_t(items, n_items, static_cast<const uint16_t*>(keys), static_cast<const uint16_t*>(values), heads, hd, scale);
  } else {
    decode_attention_t(items, n_items, static_cast<const float*>(keys), static_cast<const float*>(values), heads, hd, scale);
  }
}

}  // namespace torchspeed::inference
