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
  if (matcher_) {
    // Note [Structured output]: what cannot continue the grammar is masked last. A grammar
    // with nothing left to allow (only possible with ignore_eos or min_tokens holding the end
    // back) ends the text.
    if (logits == raw) buf_.assign(raw, raw + vocab);
    matcher_->mask(buf_.data(), vocab);
    logits = buf_.data();
    if (std::none_of(buf_.begin(), buf_.end(), [](float x) { return x > -INFINITY; }) && eos_ >= 0) {
      if (lp && p_.logprobs >= 0) *lp = logprobs_of(raw, vocab, eos_, p_.logprobs);
      return eos_;
    }
  }
  int64_t token = 0;
  if (p_.temperature <= 0) {
    for (int64_t i = 1; i < vocab; ++i) {
      if (logits[i] > logits[token]) token = i;
    }
  } else {
    // Candidates: tokens with a finite logit whose probability relative to the most likely
    // one's (at this temperature) is at least min_p. Without top-k or top-p one draw over them
    // in id order; with them, most likely first (ties by id) -- top-k, then the shortest prefix
    // reaching top_p of what top-k left -- sorting only as far as the cut needs.
    double top = -INFINITY;
    for (int64_t i = 0; i < vocab; ++i) {
      if (logits[i] > top) top = logits[i];  // NaN never compares greater
    }
    const double inv_t = 1.0 / p_.temperature;
    std::vector<int64_t>& idx = idx_;
    std::vector<double>& w = w_;
    idx.clear();
    w.assign(static_cast<size_t>(vocab), 0.0);
    for (int64_t i = 0; i < vocab; ++i) {
      const double x = std::exp((static_cast<double>(logits[i]) - top) * inv_t);
      if (x > 0 && x >= p_.min_p) {  // false for -inf (banned) and NaN
        w[static_cast<size_t>(i)] = x;
        idx.push_back(i);
      }
    }
    if (idx.empty()) {
      token = 0;  // nothing finite: as greedy would choose
      for (int64_t i = 1; i < vocab; ++i) {
        if (logits[i] > logits[token]) token = i;
      }
    } else {
      size_t keep = idx.size();
      const MoreLikely order{logits};
      if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < keep) {
        keep = static_cast<size_t>(p_.top_k);
        std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(keep), idx.end(), order);
        idx.resize(keep);
      }
      double total = 0;
      for (size_t i = 0; i < keep; ++i) total += w[static_cast<size_t>(idx[i])];
      if (p_.top_p < 1.0) {
        // Sort a prefix of 64, 512, ... candidates until it holds top_p of the mass.
        for (size_t m = std::min<size_t>(64, keep);; m = std::min(keep, m * 8)) {
          std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(m), idx.begin() + static_cast<std::ptrdiff_t>(keep), order);
          double cum = 0;
          size_t cut = 0;
          for (size_t i = 0; i < m; ++i) {
            cum += w[static_cast<size_t>(idx[i])] / total;
            if (cum >= p_.top_p) {
              cut = i + 1;
              break;
            }
          }
          if (cut > 0 || m == keep) {
            keep = cut > 0 ? cut : keep;
            break;
          }
        }
        total = 0;
        for (size_t i = 0; i < keep; ++i) total += w[static_cast<size_t>(idx[i])];
      }
      const double u = uniform() * total;
      double cum = 0;
      token = idx[keep - 1];
      for (size_t i = 0; i < keep; ++i) {
        cum += w[static_cast<size_t>(idx[i])];
        if (u < cum) {
          token = idx[i];
          break;
        }
      }
    }
  }
  if (lp && p_.logprobs >= 0) *lp = logprobs_of(raw, vocab, token, p_.logprobs);
  if (matcher_) matcher_->accept(token);
  return token;
}

}  // namespace torchspeed::inference
