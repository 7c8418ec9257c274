// The BPE tokenizer's text side: code points and their Unicode classes, GPT-2's pre-tokenizer
// (Note [GPT-2 pre-tokenization]), the pre-tokenizer steps `tokenizers` composes (Note
// [Pre-tokenizer steps]) and the NFC normalizer.
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include "torchspeed/data/bpe_internal.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data {
namespace bpe {

static std::string utf8(uint32_t cp) {
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


// Unicode's White_Space property (the regex \s).
static bool is_space(uint32_t c) {
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
static bool is_letter(uint32_t c) {
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

void make_byte_map(std::string (&to_unicode)[256], std::unordered_map<std::string, uint8_t>& to_byte) {
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    to_unicode[b] = utf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++));
    to_byte[to_unicode[b]] = static_cast<uint8_t>(b);
  }
}


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

std::string meta_to_spaces(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (s.compare(i, kMeta.size(), kMeta) == 0) {
      out += ' ';
      i += 3;
    } else {
      out += s[i++];
    }
  }
  return out;
}

// Whether s is valid UTF-8 (PCRE2 in UTF mode refuses anything else).
static bool valid_utf8(const std::string& s) {
  for (const CodePoint& c : code_points(s)) {
    if (c.cp == kInvalid) return false;
  }
  return true;
}

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

}  // namespace bpe

using namespace bpe;

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

}  // namespace torchspeed::data
