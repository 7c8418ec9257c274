#include "torchspeed/inference/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace torchspeed::inference {

namespace {
// Logits ordered most likely first, ties by id. A NaN logit (a broken model) ranks last: a
// comparator that is not a strict weak order makes std::sort undefined behaviour.
struct MoreLikely {
  const float* logits;
  float key(int64_t i) const { return std::isnan(logits[i]) ? -INFINITY : logits[i]; }
  bool operator()(int64_t a, int64_t b) const {
    const float x = key(a), y = key(b);
    return x > y || (x == y && a < b);
  }
};
}  // namespace

Sampler::Sampler(const SamplingParams& params) : p_(params) {
  if (p_.seed) {
    rng_.seed(*p_.seed);
  } else {
    std::random_device rd;
    rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
  }
}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

TokenLogprobs Sampler::logprobs_of(const float* logits, int64_t vocab, int64_t token, int64_t n) {
  double mx = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  TokenLogprobs out;
  out.logprob = static_cast<double>(logits[token]) - lse;
  if (n > 0) {
    std::vector<int64_t> idx(static_cast<size_t>(vocab));
    std::iota(idx.begin(), idx.end(), 0);
    const int64_t k = std::min(n, vocab);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), MoreLikely{logits});
    for (int64_t i = 0; i < k; ++i) out.top.emplace_back(idx[static_cast<size_t>(i)], logits[idx[static_cast<size_t>(i)]] - lse);
  }
  return out;
}

int64_t Sampler::sample(const float* logits, int64_t vocab, TokenLogprobs* lp) {
  int64_t token = 0;
  if (p_.temperature <= 0) {
    for (int64_t i = 1; i < vocab; ++i) {
      if (logits[i] > logits[token]) token = i;
    }
  } else {
    // Candidates most likely first (ties by id), cut by top-k, then by top-p on the
    // temperature-scaled distribution, then one draw over what is left.
    std::vector<int64_t> idx(static_cast<size_t>(vocab));
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), MoreLikely{logits});
    size_t keep = idx.size();
    if (p_.top_k > 0) keep = std::min(keep, static_cast<size_t>(p_.top_k));
    const double inv_t = 1.0 / p_.temperature, top = logits[idx[0]];
    std::vector<double> w(keep);
    double total = 0;
    for (size_t i = 0; i < keep; ++i) {
      w[i] = std::exp((static_cast<double>(logits[idx[i]]) - top) * inv_t);
      total += w[i];
    }
    if (p_.top_p < 1.0) {
      double cum = 0;
      size_t cut = keep;
      for (size_t i = 0; i < keep; ++i) {
        cum += w[i] / total;
        if (cum >= p_.top_p) {
          cut = i + 1;
          break;
        }
      }
      keep = cut;
      total = 0;
      for (size_t i = 0; i < keep; ++i) total += w[i];
    }
    const double u = uniform() * total;
    double cum = 0;
    token = idx[keep - 1];
    for (size_t i = 0; i < keep; ++i) {
      cum += w[i];
      if (u < cum) {
        token = idx[i];
        break;
      }
    }
  }
  if (lp && p_.logprobs >= 0) *lp = logprobs_of(logits, vocab, token, p_.logprobs);
  return token;
}

}  // namespace torchspeed::inference
