#include "torchspeed/inference/attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace torchspeed::inference {

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
