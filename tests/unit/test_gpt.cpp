// The GPT against an independent computation: one block written out with plain tensor ops
// (layer norm, causal attention, GELU MLP), outputs and every gradient compared; causality,
// weight tying, parameter count and the loss at initialisation.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>

#include "torchspeed/models/gpt.h"
#include "torchspeed/models/lora.h"
#include "torchspeed/base/error.h"

using namespace torchspeed::models;

namespace {
GPTConfig small() {
  GPTConfig c;
  c.vocab = 256;
  c.seq_len = 16;
  c.d_model = 24;
  c.n_layer = 2;
  c.n_head = 3;
  return c;
}

// Layer norm, attention and MLP spelled out: no torch::nn module involved.
at::Tensor reference_block(GPTBlock& b, const at::Tensor& x, int64_t n_head) {
  auto ln = [](const at::Tensor& v, const at::Tensor& w, const at::Tensor& bias) {
    at::Tensor mean = v.mean(-1, true);
    at::Tensor var = (v - mean).pow(2).mean(-1, true);
    return (v - mean) / (var + 1e-5).sqrt() * w + bias;
  };
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2), hd = d / n_head;
  at::Tensor h = ln(x, b->ln1->weight, b->ln1->bias);
  at::Tensor qkv = at::matmul(h, b->qkv->weight.t()) + b->qkv->bias;
  at::Tensor out = at::zeros_like(x);
  std::vector<at::Tensor> heads;
  for (int64_t head = 0; head < n_head; ++head) {
    at::Tensor q = qkv.narrow(2, head * hd, hd), k = qkv.narrow(2, d + head * hd, hd), v = qkv.narrow(2, 2 * d + head * hd, hd);
    at::Tensor scores = at::matmul(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(hd));
    at::Tensor mask = at::ones({T, T}).tril().to(at::kBool);
    scores = at::where(mask, scores, at::full({}, -1e30));
    at::Tensor p = scores.exp() / scores.exp().sum(-1, true);
    heads.push_back(at::matmul(p, v));
  }
  at::Tensor attn = at::matmul(at::cat(heads, 2), b->attn_proj->weight.t()) + b->attn_proj->bias;
  at::Tensor r = x + attn;
  at::Tensor f = at::matmul(ln(r, b->ln2->weight, b->ln2->bias), b->fc->weight.t()) + b->fc->bias;
  f = 0.5 * f * (1 + at::erf(f / std::sqrt(2.0)));  // exact GELU
  return r + at::matmul(f, b->mlp_proj->weight.t()) + b->mlp_proj->bias;
  (void)B;
}
}  // namespace

TEST(GPT, BlockMatchesAWrittenOutComputationWithGradients) {
  torch::manual_seed(0);
  GPTConfig c = small();
  GPTBlock block(c);
  at::Tensor x = torch::randn({2, 7, c.d_model}, torch::requires_grad());
  at::Tensor g = at::randn({2, 7, c.d_model});
  at::Tensor ref = reference_block(block, x, c.n_head);
  auto params = block->parameters();
  auto ref_grads = torch::autograd::grad({ref}, [&] { auto v = params; v.push_back(x); return v; }(), {g});
  at::Tensor got = block->forward(x);
  auto got_grads = torch::autograd::grad({got}, [&] { auto v = params; v.push_back(x); return v; }(), {g});
  EXPECT_TRUE(at::allclose(got, ref, 1e-5, 1e-5)) << (got - ref).abs().max().item<double>();
  ASSERT_EQ(got_grads.size(), ref_grads.size());
  for (size_t i = 0; i < got_grads.size(); ++i) {
    EXPECT_TRUE(at::allclose(got_grads[i], ref_grads[i], 1e-4, 1e-5)) << "gradient " << i << ": "
        << (got_grads[i] - ref_grads[i]).abs().max().item<double>();
  }
}

namespace {
// A Llama / Qwen3 block spelled out: RMSNorm, rotary positions as a rotation of each pair (i,
// i + hd/2) by position x theta^(-2i/hd) (angles in double), grouped-query heads looping over
// their KV head, optional per-head q/k RMSNorm, SwiGLU; no torch::nn module involved.
at::Tensor reference_llama_block(GPTBlock& b, const at::Tensor& x, const GPTConfig& c) {
  auto rms = [&](const at::Tensor& v, const at::Tensor& w) {
    return v / (v.pow(2).mean(-1, true) + c.layer_norm_eps).sqrt() * w;
  };
  const int64_t T = x.size(1), d = x.size(2), H = c.n_head, KV = c.kv_heads(), hd = c.hd(), half = hd / 2;
  std::vector<double> angle_cos, angle_sin;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(t) * std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
      angle_cos.push_back(std::cos(a));
      angle_sin.push_back(std::sin(a));
    }
  }
  const at::Tensor cs = at::tensor(angle_cos, at::kDouble).view({T, half}).to(at::kFloat);
  const at::Tensor sn = at::tensor(angle_sin, at::kDouble).view({T, half}).to(at::kFloat);
  auto rotate = [&](const at::Tensor& v) {  // [B, T, hd]
    const at::Tensor a = v.narrow(2, 0, half), bb = v.narrow(2, half, half);
    return at::cat({a * cs - bb * sn, a * sn + bb * cs}, 2);
  };
  at::Tensor h = rms(x, b->ln1->weight);
  at::Tensor qkv = at::matmul(h, b->qkv->weight.t());
  std::vector<at::Tensor> heads;
  for (int64_t head = 0; head < H; ++head) {
    const int64_t g = head / (H / KV);
    at::Tensor q = qkv.narrow(2, head * hd, hd), k = qkv.narrow(2, H * hd + g * hd, hd);
    at::Tensor v = qkv.narrow(2, (H + KV) * hd + g * hd, hd);
    if (c.qk_norm) {
      q = rms(q, b->q_norm->weight);
      k = rms(k, b->k_norm->weight);
    }
    q = rotate(q), k = rotate(k);
    at::Tensor scores = at::matmul(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(hd));
    scores = at::where(at::ones({T, T}).tril().to(at::kBool), scores, at::full({}, -1e30));
    heads.push_back(at::matmul(scores.softmax(-1), v));
  }
  at::Tensor r = x + at::matmul(at::cat(heads, 2), b->attn_proj->weight.t());
  at::Tensor f = at::matmul(rms(r, b->ln2->weight), b->fc->weight.t());
  const int64_t ff = f.size(2) / 2;
  const at::Tensor gate = f.narrow(2, 0, ff), up = f.narrow(2, ff, ff);
  return r + at::matmul(gate * at::sigmoid(gate) * up, b->mlp_proj->weight.t());
  (void)d;
}

GPTConfig llama_small() {
  GPTConfig c = small();
  c.norm = "rmsnorm", c.positions = "rope", c.activation = "swiglu", c.n_kv_head = 1, c.d_ff = 40;
  c.qkv_bias = c.attn_out_bias = c.mlp_bias = false, c.rope_theta = 10000;
  return c;
}
}  // namespace

TEST(GPT, LlamaAndQwen3BlocksMatchAWrittenOutComputationWithGradients) {
  for (bool qk_norm : {false, true}) {
    torch::manual_seed(2);
    GPTConfig c = llama_small();
    c.qk_norm = qk_norm;
    if (qk_norm) c.head_dim = 16;  // Qwen3: a head width of its own (3 x 16 != 24)
    GPTBlock block(c);
    {
      torch::NoGradGuard g;
      for (auto& p : block->parameters()) p.add_(at::randn_like(p) * 0.1);  // norms away from 1
    }
    EXPECT_EQ(block->qkv->weight.size(0), (c.n_head + 2 * c.kv_heads()) * c.hd());
    EXPECT_FALSE(block->qkv->bias.defined());
    at::Tensor x = torch::randn({2, 9, c.d_model}, torch::requires_grad());
    at::Tensor g = at::randn({2, 9, c.d_model});
    auto inputs = block->parameters();
    inputs.push_back(x);
    at::Tensor ref = reference_llama_block(block, x, c);
    auto ref_grads = torch::autograd::grad({ref}, inputs, {g});
    at::Tensor got = block->forward(x);
    auto got_grads = torch::autograd::grad({got}, inputs, {g});
    EXPECT_TRUE(at::allclose(got, ref, 1e-5, 1e-5)) << "qk_norm " << qk_norm << ": "
                                                    << (got - ref).abs().max().item<double>();
    ASSERT_EQ(got_grads.size(), ref_grads.size());
    for (size_t i = 0; i < got_grads.size(); ++i) {
      EXPECT_TRUE(at::allclose(got_grads[i], ref_grads[i], 1e-4, 1e-5))
          << "qk_norm " << qk_norm << " gradient " << i << ": " << (got_grads[i] - ref_grads[i]).abs().max().item<double>();
    }
  }
}

// LoRA: a fresh adapter (B = 0) leaves the block's output as it was; only the adapter's
// parameters get gradients; a trained one equals the block whose weights have it merged.
TEST(GPT, LoraStartsAtTheBaseTrainsOnlyTheAdapterAndMerges) {
  torch::manual_seed(3);
  const GPTConfig c = llama_small();
  GPTBlock block(c, 0);
  at::Tensor x = torch::randn({2, 7, c.d_model});
  const at::Tensor base_out = block->forward(x).detach();
  LoraOptions o = LoraOptions::from_json({{"r", 2}, {"lora_alpha", 6}, {"target_modules", {"k_proj", "up_proj", "down_proj", "o_proj"}}}, c);
  EXPECT_DOUBLE_EQ(o.scale(), 3.0);
  block->add_lora(c, o);
  EXPECT_TRUE(at::equal(block->forward(x), base_out));
  std::vector<std::string> trainable;
  for (const auto& p : block->named_parameters()) {
    if (p.value().requires_grad()) trainable.push_back(p.key());
  }
  EXPECT_EQ(trainable.size(), 8u);  // 4 modules x (A, B)
  for (const auto& n : trainable) EXPECT_EQ(n.rfind("lora.", 0), 0u) << n;
  {
    torch::NoGradGuard g;
    for (auto& m : block->lora->modules) m.B.normal_(0, 0.3);
  }
  const at::Tensor out = block->forward(x);
  out.sum().backward();
  for (const auto& p : block->named_parameters()) {
    EXPECT_EQ(p.value().grad().defined(), p.value().requires_grad()) << p.key();
  }
  EXPECT_GT((out - base_out).abs().max().item<double>(), 1e-2);
  // Merged: each module's scale * B A added to its rows of the fused weights.
  std::vector<std::pair<std::string, at::Tensor>> params, lora;
  for (const auto& p : block->named_parameters()) {
    (p.key().rfind("lora.", 0) == 0 ? lora : params).emplace_back("block0." + p.key(), p.value());
  }
  GPTConfig one = c;
  one.n_layer = 1;
  const auto merged = merge_lora(params, lora_adapter_of(lora, one, o), one);
  GPTBlock plain(c, 0);
  {
    torch::NoGradGuard g;
    for (const auto& [name, t] : merged) plain->named_parameters()[name.substr(7)].copy_(t);
  }
  EXPECT_TRUE(at::allclose(plain->forward(x), out, 1e-5, 1e-5)) << (plain->forward(x) - out).abs().max().item<double>();
  // A target the model does not have is refused by name.
  EXPECT_THROW(LoraOptions::from_json({{"target_modules", {"c_attn"}}}, c), torchspeed::Error);
  EXPECT_THROW(LoraOptions::from_json({{"rank", 4}}, c), torchspeed::Error);
}

TEST(GPT, TheDescriptionRoundTripsThroughJsonAndCountsParameters) {
  GPTConfig c = llama_small();
  c.qk_norm = true, c.head_dim = 16, c.tie_embeddings = false;
  c.rope_scaling.type = "yarn", c.rope_scaling.factor = 4, c.rope_scaling.original_max_position_embeddings = 8;
  const GPTConfig back = GPTConfig::from_json(c.to_json());
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_TRUE(back.rope_scaling == c.rope_scaling);
  torch::manual_seed(3);
  auto model = make_gpt(c);
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  EXPECT_EQ(n, c.num_params());
  // GPT-2's section has none of the new keys: old checkpoints' configs read as before.
  EXPECT_FALSE(small().to_json().contains("norm"));
  EXPECT_THROW(GPTConfig::from_json({{"norm", "batchnorm"}}), std::exception);
  EXPECT_THROW(GPTConfig::from_json({{"n_head", 4}, {"n_kv_head", 3}, {"d_model", 32}}), std::exception);
  EXPECT_THROW(GPTConfig::from_json({{"positions", "rope"}, {"rope_scaling", {{"type", "dynamic"}}}}), std::exception);
}

// Rotary tables as transformers computes them for each scaling: spot values from the formulas.
TEST(GPT, RopeTablesFollowEachScaling) {
  GPTConfig c = llama_small();
  c.head_dim = 8, c.seq_len = 64, c.rope_theta = 10000;
  const RopeTables plain = rope_tables(c, 64);
  EXPECT_NEAR(plain.cos[5][1].item<double>(), std::cos(5 * std::pow(10000.0, -2.0 / 8)), 1e-6);
  GPTConfig lin = c;
  lin.rope_scaling.type = "linear", lin.rope_scaling.factor = 2;
  EXPECT_NEAR(rope_tables(lin, 64).sin[6][1].item<double>(), std::sin(3 * std::pow(10000.0, -2.0 / 8)), 1e-6);
  // llama3 with an original context of 64: wavelengths above 64 (low_freq_factor 1) are scaled
  // by 1/factor, those below 64/4 kept (2 pi: kept; 2 pi 10^3: scaled).
  GPTConfig l3 = c;
  l3.rope_scaling.type = "llama3", l3.rope_scaling.factor = 8, l3.rope_scaling.original_max_position_embeddings = 64;
  const RopeTables t = rope_tables(l3, 64);
  EXPECT_NEAR(t.cos[7][0].item<double>(), std::cos(7.0), 1e-6);                            // wavelength 2 pi: kept
  EXPECT_NEAR(t.cos[7][3].item<double>(), std::cos(7 * std::pow(10000.0, -6.0 / 8) / 8), 1e-6);  // scaled
  // yarn: cos and sin scaled by 0.1 ln(factor) + 1.
  GPTConfig y = c;
  y.rope_scaling.type = "yarn", y.rope_scaling.factor = 4, y.rope_scaling.original_max_position_embeddings = 16;
  EXPECT_NEAR(rope_tables(y, 64).cos[0][0].item<double>(), 0.1 * std::log(4.0) + 1, 1e-6);
}

TEST(GPT, IsCausalTiedAndCountsItsParameters) {
  torch::manual_seed(1);
  GPTConfig c = small();
  auto model = make_gpt(c);
  ASSERT_EQ(model->size(), static_cast<size_t>(c.n_layer + 2));
  // Tied: the head's weight is the token embedding's tensor.
  auto embed = model->layer_module(0)->named_parameters()["tok.weight"];
  auto head = model->layer_module(model->size() - 1)->named_parameters()["weight"];
  EXPECT_EQ(embed.unsafeGetTensorImpl(), head.unsafeGetTensorImpl());
  std::set<const void*> unique;
  int64_t n = 0;
  for (auto& p : model->parameters())
    if (unique.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  EXPECT_EQ(n, c.num_params());
  EXPECT_DOUBLE_EQ(c.flops_per_token(), 6.0 * n + 12.0 * c.n_layer * c.d_model * c.seq_len);
  // Changing a later token leaves earlier logits unchanged.
  model->eval();
  at::Tensor a = at::randint(0, 256, {1, 10}, at::kLong), b = a.clone();
  b[0][7] = (b[0][7].item<int64_t>() + 1) % 256;
  at::Tensor la = model->forward(a), lb = model->forward(b);
  EXPECT_TRUE(at::allclose(la.narrow(1, 0, 7), lb.narrow(1, 0, 7), 1e-6, 1e-6));
  EXPECT_FALSE(at::allclose(la.narrow(1, 7, 3), lb.narrow(1, 7, 3), 1e-6, 1e-6));
  // At initialisation the prediction is close to uniform: loss ~ ln(256).
  at::Tensor y = at::randint(0, 256, {4, 16}, at::kLong);
  const double loss = model->loss(model->forward(at::randint(0, 256, {4, 16}, at::kLong)), y).item<double>();
  EXPECT_NEAR(loss, std::log(256.0), 0.15);
}

TEST(GPT, ConfigErrorsNameTheKey) {
  EXPECT_THROW(GPTConfig::from_json({{"d_model", 30}, {"n_head", 4}}), torchspeed::Error);
  try {
    GPTConfig::from_json({{"d_modle", 32}});
    FAIL();
  } catch (const torchspeed::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.d_modle: unknown key; did you mean \"d_model\"?"), std::string::npos) << e.what();
  }
}

TEST(GPT, TanhGeluAndLayerNormEpsilonAreTheConfigs) {
  // GPT-2's MLP uses the tanh approximation: the block's output changes with it, by exactly
  // what the two GELUs differ by for the same weights.
  GPTConfig c;
  c.d_model = 16;
  c.n_head = 2;
  torch::manual_seed(3);
  GPTBlock exact(c);
  GPTConfig ct = c;
  ct.activation = "gelu_tanh";
  ct.layer_norm_eps = 1e-3;
  GPTBlock tanh_block(ct);
  {
    torch::NoGradGuard g;
    auto src = exact->parameters(), dst = tanh_block->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  const at::Tensor x = torch::randn({2, 5, 16});
  const at::Tensor h = x + tanh_block->attention(at::layer_norm(x, {16}, tanh_block->ln1->weight, tanh_block->ln1->bias, 1e-3));
  const at::Tensor want = h + tanh_block->mlp_proj(at::gelu(tanh_block->fc(at::layer_norm(h, {16}, tanh_block->ln2->weight, tanh_block->ln2->bias, 1e-3)), "tanh"));
  EXPECT_TRUE(torch::allclose(tanh_block->forward(x), want, 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(exact->forward(x), tanh_block->forward(x), 1e-5, 1e-6));
  EXPECT_EQ(GPTConfig::from_json(ct.to_json()).activation, "gelu_tanh");
  try {
    GPTConfig::from_json({{"activation", "relu"}});
    FAIL();
  } catch (const torchspeed::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.activation: \"relu\" is not one of"), std::string::npos) << e.what();
  }
}

TEST(GPT, SamplingIsSeededAndGreedyIsDeterministic) {
  torch::manual_seed(2);
  GPTConfig c = small();
  auto model = make_gpt(c);
  SampleOptions o;
  o.max_new_tokens = 20;
  o.seed = 5;
  auto a = sample(model, c, {72, 105}, o), b = sample(model, c, {72, 105}, o);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 20u);
  o.temperature = 0;
  EXPECT_EQ(sample(model, c, {1, 2, 3}, o), sample(model, c, {1, 2, 3}, o));
}
