// GPT layers and initialisation (GPT-2: N(0, 0.02) weights, residual projections scaled by
// 1/sqrt(2 n_layer), zero biases, unit LayerNorm).
#include "torchspeed/models/gpt.h"
#include "torchspeed/models/lora.h"

#include "torchspeed/nn/fused_ops.h"
#include "torchspeed/nn/tiled.h"
#include "torchspeed/parallel/sequence.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "torchspeed/config/config.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/base/error.h"

namespace torchspeed::models {

bool RopeScaling::operator==(const RopeScaling& o) const {
  return type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor &&
         high_freq_factor == o.high_freq_factor &&
         original_max_position_embeddings == o.original_max_position_embeddings && beta_fast == o.beta_fast &&
         beta_slow == o.beta_slow && attention_factor == o.attention_factor && truncate == o.truncate;
}

GPTConfig GPTConfig::from_json(const nlohmann::json& j, const std::string& path) {
  config::Diagnostics diag;
  config::JsonReader r(j, path, diag);
  GPTConfig c;
  c.vocab = r.get_int("vocab", c.vocab, 2, 1 << 24);
  c.seq_len = r.get_int("seq_len", c.seq_len, 1, 1 << 24);
  c.d_model = r.get_int("d_model", c.d_model, 1, 1 << 20);
  c.n_layer = r.get_int("n_layer", c.n_layer, 1, 1 << 12);
  c.n_head = r.get_int("n_head", c.n_head, 1, 1 << 12);
  c.dropout = r.get_double("dropout", c.dropout, 0.0, 0.99);
  c.tie_embeddings = r.get_bool("tie_embeddings", c.tie_embeddings);
  c.activation = r.get_string("activation", c.activation);
  c.layer_norm_eps = r.get_double("layer_norm_eps", c.layer_norm_eps, 1e-12, 1e-1);
  c.n_kv_head = r.get_int("n_kv_head", c.n_kv_head, 0, 1 << 12);
  c.head_dim = r.get_int("head_dim", c.head_dim, 0, 1 << 14);
  c.d_ff = r.get_int("d_ff", c.d_ff, 0, 1 << 24);
  c.norm = r.get_string("norm", c.norm);
  c.positions = r.get_string("positions", c.positions);
  c.rope_theta = r.get_double("rope_theta", c.rope_theta, 1.0, 1e12);
  c.qkv_bias = r.get_bool("qkv_bias", c.qkv_bias);
  c.attn_out_bias = r.get_bool("attn_out_bias", c.attn_out_bias);
  c.mlp_bias = r.get_bool("mlp_bias", c.mlp_bias);
  c.qk_norm = r.get_bool("qk_norm", c.qk_norm);
  if (j.is_object() && j.contains("moe")) c.moe = MoEConfig::from_json(j.at("moe"), path + ".moe", diag);
  if (j.is_object() && j.contains("rope_scaling")) {
    const std::string sp = path + ".rope_scaling";
    config::JsonReader s(j.at("rope_scaling"), sp, diag);
    RopeScaling& rs = c.rope_scaling;
    rs.type = s.get_string("type", rs.type);
    rs.factor = s.get_double("factor", rs.factor, 1e-6, 1e6);
    rs.low_freq_factor = s.get_double("low_freq_factor", rs.low_freq_factor, 1e-6, 1e6);
    rs.high_freq_factor = s.get_double("high_freq_factor", rs.high_freq_factor, 1e-6, 1e6);
    rs.original_max_position_embeddings =
        s.get_int("original_max_position_embeddings", rs.original_max_position_embeddings, 0, 1 << 26);
    rs.beta_fast = s.get_double("beta_fast", rs.beta_fast, 1e-6, 1e6);
    rs.beta_slow = s.get_double("beta_slow", rs.beta_slow, 1e-6, 1e6);
    rs.attention_factor = s.get_double("attention_factor", rs.attention_factor, 0.0, 1e6);
    rs.truncate = s.get_bool("truncate", rs.truncate);
    s.finish();
    if (rs.type != "none" && rs.type != "linear" && rs.type != "llama3" && rs.type != "yarn") {
      diag.errors.push_back(concat(sp, ".type: \"", rs.type, "\" is not one of \"none\", \"linear\", \"llama3\", \"yarn\""));
    }
    if (rs.type == "llama3" && rs.high_freq_factor <= rs.low_freq_factor) {
      diag.errors.push_back(concat(sp, ".high_freq_factor: ", rs.high_freq_factor, " must exceed low_freq_factor ",
                                   rs.low_freq_factor));
    }
  }
  const char* const activations[] = {"gelu", "gelu_tanh", "swiglu"};
  if (std::find(std::begin(activations), std::end(activations), c.activation) == std::end(activations)) {
    diag.errors.push_back(concat(path, ".activation: \"", c.activation,
                                 "\" is not one of \"gelu\" (exact), \"gelu_tanh\" (GPT-2's tanh approximation) and "
                                 "\"swiglu\" (silu(gate) * up)"));
  }
  if (c.norm != "layernorm" && c.norm != "rmsnorm") {
    diag.errors.push_back(concat(path, ".norm: \"", c.norm, "\" is not one of \"layernorm\" and \"rmsnorm\""));
  }
  if (c.positions != "learned" && c.positions != "rope") {
    diag.errors.push_back(concat(path, ".positions: \"", c.positions, "\" is not one of \"learned\" and \"rope\""));
  }
  r.accept("type");
  r.accept("family");
  r.accept("rope_scaling");  // read above
  r.accept("moe");
  r.finish();
  if (c.head_dim == 0 && c.d_model % c.n_head != 0) {
    diag.errors.push_back(concat(path, ".n_head: d_model ", c.d_model, " is not divisible by n_head ", c.n_head,
                                 " (set head_dim for a head width of its own)"));
  }
  if (c.n_head % c.kv_heads() != 0) {
    diag.errors.push_back(concat(path, ".n_kv_head: n_head ", c.n_head, " is not a multiple of n_kv_head ", c.kv_heads()));
  }
  if (c.moe.enabled() && !c.swiglu()) {
    diag.errors.push_back(concat(path, ".moe: the experts are SwiGLU MLPs; set ", path, ".activation to \"swiglu\""));
  }
  if (c.moe.enabled() && c.mlp_bias) {
    diag.errors.push_back(concat(path, ".mlp_bias: the experts have no biases; set false with ", path, ".moe"));
  }
  if (c.rope() && c.hd() % 2 != 0) {
    diag.errors.push_back(concat(path, ".head_dim: rotary positions need an even head width, got ", c.hd()));
  }
  if (!diag.errors.empty()) throw config::ConfigError(diag.errors);
  return c;
}

nlohmann::json GPTConfig::to_json() const {
  nlohmann::json j = {{"vocab", vocab}, {"seq_len", seq_len}, {"d_model", d_model}, {"n_layer", n_layer},
                      {"n_head", n_head}, {"dropout", dropout}, {"tie_embeddings", tie_embeddings},
                      {"activation", activation}, {"layer_norm_eps", layer_norm_eps}};
  // The family's keys only where they differ from GPT-2's, so GPT-2 configs read as before.
  const GPTConfig d;
  if (n_kv_head != d.n_kv_head) j["n_kv_head"] = n_kv_head;
  if (head_dim != d.head_dim) j["head_dim"] = head_dim;
  if (d_ff != d.d_ff) j["d_ff"] = d_ff;
  if (norm != d.norm) j["norm"] = norm;
  if (positions != d.positions) j["positions"] = positions;
  if (rope()) j["rope_theta"] = rope_theta;
  if (!(rope_scaling == d.rope_scaling)) {
    const RopeScaling& s = rope_scaling;
    j["rope_scaling"] = {{"type", s.type}, {"factor", s.factor}, {"low_freq_factor", s.low_freq_factor},
                         {"high_freq_factor", s.high_freq_factor},
                         {"original_max_position_embeddings", s.original_max_position_embeddings},
                         {"beta_fast", s.beta_fast}, {"beta_slow", s.beta_slow},
                         {"attention_factor", s.attention_factor}, {"truncate", s.truncate}};
  }
  if (qkv_bias != d.qkv_bias) j["qkv_bias"] = qkv_bias;
  if (attn_out_bias != d.attn_out_bias) j["attn_out_bias"] = attn_out_bias;
  if (mlp_bias != d.mlp_bias) j["mlp_bias"] = mlp_bias;
  if (qk_norm != d.qk_norm) j["qk_norm"] = qk_norm;
  if (moe.enabled()) j["moe"] = moe.to_json();
  return j;
}

int64_t GPTConfig::block_params() const {
  const int64_t d = d_model, qkv = q_width() + 2 * kv_width(), f = ff();
  const int64_t norms = 2 * (rms() ? d : 2 * d) + (qk_norm ? 2 * hd() : 0);
  const int64_t attn = d * qkv + (qkv_bias ? qkv : 0) + q_width() * d + (attn_out_bias ? d : 0);
  const int64_t up = swiglu() ? 2 * f : f;
  const int64_t mlp = moe.enabled() ? experts().params(d) : d * up + f * d + (mlp_bias ? up + d : 0);
  return norms + attn + mlp;
}

int64_t GPTConfig::active_params() const {
  if (!moe.enabled()) return num_params();
  const MoEConfig m = experts();
  return num_params() - n_layer * (m.params(d_model) - m.active_params(d_model));
}

int64_t GPTConfig::embed_params() const { return vocab * d_model + (rope() ? 0 : seq_len * d_model); }

int64_t GPTConfig::head_params() const { return (rms() ? d_model : 2 * d_model) + (tie_embeddings ? 0 : vocab * d_model); }

int64_t GPTConfig::num_params() const { return embed_params() + n_layer * block_params() + head_params(); }

double GPTConfig::flops_per_token() const {
  return 6.0 * static_cast<double>(active_params()) + 12.0 * n_layer * q_width() * seq_len;
}

NormImpl::NormImpl(int64_t dim_, double eps_, bool rms_) : dim(dim_), eps(eps_), rms(rms_) {
  weight = register_parameter("weight", at::ones({dim}));
  if (!rms) bias = register_parameter("bias", at::zeros({dim}));
}

at::Tensor NormImpl::forward(const at::Tensor& x) {
  if (!rms) return at::layer_norm(x, {dim}, weight, bias, eps);
  if (weight.scalar_type() == x.scalar_type()) return nn::rms_norm(x, weight, eps);  // Note [Fused block operators]
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * y.to(x.scalar_type());
}

Norm copy_norm(const Norm& src) {
  Norm n(src->dim, src->eps, src->rms);
  c10::NoGradGuard g;
  n->weight.copy_(src->weight);
  if (n->bias.defined()) n->bias.copy_(src->bias);
  return n;
}

// Note [Rotary tables]
// As transformers' rotary embeddings compute them, in fp32: inv_freq = 1 / theta^(2i / hd) for
// i < hd / 2 (torch.pow of the scalar theta), rescaled by rope_scaling (linear: / factor;
// llama3: the long wavelengths / factor, the short ones kept, the middle smoothly between; yarn:
// a ramp between interpolated and extrapolated frequencies), then positions x inv_freq (one
// product each) and their cos and sin, times yarn's attention factor.
namespace {
RopeTables compute_rope_tables(const GPTConfig& c, int64_t positions);
}

// Every block of a model shares one table (a Llama of 8192 positions and 30 layers would hold
// 60 MB of copies otherwise): tables are kept by their settings, read-only once made.
RopeTables rope_tables(const GPTConfig& c, int64_t positions) {
  static std::mutex mu;
  static std::map<std::string, RopeTables> cache;
  nlohmann::json key = c.to_json();
  const std::string k = concat(c.hd(), "/", positions, "/", c.rope_theta, "/", key.value("rope_scaling", nlohmann::json()).dump());
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k);
  if (it == cache.end()) it = cache.emplace(k, compute_rope_tables(c, positions)).first;
  return it->second;
}

namespace {
RopeTables compute_rope_tables(const GPTConfig& c, int64_t positions) {
  const int64_t hd = c.hd();
  const RopeScaling& s = c.rope_scaling;
  const at::Tensor exps = at::arange(0, hd, 2, at::kLong).to(at::kFloat) / static_cast<double>(hd);
  const at::Tensor pos_freqs = at::pow(c.rope_theta, exps);
  at::Tensor inv = 1.0 / pos_freqs;
  double attention = 1.0;
  const double two_pi = 2.0 * M_PI;
  if (s.type == "linear") {
    inv = inv / s.factor;
  } else if (s.type == "llama3") {
    const double old_ctx = static_cast<double>(s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                                                                         : c.seq_len);
    const double low_wavelen = old_ctx / s.low_freq_factor, high_wavelen = old_ctx / s.high_freq_factor;
    const at::Tensor wavelen = two_pi / inv;
    at::Tensor llama = at::where(wavelen > low_wavelen, inv / s.factor, inv);
    const at::Tensor smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * llama / s.factor + smooth * llama;
    const at::Tensor medium = at::logical_not(wavelen < high_wavelen).logical_and(at::logical_not(wavelen > low_wavelen));
    inv = at::where(medium, smoothed, llama);
  } else if (s.type == "yarn") {
    const double factor = s.factor;
    const double orig = static_cast<double>(s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                                                                      : c.seq_len);
    attention = s.attention_factor > 0 ? s.attention_factor : (factor <= 1 ? 1.0 : 0.1 * std::log(factor) + 1.0);
    auto correction_dim = [&](double rotations) {
      return (static_cast<double>(hd) * std::log(orig / (rotations * two_pi))) / (2.0 * std::log(c.rope_theta));
    };
    double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(hd - 1));
    if (low == high) high += 0.001;
    const at::Tensor ramp = ((at::arange(hd / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
    const at::Tensor extrapolation = 1 - ramp;
    const at::Tensor interpolation_freq = 1.0 / (factor * pos_freqs);
    inv = interpolation_freq * (1 - extrapolation) + inv * extrapolation;
  }
  const at::Tensor freqs = at::outer(at::arange(positions, at::kLong).to(at::kFloat), inv);  // [positions, hd/2]
  RopeTables t;
  t.cos = freqs.cos();
  t.sin = freqs.sin();
  if (attention != 1.0) {
    t.cos = t.cos * attention;
    t.sin = t.sin * attention;
  }
  return t;
}
}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& t) {
  const int64_t T = x.size(-2), half = x.size(-1) / 2;
  TS_CHECK(T <= t.cos.size(0), "sequence of ", T, " tokens is longer than the model's seq_len ", t.cos.size(0));
  const at::Tensor cos = t.cos.narrow(0, 0, T).to(x.scalar_type()), sin = t.sin.narrow(0, 0, T).to(x.scalar_type());
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

namespace {
// Note [Causal attention]
// LibTorch 2.x has at::scaled_dot_product_attention, whose CPU kernel is a fused flash attention
// (blocked over keys with an online softmax: the [T, T] scores never exist in full, forward or
// backward) when dropout is off; with attention dropout it falls back to the composite math
// path, which equals ours. We use it where it is faster, measured here (forward + backward, one
// thread, torch 2.15, AVX512-BF16 EPYC): in fp32 it takes 0.62-0.75x the time of the spelled-out
// attention ([16,6,128,32]: 14.0 vs 22.6 ms; [4,12,256,64]: 40.1 vs 57.0 ms); in bf16 its kernel
// is 1.7-2.8x slower than bf16 matmuls through oneDNN (33.3 vs 12.1 ms; 48.6 vs 27.7 ms), so
// bf16 keeps the spelled-out form. LibTorch 1.13 has no SDPA. Both forms draw attention dropout
// from the default CPU generator, which activation checkpointing restores on replay.
// q, k, v: [B, H, T, hd]; returns [B, H, T, hd].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            torch::nn::Dropout drop) {
#if TORCH_VERSION_MAJOR >= 2
  if (q.scalar_type() == at::kFloat) {
    const double p = drop->is_training() ? drop->options.p() : 0.0;
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/true);
  }
#endif
  const int64_t T = q.size(2), hd = q.size(3);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  at::Tensor causal = at::ones({T, T}, q.options().dtype(at::kBool)).triu(1);
  att = att.masked_fill(causal, -std::numeric_limits<float>::infinity()).softmax(-1);
  return at::matmul(drop(att), v);
}

void init_linear(torch::nn::Linear& l, double std) {
  c10::NoGradGuard g;
  l->weight.normal_(0.0, std);
  if (l->bias.defined()) l->bias.zero_();
}
}  // namespace

GPTEmbeddingImpl::GPTEmbeddingImpl(const GPTConfig& c) {
  tok = register_module("tok", torch::nn::Embedding(c.vocab, c.d_model));
  if (!c.rope()) pos = register_module("pos", torch::nn::Embedding(c.seq_len, c.d_model));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
  c10::NoGradGuard g;
  tok->weight.normal_(0.0, 0.02);
  if (pos) pos->weight.normal_(0.0, 0.02);
}

at::Tensor GPTEmbeddingImpl::forward(const at::Tensor& tokens) {
  TS_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
           "GPT input must be int64 token ids [batch, time], got ", tokens.scalar_type(), " ", tokens.sizes());
  if (!pos) {  // rotary positions: applied inside attention
    return drop(tok_q.active() ? at::embedding(compression::weight_of(tok_q, tok->weight), tokens) : tok(tokens));
  }
  const int64_t first = sp ? sp->rank() * tokens.size(1) : 0;  // a sequence-parallel shard's first position
  TS_CHECK(first + tokens.size(1) <= pos->weight.size(0), "sequence of ", first + tokens.size(1),
           " tokens is longer than the model's seq_len ", pos->weight.size(0));
  at::Tensor positions = at::arange(first, first + tokens.size(1), tokens.options());
  if (!tok_q.active() && !pos_q.active()) return drop(tok(tokens) + pos(positions).unsqueeze(0));
  return drop(at::embedding(compression::weight_of(tok_q, tok->weight), tokens) +
              at::embedding(compression::weight_of(pos_q, pos->weight), positions).unsqueeze(0));
}

std::vector<compression::Site> GPTEmbeddingImpl::compression_sites() {
  using K = compression::Site::Kind;
  std::vector<compression::Site> sites{{"tok", {"transformer.wte", "model.embed_tokens"}, K::kEmbedding,
                                        tok->options.num_embeddings(), &tok_q, {}}};
  if (pos) sites.push_back({"pos", {"transformer.wpe"}, K::kEmbedding, pos->options.num_embeddings(), &pos_q, {}});
  return sites;
}

namespace {
// A linear layer with its quantization state applied (compression/quantize.h).
at::Tensor linear(torch::nn::Linear& l, const compression::SiteState& q, const at::Tensor& x) {
  if (!q.active()) return l(x);
  return at::linear(compression::input_of(q, x), compression::weight_of(q, l->weight), l->bias);
}
}  // namespace

GPTBlockImpl::GPTBlockImpl(const GPTConfig& c, int64_t index_)
    : n_head(c.n_head), n_kv_head(c.kv_heads()), head_dim(c.hd()), index(index_), n_layer(c.n_layer),
      gelu_approximate(c.gelu_approximate()), swiglu(c.swiglu()) {
  const int64_t d = c.d_model, f = c.ff();
  using LO = torch::nn::LinearOptions;
  // Registered in this order: the parameter order of checkpoints and of the tensor-parallel form.
  ln1 = register_module("ln1", Norm(d, c.layer_norm_eps, c.rms()));
  qkv = register_module("qkv", torch::nn::Linear(LO(d, c.q_width() + 2 * c.kv_width()).bias(c.qkv_bias)));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", Norm(head_dim, c.layer_norm_eps, true));
    k_norm = register_module("k_norm", Norm(head_dim, c.layer_norm_eps, true));
  }
  attn_proj = register_module("attn_proj", torch::nn::Linear(LO(c.q_width(), d).bias(c.attn_out_bias)));
  ln2 = register_module("ln2", Norm(d, c.layer_norm_eps, c.rms()));
  const double residual_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  if (!c.moe.enabled()) {
    fc = register_module("fc", torch::nn::Linear(LO(d, swiglu ? 2 * f : f).bias(c.mlp_bias)));
    mlp_proj = register_module("mlp_proj", torch::nn::Linear(LO(f, d).bias(c.mlp_bias)));
  }
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
  // The draws in GPT-2's order (qkv, fc, attn_proj, mlp_proj), then the experts': a seed gives
  // the dense models it always gave.
  init_linear(qkv, 0.02);
  if (fc) init_linear(fc, 0.02);
  init_linear(attn_proj, residual_std);
  if (mlp_proj) init_linear(mlp_proj, residual_std);
  if (c.moe.enabled()) moe = register_module("moe", MoE(c.experts(), d, residual_std, c.n_layer));
  if (c.rope()) rope = rope_tables(c, c.seq_len);
}

namespace {
// Self-attention of one block (dense or one tensor-parallel rank's heads): qkv [B, T, (H + 2 KV)
// hd] -> [B, T, H hd]. Qwen3's q/k norms, then rotary positions, then each KV head repeated for
// its query group (Hugging Face's repeat_kv), then causal attention.
at::Tensor attend(const at::Tensor& qkv, int64_t H, int64_t KV, int64_t hd, Norm& q_norm, Norm& k_norm,
                  const RopeTables& rope, torch::nn::Dropout& drop) {
  const int64_t B = qkv.size(0), T = qkv.size(1);
  at::Tensor q, k, v;
  if (KV == H && !q_norm && !rope.cos.defined()) {
    // GPT-2: the three thirds as views of one permuted tensor (the layout SDPA has always seen).
    auto parts = qkv.view({B, T, 3, H, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
    q = parts[0], k = parts[1], v = parts[2];
  } else if (!q_norm) {
    // One node: the split, the rotation and the repeated KV heads (Note [Fused block operators]).
    auto parts = nn::split_qkv_rope(qkv, H, KV, hd, rope.cos, rope.sin);
    q = parts[0], k = parts[1], v = parts[2];
  } else {
    q = qkv.narrow(-1, 0, H * hd).view({B, T, H, hd});
    k = qkv.narrow(-1, H * hd, KV * hd).view({B, T, KV, hd});
    v = qkv.narrow(-1, (H + KV) * hd, KV * hd).view({B, T, KV, hd});
    if (q_norm) {
      q = q_norm(q);
      k = k_norm(k);
    }
    q = q.transpose(1, 2), k = k.transpose(1, 2), v = v.transpose(1, 2);  // [B, heads, T, hd]
    if (rope.cos.defined()) {
      q = apply_rope(q, rope);
      k = apply_rope(k, rope);
    }
    if (KV != H) {
      k = k.repeat_interleave(H / KV, 1);
      v = v.repeat_interleave(H / KV, 1);
    }
  }
  return causal_attention(q, k, v, drop).transpose(1, 2).reshape({B, T, H * hd});
}

// The MLP's activation on fc's output: GELU (exact or tanh), or SwiGLU over [gate; up] halves.
at::Tensor mlp_activation(const at::Tensor& f, bool swiglu, const std::string& gelu_approximate) {
  if (!swiglu) return at::gelu(f, gelu_approximate);
  return nn::swiglu(f);  // silu(gate) * up, one node (Note [Fused block operators])
}
}  // namespace

void GPTBlockImpl::add_lora(const GPTConfig& c, const LoraOptions& options) {
  TS_CHECK(!lora, "block", index, " has a LoRA adapter already");
  TS_CHECK(!moe, "LoRA fine-tuning of Mixture-of-Experts models is not implemented (block", index, " has experts)");
  freeze(*this);
  lora = register_module("lora", std::make_shared<LoraBlockImpl>(c, options));
}

namespace {
// y plus the adapter's update of fused linear `which` for input x (y itself without one).
at::Tensor with_lora(const std::shared_ptr<LoraBlockImpl>& lora, checkpoint::peft::Fused which, const at::Tensor& x,
                     at::Tensor y) {
  if (!lora) return y;
  const at::Tensor d = lora->delta(which, x);
  return d.defined() ? y + d.to(y.scalar_type()) : y;
}
}  // namespace

at::Tensor GPTBlockImpl::attention(const at::Tensor& x) {
  using checkpoint::peft::Fused;
  const at::Tensor projected = with_lora(lora, Fused::kQKV, x, linear(qkv, qkv_q, x));
  at::Tensor a;
  if (sp) {
    // Ulysses: this rank's heads over the whole sequence, then its tokens with every head back.
    const int64_t P = sp->size();
    const at::Tensor heads = parallel::sequence_to_heads(projected, n_head, n_kv_head, head_dim, sp);
    a = parallel::heads_to_sequence(attend(heads, n_head / P, parallel::sequence_parallel_kv_heads(n_head, n_kv_head, P),
                                           head_dim, q_norm, k_norm, rope, drop),
                                    sp);
  } else {
    a = attend(projected, n_head, n_kv_head, head_dim, q_norm, k_norm, rope, drop);
  }
  return with_lora(lora, Fused::kProj, a, linear(attn_proj, attn_proj_q, a));
}



at::Tensor GPTBlockImpl::forward(const at::Tensor& x) {
  auto block = [this](const at::Tensor& in) {
    at::Tensor h = in + drop(attention(ln1(in)));
    if (moe) return h + drop(moe(ln2(h)));
    const nn::TileFn mlp = [this](const at::Tensor& n, int64_t, int64_t) {
      using checkpoint::peft::Fused;
      if (lora) {
        const at::Tensor m = mlp_activation(with_lora(lora, Fused::kFC, n, linear(fc, fc_q, n)), swiglu, gelu_approximate);
        return with_lora(lora, Fused::kMLP, m, linear(mlp_proj, mlp_proj_q, m));
      }
      return linear(mlp_proj, mlp_proj_q, mlp_activation(linear(fc, fc_q, n), swiglu, gelu_approximate));
    };
    if (mlp_tiles <= 1 || !is_training()) return h + drop(mlp(ln2(h), 0, h.size(1)));
    // ALST's tiled MLP: the slices' gradients reach fc and mlp_proj once (nn/tiled.h).
    std::vector<at::Tensor> params = fc->parameters();
    for (const auto& p : mlp_proj->parameters()) params.push_back(p);
    return h + drop(nn::tiled(mlp, ln2(h), params, mlp_tiles, nn::TileCombine::kConcat));
  };
  if (kept_tokens > 0 && is_training()) return nn::run_on_kept_tokens(x, kept_tokens, block);
  return block(x);
}

std::vector<compression::Site> GPTBlockImpl::compression_sites() {
  using K = compression::Site::Kind;
  const std::string h = "transformer.h." + std::to_string(index) + ".";
  const std::string l = "model.layers." + std::to_string(index) + ".";
  std::vector<compression::Site> sites = {
      {"qkv", {h + "attn.c_attn", l + "self_attn.qkv_proj"}, K::kLinear, qkv->options.out_features(), &qkv_q,
       {l + "self_attn.q_proj", l + "self_attn.k_proj", l + "self_attn.v_proj"}},
      {"attn_proj", {h + "attn.c_proj", l + "self_attn.o_proj"}, K::kLinear, attn_proj->options.out_features(), &attn_proj_q, {}}};
  if (moe) return sites;  // the experts are not compressible: the attention's linears only
  sites.push_back({"fc", {h + "mlp.c_fc", l + "mlp.gate_up_proj"}, K::kLinear, fc->options.out_features(), &fc_q,
                   swiglu ? std::vector<std::string>{l + "mlp.gate_proj", l + "mlp.up_proj"}
                          : std::vector<std::string>{l + "mlp.up_proj"}});
  sites.push_back({"mlp_proj", {h + "mlp.c_proj", l + "mlp.down_proj"}, K::kLinear, mlp_proj->options.out_features(),
                   &mlp_proj_q, {}});
  return sites;
}

GPTHeadImpl::GPTHeadImpl(const GPTConfig& c, const at::Tensor& tied) : is_tied(tied.defined()), vocab(c.vocab) {
  ln_f = register_module("ln_f", Norm(c.d_model, c.layer_norm_eps, c.rms()));
  if (tied.defined()) {
    weight = register_parameter("weight", tied);
  } else {
    weight = register_parameter("weight", at::empty({c.vocab, c.d_model}).normal_(0.0, 0.02));
  }
}

at::Tensor GPTHeadImpl::forward(const at::Tensor& x) {
  if (!weight_q.active()) return at::matmul(ln_f(x), weight.t());
  return at::matmul(compression::input_of(weight_q, ln_f(x)), compression::weight_of(weight_q, weight).t());
}

std::vector<compression::Site> GPTHeadImpl::compression_sites() {
  if (is_tied) return {};
  return {{"head", {"lm_head"}, compression::Site::Kind::kLinear, vocab, &weight_q, {}}};
}

GPTEmbeddingTPImpl::GPTEmbeddingTPImpl(const GPTEmbedding& dense, const comm::CommunicatorPtr& tp) {
  tok = register_module("tok", tensor_parallel::VocabParallelEmbedding(dense->tok->weight, tp));
  if (dense->pos) pos = register_module("pos", torch::nn::Embedding(dense->pos->weight.size(0), dense->pos->weight.size(1)));
  drop = register_module("drop", torch::nn::Dropout(dense->drop->options.p()));
  c10::NoGradGuard g;
  if (pos) pos->weight.copy_(dense->pos->weight);
}

at::Tensor GPTEmbeddingTPImpl::forward(const at::Tensor& tokens) {
  TS_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
           "GPT input must be int64 token ids [batch, time], got ", tokens.scalar_type(), " ", tokens.sizes());
  if (!pos) return drop(tok(tokens));
  at::Tensor positions = at::arange(tokens.size(1), tokens.options());
  return drop(tok(tokens) + pos(positions).unsqueeze(0));
}

GPTBlockTPImpl::GPTBlockTPImpl(const GPTBlock& dense, const comm::CommunicatorPtr& tp)
    : head_dim(dense->head_dim), gelu_approximate(dense->gelu_approximate), swiglu(dense->swiglu), rope(dense->rope) {
  TS_CHECK(dense->n_head % tp->size() == 0, "model.n_head ", dense->n_head, " does not divide by tensor_parallel.tp_size ",
           tp->size());
  // Grouped-query attention: each rank takes whole KV heads with their query groups; with fewer
  // KV heads than ranks, each KV head is shared by tp / n_kv_head consecutive ranks (Note [Shared
  // key/value heads]).
  const int64_t tps = tp->size();
  local_heads = dense->n_head / tps;
  if (dense->n_kv_head % tps == 0) {
    local_kv_heads = dense->n_kv_head / tps;
  } else {
    // head_dim % tp: each rank's rows are 1/tp of every section, as checkpoints merge them.
    TS_CHECK(tps % dense->n_kv_head == 0 && dense->head_dim % tps == 0, "model.n_kv_head ", dense->n_kv_head,
             " and tensor_parallel.tp_size ", tps, ": the ranks take whole key/value heads (tp_size dividing n_kv_head) or share "
             "them (n_kv_head dividing tp_size, and head_dim ", dense->head_dim, " dividing by tp_size)");
    local_kv_heads = 1;
    kv_replicas = tps / dense->n_kv_head;
    kv_group = tensor_parallel::replica_group(tp, static_cast<int>(kv_replicas));
  }
  // Registered in the dense block's order, so parameters line up with the dense model's.
  ln1 = register_module("ln1", copy_norm(dense->ln1));
  // qkv rows are [q heads | k heads | v heads] (widths H : KV : KV): each part is split by heads.
  std::vector<int64_t> sections;
  if (dense->n_kv_head != dense->n_head) sections = {dense->n_head, dense->n_kv_head, dense->n_kv_head};
  qkv = register_module("qkv", tensor_parallel::ColumnParallelLinear(dense->qkv->weight, dense->qkv->bias, tp, false, 3,
                                                                     sections));
  if (dense->q_norm) {
    q_norm = register_module("q_norm", copy_norm(dense->q_norm));
    k_norm = register_module("k_norm", copy_norm(dense->k_norm));
  }
  attn_proj = register_module("attn_proj", tensor_parallel::RowParallelLinear(dense->attn_proj->weight, dense->attn_proj->bias, tp));
  ln2 = register_module("ln2", copy_norm(dense->ln2));
  if (!dense->moe) {
    // SwiGLU's fc rows are [gate; up]: each half is split alike (chunks = 2).
    fc = register_module("fc", tensor_parallel::ColumnParallelLinear(dense->fc->weight, dense->fc->bias, tp, false,
                                                                     swiglu ? 2 : 1));
    mlp_proj = register_module("mlp_proj", tensor_parallel::RowParallelLinear(dense->mlp_proj->weight, dense->mlp_proj->bias, tp));
  }
  drop = register_module("drop", torch::nn::Dropout(dense->drop->options.p()));
  // Mixture of experts: the attention splits as above; the experts stay whole on every
  // tensor-parallel rank, which routes the same replicated rows (with expert parallelism, over the
  // expert-parallel group of its own tensor-parallel index). Their gradients are equal on the
  // tensor-parallel ranks and count once in the norm, as the replicated norms' do.
  if (dense->moe) moe = register_module("moe", dense->moe);
}

// Note [Shared key/value heads]
// With fewer KV heads than tensor-parallel ranks (tp 4 over Llama's 2 KV heads), the qkv weight
// is still split by rows as always: each rank's rows are its query heads and 1/r of one KV head's
// key and value rows, where r = tp / n_kv_head ranks share that head. Forward gathers the head's
// keys and values from those r ranks; backward sums the r ranks' gradients of them (each attends
// with other query heads) and gives each rank its part. Parameters stay plain row splits, so
// checkpoints, resharding and the gradient norm treat them as any split weight; vLLM instead
// holds the whole head on each sharing rank.
at::Tensor GPTBlockTPImpl::forward(const at::Tensor& x) {
  at::Tensor h_qkv = qkv(ln1(x));
  if (kv_replicas > 1) {
    const int64_t qw = local_heads * head_dim, part = head_dim / kv_replicas;
    h_qkv = at::cat({h_qkv.narrow(-1, 0, qw), tensor_parallel::gather_sum_from_region(h_qkv.narrow(-1, qw, part), kv_group),
                     tensor_parallel::gather_sum_from_region(h_qkv.narrow(-1, qw + part, part), kv_group)},
                    -1);
  }
  at::Tensor y = attend(h_qkv, local_heads, local_kv_heads, head_dim, q_norm, k_norm, rope, drop);
  at::Tensor h = x + drop(attn_proj(y));
  if (moe) return h + drop(moe(ln2(h)));
  return h + drop(mlp_proj(mlp_activation(fc(ln2(h)), swiglu, gelu_approximate)));
}

GPTHeadTPImpl::GPTHeadTPImpl(const GPTHead& dense, const at::Tensor& tied, const comm::CommunicatorPtr& tp_) : tp(tp_) {
  ln_f = register_module("ln_f", copy_norm(dense->ln_f));
  if (tied.defined()) {
    weight = register_parameter("weight", tied);
  } else {
    weight = register_parameter("weight", tensor_parallel::slice(dense->weight.detach(), {0, 1}, tp->rank(), tp->size()));
    tensor_parallel::mark_split(weight, {0, 1});
  }
}

at::Tensor GPTHeadTPImpl::forward(const at::Tensor& x) {
  return at::matmul(tensor_parallel::copy_to_region(ln_f(x), tp), weight.t());
}

namespace {
// Copies `init`'s tensors named "<layer>.<param>" into the layer's parameters (`skip`: a tied
// parameter another layer loads).
void load_layer(torch::nn::Module& m, const std::string& layer, const InitTensors& init, const std::string& skip = "") {
  if (!init) return;
  c10::NoGradGuard g;
  for (auto& item : m.named_parameters(/*recurse=*/true)) {
    if (item.key() == skip) continue;
    const std::string name = layer + "." + item.key();
    const auto it = init->find(name);
    TS_CHECK(it != init->end(), "--init-from: the checkpoint has no tensor '", name, "' (shape ", item.value().sizes(), ")");
    TS_CHECK(it->second.sizes() == item.value().sizes(), "--init-from: tensor '", name, "' has shape ", it->second.sizes(),
             " in the checkpoint but ", item.value().sizes(), " in the model");
    item.value().copy_(it->second);
  }
}
}  // namespace

nn::StackSpec gpt_spec(const GPTConfig& c, uint64_t seed, comm::CommunicatorPtr tp, InitTensors init,
                       std::shared_ptr<const LoraOptions> lora, comm::CommunicatorPtr ep) {
  nn::StackSpec spec;
  spec.seed = seed;
  const bool parallel = tp && tp->size() > 1;
  // Without `ep` every expert is built (a single-process reference of an expert-parallel run).
  TS_CHECK(!ep || (c.moe.enabled() && ep->size() == c.moe.ep_size), "the expert-parallel group has ", ep ? ep->size() : 0,
           " ranks but model.moe.ep_size is ", c.moe.ep_size, c.moe.enabled() ? "" : " (the model has no experts)");
  TS_CHECK(!(lora && parallel), "LoRA fine-tuning runs without tensor parallelism (tp ", tp ? tp->size() : 1,
           "): use data parallelism and ZeRO");
  const int64_t d = c.d_model;
  const int64_t block = c.block_params();
  // The tensor-parallel layers are built from the dense ones (a transient full layer), so every
  // rank slices the same weights the dense model has.
  nn::LayerSpec embed{"embed",
                      [c, tp, parallel, init, lora](const nn::TiedTensors&) {
                        GPTEmbedding dense(c);
                        load_layer(*dense, "embed", init);
                        if (lora) freeze(*dense);
                        return parallel ? torch::nn::AnyModule(GPTEmbeddingTP(dense, tp)) : torch::nn::AnyModule(dense);
                      },
                      c.embed_params(), {}};
  if (c.tie_embeddings) embed.ties = {{"tok.weight", "wte"}};
  spec.layers.push_back(embed);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    spec.layers.push_back({"block" + std::to_string(i),
                           [c, tp, parallel, init, i, lora, ep](const nn::TiedTensors&) {
                             GPTBlock dense(c, i);
                             load_layer(*dense, "block" + std::to_string(i), init);
                             if (lora) dense->add_lora(c, *lora);
                             if (dense->moe && ep) dense->moe->shard_experts(ep);
                             return parallel ? torch::nn::AnyModule(GPTBlockTP(dense, tp)) : torch::nn::AnyModule(dense);
                           },
                           block, {}});
  }
  nn::LayerSpec head{"head",
                     [c, tp, parallel, init, lora](const nn::TiedTensors& tied) {
                       const auto it = tied.find("wte");
                       const at::Tensor t = c.tie_embeddings && it != tied.end() ? it->second : at::Tensor();
                       const std::string skip = c.tie_embeddings ? "weight" : "";
                       if (!parallel) {
                         GPTHead head(c, t);
                         load_layer(*head, "head", init, skip);
                         if (lora) freeze(*head);
                         return torch::nn::AnyModule(head);
                       }
                       GPTHead dense(c, at::Tensor());
                       load_layer(*dense, "head", init, skip);
                       return torch::nn::AnyModule(GPTHeadTP(dense, t, tp));
                     },
                     c.head_params() + (c.tie_embeddings ? c.vocab * d : 0), {}};
  if (c.tie_embeddings) head.ties = {{"weight", "wte"}};
  spec.layers.push_back(head);
  const int64_t vocab = c.vocab;
  if (parallel) {
    spec.loss = [tp](const at::Tensor& logits, const at::Tensor& targets) {
      return tensor_parallel::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), tp);
    };
  } else {
    spec.loss = [vocab](const at::Tensor& logits, const at::Tensor& targets) {
      return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}).to(at::kFloat), targets.reshape({-1}));
    };
  }
  return spec;
}

nn::LayerStack make_gpt(const GPTConfig& c) {
  return nn::build(gpt_spec(c, at::detail::getDefaultCPUGenerator().current_seed()));
}

}  // namespace torchspeed::models

namespace torchspeed::models {

std::vector<int64_t> sample(nn::LayerStack& model, const GPTConfig& c, std::vector<int64_t> tokens,
                            const SampleOptions& o) {
  TS_CHECK(!tokens.empty(), "generation needs a non-empty prompt");
  c10::NoGradGuard no_grad;
  model->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - c.seq_len);
    at::Tensor ctx = at::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end()), at::kLong).unsqueeze(0);
    at::Tensor logits = model->forward(ctx).select(1, -1).squeeze(0).to(at::kFloat);  // [vocab]
    int64_t next;
    if (o.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / o.temperature;
      if (o.top_k > 0 && o.top_k < logits.size(0)) {
        at::Tensor kth = std::get<0>(logits.topk(o.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = at::multinomial(logits.softmax(0), 1, false, gen).item<int64_t>();
    }
    tokens.push_back(next);
    out.push_back(next);
  }
  return out;
}

}  // namespace torchspeed::models
