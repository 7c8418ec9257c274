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

// Note [Logits processing]
// The order and the arithmetic are vLLM's (v1 sampler): first what may change the greedy choice,
// in place on a copy of the row (never the model's logits, which logprobs report):
//   1. logit_bias: bias[t] added (OpenAI's -100 bans a token in practice, +100 forces it);
//   2. min_tokens: while fewer are generated, EOS, end-of-turn and stop ids get -inf;
//   3. repetition_penalty r on every token of the prompt or the output: l / r where l > 0, l * r
//      where not (Hugging Face's and vLLM's; r > 1 discourages repeats);
//   4. frequency f and presence p on the output's counts c: l - f c - p [c > 0] (OpenAI's).
// Greedy takes the argmax of that. Sampling divides by the temperature and then keeps, of the
// tokens most likely first, those at least min_p times as likely as the first, then the top_k,
// then the smallest prefix whose probability reaches top_p; one uniform draw picks among them.
// The counts grow with the history the engine passes (the sequence's own tokens), so a request's
// tokens depend on its own history and seed alone, never on its batch.

Sampler::Sampler(const SamplingParams& params, int64_t eos) : p_(params), eos_(eos) {
  shapes_ = p_.min_tokens > 0 || p_.presence_penalty != 0 || p_.frequency_penalty != 0 || p_.repetition_penalty != 1.0 ||
            !p_.logit_bias.empty();
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

const float* Sampler::shape(const float* logits, int64_t vocab, const std::vector<int64_t>& history, int64_t prompt_len) {
  const bool repetition = p_.repetition_penalty != 1.0;
  for (; counted_ < history.size(); ++counted_) {
    const int64_t t = history[counted_];
    if (static_cast<int64_t>(counted_) < prompt_len) {
      if (repetition) prompt_.insert(t);
    } else {
      ++counts_[t];
    }
  }
  buf_.assign(logits, logits + vocab);
  float* l = buf_.data();
  auto in_vocab = [&](int64_t t) { return t >= 0 && t < vocab; };
  for (const auto& [t, b] : p_.logit_bias) {
    if (in_vocab(t)) l[t] += b;
  }
  const int64_t generated = static_cast<int64_t>(history.size()) - prompt_len;
  if (generated < p_.min_tokens) {
    if (in_vocab(eos_)) l[eos_] = -INFINITY;
    for (const auto* ids : {&p_.eos_token_ids, &p_.stop_token_ids}) {
      for (int64_t t : *ids) {
        if (in_vocab(t)) l[t] = -INFINITY;
      }
    }
  }
  if (repetition) {
    const auto r = static_cast<float>(p_.repetition_penalty);
    auto penalize = [&](int64_t t) {
      if (in_vocab(t)) l[t] = l[t] > 0 ? l[t] / r : l[t] * r;
    };
    for (int64_t t : prompt_) penalize(t);
    for (const auto& [t, c] : counts_) {
      if (!prompt_.count(t)) penalize(t);
    }
  }
  if (p_.frequency_penalty != 0 || p_.presence_penalty != 0) {
    for (const auto& [t, c] : counts_) {
      if (in_vocab(t)) {
        l[t] -= static_cast<float>(p_.frequency_penalty * static_cast<double>(c) + p_.presence_penalty);
      }
    }
  }
  return l;
}

int64_t Sampler::sample(const float* raw, int64_t vocab, TokenLogprobs* lp, const std::vector<int64_t>& history,
                        int64_t prompt_len) {
  const float* logits = shapes_ ? shape(raw, vocab, history, prompt_len) : raw;
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
    const double inv_t = 1.0 / p_.temperature, top = logits[idx[0]];
    std::vector<double> w(keep);
    // w: each candidate's probability relative to the most likely one's. Tokens with none (a
    // -inf logit: banned) and, with min_p, those under min_p are cut.
    size_t live = 0;
    for (size_t i = 0; i < keep; ++i) {
      w[i] = std::exp((static_cast<double>(logits[idx[i]]) - top) * inv_t);
      if (w[i] > 0 && w[i] >= p_.min_p) live = i + 1;
    }
    keep = std::max<size_t>(live, 1);
    if (p_.top_k > 0) keep = std::min(keep, static_cast<size_t>(p_.top_k));
    double total = 0;
    for (size_t i = 0; i < keep; ++i) total += w[i];
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
  if (lp && p_.logprobs >= 0) *lp = logprobs_of(raw, vocab, token, p_.logprobs);
  return token;
}

}  // namespace torchspeed::inference
