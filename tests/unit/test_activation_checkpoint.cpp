// Activation checkpointing (nn/checkpoint.h): the replayed backward equals the plain one, also
// with dropout (the RNG state is replayed); the graph owns its segment, so a segment that dies
// before backward is still replayed; interval_segments cuts a stack as DeepSpeed's interval.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "torchspeed/nn/checkpoint.h"

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
