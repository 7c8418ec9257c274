#include "torchspeed/checkpoint/peft.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/file.h"

namespace torchspeed::checkpoint::peft {

// Note [LoRA]
// A LoRA adapter (Hu et al., 2021; PEFT's LoraLayer) adds to a linear module's output
// y = W x the update scale * B (A x), A [r, in] and B [out, r], scale = lora_alpha / r (with
// use_rslora, lora_alpha / sqrt(r); a module given its own rank by rank_pattern uses that rank).
// Our blocks fuse Hugging Face's q/k/v projections into one qkv linear and gate/up into one fc
// linear, so a module's update lands on rows of a fused output: q_proj on qkv's first n_head *
// head_dim rows, k_proj and v_proj on the next n_kv_head * head_dim each, gate_proj and up_proj
// on fc's two halves. Serving stacks an adapter's modules of one fused linear into one A (their A
// rows one after another) and one block-diagonal B, so an update is two small products per fused
// linear whatever the number of modules; training adds the modules' updates to the same rows
// (models/lora). The dropout PEFT applies to x in training (lora_dropout) is not applied: a
// config that sets it trains as with 0.

std::vector<Target> targets(const models::GPTConfig& c) {
  const int64_t d = c.d_model, Q = c.q_width(), KV = c.kv_width(), ff = c.ff();
  if (!c.rope()) {  // GPT-2: attn.c_attn is the fused qkv itself, mlp.c_fc the fc
    return {{"attn.c_attn", "c_attn", Fused::kQKV, 0, Q + 2 * KV, d},
            {"attn.c_proj", "c_proj", Fused::kProj, 0, d, Q},
            {"mlp.c_fc", "c_fc", Fused::kFC, 0, ff, d},
            {"mlp.c_proj", "c_proj", Fused::kMLP, 0, d, ff}};
  }
  TS_CHECK(c.swiglu(), "LoRA: a model with rotary positions and activation \"", c.activation,
           "\" has no Hugging Face module names (the Llama family's MLP is SwiGLU)");
  return {{"self_attn.q_proj", "q_proj", Fused::kQKV, 0, Q, d},
          {"self_attn.k_proj", "k_proj", Fused::kQKV, Q, KV, d},
          {"self_attn.v_proj", "v_proj", Fused::kQKV, Q + KV, KV, d},
          {"self_attn.o_proj", "o_proj", Fused::kProj, 0, d, Q},
          {"mlp.gate_proj", "gate_proj", Fused::kFC, 0, ff, d},
          {"mlp.up_proj", "up_proj", Fused::kFC, ff, ff, d},
          {"mlp.down_proj", "down_proj", Fused::kMLP, 0, d, ff}};
}

namespace {
std::string layer_prefix(const models::GPTConfig& c, int64_t layer) {
  return (c.rope() ? "base_model.model.model.layers." : "base_model.model.transformer.h.") + std::to_string(layer) + ".";
}

bool empty_or_null(const nlohmann::json& v) { return v.is_null() || ((v.is_array() || v.is_object()) && v.empty()); }
}  // namespace

std::string tensor_name(const models::GPTConfig& c, int64_t layer, const Target& t, char which) {
  return layer_prefix(c, layer) + t.module + (which == 'A' ? ".lora_A.weight" : ".lora_B.weight");
}

double Adapter::scale(int64_t module_rank) const {
  return rslora ? alpha / std::sqrt(static_cast<double>(module_rank)) : alpha / static_cast<double>(module_rank);
}

Adapter load(const std::string& dir, const models::GPTConfig& cfg) {
  Adapter a;
  a.source = dir;
  const std::string cfg_path = dir + "/adapter_config.json";
  TS_CHECK(std::filesystem::is_regular_file(cfg_path), dir, ": no adapter_config.json (a LoRA adapter is PEFT's folder: ",
           "adapter_config.json and adapter_model.safetensors)");
  try {
    a.config = nlohmann::json::parse(read_file(cfg_path));
  } catch (const nlohmann::json::exception& e) {  // parse errors, and numbers past a double
    TS_CHECK(false, cfg_path, ": not JSON (", e.what(), ")");
  }
  const nlohmann::json& j = a.config;
  TS_CHECK(j.is_object(), cfg_path, ": expected a JSON object");
  auto bad = [&](const std::string& key, const std::string& why) { TS_CHECK(false, cfg_path, ": \"", key, "\" ", why); };
  if (j.contains("peft_type") && j["peft_type"] != "LORA") bad("peft_type", "is " + j["peft_type"].dump() + "; only LORA adapters are served");
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1) bad("r", "must be a positive integer");
  a.r = j["r"].get<int64_t>();
  if (j.contains("lora_alpha")) {
    if (!j["lora_alpha"].is_number()) bad("lora_alpha", "must be a number");
    a.alpha = j["lora_alpha"].get<double>();
  } else {
    a.alpha = 8;  // PEFT's default
  }
  if (j.contains("use_rslora") && !j["use_rslora"].is_null()) {
    if (!j["use_rslora"].is_boolean()) bad("use_rslora", "must be true or false");
    a.rslora = j["use_rslora"].get<bool>();
  }
  // What changes the forward and is not computed here is refused by name; the rest of PEFT's keys
  // (dropout, initialisation, revision, task type...) concern training or bookkeeping only.
  if (j.contains("use_dora") && j["use_dora"] != false && !j["use_dora"].is_null()) bad("use_dora", "is " + j["use_dora"].dump() + ": DoRA adapters are not supported");
  if (j.contains("bias") && j["bias"] != "none") bad("bias", "is " + j["bias"].dump() + ": only \"none\" is supported (no LoRA biases)");
  if (j.contains("lora_bias") && j["lora_bias"] != false && !j["lora_bias"].is_null()) bad("lora_bias", "is " + j["lora_bias"].dump() + ": LoRA biases are not supported");
  // LoRA variants and extras PEFT writes as keys of a LoRA config, each of which changes the
  // forward when set (null, false, {} and [] are PEFT's "off").
  for (const char* k : {"modules_to_save", "alpha_pattern", "layer_replication", "trainable_token_indices", "target_parameters",
                        "use_qalora", "use_bdlora", "alora_invocation_tokens", "arrow_config", "kasa_config", "monteclora_config"}) {
    if (j.contains(k) && !empty_or_null(j[k]) && j[k] != false) bad(k, "is set (" + j[k].dump() + "): not supported");
  }
  const bool rank_pattern = j.contains("rank_pattern") && !empty_or_null(j["rank_pattern"]);
  const std::vector<Target> ts = targets(cfg);
  if (j.contains("target_modules") && j["target_modules"].is_array()) {
    std::set<std::string> known;
    for (const Target& t : ts) known.insert(t.short_name);
    for (const auto& m : j["target_modules"]) {
      if (!m.is_string() || (!known.count(m.get<std::string>()) && m.get<std::string>() != "all-linear")) {
        bad("target_modules", "names " + m.dump() + ", which is not a linear of this model's blocks (" +
                                   std::to_string(known.size()) + " are: q/k/v/o_proj, gate/up/down_proj or GPT-2's)");
      }
    }
  }

  const std::string st = dir + "/adapter_model.safetensors";
  TS_CHECK(std::filesystem::is_regular_file(st), dir, ": no adapter_model.safetensors",
           std::filesystem::exists(dir + "/adapter_model.bin") ? " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" : "");
  SafetensorsFile file = load_safetensors(st);
  std::map<std::string, std::pair<int64_t, size_t>> where;  // tensor name -> (layer, target)
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    for (size_t t = 0; t < ts.size(); ++t) {
      where[tensor_name(cfg, l, ts[t], 'A')] = {l, t};
      where[tensor_name(cfg, l, ts[t], 'B')] = {l, t};
    }
  }
  a.A.assign(static_cast<size_t>(cfg.n_layer), std::vector<at::Tensor>(ts.size()));
  a.B = a.A;
  int64_t found = 0;
  for (auto& [name, tensor] : file.tensors) {
    const auto it = where.find(name);
    TS_CHECK(it != where.end(), st, ": tensor \"", name, "\" adapts no linear of this model's ", cfg.n_layer,
             " blocks (expected names like \"", tensor_name(cfg, 0, ts[0], 'A'), "\")");
    TS_CHECK(c10::isFloatingType(tensor.scalar_type()) && tensor.dim() == 2, st, ": tensor \"", name,
             "\" must be a floating-point matrix, got ", tensor.scalar_type(), " of ", tensor.dim(), " dimensions");
    const auto [l, t] = it->second;
    const bool is_a = name.compare(name.size() - 14, 14, ".lora_A.weight") == 0;  // a name `where` holds
    at::Tensor& slot = (is_a ? a.A : a.B)[static_cast<size_t>(l)][t];
    slot = tensor.to(at::kFloat).contiguous();
    ++found;
  }
  TS_CHECK(found > 0, st, ": holds no LoRA tensor");
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    for (size_t t = 0; t < ts.size(); ++t) {
      const at::Tensor& A = a.A[static_cast<size_t>(l)][t];
      const at::Tensor& B = a.B[static_cast<size_t>(l)][t];
      if (!A.defined() && !B.defined()) continue;
      TS_CHECK(A.defined() && B.defined(), st, ": \"", tensor_name(cfg, l, ts[t], A.defined() ? 'B' : 'A'),
               "\" is missing (its ", A.defined() ? "lora_A" : "lora_B", " is there)");
      const int64_t rm = A.size(0);
      TS_CHECK(A.size(1) == ts[t].in && B.size(0) == ts[t].rows && B.size(1) == rm, st, ": \"", tensor_name(cfg, l, ts[t], 'A'),
               "\" and its lora_B have shapes [", A.size(0), ", ", A.size(1), "] and [", B.size(0), ", ", B.size(1),
               "]; this model's ", ts[t].module, " needs [r, ", ts[t].in, "] and [", ts[t].rows, ", r]");
      TS_CHECK(rank_pattern || rm == a.r, st, ": \"", tensor_name(cfg, l, ts[t], 'A'), "\" has rank ", rm, " but ", cfg_path,
               " says r = ", a.r, " (and sets no rank_pattern)");
    }
  }
  return a;
}

void save(const std::string& dir, const Adapter& a, const models::GPTConfig& cfg, const std::string& base_model) {
  const std::vector<Target> ts = targets(cfg);
  NamedTensors tensors;
  std::set<std::string> modules;
  for (int64_t l = 0; l < cfg.n_layer && l < static_cast<int64_t>(a.A.size()); ++l) {
    for (size_t t = 0; t < ts.size(); ++t) {
      const at::Tensor& A = a.A[static_cast<size_t>(l)][t];
      if (!A.defined()) continue;
      const at::Tensor& B = a.B[static_cast<size_t>(l)][t];
      TS_INTERNAL_ASSERT(B.defined(), "LoRA module without lora_B");
      tensors.emplace_back(tensor_name(cfg, l, ts[t], 'A'), A.detach().to(at::kFloat).contiguous());
      tensors.emplace_back(tensor_name(cfg, l, ts[t], 'B'), B.detach().to(at::kFloat).contiguous());
      modules.insert(ts[t].short_name);
    }
  }
  TS_CHECK(!tensors.empty(), "LoRA: an adapter with no module to save to ", dir);
  nlohmann::json c = {{"peft_type", "LORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"auto_mapping", nullptr},
                      {"base_model_name_or_path", base_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(base_model)},
                      {"revision", nullptr},
                      {"inference_mode", true},
                      {"r", a.r},
                      {"lora_alpha", a.alpha},
                      {"lora_dropout", a.config.value("lora_dropout", 0.0)},
                      {"target_modules", std::vector<std::string>(modules.begin(), modules.end())},
                      {"exclude_modules", nullptr},
                      {"fan_in_fan_out", !cfg.rope()},  // GPT-2's Conv1D weights are [in, out]
                      {"bias", "none"},
                      {"use_rslora", a.rslora},
                      {"use_dora", false},
                      {"modules_to_save", nullptr},
                      {"init_lora_weights", true},
                      {"layers_to_transform", nullptr},
                      {"layers_pattern", nullptr},
                      {"rank_pattern", nlohmann::json::object()},
                      {"alpha_pattern", nlohmann::json::object()}};
  std::filesystem::create_directories(dir);
  save_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(dir + "/adapter_config.json", c.dump(2) + "\n");
}

}  // namespace torchspeed::checkpoint::peft
