// GPT-2's byte-level BPE without Python: GPT-2's pre-tokenization pattern on the cases its
// lookahead and contractions decide, merges by rank, any bytes (invalid UTF-8 too) round-trip,
// and malformed files named. (tests/tokenizer/ compares with Hugging Face's tokenizers.)
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <random>

#include "test_util.h"
#include "torchspeed/checkpoint/gguf_writer.h"
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

// Issue 35: long prompts without spaces and texts full of added tokens encode in linear-ish time,
// with ids equal to the definition the fast paths replace.
namespace {
// The merge loop before the heap, kept as the reference: rescan the symbols for the lowest-ranked
// adjacent pair, take the leftmost among equals, merge it, repeat (quadratic, but obviously the
// definition: tokenizers' Word::merge_all and llama.cpp's SPM tokenizer compute the same).
using Ranks = std::map<std::pair<std::string, std::string>, double>;
std::vector<std::string> reference_merges(std::vector<std::string> sym, const Ranks& rank) {
  while (sym.size() > 1) {
    size_t at = 0;
    bool found = false;
    double best = 0;
    for (size_t k = 0; k + 1 < sym.size(); ++k) {
      const auto it = rank.find({sym[k], sym[k + 1]});
      if (it != rank.end() && (!found || it->second < best)) {
        best = it->second;
        at = k;
        found = true;
      }
    }
    if (!found) break;
    sym[at] += sym[at + 1];
    sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  return sym;
}

// The added-token split before the single scan, kept as the reference: for every span, search the
// rest of the text for every added token; the earliest wins, the longest at a tie (`added` is
// longest first). Calls plain(span, at_start) between matches and added(id) for each match.
void reference_split(const std::string& text, const std::vector<std::pair<std::string, int64_t>>& added,
                     const std::function<void(const std::string&, bool)>& plain, const std::function<void(int64_t)>& hit) {
  size_t start = 0;
  while (start < text.size()) {
    size_t at = std::string::npos;
    const std::pair<std::string, int64_t>* h = nullptr;
    for (const auto& a : added) {
      const size_t p = text.find(a.first, start);
      if (p < at) at = p, h = &a;
    }
    if (!h) break;
    plain(text.substr(start, at - start), start == 0);
    hit(h->second);
    start = at + h->first.size();
  }
  if (start < text.size()) plain(text.substr(start), start == 0);
}

// A byte-level tokenizer over `alphabet` with `n` random merges (pairs of any tokens so far, some
// of them making a token another merge already makes), written as vocab.json + merges.txt.
struct RandomByteBpe {
  std::string dir;
  Ranks rank;
  std::map<std::string, int64_t> vocab;
};
RandomByteBpe random_byte_bpe(std::mt19937& rng, const std::string& alphabet, int n, const std::string& tag) {
  RandomByteBpe r;
  r.dir = (fs::temp_directory_path() / ("ts-bpe-rand-" + tag + "-" + std::to_string(::getpid()))).string();
  fs::create_directories(r.dir);
  for (int b = 0; b < 256; ++b) r.vocab[byte_char(b)] = b;
  std::vector<std::string> toks;
  for (unsigned char c : alphabet) toks.push_back(byte_char(c));
  std::ofstream m(r.dir + "/merges.txt");
  m << "#version: 0.2\n";
  for (int i = 0; i < n; ++i) {
    const std::string& a = toks[rng() % toks.size()];
    const std::string& b = toks[rng() % toks.size()];
    if (r.rank.count({a, b})) continue;
    r.rank[{a, b}] = static_cast<double>(r.rank.size());
    m << a << " " << b << "\n";
    if (r.vocab.emplace(a + b, static_cast<int64_t>(r.vocab.size())).second) toks.push_back(a + b);
  }
  nlohmann::json v(r.vocab);
  std::ofstream(r.dir + "/vocab.json") << v.dump();
  return r;
}

std::vector<int64_t> reference_byte_level(const RandomByteBpe& r, const std::string& text) {
  std::vector<int64_t> out;
  for (const auto& piece : BpeTokenizer::pre_tokenize(text)) {
    std::vector<std::string> sym;
    for (unsigned char c : piece) sym.push_back(byte_char(c));
    for (const auto& s : reference_merges(sym, r.rank)) out.push_back(r.vocab.at(s));
  }
  return out;
}

std::string random_text(std::mt19937& rng, const std::vector<std::string>& parts, size_t len) {
  std::string s;
  while (s.size() < len) s += parts[rng() % parts.size()];
  return s;
}

const std::string kMeta = "\xE2\x96\x81";

// A GGUF SentencePiece vocabulary ("llama": tokens with scores, merged highest score first, equal
// scores leftmost first): <unk>, <s>, </s>, the 256 byte tokens, ▁ a b c, and `n` random tokens
// made of two tokens so far, whose scores come from a few values (many ties between pairs).
struct RandomSpm {
  std::string path;
  Ranks rank;
  std::map<std::string, int64_t> vocab;
};
RandomSpm random_spm(std::mt19937& rng, int n, const std::string& tag, std::vector<std::string> extra = {}) {
  RandomSpm r;
  r.path = (fs::temp_directory_path() / ("ts-spm-rand-" + tag + "-" + std::to_string(::getpid()) + ".gguf")).string();
  std::vector<std::string> tokens{"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types{2, 3, 3};
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">");
    types.push_back(6);
  }
  std::vector<float> scores(tokens.size(), 0.f);
  std::vector<std::string> normal{kMeta, "a", "b", "c"};
  normal.insert(normal.end(), extra.begin(), extra.end());
  std::map<std::string, float> score;
  for (const auto& t : normal) score[t] = -1000.f;
  for (int i = 0; i < n; ++i) {
    const std::string t = normal[rng() % normal.size()] + normal[rng() % normal.size()];
    if (score.count(t)) continue;
    score[t] = -static_cast<float>(rng() % 4);
    normal.push_back(t);
  }
  for (const auto& t : normal) {
    r.vocab[t] = static_cast<int64_t>(tokens.size());
    tokens.push_back(t);
    types.push_back(1);
    scores.push_back(score[t]);
  }
  for (size_t i = 0; i < 3; ++i) r.vocab[tokens[i]] = static_cast<int64_t>(i);
  // Every split of a token into two tokens merges at the token's score (Note [SentencePiece-style BPE]).
  for (const auto& [t, s] : score) {
    for (size_t k = 1; k < t.size(); ++k) {
      if ((static_cast<unsigned char>(t[k]) & 0xC0) == 0x80) continue;  // inside a character
      const std::string a = t.substr(0, k), b = t.substr(k);
      if (score.count(a) && score.count(b)) r.rank[{a, b}] = -s;
    }
  }
  namespace gguf = torchspeed::checkpoint::gguf;
  gguf::write(r.path, {{"tokenizer.ggml.model", std::string("llama")}, {"tokenizer.ggml.tokens", tokens},
                       {"tokenizer.ggml.scores", scores}, {"tokenizer.ggml.token_type", types},
                       {"tokenizer.ggml.unknown_token_id", uint32_t{0}}, {"tokenizer.ggml.bos_token_id", uint32_t{1}},
                       {"tokenizer.ggml.eos_token_id", uint32_t{2}}},
              {});
  return r;
}

// What the GGUF SentencePiece tokenizer computes, from the definitions: <s> and </s> split off
// first, each span between them gets "▁" in front and its spaces as "▁", then the merges.
std::vector<int64_t> reference_spm(const RandomSpm& r, const std::string& text) {
  std::vector<int64_t> out;
  reference_split(
      text, {{"</s>", 2}, {"<s>", 1}},
      [&](const std::string& span, bool) {
        if (span.empty()) return;
        std::vector<std::string> sym{kMeta};
        for (char c : span) sym.push_back(c == ' ' ? kMeta : std::string(1, c));
        for (const auto& s : reference_merges(sym, r.rank)) out.push_back(r.vocab.at(s));
      },
      [&](int64_t id) { out.push_back(id); });
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

// The heap merge (lowest rank, leftmost among equals) equals the rescanning definition on random
// byte-level vocabularies (some tokens made by two merges) and random texts.
TEST(Bpe, HeapMergesEqualTheRescanningDefinitionByteLevel) {
  std::mt19937 rng(35);
  for (int v = 0; v < 12; ++v) {
    const RandomByteBpe r = random_byte_bpe(rng, v % 2 ? "abc " : "ab", 40 + 20 * v, std::to_string(v));
    const BpeTokenizer t = BpeTokenizer::from_folder(r.dir);
    for (int i = 0; i < 150; ++i) {
      const std::string s = random_text(rng, {"a", "b", "c", " ", "ab", "aa"}, rng() % 160);
      ASSERT_EQ(t.encode(s), reference_byte_level(r, s)) << "vocabulary " << v << ", text '" << s << "'";
    }
    fs::remove_all(r.dir);
  }
}

// The same for GGUF SentencePiece vocabularies, whose merges share ranks (equal scores): between
// pairs of one rank the leftmost merges first. Control tokens split the text first.
TEST(Bpe, HeapMergesEqualTheRescanningDefinitionSentencePiece) {
  std::mt19937 rng(36);
  for (int v = 0; v < 12; ++v) {
    const RandomSpm r = random_spm(rng, 30 + 15 * v, std::to_string(v));
    const BpeTokenizer t = BpeTokenizer::from_gguf(r.path);
    for (int i = 0; i < 150; ++i) {
      const std::string s = random_text(rng, {"a", "b", "c", " ", "ab", "ca", "</s>", "<s>"}, rng() % 160);
      ASSERT_EQ(t.encode(s), reference_spm(r, s)) << "vocabulary " << v << ", text '" << s << "'";
    }
    fs::remove(r.path);
  }
}

// A 200,000-byte run without spaces (one piece for the merges) and random base64 encode in far
// less than the quadratic loop's minutes. The time box is loose on purpose (a loaded machine);
// the ids are checked against the definition on a shorter run.
TEST(Bpe, LongRunsWithoutSpacesEncodeInLinearishTime) {
  std::mt19937 rng(37);
  std::vector<std::pair<std::string, std::string>> merges{{"a", "a"}, {"aa", "aa"}, {"aaaa", "aaaa"}, {"aaaaaaaa", "aaaaaaaa"},
                                                          {"b", "a"}, {"ba", "a"}, {"c", "d"}, {"x", "y"}};
  const std::string dir = write_tokenizer(merges);
  const BpeTokenizer t = BpeTokenizer::from_folder(dir);
  RandomByteBpe r;
  r.dir = dir;
  for (int b = 0; b < 256; ++b) r.vocab[byte_char(b)] = b;
  for (size_t i = 0; i < merges.size(); ++i) {
    r.rank[merges[i]] = static_cast<double>(i);
    r.vocab[merges[i].first + merges[i].second] = 256 + static_cast<int64_t>(i);
  }
  const std::string run(200000, 'a');
  auto t0 = std::chrono::steady_clock::now();
  const auto ids = t.encode(run);
  const double s_run = seconds_since(t0);
  EXPECT_EQ(ids.size(), 200000u / 16);  // 12,500 tokens of 16 a's
  EXPECT_EQ(t.decode(ids), run);
  for (size_t len : {1u, 2u, 3u, 17u, 1000u, 2023u}) {
    const std::string s(len, 'a');
    EXPECT_EQ(t.encode(s), reference_byte_level(r, s)) << len;
  }
  const std::string b64chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string b64;
  for (int i = 0; i < 200000; ++i) b64 += b64chars[rng() % 64];
  t0 = std::chrono::steady_clock::now();
  const auto b64_ids = t.encode(b64);
  const double s_b64 = seconds_since(t0);
  EXPECT_EQ(t.decode(b64_ids), b64);
  EXPECT_EQ(t.encode(b64.substr(0, 3000)), reference_byte_level(r, b64.substr(0, 3000)));
  // SentencePiece style: the whole text is one word.
  const RandomSpm spm = random_spm(rng, 0, "run", {"aa", "aaaa", "aaaaaaaa"});
  const BpeTokenizer ts = BpeTokenizer::from_gguf(spm.path);
  t0 = std::chrono::steady_clock::now();
  const auto spm_ids = ts.encode(run);
  const double s_spm = seconds_since(t0);
  EXPECT_EQ(ts.decode(spm_ids), " " + run);
  for (size_t len : {1u, 7u, 999u}) {
    const std::string s(len, 'a');
    EXPECT_EQ(ts.encode(s), reference_spm(spm, s)) << len;
  }
  std::printf("200,000 bytes: a run %.3f s, base64 %.3f s, SentencePiece run %.3f s\n", s_run, s_b64, s_spm);
  EXPECT_LT(s_run + s_b64 + s_spm, 6.0);
  fs::remove_all(dir);
  fs::remove(spm.path);
}

// Many added tokens (overlapping ones: the earliest match wins, the longest at one position), in
// a long text: one scan, with the pieces between them exactly as the per-token search made them.
TEST(Bpe, ManyAddedTokensSplitInOneScan) {
  const std::string dir = write_tokenizer({{"h", "e"}, {"x", "x"}});
  using json = nlohmann::json;
  json vocab = json::parse(std::ifstream(dir + "/vocab.json"));
  json merges = json::array({"h e", "x x"});
  const std::vector<std::string> added_text{"<|a|>", "<|a|>x", "<|b|>", "<|never|>", "|>|", "<|", "<|a|>xx"};
  std::vector<std::pair<std::string, int64_t>> added;
  json added_json = json::array();
  for (size_t i = 0; i < added_text.size(); ++i) {
    added.emplace_back(added_text[i], 300 + static_cast<int64_t>(i));
    added_json.push_back({{"id", 300 + i}, {"content", added_text[i]}, {"special", true}});
  }
  std::stable_sort(added.begin(), added.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  json j = {{"added_tokens", added_json}, {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  const std::string path = dir + "/tokenizer.json";
  std::ofstream(path) << j.dump();
  const BpeTokenizer t = BpeTokenizer::from_tokenizer_json(path);
  auto reference = [&](const std::string& text) {
    std::vector<int64_t> out;
    reference_split(
        text, added,
        [&](const std::string& span, bool) {
          const auto ids = t.encode(span);  // a span holds no whole added token
          out.insert(out.end(), ids.begin(), ids.end());
        },
        [&](int64_t id) { out.push_back(id); });
    return out;
  };
  std::mt19937 rng(38);
  const std::vector<std::string> parts{"<|a|>", "<|a|>x", "x", "<|b|>", "<|", "|>", " he", "<", "|", "<|a", "a|>", "\xc3"};
  for (int i = 0; i < 500; ++i) {
    const std::string s = random_text(rng, parts, rng() % 80);
    ASSERT_EQ(t.encode(s), reference(s)) << "'" << s << "'";
  }
  const std::string big = random_text(rng, parts, 200000);
  auto t0 = std::chrono::steady_clock::now();
  const auto ids = t.encode(big);
  const double secs = seconds_since(t0);
  EXPECT_EQ(t.decode(ids), big);
  const std::string mid = big.substr(0, 20000);
  EXPECT_EQ(t.encode(mid), reference(mid));
  const auto matches = std::count_if(ids.begin(), ids.end(), [](int64_t id) { return id >= 300; });
  std::printf("200,000 bytes with %td added-token matches: %.3f s\n", matches, secs);
  EXPECT_LT(secs, 2.0);
  fs::remove_all(dir);
}

// Under a Metaspace pre-tokenizer, text that starts with an added token, or two adjacent added
// tokens, leave no span between them to encode: no lone "▁" token (ids as Hugging Face's
// tokenizers 0.23.3 gives them for this tokenizer.json).
TEST(Bpe, MetaspaceMakesNoTokenOfAnEmptySpanBetweenAddedTokens) {
  using json = nlohmann::json;
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {kMeta, 3}, {"a", 4}, {kMeta + "a", 5}};
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) vocab[std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">"] = 6 + b;
  const fs::path path = fs::temp_directory_path() / ("ts-metaspace-" + std::to_string(::getpid()) + ".json");
  for (const std::string scheme : {"always", "first"}) {
    json j = {{"added_tokens", json::array({json{{"id", 1}, {"content", "<s>"}, {"special", true}},
                                            json{{"id", 2}, {"content", "</s>"}, {"special", true}}})},
              {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", scheme}, {"split", true}}},
              {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"byte_fallback", true}, {"fuse_unk", true}, {"vocab", vocab},
                         {"merges", json::array({kMeta + " a"})}}}};
    std::ofstream(path) << j.dump();
    const BpeTokenizer t = BpeTokenizer::from_tokenizer_json(path.string());
    const bool always = scheme == "always";
    EXPECT_EQ(t.encode("</s>a"), (std::vector<int64_t>{2, always ? 5 : 4})) << scheme;
    EXPECT_EQ(t.encode("a</s></s>a"), (std::vector<int64_t>{5, 2, 2, always ? 5 : 4})) << scheme;
    EXPECT_EQ(t.encode("<s>"), (std::vector<int64_t>{1})) << scheme;
    EXPECT_EQ(t.encode("a</s>"), (std::vector<int64_t>{5, 2})) << scheme;
    EXPECT_EQ(t.normalized("<s></s>a"), always ? "<s></s> a" : "<s></s>a") << scheme;
  }
  fs::remove(path);
}

namespace {
// A GGUF SentencePiece vocabulary of `tokens` (types and scores alike) and `extra` metadata.
void write_gguf_spm(const std::string& path, const std::vector<std::string>& tokens, const std::vector<int32_t>& types,
                    const torchspeed::checkpoint::gguf::Metadata& extra = {}) {
  namespace gguf = torchspeed::checkpoint::gguf;
  gguf::Metadata md{{"tokenizer.ggml.model", std::string("llama")}, {"tokenizer.ggml.tokens", tokens},
                    {"tokenizer.ggml.scores", std::vector<float>(tokens.size(), 0.f)}, {"tokenizer.ggml.token_type", types}};
  md.insert(md.end(), extra.begin(), extra.end());
  gguf::write(path, md, {});
}
}  // namespace

// Token ids index the id table: tokenizer.json's and GGUF's ids outside the vocabulary, and ids
// or contents standing for two tokens, are errors naming the file, the entry and the id.
TEST(Bpe, TokenIdsFromFilesAreValidated) {
  using json = nlohmann::json;
  const std::string dir = write_tokenizer({{"h", "e"}});
  const json vocab = json::parse(std::ifstream(dir + "/vocab.json"));  // 257 tokens, ids 0..256
  const std::string path = dir + "/tokenizer.json";
  auto write = [&](const json& v, const json& added) {
    json j = {{"added_tokens", added},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
              {"model", {{"type", "BPE"}, {"vocab", v}, {"merges", json::array({"h e"})}}}};
    std::ofstream(path) << j.dump();
  };
  auto added = [](int64_t id, const std::string& content) { return json{{"id", id}, {"content", content}, {"special", true}}; };
  json v = vocab;
  v["bad"] = -1;
  write(v, json::array());
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); }, "token 'bad' has id -1, outside [0, ");
  v = vocab;
  v["bad"] = json::parse("18446744073709551615");  // wraps to -1 as int64
  write(v, json::array());
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); },
                        "tokenizer.json: model.vocab['bad'] has id 18446744073709551615, past any vocabulary");
  write(vocab, json::array({added(int64_t{1} << 31, "<big>")}));
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); },
                        "added_tokens[0] (\"<big>\") has id 2147483648, outside [0, 1540] (257 ids in the vocabulary)");
  write(vocab, json::array({added(-7, "<neg>")}));
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); }, "added_tokens[0] (\"<neg>\") has id -7, outside [0, ");
  write(vocab, json::array({added(300, "")}));
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); }, "added_tokens[0] (id 300) has an empty content");
  write(vocab, json::array({added(300, "<x>"), added(301, "<x>")}));
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); },
                        "added_tokens[1] (\"<x>\") has id 301, but \"<x>\" is token 300 of an earlier added token");
  write(vocab, json::array({added(300, "<x>"), added(300, "<y>")}));
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); },
                        "added_tokens[1] (\"<y>\") has id 300, which is already \"<x>\"");
  write(vocab, json::array({added(256, "<x>")}));  // 256 is "he"
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); }, "added_tokens[0] (\"<x>\") has id 256, which is already \"he\"");
  write(vocab, json::array({added(300, "he")}));
  ts_test::expect_error([&] { BpeTokenizer::from_tokenizer_json(path); },
                        "added_tokens[0] (\"he\") has id 300, but \"he\" is token 256 of the vocabulary");
  // The same token listed twice, or an added token the vocabulary holds under its id, is fine.
  write(vocab, json::array({added(300, "<x>"), added(300, "<x>"), added(256, "he")}));
  const BpeTokenizer t = BpeTokenizer::from_tokenizer_json(path);
  EXPECT_EQ(t.vocab_size(), 301);
  EXPECT_EQ(t.encode("<x>he<x>"), (std::vector<int64_t>{300, 256, 300}));
  EXPECT_EQ(t.token_bytes(300), "<x>");
  fs::remove_all(dir);

  // GGUF: ids are the tokens' indexes; the metadata's ids must name one of them.
  const std::string gpath = (fs::temp_directory_path() / ("ts-gguf-ids-" + std::to_string(::getpid()) + ".gguf")).string();
  std::vector<std::string> toks{"<unk>", "<s>", "</s>", kMeta, "a", kMeta + "a"};
  std::vector<int32_t> types{2, 3, 3, 1, 1, 1};
  write_gguf_spm(gpath, toks, types, {{"tokenizer.ggml.eos_token_id", uint32_t{99999}}});
  ts_test::expect_error([&] { BpeTokenizer::from_gguf(gpath); }, "tokenizer.ggml.eos_token_id 99999 is outside the 6 tokens");
  write_gguf_spm(gpath, toks, types, {{"tokenizer.ggml.bos_token_id", int32_t{-3}}});
  ts_test::expect_error([&] { BpeTokenizer::from_gguf(gpath); }, "tokenizer.ggml.bos_token_id -3 is outside the 6 tokens");
  // A string listed twice keeps its first id for encoding (a control token too); the later
  // indexes (here the last, which left the id table one short) keep their strings for decoding,
  // so the table covers every id: the GGUF write-back, which marks added ids in a table of the
  // vocabulary's size, stays inside it, and the tokenizer.json write-back reads back alike.
  toks.insert(toks.end(), {"</s>", "a"});
  types.insert(types.end(), {1, 3});
  write_gguf_spm(gpath, toks, types);
  const BpeTokenizer g = BpeTokenizer::from_gguf(gpath);
  EXPECT_EQ(g.vocab_size(), 8);
  EXPECT_EQ(g.token_bytes(6), "</s>");
  EXPECT_EQ(g.token_bytes(7), "a");
  EXPECT_EQ(g.encode("a</s>"), (std::vector<int64_t>{5, 2}));
  EXPECT_EQ(g.gguf_vocab(g.vocab_size()).tokens, toks);
  std::ofstream(gpath + ".json") << g.to_tokenizer_json().dump();
  EXPECT_EQ(BpeTokenizer::from_tokenizer_json(gpath + ".json").encode("a</s>a"), g.encode("a</s>a"));
  fs::remove(gpath + ".json");
  fs::remove(gpath);
}
