// Tokenizer helpers: decoding through token_bytes, and choosing a tokenizer by name or path.
#include "torchspeed/data/tokenizer.h"

#include "torchspeed/io/gguf.h"

#include <filesystem>

#include "torchspeed/data/bpe_tokenizer.h"
#include "torchspeed/data/text.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data {

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) out += token_bytes(id);
  return out;
}

std::vector<int64_t> Tokenizer::encode_prompt(const std::string& text) const {
  std::vector<int64_t> ids = encode(text);
  if (const int64_t bos = bos_to_add(); bos >= 0) ids.insert(ids.begin(), bos);
  return ids;
}

TokenizerPtr load_tokenizer(const std::string& spec) {
  namespace fs = std::filesystem;
  if (spec.empty() || spec == "bytes") return std::make_shared<ByteTokenizer>();
  TS_CHECK(fs::exists(spec), "tokenizer '", spec,
           "' does not exist: give \"bytes\", a tokenizer.json, or a folder with tokenizer.json or vocab.json + merges.txt");
  if (fs::is_directory(spec)) return std::make_shared<BpeTokenizer>(BpeTokenizer::from_folder(spec));
  if (io::gguf::is_gguf(spec)) return std::make_shared<BpeTokenizer>(BpeTokenizer::from_gguf(spec));
  return std::make_shared<BpeTokenizer>(BpeTokenizer::from_tokenizer_json(spec));
}

}  // namespace torchspeed::data
