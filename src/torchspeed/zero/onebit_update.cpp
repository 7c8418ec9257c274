// 1-bit Adam past its warm-up (DeepSpeed's OnebitAdam, stage 0 only): backward left each rank's
// own gradient (no reduction), the momentum is updated from it and replaced by its 1-bit average
// over the data-parallel group (comm/compressed.h), then the parameters step with the variance
// frozen at the end of the warm-up. Every rank ends with the same momentum and parameters.
#include <ATen/ATen.h>

#include "torchspeed/runtime/error.h"
#include "torchspeed/zero/detail/units.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero {

void ZeroOptimizer::onebit_update(float grad_scale, double lr) {
  const size_t km = has_master_ ? 1 : 0;  // exp_avg in kinds_
  at::Tensor momentum = store_->resident(km);
  TS_INTERNAL_ASSERT(momentum.defined(), "1-bit Adam needs its momentum in memory");
  const double base_lr = opt_.adam.lr;
  // Local momentum.
  size_t cached = SIZE_MAX;
  at::Tensor grad;
  store_->visit(
      [&](size_t i, float* const* state) {
        const detail::Piece& s = pieces_[i];
        if (cached != s.unit) {
          grad = update_grad(*units_[s.unit]);
          cached = s.unit;
        }
        ++timings_.optimizer_sub_groups;
        const auto* g = static_cast<const char*>(grad.data_ptr()) + s.begin * static_cast<int64_t>(grad.element_size());
        optim::onebit_momentum(g, grad.scalar_type(), grad_scale, state[km], s.length, opt_.adam.beta1);
      },
      /*read=*/true, /*write=*/true);
  grad = at::Tensor();
  // Its average, one bit per element (Note [1-bit all-reduce]).
  if (dp_size_ > 1) {
    if (!onebit_) onebit_ = std::make_unique<comm::OneBitAllReduce>(dp_, momentum.numel());
    onebit_->run(momentum);
  }
  // The update with the frozen variance.
  const optim::ParamOut out_kind = param_out(/*master_is_param=*/!has_master_);
  cached = SIZE_MAX;
  at::Tensor dest;
  store_->visit(
      [&](size_t i, float* const* state) {
        const detail::Piece& s = pieces_[i];
        if (cached != s.unit) {
          if (cached != SIZE_MAX) end_update(*units_[cached], dest);
          dest = begin_update(*units_[s.unit]);
          cached = s.unit;
        }
        const GroupHyper g = group_hyper(s.group, lr, base_lr, opt_.adam.weight_decay);
        const int64_t es = static_cast<int64_t>(dest.element_size());
        float* p = has_master_ ? state[0] : dest.data_ptr<float>() + s.begin;
        void* out = has_master_ ? static_cast<char*>(dest.data_ptr()) + s.begin * es : nullptr;
        optim::onebit_apply(p, state[km], state[km + 1], s.length, g.lr, opt_.adam.eps, g.weight_decay, out, out_kind);
      },
      /*read=*/true, /*write=*/true);
  if (cached != SIZE_MAX) end_update(*units_[cached], dest);
}

}  // namespace torchspeed::zero
