// Activation checkpointing (nn/checkpoint.h): the replayed backward equals the plain one, also
// with dropout (the RNG state is replayed); the graph owns its segment, so a segment that dies
// before backward is still replayed; interval_segments cuts a stack as DeepSpeed's interval.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "torchspeed/nn/checkpoint.h"
#include "torchspeed/nn/tiled.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

namespace ts = torchspeed;

namespace {

struct Net {
  torch::nn::Linear a{8, 16}, b{16, 8};
  torch::nn::Dropout drop{0.5};
  at::Tensor operator()(const at::Tensor& x) { return b(drop(torch::gelu(a(x)))); }
  std::vector<at::Tensor> grads() const { return {a->weight.grad().clone(), a->bias.grad().clone(), b->weight.grad().clone()}; }
  void zero_grad() {
    for (auto* p : {&a->weight, &a->bias, &b->weight, &b->bias}) p->mutable_grad() = at::Tensor();
  }
};

}  // namespace

TEST(ActivationCheckpoint, ReplayedBackwardEqualsThePlainOneWithDropout) {
  torch::manual_seed(3);
  Net net;
  at::Tensor x = torch::randn({4, 8}).requires_grad_(true);
  torch::manual_seed(11);
  (net(x) * 1.5).sum().backward();
  const auto plain = net.grads();
  const at::Tensor plain_x = x.grad().clone();
  net.zero_grad();
  x.mutable_grad() = at::Tensor();
  torch::manual_seed(11);
  const ts::nn::Segment seg = [&net](const at::Tensor& in) { return net(in); };
  at::Tensor y = ts::nn::checkpoint(seg, x);
  torch::manual_seed(999);  // backward must replay forward's RNG stream, not the current one
  (y * 1.5).sum().backward();
  const auto replayed = net.grads();
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(plain[i].equal(replayed[i])) << "parameter " << i;
  EXPECT_TRUE(plain_x.equal(x.grad()));
}

TEST(ActivationCheckpoint, TheGraphOwnsItsSegment) {
  torch::manual_seed(5);
  auto net = std::make_shared<Net>();
  at::Tensor x = torch::randn({4, 8});
  net->drop->eval();
  (*net)(x).pow(2).sum().backward();
  const auto plain = net->grads();
  net->zero_grad();
  at::Tensor y;
  {
    // The segment and the only other reference to what it captures die before backward.
    std::shared_ptr<Net> owned = net;
    ts::nn::Segment seg = [owned](const at::Tensor& in) { return (*owned)(in); };
    y = ts::nn::checkpoint(seg, x);
  }
  std::weak_ptr<Net> alive = net;
  const Net* raw = net.get();
  net.reset();
  ASSERT_FALSE(alive.expired()) << "the graph keeps the segment (and what it captured) alive";
  y.pow(2).sum().backward();
  const auto replayed = raw->grads();
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(plain[i].equal(replayed[i])) << "parameter " << i;
  y = at::Tensor();  // frees the graph, and with it the segment
  EXPECT_TRUE(alive.expired());
}

TEST(ActivationCheckpoint, IntervalSegmentsCoverTheStackInOrder) {
  std::vector<std::pair<size_t, size_t>> ran;
  const auto segments = ts::nn::interval_segments(5, 2, [&](const at::Tensor& x, size_t b, size_t e) {
    ran.emplace_back(b, e);
    return x;
  });
  ASSERT_EQ(segments.size(), 3u);
  for (const auto& s : segments) s(at::zeros({1}));
  EXPECT_EQ(ran, (std::vector<std::pair<size_t, size_t>>{{0, 2}, {2, 4}, {4, 5}}));
  EXPECT_EQ(ts::nn::interval_segments(3, 4, [](const at::Tensor& x, size_t, size_t) { return x; }).size(), 1u);
}

// ALST's tiling (nn/tiled.h): an MLP over 3 uneven slices of a 10-token sequence, and a summed
// loss over 4, give the untiled gradients of the input and every parameter; each parameter's
// gradient arrives once per backward (its AccumulateGrad runs once: ZeRO's hooks count on it);
// a frozen parameter gets none; without autograd the result is fn(x) itself.
TEST(Tiled, SlicesGiveTheWholeGradientsOnceEach) {
  torch::manual_seed(3);
  torch::nn::Linear fc(8, 16), proj(16, 8);
  auto mlp = [&](const at::Tensor& x, int64_t, int64_t) { return proj(at::gelu(fc(x))); };
  const at::Tensor x0 = at::randn({2, 10, 8});
  std::vector<at::Tensor> params = fc->parameters();
  for (const auto& p : proj->parameters()) params.push_back(p);
  std::vector<int> fired(params.size(), 0);
  std::vector<decltype(torch::autograd::impl::grad_accumulator(params[0]))> accumulators;  // held, as ZeRO holds them
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    accumulators.push_back(acc);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [&fired, i](const torch::autograd::variable_list& out, const torch::autograd::variable_list&) {
          ++fired[i];
          return out;
        }));
  }
  const at::Tensor w = at::randn({2, 10, 8});
  auto run = [&](int64_t tiles) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    at::Tensor x = x0.clone().requires_grad_(true);
    at::Tensor y = tiles > 1 ? torchspeed::nn::tiled(mlp, x, params, tiles, torchspeed::nn::TileCombine::kConcat) : mlp(x, 0, 10);
    (y * w).sum().backward();
    std::vector<at::Tensor> g{x.grad().clone()};
    for (auto& p : params) g.push_back(p.grad().clone());
    return std::make_pair(y.detach(), g);
  };
  const auto [y1, g1] = run(1);
  std::fill(fired.begin(), fired.end(), 0);
  const auto [y3, g3] = run(3);
  EXPECT_TRUE(at::allclose(y1, y3, 1e-6, 1e-6));
  for (size_t i = 0; i < g1.size(); ++i) EXPECT_TRUE(at::allclose(g1[i], g3[i], 1e-5, 1e-6)) << "gradient " << i;
  for (size_t i = 0; i < fired.size(); ++i) EXPECT_EQ(fired[i], 1) << "parameter " << i << "'s gradient arrived " << fired[i] << " times";

  // A summed loss over 4 slices (3, 3, 3, 1 tokens) equals the whole sum.
  const at::Tensor target = at::randint(0, 8, {2, 10}, at::kLong);
  auto loss = [&](const at::Tensor& x, int64_t start, int64_t length) {
    return torch::nn::functional::cross_entropy(mlp(x, 0, 0).reshape({-1, 8}), target.narrow(1, start, length).reshape({-1}),
                                                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  };
  at::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  loss(xa, 0, 10).backward();
  std::vector<at::Tensor> whole;
  for (auto& p : params) whole.push_back(p.grad().clone()), p.mutable_grad() = at::Tensor();
  at::Tensor tl = torchspeed::nn::tiled(loss, xb, params, 4, torchspeed::nn::TileCombine::kSum);
  EXPECT_NEAR(tl.item<double>(), loss(x0, 0, 10).item<double>(), 1e-4);
  tl.backward();
  EXPECT_TRUE(at::allclose(xa.grad(), xb.grad(), 1e-5, 1e-6));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::allclose(whole[i], params[i].grad(), 1e-5, 1e-6)) << i;

  // Frozen: no gradient; no autograd: fn(x) itself.
  fc->weight.requires_grad_(false);
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  at::Tensor x = x0.clone().requires_grad_(true);
  torchspeed::nn::tiled(mlp, x, params, 3, torchspeed::nn::TileCombine::kConcat).sum().backward();
  EXPECT_FALSE(fc->weight.grad().defined());
  EXPECT_TRUE(proj->weight.grad().defined());
  {
    torch::NoGradGuard g;
    EXPECT_TRUE(at::equal(torchspeed::nn::tiled(mlp, x0, params, 3, torchspeed::nn::TileCombine::kConcat), mlp(x0, 0, 10)));
  }
}
