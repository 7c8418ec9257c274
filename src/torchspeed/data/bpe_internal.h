// Internals shared by the BPE tokenizer's sources (bpe_tokenizer.cpp: merging, encoding,
// decoding; bpe_pretokenize.cpp: code points, pre-tokenizer steps, normalizers; bpe_formats.cpp:
// tokenizer.json, vocab/merges and GGUF in and out). Not part of the public API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "torchspeed/data/bpe_tokenizer.h"

namespace torchspeed::data {

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

namespace bpe {

// A code point and its bytes in the text; an invalid byte is one code point of its own that is
// neither letter, number nor space.
struct CodePoint {
  uint32_t cp;
  size_t begin, len;
};
constexpr uint32_t kInvalid = 0xFFFFFFFFu;
std::vector<CodePoint> code_points(const std::string& s);

enum class Cls { kLetter, kNumber, kSpace, kOther };
bool is_number(uint32_t c);  // \p{N}
Cls classify(uint32_t c);

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the rest to U+0100 onwards.
void make_byte_map(std::string (&to_unicode)[256], std::unordered_map<std::string, uint8_t>& to_byte);

// The patterns llama.cpp names in tokenizer.ggml.pre, as the models' tokenizer.json spell them.
extern const char* const kLlama3Pattern;
extern const char* const kQwen2Pattern;
std::shared_ptr<const BpeTokenizer::PreStep> step_of(BpeTokenizer::PreStep::Kind k);
std::shared_ptr<const BpeTokenizer::PreStep> regex_step(const std::string& pattern, bool removed, const std::string& source);

// The largest token id a vocabulary of `n` entries may use (ids are dense in real files; some
// leave a few holes): twice its size plus 1024, and never past a model's largest vocabulary
// (models::GPTConfig's vocab <= 2^24). Ids index the id table, which a hostile file's id 2^31
// would otherwise size at 64 GB.
inline int64_t max_token_id(int64_t n) { return std::min<int64_t>(2 * n + 1024, (int64_t{1} << 24) - 1); }

inline const std::string kMeta = "\xE2\x96\x81";  // U+2581, SentencePiece's space
// SentencePiece's U+2581 back to spaces (Note [SentencePiece-style BPE]).
std::string meta_to_spaces(const std::string& s);
// NFC of valid UTF-8 text through ICU; text that is not valid UTF-8 is returned as it is.
std::string nfc(const std::string& text);

}  // namespace bpe
}  // namespace torchspeed::data
