// OpTimeProfile: operator time lands in the right category, nesting is exclusive, and nothing is
// observed outside a scope.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "torchspeed/monitor/op_profile.h"

using torchspeed::monitor::OpTimeProfile;
using torchspeed::monitor::OpTimes;

TEST(OpProfile, GemmDominatesAMatmulAndElementwiseIsOther) {
  at::Tensor a = at::randn({256, 256}), b = at::randn({256, 256});
  OpTimes t;
  {
    OpTimeProfile::Scope scope(t);
    for (int i = 0; i < 20; ++i) (void)at::mm(a, b);
  }
  EXPECT_GT(t.ops, 0);
  EXPECT_GT(t.gemm_s, 0.0);
  EXPECT_GT(t.gemm_s, 5 * t.other_s) << "a loop of mm must be GEMM time";
  OpTimes e;
  {
    OpTimeProfile::Scope scope(e);
    for (int i = 0; i < 20; ++i) (void)(a.exp() + b);
  }
  EXPECT_EQ(e.gemm_s, 0.0);
  EXPECT_GT(e.other_s, 0.0);
}

TEST(OpProfile, BackwardGemmsAndLinearAreCounted) {
  auto lin = torch::nn::Linear(128, 512);
  at::Tensor x = at::randn({64, 128}, at::requires_grad());
  OpTimes t;
  {
    OpTimeProfile::Scope scope(t);
    lin(x).sum().backward();
  }
  // Forward addmm plus two backward mm's: the GEMMs, not their wrappers, hold the time.
  EXPECT_GT(t.gemm_s, 0.0);
  EXPECT_GT(t.other_s, 0.0);
}

TEST(OpProfile, NothingIsObservedOutsideAScope) {
  OpTimes t;
  { OpTimeProfile::Scope scope(t); }
  const int64_t ops = t.ops;
  (void)at::mm(at::randn({32, 32}), at::randn({32, 32}));
  EXPECT_EQ(t.ops, ops);
}

TEST(OpProfile, OneScopeAtATime) {
  OpTimes a, b;
  OpTimeProfile::Scope scope(a);
  EXPECT_THROW(OpTimeProfile::Scope second(b), std::exception);
}

#if TORCH_VERSION_MAJOR >= 2
TEST(OpProfile, AttentionIncludesItsOwnGemms) {
  at::Tensor q = at::randn({2, 4, 128, 32}), k = at::randn({2, 4, 128, 32}), v = at::randn({2, 4, 128, 32});
  OpTimes t;
  {
    OpTimeProfile::Scope scope(t);
    (void)at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
  }
  EXPECT_GT(t.attention_s, 0.0);
  EXPECT_EQ(t.gemm_s, 0.0) << "GEMMs run by attention count as attention";
}
#endif
