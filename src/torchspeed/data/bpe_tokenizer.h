// BPE tokenizers as Hugging Face's `tokenizers` computes them, in two styles:
// - byte-level (GPT-2, Llama 3, Qwen2, SmolLM): text is split by the pre-tokenizer, each piece's
//   UTF-8 bytes are mapped to printable characters (bytes_to_unicode) and merged; any byte
//   sequence round-trips because every byte has a token;
// - SentencePiece-style (Llama 2, Mistral; Note [SentencePiece-style BPE]): spaces become U+2581
//   "▁" (a Prepend/Replace normalizer or a Metaspace pre-tokenizer), merges run over characters,
//   and a character the vocabulary lacks falls back to its bytes' <0xXX> tokens.
// Read from GPT-2's vocab.json + merges.txt, a tokenizer.json, or a GGUF file's tokenizer.
// Merges apply lowest rank first, leftmost first, one at a time (tokenizers' Word::merge_all).
#pragma once

#include <nlohmann/json.hpp>

#include <bitset>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "torchspeed/data/tokenizer.h"

namespace torchspeed::io::gguf {
class File;
}

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
  // The tokenizer a GGUF file carries: tokenizer.ggml.model "gpt2" (byte-level BPE: its tokens,
  // merges; tokenizer.ggml.pre "gpt-2"/"default", "smollm", "llama-bpe", "qwen2", another is
  // refused by name) or "llama" (SentencePiece: tokens with scores, merged highest score first
  // as llama.cpp merges them, byte fallback, a space prefix per tokenizer.ggml.add_space_prefix).
  // Control and user-defined tokens are matched literally, as added tokens; the EOS id.
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
  // This tokenizer as GGUF's tokenizer.ggml.* metadata (what `convert --format gguf` writes):
  // byte-level BPE as model "gpt2" with its merges and llama.cpp's name for the pre-tokenizer
  // (gpt-2, smollm, llama-bpe, qwen2; another is an error naming it); SentencePiece style as
  // model "llama" with scores from the merge ranks (Note [SentencePiece-style BPE]). Ids past
  // the vocabulary up to `n_vocab` are llama.cpp's [PADn] unused tokens.
  struct GgufVocab {
    std::string model, pre;
    std::vector<std::string> tokens;
    std::vector<int32_t> types;       // llama.cpp: 1 normal, 2 unknown, 3 control, 5 unused, 6 byte
    std::vector<float> scores;        // model "llama"
    std::vector<std::string> merges;  // model "gpt2"
    int64_t unk = -1;
    bool add_space_prefix = false;
  };
  GgufVocab gguf_vocab(int64_t n_vocab) const;
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  int64_t eos_id() const override { return eos_; }
  int64_t bos_to_add() const override { return add_bos_; }
  std::string source() const override { return source_; }
  // GPT-2's split of `text` into the pieces BPE runs on (for tests).
  static std::vector<std::string> pre_tokenize(const std::string& text);

 private:
  BpeTokenizer(std::unordered_map<std::string, int64_t> vocab, std::vector<std::pair<std::string, std::string>> merges,
               const std::string& source, bool spm = false, std::vector<int> ranks = {});
  static BpeTokenizer from_gguf_spm(const io::gguf::File& f, const std::string& path);
  // A GGUF vocabulary's unknown, EOS and BOS ids and its control/user-defined tokens; every
  // index of `tokens` an id (a string listed twice keeps its first id for encoding, and each
  // index its string for decoding).
  void take_gguf_specials(const io::gguf::File& f, const std::string& path, const nlohmann::json& tokens,
                          const std::vector<std::pair<std::string, int64_t>>& special, bool add_bos_default);
  void bpe(const std::string& piece, std::vector<int64_t>& out) const;
  void encode_plain(const std::string& text, bool at_start, std::vector<int64_t>& out) const;
  // The merges as ids: (left << 32 | right) -> (rank, merged id); `order` keeps them by rank.
  void set_merges(const std::vector<std::pair<std::string, std::string>>& merges, const std::vector<int>& ranks);
  // SentencePiece style: the normalizer and Metaspace applied to one span of plain text (between
  // added tokens; `at_start`: the span begins the text).
  std::string spm_normalize(const std::string& text, bool at_start) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<uint64_t, std::pair<int, int64_t>> merges_;
  std::vector<std::pair<int64_t, int64_t>> merge_order_;  // by rank
  std::string byte_to_unicode_[256];            // UTF-8 of each byte's character
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
  std::string source_;
  std::vector<std::pair<std::string, int64_t>> added_;  // longest first (index_added)
  // added_ as a byte trie, so that one scan of the text finds every match (Note [Added tokens]).
  // Rebuilt by index_added() whenever added_ changes; encode refuses a stale index.
  std::unordered_map<uint64_t, int32_t> added_edges_;  // (node << 8) | byte -> child; node 0 is the root
  std::vector<int32_t> added_end_;                     // node -> index in added_ of the token ending there, or -1
  std::bitset<256> added_first_;                       // the bytes an added token starts with
  std::unordered_map<int64_t, size_t> added_by_id_;    // id -> index in added_ (the first, longest first)
  size_t added_indexed_ = 0;                           // added_.size() when the trie was built
  void index_added();
  // The earliest added token at or after `from` (the longest of those starting there): its
  // position and index in added_; npos for both where there is none.
  std::pair<size_t, size_t> find_added(const std::string& text, size_t from) const;
  int64_t eos_ = -1;
  int64_t add_bos_ = -1;
  int64_t unk_ = -1;  // what a byte the vocabulary lacks encodes as (-1: an error)
 public:
  struct PreStep;  // one step of the pre-tokenizer (bpe_tokenizer.cpp)
 private:
  // The pre-tokenizer as `tokenizers` composes it: regex splits (Llama 3's and Qwen2's
  // patterns, on PCRE2), SmolLM's digits, GPT-2's pattern; empty: GPT-2's pattern alone.
  std::vector<std::shared_ptr<const PreStep>> pre_;
  bool ignore_merges_ = false;  // Llama 3: a piece that is a vocabulary token is taken whole
  bool nfc_ = false;            // Qwen2: text NFC-normalized first (ICU)
  // SentencePiece style (Note [SentencePiece-style BPE]).
  bool spm_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool prepend_ = false;        // normalizer Prepend("▁") on every non-empty span (Llama 2's legacy)
  bool replace_space_ = false;  // normalizer Replace(" ", "▁")
  enum class Metaspace { kNone, kAlways, kFirst, kNever } metaspace_ = Metaspace::kNone;
  bool metaspace_split_ = false;
  std::vector<int64_t> byte_token_;  // SentencePiece style: <0xXX> token of each byte, -1 if none
  std::unordered_map<int64_t, uint8_t> byte_of_token_;  // and back
  std::vector<std::string> pre_split(const std::string& text) const;
};

}  // namespace torchspeed::data
