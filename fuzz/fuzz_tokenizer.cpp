// libFuzzer target: the tokenizer.json reader (BpeTokenizer::from_tokenizer_json: model,
// normalizer, pre-tokenizer, post-processor, added tokens) and, for an accepted file, encoding a
// fixed multilingual text, decoding every id, and writing it back out (to_tokenizer_json), which
// must read back to the same ids. Refusals are torchspeed::Error; anything else,
// or a read outside the bytes (ASan), is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "torchspeed/data/bpe_tokenizer.h"

namespace {
constexpr const char* kTarget = "fuzz_tokenizer";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string in = fuzz::scratch_dir() + "/tokenizer.json";
  fuzz::write_file(in, data, size);
  fuzz::run_expecting_errors(kTarget, [&] {
    const auto tok = torchspeed::data::BpeTokenizer::from_tokenizer_json(in);
    const std::string text = "Hello  w\xc3\xb6rld 123 <s>a</s> \xe3\x81\x93\xf0\x9f\x8e\x89 \xff";
    const auto ids = tok.encode(text);
    for (int64_t id : ids) (void)tok.token_bytes(id);
    (void)tok.normalized(text);
    (void)tok.bos_to_add();
    // Property: what to_tokenizer_json() writes (convert --format hf) reads back to the same ids.
    static const std::string again = fuzz::scratch_dir() + "/again.json";
    const std::string out = tok.to_tokenizer_json().dump();
    fuzz::write_file(again, reinterpret_cast<const uint8_t*>(out.data()), out.size());
    const auto tok2 = torchspeed::data::BpeTokenizer::from_tokenizer_json(again);
    if (tok2.encode(text) != ids || tok2.bos_to_add() != tok.bos_to_add())
      fuzz::bug(kTarget, "to_tokenizer_json() reads back to other ids");
  });
  return 0;
}
