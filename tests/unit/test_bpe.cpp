// GPT-2's byte-level BPE without Python: GPT-2's pre-tokenization pattern on the cases its
// lookahead and contractions decide, merges by rank, any bytes (invalid UTF-8 too) round-trip,
// and malformed files named. (tests/tokenizer/ compares with Hugging Face's tokenizers.)
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "test_util.h"
#include "torchspeed/data/bpe_tokenizer.h"
#include "torchspeed/data/text.h"

using torchspeed::data::BpeTokenizer;
namespace fs = std::filesystem;

namespace {
using V = std::vector<std::string>;

// GPT-2's byte -> character map for the printable ASCII bytes is the identity; the rest here.
std::string byte_char(int b) {
  int extra = 0;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
    const int cp = printable ? x : 256 + extra++;
    if (x == b) {
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      return s;
    }
  }
  return "";
}

// A byte-level vocabulary (every byte, then merged tokens) in vocab.json + merges.txt.
std::string write_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges) {
  const fs::path dir = fs::temp_directory_path() / ("ts-bpe-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  nlohmann::json vocab = nlohmann::json::object();
  int64_t id = 0;
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = id++;
  std::ofstream m(dir / "merges.txt");
  m << "#version: 0.2\n";
  for (const auto& [a, b] : merges) {
    vocab[a + b] = id++;
    m << a << " " << b << "\n";
  }
  std::ofstream(dir / "vocab.json") << vocab.dump();
  return dir.string();
}
}  // namespace

TEST(Bpe, PreTokenizationFollowsGpt2sPattern) {
  EXPECT_EQ(BpeTokenizer::pre_tokenize("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(BpeTokenizer::pre_tokenize("I'm here, you're not"), (V{"I", "'m", " here", ",", " you", "'re", " not"}));
  // A run of spaces gives its last one to the next word; other whitespace never prefixes.
  EXPECT_EQ(BpeTokenizer::pre_tokenize("x   y"), (V{"x", "  ", " y"}));
  EXPECT_EQ(BpeTokenizer::pre_tokenize("a\n\nb"), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(BpeTokenizer::pre_tokenize("end  "), (V{"end", "  "}));
  EXPECT_EQ(BpeTokenizer::pre_tokenize("abc123 42$$ hi"), (V{"abc", "123", " 42", "$$", " hi"}));
  EXPECT_EQ(BpeTokenizer::pre_tokenize("caf\xc3\xa9 \xc2\xa3" "5"), (V{"caf\xc3\xa9", " \xc2\xa3", "5"}));
  EXPECT_EQ(BpeTokenizer::pre_tokenize("'x"), (V{"'", "x"}));  // not a contraction
}

TEST(Bpe, MergesApplyByRankAndEveryByteRoundTrips) {
  const std::string dir = write_tokenizer({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {byte_char(' '), "w"}});
  const BpeTokenizer t = BpeTokenizer::from_folder(dir);
  EXPECT_EQ(t.vocab_size(), 260);
  // "hell" -> he + ll -> hell (ids 256, 257, then 258); " w" merges to 259.
  EXPECT_EQ(t.encode("hell"), (std::vector<int64_t>{258}));
  EXPECT_EQ(t.encode("hello wo"), (std::vector<int64_t>{258, 'o', 259, 'o'}));
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
  bytes += "\xff\xfe invalid \xc3";
  EXPECT_EQ(t.decode(t.encode(bytes)), bytes);
  ts_test::expect_error([&] { t.decode({999}); }, "token id 999 is not in the vocabulary");
  fs::remove_all(dir);
}

TEST(Bpe, MalformedFilesAreNamed) {
  const std::string dir = write_tokenizer({});
  std::ofstream(dir + "/merges.txt") << "#version: 0.2\na b c\n";
  ts_test::expect_error([&] { BpeTokenizer::from_folder(dir); }, "merges.txt:2: expected two tokens");
  std::ofstream(dir + "/merges.txt") << "";
  std::ofstream(dir + "/vocab.json") << R"({"a": 0})";
  ts_test::expect_error([&] { BpeTokenizer::from_folder(dir); }, "the vocabulary has tokens for only 1 of the 256 bytes");
  std::ofstream(dir + "/tokenizer.json") << R"({"model": {"type": "WordPiece"}})";
  ts_test::expect_error([&] { BpeTokenizer::from_folder(dir); }, "only BPE models are read");
  // A sparse id would size the id table (found by fuzzing: id 2^31 - 1 asked for 64 GB).
  std::ofstream(dir + "/tokenizer.json") << R"({"model": {"type": "BPE", "vocab": {"a": 2147483647}}, "pre_tokenizer": {"type": "ByteLevel"}})";
  ts_test::expect_error([&] { BpeTokenizer::from_folder(dir); }, "has id 2147483647, outside [0, 1026]");
  std::ofstream(dir + "/tokenizer.json") << R"({"model": {"type": "BPE", "vocab": {}, "dropout": 0.1}, "pre_tokenizer": {"type": "ByteLevel"}})";
  ts_test::expect_error([&] { BpeTokenizer::from_folder(dir); }, "model.dropout 0.1 (BPE-dropout) is not supported");
  std::ofstream(dir + "/tokenizer.json") << R"({"model": {"type": "BPE", "vocab": {}, "byte_fallback": "yes"}, "pre_tokenizer": {"type": "ByteLevel"}})";
  ts_test::expect_error([&] { BpeTokenizer::from_folder(dir); }, "tokenizer.json: a value has the wrong type");
  fs::remove_all(dir);
}

TEST(Bpe, EndOfTextIsSplitOffAsOneTokenAndCorporaTokenizeAndDecodeBack) {
  // GPT-2's vocab.json holds <|endoftext|>; like Hugging Face's tokenizers it is matched whole,
  // before pre-tokenization, and is the end-of-text id.
  const std::string dir = write_tokenizer({{"h", "e"}});
  nlohmann::json vocab = nlohmann::json::parse(std::ifstream(dir + "/vocab.json"));
  vocab["<|endoftext|>"] = 257;
  std::ofstream(dir + "/vocab.json") << vocab.dump();
  const BpeTokenizer t = BpeTokenizer::from_folder(dir);
  EXPECT_EQ(t.eos_id(), 257);
  EXPECT_EQ(t.encode("he<|endoftext|>he"), (std::vector<int64_t>{256, 257, 256}));
  EXPECT_EQ(t.token_bytes(257), "<|endoftext|>");
  EXPECT_EQ(t.decode({256, 257}), "he<|endoftext|>");
  // A corpus tokenized with it: ids, not bytes, and the splits decode back to the text.
  const fs::path corpus = fs::path(dir) / "corpus";
  fs::create_directories(corpus);
  std::string text;
  for (int i = 0; i < 50; ++i) text += "hello there, he said\n";
  std::ofstream(corpus / "a.txt") << text;
  const auto c = torchspeed::data::TextCorpus::load(corpus.string(), 0.2, 4, &t);
  EXPECT_EQ(c.bytes, static_cast<int64_t>(text.size()));
  EXPECT_LT(c.train.size() + c.val.size(), text.size());  // "he" merged
  std::vector<int64_t> all(c.train.begin(), c.train.end());
  all.insert(all.end(), c.val.begin(), c.val.end());
  EXPECT_EQ(t.decode(all), text);
  EXPECT_EQ(torchspeed::data::load_tokenizer(dir)->encode("he"), (std::vector<int64_t>{256}));
  EXPECT_EQ(torchspeed::data::load_tokenizer("bytes")->encode("he"), (std::vector<int64_t>{'h', 'e'}));
  ts_test::expect_error([] { torchspeed::data::load_tokenizer("/nonexistent/tok"); }, "tokenizer '/nonexistent/tok' does not exist");
  fs::remove_all(dir);
}

// Llama 2's tokenizer.json form (Note [SentencePiece-style BPE]), small: "▁" marks spaces, a
// character the vocabulary lacks falls back to its bytes' <0xXX> tokens, every span between
// added tokens gets the "▁" prefix, merges apply lowest rank first, and the post-processor's <s>
// is the BOS a completion prompt starts with (encode itself never adds it).
TEST(Bpe, SentencePieceStyleByteFallbackAndBos) {
  const std::string meta = "\xE2\x96\x81";
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) vocab[std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">"] = 3 + b;
  int64_t id = 259;
  for (const std::string& t : std::vector<std::string>{meta, "a", "b", "c", meta + "a", "ab", meta + "ab", "bc"}) vocab[t] = id++;
  using json = nlohmann::json;
  json j = json::object();
  j["added_tokens"] = json::array({json{{"id", 1}, {"content", "<s>"}, {"special", true}},
                                   json{{"id", 2}, {"content", "</s>"}, {"special", true}}});
  json prepend = {{"type", "Prepend"}, {"prepend", meta}};
  json replace = {{"type", "Replace"}, {"pattern", json{{"String", " "}}}, {"content", meta}};
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({prepend, replace})}};
  j["pre_tokenizer"] = nullptr;
  json single = json::array({json{{"SpecialToken", json{{"id", "<s>"}, {"type_id", 0}}}},
                             json{{"Sequence", json{{"id", "A"}, {"type_id", 0}}}}});
  json specials = json::object();
  specials["<s>"] = {{"id", "<s>"}, {"ids", json::array({1})}, {"tokens", json::array({"<s>"})}};
  j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", single}, {"special_tokens", specials}};
  j["model"] = {{"type", "BPE"}, {"unk_token", "<unk>"}, {"byte_fallback", true}, {"fuse_unk", true}, {"vocab", vocab},
                {"merges", json::array({meta + " a", "a b", meta + "a b", "b c"})}};
  const fs::path path = fs::temp_directory_path() / ("ts-spm-" + std::to_string(::getpid()) + ".json");
  std::ofstream(path) << j.dump();
  const auto t = BpeTokenizer::from_tokenizer_json(path.string());
  const int64_t m = 259, c = 262, ma = 263, mab = 265, bc = 266;
  // "ab c": "▁ab▁c" -> ▁a (rank 0), then ▁a+b (rank 2) -> ▁ab; "▁c" has no merge.
  EXPECT_EQ(t.encode("ab c"), (std::vector<int64_t>{mab, m, c}));
  // "bc" merges (rank 3) only where "▁a"/"ab" did not take the b first; "é" (0xC3 0xA9) falls back to bytes.
  EXPECT_EQ(t.encode("abc"), (std::vector<int64_t>{mab, c}));
  EXPECT_EQ(t.encode("bc\xC3\xA9"), (std::vector<int64_t>{m, bc, 3 + 0xC3, 3 + 0xA9}));
  // An added token starts a new span, which gets its own "▁".
  EXPECT_EQ(t.encode("a</s>a"), (std::vector<int64_t>{ma, 2, ma}));
  EXPECT_EQ(t.decode(t.encode("ab c\xC3\xA9")), " ab c\xC3\xA9");
  EXPECT_EQ(t.normalized("ab c\xC3\xA9"), " ab c\xC3\xA9");
  EXPECT_EQ(t.bos_to_add(), 1);
  fs::remove(path);
}
