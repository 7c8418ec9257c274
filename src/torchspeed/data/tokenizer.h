// The tokenizer interface training, generation and serving share: text to ids, and each id back
// to the bytes it stands for (byte-level tokenizers give every id a byte string, so generated
// text streams as bytes and is made valid UTF-8 at the edges). Two kinds: bytes (vocab 256, the
// default: no files) and GPT-2's byte-level BPE (bpe_tokenizer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torchspeed::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  // The bytes of one token; an id outside the vocabulary is an error naming it.
  virtual std::string token_bytes(int64_t id) const = 0;
  std::string decode(const std::vector<int64_t>& ids) const;
  // The text as the tokenizer's normalizer leaves it (Qwen2's NFC): what decode(encode(text))
  // gives back. Identity for tokenizers without one.
  virtual std::string normalized(const std::string& text) const { return text; }
  virtual int64_t vocab_size() const = 0;
  // The token a prompt starts with (Hugging Face's add_special_tokens: a TemplateProcessing
  // post-processor that begins with a special token, Llama's <s> or <|begin_of_text|>; GGUF's
  // tokenizer.ggml.add_bos_token), or -1. encode() itself never adds it.
  virtual int64_t bos_to_add() const { return -1; }
  // A prompt's text as Hugging Face encodes it with special tokens (and vLLM and llama.cpp do):
  // encode() with bos_to_add() first where there is one. What /v1/completions and `generate` use.
  std::vector<int64_t> encode_prompt(const std::string& text) const;
  // The end-of-text token (GPT-2's <|endoftext|>), or -1 when the vocabulary has none.
  virtual int64_t eos_id() const { return -1; }
  // "bytes" or the file or folder it was read from.
  virtual std::string source() const = 0;
};
using TokenizerPtr = std::shared_ptr<const Tokenizer>;

// `spec`: "bytes" (or empty), or a BPE tokenizer's tokenizer.json file or folder (tokenizer.json,
// or vocab.json + merges.txt). Errors name the path.
TokenizerPtr load_tokenizer(const std::string& spec);

}  // namespace torchspeed::data
