// The serving sampler's rules (greedy, top-k, top-p, seeds, logprobs, NaN logits) and the text
// stream's stop strings and UTF-8 handling, against hand-computed answers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "torchspeed/inference/sampler.h"
#include "torchspeed/inference/text.h"

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
