// Which tokenizer goes with a model: see model_tokenizer.h.
#include "torchspeed/data/model_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "torchspeed/io/gguf.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data {

TokenizerPtr tokenizer_of_model(const std::string& path, const checkpoint::Model& model, const std::string& spec) {
  namespace fs = std::filesystem;
  std::string chosen = spec;
  if (chosen.empty() && fs::is_regular_file(path) && io::gguf::is_gguf(path)) chosen = path;  // its own tokenizer
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

namespace {
namespace fs = std::filesystem;

std::string token_text(const nlohmann::json& v) {  // "str" or an AddedToken {"content": "str"}
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v.at("content").is_string()) return v.at("content").get<std::string>();
  return "";
}

nlohmann::json read_json_or_null(const fs::path& p) {
  if (!fs::is_regular_file(p)) return nullptr;
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, p.string(), ": not JSON: ", e.what());
  }
  return nullptr;
}

// A Hugging Face folder's template and special tokens, into `f`; false when it has no template.
bool from_hf_folder(const fs::path& dir, const Tokenizer& tok, ChatFormat& f) {
  const nlohmann::json cfg = read_json_or_null(dir / "tokenizer_config.json");
  std::string text, source;
  if (fs::is_regular_file(dir / "chat_template.jinja")) {
    std::ifstream in(dir / "chat_template.jinja", std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
    source = (dir / "chat_template.jinja").string();
  } else if (cfg.is_object() && cfg.contains("chat_template")) {
    const auto& t = cfg.at("chat_template");
    source = (dir / "tokenizer_config.json").string() + " chat_template";
    if (t.is_string()) {
      text = t.get<std::string>();
    } else if (t.is_array()) {  // named templates: the "default" one
      for (const auto& e : t) {
        if (e.is_object() && e.value("name", std::string()) == "default" && e.contains("template") && e.at("template").is_string()) {
          text = e.at("template").get<std::string>();
        }
      }
    }
  }
  if (text.empty()) return false;
  f.tmpl = std::make_shared<const ChatTemplate>(text, source);
  f.source = source;
  f.text = text;
  if (cfg.is_object()) {
    for (const char* k : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
      if (cfg.contains(k)) f.context[k] = token_text(cfg.at(k));
    }
  }
  const nlohmann::json gen = read_json_or_null(dir / "generation_config.json");
  if (gen.is_object() && gen.contains("eos_token_id")) {
    const auto& e = gen.at("eos_token_id");
    if (e.is_number_integer()) f.stop_ids.push_back(e.get<int64_t>());
    if (e.is_array()) {
      for (const auto& x : e) {
        if (x.is_number_integer()) f.stop_ids.push_back(x.get<int64_t>());
      }
    }
  }
  (void)tok;
  return true;
}

bool from_gguf_info(const nlohmann::json& info, const std::string& source, const Tokenizer& tok, ChatFormat& f) {
  if (!info.is_object() || !info.contains("tokenizer.chat_template") || !info.at("tokenizer.chat_template").is_string()) {
    return false;
  }
  f.source = source + " tokenizer.chat_template";
  f.text = info.at("tokenizer.chat_template").get<std::string>();
  f.tmpl = std::make_shared<const ChatTemplate>(f.text, f.source);
  for (const auto& [key, name] : {std::pair<const char*, const char*>{"tokenizer.ggml.bos_token_id", "bos_token"},
                                  {"tokenizer.ggml.eos_token_id", "eos_token"}}) {
    if (info.contains(key) && info.at(key).is_number_integer()) {
      const int64_t id = info.at(key).get<int64_t>();
      if (id >= 0 && id < tok.vocab_size()) f.context[name] = tok.token_bytes(id);
    }
  }
  return true;
}
}  // namespace

ChatFormatPtr chat_format_of_model(const std::string& path, const checkpoint::Model& model, const Tokenizer& tok) {
  auto f = std::make_shared<ChatFormat>();
  bool found = from_gguf_info(model.config.value("gguf", nlohmann::json()), model.source, tok, *f);
  for (const fs::path& dir : {fs::path(path), fs::path(path) / "model"}) {
    if (!found && fs::is_directory(dir)) found = from_hf_folder(dir, tok, *f);
  }
  const std::string src = tok.source();
  if (!found && src != "bytes" && fs::exists(src)) {
    if (io::gguf::is_gguf(src)) {
      const io::gguf::File g(src);
      found = from_gguf_info(g.header().metadata, src, tok, *f);
    } else {
      found = from_hf_folder(fs::is_directory(src) ? fs::path(src) : fs::path(src).parent_path(), tok, *f);
    }
  }
  if (tok.eos_id() >= 0 && std::find(f->stop_ids.begin(), f->stop_ids.end(), tok.eos_id()) == f->stop_ids.end()) {
    f->stop_ids.push_back(tok.eos_id());
  }
  if (!f->context.contains("eos_token") && tok.eos_id() >= 0) f->context["eos_token"] = tok.token_bytes(tok.eos_id());
  if (!found) f->tmpl = nullptr;
  return f;
}

}  // namespace torchspeed::data
