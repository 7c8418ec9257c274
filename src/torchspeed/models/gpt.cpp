// GPT layers and initialisation (GPT-2: N(0, 0.02) weights, residual projections scaled by
// 1/sqrt(2 n_layer), zero biases, unit LayerNorm).
#include "torchspeed/models/gpt.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/version.h>

#include <cmath>

#include "torchspeed/config/config.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/runtime/error.h"

namespace torchspeed::models {

GPTConfig GPTConfig::from_json(const nlohmann::json& j, const std::string& path) {
  config::Diagnostics diag;
  config::JsonReader r(j, path, diag);
  GPTConfig c;
  c.vocab = r.get_int("vocab", c.vocab, 2, 1 << 24);
  c.seq_len = r.get_int("seq_len", c.seq_len, 1, 1 << 20);
  c.d_model = r.get_int("d_model", c.d_model, 1, 1 << 20);
  c.n_layer = r.get_int("n_layer", c.n_layer, 1, 1 << 12);
  c.n_head = r.get_int("n_head", c.n_head, 1, 1 << 12);
  c.dropout = r.get_double("dropout", c.dropout, 0.0, 0.99);
  c.tie_embeddings = r.get_bool("tie_embeddings", c.tie_embeddings);
  c.activation = r.get_string("activation", c.activation);
  c.layer_norm_eps = r.get_double("layer_norm_eps", c.layer_norm_eps, 1e-12, 1e-1);
  if (c.activation != "gelu" && c.activation != "gelu_tanh") {
    diag.errors.push_back(concat(path, ".activation: \"", c.activation,
                                 "\" is not one of \"gelu\" (exact) and \"gelu_tanh\" (GPT-2's tanh approximation)"));
  }
  r.accept("type");
  r.finish();
  if (c.d_model % c.n_head != 0) {
    diag.errors.push_back(concat(path, ".n_head: d_model ", c.d_model, " is not divisible by n_head ", c.n_head));
  }
  if (!diag.errors.empty()) throw config::ConfigError(diag.errors);
  return c;
}

nlohmann::json GPTConfig::to_json() const {
  return {{"vocab", vocab}, {"seq_len", seq_len}, {"d_model", d_model}, {"n_layer", n_layer},
          {"n_head", n_head}, {"dropout", dropout}, {"tie_embeddings", tie_embeddings},
          {"activation", activation}, {"layer_norm_eps", layer_norm_eps}};
}

int64_t GPTConfig::num_params() const {
  const int64_t d = d_model;
  const int64_t embed = vocab * d + seq_len * d;
  const int64_t block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
  const int64_t head = 2 * d + (tie_embeddings ? 0 : vocab * d);
  return embed + n_layer * block + head;
}

double GPTConfig::flops_per_token() const {
  return 6.0 * static_cast<double>(num_params()) + 12.0 * n_layer * d_model * seq_len;
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
  pos = register_module("pos", torch::nn::Embedding(c.seq_len, c.d_model));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
  c10::NoGradGuard g;
  tok->weight.normal_(0.0, 0.02);
  pos->weight.normal_(0.0, 0.02);
}

at::Tensor GPTEmbeddingImpl::forward(const at::Tensor& tokens) {
  TS_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
           "GPT input must be int64 token ids [batch, time], got ", tokens.scalar_type(), " ", tokens.sizes());
  TS_CHECK(tokens.size(1) <= pos->weight.size(0), "sequence of ", tokens.size(1),
           " tokens is longer than the model's seq_len ", pos->weight.size(0));
  at::Tensor positions = at::arange(tokens.size(1), tokens.options());
  if (!tok_q.active() && !pos_q.active()) return drop(tok(tokens) + pos(positions).unsqueeze(0));
  return drop(at::embedding(compression::weight_of(tok_q, tok->weight), tokens) +
              at::embedding(compression::weight_of(pos_q, pos->weight), positions).unsqueeze(0));
}

std::vector<compression::Site> GPTEmbeddingImpl::compression_sites() {
  using K = compression::Site::Kind;
  return {{"tok", {"transformer.wte"}, K::kEmbedding, tok->options.num_embeddings(), &tok_q},
          {"pos", {"transformer.wpe"}, K::kEmbedding, pos->options.num_embeddings(), &pos_q}};
}

namespace {
// A linear layer with its quantization state applied (compression/quantize.h).
at::Tensor linear(torch::nn::Linear& l, const compression::SiteState& q, const at::Tensor& x) {
  if (!q.active()) return l(x);
  return at::linear(compression::input_of(q, x), compression::weight_of(q, l->weight), l->bias);
}
}  // namespace

GPTBlockImpl::GPTBlockImpl(const GPTConfig& c, int64_t index_)
    : n_head(c.n_head), index(index_), n_layer(c.n_layer), gelu_approximate(c.gelu_approximate()) {
  const int64_t d = c.d_model;
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(c.layer_norm_eps)));
  qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
  attn_proj = register_module("attn_proj", torch::nn::Linear(d, d));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(c.layer_norm_eps)));
  fc = register_module("fc", torch::nn::Linear(d, 4 * d));
  mlp_proj = register_module("mlp_proj", torch::nn::Linear(4 * d, d));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
  const double residual_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  init_linear(qkv, 0.02);
  init_linear(fc, 0.02);
  init_linear(attn_proj, residual_std);
  init_linear(mlp_proj, residual_std);
}

at::Tensor GPTBlockImpl::attention(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2), hd = d / n_head;
  // [B, T, 3d] -> 3 x [B, H, T, hd]
  auto parts = linear(qkv, qkv_q, x).view({B, T, 3, n_head, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
  at::Tensor y = causal_attention(parts[0], parts[1], parts[2], drop);  // [B, H, T, hd]
  return linear(attn_proj, attn_proj_q, y.transpose(1, 2).reshape({B, T, d}));
}

at::Tensor GPTBlockImpl::forward(const at::Tensor& x) {
  auto block = [this](const at::Tensor& in) {
    at::Tensor h = in + drop(attention(ln1(in)));
    return h + drop(linear(mlp_proj, mlp_proj_q, at::gelu(linear(fc, fc_q, ln2(h)), gelu_approximate)));
  };
  if (kept_tokens > 0 && is_training()) return nn::run_on_kept_tokens(x, kept_tokens, block);
  return block(x);
}

std::vector<compression::Site> GPTBlockImpl::compression_sites() {
  using K = compression::Site::Kind;
  const std::string h = "transformer.h." + std::to_string(index) + ".";
  return {{"qkv", {h + "attn.c_attn"}, K::kLinear, qkv->options.out_features(), &qkv_q},
          {"attn_proj", {h + "attn.c_proj"}, K::kLinear, attn_proj->options.out_features(), &attn_proj_q},
          {"fc", {h + "mlp.c_fc"}, K::kLinear, fc->options.out_features(), &fc_q},
          {"mlp_proj", {h + "mlp.c_proj"}, K::kLinear, mlp_proj->options.out_features(), &mlp_proj_q}};
}

GPTHeadImpl::GPTHeadImpl(const GPTConfig& c, const at::Tensor& tied) : is_tied(tied.defined()), vocab(c.vocab) {
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(c.layer_norm_eps)));
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
  return {{"head", {"lm_head"}, compression::Site::Kind::kLinear, vocab, &weight_q}};
}

namespace {
torch::nn::LayerNorm copy_norm(const torch::nn::LayerNorm& src) {
  torch::nn::LayerNorm n(torch::nn::LayerNormOptions(src->options.normalized_shape()).eps(src->options.eps()));
  c10::NoGradGuard g;
  n->weight.copy_(src->weight);
  n->bias.copy_(src->bias);
  return n;
}
}  // namespace

GPTEmbeddingTPImpl::GPTEmbeddingTPImpl(const GPTEmbedding& dense, const comm::CommunicatorPtr& tp) {
  tok = register_module("tok", tensor_parallel::VocabParallelEmbedding(dense->tok->weight, tp));
  pos = register_module("pos", torch::nn::Embedding(dense->pos->weight.size(0), dense->pos->weight.size(1)));
  drop = register_module("drop", torch::nn::Dropout(dense->drop->options.p()));
  c10::NoGradGuard g;
  pos->weight.copy_(dense->pos->weight);
}

at::Tensor GPTEmbeddingTPImpl::forward(const at::Tensor& tokens) {
  TS_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
           "GPT input must be int64 token ids [batch, time], got ", tokens.scalar_type(), " ", tokens.sizes());
  at::Tensor positions = at::arange(tokens.size(1), tokens.options());
  return drop(tok(tokens) + pos(positions).unsqueeze(0));
}

GPTBlockTPImpl::GPTBlockTPImpl(const GPTBlock& dense, const comm::CommunicatorPtr& tp)
    : gelu_approximate(dense->gelu_approximate) {
  TS_CHECK(dense->n_head % tp->size() == 0, "model.n_head ", dense->n_head, " does not divide by tensor_parallel.tp_size ",
           tp->size());
  local_heads = dense->n_head / tp->size();
  // Registered in the dense block's order, so parameters line up with the dense model's.
  ln1 = register_module("ln1", copy_norm(dense->ln1));
  // qkv rows are [q heads | k heads | v heads]: each third is split by heads (chunks = 3).
  qkv = register_module("qkv", tensor_parallel::ColumnParallelLinear(dense->qkv->weight, dense->qkv->bias, tp, false, 3));
  attn_proj = register_module("attn_proj", tensor_parallel::RowParallelLinear(dense->attn_proj->weight, dense->attn_proj->bias, tp));
  ln2 = register_module("ln2", copy_norm(dense->ln2));
  fc = register_module("fc", tensor_parallel::ColumnParallelLinear(dense->fc->weight, dense->fc->bias, tp));
  mlp_proj = register_module("mlp_proj", tensor_parallel::RowParallelLinear(dense->mlp_proj->weight, dense->mlp_proj->bias, tp));
  drop = register_module("drop", torch::nn::Dropout(dense->drop->options.p()));
}

at::Tensor GPTBlockTPImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  at::Tensor h = ln1(x);
  at::Tensor q3 = qkv(h);  // [B, T, 3 * local_heads * hd]
  const int64_t hd = q3.size(2) / (3 * local_heads);
  auto parts = q3.view({B, T, 3, local_heads, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
  at::Tensor y = causal_attention(parts[0], parts[1], parts[2], drop).transpose(1, 2).reshape({B, T, local_heads * hd});
  h = x + drop(attn_proj(y));
  return h + drop(mlp_proj(at::gelu(fc(ln2(h)), gelu_approximate)));
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

nn::StackSpec gpt_spec(const GPTConfig& c, uint64_t seed, comm::CommunicatorPtr tp, InitTensors init) {
  nn::StackSpec spec;
  spec.seed = seed;
  const bool parallel = tp && tp->size() > 1;
  const int64_t d = c.d_model;
  const int64_t block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
  // The tensor-parallel layers are built from the dense ones (a transient full layer), so every
  // rank slices the same weights the dense model has.
  nn::LayerSpec embed{"embed",
                      [c, tp, parallel, init](const nn::TiedTensors&) {
                        GPTEmbedding dense(c);
                        load_layer(*dense, "embed", init);
                        return parallel ? torch::nn::AnyModule(GPTEmbeddingTP(dense, tp)) : torch::nn::AnyModule(dense);
                      },
                      c.vocab * d + c.seq_len * d, {}};
  if (c.tie_embeddings) embed.ties = {{"tok.weight", "wte"}};
  spec.layers.push_back(embed);
  for (int64_t i = 0; i < c.n_layer; ++i) {
    spec.layers.push_back({"block" + std::to_string(i),
                           [c, tp, parallel, init, i](const nn::TiedTensors&) {
                             GPTBlock dense(c, i);
                             load_layer(*dense, "block" + std::to_string(i), init);
                             return parallel ? torch::nn::AnyModule(GPTBlockTP(dense, tp)) : torch::nn::AnyModule(dense);
                           },
                           block, {}});
  }
  nn::LayerSpec head{"head",
                     [c, tp, parallel, init](const nn::TiedTensors& tied) {
                       const auto it = tied.find("wte");
                       const at::Tensor t = c.tie_embeddings && it != tied.end() ? it->second : at::Tensor();
                       const std::string skip = c.tie_embeddings ? "weight" : "";
                       if (!parallel) {
                         GPTHead head(c, t);
                         load_layer(*head, "head", init, skip);
                         return torch::nn::AnyModule(head);
                       }
                       GPTHead dense(c, at::Tensor());
                       load_layer(*dense, "head", init, skip);
                       return torch::nn::AnyModule(GPTHeadTP(dense, t, tp));
                     },
                     2 * d + c.vocab * d, {}};
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
