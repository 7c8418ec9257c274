// Choosing the next token: greedy, temperature, top-k, top-p (nucleus), min-p, with a random
// stream per request (seeded or not) so a request draws the same numbers alone or in any batch;
// the logits first shaped as vLLM shapes them (Note [Logits processing] in sampler.cpp): logit
// bias, min_tokens, repetition / frequency / presence penalties; and the log-probabilities
// OpenAI's `logprobs` returns (of the model's distribution, before any of that, as vLLM
// reports them by default).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchspeed/inference/structured.h"

namespace torchspeed::inference {

struct SamplingParams {
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: every token
  double top_p = 1.0;
  std::optional<uint64_t> seed;
  int64_t max_tokens = 16;
  std::vector<std::string> stop;  // generation ends before the first occurrence of any
  int64_t logprobs = -1;          // -1: none; N: the chosen token's and the N most likely
  bool prompt_logprobs = false;   // also every prompt token's (OpenAI's echo with logprobs)
  bool ignore_eos = false;        // keep generating past the tokenizer's end-of-text token
  // Token ids that end the generation like the end-of-text token, and like it not under
  // ignore_eos (a chat template's end of turn: vLLM's generation-config EOS ids).
  std::vector<int64_t> eos_token_ids;
  // Token ids that always end the generation (vLLM's stop_token_ids); their text is not shown.
  std::vector<int64_t> stop_token_ids;
  // End-of-text, end-of-turn and stop tokens, and stop strings, are held back until this many
  // tokens are generated (vLLM's min_tokens).
  int64_t min_tokens = 0;
  // OpenAI's penalties on the generated tokens: logit -= frequency * count + presence * (count > 0).
  double presence_penalty = 0, frequency_penalty = 0;
  // vLLM's (and Hugging Face's): a token in the prompt or the output has its logit divided by it
  // where positive and multiplied where not.
  double repetition_penalty = 1.0;
  double min_p = 0;  // tokens less likely than min_p x the most likely one are dropped
  std::vector<std::pair<int64_t, float>> logit_bias;  // added to those tokens' logits
  // Structured output: only tokens that keep the text inside the grammar (response_format).
  GrammarPtr grammar;
};

struct TokenLogprobs {
  double logprob = 0;  // of the chosen token
  std::vector<std::pair<int64_t, double>> top;  // most likely first
};

class Sampler {
 public:
  // eos: the tokenizer's end-of-text id (min_tokens holds it back), -1: none.
  explicit Sampler(const SamplingParams& params, int64_t eos = -1);
  // logits: `vocab` fp32 values. history: the sequence so far, its first prompt_len tokens the
  // prompt and the rest generated (what the penalties and min_tokens read; only appended to
  // between calls). Returns the token; fills `lp` when params.logprobs >= 0.
  int64_t sample(const float* logits, int64_t vocab, TokenLogprobs* lp, const std::vector<int64_t>& history = {},
                 int64_t prompt_len = 0);
  // Holds sampling to params.grammar: `m` masks each row and follows each chosen token.
  void constrain(std::unique_ptr<GrammarMatcher> m) { matcher_ = std::move(m); }
  const GrammarMatcher* matcher() const { return matcher_.get(); }
  // Whether the logits are changed before sampling (penalties, bias, min_tokens).
  bool shapes_logits() const { return shapes_; }
  // The row as sample() would see it after bias, min_tokens and penalties (Note [Logits
  // processing]); valid until the next call. Reads `history` as sample() does.
  const float* shape(const float* logits, int64_t vocab, const std::vector<int64_t>& history, int64_t prompt_len);
  // Log-probability of `token` and the top `n` under `logits`.
  static TokenLogprobs logprobs_of(const float* logits, int64_t vocab, int64_t token, int64_t n);

 private:
  double uniform();  // [0, 1), 53 random bits
  SamplingParams p_;
  int64_t eos_;
  bool shapes_;
  std::mt19937_64 rng_;
  std::unique_ptr<GrammarMatcher> matcher_;
  std::vector<float> buf_;                   // shaped logits
  std::vector<int64_t> idx_;                 // sampling candidates
  std::vector<double> w_;                    // their weights, by token id
  std::unordered_map<int64_t, int64_t> counts_;  // generated tokens seen so far
  std::unordered_set<int64_t> prompt_;       // the prompt's distinct tokens (repetition penalty)
  size_t counted_ = 0;                       // history entries already in counts_ / prompt_
};

}  // namespace torchspeed::inference
