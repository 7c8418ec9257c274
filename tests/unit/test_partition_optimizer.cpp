// The optimizers on their own, without ZeRO (Note [Strategy x optimizer] in
// optim/partition_optimizer.h): a PartitionView over plain tensors, cut into pieces wherever a
// test likes, against LibTorch's optimizers and a per-tensor Lamb written out in LibTorch ops.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <limits>

#include "torchspeed/optim/partition_optimizer.h"

using namespace torchspeed::optim;

namespace {

// One rank's partition: the parameter tensors laid end to end (fp32, updated in place: no
// separate masters), their gradients, the optimizer's state kinds; pieces cut at group changes
// and every `cut` elements.
class TensorView final : public PartitionView {
 public:
  TensorView(const std::vector<int64_t>& sizes, const std::vector<int>& groups, int64_t cut, size_t kinds) {
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    param = at::zeros({total});
    grad = at::zeros({total});
    for (size_t k = 0; k < kinds; ++k) state.push_back(at::zeros({total}));
    std::vector<int64_t> begin(sizes.size(), 0);
    for (size_t t = 1; t < sizes.size(); ++t) begin[t] = begin[t - 1] + sizes[t - 1];
    for (size_t t = 0; t < sizes.size(); ++t) {
      // A run of one group ends at the last tensor of that group in a row.
      const bool starts_run = t == 0 || groups[t] != groups[t - 1];
      if (!starts_run) continue;
      size_t last = t;
      while (last + 1 < sizes.size() && groups[last + 1] == groups[t]) ++last;
      const int64_t lo = begin[t], hi = begin[last] + sizes[last];
      for (int64_t a = lo; a < hi; a += cut) {
        Piece p{a, std::min(cut, hi - a), groups[t], {}};
        for (size_t s = t; s <= last; ++s) {
          const int64_t x = std::max(p.offset, begin[s]), y = std::min(p.offset + p.length, begin[s] + sizes[s]);
          if (x < y) p.tensors.push_back({s, x - p.offset, y - x});
        }
        pieces_.push_back(std::move(p));
      }
    }
    sizes_ = sizes;
    begin_ = begin;
  }
  at::Tensor tensor(const at::Tensor& flat, size_t t) const { return flat.narrow(0, begin_[t], sizes_[t]); }

  void visit(bool with_grad, bool, const std::function<void(const PieceView&)>& fn) override {
    std::vector<float*> ptrs(state.size());
    for (const Piece& p : pieces_) {
      PieceView s;
      s.offset = p.offset;
      s.length = p.length;
      s.group = p.group;
      if (with_grad) s.grad = grad.data_ptr<float>() + p.offset;
      s.param = param.data_ptr<float>() + p.offset;
      for (size_t k = 0; k < state.size(); ++k) ptrs[k] = state[k].data_ptr<float>() + p.offset;
      s.state = ptrs.data();
      s.tensors = &p.tensors;
      fn(s);
    }
  }
  int64_t numel() const override { return param.numel(); }
  size_t num_tensors() const override { return sizes_.size(); }
  at::Tensor resident_state(size_t kind) override { return state.at(kind); }
  void sum_tensor_stats(std::vector<double>&) override {}  // every tensor is whole here

  at::Tensor param, grad;
  std::vector<at::Tensor> state;

 private:
  struct Piece {
    int64_t offset, length;
    int group;
    std::vector<TensorRange> tensors;
  };
  std::vector<Piece> pieces_;
  std::vector<int64_t> sizes_, begin_;
};

double max_rel(const at::Tensor& a, const at::Tensor& b) { return ((a - b).abs().max() / b.abs().max()).item<double>(); }

}  // namespace

// AdamW through the view, pieces cut across tensors and a second parameter group with its own
// lr and weight decay, against torch::optim::AdamW with the same two groups.
TEST(PartitionOptimizer, AdamWOverPiecesMatchesLibTorchWithParameterGroups) {
  torch::manual_seed(1);
  const std::vector<int64_t> sizes{1000, 37, 500};
  const std::vector<int> groups{0, 0, 1};
  OptimizerSpec spec;
  spec.type = OptimizerType::kAdamW;
  spec.adam.lr = 1e-2;
  spec.adam.weight_decay = 0.1;
  spec.groups.push_back({5e-3, 0.0});  // group 1: half the lr, no decay
  auto opt = make_partition_optimizer(spec, nullptr);
  ASSERT_EQ(opt->state_kinds(), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  EXPECT_TRUE(opt->elementwise());
  TensorView view(sizes, groups, /*cut=*/97, opt->state_kinds().size());
  view.param.normal_();

  std::vector<at::Tensor> ref;
  for (size_t t = 0; t < sizes.size(); ++t) ref.push_back(view.tensor(view.param, t).clone().set_requires_grad(true));
  std::vector<torch::optim::OptimizerParamGroup> pg;
  pg.emplace_back(std::vector<at::Tensor>{ref[0], ref[1]},
                  std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
  pg.emplace_back(std::vector<at::Tensor>{ref[2]},
                  std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(5e-3).weight_decay(0.0)));
  torch::optim::AdamW torch_opt(std::move(pg));
  for (int step = 1; step <= 5; ++step) {
    view.grad.normal_();
    for (size_t t = 0; t < sizes.size(); ++t) ref[t].mutable_grad() = view.tensor(view.grad, t).clone();
    torch_opt.step();
    view.grad.mul_(8.0);  // the view's gradient is scaled; grad_scale undoes it
    opt->step(view, step, 0.125f, 1e-2, std::nullopt);
    for (size_t t = 0; t < sizes.size(); ++t)
      ASSERT_LE(max_rel(view.tensor(view.param, t), ref[t].detach()), 2.0 * step * std::numeric_limits<float>::epsilon())
          << "tensor " << t << " step " << step;
  }
}

// Lamb's trust ratio is per tensor whatever the pieces: cut every 7 elements it matches one piece
// per group, and both match DeepSpeed's FusedLamb written out per tensor.
TEST(PartitionOptimizer, LambIsPerTensorWhereverThePiecesAreCut) {
  torch::manual_seed(2);
  const std::vector<int64_t> sizes{300, 41, 128};
  const std::vector<int> groups{0, 0, 0};
  OptimizerSpec spec;
  spec.type = OptimizerType::kLamb;
  spec.lamb.lr = 1e-2;
  spec.lamb.weight_decay = 0.01;
  spec.lamb.max_coeff = 0.3;  // one tensor's ratio clamps
  auto fine = make_partition_optimizer(spec, nullptr), whole = make_partition_optimizer(spec, nullptr);
  EXPECT_FALSE(fine->elementwise());
  TensorView a(sizes, groups, 7, 2), b(sizes, groups, 1 << 20, 2);
  a.param.normal_();
  a.tensor(a.param, 1).mul_(10.0);
  b.param.copy_(a.param);
  std::vector<at::Tensor> p, m, v;
  for (size_t t = 0; t < sizes.size(); ++t) {
    p.push_back(a.tensor(a.param, t).to(at::kDouble));
    m.push_back(at::zeros({sizes[t]}, at::kDouble));
    v.push_back(at::zeros({sizes[t]}, at::kDouble));
  }
  const auto& h = spec.lamb;
  for (int step = 1; step <= 4; ++step) {
    a.grad.normal_();
    b.grad.copy_(a.grad);
    fine->step(a, step, 1.0f, h.lr, std::nullopt);
    whole->step(b, step, 1.0f, h.lr, std::nullopt);
    ASSERT_LE(max_rel(a.param, b.param), 1e-6) << "step " << step;
    for (size_t t = 0; t < sizes.size(); ++t) {
      const at::Tensor g = a.tensor(a.grad, t).to(at::kDouble);
      m[t] = h.beta1 * m[t] + (1 - h.beta1) * g;
      v[t] = h.beta2 * v[t] + (1 - h.beta2) * g * g;
      const at::Tensor u = m[t] / (v[t].sqrt() + h.eps) + h.weight_decay * p[t];
      const double wn = p[t].norm().item<double>(), un = u.norm().item<double>();
      const double coeff = wn > 0 && un > 0 ? std::clamp(wn / un, h.min_coeff, h.max_coeff) : 1.0;
      const double bias = std::sqrt(1 - std::pow(h.beta2, step)) / (1 - std::pow(h.beta1, step));
      p[t] = p[t] - h.lr * bias * coeff * u;
      ASSERT_LE(max_rel(a.tensor(a.param, t).to(at::kDouble), p[t]), 1e-5) << "tensor " << t << " step " << step;
    }
  }
}

// Which steps average gradients: 1-bit Adam until its freeze_step; 0/1 Adam on DeepSpeed's
// variance schedule (var_interval doubles every var_update_scaler variance steps) until
// var_freeze_step + 2, then never (local steps).
TEST(PartitionOptimizer, TheOneBitFamilyReducesOnDeepSpeedsSchedule) {
  OptimizerSpec spec;
  spec.adam.lr = 1e-3;
  spec.type = OptimizerType::kOneBitAdam;
  spec.freeze_step = 3;
  auto onebit = make_partition_optimizer(spec, nullptr);
  EXPECT_TRUE(onebit->needs_replicated_state());
  spec.type = OptimizerType::kZeroOneAdam;
  spec.zero_one.var_freeze_step = 12;
  spec.zero_one.var_update_scaler = 2;
  spec.zero_one.local_step_scaler = 1000;
  auto zero_one = make_partition_optimizer(spec, nullptr);
  TensorView v1({64}, {0}, 16, 2), v2({64}, {0}, 16, 2);
  v1.param.normal_();
  v2.param.normal_();
  std::vector<int> onebit_reduced, zero_one_reduced;
  for (int t = 1; t <= 16; ++t) {
    v1.grad.normal_();
    v2.grad.normal_();
    if (onebit->reduces_gradients(t)) onebit_reduced.push_back(t);
    if (zero_one->reduces_gradients(t)) zero_one_reduced.push_back(t);
    onebit->step(v1, t, 1.0f, 1e-3, std::nullopt);
    zero_one->step(v2, t, 1.0f, 1e-3, std::nullopt);
  }
  EXPECT_EQ(onebit_reduced, (std::vector<int>{1, 2, 3}));
  // Intervals 1, 1 | 2, 2 | 4, 4 | 8: steps 1, 2, 4, 6, 8, 12; from step 14 the local phase.
  EXPECT_EQ(zero_one_reduced, (std::vector<int>{1, 2, 4, 6, 8, 12}));
  EXPECT_TRUE(v1.param.isfinite().all().item<bool>());
  EXPECT_TRUE(v2.param.isfinite().all().item<bool>());
}

// 1-bit Lamb's per-tensor scalars go to a checkpoint by tensor name: a fresh optimizer that
// imports them (and the state) continues exactly as the one that kept running.
TEST(PartitionOptimizer, OneBitLambScalarsRoundTripByName) {
  torch::manual_seed(3);
  OptimizerSpec spec;
  spec.type = OptimizerType::kOneBitLamb;
  spec.lamb.lr = 1e-2;
  spec.lamb.bias_correction = false;
  spec.freeze_step = 3;
  auto first = make_partition_optimizer(spec, nullptr);
  ASSERT_EQ(first->state_kinds(), (std::vector<std::string>{"exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"}));
  const std::vector<int64_t> sizes{50, 30};
  const std::vector<std::string> names{"a.weight", "b.weight"};
  TensorView view(sizes, {0, 0}, 16, 3);
  view.param.normal_();
  EXPECT_TRUE(first->export_scalars(names).is_null());  // nothing before the first step
  for (int t = 1; t <= 5; ++t) {
    view.grad.normal_();
    first->step(view, t, 1.0f, 1e-2, std::nullopt);
  }
  const nlohmann::json scalars = first->export_scalars(names);
  ASSERT_TRUE(scalars.contains("onebit_lamb") && scalars["onebit_lamb"].contains("b.weight")) << scalars.dump();

  TensorView copy(sizes, {0, 0}, 16, 3);
  copy.param.copy_(view.param);
  for (size_t k = 0; k < 3; ++k) copy.state[k].copy_(view.state[k]);
  auto second = make_partition_optimizer(spec, nullptr);
  second->restart();
  second->import_scalars(scalars, names, 5);
  view.grad.normal_();
  copy.grad.copy_(view.grad);
  first->step(view, 6, 1.0f, 1e-2, std::nullopt);
  second->step(copy, 6, 1.0f, 1e-2, std::nullopt);
  EXPECT_TRUE(at::equal(view.param, copy.param));

  auto third = make_partition_optimizer(spec, nullptr);
  nlohmann::json missing = scalars;
  missing["onebit_lamb"].erase("b.weight");
  EXPECT_THROW(third->import_scalars(missing, names, 5), std::exception);
}
