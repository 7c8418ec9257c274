// Encodes files with a tokenizer as generate and serve load it (data::load_tokenizer: a
// tokenizer.json, a folder, or a GGUF file's own tokenizer), for a Python test to compare with
// Hugging Face's (with special tokens: a BOS where the tokenizer adds one, as /v1/completions
// does). usage: encode_files TOKENIZER OUT.json FILE... ; writes {"FILE": [ids], ...}
// and checks that decoding gives each file's bytes back (as the tokenizer's normalizer leaves
// them).
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "torchspeed/data/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: encode_files TOKENIZER OUT.json FILE...\n");
    return 2;
  }
  try {
    const auto tok = torchspeed::data::load_tokenizer(argv[1]);
    nlohmann::json out = nlohmann::json::object();
    int64_t tokens = 0;
    for (int i = 3; i < argc; ++i) {
      std::ifstream in(argv[i], std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      const std::string text = ss.str();
      // As /v1/completions encodes a prompt: the tokenizer's BOS first where it adds one; decoding
      // the rest gives the text back.
      const auto ids = tok->encode_prompt(text);
      const size_t bos = tok->bos_to_add() >= 0 ? 1 : 0;
      if (tok->decode(std::vector<int64_t>(ids.begin() + bos, ids.end())) != tok->normalized(text)) {
        std::fprintf(stderr, "encode_files: %s does not decode back to its (normalized) bytes\n", argv[i]);
        return 1;
      }
      tokens += static_cast<int64_t>(ids.size());
      out[argv[i]] = ids;
    }
    std::ofstream(argv[2]) << out.dump();
    std::printf("encode_files: %d files, %lld tokens (tokenizer %s, %lld ids)\n", argc - 3, static_cast<long long>(tokens),
                tok->source().c_str(), static_cast<long long>(tok->vocab_size()));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "encode_files: %s\n", e.what());
    return 1;
  }
}
