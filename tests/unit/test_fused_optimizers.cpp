// Fused optimizer kernels against LibTorch's own optimizers, step for step, within the rounding
// two float paths may differ by.
#include <gtest/gtest.h>

#include <limits>

#include <torch/torch.h>

#include "torchspeed/optim/fused_optimizers.h"

using namespace torchspeed::optim;

namespace {
constexpr int64_t kN = 40007;  // not a multiple of any vector width
double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max()).item<double>();
}
// Each step rounds a parameter twice (decay or the gradient's weight-decay term, then the
// update), and our kernel may contract a multiply-add that LibTorch's kernel rounds twice (or
// the other way round, by the CPU's vector width): up to two float ulps of the largest
// parameter apart per step, accumulated. A step that is wrong is off by far more: a missing
// bias correction or weight decay is 1e-3 here. (At 1e-6 flat, CI's CPU failed at step 10 with
// 1.08e-6, this one passed with 5.7e-7 worst over 100 seeds.)
double rounding_bound(int step) { return 2.0 * step * std::numeric_limits<float>::epsilon(); }
}  // namespace

TEST(FusedOptimizers, AdamWAndAdamMatchLibTorch) {
  torch::manual_seed(0);
  for (bool adam_w : {true, false}) {
    at::Tensor ref = torch::randn({kN}).set_requires_grad(true);
    at::Tensor p = ref.detach().clone(), m = at::zeros({kN}), v = at::zeros({kN});
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (adam_w) opt = std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{ref}, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
    else opt = std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{ref}, torch::optim::AdamOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
    AdamHyper h;
    h.lr = 1e-2; h.beta1 = 0.9; h.beta2 = 0.95; h.eps = 1e-8; h.weight_decay = 0.1; h.adam_w_mode = adam_w;
    for (int step = 1; step <= 10; ++step) {
      at::Tensor g = torch::randn({kN});
      ref.mutable_grad() = g.clone();
      opt->step();
      h.step = step;
      // Pass the gradient pre-multiplied by 4 with grad_scale 1/4: the kernel's unscaling.
      at::Tensor g4 = g * 4;
      adam_step(p.data_ptr<float>(), g4.data_ptr(), at::kFloat, 0.25f, m.data_ptr<float>(), v.data_ptr<float>(), kN, h, nullptr, ParamOut::kNone);
      ASSERT_LE(max_rel(p, ref.detach()), rounding_bound(step)) << (adam_w ? "AdamW" : "Adam") << " step " << step;
    }
  }
}

TEST(FusedOptimizers, BF16GradientsAndParameterCopies) {
  at::Tensor p = torch::randn({kN}), m = at::zeros({kN}), v = at::zeros({kN});
  at::Tensor expect_p = p.clone(), em = m.clone(), ev = v.clone();
  at::Tensor g = torch::randn({kN}).to(at::kBFloat16);
  at::Tensor out = at::empty({kN}, at::kBFloat16), out16 = at::empty({kN});
  AdamHyper h;
  adam_step(expect_p.data_ptr<float>(), g.to(at::kFloat).data_ptr(), at::kFloat, 1.0f, em.data_ptr<float>(), ev.data_ptr<float>(), kN, h, nullptr, ParamOut::kNone);
  adam_step(p.data_ptr<float>(), g.data_ptr(), at::kBFloat16, 1.0f, m.data_ptr<float>(), v.data_ptr<float>(), kN, h, out.data_ptr(), ParamOut::kBF16);
  EXPECT_LE(max_rel(p, expect_p), 1e-6);                // a bf16 gradient reads as its exact value
  EXPECT_TRUE(at::equal(out, p.to(at::kBFloat16)));     // the copy rounds exactly as c10 does
  write_params(p.data_ptr<float>(), kN, out16.data_ptr(), ParamOut::kFP16Values);
  EXPECT_TRUE(at::equal(out16, p.to(at::kHalf).to(at::kFloat)));
}

TEST(FusedOptimizers, SgdMomentumAndNesterovMatchLibTorch) {
  torch::manual_seed(0);
  for (bool nesterov : {false, true}) {
    at::Tensor ref = torch::randn({kN}).set_requires_grad(true);
    at::Tensor p = ref.detach().clone(), buf = at::zeros({kN});
    torch::optim::SGD opt({ref}, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01).nesterov(nesterov));
    SgdHyper h;
    h.lr = 0.1; h.momentum = 0.9; h.weight_decay = 0.01; h.nesterov = nesterov;
    for (int step = 1; step <= 5; ++step) {
      at::Tensor g = torch::randn({kN});
      ref.mutable_grad() = g.clone();
      opt.step();
      h.first_step = step == 1;
      sgd_step(p.data_ptr<float>(), g.data_ptr(), at::kFloat, 1.0f, buf.data_ptr<float>(), kN, h, nullptr, ParamOut::kNone);
      ASSERT_LE(max_rel(p, ref.detach()), 1e-6) << "nesterov " << nesterov << " step " << step;
    }
  }
}

TEST(FusedOptimizers, SumOfSquaresDetectsOverflow) {
  at::Tensor g = torch::randn({kN});
  EXPECT_NEAR(sum_squares(g.data_ptr(), at::kFloat, kN), g.to(at::kDouble).pow(2).sum().item<double>(), 1e-9 * kN);
  g[123] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(sum_squares(g.data_ptr(), at::kFloat, kN)));
  g[123] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(std::isfinite(sum_squares(g.data_ptr(), at::kFloat, kN)));
  at::Tensor b = torch::randn({kN}).to(at::kBFloat16);
  EXPECT_NEAR(sum_squares(b.data_ptr(), at::kBFloat16, kN), b.to(at::kDouble).pow(2).sum().item<double>(), 1e-9 * kN);
}
