// Structured output (inference/structured.h): the grammar accepts exactly the texts its schema
// admits, the mask allows exactly the tokens accept() takes, and text sampled under the mask
// from random logits always parses and holds to the schema.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "torchspeed/data/text.h"
#include "torchspeed/data/tokenizer.h"
#include "torchspeed/inference/sampler.h"
#include "torchspeed/inference/structured.h"

using namespace torchspeed::inference;
using nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {
// Every byte, then multi-byte pieces as a BPE vocabulary has them (some crossing JSON's
// structure: `":`, `",`, `{"`, `}]`), then an end-of-text token.
class PieceTokenizer : public torchspeed::data::Tokenizer {
 public:
  PieceTokenizer() {
    for (int b = 0; b < 256; ++b) pieces_.push_back(std::string(1, static_cast<char>(b)));
    for (const char* p : {"\":", "\",", "{\"", "}]", "\"name", "name", "age", "\":\"", "true", "false", "null", "12",
                          "0.", "e+", " \"", "\"}", "\"]", "[\"", "tags", "ok", "score", "\\u00", "\xC3\xA9", "\xE2\x82"}) {
      pieces_.push_back(p);
    }
    eos_ = static_cast<int64_t>(pieces_.size());
    pieces_.push_back("<|end|>");
  }
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> out;
    for (unsigned char c : text) out.push_back(c);
    return out;
  }
  std::string token_bytes(int64_t id) const override { return pieces_.at(static_cast<size_t>(id)); }
  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  int64_t eos_id() const override { return eos_; }
  std::string source() const override { return "pieces"; }

 private:
  std::vector<std::string> pieces_;
  int64_t eos_ = -1;
};

bool accepts(const GrammarPtr& g, const std::shared_ptr<const TokenTrie>& trie, const std::string& text, int64_t eos) {
  GrammarMatcher m(g, trie, {eos});
  for (unsigned char c : text) {
    if (!m.accept(c)) return false;
  }
  return m.complete();
}

const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "ok": {"type": "boolean"},
    "score": {"type": ["number", "null"]},
    "child": {"$ref": "#/$defs/node"}
  },
  "required": ["name", "age"],
  "additionalProperties": false,
  "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}}
})";

// The schema's rules, checked on a parsed value (independent of the grammar).
void expect_valid(const json& v, const std::string& text) {
  ASSERT_TRUE(v.is_object()) << text;
  ASSERT_TRUE(v.contains("name") && v["name"].is_string()) << text;
  EXPECT_LE(v["name"].get<std::string>().size(), 8u * 4) << text;
  ASSERT_TRUE(v.contains("age") && v["age"].is_number_integer()) << text;
  for (const auto& [k, x] : v.items()) {
    EXPECT_TRUE(k == "name" || k == "age" || k == "tags" || k == "ok" || k == "score" || k == "child") << text;
  }
  if (v.contains("tags")) {
    ASSERT_TRUE(v["tags"].is_array()) << text;
    EXPECT_LE(v["tags"].size(), 3u) << text;
    for (const auto& t : v["tags"]) EXPECT_TRUE(t == "a" || t == "b") << text;
  }
  if (v.contains("ok")) {
    EXPECT_TRUE(v["ok"].is_boolean()) << text;
  }
  if (v.contains("score")) {
    EXPECT_TRUE(v["score"].is_number() || v["score"].is_null()) << text;
  }
  for (const json* n = v.contains("child") ? &v["child"] : nullptr; n && !n->is_null(); n = &(*n)["next"]) {
    ASSERT_TRUE(n->is_object() && n->contains("v") && (*n)["v"].is_number_integer() && n->contains("next")) << text;
  }
}
}  // namespace

TEST(Structured, AcceptsWhatTheSchemaAdmits) {
  PieceTokenizer tok;
  auto trie = std::make_shared<const TokenTrie>(tok, tok.vocab_size());
  const auto g = Grammar::json_schema(ojson::parse(kSchema));
  const int64_t eos = tok.eos_id();
  for (const char* ok : {R"({"name":"x","age":3})", R"({"name":"","age":-10,"ok":true})",
                         R"({"name": "é\n\u00e9", "age": 0, "tags": ["a", "b"], "score": 1.5e+3})",
                         R"({"name":"ab","age":7,"score":null,"child":{"v":1,"next":{"v":2,"next":null}}})",
                         R"({"name":"ab","age":7,"tags":[]})"}) {
    EXPECT_TRUE(accepts(g, trie, ok, eos)) << ok;
    EXPECT_TRUE(json::accept(ok)) << ok;
  }
  for (const char* bad : {R"({"age":3,"name":"x"})",          // out of the schema's order
                          R"({"name":"x"})",                   // age is required
                          R"({"name":"x","age":3.5})",         // not an integer
                          R"({"name":"123456789","age":1})",   // maxLength 8
                          R"({"name":"x","age":1,"tags":["c"]})", R"({"name":"x","age":1,"tags":["a","a","b","a"]})",
                          R"({"name":"x","age":01})", R"({"name":"x","age":1,})", R"({"name":"x","age":1} )",
                          R"({"name":"x","age":1,"extra":1})", R"({"name":"x","age":1,"child":{"v":1}})",
                          "{\"name\":\"\x01\",\"age\":1}", "{\"name\":\"\xFF\",\"age\":1}", R"({ "name":"x","age":1})"}) {
    EXPECT_FALSE(accepts(g, trie, bad, eos)) << bad;
  }
  EXPECT_TRUE(accepts(Grammar::json_object(), trie, R"({"a":[1,{"b":null}],"c":"d"})", eos));
  EXPECT_FALSE(accepts(Grammar::json_object(), trie, R"([1])", eos));
  EXPECT_TRUE(accepts(Grammar::choice({"yes", "no", "maybe"}), trie, "maybe", eos));
  EXPECT_FALSE(accepts(Grammar::choice({"yes", "no", "maybe"}), trie, "ma", eos));
}

TEST(Structured, RefusesWhatItCannotHoldTo) {
  auto path_of = [](const char* schema) {
    try {
      (void)Grammar::json_schema(ojson::parse(schema));
    } catch (const GrammarError& e) {
      return e.path;
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(path_of(R"({"type":"object","properties":{"age":{"type":"integer","minimum":0}}})"), "properties.age.minimum");
  EXPECT_EQ(path_of(R"({"type":"string","pattern":"(?=a)b"})"), "pattern");
  EXPECT_EQ(path_of(R"({"type":"string","pattern":"a+"})"), "(accepted)");
  EXPECT_EQ(path_of(R"({"type":"widget"})"), "type");
  EXPECT_EQ(path_of(R"({"$ref":"#/$defs/missing"})"), "$ref");
  EXPECT_EQ(path_of(R"({"type":"object","properties":{"a":{}},"required":["b"]})"), "required");
  EXPECT_EQ(path_of(R"({"title":"t","description":"d","type":"boolean"})"), "(accepted)");
}

// The mask allows a token exactly when accept() takes it, state after state.
TEST(Structured, MaskMatchesAccept) {
  PieceTokenizer tok;
  const int64_t vocab = tok.vocab_size();
  auto trie = std::make_shared<const TokenTrie>(tok, vocab);
  const auto g = Grammar::json_schema(ojson::parse(kSchema));
  GrammarMatcher m(g, trie, {tok.eos_id()});
  const std::string text = R"({"name":"é","age":12,"tags":["a"],"score":0.5})";
  std::vector<float> row(static_cast<size_t>(vocab));
  for (size_t i = 0; i <= text.size(); ++i) {
    std::fill(row.begin(), row.end(), 1.0f);
    m.mask(row.data(), vocab);
    for (int64_t t = 0; t < vocab; ++t) {
      GrammarMatcher probe = m;  // copy: accept moves it
      const bool allowed = row[static_cast<size_t>(t)] > -INFINITY;
      const bool takes = t == tok.eos_id() ? probe.complete() : probe.accept(t);
      ASSERT_EQ(allowed, takes) << "token " << t << " (" << tok.token_bytes(t) << ") after " << text.substr(0, i);
    }
    if (i < text.size()) {
      ASSERT_TRUE(m.accept(static_cast<unsigned char>(text[i])));
    }
  }
  EXPECT_TRUE(m.complete());
}

// Random logits, sampled under the mask: every text that ends parses and holds to the schema.
TEST(Structured, SampledTextsAlwaysHoldToTheSchema) {
  PieceTokenizer tok;
  const int64_t vocab = tok.vocab_size(), eos = tok.eos_id();
  auto trie = std::make_shared<const TokenTrie>(tok, vocab);
  const auto g = Grammar::json_schema(ojson::parse(kSchema));
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.0f, 2.0f);
  int ended = 0;
  for (int run = 0; run < 200; ++run) {
    SamplingParams p;
    p.seed = static_cast<uint64_t>(run);
    p.temperature = 1.0;
    Sampler s(p, eos);
    s.constrain(std::make_unique<GrammarMatcher>(g, trie, std::vector<int64_t>{eos}));
    std::string text;
    std::vector<float> row(static_cast<size_t>(vocab));
    for (int step = 0; step < 400; ++step) {
      for (auto& x : row) x = noise(rng);
      row[static_cast<size_t>(eos)] += 3.0f;  // end as soon as the grammar allows
      for (unsigned char c : std::string("}],\"")) row[c] += 2.0f;  // close things sooner
      const int64_t t = s.sample(row.data(), vocab, nullptr);
      if (t == eos) {
        ++ended;
        json v;
        ASSERT_NO_THROW(v = json::parse(text)) << text;
        expect_valid(v, text);
        break;
      }
      text += tok.token_bytes(t);
    }
  }
  EXPECT_GE(ended, 150);  // most runs end within 400 tokens
}

// Schemas whose alternatives refer to themselves, or multiply, are refused or stay bounded.
TEST(Structured, SelfReferenceAndBlowUpAreBounded) {
  EXPECT_THROW((void)Grammar::json_schema(ojson::parse(R"({"anyOf": [{"$ref": "#"}, {"type": "null"}]})")), GrammarError);
  // 2^30 paths of nested alternatives down to one literal: each byte's work is bounded.
  ojson defs = ojson::object();
  for (int i = 0; i < 30; ++i) {
    const std::string next = i + 1 < 30 ? "#/$defs/d" + std::to_string(i + 1) : "";
    defs["d" + std::to_string(i)] = next.empty() ? ojson{{"const", 1}} : ojson{{"anyOf", {{{"$ref", next}}, {{"$ref", next}}}}};
  }
  const auto g = Grammar::json_schema(ojson{{"$ref", "#/$defs/d0"}, {"$defs", defs}});
  torchspeed::data::ByteTokenizer bytes;
  auto trie = std::make_shared<const TokenTrie>(bytes, 256);
  GrammarMatcher m(g, trie, {});
  std::vector<float> row(256, 0.0f);
  m.mask(row.data(), 256);  // returns (the test's time bounds it)
  EXPECT_GT(row['1'], -INFINITY);
  EXPECT_EQ(row['2'], -INFINITY);
  ASSERT_TRUE(m.accept('1'));
  EXPECT_TRUE(m.finished());
}

namespace {
// UTF-8 to code points (wchar_t is 32 bits here): patterns count characters, as Python's re does.
std::wstring wide(const std::string& s) {
  std::wstring out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    uint32_t cp = n == 1 ? c : c & (0xFF >> (n + 1));
    for (int k = 1; k < n && i + static_cast<size_t>(k) < s.size(); ++k) cp = cp << 6 | (static_cast<unsigned char>(s[i + static_cast<size_t>(k)]) & 0x3F);
    out += static_cast<wchar_t>(cp);
    i += static_cast<size_t>(n);
  }
  return out;
}
}  // namespace

// Regular expressions (vLLM's structured_outputs.regex, and JSON Schema's pattern): texts
// sampled under the mask from random logits always match, checked with std::wregex.
TEST(Structured, RegexTextsAlwaysMatch) {
  PieceTokenizer tok;
  const int64_t vocab = tok.vocab_size(), eos = tok.eos_id();
  auto trie = std::make_shared<const TokenTrie>(tok, vocab);
  for (const char* pattern : {"(cat|dog)s?", "[A-Z][a-z]{2,5} [0-9]{3}-[0-9]{4}", "\\d+(\\.\\d{1,2})?", "(ab|a)*c",
                              "[^x\\n]{1,8}!", "https?://[a-z]+\\.(com|org)/[a-z0-9_]*"}) {
    const auto g = Grammar::regex(pattern);
    const std::wregex re(wide(pattern));
    std::mt19937 rng(3);
    std::normal_distribution<float> noise(0.0f, 2.0f);
    int ended = 0;
    for (int run = 0; run < 60; ++run) {
      SamplingParams p;
      p.seed = static_cast<uint64_t>(run);
      Sampler s(p, eos);
      s.constrain(std::make_unique<GrammarMatcher>(g, trie, std::vector<int64_t>{eos}));
      std::string text;
      std::vector<float> row(static_cast<size_t>(vocab));
      for (int step = 0; step < 200; ++step) {
        for (auto& x : row) x = noise(rng);
        row[static_cast<size_t>(eos)] += 2.0f;
        const int64_t t = s.sample(row.data(), vocab, nullptr);
        if (t == eos) break;
        text += tok.token_bytes(t);
        if (s.matcher()->finished()) break;
      }
      if (s.matcher()->complete()) {
        ++ended;
        EXPECT_TRUE(std::regex_match(wide(text), re)) << pattern << ": " << text;
      }
    }
    EXPECT_GE(ended, 40) << pattern;
  }
  EXPECT_THROW((void)Grammar::regex("a(?=b)"), GrammarError);
  EXPECT_THROW((void)Grammar::regex("(a"), GrammarError);
  EXPECT_THROW((void)Grammar::regex("a{3,2}"), GrammarError);
  EXPECT_THROW((void)Grammar::regex("a{2}{3}"), GrammarError);  // Python's "multiple repeat"
  EXPECT_THROW((void)Grammar::regex("(a|b){200}{200}"), GrammarError);
  // JSON Schema's pattern is a search inside the string; the string never needs escapes.
  const auto g = Grammar::json_schema(ojson::parse(R"({"type":"object","properties":{"id":{"type":"string","pattern":"^[A-Z]{3}-\\d{2}$"},"note":{"type":"string","pattern":"ok"}},"required":["id","note"]})"));
  EXPECT_TRUE(accepts(g, trie, R"({"id":"ABC-12","note":"is ok here"})", eos));
  EXPECT_FALSE(accepts(g, trie, R"({"id":"ABC-123","note":"ok"})", eos));
  EXPECT_FALSE(accepts(g, trie, R"({"id":"ABC-12","note":"no"})", eos));
  EXPECT_FALSE(accepts(g, trie, R"({"id":"ABC-12","note":"o\"k ok"})", eos));
}
