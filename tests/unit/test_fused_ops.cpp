// The fused block operators (nn/fused_ops.h) against the composite ATen forms transformers
// writes, forward and every gradient: fp64 and fp32 to rounding, bf16 within its precision.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "torchspeed/nn/fused_ops.h"

using namespace torchspeed;

namespace {

at::Tensor rms_reference(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return w * (xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

at::Tensor rope_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {  // x [B, H, T, hd]
  const int64_t T = x.size(2), half = x.size(3) / 2;
  const at::Tensor c = cos.narrow(0, 0, T).to(x.scalar_type()), s = sin.narrow(0, 0, T).to(x.scalar_type());
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs().max() / b.to(at::kDouble).abs().max().clamp_min(1e-30)).item<double>();
}

// Runs f on fresh leaves copied from `inputs`, returns the output and the inputs' gradients for
// the given output gradient.
template <typename F>
std::vector<at::Tensor> run(F f, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& dys) {
  std::vector<at::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
  std::vector<at::Tensor> outs = f(leaves);
  std::vector<at::Tensor> detached;
  for (const auto& o : outs) detached.push_back(o.detach());
  torch::autograd::backward(outs, dys);
  for (const auto& l : leaves) detached.push_back(l.grad());
  return detached;
}

class FusedOps : public ::testing::TestWithParam<at::ScalarType> {};

double tolerance(at::ScalarType t) { return t == at::kDouble ? 1e-12 : t == at::kFloat ? 2e-6 : 2e-2; }

TEST_P(FusedOps, RmsNormMatchesTheCompositeForm) {
  const auto dt = GetParam();
  torch::manual_seed(1);
  for (int64_t rows : {1, 7, 130}) {  // one row, fewer than a chunk, several 64-row chunks
    const at::Tensor x = at::randn({rows, 3, 37}).to(dt), w = (1 + 0.1 * at::randn({37})).to(dt);
    const at::Tensor dy = at::randn({rows, 3, 37}).to(dt);
    auto fused = run([](auto& l) { return std::vector<at::Tensor>{nn::rms_norm(l[0], l[1], 1e-5)}; }, {x, w}, {dy});
    auto ref = run([](auto& l) { return std::vector<at::Tensor>{rms_reference(l[0], l[1], 1e-5)}; }, {x, w}, {dy});
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_EQ(fused[i].scalar_type(), ref[i].scalar_type());
      // transformers' RMSNorm computes in fp32 whatever the input (ours in fp64 for fp64 inputs).
      EXPECT_LT(max_rel(fused[i], ref[i]), tolerance(dt == at::kDouble ? at::kFloat : dt)) << "rows " << rows << " tensor " << i;
    }
  }
}

TEST_P(FusedOps, SwigluMatchesTheCompositeForm) {
  const auto dt = GetParam();
  torch::manual_seed(2);
  const at::Tensor f = at::randn({5, 9, 2 * 24}).to(dt), dy = at::randn({5, 9, 24}).to(dt);
  auto fused = run([](auto& l) { return std::vector<at::Tensor>{nn::swiglu(l[0])}; }, {f}, {dy});
  auto ref = run([](auto& l) { return std::vector<at::Tensor>{at::silu(l[0].narrow(-1, 0, 24)) * l[0].narrow(-1, 24, 24)}; },
                 {f}, {dy});
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_LT(max_rel(fused[i], ref[i]), tolerance(dt)) << "tensor " << i;
}

TEST_P(FusedOps, SplitQkvRopeMatchesNarrowRotateAndRepeat) {
  const auto dt = GetParam();
  torch::manual_seed(3);
  const int64_t B = 2, T = 11, hd = 8;
  const at::Tensor freqs = at::outer(at::arange(16, at::kFloat), 1.0 / at::pow(10000.0, at::arange(0, hd, 2).to(at::kFloat) / hd));
  const at::Tensor cos = freqs.cos(), sin = freqs.sin();
  for (auto [H, KV, rope] : std::vector<std::tuple<int64_t, int64_t, bool>>{{6, 2, true}, {4, 4, true}, {6, 1, false}, {3, 3, false}}) {
    const at::Tensor qkv = at::randn({B, T, (H + 2 * KV) * hd}).to(dt);
    std::vector<at::Tensor> dys;  // contiguous, and strided as SDPA's gradients come
    dys.push_back(at::randn({B, H, T, hd}).to(dt));
    dys.push_back(at::randn({B, T, H, hd}).to(dt).transpose(1, 2));
    dys.push_back(at::randn({B, H, hd, T}).to(dt).transpose(2, 3));
    const at::Tensor c = rope ? cos : at::Tensor(), s = rope ? sin : at::Tensor();
    auto fused = run(
        [&](auto& l) {
          auto o = nn::split_qkv_rope(l[0], H, KV, hd, c, s);
          return std::vector<at::Tensor>{o[0], o[1], o[2]};
        },
        {qkv}, dys);
    auto ref = run(
        [&](auto& l) {
          at::Tensor q = l[0].narrow(-1, 0, H * hd).view({B, T, H, hd}).transpose(1, 2);
          at::Tensor k = l[0].narrow(-1, H * hd, KV * hd).view({B, T, KV, hd}).transpose(1, 2);
          at::Tensor v = l[0].narrow(-1, (H + KV) * hd, KV * hd).view({B, T, KV, hd}).transpose(1, 2);
          if (rope) q = rope_reference(q, cos, sin), k = rope_reference(k, cos, sin);
          return std::vector<at::Tensor>{q, k.repeat_interleave(H / KV, 1), v.repeat_interleave(H / KV, 1)};
        },
        {qkv}, dys);
    for (size_t i = 0; i < fused.size(); ++i) {
      EXPECT_TRUE(fused[i].is_contiguous() || i == 3);
      EXPECT_LT(max_rel(fused[i], ref[i]), tolerance(dt)) << "H " << H << " KV " << KV << " tensor " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedOps, ::testing::Values(at::kDouble, at::kFloat, at::kBFloat16),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(FusedOpsErrors, ShapesAreChecked) {
  EXPECT_THROW(nn::rms_norm(at::randn({2, 4}), at::ones({5}), 1e-5), std::exception);
  EXPECT_THROW(nn::swiglu(at::randn({2, 5})), std::exception);
  EXPECT_THROW(nn::split_qkv_rope(at::randn({1, 2, 30}), 2, 1, 8, at::Tensor(), at::Tensor()), std::exception);
  EXPECT_THROW(nn::split_qkv_rope(at::randn({1, 20, 32}), 2, 1, 8, at::randn({16, 4}), at::randn({16, 4})), std::exception);
}

}  // namespace
