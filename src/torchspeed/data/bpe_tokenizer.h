// GPT-2's byte-level BPE tokenizer (what Hugging Face's GPT2Tokenizer and the `tokenizers`
// package's ByteLevel BPE compute), read from GPT-2's vocab.json + merges.txt or from a
// tokenizer.json. Text is split by GPT-2's pre-tokenization pattern, each piece's UTF-8 bytes are
// mapped to printable characters (bytes_to_unicode), and merges apply lowest rank first.
// Any byte sequence round-trips: every byte has a token.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "torchspeed/data/tokenizer.h"

namespace torchspeed::data {

class BpeTokenizer : public Tokenizer {
 public:
  // vocab.json (token -> id) and merges.txt (one "a b" pair per line, rank = line order; a first
  // line starting with "#version" is skipped). Errors name the file and entry.
  static BpeTokenizer from_files(const std::string& vocab_json, const std::string& merges_txt);
  // A tokenizer.json whose model is BPE with a ByteLevel pre-tokenizer.
  static BpeTokenizer from_tokenizer_json(const std::string& path);
  // A folder holding tokenizer.json, or vocab.json and merges.txt.
  static BpeTokenizer from_folder(const std::string& dir);
  // The tokenizer a GGUF file carries (tokenizer.ggml.model "gpt2": byte-level BPE): its tokens,
  // merges and token types (control and user-defined tokens are matched literally, as added
  // tokens), its EOS id; tokenizer.ggml.pre "gpt-2"/"default", or "smollm" (digits split one by
  // one first). Another pre-tokenizer is refused by name.
  static BpeTokenizer from_gguf(const std::string& path);

  // Added tokens (tokenizer.json's added_tokens; GPT-2's <|endoftext|> from a vocab.json) are
  // matched literally before pre-tokenization, as Hugging Face's tokenizers do.
  std::vector<int64_t> encode(const std::string& text) const override;
  std::string token_bytes(int64_t id) const override;
  std::string normalized(const std::string& text) const override;
  // This tokenizer as a Hugging Face tokenizer.json (model BPE with its vocabulary, merges in
  // rank order and ignore_merges; the normalizer; the pre-tokenizer steps; the added tokens; a
  // ByteLevel decoder): what `convert --format hf` writes for a model whose tokenizer came from
  // a GGUF file.
  nlohmann::json to_tokenizer_json() const;
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  int64_t eos_id() const override { return eos_; }
  std::string source() const override { return source_; }
  // GPT-2's split of `text` into the pieces BPE runs on (for tests).
  static std::vector<std::string> pre_tokenize(const std::string& text);

 private:
  BpeTokenizer(std::unordered_map<std::string, int64_t> vocab, std::vector<std::pair<std::string, std::string>> merges,
               const std::string& source);
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;
  void encode_plain(const std::string& text, std::vector<int64_t>& out) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int> ranks_;  // "a\x01b" -> rank
  std::string byte_to_unicode_[256];            // UTF-8 of each byte's character
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
  std::string source_;
  std::vector<std::pair<std::string, int64_t>> added_;  // longest first
  int64_t eos_ = -1;
  int64_t unk_ = -1;  // what a byte the vocabulary lacks encodes as (-1: an error)
 public:
  struct PreStep;  // one step of the pre-tokenizer (bpe_tokenizer.cpp)
 private:
  // The pre-tokenizer as `tokenizers` composes it: regex splits (Llama 3's and Qwen2's
  // patterns, on PCRE2), SmolLM's digits, GPT-2's pattern; empty: GPT-2's pattern alone.
  std::vector<std::shared_ptr<const PreStep>> pre_;
  bool ignore_merges_ = false;  // Llama 3: a piece that is a vocabulary token is taken whole
  bool nfc_ = false;            // Qwen2: text NFC-normalized first (ICU)
  std::vector<std::string> pre_split(const std::string& text) const;
};

}  // namespace torchspeed::data
