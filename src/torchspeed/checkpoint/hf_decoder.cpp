// Hugging Face Llama / Mistral / Qwen2 / Qwen3 folders: config.json <-> our model section,
// tensor names and fused layouts.
#include "torchspeed/checkpoint/hf_decoder.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <vector>

#include "torchspeed/checkpoint/hf_gpt2.h"
#include "torchspeed/config/config.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/file.h"

namespace torchspeed::checkpoint::hf {
namespace fs = std::filesystem;

// Note [Decoder names]
// Ours (torch.nn.Linear weights [out, in])      transformers (model.layers.{i}. before the block's)
//   embed.tok.weight [V, d]                      model.embed_tokens.weight
//   block{i}.ln1.weight                          input_layernorm.weight
//   block{i}.qkv.{weight,bias} [(H+2KV)hd, d]    self_attn.{q,k,v}_proj.{weight,bias}, rows stacked q, k, v
//   block{i}.q_norm.weight, k_norm.weight        self_attn.q_norm.weight, self_attn.k_norm.weight (Qwen3)
//   block{i}.attn_proj.{weight,bias}             self_attn.o_proj.{weight,bias}
//   block{i}.ln2.weight                          post_attention_layernorm.weight
//   block{i}.fc.{weight,bias} [2 ff, d]          mlp.{gate,up}_proj.{weight,bias}, rows stacked gate, up
//   block{i}.mlp_proj.{weight,bias}              mlp.down_proj.{weight,bias}
//   head.ln_f.weight                             model.norm.weight
//   head.weight (untied heads only)              lm_head.weight
// Mixture-of-Experts blocks (Mixtral's block_sparse_moe.*, Qwen2/3-MoE's mlp.*, as save_pretrained
// writes them: one tensor per expert; the fused 3-D form of save_original_format=False reads too):
//   block{i}.moe.router [E, d]                   {block_sparse_moe,mlp}.gate.weight
//   block{i}.moe.gate_up [E, 2 ff, d]            experts.{j}.{w1,w3} (Mixtral) / {gate,up}_proj: gate rows first
//   block{i}.moe.down [E, d, ff]                 experts.{j}.w2 / down_proj
//   block{i}.moe.shared_fc [2 sff, d]            mlp.shared_expert.{gate,up}_proj.weight (Qwen2-MoE)
//   block{i}.moe.shared_proj [d, sff]            mlp.shared_expert.down_proj.weight
//   block{i}.moe.shared_gate [1, d]              mlp.shared_expert_gate.weight
// q and k rows keep transformers' order (the rotate-half convention), so no permutation.
namespace {

const char* const kFamilies[] = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"};

struct Reader {
  const nlohmann::json& j;
  const std::string& source;
  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
  int64_t integer(const char* key, int64_t fallback = -1) const {
    if (!has(key)) {
      TS_CHECK(fallback >= 0, source, ": \"", key, "\" is missing");
      return fallback;
    }
    const auto& v = j.at(key);
    TS_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, source, ": \"", key, "\" must be a positive integer, got ",
             v.dump());
    return v.get<int64_t>();
  }
  double number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    TS_CHECK(j.at(key).is_number(), source, ": \"", key, "\" must be a number, got ", j.at(key).dump());
    return j.at(key).get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    TS_CHECK(j.at(key).is_boolean(), source, ": \"", key, "\" must be true or false, got ", j.at(key).dump());
    return j.at(key).get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    TS_CHECK(j.at(key).is_string(), source, ": \"", key, "\" must be a string, got ", j.at(key).dump());
    return j.at(key).get<std::string>();
  }
};

// The rope settings: transformers 5 writes "rope_parameters" {rope_type, rope_theta, factor, ...};
// 4.x wrote "rope_theta" and "rope_scaling" {type or rope_type, factor, ...}.
void read_rope(const nlohmann::json& h, const std::string& source, int64_t seq_len, nlohmann::json& m) {
  const Reader top{h, source};
  nlohmann::json params = nlohmann::json::object();
  std::string where = "rope_scaling";
  if (top.has("rope_parameters")) {
    params = h.at("rope_parameters");
    where = "rope_parameters";
  } else if (top.has("rope_scaling")) {
    params = h.at("rope_scaling");
  }
  TS_CHECK(params.is_object(), source, ": \"", where, "\" must be an object, got ", params.dump());
  const std::string src = source + " " + where;
  const Reader r{params, src};
  double theta = top.number("rope_theta", 10000.0);
  theta = r.number("rope_theta", theta);
  m["rope_theta"] = theta;
  const double partial = r.number("partial_rotary_factor", top.number("partial_rotary_factor", 1.0));
  TS_CHECK(partial == 1.0, source, ": \"partial_rotary_factor\" ", partial,
           " is not supported (rotary positions over the whole head only)");
  std::string type = r.string("rope_type", r.string("type", "default"));
  if (type == "default") return;
  TS_CHECK(type == "linear" || type == "llama3" || type == "yarn", src, ": \"rope_type\" \"", type,
           "\" is not supported (default, linear, llama3 and yarn are)");
  nlohmann::json s = {{"type", type}, {"factor", r.number("factor", 1.0)}};
  TS_CHECK(r.has("factor"), src, ": \"factor\" is missing");
  if (type == "llama3" || type == "yarn") {
    s["original_max_position_embeddings"] =
        r.integer("original_max_position_embeddings", top.integer("original_max_position_embeddings", seq_len));
  }
  if (type == "llama3") {
    s["low_freq_factor"] = r.number("low_freq_factor", 1.0);
    s["high_freq_factor"] = r.number("high_freq_factor", 4.0);
  }
  if (type == "yarn") {
    TS_CHECK(!r.has("mscale") && !r.has("mscale_all_dim"), src,
             ": \"mscale\" / \"mscale_all_dim\" (DeepSeek's yarn) are not supported");
    s["beta_fast"] = r.number("beta_fast", 32.0);
    s["beta_slow"] = r.number("beta_slow", 1.0);
    if (r.has("attention_factor")) s["attention_factor"] = r.number("attention_factor", 0.0);
    s["truncate"] = r.boolean("truncate", true);
  }
  m["rope_scaling"] = s;
}

std::string family_of(const nlohmann::json& m) {
  const bool qkv = m.value("qkv_bias", true), out = m.value("attn_out_bias", true), mlp = m.value("mlp_bias", true);
  if (m.contains("moe") && m.at("moe").value("num_experts", int64_t{0}) > 0) {
    if (m.value("qk_norm", false)) return "qwen3_moe";
    if (m.at("moe").value("shared_d_ff", int64_t{0}) > 0) return "qwen2_moe";
    return "mixtral";
  }
  if (m.value("qk_norm", false)) return "qwen3";
  if (qkv && !out && !mlp) return "qwen2";
  const std::string f = m.value("family", std::string());
  if (f == "mistral" && !qkv && !out && !mlp) return "mistral";
  return "llama";
}

std::string layer_prefix(int64_t i) { return concat("model.layers.", i, "."); }

// A Mixture-of-Experts block's tensors (Note [Decoder names]): `p` the HF layer prefix, `b` ours.
template <class Take, class Add, class Has>
void load_experts(const nlohmann::json& m, const std::string& p, const std::string& b, int64_t d, Take& take, Add& add,
                  Has has) {
  const nlohmann::json& e = m.at("moe");
  const bool mixtral = m.at("family").get<std::string>() == "mixtral";
  const int64_t E = e.at("num_experts").get<int64_t>(), ff = e.at("d_ff").get<int64_t>();
  // save_original_format=False (or a model saved from memory by other tools): the fused form,
  // where Mixtral's block is "mlp." too.
  const std::string fused = p + "mlp.experts.";
  const bool is_fused = has(fused + "gate_up_proj");
  const std::string moe = p + (mixtral && !is_fused ? "block_sparse_moe." : "mlp.");
  add(b + "moe.router", take(moe + "gate.weight", {E, d}));
  if (is_fused) {
    add(b + "moe.gate_up", take(fused + "gate_up_proj", {E, 2 * ff, d}));
    add(b + "moe.down", take(fused + "down_proj", {E, d, ff}));
  } else {
    std::vector<at::Tensor> gate_up, down;
    for (int64_t j = 0; j < E; ++j) {
      const std::string x = concat(moe, "experts.", j, ".");
      const char* g = mixtral ? "w1.weight" : "gate_proj.weight";
      const char* u = mixtral ? "w3.weight" : "up_proj.weight";
      const char* w = mixtral ? "w2.weight" : "down_proj.weight";
      gate_up.push_back(at::cat({take(x + g, {ff, d}), take(x + u, {ff, d})}));
      down.push_back(take(x + w, {d, ff}));
    }
    add(b + "moe.gate_up", at::stack(gate_up));
    add(b + "moe.down", at::stack(down));
  }
  const int64_t sff = e.value("shared_d_ff", int64_t{0});
  if (sff > 0) {
    const std::string s = p + "mlp.shared_expert.";
    add(b + "moe.shared_fc", at::cat({take(s + "gate_proj.weight", {sff, d}), take(s + "up_proj.weight", {sff, d})}));
    add(b + "moe.shared_proj", take(s + "down_proj.weight", {d, sff}));
    add(b + "moe.shared_gate", take(p + "mlp.shared_expert_gate.weight", {1, d}));
  }
}

}  // namespace

bool is_decoder_family(const std::string& t) {
  return std::find(std::begin(kFamilies), std::end(kFamilies), t) != std::end(kFamilies);
}

nlohmann::json model_section_from_decoder(const nlohmann::json& h, const std::string& source) {
  TS_CHECK(h.is_object(), source, ": expected a JSON object");
  const Reader r{h, source};
  const std::string type = r.string("model_type", "");
  TS_CHECK(is_decoder_family(type), source, ": \"model_type\" is \"", type,
           "\"; torchspeed runs gpt2, llama (Llama 1-3.2, SmolLM), mistral, qwen2, qwen3, mixtral, qwen2_moe and qwen3_moe; ",
           "this one would need its ",
           "architecture added to the model description (models/gpt.h)");
  nlohmann::json m;
  m["family"] = type;
  m["vocab"] = r.integer("vocab_size");
  m["seq_len"] = r.integer("max_position_embeddings", 2048);
  const int64_t d = r.integer("hidden_size"), heads = r.integer("num_attention_heads");
  m["d_model"] = d;
  m["n_layer"] = r.integer("num_hidden_layers");
  m["n_head"] = heads;
  const int64_t kv = r.integer("num_key_value_heads", heads);
  TS_CHECK(heads % kv == 0, source, ": \"num_attention_heads\" ", heads, " is not a multiple of \"num_key_value_heads\" ", kv);
  if (kv != heads) m["n_kv_head"] = kv;
  const int64_t hd = r.has("head_dim") ? r.integer("head_dim") : d / heads;
  TS_CHECK(r.has("head_dim") || d % heads == 0, source, ": \"hidden_size\" ", d, " is not a multiple of \"num_attention_heads\" ",
           heads, " and there is no \"head_dim\"");
  if (hd * heads != d || r.has("head_dim")) m["head_dim"] = hd;
  m["d_ff"] = r.integer("intermediate_size");
  const std::string act = r.string("hidden_act", "silu");
  TS_CHECK(act == "silu" || act == "swish", source, ": \"hidden_act\" is \"", act,
           "\"; the ", type, " MLP torchspeed computes is SwiGLU (silu)");
  m["activation"] = "swiglu";
  m["norm"] = "rmsnorm";
  m["layer_norm_eps"] = r.number("rms_norm_eps", 1e-6);
  m["positions"] = "rope";
  read_rope(h, source, m["seq_len"].get<int64_t>(), m);
  m["tie_embeddings"] = r.boolean("tie_word_embeddings", false);
  const double attn_drop = r.number("attention_dropout", 0.0);
  TS_CHECK(attn_drop == 0.0, source, ": \"attention_dropout\" ", attn_drop,
           " is not supported (torchspeed's dropout rate applies to residual paths too); set it to 0");
  m["dropout"] = 0.0;
  bool qkv_bias = false, out_bias = false, mlp_bias = false;
  if (type == "llama") {
    qkv_bias = out_bias = r.boolean("attention_bias", false);
    mlp_bias = r.boolean("mlp_bias", false);
  } else if (type == "qwen2") {
    qkv_bias = true;  // Qwen2's q/k/v projections always have biases, o_proj none
  } else if (type == "qwen2_moe") {
    qkv_bias = r.boolean("qkv_bias", true);  // o_proj none
  } else if (type == "qwen3" || type == "qwen3_moe") {
    qkv_bias = out_bias = r.boolean("attention_bias", false);
    m["qk_norm"] = true;
  }
  if (type == "mixtral" || type == "qwen2_moe" || type == "qwen3_moe") {
    // Note [Mixture of experts]: the HF families route dropless; the auxiliary loss is in the
    // training loss only when output_router_logits is set, as in transformers.
    nlohmann::json moe;
    const bool mixtral = type == "mixtral";
    // Mixtral's key is num_local_experts, the Qwen MoE families' num_experts; transformers 5
    // writes either (its configs map one name onto the other).
    const char* experts_key = mixtral ? "num_local_experts" : "num_experts";
    const char* other_key = mixtral ? "num_experts" : "num_local_experts";
    moe["num_experts"] = r.integer(r.has(experts_key) || !r.has(other_key) ? experts_key : other_key);
    moe["k"] = r.integer("num_experts_per_tok");
    TS_CHECK(moe["k"].get<int64_t>() <= moe["num_experts"].get<int64_t>(), source, ": \"num_experts_per_tok\" ",
             moe["k"].dump(), " exceeds the number of experts ", moe["num_experts"].dump());
    moe["d_ff"] = mixtral ? m.at("d_ff").get<int64_t>() : r.integer("moe_intermediate_size");
    moe["drop_tokens"] = false;
    moe["norm_topk_prob"] = mixtral ? true : r.boolean("norm_topk_prob", false);
    moe["aux_loss_coef"] = r.boolean("output_router_logits", false) ? r.number("router_aux_loss_coef", 0.001) : 0.0;
    moe["aux_loss_type"] = "transformers";
    if (type == "qwen2_moe") moe["shared_d_ff"] = r.integer("shared_expert_intermediate_size");
    if (mixtral) {
      const double jitter = r.number("router_jitter_noise", 0.0);
      TS_CHECK(jitter == 0.0, source, ": \"router_jitter_noise\" ", jitter,
               " is not supported (torchspeed routes without noise); set it to 0");
    } else {
      TS_CHECK(r.number("decoder_sparse_step", 1) == 1, source, ": \"decoder_sparse_step\" ", h.at("decoder_sparse_step").dump(),
               " is not supported (torchspeed's MoE models have experts in every layer)");
      TS_CHECK(!r.has("mlp_only_layers") || (h.at("mlp_only_layers").is_array() && h.at("mlp_only_layers").empty()), source,
               ": \"mlp_only_layers\" ", r.has("mlp_only_layers") ? h.at("mlp_only_layers").dump() : std::string(),
               " is not supported (torchspeed's MoE models have experts in every layer)");
    }
    m["moe"] = moe;
  }
  if (type == "mistral" || type == "mixtral") {
    TS_CHECK(!r.has("sliding_window"), source, ": \"sliding_window\" is ", h.at("sliding_window").dump(),
             "; torchspeed attends to the whole context, so a sliding-window Mistral would give other results: ",
             "set it to null for a model trained without one (Mistral 7B v0.2 and later)");
  }
  if (type == "qwen2" || type == "qwen3" || type == "qwen2_moe" || type == "qwen3_moe") {
    TS_CHECK(!r.boolean("use_sliding_window", false), source,
             ": \"use_sliding_window\": true is not supported (torchspeed attends to the whole context)");
  }
  m["qkv_bias"] = qkv_bias;
  m["attn_out_bias"] = out_bias;
  m["mlp_bias"] = mlp_bias;
  return m;
}

nlohmann::json decoder_config(const nlohmann::json& m, const nlohmann::json& hf_config, int64_t eos) {
  const std::string family = family_of(m);
  static const std::map<std::string, const char*> arch = {{"llama", "LlamaForCausalLM"},
                                                         {"mistral", "MistralForCausalLM"},
                                                         {"qwen2", "Qwen2ForCausalLM"},
                                                         {"qwen3", "Qwen3ForCausalLM"},
                                                         {"mixtral", "MixtralForCausalLM"},
                                                         {"qwen2_moe", "Qwen2MoeForCausalLM"},
                                                         {"qwen3_moe", "Qwen3MoeForCausalLM"}};
  nlohmann::json h = hf_config.is_object() && hf_config.value("model_type", std::string()) == family ? hf_config
                                                                                                      : nlohmann::json::object();
  // What we compute decides these keys; the folder's others (token ids, ...) stay as they were.
  for (const char* k : {"rope_scaling", "rope_parameters", "rope_theta", "torch_dtype", "dtype", "transformers_version"}) {
    h.erase(k);
  }
  const int64_t heads = m.at("n_head").get<int64_t>(), d = m.at("d_model").get<int64_t>();
  h["architectures"] = {arch.at(family)};
  h["model_type"] = family;
  h["vocab_size"] = m.at("vocab");
  h["max_position_embeddings"] = m.at("seq_len");
  h["hidden_size"] = d;
  h["num_hidden_layers"] = m.at("n_layer");
  h["num_attention_heads"] = heads;
  h["num_key_value_heads"] = m.value("n_kv_head", int64_t{0}) > 0 ? m.at("n_kv_head").get<int64_t>() : heads;
  h["head_dim"] = m.value("head_dim", int64_t{0}) > 0 ? m.at("head_dim").get<int64_t>() : d / heads;
  h["intermediate_size"] = m.value("d_ff", int64_t{0}) > 0 ? m.at("d_ff").get<int64_t>() : 4 * d;
  h["hidden_act"] = "silu";
  h["rms_norm_eps"] = m.value("layer_norm_eps", 1e-6);
  h["tie_word_embeddings"] = m.value("tie_embeddings", false);
  h["attention_dropout"] = 0.0;
  h["initializer_range"] = h.value("initializer_range", 0.02);
  h["use_cache"] = true;
  h["rope_theta"] = m.value("rope_theta", 10000.0);
  if (m.contains("rope_scaling")) {
    const auto& s = m.at("rope_scaling");
    nlohmann::json rs = {{"rope_type", s.at("type")}, {"factor", s.at("factor")}};
    const std::string t = s.at("type").get<std::string>();
    if (t == "llama3" || t == "yarn") rs["original_max_position_embeddings"] = s.at("original_max_position_embeddings");
    if (t == "llama3") {
      rs["low_freq_factor"] = s.at("low_freq_factor");
      rs["high_freq_factor"] = s.at("high_freq_factor");
    }
    if (t == "yarn") {
      rs["beta_fast"] = s.at("beta_fast");
      rs["beta_slow"] = s.at("beta_slow");
      if (s.value("attention_factor", 0.0) > 0) rs["attention_factor"] = s.at("attention_factor");
      rs["truncate"] = s.value("truncate", true);
    }
    h["rope_scaling"] = rs;
  }
  const bool qkv = m.value("qkv_bias", true), out = m.value("attn_out_bias", true), mlp = m.value("mlp_bias", true);
  if (family == "llama") {
    TS_CHECK(qkv == out, "model.qkv_bias ", qkv, " and attn_out_bias ", out,
             " differ: no Hugging Face family has that combination with qk_norm false");
    h["attention_bias"] = qkv;
    h["mlp_bias"] = mlp;
  } else if (family == "qwen3" || family == "qwen3_moe") {
    TS_CHECK(qkv == out && !mlp, "model.qk_norm with qkv_bias ", qkv, ", attn_out_bias ", out, ", mlp_bias ", mlp,
             " is no Qwen3 (attention_bias covers q/k/v and o, the MLP has none)");
    h["attention_bias"] = qkv;
  } else if (family == "mistral" || family == "mixtral") {
    h["sliding_window"] = nullptr;
  }
  if (family == "qwen2" || family == "qwen3" || family == "qwen2_moe" || family == "qwen3_moe") h["use_sliding_window"] = false;
  if (family == "mixtral" || family == "qwen2_moe" || family == "qwen3_moe") {
    const nlohmann::json& e = m.at("moe");
    const int64_t d_ff = h.at("intermediate_size").get<int64_t>();
    const int64_t expert_ff = e.value("d_ff", int64_t{0}) > 0 ? e.at("d_ff").get<int64_t>() : d_ff;
    const double coef = e.value("aux_loss_coef", 0.01);
    TS_CHECK(!mlp, "model.mlp_bias: a ", family, " model's experts have no biases");
    if (family == "mixtral") {
      TS_CHECK(!qkv && !out, "model.qkv_bias / attn_out_bias: Mixtral's attention has no biases, and no Hugging Face MoE "
                             "family has q/k/v biases without a shared expert (Qwen2-MoE's)");
      TS_CHECK(e.value("norm_topk_prob", true), "model.moe.norm_topk_prob false: Mixtral always renormalises its k routing "
                                                "weights, and no other Hugging Face MoE family fits this model (Qwen3-MoE "
                                                "has q/k norms, Qwen2-MoE a shared expert)");
      h["num_local_experts"] = e.at("num_experts");
      h["intermediate_size"] = expert_ff;
      h["router_jitter_noise"] = 0.0;
    } else {
      TS_CHECK(family == "qwen2_moe" || e.value("shared_d_ff", int64_t{0}) == 0,
               "model.moe.shared_d_ff: a shared expert with q/k norms fits no Hugging Face family (Qwen3-MoE has none)");
      if (family == "qwen2_moe") {
        TS_CHECK(!out, "model.moe.shared_d_ff: a shared expert is Qwen2-MoE's, whose attention has no o_proj bias "
                       "(attn_out_bias false)");
        h["shared_expert_intermediate_size"] = e.at("shared_d_ff");
        h["qkv_bias"] = qkv;
      }
      h["num_experts"] = e.at("num_experts");
      h["moe_intermediate_size"] = expert_ff;
      h["norm_topk_prob"] = e.value("norm_topk_prob", true);
      h["decoder_sparse_step"] = 1;
      h["mlp_only_layers"] = nlohmann::json::array();
    }
    h["num_experts_per_tok"] = e.value("k", int64_t{2});
    h["router_aux_loss_coef"] = coef;
    h["output_router_logits"] = coef > 0;
  }
  if (eos >= 0 && !h.contains("eos_token_id")) h["eos_token_id"] = eos;
  return h;
}

Model load_decoder(const std::string& dir) {
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  const nlohmann::json h = config::read_json_file(cfg_path);
  Model out;
  const nlohmann::json m = model_section_from_decoder(h, cfg_path);
  out.config["model"] = m;
  out.config["hf_config"] = h;
  const bool tied = m.at("tie_embeddings").get<bool>();
  const int64_t n_layer = m.at("n_layer").get<int64_t>();
  // Every tensor by its Hugging Face name, then assembled in model order.
  std::map<std::string, at::Tensor> hf;
  std::map<std::string, std::string> file_of;
  const std::vector<std::string> files = safetensors_files(dir);
  for (const std::string& file : files) {
    auto f = load_safetensors(file);
    for (auto& [name, t] : f.tensors) {
      static const std::string inv_freq = ".rotary_emb.inv_freq";  // a buffer old checkpoints carry
      if (name.size() > inv_freq.size() && name.compare(name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0) continue;
      file_of[name] = file;
      hf[name] = std::move(t);
    }
  }
  out.source = files.size() == 1 ? files[0] : dir;
  // Every tensor is checked against the shape config.json implies before it is used: a
  // mismatch is the file's error, not a LibTorch one later (or a kernel reading past a buffer).
  const int64_t vocab = m.at("vocab").get<int64_t>(), d = m.at("d_model").get<int64_t>(),
                heads = m.at("n_head").get<int64_t>(), kv = m.value("n_kv_head", heads),
                hd = m.value("head_dim", heads > 0 ? d / heads : int64_t{0}), ff = m.at("d_ff").get<int64_t>();
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    const auto it = hf.find(name);
    TS_CHECK(it != hf.end(), out.source, ": tensor \"", name, "\" is missing (a ", m.at("family").get<std::string>(),
             " model of ", n_layer, " layers has it)");
    TS_CHECK(it->second.sizes().vec() == shape, file_of[name], ": tensor \"", name, "\" has shape ", it->second.sizes(),
             "; config.json (", cfg_path, ") implies ", at::IntArrayRef(shape));
    at::Tensor t = it->second.to(at::kFloat).contiguous();
    hf.erase(it);
    return t;
  };
  auto add = [&](const std::string& ours, const at::Tensor& t) { out.params.emplace_back(ours, t); };
  add("embed.tok.weight", take("model.embed_tokens.weight", {vocab, d}));
  const bool qkv_bias = m.at("qkv_bias").get<bool>(), out_bias = m.at("attn_out_bias").get<bool>(),
             mlp_bias = m.at("mlp_bias").get<bool>(), qk_norm = m.value("qk_norm", false);
  for (int64_t i = 0; i < n_layer; ++i) {
    const std::string p = layer_prefix(i), b = concat("block", i, ".");
    const std::string a = p + "self_attn.", f = p + "mlp.";
    add(b + "ln1.weight", take(p + "input_layernorm.weight", {d}));
    add(b + "qkv.weight", at::cat({take(a + "q_proj.weight", {heads * hd, d}), take(a + "k_proj.weight", {kv * hd, d}),
                                   take(a + "v_proj.weight", {kv * hd, d})}));
    if (qkv_bias) {
      add(b + "qkv.bias", at::cat({take(a + "q_proj.bias", {heads * hd}), take(a + "k_proj.bias", {kv * hd}),
                                   take(a + "v_proj.bias", {kv * hd})}));
    }
    if (qk_norm) {
      add(b + "q_norm.weight", take(a + "q_norm.weight", {hd}));
      add(b + "k_norm.weight", take(a + "k_norm.weight", {hd}));
    }
    add(b + "attn_proj.weight", take(a + "o_proj.weight", {d, heads * hd}));
    if (out_bias) add(b + "attn_proj.bias", take(a + "o_proj.bias", {d}));
    add(b + "ln2.weight", take(p + "post_attention_layernorm.weight", {d}));
    if (m.contains("moe")) {
      load_experts(m, p, b, d, take, add, [&](const std::string& n) { return hf.count(n) > 0; });
      continue;
    }
    add(b + "fc.weight", at::cat({take(f + "gate_proj.weight", {ff, d}), take(f + "up_proj.weight", {ff, d})}));
    if (mlp_bias) add(b + "fc.bias", at::cat({take(f + "gate_proj.bias", {ff}), take(f + "up_proj.bias", {ff})}));
    add(b + "mlp_proj.weight", take(f + "down_proj.weight", {d, ff}));
    if (mlp_bias) add(b + "mlp_proj.bias", take(f + "down_proj.bias", {d}));
  }
  add("head.ln_f.weight", take("model.norm.weight", {d}));
  if (!tied) {
    add("head.weight", take("lm_head.weight", {vocab, d}));
  } else {
    hf.erase("lm_head.weight");  // a tied head saved anyway: the embedding is the head
  }
  if (!hf.empty()) {
    TS_CHECK(false, file_of[hf.begin()->first], ": tensor \"", hf.begin()->first, "\" is not part of a ",
             m.at("family").get<std::string>(), " model with this config.json (", hf.size(), " such tensors)");
  }
  return out;
}

int64_t save_decoder(const std::string& dir, const NamedTensors& params, const nlohmann::json& m,
                     const nlohmann::json& hf_config, at::ScalarType dtype, const std::string& tokenizer_dir, int64_t eos) {
  TS_CHECK(m.value("positions", std::string("learned")) == "rope" && m.value("norm", std::string()) == "rmsnorm" &&
               m.value("activation", std::string()) == "swiglu",
           "the model (", m.dump(), ") is not Llama-shaped (rotary positions, RMSNorm, SwiGLU): no Hugging Face ",
           "decoder family to write it as");
  const nlohmann::json h = decoder_config(m, hf_config, eos);
  const int64_t heads = h.at("num_attention_heads").get<int64_t>(), kv = h.at("num_key_value_heads").get<int64_t>(),
                hd = h.at("head_dim").get<int64_t>(), ff = h.at("intermediate_size").get<int64_t>();
  const bool tied = h.at("tie_word_embeddings").get<bool>();
  NamedTensors out;
  auto put = [&](const std::string& name, const at::Tensor& t) { out.emplace_back(name, t.to(dtype).contiguous()); };
  static const std::regex block(R"(block(\d+)\.(\w+)\.(weight|bias))");
  static const std::regex experts(R"(block(\d+)\.moe\.(\w+))");
  const std::string family = h.at("model_type").get<std::string>();
  for (const auto& [name, t] : params) {
    std::smatch mt;
    if (std::regex_match(name, mt, experts)) {
      const std::string p = layer_prefix(std::stoll(mt[1].str())), part = mt[2].str();
      const bool mixtral = family == "mixtral";
      const std::string moe = p + (mixtral ? "block_sparse_moe." : "mlp.");
      if (part == "router") {
        put(moe + "gate.weight", t);
      } else if (part == "gate_up" || part == "down") {
        const int64_t eff = t.size(part == "down" ? 2 : 1) / (part == "down" ? 1 : 2);
        for (int64_t j = 0; j < t.size(0); ++j) {
          const std::string x = concat(moe, "experts.", j, ".");
          if (part == "down") {
            put(x + (mixtral ? "w2.weight" : "down_proj.weight"), t[j]);
          } else {
            put(x + (mixtral ? "w1.weight" : "gate_proj.weight"), t[j].narrow(0, 0, eff));
            put(x + (mixtral ? "w3.weight" : "up_proj.weight"), t[j].narrow(0, eff, eff));
          }
        }
      } else if (part == "shared_fc") {
        const int64_t sff = t.size(0) / 2;
        put(p + "mlp.shared_expert.gate_proj.weight", t.narrow(0, 0, sff));
        put(p + "mlp.shared_expert.up_proj.weight", t.narrow(0, sff, sff));
      } else if (part == "shared_proj") {
        put(p + "mlp.shared_expert.down_proj.weight", t);
      } else if (part == "shared_gate") {
        put(p + "mlp.shared_expert_gate.weight", t);
      } else {
        TS_CHECK(false, "parameter '", name, "' has no counterpart in a ", family, " model");
      }
      continue;
    }
    if (name == "embed.tok.weight") {
      put("model.embed_tokens.weight", t);
    } else if (name == "head.ln_f.weight") {
      put("model.norm.weight", t);
    } else if (name == "head.weight") {
      if (!tied) put("lm_head.weight", t);
    } else if (std::regex_match(name, mt, block)) {
      const std::string p = layer_prefix(std::stoll(mt[1].str())), part = mt[2].str(), kind = mt[3].str();
      if (part == "ln1") {
        put(p + "input_layernorm." + kind, t);
      } else if (part == "ln2") {
        put(p + "post_attention_layernorm." + kind, t);
      } else if (part == "qkv") {
        put(p + "self_attn.q_proj." + kind, t.narrow(0, 0, heads * hd));
        put(p + "self_attn.k_proj." + kind, t.narrow(0, heads * hd, kv * hd));
        put(p + "self_attn.v_proj." + kind, t.narrow(0, (heads + kv) * hd, kv * hd));
      } else if (part == "q_norm" || part == "k_norm") {
        put(p + "self_attn." + part + "." + kind, t);
      } else if (part == "attn_proj") {
        put(p + "self_attn.o_proj." + kind, t);
      } else if (part == "fc") {
        put(p + "mlp.gate_proj." + kind, t.narrow(0, 0, ff));
        put(p + "mlp.up_proj." + kind, t.narrow(0, ff, ff));
      } else if (part == "mlp_proj") {
        put(p + "mlp.down_proj." + kind, t);
      } else {
        TS_CHECK(false, "parameter '", name, "' has no counterpart in a ", h.at("model_type").get<std::string>(), " model");
      }
    } else {
      TS_CHECK(false, "parameter '", name, "' has no counterpart in a ", h.at("model_type").get<std::string>(), " model");
    }
  }
  fs::create_directories(dir);
  nlohmann::json cfg = h;
  cfg["torch_dtype"] = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
  const auto digest = save_safetensors((fs::path(dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / "config.json").string(), cfg.dump(2) + "\n");
  copy_tokenizer_files(dir, tokenizer_dir);
  return digest.bytes;
}

}  // namespace torchspeed::checkpoint::hf
