// Choosing the next token: greedy, temperature, top-k, top-p (nucleus), with a random stream
// per request (seeded or not) so a request draws the same numbers alone or in any batch; and
// the log-probabilities OpenAI's `logprobs` returns (of the model's distribution, before
// temperature and truncation, as vLLM reports them).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

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
  // Token ids that end the generation like the end-of-text token (a chat template's end of
  // turn, vLLM's stop_token_ids); their text is not shown.
  std::vector<int64_t> stop_token_ids;
};

struct TokenLogprobs {
  double logprob = 0;  // of the chosen token
  std::vector<std::pair<int64_t, double>> top;  // most likely first
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // logits: `vocab` fp32 values. Returns the token; fills `lp` when params.logprobs >= 0.
  int64_t sample(const float* logits, int64_t vocab, TokenLogprobs* lp);
  // Log-probability of `token` and the top `n` under `logits`.
  static TokenLogprobs logprobs_of(const float* logits, int64_t vocab, int64_t token, int64_t n);

 private:
  double uniform();  // [0, 1), 53 random bits
  SamplingParams p_;
  std::mt19937_64 rng_;
};

}  // namespace torchspeed::inference
