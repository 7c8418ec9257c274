// The elementwise optimizers over a partition (Adam, AdamW, SGD: one fused pass) and the choice
// of implementation (Note [Strategy x optimizer] in partition_optimizer.h).
#include "torchspeed/optim/partition_optimizer.h"

#include "torchspeed/optim/detail/optimizers.h"
#include "torchspeed/base/error.h"

namespace torchspeed::optim {

GroupHyper group_hyper(const OptimizerSpec& spec, int group, double lr, double base_lr, double weight_decay) {
  const ParamGroupOptions* g = group > 0 ? &spec.groups.at(static_cast<size_t>(group - 1)) : nullptr;
  return {g && g->lr && base_lr > 0.0 ? lr * (*g->lr / base_lr) : lr, g && g->weight_decay ? *g->weight_decay : weight_decay};
}

void elementwise_step(const OptimizerSpec& spec, PartitionView& view, int64_t t, float grad_scale, double lr,
                      std::optional<double> beta1) {
  const bool sgd = spec.type == OptimizerType::kSGD;
  const double base_lr = sgd ? spec.sgd.lr : spec.adam.lr;
  view.visit(/*with_grad=*/true, /*updates=*/true, [&](const PieceView& s) {
    if (sgd) {
      SgdHyper h = spec.sgd;
      const GroupHyper g = group_hyper(spec, s.group, lr, base_lr, h.weight_decay);
      h.lr = g.lr;
      h.weight_decay = g.weight_decay;
      h.first_step = t == 1;
      sgd_step(s.param, s.grad, s.grad_dtype, grad_scale, h.momentum != 0.0 ? s.state[0] : nullptr, s.length, h, s.out,
               s.out_kind);
    } else {
      AdamHyper h = spec.adam;
      const GroupHyper g = group_hyper(spec, s.group, lr, base_lr, h.weight_decay);
      h.lr = g.lr;
      h.weight_decay = g.weight_decay;
      if (beta1) h.beta1 = *beta1;
      h.step = t;
      adam_step(s.param, s.grad, s.grad_dtype, grad_scale, s.state[0], s.state[1], s.length, h, s.out, s.out_kind);
    }
  });
}

namespace {

// Adam, AdamW (adam.adam_w_mode picks the weight decay) and SGD.
class ElementwiseOptimizer final : public PartitionOptimizer {
 public:
  explicit ElementwiseOptimizer(OptimizerSpec spec) : PartitionOptimizer(std::move(spec)) {}
  std::vector<std::string> state_kinds() const override {
    if (spec_.type == OptimizerType::kSGD) return {"momentum"};
    return {"exp_avg", "exp_avg_sq"};
  }
  bool elementwise() const override { return true; }
  void step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double> beta1) override {
    elementwise_step(spec_, view, t, grad_scale, lr, beta1);
  }
};

}  // namespace

std::unique_ptr<PartitionOptimizer> make_partition_optimizer(OptimizerSpec spec, comm::CommunicatorPtr dp) {
  switch (spec.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
    case OptimizerType::kSGD: return std::make_unique<ElementwiseOptimizer>(std::move(spec));
    case OptimizerType::kLamb: return detail::make_lamb(std::move(spec), std::move(dp));
    case OptimizerType::kOneBitLamb: return detail::make_onebit_lamb(std::move(spec), std::move(dp));
    case OptimizerType::kOneBitAdam: return detail::make_onebit_adam(std::move(spec), std::move(dp));
    case OptimizerType::kZeroOneAdam: return detail::make_zero_one_adam(std::move(spec), std::move(dp));
    case OptimizerType::kNone: break;
  }
  TS_CHECK(false, "ZeroOptimizer needs an optimizer: Adam, AdamW, SGD, Lamb, OneBitAdam, ZeroOneAdam or OneBitLamb");
}

}  // namespace torchspeed::optim
