// Hugging Face GPT-2 folders: config.json <-> our model section, tensor names and layouts.
#include "torchspeed/checkpoint/hf_gpt2.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include "torchspeed/config/config.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/file.h"

namespace torchspeed::checkpoint::hf {
namespace fs = std::filesystem;

// Note [GPT-2 names]
// Ours (torch.nn.Linear weights [out, in])      GPT2LMHeadModel (Conv1D weights [in, out])
//   embed.tok.weight [V, d]                      transformer.wte.weight
//   embed.pos.weight [T, d]                      transformer.wpe.weight
//   block{i}.ln1.{weight,bias}                   transformer.h.{i}.ln_1.{weight,bias}
//   block{i}.qkv.{weight,bias}    [3d, d]        transformer.h.{i}.attn.c_attn.{weight,bias}  (weight.T)
//   block{i}.attn_proj.{weight,bias} [d, d]      transformer.h.{i}.attn.c_proj.{weight,bias}  (weight.T)
//   block{i}.ln2.{weight,bias}                   transformer.h.{i}.ln_2.{weight,bias}
//   block{i}.fc.{weight,bias}     [4d, d]        transformer.h.{i}.mlp.c_fc.{weight,bias}     (weight.T)
//   block{i}.mlp_proj.{weight,bias} [d, 4d]      transformer.h.{i}.mlp.c_proj.{weight,bias}   (weight.T)
//   head.ln_f.{weight,bias}                      transformer.ln_f.{weight,bias}
//   head.weight (untied heads only)              lm_head.weight [V, d]
// The fused qkv layouts agree: rows (GPT-2: columns) are q of every head, then k, then v, head
// h at h*hd..(h+1)*hd of each third. The original GPT-2 checkpoints have no "transformer."
// prefix and store the causal mask as h.{i}.attn.bias / attn.masked_bias (buffers, skipped).
namespace {

const char* const kTokenizerFiles[] = {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                                       "special_tokens_map.json"};

struct BlockPart {
  const char* hf;
  const char* ours;
  bool conv1d;  // a projection: transposed
};
const BlockPart kBlockParts[] = {
    {"ln_1", "ln1", false},          {"attn.c_attn", "qkv", true}, {"attn.c_proj", "attn_proj", true},
    {"ln_2", "ln2", false},          {"mlp.c_fc", "fc", true},     {"mlp.c_proj", "mlp_proj", true},
};

// HF name (without "transformer.") -> (our name, transpose); empty for a skipped buffer.
std::pair<std::string, bool> our_name(const std::string& hf_name, bool tied) {
  static const std::map<std::string, std::string> top = {{"wte.weight", "embed.tok.weight"},
                                                         {"wpe.weight", "embed.pos.weight"},
                                                         {"ln_f.weight", "head.ln_f.weight"},
                                                         {"ln_f.bias", "head.ln_f.bias"}};
  if (auto it = top.find(hf_name); it != top.end()) return {it->second, false};
  if (hf_name == "lm_head.weight") return {tied ? "" : "head.weight", false};
  static const std::regex block(R"(h\.(\d+)\.(.+)\.(weight|bias))");
  std::smatch m;
  if (std::regex_match(hf_name, m, block)) {
    if (m[2] == "attn" && m[3] == "bias") return {"", false};  // the causal mask buffer
    for (const BlockPart& p : kBlockParts) {
      if (m[2] == p.hf) return {concat("block", m[1].str(), ".", p.ours, ".", m[3].str()), p.conv1d && m[3] == "weight"};
    }
  }
  if (std::regex_match(hf_name, std::regex(R"(h\.\d+\.attn\.masked_bias)"))) return {"", false};
  return {"?", false};
}

const nlohmann::json& need(const nlohmann::json& j, const char* key, const std::string& source) {
  TS_CHECK(j.contains(key) && !j.at(key).is_null(), source, ": \"", key, "\" is missing");
  return j.at(key);
}

int64_t int_of(const nlohmann::json& j, const char* key, const std::string& source) {
  const auto& v = need(j, key, source);
  TS_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, source, ": \"", key, "\" must be a positive integer, got ", v.dump());
  return v.get<int64_t>();
}

double double_of(const nlohmann::json& j, const char* key, double fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  TS_CHECK(j.at(key).is_number(), source, ": \"", key, "\" must be a number, got ", j.at(key).dump());
  return j.at(key).get<double>();
}

bool bool_of(const nlohmann::json& j, const char* key, bool fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  TS_CHECK(j.at(key).is_boolean(), source, ": \"", key, "\" must be true or false, got ", j.at(key).dump());
  return j.at(key).get<bool>();
}

void copy_file_atomic(const fs::path& from, const fs::path& to) { write_file_atomic(to.string(), read_file(from.string())); }

}  // namespace

bool is_hf_folder(const std::string& dir) {
  const fs::path cfg = fs::path(dir) / "config.json";
  if (!fs::is_regular_file(cfg)) return false;
  try {
    return config::read_json_file(cfg.string()).contains("model_type");
  } catch (const std::exception&) {
    return false;
  }
}

nlohmann::json model_section_from_gpt2(const nlohmann::json& h, const std::string& source) {
  TS_CHECK(h.is_object(), source, ": expected a JSON object");
  const std::string type = h.value("model_type", std::string());
  TS_CHECK(type == "gpt2", source, ": \"model_type\" is \"", type, "\", not \"gpt2\"");
  nlohmann::json m;
  m["vocab"] = int_of(h, "vocab_size", source);
  m["seq_len"] = int_of(h, h.contains("n_positions") ? "n_positions" : "n_ctx", source);
  const int64_t d = int_of(h, "n_embd", source);
  m["d_model"] = d;
  m["n_layer"] = int_of(h, "n_layer", source);
  m["n_head"] = int_of(h, "n_head", source);
  TS_CHECK(d % m["n_head"].get<int64_t>() == 0, source, ": \"n_embd\" ", d, " is not a multiple of \"n_head\" ",
           m["n_head"].get<int64_t>());
  if (h.contains("n_inner") && !h.at("n_inner").is_null()) {
    TS_CHECK(h.at("n_inner").is_number_integer() && h.at("n_inner").get<int64_t>() == 4 * d, source,
             ": \"n_inner\" is ", h.at("n_inner").dump(), "; torchspeed's GPT has an MLP of 4 n_embd = ", 4 * d);
  }
  const std::string act = h.value("activation_function", std::string("gelu_new"));
  if (act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast") {
    m["activation"] = "gelu_tanh";  // three spellings of 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
  } else if (act == "gelu") {
    m["activation"] = "gelu";
  } else {
    TS_CHECK(false, source, ": \"activation_function\" is \"", act,
             "\"; torchspeed's GPT computes \"gelu\" (exact) and \"gelu_new\" (tanh approximation)");
  }
  m["layer_norm_eps"] = double_of(h, "layer_norm_epsilon", 1e-5, source);
  m["tie_embeddings"] = bool_of(h, "tie_word_embeddings", true, source);
  // One dropout rate in our GPT: GPT-2's three are equal (0.1) in every released checkpoint.
  const double resid = double_of(h, "resid_pdrop", 0.1, source);
  for (const char* k : {"embd_pdrop", "attn_pdrop"}) {
    TS_CHECK(double_of(h, k, 0.1, source) == resid, source, ": \"", k, "\" differs from \"resid_pdrop\" ", resid,
             "; torchspeed's GPT has one dropout rate");
  }
  m["dropout"] = resid;
  TS_CHECK(bool_of(h, "scale_attn_weights", true, source), source,
           ": \"scale_attn_weights\": false is not supported (attention is scaled by 1/sqrt(head_dim))");
  TS_CHECK(!bool_of(h, "scale_attn_by_inverse_layer_idx", false, source), source,
           ": \"scale_attn_by_inverse_layer_idx\": true is not supported");
  TS_CHECK(!bool_of(h, "add_cross_attention", false, source), source, ": \"add_cross_attention\": true is not supported");
  return m;
}

nlohmann::json gpt2_config(const nlohmann::json& m, int64_t eos) {
  const double dropout = m.value("dropout", 0.0);
  nlohmann::json h = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", m.at("vocab")},
      {"n_positions", m.at("seq_len")},
      {"n_embd", m.at("d_model")},
      {"n_layer", m.at("n_layer")},
      {"n_head", m.at("n_head")},
      {"n_inner", nullptr},
      {"activation_function", m.value("activation", std::string("gelu")) == "gelu_tanh" ? "gelu_new" : "gelu"},
      {"resid_pdrop", dropout},
      {"embd_pdrop", dropout},
      {"attn_pdrop", dropout},
      {"layer_norm_epsilon", m.value("layer_norm_eps", 1e-5)},
      {"initializer_range", 0.02},
      {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false},
      {"reorder_and_upcast_attn", false},
      {"tie_word_embeddings", m.value("tie_embeddings", true)},
      {"use_cache", true},
      {"bos_token_id", eos >= 0 ? nlohmann::json(eos) : nlohmann::json(nullptr)},
      {"eos_token_id", eos >= 0 ? nlohmann::json(eos) : nlohmann::json(nullptr)},
  };
  return h;
}

std::vector<std::string> safetensors_files(const std::string& dir) {
  const fs::path d(dir);
  std::vector<std::string> files;
  if (fs::exists(d / "model.safetensors")) {
    files.push_back((d / "model.safetensors").string());
  } else if (fs::exists(d / "model.safetensors.index.json")) {
    const std::string index = (d / "model.safetensors.index.json").string();
    const nlohmann::json j = config::read_json_file(index);
    TS_CHECK(j.contains("weight_map") && j.at("weight_map").is_object(), index, ": no \"weight_map\" object");
    std::set<std::string> seen;
    for (const auto& [name, file] : j.at("weight_map").items()) {
      TS_CHECK(file.is_string(), index, ": weight_map[\"", name, "\"] must be a file name");
      check_plain_name(file.get<std::string>(), index, concat("weight_map[\"", name, "\"]: shard file").c_str());
      if (seen.insert(file.get<std::string>()).second) files.push_back((d / file.get<std::string>()).string());
    }
  } else {
    TS_CHECK(false, dir, ": no model.safetensors (or model.safetensors.index.json); torchspeed reads safetensors, ",
             "not pytorch_model.bin: save with save_pretrained(DIR) (safe_serialization is the default)");
  }
  return files;
}

void copy_tokenizer_files(const std::string& dir, const std::string& tokenizer_dir) {
  if (tokenizer_dir.empty()) return;
  if (fs::is_regular_file(tokenizer_dir) && fs::path(tokenizer_dir).filename() != "vocab.json") {
    copy_file_atomic(tokenizer_dir, fs::path(dir) / "tokenizer.json");  // a tokenizer.json by any name
    return;
  }
  // A folder, or the vocab.json of one (vocab.json + merges.txt).
  const fs::path from = fs::is_regular_file(tokenizer_dir) ? fs::path(tokenizer_dir).parent_path() : fs::path(tokenizer_dir);
  int copied = 0;
  for (const char* f : kTokenizerFiles) {
    const fs::path src = from / f;
    if (fs::is_regular_file(src)) {
      copy_file_atomic(src, fs::path(dir) / f);
      ++copied;
    }
  }
  TS_CHECK(copied > 0, tokenizer_dir, ": no tokenizer files (tokenizer.json, or vocab.json and merges.txt) to copy");
  // The generation defaults (EOS ids) travel with the tokenizer when the model came with them.
  if (fs::is_regular_file(from / "generation_config.json")) {
    copy_file_atomic(from / "generation_config.json", fs::path(dir) / "generation_config.json");
  }
}

Model load_hf(const std::string& dir) {
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  const nlohmann::json h = config::read_json_file(cfg_path);
  const std::string type = h.is_object() ? h.value("model_type", std::string()) : std::string();
  if (type == "gpt2") return load_gpt2(dir);
  return load_decoder(dir);
}

Model load_gpt2(const std::string& dir) {
  const fs::path d(dir);
  const std::string cfg_path = (d / "config.json").string();
  const nlohmann::json h = config::read_json_file(cfg_path);
  Model out;
  out.config["model"] = model_section_from_gpt2(h, cfg_path);
  out.config["hf_config"] = h;
  const bool tied = out.config["model"]["tie_embeddings"].get<bool>();
  const std::vector<std::string> files = safetensors_files(dir);
  for (const std::string& file : files) {
    auto f = load_safetensors(file);
    for (auto& [hf_name, t] : f.tensors) {
      const std::string bare = hf_name.rfind("transformer.", 0) == 0 ? hf_name.substr(12) : hf_name;
      const auto [ours, transpose] = our_name(bare, tied);
      TS_CHECK(ours != "?", file, ": tensor \"", hf_name, "\" is not part of a GPT-2 (GPT2LMHeadModel) model");
      if (ours.empty()) continue;
      at::Tensor v = t.to(at::kFloat);
      out.params.emplace_back(ours, transpose ? v.t().contiguous() : v.contiguous());
    }
  }
  // Model order (the order stack_parameters gives), so a folder loads like our own files.
  auto rank = [](const std::string& n) -> std::pair<int64_t, std::string> {
    if (n.rfind("embed.", 0) == 0) return {-1, n == "embed.tok.weight" ? "0" : "1"};
    if (n.rfind("head.", 0) == 0) return {1 << 30, n};
    const auto dot = n.find('.');
    return {std::stoll(n.substr(5, dot - 5)), n};
  };
  std::stable_sort(out.params.begin(), out.params.end(),
                   [&](const auto& a, const auto& b) { return rank(a.first).first < rank(b.first).first; });
  out.source = files.size() == 1 ? files[0] : dir;
  return out;
}

int64_t save_gpt2(const std::string& dir, const NamedTensors& params, const nlohmann::json& model_section,
                  at::ScalarType dtype, const std::string& tokenizer_dir, int64_t eos) {
  const bool tied = model_section.value("tie_embeddings", true);
  // Our name -> HF name, built from the table above.
  std::map<std::string, std::pair<std::string, bool>> names = {
      {"embed.tok.weight", {"transformer.wte.weight", false}},
      {"embed.pos.weight", {"transformer.wpe.weight", false}},
      {"head.ln_f.weight", {"transformer.ln_f.weight", false}},
      {"head.ln_f.bias", {"transformer.ln_f.bias", false}},
      {"head.weight", {"lm_head.weight", false}},
  };
  const int64_t n_layer = model_section.at("n_layer").get<int64_t>();
  for (int64_t i = 0; i < n_layer; ++i) {
    for (const BlockPart& p : kBlockParts) {
      for (const char* kind : {"weight", "bias"}) {
        names[concat("block", i, ".", p.ours, ".", kind)] = {concat("transformer.h.", i, ".", p.hf, ".", kind),
                                                             p.conv1d && std::string(kind) == "weight"};
      }
    }
  }
  NamedTensors out;
  for (const auto& [name, t] : params) {
    const auto it = names.find(name);
    TS_CHECK(it != names.end(), "parameter '", name, "' has no GPT-2 counterpart: the model is not torchspeed's GPT");
    if (name == "head.weight" && tied) continue;
    at::Tensor v = it->second.second ? t.t() : t;
    out.emplace_back(it->second.first, v.to(dtype).contiguous());
  }
  fs::create_directories(dir);
  nlohmann::json h = gpt2_config(model_section, eos);
  h["torch_dtype"] = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
  const auto digest = save_safetensors((fs::path(dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / "config.json").string(), h.dump(2) + "\n");
  copy_tokenizer_files(dir, tokenizer_dir);
  return digest.bytes;
}

}  // namespace torchspeed::checkpoint::hf
