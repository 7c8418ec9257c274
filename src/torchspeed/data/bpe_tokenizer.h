// GPT-2's byte-level BPE tokenizer (what Hugging Face's GPT2Tokenizer and the `tokenizers`
// package's ByteLevel BPE compute), read from GPT-2's vocab.json + merges.txt or from a
// tokenizer.json. Text is split by GPT-2's pre-tokenization pattern, each piece's UTF-8 bytes are
// mapped to printable characters (bytes_to_unicode), and merges apply lowest rank first.
// Any byte sequence round-trips: every byte has a token.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace torchspeed::data {

class BpeTokenizer {
 public:
  // vocab.json (token -> id) and merges.txt (one "a b" pair per line, rank = line order; a first
  // line starting with "#version" is skipped). Errors name the file and entry.
  static BpeTokenizer from_files(const std::string& vocab_json, const std::string& merges_txt);
  // A tokenizer.json whose model is BPE with a ByteLevel pre-tokenizer.
  static BpeTokenizer from_tokenizer_json(const std::string& path);
  // A folder holding tokenizer.json, or vocab.json and merges.txt.
  static BpeTokenizer from_folder(const std::string& dir);

  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const { return static_cast<int64_t>(id_to_token_.size()); }
  // GPT-2's split of `text` into the pieces BPE runs on (for tests).
  static std::vector<std::string> pre_tokenize(const std::string& text);

 private:
  BpeTokenizer(std::unordered_map<std::string, int64_t> vocab, std::vector<std::pair<std::string, std::string>> merges,
               const std::string& source);
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int> ranks_;  // "a\x01b" -> rank
  std::string byte_to_unicode_[256];            // UTF-8 of each byte's character
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
  std::string source_;
};

}  // namespace torchspeed::data
