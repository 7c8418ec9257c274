// The serving sampler's rules (greedy, top-k, top-p, seeds, logprobs, NaN logits) and the text
// stream's stop strings and UTF-8 handling, against hand-computed answers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "torchspeed/inference/sampler.h"
#include "torchspeed/inference/text_stream.h"

using namespace torchspeed::inference;

TEST(Sampler, Rules) {
  std::vector<float> logits{0.1f, 2.0f, 1.9f, -1.0f, 0.5f};
  SamplingParams greedy;
  greedy.temperature = 0;
  EXPECT_EQ(Sampler(greedy).sample(logits.data(), 5, nullptr), 1);
  SamplingParams k1;
  k1.top_k = 1;
  k1.seed = 3;
  Sampler s1(k1);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s1.sample(logits.data(), 5, nullptr), 1);
  SamplingParams k2 = k1;
  k2.top_k = 2;
  Sampler s2(k2);
  std::map<int64_t, int> seen;
  for (int i = 0; i < 400; ++i) ++seen[s2.sample(logits.data(), 5, nullptr)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[1], seen[2]);  // exp(0.1) more likely
  SamplingParams p;
  p.top_p = 0.3;  // the top token alone holds more than 30%
  p.seed = 1;
  Sampler sp(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sp.sample(logits.data(), 5, nullptr), 1);
  // Same seed, same draws.
  SamplingParams t;
  t.seed = 42;
  Sampler a(t), b(t);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.sample(logits.data(), 5, nullptr), b.sample(logits.data(), 5, nullptr));
  TokenLogprobs lp = Sampler::logprobs_of(logits.data(), 5, 2, 3);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  EXPECT_NEAR(lp.logprob, 1.9 - std::log(z), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].first, 1);
  EXPECT_EQ(lp.top[1].first, 2);
  EXPECT_EQ(lp.top[2].first, 4);
}

TEST(TextStream, StopsAndUtf8) {
  TextStream s({"END", "xy"});
  std::string streamed;
  for (char c : std::string("abcEN")) {
    EXPECT_FALSE(s.append(std::string(1, c)));
    streamed += s.take(false);
  }
  EXPECT_EQ(streamed, "abc");  // "EN" could start "END": held back
  EXPECT_TRUE(s.append("D and more"));
  streamed += s.take(true);
  EXPECT_EQ(streamed, "abc");
  EXPECT_EQ(s.text(), "abc");
  // A multi-byte character is never split across chunks; invalid bytes become U+FFFD.
  TextStream u({});
  std::string out;
  for (unsigned char c : std::string("h\xC3\xA9!\xFF")) {
    u.append(std::string(1, static_cast<char>(c)));
    const std::string piece = u.take(false);
    EXPECT_EQ(piece, sanitize_utf8(piece));
    out += piece;
  }
  out += u.take(true);
  EXPECT_EQ(out, "h\xC3\xA9!\xEF\xBF\xBD");
  EXPECT_EQ(out, sanitize_utf8("h\xC3\xA9!\xFF"));
  EXPECT_EQ(sanitize_utf8("a\xE2\x82"), "a\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(complete_utf8_prefix("a\xE2\x82", 3), 1u);
  EXPECT_EQ(token_text(std::string("A")), "A");
  EXPECT_EQ(token_text(std::string("\xE2")), "bytes:\\xe2");
}

TEST(Sampler, NaNLogitsRankLast) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> logits(4096, nan);
  logits[17] = 1.0f;
  logits[4000] = 0.5f;
  SamplingParams p;
  p.seed = 1;
  p.top_k = 2;
  p.logprobs = 3;
  Sampler s(p);
  for (int i = 0; i < 20; ++i) {
    TokenLogprobs lp;
    const int64_t t = s.sample(logits.data(), 4096, &lp);
    EXPECT_TRUE(t == 17 || t == 4000);
    ASSERT_EQ(lp.top.size(), 3u);
    EXPECT_EQ(lp.top[0].first, 17);
    EXPECT_EQ(lp.top[1].first, 4000);
  }
}

// stop(drain, deadline) aborts what is still running at the deadline; a receiver (sink) that
// throws ends its own request only (it ended the process before).

// Note [Logits processing]: bias, min_tokens, repetition / frequency / presence penalties,
// each against the formula written out here.
TEST(Sampler, ShapesLogitsAsVllm) {
  const std::vector<float> raw{2.0f, -1.0f, 0.5f, 3.0f, -0.25f, 1.0f, 0.0f};
  const std::vector<int64_t> history{0, 1, /*generated:*/ 3, 3, 2};  // prompt_len 2
  SamplingParams p;
  p.repetition_penalty = 1.5;
  p.frequency_penalty = 0.5;
  p.presence_penalty = 0.25;
  p.logit_bias = {{4, 3.0f}, {6, -100.0f}};
  p.min_tokens = 4;  // 3 generated: EOS (5) and the stop id (4) held back
  p.stop_token_ids = {4};
  Sampler s(p, /*eos=*/5);
  ASSERT_TRUE(s.shapes_logits());
  const float* l = s.shape(raw.data(), 7, history, 2);
  const std::map<int64_t, int> counts{{3, 2}, {2, 1}};
  for (int64_t t = 0; t < 7; ++t) {
    double want = raw[static_cast<size_t>(t)];
    if (t == 4) want += 3.0;
    if (t == 6) want -= 100.0;
    if (t == 4 || t == 5) want = -INFINITY;
    const bool seen = t == 0 || t == 1 || counts.count(t);
    if (seen) want = want > 0 ? want / 1.5 : want * 1.5;
    if (counts.count(t)) want -= 0.5 * counts.at(t) + 0.25;
    EXPECT_FLOAT_EQ(l[t], static_cast<float>(want)) << "token " << t;
  }
  // One more generated token: min_tokens is met, EOS and the stop id come back.
  const std::vector<int64_t> longer{0, 1, 3, 3, 2, 0};
  l = s.shape(raw.data(), 7, longer, 2);
  EXPECT_FLOAT_EQ(l[5], 1.0f);
  EXPECT_FLOAT_EQ(l[4], -0.25f + 3.0f);
  EXPECT_FLOAT_EQ(l[0], 2.0f / 1.5f - 0.5f - 0.25f);  // in the prompt and now generated once

  // Greedy takes the shaped argmax; logprobs stay the model's own.
  SamplingParams g = p;
  g.temperature = 0;
  g.logprobs = 0;
  Sampler gs(g, 5);
  TokenLogprobs lp;
  EXPECT_EQ(gs.sample(raw.data(), 7, &lp, history, 2), 0);  // 3 had 3.0, shaped to 0.75; 0 has 1.33
  EXPECT_DOUBLE_EQ(lp.logprob, Sampler::logprobs_of(raw.data(), 7, 0, 0).logprob);
  SamplingParams none;
  EXPECT_FALSE(Sampler(none).shapes_logits());
}

TEST(Sampler, MinPAndBannedTokens) {
  // Relative to the most likely: 1, e^-1 (0.37), e^-2 (0.14), e^-4 (0.018).
  const std::vector<float> logits{4.0f, 3.0f, 2.0f, 0.0f};
  SamplingParams p;
  p.seed = 9;
  p.min_p = 0.1;
  Sampler s(p);
  std::map<int64_t, int> seen;
  for (int i = 0; i < 2000; ++i) ++seen[s.sample(logits.data(), 4, nullptr)];
  EXPECT_EQ(seen.count(3), 0u);
  EXPECT_GT(seen[2], 0);
  // At temperature 0.5 the ratios square: 0.14 -> 0.018, under min_p.
  p.temperature = 0.5;
  Sampler cold(p);
  seen.clear();
  for (int i = 0; i < 2000; ++i) ++seen[cold.sample(logits.data(), 4, nullptr)];
  EXPECT_EQ(seen.count(2) + seen.count(3), 0u);
  EXPECT_GT(seen[1], 0);
  // logit_bias -100 bans a token however likely; +100 forces one.
  SamplingParams b;
  b.seed = 1;
  b.logit_bias = {{0, -100.0f}};
  Sampler banned(b);
  for (int i = 0; i < 500; ++i) EXPECT_NE(banned.sample(logits.data(), 4, nullptr), 0);
  b.logit_bias = {{3, 100.0f}};
  Sampler forced(b);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(forced.sample(logits.data(), 4, nullptr), 3);
}

TEST(TextStream, StopsCanBeHeldOff) {
  TextStream t({"ab"});
  EXPECT_FALSE(t.append("xab", /*stops=*/false));  // before min_tokens: no stop
  EXPECT_FALSE(t.append("a"));                      // a stop ending here would count; "ab" did not
  EXPECT_TRUE(t.append("b"));
  EXPECT_EQ(t.take(true), "xab");  // cut before the stop that ended in the last bytes
}
