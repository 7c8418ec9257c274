// Lamb over a ZeRO partition (DeepSpeed's FusedLamb semantics, optim/fused_optimizers.h): the
// trust ratio is per parameter tensor, and a tensor may be cut across this rank's pieces and
// across data-parallel ranks, so the update takes two passes over the store.
//
// Note [Lamb over partitions]
// Pass 1 updates the moments of every piece and adds each tensor range's sums of squares of the
// parameter and of the update u = m / (sqrt(v) + eps) + wd p into its tensor's slot. The slots are
// summed over the data-parallel group (sharded strategies; stage 0 ranks hold whole tensors), so
// every rank has each whole tensor's norms. Pass 2 recomputes u from the new moments and applies
// p -= step * coeff * u with the tensor's coefficient. DeepSpeed itself, under ZeRO, computes the
// ratio per flat partition (its optimizer sees one flat tensor); ours is the per-tensor Lamb a
// single process computes, at any data-parallel size and sub-group size.
#include <ATen/ATen.h>

#include <algorithm>

#include "torchspeed/zero/detail/units.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero {

using StepPiece = detail::Piece;
using detail::Unit;

void ZeroOptimizer::lamb_update(float grad_scale, double lr) {
  // Slot of each (unit, parameter): first[u] + its index in the unit.
  std::vector<size_t> first(units_.size() + 1, 0);
  for (size_t u = 0; u < units_.size(); ++u) first[u + 1] = first[u] + units_[u]->params.size();
  std::vector<double> sums(2 * first.back(), 0.0);
  const size_t km = has_master_ ? 1 : 0;  // index of exp_avg in kinds_
  const double base_lr = opt_.lamb.lr;
  auto hyper = [&](const StepPiece& s) {
    optim::LambHyper h = opt_.lamb;
    const GroupHyper g = group_hyper(s.group, lr, base_lr, h.weight_decay);
    h.lr = g.lr;
    h.weight_decay = g.weight_decay;
    h.step = step_count_;
    return h;
  };
  // fn(parameter index in the unit, offset in the piece, length) for each tensor range of a piece.
  auto for_each_tensor = [&](const StepPiece& s, auto&& fn) {
    const Unit& u = *units_[s.unit];
    const int64_t lo = u.update_begin + s.begin, hi = lo + s.length;
    for (size_t k = 0; k < u.params.size(); ++k) {
      const auto& p = u.params[k];
      const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
      if (a < b) fn(k, a - lo, b - a);
    }
  };

  // Pass 1: moments and norms.
  size_t cached = SIZE_MAX;
  at::Tensor grad, params;
  store_->visit(
      [&](size_t i, float* const* state) {
        const StepPiece& s = pieces_[i];
        Unit& u = *units_[s.unit];
        if (cached != s.unit) {
          grad = update_grad(u);
          if (!has_master_) params = update_dest(u);
          cached = s.unit;
        }
        ++timings_.optimizer_sub_groups;
        const optim::LambHyper h = hyper(s);
        const float* p = has_master_ ? state[0] : params.data_ptr<float>() + s.begin;
        const auto* g = static_cast<const char*>(grad.data_ptr()) + s.begin * static_cast<int64_t>(grad.element_size());
        for_each_tensor(s, [&](size_t k, int64_t off, int64_t n) {
          const optim::LambNorms r =
              optim::lamb_moments(p + off, g + off * static_cast<int64_t>(grad.element_size()), grad.scalar_type(),
                                  grad_scale, state[km] + off, state[km + 1] + off, n, h);
          sums[2 * (first[s.unit] + k)] += r.w_sq;
          sums[2 * (first[s.unit] + k) + 1] += r.u_sq;
        });
      },
      /*read=*/true, /*write=*/true);
  grad = at::Tensor();
  params = at::Tensor();
  if (sharded_ && dp_size_ > 1 && !sums.empty()) {
    at::Tensor t = at::from_blob(sums.data(), {static_cast<int64_t>(sums.size())}, at::kDouble);
    dp_->all_reduce(t);
  }

  // Pass 2: the update with each tensor's coefficient.
  const optim::ParamOut out_kind = param_out(/*master_is_param=*/!has_master_);
  cached = SIZE_MAX;
  at::Tensor dest;
  store_->visit(
      [&](size_t i, float* const* state) {
        const StepPiece& s = pieces_[i];
        Unit& u = *units_[s.unit];
        if (cached != s.unit) {
          if (cached != SIZE_MAX) end_update(*units_[cached], dest);
          dest = begin_update(u);  // the whole unit or this rank's shard of it
          cached = s.unit;
        }
        const optim::LambHyper h = hyper(s);
        const int64_t es = static_cast<int64_t>(dest.element_size());
        float* p = has_master_ ? state[0] : dest.data_ptr<float>() + s.begin;
        char* out = has_master_ ? static_cast<char*>(dest.data_ptr()) + s.begin * es : nullptr;
        for_each_tensor(s, [&](size_t k, int64_t off, int64_t n) {
          const size_t slot = 2 * (first[s.unit] + k);
          const double coeff = optim::lamb_coeff({sums[slot], sums[slot + 1]}, h);
          optim::lamb_apply(p + off, state[km] + off, state[km + 1] + off, n, h, coeff, out ? out + off * es : nullptr,
                            out_kind);
        });
      },
      /*read=*/true, /*write=*/true);
  if (cached != SIZE_MAX) end_update(*units_[cached], dest);
}

}  // namespace torchspeed::zero
