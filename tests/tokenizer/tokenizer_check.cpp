// Compares torchspeed's BPE tokenizer with Hugging Face's `tokenizers` on the reference data
// make_reference.py wrote: for every corpus file, the ids from tokenizer.json and from
// vocab.json + merges.txt must equal those of `tokenizers`, and decoding must give the text back.
// Prints "tokenizer check: N files, T tokens equal" and exits 0, or names the first difference.
#include <nlohmann/json.hpp>

#include <cstdio>

#include "torchspeed/data/bpe_tokenizer.h"
#include "torchspeed/base/file.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: tokenizer_check REFERENCE_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  using torchspeed::data::BpeTokenizer;
  const BpeTokenizer from_json = BpeTokenizer::from_tokenizer_json(dir + "/tokenizer.json");
  const BpeTokenizer from_files = BpeTokenizer::from_files(dir + "/vocab.json", dir + "/merges.txt");
  const auto ref = nlohmann::json::parse(torchspeed::read_file(dir + "/ids.json"));
  int64_t tokens = 0, files = 0;
  for (const auto& name : ref.at("files")) {
    const std::string n = name.get<std::string>();
    const std::string text = torchspeed::read_file(dir + "/texts/" + n + ".txt");
    const auto want = ref.at("ids").at(n).get<std::vector<int64_t>>();
    for (const BpeTokenizer* t : {&from_json, &from_files}) {
      const auto got = t->encode(text);
      if (got != want) {
        size_t i = 0;
        while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
        std::fprintf(stderr, "%s: ids differ at token %zu of %zu (ours %ld, tokenizers' %ld), %s\n", n.c_str(), i,
                     want.size(), i < got.size() ? static_cast<long>(got[i]) : -1L,
                     i < want.size() ? static_cast<long>(want[i]) : -1L,
                     t == &from_json ? "tokenizer.json" : "vocab.json + merges.txt");
        return 1;
      }
      if (t->decode(got) != text) {
        std::fprintf(stderr, "%s: decoding does not give the text back\n", n.c_str());
        return 1;
      }
    }
    tokens += static_cast<int64_t>(want.size());
    ++files;
  }
  std::printf("tokenizer check: %ld files, %ld tokens equal to tokenizers' (vocab %ld)\n", static_cast<long>(files),
              static_cast<long>(tokens), static_cast<long>(from_json.vocab_size()));
  return 0;
}
