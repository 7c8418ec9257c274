// Data: tokenizer round trips, corpus loading and its errors, the bigram baseline, and the
// distributed sampler (disjoint shards, per-epoch reshuffle from the seed, exact resume).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "torchspeed/data/text.h"
#include "torchspeed/base/error.h"
#include "test_util.h"

using namespace torchspeed::data;
using ts_test::expect_error;
namespace fs = std::filesystem;

namespace {
fs::path make_corpus(const std::string& name, const std::map<std::string, std::string>& files) {
  fs::path dir = fs::temp_directory_path() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& [f, text] : files) std::ofstream(dir / f, std::ios::binary) << text;
  return dir;
}
}  // namespace

TEST(Data, TokenizerRoundTripsAnyBytes) {
  ByteTokenizer t;
  const std::string s = "Fortune favours the bold. \xc3\xa9t\xc3\xa9\n\t";
  auto ids = t.encode(s);
  EXPECT_EQ(ids.size(), s.size());
  EXPECT_EQ(t.decode(ids), s);
  EXPECT_EQ(ids[0], 'F');
}

TEST(Data, CorpusSkipsIndexFilesAndSeparators) {
  std::string body;
  for (int i = 0; i < 200; ++i) body += "line " + std::to_string(i) + "\n%\n";
  auto dir = make_corpus("ts_corpus", {{"quotes", body}, {"quotes.dat", std::string("\0\1\2", 3)}});
  auto c = TextCorpus::load(dir.string(), 0.1, 8);
  EXPECT_EQ(c.files.size(), 1u);
  const std::string all(c.train.begin(), c.train.end());
  EXPECT_EQ(all.find('%'), std::string::npos);
  const double frac = static_cast<double>(c.val.size()) / (c.train.size() + c.val.size());
  EXPECT_NEAR(frac, 0.1, 0.01);
}

TEST(Data, BadCorpusIsAClearError) {
  expect_error([] { TextCorpus::load("/nonexistent/corpus", 0.1, 8); }, "data path '/nonexistent/corpus' does not exist");
  auto empty = make_corpus("ts_empty", {{"a.txt", ""}});
  expect_error([&] { TextCorpus::load(empty.string(), 0.1, 8); }, "holds no text");
  auto tiny = make_corpus("ts_tiny", {{"a.txt", "hello"}});
  expect_error([&] { TextCorpus::load(tiny.string(), 0.1, 64); }, "too short for windows of 64 tokens");
  auto binary = make_corpus("ts_binary", {{"a.bin", std::string("ab\0cd", 5)}});
  expect_error([&] { TextCorpus::load(binary.string(), 0.1, 1); }, "is not a text file");
}

TEST(Data, BigramEntropyOfKnownSequences) {
  TextCorpus c;
  for (int i = 0; i < 1000; ++i) c.train.push_back(i % 2 ? 'b' : 'a');
  EXPECT_NEAR(c.bigram_entropy(), 0.0, 1e-12);  // the next byte is always determined
  c.train.clear();
  uint32_t x = 12345;
  for (int i = 0; i < 200000; ++i) {
    x = x * 1664525u + 1013904223u;
    c.train.push_back((x >> 16) & 1 ? 'x' : 'y');
  }
  EXPECT_NEAR(c.bigram_entropy(), std::log(2.0), 1e-3);  // independent fair coin
}

TEST(Data, SamplerShardsAreDisjointAndReshuffle) {
  const int64_t windows = 1001;
  for (int size : {1, 2, 3, 4}) {
    std::set<int64_t> all;
    for (int r = 0; r < size; ++r) {
      DistributedSampler s(windows, r, size, 7);
      auto shard = s.shard(0);
      EXPECT_EQ(static_cast<int64_t>(shard.size()), windows / size);
      for (int64_t w : shard) {
        EXPECT_TRUE(w >= 0 && w < windows);
        EXPECT_TRUE(all.insert(w).second) << "window " << w << " given to two ranks";
      }
    }
  }
  DistributedSampler s(windows, 0, 2, 7), same(windows, 0, 2, 7), other(windows, 0, 2, 8);
  EXPECT_EQ(s.shard(0), same.shard(0));
  EXPECT_NE(s.shard(0), s.shard(1));      // a new order every epoch
  EXPECT_NE(s.shard(0), other.shard(0));  // from the seed
}

TEST(Data, SamplerResumesAtTheExactPosition) {
  DistributedSampler a(97, 1, 3, 11);
  for (int i = 0; i < 70; ++i) a.next();  // crosses into the second epoch (32 per rank)
  DistributedSampler b(97, 1, 3, 11);
  b.load_state(a.state());
  EXPECT_EQ(b.epoch(), 2);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(a.next(), b.next()) << i;
  EXPECT_THROW(b.load_state(nlohmann::json{{"epoch", 0}, {"position", 1000}}), torchspeed::Error);
}

// A checkpoint saves the loader's state after the batches it handed out, not after the one it
// prepared ahead: a resumed loader continues with exactly the batch the original would give next.
TEST(Data, LoaderStateExcludesThePreparedBatch) {
  torchspeed::data::TokenIds tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 131) % 251);
  torchspeed::data::TextLoader a(tokens, 16, 4, 0, 2, 3);
  for (int i = 0; i < 5; ++i) a.next();
  const auto saved = a.state();
  EXPECT_EQ(saved.at("position").get<int64_t>(), 20);  // 5 batches of 4 windows
  torchspeed::data::TextLoader b(tokens, 16, 4, 0, 2, 3);
  b.next();  // a prepared batch that load_state must drop
  b.load_state(saved);
  for (int i = 0; i < 30; ++i) {  // across epoch ends (156 windows per rank)
    auto x = a.next(), y = b.next();
    ASSERT_TRUE(x.inputs.equal(y.inputs) && x.targets.equal(y.targets)) << "batch " << i;
  }
}

// Resharding: a position saved at dp 4 continues after the same share of the epoch at dp 2.
TEST(Data, SamplerStateMapsToAnotherDataParallelSize) {
  DistributedSampler a(400, 0, 4, 5);
  for (int i = 0; i < 30; ++i) a.next();
  DistributedSampler b(400, 1, 2, 5);
  b.load_state(a.state());
  EXPECT_EQ(b.state().at("position").get<int64_t>(), 60);  // 120 of 400 windows consumed
  EXPECT_EQ(b.state().at("dp_size").get<int64_t>(), 2);
}
