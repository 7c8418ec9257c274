#include "torchspeed/inference/attention.h"

#include <ATen/Parallel.h>
// GCC 12 warns about the "undefined" vectors inside its own AVX-512 headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace torchspeed::inference {

namespace {
#define TS_AVX512 __attribute__((target("avx512f")))

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// One (sequence, head) with head_dim a multiple of 16: q.k per key in registers, one reduction
// per key, then the weighted sum of values 16 lanes at a time.
TS_AVX512 void head_avx512(const float* q, const float* keys, const float* values, const int64_t* slots, int64_t L,
                           int64_t row, int64_t hd, float scale, float* p, float* o) {
  __m512 qv[16];  // head_dim <= 256
  const int64_t nv = hd / 16;
  for (int64_t c = 0; c < nv; ++c) qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * c), _mm512_set1_ps(scale));
  float mx = -INFINITY;
  for (int64_t j = 0; j < L; ++j) {
    const float* k = keys + slots[j] * row;
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int64_t c = 1; c < nv; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), acc);
    const float sj = _mm512_reduce_add_ps(acc);
    p[j] = sj;
    mx = std::max(mx, sj);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < L; ++j) {
    p[j] = std::exp(p[j] - mx);
    sum += p[j];
  }
  const float inv = 1.0f / sum;
  __m512 ov[16];
  for (int64_t c = 0; c < nv; ++c) ov[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    const float* v = values + slots[j] * row;
    const __m512 w = _mm512_set1_ps(p[j] * inv);
    for (int64_t c = 0; c < nv; ++c) ov[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), ov[c]);
  }
  for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(o + 16 * c, ov[c]);
}
}  // namespace

void decode_attention(const DecodeAttentionItem* items, int64_t n_items, const float* keys, const float* values,
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
        head_avx512(q, keys + h * hd, values + h * hd, it.slots, it.length, row, hd, scale, p.data(), it.out + h * hd);
        continue;
      }
      float mx = -INFINITY;
      for (int64_t j = 0; j < it.length; ++j) {
        const float* k = keys + it.slots[j] * row + h * hd;
        float s = 0.0f;
        for (int64_t c = 0; c < hd; ++c) s += q[c] * k[c];
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
        const float* v = values + it.slots[j] * row + h * hd;
        for (int64_t c = 0; c < hd; ++c) o[c] += w * v[c];
      }
    }
  });
}

}  // namespace torchspeed::inference
