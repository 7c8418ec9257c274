// The Mixture-of-Experts MLP against computations written out here: DeepSpeed's capacity and
// drop order on hand-made router logits, the load-balancing loss's formula, the layer's output
// token by token, and the gradient the attached auxiliary loss gives (nn/aux_loss.h) against
// adding it to the loss by hand, at the engine's loss factor.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>

#include "torchspeed/config/config.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/models/moe.h"
#include "torchspeed/nn/aux_loss.h"
#include "torchspeed/base/error.h"

using namespace torchspeed::models;
namespace nn = torchspeed::nn;

namespace {
MoEConfig moe(int64_t E, int64_t k) {
  MoEConfig c;
  c.num_experts = E;
  c.k = k;
  c.d_ff = 12;
  return c;
}

// Logits that make token s prefer expert first[s], then second[s].
at::Tensor logits_for(const std::vector<int64_t>& first, const std::vector<int64_t>& second, int64_t E) {
  at::Tensor l = at::zeros({static_cast<int64_t>(first.size()), E});
  for (size_t s = 0; s < first.size(); ++s) {
    l[static_cast<int64_t>(s)][first[s]] = 3.0;
    l[static_cast<int64_t>(s)][second[s]] = 2.0;
  }
  return l;
}
}  // namespace

TEST(MoE, Top1CapacityKeepsTheFirstTokensOfEachExpert) {
  MoEConfig c = moe(2, 1);
  c.capacity_factor = 1.0;  // capacity ceil(1 * 6 / 2 * 1) = 3
  c.min_capacity = 0;
  c.norm_topk_prob = false;  // DeepSpeed's top-1: the weight is the probability
  // Five tokens want expert 0, one wants expert 1.
  const at::Tensor l = logits_for({0, 0, 1, 0, 0, 0}, {1, 1, 0, 1, 1, 1}, 2);
  const Routing r = route(l, c, /*training=*/true);
  const at::Tensor p = l.softmax(-1);
  for (int64_t s = 0; s < 6; ++s) {
    const int64_t e = r.experts[s][0].item<int64_t>();
    EXPECT_EQ(e, s == 2 ? 1 : 0);
    // Expert 0's tokens 0, 1, 3 fit; 4 and 5 are past its capacity.
    const float want = (s == 4 || s == 5) ? 0.0f : p[s][e].item<float>();
    EXPECT_FLOAT_EQ(r.weights[s][0].item<float>(), want) << "token " << s;
  }
  // Evaluation uses eval_capacity_factor: 2 -> capacity 6, nothing dropped.
  c.eval_capacity_factor = 2.0;
  const Routing ev = route(l, c, /*training=*/false);
  EXPECT_GT(ev.weights[5][0].item<float>(), 0.0f);
  // Dropless: nothing dropped whatever the capacity factor.
  c.drop_tokens = false;
  EXPECT_GT(route(l, c, true).weights[5][0].item<float>(), 0.0f);
}

TEST(MoE, Top2SecondChoicesQueueAfterAllFirstChoicesAndRenormalise) {
  MoEConfig c = moe(3, 2);
  c.capacity_factor = 0.5;  // capacity ceil(2 * 4 / 3 * 0.5) = 2
  c.min_capacity = 0;
  // Firsts: 0, 0, 1, 2; seconds: 1, 2, 0, 0. Expert 0 holds tokens 0, 1 (firsts); the seconds of
  // tokens 2 and 3 come after them and are dropped. Expert 1: token 2 (first), token 0 (second).
  // Expert 2: token 3 (first), token 1 (second).
  const at::Tensor l = logits_for({0, 0, 1, 2}, {1, 2, 0, 0}, 3);
  const Routing r = route(l, c, true);
  auto w = [&](int64_t s, int64_t j) { return r.weights[s][j].item<float>(); };
  EXPECT_FLOAT_EQ(w(0, 0) + w(0, 1), 1.0f);
  EXPECT_GT(w(0, 1), 0.0f);
  EXPECT_GT(w(1, 1), 0.0f);
  // Tokens 2 and 3 lost their second expert: the first takes weight 1 (DeepSpeed's renormalisation
  // after dropping).
  EXPECT_FLOAT_EQ(w(2, 0), 1.0f);
  EXPECT_FLOAT_EQ(w(2, 1), 0.0f);
  EXPECT_FLOAT_EQ(w(3, 0), 1.0f);
  EXPECT_FLOAT_EQ(w(3, 1), 0.0f);
  // The weights of a kept pair are its probabilities over their sum.
  const at::Tensor p = l.softmax(-1);
  const float p0 = p[0][0].item<float>(), p1 = p[0][1].item<float>();
  EXPECT_NEAR(w(0, 0), p0 / (p0 + p1), 1e-6);
}

TEST(MoE, LoadBalancingLossIsDeepSpeedsFormula) {
  torch::manual_seed(3);
  for (int64_t k : {1, 2, 3}) {
    const MoEConfig c = moe(4, k);
    const at::Tensor l = torch::randn({10, 4});
    const Routing r = route(l, c, true);
    const at::Tensor p = l.softmax(-1);
    const at::Tensor top = std::get<1>(p.topk(k, -1));
    double want = 0;
    for (int64_t e = 0; e < 4; ++e) {
      const double me = p.select(1, e).mean().item<double>();
      double ce = 0;
      for (int64_t s = 0; s < 10; ++s) {
        for (int64_t j = 0; j < (k <= 2 ? 1 : k); ++j) ce += top[s][j].item<int64_t>() == e ? 1.0 : 0.0;
      }
      want += me * ce / 10.0;
    }
    want *= 4.0 / (k <= 2 ? 1.0 : static_cast<double>(k));
    EXPECT_NEAR(r.aux.item<double>(), want, 1e-6) << "k " << k;
  }
}

TEST(MoE, LayerEqualsEachTokensExpertsWrittenOut) {
  torch::manual_seed(5);
  MoEConfig c = moe(4, 2);
  c.drop_tokens = false;
  c.shared_d_ff = 8;
  c.norm_topk_prob = false;
  MoE layer(c, 16, 0.02);
  layer->eval();
  const at::Tensor x = torch::randn({2, 5, 16});
  const at::Tensor y = layer(x);
  // Written out: softmax, the two best experts, each a SwiGLU MLP, plus the gated shared expert.
  const at::Tensor xf = x.reshape({-1, 16});
  auto swiglu_mlp = [](const at::Tensor& v, const at::Tensor& up, const at::Tensor& down) {
    const at::Tensor h = at::matmul(up, v);
    const int64_t f = h.size(0) / 2;
    return at::matmul(down, at::silu(h.narrow(0, 0, f)) * h.narrow(0, f, f));
  };
  for (int64_t s = 0; s < xf.size(0); ++s) {
    const at::Tensor v = xf[s];
    const at::Tensor p = at::matmul(layer->router, v).softmax(0);
    const auto top = p.topk(2);
    at::Tensor want = at::zeros({16});
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t e = std::get<1>(top)[j].item<int64_t>();
      want += std::get<0>(top)[j] * swiglu_mlp(v, layer->gate_up[e], layer->down[e]);
    }
    want += at::sigmoid(at::matmul(layer->shared_gate, v)) * swiglu_mlp(v, layer->shared_fc, layer->shared_proj);
    EXPECT_TRUE(at::allclose(y.reshape({-1, 16})[s], want, 1e-5, 1e-6)) << "token " << s;
  }
}

TEST(MoE, AttachedAuxLossGivesTheGradientOfAddingItToTheLoss) {
  MoEConfig c = moe(4, 2);
  c.aux_loss_coef = 0.5;  // large, so its share of the router's gradient is visible
  const at::Tensor x = torch::randn({3, 7, 16});
  const at::Tensor target = torch::randn({3, 7, 16});
  for (double factor : {1.0, 8.0 / 3.0}) {
    // Written out: (loss + coef * aux) * factor, backward.
    torch::manual_seed(9);
    MoE a(c, 16, 0.02);
    nn::AuxLoss::collect(true);
    at::Tensor loss = (a(x) - target).pow(2).mean();
    const auto collected = nn::AuxLoss::take_collected();
    nn::AuxLoss::collect(false);
    ASSERT_EQ(collected.size(), 1u);
    ((loss + collected[0]) * factor).backward();
    // Attached: loss * factor, backward, with the engine's factor set.
    torch::manual_seed(9);
    MoE b(c, 16, 0.02);
    nn::AuxLoss::set_backward_scale(factor);
    ((b(x) - target).pow(2).mean() * factor).backward();
    nn::AuxLoss::set_backward_scale(1.0);
    for (const char* n : {"router", "gate_up", "down"}) {
      const at::Tensor ga = a->named_parameters()[n].grad(), gb = b->named_parameters()[n].grad();
      ASSERT_TRUE(ga.defined() && gb.defined()) << n;
      EXPECT_TRUE(at::allclose(ga, gb, 1e-5, 1e-7)) << n << " factor " << factor;
    }
    // The aux loss moves the router's gradient (the test would pass vacuously otherwise).
    torch::manual_seed(9);
    MoE plain(c, 16, 0.02);
    nn::AuxLoss::collect(true);
    ((plain(x) - target).pow(2).mean() * factor).backward();
    nn::AuxLoss::take_collected();
    nn::AuxLoss::collect(false);
    EXPECT_FALSE(at::allclose(plain->router.grad(), b->router.grad(), 1e-5, 1e-7));
  }
}

TEST(MoE, ExpertsNoTokenReachedGetZeroGradients) {
  torch::manual_seed(2);
  MoEConfig c = moe(4, 1);
  c.aux_loss_coef = 0;
  MoE layer(c, 16, 0.02);
  {
    torch::NoGradGuard g;
    layer->router.zero_();
    layer->router[1].fill_(1.0);  // every token with positive features picks expert 1
  }
  const at::Tensor x = torch::rand({1, 6, 16}) + 0.1;
  layer(x).sum().backward();
  for (int64_t e = 0; e < 4; ++e) {
    const at::Tensor g = layer->gate_up.grad()[e];
    if (e == 1) {
      EXPECT_GT(g.abs().sum().item<double>(), 0.0);
    } else {
      EXPECT_EQ(g.abs().sum().item<double>(), 0.0) << "expert " << e;
    }
  }
}

TEST(MoE, ConfigReadsDeepSpeedsKeysAndRefusesWhatItDoesNotCompute) {
  nlohmann::json m = {{"activation", "swiglu"}, {"mlp_bias", false}, {"d_model", 32}, {"n_head", 4},
                      {"moe", {{"num_experts", 8}, {"k", 2}, {"capacity_factor", 1.25}, {"min_capacity", 2}}}};
  const GPTConfig c = GPTConfig::from_json(m);
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.experts().d_ff, 128);  // the model's d_ff (4 d_model)
  EXPECT_EQ(GPTConfig::from_json(c.to_json()).to_json(), c.to_json());
  // Parameters: router + 8 experts of 3 * d_ff * d; FLOPs count the 2 a token uses.
  const int64_t moe_params = 8 * 32 + 8 * 3 * 128 * 32;
  EXPECT_EQ(c.num_params() - c.active_params(), c.n_layer * (moe_params - (8 * 32 + 2 * 3 * 128 * 32)));
  auto error_of = [&](const nlohmann::json& j) {
    try {
      GPTConfig::from_json(j);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  for (const auto& [key, value, needle] :
       std::vector<std::tuple<std::string, nlohmann::json, std::string>>{{"use_rts", true, "model.moe.use_rts"},
                                                                        {"noisy_gate_policy", "Jitter", "model.moe.noisy_gate_policy"},
                                                                        {"ep_size", 3, "model.moe.ep_size"},  // 8 experts
                                                                        {"k", 9, "model.moe.k"},
                                                                        {"use_residual", true, "model.moe.use_residual"}}) {
    nlohmann::json bad = m;
    bad["moe"][key] = value;
    EXPECT_NE(error_of(bad).find(needle), std::string::npos) << key << ": " << error_of(bad);
  }
  // Expert parallelism is how a run lays the model out: read, and left out of the model's JSON.
  nlohmann::json ep = m;
  ep["moe"]["ep_size"] = 4;
  const GPTConfig with_ep = GPTConfig::from_json(ep);
  EXPECT_EQ(with_ep.moe.ep_size, 4);
  EXPECT_EQ(with_ep.to_json(), c.to_json());
  nlohmann::json gelu = m;
  gelu["activation"] = "gelu";
  EXPECT_NE(error_of(gelu).find("swiglu"), std::string::npos);
}
