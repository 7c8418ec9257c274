// Which tokenizer goes with a model: see model_tokenizer.h.
#include "torchspeed/data/model_tokenizer.h"

#include <filesystem>

#include "torchspeed/runtime/error.h"

namespace torchspeed::data {

TokenizerPtr tokenizer_of_model(const std::string& path, const checkpoint::Model& model, const std::string& spec) {
  namespace fs = std::filesystem;
  std::string chosen = spec;
  if (chosen.empty()) {
    for (const fs::path& dir : {fs::path(path), fs::path(path) / "model"}) {
      if (fs::is_directory(dir) && (fs::exists(dir / "tokenizer.json") || fs::exists(dir / "vocab.json"))) {
        chosen = dir.string();
        break;
      }
    }
  }
  if (chosen.empty()) {
    const auto data = model.config.value("data", nlohmann::json::object());
    if (data.is_object() && data.contains("tokenizer") && data.at("tokenizer").is_string()) {
      chosen = data.at("tokenizer").get<std::string>();
    }
  }
  auto tok = load_tokenizer(chosen);
  const int64_t vocab = model.config.value("model", nlohmann::json::object()).value("vocab", int64_t{256});
  TS_CHECK(tok->vocab_size() <= vocab, "the tokenizer ", tok->source(), " has ", tok->vocab_size(),
           " tokens but the model at ", path, " only ", vocab, ": pass the tokenizer it was trained with (--tokenizer)");
  return tok;
}

}  // namespace torchspeed::data
