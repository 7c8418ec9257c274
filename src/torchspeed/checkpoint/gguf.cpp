// A llama.cpp GGUF model as our model description and parameter names (see gguf.h).
#include "torchspeed/checkpoint/gguf.h"

#include <ATen/ATen.h>

#include "torchspeed/base/error.h"

namespace torchspeed::checkpoint::gguf {

// Note [GGUF names]
// llama.cpp (blk.{i}.)            ours
//   token_embd.weight              embed.tok.weight
//   attn_norm.weight               block{i}.ln1.weight
//   attn_{q,k,v}.{weight,bias}     block{i}.qkv.{weight,bias} (rows stacked; q and k unpermuted, below)
//   attn_{q,k}_norm.weight         block{i}.{q,k}_norm.weight (Qwen3)
//   attn_output.weight             block{i}.attn_proj.weight
//   ffn_norm.weight                block{i}.ln2.weight
//   ffn_{gate,up}.weight           block{i}.fc.weight (rows stacked gate, up)
//   ffn_down.weight                block{i}.mlp_proj.weight
//   output_norm.weight             head.ln_f.weight
//   output.weight                  head.weight (absent: tied to the embedding)
// llama.cpp's converter permutes the q and k rows of "llama" files so that each head's pairs
// (i, i + hd/2) sit side by side (ggml's interleaved rope): HF rows viewed [heads, 2, hd/2]
// become [heads, hd/2, 2]. We undo it; qwen2/qwen3 files use the rotate-half layout as is.
Model load_gguf(const std::string& path) {
  File f(path);
  const std::string arch = f.string("general.architecture");
  TS_CHECK(arch == "llama" || arch == "mistral" || arch == "qwen2" || arch == "qwen3", path,
           ": general.architecture is \"", arch, "\"; torchspeed reads llama, mistral, qwen2 and qwen3 GGUF files");
  const std::string p = arch + ".";
  auto opt_int = [&](const std::string& k, int64_t fallback) { return f.has(p + k) ? f.integer(p + k) : fallback; };
  nlohmann::json m;
  m["family"] = arch;
  const int64_t d = f.integer(p + "embedding_length"), heads = f.integer(p + "attention.head_count");
  TS_CHECK(d > 0 && heads > 0 && d <= (1 << 20) && heads <= 4096, path, ": embedding_length ", d, " / head_count ", heads);
  TS_CHECK(f.header().metadata.at(p + "attention.head_count").is_number(), path, ": per-layer head counts are not supported");
  const int64_t kv = opt_int("attention.head_count_kv", heads);
  TS_CHECK(kv > 0 && heads % kv == 0, path, ": head_count ", heads, " is not a multiple of head_count_kv ", kv);
  const int64_t hd = opt_int("attention.key_length", d / heads);
  TS_CHECK(opt_int("attention.value_length", hd) == hd, path, ": attention.value_length differs from key_length");
  TS_CHECK(opt_int("rope.dimension_count", hd) == hd, path, ": rope.dimension_count ", opt_int("rope.dimension_count", hd),
           " is not the head width ", hd, " (partial rotary dimensions are not supported)");
  const auto& md = f.header().metadata;
  TS_CHECK(md.contains("tokenizer.ggml.tokens") && md.at("tokenizer.ggml.tokens").is_array(), path,
           ": no tokenizer.ggml.tokens array");
  m["vocab"] = f.has(p + "vocab_size") ? f.integer(p + "vocab_size")
                                       : static_cast<int64_t>(md.at("tokenizer.ggml.tokens").size());
  m["seq_len"] = f.integer(p + "context_length");
  m["d_model"] = d;
  m["n_layer"] = f.integer(p + "block_count");
  m["n_head"] = heads;
  if (kv != heads) m["n_kv_head"] = kv;
  if (hd * heads != d) m["head_dim"] = hd;
  m["d_ff"] = f.integer(p + "feed_forward_length");
  m["activation"] = "swiglu";
  m["norm"] = "rmsnorm";
  m["layer_norm_eps"] = f.number(p + "attention.layer_norm_rms_epsilon");
  m["positions"] = "rope";
  m["rope_theta"] = f.has(p + "rope.freq_base") ? f.number(p + "rope.freq_base") : 10000.0;
  const std::string scaling = f.has(p + "rope.scaling.type") ? f.string(p + "rope.scaling.type") : "none";
  if (scaling == "linear" || scaling == "yarn") {
    nlohmann::json s = {{"type", scaling}, {"factor", f.number(p + "rope.scaling.factor")}};
    if (scaling == "yarn") {
      s["original_max_position_embeddings"] = f.integer(p + "rope.scaling.original_context_length");
    }
    m["rope_scaling"] = s;
  } else {
    TS_CHECK(scaling == "none", path, ": rope.scaling.type \"", scaling, "\" is not supported (none, linear, yarn)");
  }
  TS_CHECK(!f.find("rope_freqs.weight"), path,
           ": rope_freqs.weight (llama3 frequency factors baked into the file) is not supported yet");
  m["tie_embeddings"] = f.find("output.weight") == nullptr;
  m["dropout"] = 0.0;
  m["qkv_bias"] = f.find("blk.0.attn_q.bias") != nullptr;
  m["attn_out_bias"] = f.find("blk.0.attn_output.bias") != nullptr;
  m["mlp_bias"] = f.find("blk.0.ffn_down.bias") != nullptr;
  if (f.find("blk.0.attn_q_norm.weight")) m["qk_norm"] = true;

  Model out;
  out.config["model"] = m;
  nlohmann::json info = nlohmann::json::object();
  for (const char* k : {"tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                        "tokenizer.ggml.add_bos_token", "tokenizer.ggml.model", "tokenizer.ggml.pre", "general.name"}) {
    if (md.contains(k)) info[k] = md.at(k);
  }
  out.config["gguf"] = info;
  out.source = path;
  const int64_t n_layer = m["n_layer"].get<int64_t>();
  std::vector<bool> used(f.header().tensors.size(), false);
  auto take = [&](const std::string& name, const std::vector<int64_t>& shape) {
    const TensorInfo* t = f.find(name);
    TS_CHECK(t, path, ": tensor \"", name, "\" is missing");
    TS_CHECK(t->shape == shape, path, ": tensor \"", name, "\" has shape ", at::IntArrayRef(t->shape), ", the model's config wants ",
             at::IntArrayRef(shape));
    used[static_cast<size_t>(t - f.header().tensors.data())] = true;
    return f.tensor(*t);
  };
  const bool permuted = arch == "llama" || arch == "mistral";
  auto unpermute = [&](const at::Tensor& w, int64_t n_head) {
    if (!permuted) return w;
    const int64_t rows = w.size(0);
    return w.reshape({n_head, hd / 2, 2, -1}).transpose(1, 2).reshape({rows, -1}).contiguous();
  };
  const int64_t vocab = m["vocab"].get<int64_t>(), ff = m["d_ff"].get<int64_t>();
  out.params.emplace_back("embed.tok.weight", take("token_embd.weight", {vocab, d}));
  for (int64_t i = 0; i < n_layer; ++i) {
    const std::string g = concat("blk.", i, "."), b = concat("block", i, ".");
    out.params.emplace_back(b + "ln1.weight", take(g + "attn_norm.weight", {d}));
    at::Tensor q = unpermute(take(g + "attn_q.weight", {heads * hd, d}), heads);
    at::Tensor k = unpermute(take(g + "attn_k.weight", {kv * hd, d}), kv);
    out.params.emplace_back(b + "qkv.weight", at::cat({q, k, take(g + "attn_v.weight", {kv * hd, d})}));
    if (m["qkv_bias"].get<bool>()) {
      at::Tensor qb = unpermute(take(g + "attn_q.bias", {heads * hd}).unsqueeze(1), heads).squeeze(1);
      at::Tensor kb = unpermute(take(g + "attn_k.bias", {kv * hd}).unsqueeze(1), kv).squeeze(1);
      out.params.emplace_back(b + "qkv.bias", at::cat({qb, kb, take(g + "attn_v.bias", {kv * hd})}));
    }
    if (m.value("qk_norm", false)) {
      out.params.emplace_back(b + "q_norm.weight", take(g + "attn_q_norm.weight", {hd}));
      out.params.emplace_back(b + "k_norm.weight", take(g + "attn_k_norm.weight", {hd}));
    }
    out.params.emplace_back(b + "attn_proj.weight", take(g + "attn_output.weight", {d, heads * hd}));
    if (m["attn_out_bias"].get<bool>()) out.params.emplace_back(b + "attn_proj.bias", take(g + "attn_output.bias", {d}));
    out.params.emplace_back(b + "ln2.weight", take(g + "ffn_norm.weight", {d}));
    out.params.emplace_back(b + "fc.weight", at::cat({take(g + "ffn_gate.weight", {ff, d}), take(g + "ffn_up.weight", {ff, d})}));
    if (m["mlp_bias"].get<bool>()) {
      out.params.emplace_back(b + "fc.bias", at::cat({take(g + "ffn_gate.bias", {ff}), take(g + "ffn_up.bias", {ff})}));
    }
    out.params.emplace_back(b + "mlp_proj.weight", take(g + "ffn_down.weight", {d, ff}));
    if (m["mlp_bias"].get<bool>()) out.params.emplace_back(b + "mlp_proj.bias", take(g + "ffn_down.bias", {d}));
  }
  out.params.emplace_back("head.ln_f.weight", take("output_norm.weight", {d}));
  if (!m["tie_embeddings"].get<bool>()) out.params.emplace_back("head.weight", take("output.weight", {vocab, d}));
  for (size_t i = 0; i < used.size(); ++i) {
    TS_CHECK(used[i], path, ": tensor \"", f.header().tensors[i].name, "\" is not part of a ", arch,
             " model as torchspeed reads it");
  }
  return out;
}

}  // namespace torchspeed::checkpoint::gguf
