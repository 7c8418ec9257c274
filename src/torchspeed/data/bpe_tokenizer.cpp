// GPT-2's byte-level BPE (Note [GPT-2 pre-tokenization]).
#include "torchspeed/data/bpe_tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <sstream>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/file.h"

namespace torchspeed::data {
namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// A code point and its bytes in the text; an invalid byte is one code point of its own that is
// neither letter, number nor space.
struct CodePoint {
  uint32_t cp;
  size_t begin, len;
};
constexpr uint32_t kInvalid = 0xFFFFFFFFu;

std::vector<CodePoint> code_points(const std::string& s) {
  std::vector<CodePoint> out;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (!ok) {
      out.push_back({kInvalid, i, 1});
      ++i;
      continue;
    }
    out.push_back({cp, i, len});
    i += len;
  }
  return out;
}

enum class Cls { kLetter, kNumber, kSpace, kOther };

// Unicode's White_Space property (the regex \s).
bool is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// \p{N}: ASCII digits, Latin-1's superscripts and fractions, and the common digit blocks.
bool is_number(uint32_t c) {
  if (c >= '0' && c <= '9') return true;
  if (c == 0xB2 || c == 0xB3 || c == 0xB9 || (c >= 0xBC && c <= 0xBE)) return true;
  static const uint32_t digit_blocks[] = {0x0660, 0x06F0, 0x07C0, 0x0966, 0x09E6, 0x0A66, 0x0AE6, 0x0B66, 0x0BE6,
                                          0x0C66, 0x0CE6, 0x0D66, 0x0E50, 0x0ED0, 0x0F20, 0x1040, 0xFF10};
  for (uint32_t b : digit_blocks)
    if (c >= b && c < b + 10) return true;
  return (c >= 0x2070 && c <= 0x2079 && c != 0x2071 && c != 0x2072 && c != 0x2073) || (c >= 0x2080 && c <= 0x2089) ||
         (c >= 0x2150 && c <= 0x2189) || (c >= 0x2460 && c <= 0x249B) || (c >= 0x2776 && c <= 0x2793);
}

// \p{L}: ASCII letters; beyond ASCII the letter ranges of the scripts in use, leaving out the
// symbol and punctuation blocks (Latin-1's and General Punctuation's, currency, arrows, math,
// box drawing, dingbats, CJK punctuation).
bool is_letter(uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (c < 0x100) return c == 0xAA || c == 0xB5 || c == 0xBA || (c >= 0xC0 && c != 0xD7 && c != 0xF7);
  if (c < 0x2B0) return true;                       // Latin Extended, IPA
  if (c >= 0x2B0 && c < 0x370) return c <= 0x2C1 || (c >= 0x2C6 && c <= 0x2D1) || (c >= 0x2E0 && c <= 0x2E4) ||
                                      c == 0x2EC || c == 0x2EE;  // modifier letters; combining marks are not
  if (c >= 0x370 && c < 0x530) return c != 0x37E && c != 0x387 && c != 0x375 && c != 0x3F6 && !(c >= 0x482 && c <= 0x489);
  if (c >= 0x2000 && c < 0x2C00) return (c >= 0x2090 && c <= 0x209C) || c == 0x2071 || c == 0x207F || c == 0x2102 ||
                                        c == 0x2107 || (c >= 0x210A && c <= 0x2113) || c == 0x2115 ||
                                        (c >= 0x2119 && c <= 0x211D) || c == 0x2124 || c == 0x2126 || c == 0x2128 ||
                                        (c >= 0x212A && c <= 0x212D) || (c >= 0x212F && c <= 0x2139);
  if (c >= 0x3000 && c < 0x3040) return c == 0x3005 || c == 0x3006 || (c >= 0x3031 && c <= 0x3035) || c == 0x303B || c == 0x303C;
  if (c >= 0xFF00 && c < 0xFFF0) return (c >= 0xFF21 && c <= 0xFF3A) || (c >= 0xFF41 && c <= 0xFF5A) || c >= 0xFF66;
  if (c >= 0x530 && c < 0x2000) return !(c >= 0x591 && c <= 0x5C7) && !(c >= 0x600 && c <= 0x61F) && !(c >= 0x64B && c <= 0x66D);
  if (c >= 0xE000 && c < 0xF900) return false;  // private use
  return c >= 0x3040 && c < 0x10FFFF;               // kana, CJK, Hangul and beyond
}

Cls classify(uint32_t c) {
  if (c == kInvalid) return Cls::kOther;
  if (is_space(c)) return Cls::kSpace;
  if (is_letter(c)) return Cls::kLetter;
  if (is_number(c)) return Cls::kNumber;
  return Cls::kOther;
}

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the rest to U+0100 onwards.
void make_byte_map(std::string (&to_unicode)[256], std::unordered_map<std::string, uint8_t>& to_byte) {
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    to_unicode[b] = utf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++));
    to_byte[to_unicode[b]] = static_cast<uint8_t>(b);
  }
}

}  // namespace

// Note [Pre-tokenizer steps]
// What `tokenizers` composes in a pre_tokenizer Sequence, applied in order, each to every piece
// the steps before made: Split with a regex (behavior Isolated: matches and the text between
// them are pieces; Removed: matches dropped), Digits (individual_digits: each number character a
// piece), and ByteLevel (use_regex: GPT-2's pattern; without it no split). Regexes run on PCRE2
// in UTF mode with Unicode properties (PCRE2_UCP), as Oniguruma does for `tokenizers`.
struct BpeTokenizer::PreStep {
  enum class Kind { kGpt2, kDigits, kRegex } kind = Kind::kGpt2;
  bool removed = false;
  std::string pattern;
  std::shared_ptr<pcre2_code> re;
  std::vector<std::string> split(const std::string& text) const;
};

namespace {
// The patterns llama.cpp names in tokenizer.ggml.pre, as the models' tokenizer.json spell them.
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::shared_ptr<const BpeTokenizer::PreStep> step_of(BpeTokenizer::PreStep::Kind k) {
  auto st = std::make_shared<BpeTokenizer::PreStep>();
  st->kind = k;
  return st;
}

std::shared_ptr<const BpeTokenizer::PreStep> regex_step(const std::string& pattern, bool removed, const std::string& source) {
  auto st = std::make_shared<BpeTokenizer::PreStep>();
  st->kind = BpeTokenizer::PreStep::Kind::kRegex;
  st->removed = removed;
  st->pattern = pattern;
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                                 &offset, nullptr);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    TS_CHECK(false, source, ": the pre-tokenizer pattern does not compile at offset ", offset, ": ",
             reinterpret_cast<const char*>(msg), " (pattern ", pattern, ")");
  }
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // optional: falls back to the interpreter
  st->re = std::shared_ptr<pcre2_code>(re, pcre2_code_free);
  return st;
}

// SentencePiece's U+2581 "▁" back to spaces (Note [SentencePiece-style BPE]).
std::string meta_to_spaces(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (s.compare(i, 3, "\xE2\x96\x81") == 0) {
      out += ' ';
      i += 3;
    } else {
      out += s[i++];
    }
  }
  return out;
}

// Whether s is valid UTF-8 (PCRE2 in UTF mode refuses anything else).
bool valid_utf8(const std::string& s) {
  for (const CodePoint& c : code_points(s)) {
    if (c.cp == kInvalid) return false;
  }
  return true;
}

// NFC of valid UTF-8 text through ICU; text that is not valid UTF-8 is returned as it is.
std::string nfc(const std::string& text) {
  bool ascii = true;
  for (unsigned char c : text) ascii = ascii && c < 0x80;
  if (ascii || !valid_utf8(text)) return text;
  UErrorCode err = U_ZERO_ERROR;
  const UNormalizer2* n = unorm2_getNFCInstance(&err);
  TS_CHECK(U_SUCCESS(err), "ICU: no NFC normalizer: ", u_errorName(err));
  int32_t len16 = 0;
  u_strFromUTF8(nullptr, 0, &len16, text.data(), static_cast<int32_t>(text.size()), &err);
  err = U_ZERO_ERROR;
  std::vector<UChar> u16(static_cast<size_t>(len16) + 1);
  u_strFromUTF8(u16.data(), len16 + 1, nullptr, text.data(), static_cast<int32_t>(text.size()), &err);
  TS_CHECK(U_SUCCESS(err), "ICU: UTF-8 to UTF-16: ", u_errorName(err));
  int32_t cap = len16 * 3 + 16;
  std::vector<UChar> norm(static_cast<size_t>(cap));
  const int32_t nlen = unorm2_normalize(n, u16.data(), len16, norm.data(), cap, &err);
  TS_CHECK(U_SUCCESS(err), "ICU: NFC: ", u_errorName(err));
  int32_t len8 = 0;
  u_strToUTF8(nullptr, 0, &len8, norm.data(), nlen, &err);
  err = U_ZERO_ERROR;
  std::string out(static_cast<size_t>(len8), '\0');
  u_strToUTF8(out.data(), len8, nullptr, norm.data(), nlen, &err);
  TS_CHECK(U_SUCCESS(err) || err == U_STRING_NOT_TERMINATED_WARNING, "ICU: UTF-16 to UTF-8: ", u_errorName(err));
  return out;
}
}  // namespace

std::vector<std::string> BpeTokenizer::PreStep::split(const std::string& text) const {
  if (kind == Kind::kGpt2) return BpeTokenizer::pre_tokenize(text);
  std::vector<std::string> out;
  if (kind == Kind::kDigits) {
    size_t seg = 0;
    for (const CodePoint& c : code_points(text)) {
      if (c.cp == kInvalid || !is_number(c.cp)) continue;
      if (c.begin > seg) out.push_back(text.substr(seg, c.begin - seg));
      out.push_back(text.substr(c.begin, c.len));
      seg = c.begin + c.len;
    }
    if (seg < text.size()) out.push_back(text.substr(seg));
    return out;
  }
  // A regex: over valid UTF-8 runs (an invalid byte is a piece of its own).
  const auto cps = code_points(text);
  size_t i = 0;
  std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> md(pcre2_match_data_create_from_pattern(re.get(), nullptr),
                                                                     pcre2_match_data_free);
  while (i < cps.size()) {
    if (cps[i].cp == kInvalid) {
      out.push_back(text.substr(cps[i].begin, 1));
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && cps[j].cp != kInvalid) ++j;
    const size_t b = cps[i].begin, e = j < cps.size() ? cps[j].begin : text.size();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data() + b);
    const size_t len = e - b;
    size_t pos = 0, gap = 0;
    while (pos <= len) {
      const int rc = pcre2_match(re.get(), subject, len, pos, 0, md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      TS_CHECK(rc >= 0, "pre-tokenizer regex failed with PCRE2 error ", rc);
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const size_t ms = ov[0], me = ov[1];
      if (ms > gap) out.push_back(text.substr(b + gap, ms - gap));
      if (me > ms && !removed) out.push_back(text.substr(b + ms, me - ms));
      gap = me;
      if (me == ms) {  // an empty match: step over one character
        if (ms >= len) break;
        size_t step = 1;
        while (ms + step < len && (static_cast<unsigned char>(text[b + ms + step]) & 0xC0) == 0x80) ++step;
        pos = ms + step;
      } else {
        pos = me;
      }
    }
    if (gap < len) out.push_back(text.substr(b + gap, len - gap));
    i = j;
  }
  return out;
}

nlohmann::json BpeTokenizer::to_tokenizer_json() const {
  using json = nlohmann::json;
  auto byte_level = [](bool regex) {
    return json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", regex}};
  };
  json steps = json::array();
  bool byte_level_last = false;
  if (pre_.empty()) {
    steps.push_back(byte_level(true));
    byte_level_last = true;
  }
  for (const auto& st : pre_) {
    byte_level_last = st->kind == PreStep::Kind::kGpt2;
    if (st->kind == PreStep::Kind::kGpt2) steps.push_back(byte_level(true));
    if (st->kind == PreStep::Kind::kDigits) steps.push_back({{"type", "Digits"}, {"individual_digits", true}});
    if (st->kind == PreStep::Kind::kRegex) {
      steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", st->pattern}}}, {"behavior", st->removed ? "Removed" : "Isolated"},
                       {"invert", false}});
    }
  }
  if (!byte_level_last) steps.push_back(byte_level(false));  // the byte mapping, no further split
  json merges = json::array();
  for (const auto& [a, b] : merge_order_) {
    merges.push_back(id_to_token_[static_cast<size_t>(a)] + " " + id_to_token_[static_cast<size_t>(b)]);
  }
  json vocab = json::object();
  for (size_t id = 0; id < id_to_token_.size(); ++id) {
    if (!id_to_token_[id].empty()) vocab[id_to_token_[id]] = static_cast<int64_t>(id);
  }
  json added = json::array();
  std::vector<std::pair<std::string, int64_t>> specials(added_.begin(), added_.end());
  std::sort(specials.begin(), specials.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  for (const auto& [content, id] : specials) {
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  }
  const std::string meta = "\xE2\x96\x81";
  json normalizer = nfc_ ? json{{"type", "NFC"}} : json(nullptr);
  json pre_tokenizer = steps.size() == 1 ? steps[0] : json{{"type", "Sequence"}, {"pretokenizers", steps}};
  json decoder = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  if (spm_) {  // Note [SentencePiece-style BPE]
    json norms = json::array();
    if (nfc_) norms.push_back({{"type", "NFC"}});
    if (prepend_) norms.push_back({{"type", "Prepend"}, {"prepend", meta}});
    if (replace_space_) norms.push_back({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", meta}});
    normalizer = norms.empty() ? json(nullptr) : norms.size() == 1 ? norms[0] : json{{"type", "Sequence"}, {"normalizers", norms}};
    pre_tokenizer = nullptr;
    if (metaspace_ != Metaspace::kNone) {
      pre_tokenizer = {{"type", "Metaspace"}, {"replacement", meta},
                       {"prepend_scheme", metaspace_ == Metaspace::kAlways ? "always" : metaspace_ == Metaspace::kFirst ? "first" : "never"},
                       {"split", metaspace_split_}};
    }
    json decs = json::array({{{"type", "Replace"}, {"pattern", {{"String", meta}}}, {"content", " "}}});
    if (byte_fallback_) decs.push_back({{"type", "ByteFallback"}});
    decs.push_back({{"type", "Fuse"}});
    if (prepend_ || metaspace_ == Metaspace::kAlways || metaspace_ == Metaspace::kFirst)
      decs.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    decoder = {{"type", "Sequence"}, {"decoders", decs}};
  }
  json post_processor = nullptr;
  if (add_bos_ >= 0) {
    const std::string bos = id_to_token_[static_cast<size_t>(add_bos_)];
    post_processor = {{"type", "TemplateProcessing"},
                      {"single", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                      {"pair", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                            {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
                      {"special_tokens", {{bos, {{"id", bos}, {"ids", json::array({add_bos_})}, {"tokens", json::array({bos})}}}}}};
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", normalizer},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", post_processor},
          {"decoder", decoder},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", unk_ >= 0 ? json(id_to_token_[static_cast<size_t>(unk_)]) : json(nullptr)},
            {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr}, {"fuse_unk", fuse_unk_},
            {"byte_fallback", byte_fallback_}, {"ignore_merges", ignore_merges_}, {"vocab", vocab}, {"merges", merges}}}};
}

BpeTokenizer::GgufVocab BpeTokenizer::gguf_vocab(int64_t n_vocab) const {
  GgufVocab v;
  TS_CHECK(n_vocab >= vocab_size(), source_, ": the model's vocabulary (", n_vocab, ") is smaller than the tokenizer's (",
           vocab_size(), ")");
  v.model = spm_ ? "llama" : "gpt2";
  if (!spm_) {
    auto pattern_is = [&](const char* p) { return pre_.size() == 1 && pre_[0]->kind == PreStep::Kind::kRegex && pre_[0]->pattern == p; };
    if (pre_.empty()) {
      v.pre = "gpt-2";
    } else if (pre_.size() == 2 && pre_[0]->kind == PreStep::Kind::kDigits && pre_[1]->kind == PreStep::Kind::kGpt2) {
      v.pre = "smollm";
    } else if (pattern_is(kLlama3Pattern) && ignore_merges_) {
      v.pre = "llama-bpe";
    } else if (pattern_is(kQwen2Pattern) && nfc_) {
      v.pre = "qwen2";
    } else {
      TS_CHECK(false, source_, ": this pre-tokenizer has no llama.cpp name (GPT-2's pattern, SmolLM's digits, Llama 3's and ",
               "Qwen2's regexes do): a GGUF file could not say how to split text");
    }
    for (const auto& [a, b] : merge_order_) {
      v.merges.push_back(id_to_token_[static_cast<size_t>(a)] + " " + id_to_token_[static_cast<size_t>(b)]);
    }
  } else {
    TS_CHECK(!nfc_, source_, ": an NFC normalizer has no place in a GGUF SentencePiece vocabulary");
    TS_CHECK(metaspace_ != Metaspace::kNever, source_, ": Metaspace prepend_scheme never has no GGUF form");
    // Mistral's Metaspace (prepend "first") and Llama 2's Prepend differ only after added tokens.
    v.add_space_prefix = prepend_ || metaspace_ != Metaspace::kNone;
  }
  std::vector<bool> special(static_cast<size_t>(n_vocab), false);
  for (const auto& a : added_) special[static_cast<size_t>(a.second)] = true;
  // SentencePiece scores: a token made by merge rank r scores -r (earlier merges first); tokens no
  // merge makes score below every merge.
  std::vector<float> score;
  if (spm_) {
    score.assign(static_cast<size_t>(n_vocab), -1e9f);
    for (const auto& [key, rm] : merges_) {
      float& s = score[static_cast<size_t>(rm.second)];
      s = std::max(s, -static_cast<float>(rm.first));
    }
  }
  for (int64_t id = 0; id < n_vocab; ++id) {
    const bool have = id < vocab_size() && !id_to_token_[static_cast<size_t>(id)].empty();
    v.tokens.push_back(have ? id_to_token_[static_cast<size_t>(id)] : concat("[PAD", id, "]"));
    int32_t type = have ? 1 : 5;
    if (have && special[static_cast<size_t>(id)]) type = 3;
    if (have && id == unk_) type = 2;
    if (have && spm_ && byte_fallback_) {
      for (int b = 0; b < 256; ++b) type = byte_token_[static_cast<size_t>(b)] == id ? 6 : type;
    }
    v.types.push_back(type);
    if (spm_) v.scores.push_back(type == 1 ? score[static_cast<size_t>(id)] : 0.f);
  }
  v.unk = unk_;
  return v;
}

std::string BpeTokenizer::normalized(const std::string& text) const {
  if (!nfc_ && !spm_) return text;
  auto norm = [&](const std::string& span, bool at_start) {
    if (!spm_) return nfc(span);
    return meta_to_spaces(spm_normalize(span, at_start));
  };
  // Added tokens are matched before normalization, as in encode.
  std::string out;
  size_t start = 0;
  while (start < text.size()) {
    size_t at = std::string::npos, len = 0;
    for (const auto& a : added_) {
      const size_t p = text.find(a.first, start);
      if (p < at) at = p, len = a.first.size();
    }
    if (at == std::string::npos) break;
    out += norm(text.substr(start, at - start), start == 0) + text.substr(at, len);
    start = at + len;
  }
  return out + (start < text.size() ? norm(text.substr(start), start == 0) : std::string());
}

std::vector<std::string> BpeTokenizer::pre_split(const std::string& text) const {
  if (pre_.empty()) return pre_tokenize(text);
  std::vector<std::string> pieces{text};
  for (const auto& step : pre_) {
    std::vector<std::string> next;
    for (const auto& p : pieces) {
      auto parts = step->split(p);
      next.insert(next.end(), std::make_move_iterator(parts.begin()), std::make_move_iterator(parts.end()));
    }
    pieces.swap(next);
  }
  return pieces;
}

// Note [GPT-2 pre-tokenization]
// GPT-2's pattern, as the `tokenizers` package's ByteLevel pre-tokenizer applies it:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matched leftmost-first by hand: the contractions, then an optional U+0020 and a run of letters,
// numbers or other characters, then whitespace: a run followed by a non-space character gives its
// last character to the next piece (the lookahead), unless the run is that one character.
std::vector<std::string> BpeTokenizer::pre_tokenize(const std::string& text) {
  const auto cps = code_points(text);
  const size_t n = cps.size();
  std::vector<std::string> out;
  auto emit = [&](size_t a, size_t b) { out.push_back(text.substr(cps[a].begin, cps[b - 1].begin + cps[b - 1].len - cps[a].begin)); };
  auto cls = [&](size_t k) { return classify(cps[k].cp); };
  size_t i = 0;
  while (i < n) {
    if (cps[i].cp == '\'' && i + 1 < n) {
      const uint32_t a = cps[i + 1].cp, b = i + 2 < n ? cps[i + 2].cp : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        emit(i, i + 2);
        i += 2;
        continue;
      }
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        emit(i, i + 3);
        i += 3;
        continue;
      }
    }
    bool matched = false;
    for (Cls c : {Cls::kLetter, Cls::kNumber, Cls::kOther}) {
      size_t start = i;
      if (cps[i].cp == ' ' && i + 1 < n && cls(i + 1) == c) start = i + 1;
      if (cls(start) != c) continue;
      size_t end = start;
      while (end < n && cls(end) == c) ++end;
      emit(i, end);
      i = end;
      matched = true;
      break;
    }
    if (matched) continue;
    // Whitespace.
    size_t end = i;
    while (end < n && cls(end) == Cls::kSpace) ++end;
    if (end < n && end - i >= 2) --end;  // \s+(?!\S): the last one joins the next piece
    emit(i, end);
    i = end;
  }
  return out;
}

BpeTokenizer::BpeTokenizer(std::unordered_map<std::string, int64_t> vocab,
                           std::vector<std::pair<std::string, std::string>> merges, const std::string& source, bool spm,
                           std::vector<int> ranks)
    : vocab_(std::move(vocab)), source_(source), spm_(spm) {
  make_byte_map(byte_to_unicode_, unicode_to_byte_);
  int64_t max_id = -1;
  for (const auto& [tok, id] : vocab_) {
    TS_CHECK(id >= 0 && id < (int64_t{1} << 31), source_, ": token '", tok, "' has id ", id, ", outside [0, 2^31)");
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : vocab_) id_to_token_[static_cast<size_t>(id)] = tok;
  set_merges(merges, ranks);
  if (spm_) {
    byte_token_.assign(256, -1);
    static const char* hex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      const std::string name = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
      if (const auto it = vocab_.find(name); it != vocab_.end()) byte_token_[static_cast<size_t>(b)] = it->second;
    }
    return;
  }
  int bytes = 0;
  for (int b = 0; b < 256; ++b) bytes += vocab_.count(byte_to_unicode_[b]) ? 1 : 0;
  // Real vocabularies may leave out a few control bytes (SmolLM's has no token for 0x04): text
  // holding one encodes it as the unknown token where there is one. Most bytes missing means
  // this is not a byte-level vocabulary at all.
  TS_CHECK(bytes >= 192, source_, ": the vocabulary has tokens for only ", bytes,
           " of the 256 bytes: not a byte-level BPE vocabulary");
  if (auto it = vocab_.find("<|endoftext|>"); it != vocab_.end()) {
    eos_ = it->second;
    added_.emplace_back(it->first, it->second);
  }
}

void BpeTokenizer::set_merges(const std::vector<std::pair<std::string, std::string>>& merges, const std::vector<int>& ranks) {
  merges_.clear();
  merge_order_.clear();
  merges_.reserve(merges.size());
  merge_order_.reserve(merges.size());
  auto id_of = [&](const std::string& t, size_t r, const std::string& pair) {
    const auto it = vocab_.find(t);
    TS_CHECK(it != vocab_.end(), source_, ": merge ", r, " '", pair, "': '", t, "' is not in the vocabulary");
    return it->second;
  };
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    const std::string pair = a + " " + b;
    const int64_t ia = id_of(a, r, pair), ib = id_of(b, r, pair), in = id_of(a + b, r, pair);
    const int rank = ranks.empty() ? static_cast<int>(r) : ranks[r];
    // A pair listed twice keeps its first (lowest) rank, as `tokenizers` keeps it.
    if (merges_.emplace((static_cast<uint64_t>(ia) << 32) | static_cast<uint64_t>(ib), std::make_pair(rank, in)).second)
      merge_order_.emplace_back(ia, ib);
  }
}

BpeTokenizer BpeTokenizer::from_files(const std::string& vocab_json, const std::string& merges_txt) {
  nlohmann::json v;
  try {
    v = nlohmann::json::parse(read_file(vocab_json));
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, vocab_json, ": not JSON: ", e.what());
  }
  TS_CHECK(v.is_object(), vocab_json, ": expected an object of token -> id");
  std::unordered_map<std::string, int64_t> vocab;
  for (const auto& [tok, id] : v.items()) {
    TS_CHECK(id.is_number_integer(), vocab_json, ": token '", tok, "' has id ", id.dump(), ", not an integer");
    vocab[tok] = id.get<int64_t>();
  }
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream in(read_file(merges_txt));
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const auto sp = line.find(' ');
    TS_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < line.size() && line.find(' ', sp + 1) == std::string::npos,
             merges_txt, ":", line_no, ": expected two tokens separated by one space, found '", line, "'");
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  return BpeTokenizer(std::move(vocab), std::move(merges), vocab_json);
}

BpeTokenizer BpeTokenizer::from_tokenizer_json(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, path, ": not JSON: ", e.what());
  }
  TS_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), path, ": no \"model\" object");
  const auto& m = j["model"];
  TS_CHECK(m.value("type", std::string()) == "BPE", path, ": model.type is ", m.value("type", std::string("missing")),
           "; only BPE models are read");
  // The pre-tokenizer (Note [Pre-tokenizer steps]) and the normalizer.
  std::vector<std::shared_ptr<const PreStep>> steps;
  Metaspace metaspace = Metaspace::kNone;
  bool metaspace_split = false, byte_level = false;
  if (j.contains("pre_tokenizer") && j["pre_tokenizer"].is_object()) {
    const auto& pt = j["pre_tokenizer"];
    std::vector<const nlohmann::json*> list;
    if (pt.value("type", std::string()) == "Sequence") {
      TS_CHECK(pt.contains("pretokenizers") && pt["pretokenizers"].is_array(), path, ": pre_tokenizer.pretokenizers must be a list");
      for (const auto& x : pt["pretokenizers"]) list.push_back(&x);
    } else {
      list.push_back(&pt);
    }
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& x = *list[i];
      const std::string where = concat(path, ": pre_tokenizer step ", i);
      TS_CHECK(x.is_object(), where, " is not an object");
      const std::string type = x.value("type", std::string());
      if (type == "Metaspace") {  // Note [SentencePiece-style BPE]
        TS_CHECK(list.size() == 1, where, ": Metaspace is supported as the only pre-tokenizer");
        const std::string rep = x.value("replacement", std::string("\xE2\x96\x81"));
        TS_CHECK(rep == "\xE2\x96\x81", where, ": Metaspace replacement '", rep, "' is not supported (U+2581 is)");
        std::string scheme = x.value("prepend_scheme", std::string());
        if (scheme.empty()) scheme = x.value("add_prefix_space", true) ? "always" : "never";
        TS_CHECK(scheme == "always" || scheme == "first" || scheme == "never", where, ": Metaspace prepend_scheme \"", scheme,
                 "\" is not one of always, first, never");
        metaspace = scheme == "always" ? Metaspace::kAlways : scheme == "first" ? Metaspace::kFirst : Metaspace::kNever;
        metaspace_split = x.value("split", true);
      } else if (type == "ByteLevel") {
        byte_level = true;
        TS_CHECK(!x.value("add_prefix_space", false), where, ": ByteLevel add_prefix_space true is not supported");
        if (x.value("use_regex", true)) steps.push_back(step_of(PreStep::Kind::kGpt2));
      } else if (type == "Digits") {
        TS_CHECK(x.value("individual_digits", false), where, ": Digits without individual_digits is not supported");
        steps.push_back(step_of(PreStep::Kind::kDigits));
      } else if (type == "Split") {
        TS_CHECK(x.contains("pattern") && x["pattern"].is_object() && x["pattern"].contains("Regex") &&
                     x["pattern"]["Regex"].is_string(),
                 where, ": Split needs a {\"Regex\": ...} pattern");
        const std::string behavior = x.value("behavior", std::string("Isolated"));
        TS_CHECK(behavior == "Isolated" || behavior == "Removed", where, ": Split behavior \"", behavior,
                 "\" is not supported (Isolated and Removed are)");
        TS_CHECK(!x.value("invert", false), where, ": Split with invert true is not supported");
        steps.push_back(regex_step(x["pattern"]["Regex"].get<std::string>(), behavior == "Removed", where));
      } else {
        TS_CHECK(false, where, ": type \"", type, "\" is not supported (ByteLevel, Digits, Split, Metaspace)");
      }
    }
  }
  // The normalizer: none, NFC, SentencePiece's Prepend("▁") and Replace(" ", "▁"), or a
  // Sequence of those.
  bool nfc_norm = false, prepend = false, replace_space = false;
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const auto& n = j["normalizer"];
    std::vector<const nlohmann::json*> list;
    if (n.is_object() && n.value("type", std::string()) == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
      for (const auto& x : n["normalizers"]) list.push_back(&x);
    } else {
      list.push_back(&n);
    }
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& x = *list[i];
      const std::string where = concat(path, ": normalizer", list.size() > 1 ? concat(" step ", i) : std::string());
      const std::string type = x.is_object() ? x.value("type", std::string()) : std::string();
      if (type == "NFC") {
        nfc_norm = true;
      } else if (type == "Prepend") {
        TS_CHECK(x.value("prepend", std::string()) == "\xE2\x96\x81" && !replace_space, where,
                 ": Prepend is supported with \"\u2581\" before Replace");
        prepend = true;
      } else if (type == "Replace") {
        const bool space = x.contains("pattern") && x["pattern"].is_object() && x["pattern"].value("String", std::string()) == " " &&
                           x.value("content", std::string()) == "\xE2\x96\x81";
        TS_CHECK(space, where, ": Replace is supported for \" \" -> \"\u2581\" only, found ", x.dump());
        replace_space = true;
      } else {
        TS_CHECK(false, where, ": ", x.is_object() ? concat("type \"", type, "\"") : x.dump(),
                 " is not supported (NFC, Prepend, Replace, and a Sequence of them are)");
      }
    }
  }
  TS_CHECK(m.contains("vocab") && m["vocab"].is_object(), path, ": model.vocab must be an object");
  std::unordered_map<std::string, int64_t> vocab;
  for (const auto& [tok, id] : m["vocab"].items()) {
    TS_CHECK(id.is_number_integer(), path, ": model.vocab['", tok, "'] is not an integer");
    vocab[tok] = id.get<int64_t>();
  }
  std::vector<std::pair<std::string, std::string>> merges;
  if (m.contains("merges")) {
    TS_CHECK(m["merges"].is_array(), path, ": model.merges must be a list");
    for (size_t r = 0; r < m["merges"].size(); ++r) {
      const auto& e = m["merges"][r];
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const auto sp = s.find(' ');
        TS_CHECK(sp != std::string::npos && sp > 0, path, ": model.merges[", r, "] = '", s, "' is not \"a b\"");
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else {
        TS_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), path, ": model.merges[", r,
                 "] is neither \"a b\" nor [a, b]");
        merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      }
    }
  }
  const bool byte_fallback = m.value("byte_fallback", false);
  const bool spm = metaspace != Metaspace::kNone || prepend || replace_space || byte_fallback;
  TS_CHECK(!spm || steps.empty(), path, ": a SentencePiece-style tokenizer (Metaspace, a \u2581 normalizer or byte_fallback) ",
           "with a ByteLevel, Digits or Split pre-tokenizer is not supported");
  TS_CHECK(spm || byte_level, path, ": a byte-level BPE without a pre_tokenizer is not supported (add ByteLevel)");
  BpeTokenizer t(std::move(vocab), std::move(merges), path, spm);
  // GPT-2's pattern alone is the default pipeline (pre_ empty).
  if (!(steps.size() == 1 && steps[0]->kind == PreStep::Kind::kGpt2)) t.pre_ = std::move(steps);
  t.nfc_ = nfc_norm;
  t.prepend_ = prepend;
  t.replace_space_ = replace_space;
  t.metaspace_ = metaspace;
  t.metaspace_split_ = metaspace_split;
  t.byte_fallback_ = byte_fallback;
  t.fuse_unk_ = m.value("fuse_unk", false);
  t.ignore_merges_ = m.value("ignore_merges", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    const auto it = t.vocab_.find(m["unk_token"].get<std::string>());
    if (it != t.vocab_.end()) t.unk_ = it->second;
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (size_t i = 0; i < j["added_tokens"].size(); ++i) {
      const auto& a = j["added_tokens"][i];
      TS_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() && a.contains("content") &&
                   a["content"].is_string(),
               path, ": added_tokens[", i, "] needs an integer id and a string content");
      const std::string content = a["content"].get<std::string>();
      const int64_t id = a["id"].get<int64_t>();
      if (id >= t.vocab_size()) t.id_to_token_.resize(static_cast<size_t>(id + 1));
      if (t.id_to_token_[static_cast<size_t>(id)].empty()) t.id_to_token_[static_cast<size_t>(id)] = content;
      t.vocab_[content] = id;
      bool known = false;
      for (const auto& [c, _] : t.added_) known = known || c == content;
      if (!known) t.added_.emplace_back(content, id);
      if (content == "<|endoftext|>") t.eos_ = id;
    }
  }
  std::stable_sort(t.added_.begin(), t.added_.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  // A TemplateProcessing post-processor (alone or in a Sequence) whose single-sequence template
  // starts with a special token: the BOS a prompt starts with.
  if (j.contains("post_processor") && j["post_processor"].is_object()) {
    std::vector<const nlohmann::json*> procs{&j["post_processor"]};
    if (j["post_processor"].value("type", std::string()) == "Sequence" && j["post_processor"].contains("processors") &&
        j["post_processor"]["processors"].is_array()) {
      procs.clear();
      for (const auto& x : j["post_processor"]["processors"]) procs.push_back(&x);
    }
    for (const auto* pp : procs) {
      if (!pp->is_object() || pp->value("type", std::string()) != "TemplateProcessing") continue;
      const auto& single = pp->contains("single") ? (*pp)["single"] : nlohmann::json();
      if (!single.is_array() || single.empty() || !single[0].is_object() || !single[0].contains("SpecialToken")) continue;
      const auto& st = single[0]["SpecialToken"];
      const std::string name = st.is_object() ? st.value("id", std::string()) : std::string();
      const auto specials = pp->contains("special_tokens") ? (*pp)["special_tokens"] : nlohmann::json();
      int64_t id = -1;
      if (specials.is_object() && specials.contains(name) && specials[name].is_object() && specials[name].contains("ids") &&
          specials[name]["ids"].is_array() && specials[name]["ids"].size() == 1 && specials[name]["ids"][0].is_number_integer()) {
        id = specials[name]["ids"][0].get<int64_t>();
      } else if (const auto it = t.vocab_.find(name); it != t.vocab_.end()) {
        id = it->second;
      }
      TS_CHECK(id >= 0 && id < t.vocab_size(), path, ": post_processor's template starts with \"", name,
               "\", which is not a token of the vocabulary");
      t.add_bos_ = id;
    }
  }
  return t;
}

namespace {
// GGUF's tokenizer.ggml.add_bos_token (llama.cpp's default where it is missing: SentencePiece
// vocabularies add BOS, byte-level ones do not) with tokenizer.ggml.bos_token_id: the BOS id, -1.
int64_t gguf_add_bos(const checkpoint::gguf::File& f, const std::string& path, bool dflt, int64_t vocab) {
  const auto& md = f.header().metadata;
  bool add = dflt;
  if (md.contains("tokenizer.ggml.add_bos_token")) {
    const auto& v = md.at("tokenizer.ggml.add_bos_token");
    TS_CHECK(v.is_boolean(), path, ": tokenizer.ggml.add_bos_token is not a boolean: ", v.type_name());
    add = v.get<bool>();
  }
  if (!add || !f.has("tokenizer.ggml.bos_token_id")) return -1;
  const int64_t bos = f.integer("tokenizer.ggml.bos_token_id");
  TS_CHECK(bos >= 0 && bos < vocab, path, ": tokenizer.ggml.bos_token_id ", bos, " is outside the ", vocab, " tokens");
  return bos;
}
}  // namespace

// GGUF's SentencePiece tokenizer (Note [SentencePiece-style BPE]).
BpeTokenizer BpeTokenizer::from_gguf_spm(const checkpoint::gguf::File& f, const std::string& path) {
  const auto& md = f.header().metadata;
  TS_CHECK(md.contains("tokenizer.ggml.tokens") && md.at("tokenizer.ggml.tokens").is_array(), path,
           ": no tokenizer.ggml.tokens array");
  const auto& tokens = md.at("tokenizer.ggml.tokens");
  TS_CHECK(md.contains("tokenizer.ggml.scores") && md.at("tokenizer.ggml.scores").is_array() &&
               md.at("tokenizer.ggml.scores").size() == tokens.size(),
           path, ": tokenizer.ggml.model \"llama\" needs tokenizer.ggml.scores, one per token");
  const auto& scores = md.at("tokenizer.ggml.scores");
  const nlohmann::json no_types = nlohmann::json::array();
  const auto& types = md.contains("tokenizer.ggml.token_type") ? md.at("tokenizer.ggml.token_type") : no_types;
  TS_CHECK(types.empty() || types.size() == tokens.size(), path, ": tokenizer.ggml.token_type has ", types.size(),
           " entries for ", tokens.size(), " tokens");
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<double> score(tokens.size());
  std::vector<std::pair<std::string, int64_t>> special;
  for (size_t i = 0; i < tokens.size(); ++i) {
    TS_CHECK(tokens[i].is_string(), path, ": tokenizer.ggml.tokens[", i, "] is not a string");
    TS_CHECK(scores[i].is_number(), path, ": tokenizer.ggml.scores[", i, "] is not a number");
    const std::string& tok = tokens[i].get_ref<const std::string&>();
    vocab.emplace(tok, static_cast<int64_t>(i));
    score[i] = scores[i].get<double>();
    const int64_t type = types.empty() || !types[i].is_number_integer() ? 1 : types[i].get<int64_t>();
    if (type == 3 || type == 4) special.emplace_back(tok, static_cast<int64_t>(i));  // control, user-defined
  }
  // Merges from the scores: each split of a token into two tokens, ranked by the token's score
  // (equal scores share a rank: the leftmost pair merges first, as in llama.cpp).
  std::vector<double> distinct(score);
  std::sort(distinct.begin(), distinct.end(), std::greater<double>());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  std::vector<std::tuple<int, int64_t, std::string, std::string>> cand;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& tok = tokens[i].get_ref<const std::string&>();
    const auto cps = code_points(tok);
    if (cps.size() < 2) continue;
    const int rank = static_cast<int>(std::lower_bound(distinct.begin(), distinct.end(), score[i], std::greater<double>()) -
                                      distinct.begin());
    for (size_t k = 1; k < cps.size(); ++k) {
      const std::string l = tok.substr(0, cps[k].begin), r = tok.substr(cps[k].begin);
      if (vocab.count(l) && vocab.count(r)) cand.emplace_back(rank, static_cast<int64_t>(i), l, r);
    }
  }
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) < std::get<0>(b) : std::get<1>(a) < std::get<1>(b);
  });
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<int> ranks;
  merges.reserve(cand.size());
  ranks.reserve(cand.size());
  for (auto& [rank, id, l, r] : cand) {
    merges.emplace_back(std::move(l), std::move(r));
    ranks.push_back(rank);
  }
  BpeTokenizer t(std::move(vocab), std::move(merges), path, /*spm=*/true, std::move(ranks));
  t.byte_fallback_ = true;
  t.fuse_unk_ = true;
  t.replace_space_ = true;
  t.prepend_ = true;  // llama.cpp's default for SentencePiece vocabularies
  if (f.has("tokenizer.ggml.add_space_prefix")) {
    const auto& v = md.at("tokenizer.ggml.add_space_prefix");
    TS_CHECK(v.is_boolean(), path, ": tokenizer.ggml.add_space_prefix is not a boolean: ", v.type_name());
    t.prepend_ = v.get<bool>();
  }
  if (f.has("tokenizer.ggml.unknown_token_id")) {
    const int64_t unk = f.integer("tokenizer.ggml.unknown_token_id");
    if (unk >= 0 && unk < t.vocab_size()) t.unk_ = unk;
  }
  for (const auto& [tok, id] : special) {
    if (!tok.empty()) t.added_.emplace_back(tok, id);
  }
  std::stable_sort(t.added_.begin(), t.added_.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  if (f.has("tokenizer.ggml.eos_token_id")) {
    const int64_t eos = f.integer("tokenizer.ggml.eos_token_id");
    TS_CHECK(eos >= 0 && eos < t.vocab_size(), path, ": tokenizer.ggml.eos_token_id ", eos, " is outside the ",
             t.vocab_size(), " tokens");
    t.eos_ = eos;
  }
  t.add_bos_ = gguf_add_bos(f, path, true, t.vocab_size());
  return t;
}

BpeTokenizer BpeTokenizer::from_gguf(const std::string& path) {
  const checkpoint::gguf::File f(path);
  const auto& md = f.header().metadata;
  const std::string model = f.has("tokenizer.ggml.model") ? f.string("tokenizer.ggml.model") : "";
  if (model == "llama") return from_gguf_spm(f, path);
  TS_CHECK(model == "gpt2", path, ": tokenizer.ggml.model is \"", model,
           "\"; torchspeed reads byte-level BPE (\"gpt2\") and SentencePiece (\"llama\") tokenizers of GGUF files");
  const std::string pre = f.has("tokenizer.ggml.pre") ? f.string("tokenizer.ggml.pre") : "default";
  TS_CHECK(pre == "default" || pre == "gpt-2" || pre == "gpt2" || pre == "smollm" || pre == "llama-bpe" || pre == "llama3" ||
               pre == "qwen2",
           path, ": tokenizer.ggml.pre \"", pre,
           "\" is not supported yet (default, gpt-2, smollm, llama-bpe (Llama 3) and qwen2 are)");
  TS_CHECK(md.contains("tokenizer.ggml.tokens") && md.at("tokenizer.ggml.tokens").is_array(), path,
           ": no tokenizer.ggml.tokens array");
  const auto& tokens = md.at("tokenizer.ggml.tokens");
  const nlohmann::json no_types = nlohmann::json::array();
  const auto& types = md.contains("tokenizer.ggml.token_type") ? md.at("tokenizer.ggml.token_type") : no_types;
  TS_CHECK(types.empty() || types.size() == tokens.size(), path, ": tokenizer.ggml.token_type has ", types.size(),
           " entries for ", tokens.size(), " tokens");
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::pair<std::string, int64_t>> special;
  for (size_t i = 0; i < tokens.size(); ++i) {
    TS_CHECK(tokens[i].is_string(), path, ": tokenizer.ggml.tokens[", i, "] is not a string");
    const std::string& tok = tokens[i].get_ref<const std::string&>();
    vocab.emplace(tok, static_cast<int64_t>(i));
    const int64_t type = types.empty() || !types[i].is_number_integer() ? 1 : types[i].get<int64_t>();
    if (type == 3 || type == 4) special.emplace_back(tok, static_cast<int64_t>(i));  // control, user-defined
  }
  std::vector<std::pair<std::string, std::string>> merges;
  if (md.contains("tokenizer.ggml.merges")) {
    const auto& ms = md.at("tokenizer.ggml.merges");
    TS_CHECK(ms.is_array(), path, ": tokenizer.ggml.merges is not an array");
    for (size_t r = 0; r < ms.size(); ++r) {
      TS_CHECK(ms[r].is_string(), path, ": tokenizer.ggml.merges[", r, "] is not a string");
      const std::string& m = ms[r].get_ref<const std::string&>();
      const auto sp = m.find(' ');
      TS_CHECK(sp != std::string::npos && sp > 0, path, ": tokenizer.ggml.merges[", r, "] = '", m, "' is not \"a b\"");
      merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
    }
  }
  BpeTokenizer t(std::move(vocab), std::move(merges), path);
  if (pre == "smollm") t.pre_ = {step_of(PreStep::Kind::kDigits), step_of(PreStep::Kind::kGpt2)};
  if (pre == "llama-bpe" || pre == "llama3") {
    t.pre_ = {regex_step(kLlama3Pattern, false, path)};
    t.ignore_merges_ = true;  // as Llama 3's tokenizer.json
  }
  if (pre == "qwen2") {
    t.pre_ = {regex_step(kQwen2Pattern, false, path)};
    t.nfc_ = true;  // as Qwen2's tokenizer.json
  }
  if (f.has("tokenizer.ggml.unknown_token_id")) {
    const int64_t unk = f.integer("tokenizer.ggml.unknown_token_id");
    if (unk >= 0 && unk < t.vocab_size()) t.unk_ = unk;
  }
  for (const auto& [tok, id] : special) {
    if (tok.empty()) continue;
    bool known = false;
    for (const auto& a : t.added_) known = known || a.first == tok;
    if (!known) t.added_.emplace_back(tok, id);
  }
  std::stable_sort(t.added_.begin(), t.added_.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  if (f.has("tokenizer.ggml.eos_token_id")) {
    const int64_t eos = f.integer("tokenizer.ggml.eos_token_id");
    TS_CHECK(eos >= 0 && eos < t.vocab_size(), path, ": tokenizer.ggml.eos_token_id ", eos, " is outside the ",
             t.vocab_size(), " tokens");
    t.eos_ = eos;
  }
  t.add_bos_ = gguf_add_bos(f, path, false, t.vocab_size());
  return t;
}

BpeTokenizer BpeTokenizer::from_folder(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(dir) / "tokenizer.json")) return from_tokenizer_json((fs::path(dir) / "tokenizer.json").string());
  TS_CHECK(fs::exists(fs::path(dir) / "vocab.json") && fs::exists(fs::path(dir) / "merges.txt"), dir,
           ": no tokenizer.json, nor vocab.json and merges.txt");
  return from_files((fs::path(dir) / "vocab.json").string(), (fs::path(dir) / "merges.txt").string());
}

void BpeTokenizer::bpe(const std::string& piece, std::vector<int64_t>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {  // a piece that is a token of its own is taken whole
    std::string whole;
    if (spm_) {
      whole = piece;
    } else {
      for (unsigned char c : piece) whole += byte_to_unicode_[c];
    }
    if (const auto it = vocab_.find(whole); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // The first symbols: one per byte (byte-level) or per character (SentencePiece style, with
  // byte fallback), as tokenizers' BPE::merge_word makes them. A symbol the vocabulary lacks is
  // the unknown token (consecutive ones fused into one under fuse_unk).
  std::vector<int64_t> ids;
  ids.reserve(piece.size());
  bool last_unk = false;
  auto unknown = [&](const std::string& what) {
    TS_CHECK(unk_ >= 0, source_, ": '", what, "' is not in the vocabulary, which has no unknown token");
    if (!(fuse_unk_ && last_unk)) ids.push_back(unk_);
    last_unk = true;
  };
  if (!spm_) {
    for (unsigned char c : piece) {
      const auto it = vocab_.find(byte_to_unicode_[c]);
      if (it == vocab_.end()) {
        unknown(byte_to_unicode_[c]);
        continue;
      }
      ids.push_back(it->second);
      last_unk = false;
    }
  } else {
    for (const CodePoint& c : code_points(piece)) {
      const std::string ch = piece.substr(c.begin, c.len);
      if (const auto it = vocab_.find(ch); it != vocab_.end()) {
        ids.push_back(it->second);
        last_unk = false;
        continue;
      }
      bool all = byte_fallback_;
      for (size_t k = 0; all && k < ch.size(); ++k) all = byte_token_[static_cast<unsigned char>(ch[k])] >= 0;
      if (all) {
        for (unsigned char b : ch) ids.push_back(byte_token_[b]);
        last_unk = false;
        continue;
      }
      unknown(ch);
    }
  }
  // Merge the lowest-ranked adjacent pair, leftmost first, one at a time, until none is left:
  // symbols in a linked list, candidate pairs in a heap, stale candidates skipped when popped.
  const int n = static_cast<int>(ids.size());
  if (n > 1 && !merges_.empty()) {
    std::vector<int> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
    std::vector<char> alive(static_cast<size_t>(n), 1);
    for (int k = 0; k < n; ++k) prev[static_cast<size_t>(k)] = k - 1, next[static_cast<size_t>(k)] = k + 1 < n ? k + 1 : -1;
    struct Cand {
      int rank, pos;
      int64_t merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::vector<Cand> heap;
    auto consider = [&](int pos) {
      const int nx = next[static_cast<size_t>(pos)];
      if (pos < 0 || nx < 0) return;
      const auto it = merges_.find((static_cast<uint64_t>(ids[static_cast<size_t>(pos)]) << 32) |
                                   static_cast<uint64_t>(ids[static_cast<size_t>(nx)]));
      if (it == merges_.end()) return;
      heap.push_back({it->second.first, pos, it->second.second});
      std::push_heap(heap.begin(), heap.end(), std::greater<Cand>());
    };
    for (int k = 0; k + 1 < n; ++k) consider(k);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<Cand>());
      const Cand c = heap.back();
      heap.pop_back();
      const size_t p = static_cast<size_t>(c.pos);
      if (!alive[p] || next[p] < 0) continue;
      const size_t q = static_cast<size_t>(next[p]);
      const auto it = merges_.find((static_cast<uint64_t>(ids[p]) << 32) | static_cast<uint64_t>(ids[q]));
      if (it == merges_.end() || it->second.second != c.merged) continue;  // stale
      ids[p] = c.merged;
      alive[q] = 0;
      next[p] = next[q];
      if (next[q] >= 0) prev[static_cast<size_t>(next[q])] = c.pos;
      if (prev[p] >= 0) consider(prev[p]);
      consider(c.pos);
    }
    for (int k = 0; k >= 0; k = next[static_cast<size_t>(k)]) out.push_back(ids[static_cast<size_t>(k)]);
    return;
  }
  out.insert(out.end(), ids.begin(), ids.end());
}

// Note [SentencePiece-style BPE]
// Llama 2's and Mistral's tokenizer.json (converted from SentencePiece models) mark spaces with
// U+2581 "▁" instead of mapping bytes: either a normalizer Sequence [Prepend("▁"), Replace(" ",
// "▁")] with no pre-tokenizer (the "legacy" form: every span between added tokens, the whole span
// one word, gets the prefix) or a Metaspace pre-tokenizer (replacement "▁", prepend_scheme
// always/first/never: first = only the span at the start of the text, and not when it already
// starts with "▁"; split: a new word at each "▁"). The BPE model merges characters; with
// byte_fallback a character the vocabulary lacks becomes the <0xXX> tokens of its UTF-8 bytes.
// Decoding maps "▁" back to a space and <0xXX> tokens to their byte. GGUF's "llama" tokenizers
// (SentencePiece: tokens with scores, no merges) are the same with merges made from the scores:
// every split of a token into two tokens merges at the rank of the token's score, highest score
// first, equal scores leftmost first, which is what llama.cpp's SPM tokenizer computes.
std::string BpeTokenizer::spm_normalize(const std::string& raw, bool at_start) const {
  static const std::string kMeta = "\xE2\x96\x81";  // U+2581
  std::string text = nfc_ ? nfc(raw) : raw;
  if (prepend_ && !text.empty()) text = kMeta + text;
  auto replace_spaces = [&](std::string& t) {
    std::string r;
    r.reserve(t.size() + t.size() / 4);
    for (char c : t) {
      if (c == ' ') {
        r += kMeta;
      } else {
        r += c;
      }
    }
    t.swap(r);
  };
  if (replace_space_) replace_spaces(text);
  if (metaspace_ != Metaspace::kNone) {
    replace_spaces(text);
    const bool starts = text.compare(0, kMeta.size(), kMeta) == 0;
    if (!starts && (metaspace_ == Metaspace::kAlways || (metaspace_ == Metaspace::kFirst && at_start))) text = kMeta + text;
  }
  return text;
}

void BpeTokenizer::encode_plain(const std::string& raw, bool at_start, std::vector<int64_t>& out) const {
  if (spm_) {
    const std::string text = spm_normalize(raw, at_start);
    if (metaspace_ == Metaspace::kNone || !metaspace_split_) {
      bpe(text, out);
      return;
    }
    // Metaspace split: a new word at each "▁", which begins it (MergedWithNext).
    static const std::string kMeta = "\xE2\x96\x81";
    size_t begin = 0;
    for (size_t at = text.find(kMeta, 1); at != std::string::npos; at = text.find(kMeta, at + 1)) {
      bpe(text.substr(begin, at - begin), out);
      begin = at;
    }
    bpe(text.substr(begin), out);
    return;
  }
  const std::string text = nfc_ ? nfc(raw) : raw;
  for (const auto& piece : pre_split(text)) bpe(piece, out);
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start < text.size()) {
    // The earliest added token (the longest one at a tie), else the rest is plain text.
    size_t at = std::string::npos;
    const std::pair<std::string, int64_t>* hit = nullptr;
    for (const auto& a : added_) {
      const size_t p = text.find(a.first, start);
      if (p < at) {
        at = p;
        hit = &a;
      }
    }
    if (!hit) break;
    encode_plain(text.substr(start, at - start), start == 0, out);
    out.push_back(hit->second);
    start = at + hit->first.size();
  }
  if (start < text.size()) encode_plain(text.substr(start), start == 0, out);
  return out;
}

std::string BpeTokenizer::token_bytes(int64_t id) const {
  TS_CHECK(id >= 0 && id < vocab_size() && !id_to_token_[static_cast<size_t>(id)].empty(), source_, ": token id ", id,
           " is not in the vocabulary (", vocab_size(), " ids)");
  const std::string& tok = id_to_token_[static_cast<size_t>(id)];
  if (spm_ && byte_fallback_) {  // a <0xXX> token is its byte (Note [SentencePiece-style BPE])
    for (int b = 0; b < 256; ++b) {
      if (byte_token_[static_cast<size_t>(b)] == id) return std::string(1, static_cast<char>(b));
    }
  }
  for (const auto& a : added_) {
    if (a.second == id) return a.first;  // added tokens are their literal text
  }
  if (spm_) {
    return meta_to_spaces(tok);
  }
  std::string out;
  for (const auto& cp : code_points(tok)) {
    const auto it = unicode_to_byte_.find(tok.substr(cp.begin, cp.len));
    TS_CHECK(it != unicode_to_byte_.end(), source_, ": token ", id, " ('", tok, "') holds a character outside the byte map");
    out += static_cast<char>(it->second);
  }
  return out;
}

}  // namespace torchspeed::data
