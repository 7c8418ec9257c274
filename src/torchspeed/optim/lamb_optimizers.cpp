// Lamb and 1-bit Lamb over a partition (DeepSpeed's FusedLamb semantics, fused_optimizers.h): the
// trust ratio is per parameter tensor, and a tensor may be cut across this rank's pieces and
// across data-parallel ranks, so the update takes two passes over the partition.
//
// Note [Lamb over partitions]
// Pass 1 updates the moments of every piece and adds each tensor range's sums of squares of the
// parameter and of the update u = m / (sqrt(v) + eps) + wd p into its tensor's slot. The slots are
// summed over the ranks holding other parts of the same tensors (PartitionView::sum_tensor_stats:
// the data-parallel group of a sharded strategy; stage 0 ranks hold whole tensors), so every rank
// has each whole tensor's norms. Pass 2 recomputes u from the new moments and applies
// p -= step * coeff * u with the tensor's coefficient. DeepSpeed itself, under ZeRO, computes the
// ratio per flat partition (its optimizer sees one flat tensor); ours is the per-tensor Lamb a
// single process computes, at any data-parallel size and sub-group size.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "torchspeed/comm/compressed.h"
#include "torchspeed/optim/detail/optimizers.h"
#include "torchspeed/base/error.h"

namespace torchspeed::optim::detail {
namespace {

// fn(piece, tensor range) for every parameter tensor's range of every piece.
template <typename Fn>
void for_each_tensor(PartitionView& view, bool with_grad, bool updates, Fn&& fn) {
  view.visit(with_grad, updates, [&](const PieceView& s) {
    for (const TensorRange& r : *s.tensors) fn(s, r);
  });
}

class Lamb : public PartitionOptimizer {
 public:
  Lamb(OptimizerSpec spec, comm::CommunicatorPtr dp) : PartitionOptimizer(std::move(spec)), dp_(std::move(dp)) {}
  std::vector<std::string> state_kinds() const override { return {"exp_avg", "exp_avg_sq"}; }
  void step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double>) override {
    lamb_step(view, t, grad_scale, lr);
  }

 protected:
  // Both passes of Note [Lamb over partitions]; leaves each tensor's coefficient in coeffs_.
  void lamb_step(PartitionView& view, int64_t t, float grad_scale, double lr) {
    auto hyper = [&](const PieceView& s) {
      LambHyper h = spec_.lamb;
      const GroupHyper g = group_hyper(spec_, s.group, lr, spec_.lamb.lr, h.weight_decay);
      h.lr = g.lr;
      h.weight_decay = g.weight_decay;
      h.step = t;
      return h;
    };
    // Pass 1: moments and norms.
    std::vector<double> sums(2 * view.num_tensors(), 0.0);
    view.visit(/*with_grad=*/true, /*updates=*/false, [&](const PieceView& s) {
      const LambHyper h = hyper(s);
      for (const TensorRange& r : *s.tensors) {
        const LambNorms n = lamb_moments(s.param + r.offset, s.grad_at(r.offset), s.grad_dtype, grad_scale,
                                         s.state[0] + r.offset, s.state[1] + r.offset, r.length, h);
        sums[2 * r.slot] += n.w_sq;
        sums[2 * r.slot + 1] += n.u_sq;
      }
    });
    view.sum_tensor_stats(sums);
    coeffs_.assign(view.num_tensors(), 1.0);
    for (size_t k = 0; k < coeffs_.size(); ++k) coeffs_[k] = lamb_coeff({sums[2 * k], sums[2 * k + 1]}, spec_.lamb);
    // Pass 2: the update with each tensor's coefficient.
    apply_pass(view, hyper);
  }

  // p -= lr * coeff * u over the partition with each tensor's coeffs_; Lamb's last pass and
  // 1-bit Lamb's.
  template <typename Hyper>
  void apply_pass(PartitionView& view, Hyper&& hyper) {
    view.visit(/*with_grad=*/false, /*updates=*/true, [&](const PieceView& s) {
      const LambHyper h = hyper(s);
      for (const TensorRange& r : *s.tensors)
        lamb_apply(s.param + r.offset, s.state[0] + r.offset, s.state[1] + r.offset, r.length, h, coeffs_[r.slot],
                   s.out_at(r.offset), s.out_kind);
    });
  }

  comm::CommunicatorPtr dp_;
  std::vector<double> coeffs_;  // the last step's coefficient per tensor (slot order)
};

// Note [1-bit Lamb]
// DeepSpeed's OnebitLamb (deepspeed/runtime/fp16/onebit/lamb.py; stage 0 only, so every tensor is
// whole on each rank, though a piece may cut it). Steps t <= freeze_step are Lamb without bias
// correction on averaged gradients (lamb_step), and each tensor keeps an EMA of its trust
// ratios (lamb_coeff_freeze, coeff_beta; ratios of exactly 1 skipped, as DeepSpeed does). At
// t = freeze_step the variance is copied to exp_avg_sq_fresh. Past it backward leaves each rank's
// own gradient and:
//  1. each tensor's momentum m = b1 m + (1 - b1) g is multiplied by its scaling_coeff (the mean
//     over tensors of rms(m) at the end of the warm-up over its own rms(m), fixed from then on),
//     so that one 1-bit scale fits every tensor; the whole momentum takes one 1-bit all-reduce;
//  2. it is scaled back, the averaged gradient it implies, (m - b1 m_prev) / (1 - b1), updates
//     exp_avg_sq_fresh (the variance stays frozen), and per tensor
//       factor = max_i (sqrt(v) + eps) / (sqrt(v_fresh) + eps),
//     pulled towards 1 by weight decay's share of the update, clamped to [factor_min,
//     factor_max] and to within factor_threshold of the last step's factor;
//  3. p -= lr * lamb_coeff_freeze * factor * (m / (sqrt(v) + eps) + wd p).
// The per-tensor scalars (lamb_coeff_freeze, last_factor, scaling_coeff) are checkpointed by
// parameter name (export_scalars); a checkpoint of the warm-up resets them on load, and the
// compression errors always restart, as DeepSpeed's load_state_dict does. A tensor whose momentum
// is all zero at the end of the warm-up gets scaling_coeff 1 (DeepSpeed divides by zero there).
class OneBitLamb final : public Lamb {
 public:
  using Lamb::Lamb;
  std::vector<std::string> state_kinds() const override { return {"exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"}; }
  bool needs_replicated_state() const override { return true; }
  bool reduces_gradients(int64_t t) const override { return t <= spec_.freeze_step; }
  void step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double>) override;
  nlohmann::json export_scalars(const std::vector<std::string>& names) const override;
  void import_scalars(const nlohmann::json& scalars, const std::vector<std::string>& names, int64_t steps) override;
  void restart() override {
    if (onebit_) onebit_->reset_errors();
  }

 private:
  struct State {
    std::vector<double> coeff_freeze, last_factor, scaling;  // scaling NaN: not yet fixed
  } ob_;
  std::unique_ptr<comm::OneBitAllReduce> onebit_;
};

void OneBitLamb::step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double>) {
  const size_t slots = view.num_tensors();
  if (ob_.coeff_freeze.size() != slots) {
    ob_.coeff_freeze.assign(slots, 0.0);
    ob_.last_factor.assign(slots, 1.0);
    ob_.scaling.assign(slots, std::numeric_limits<double>::quiet_NaN());
  }
  constexpr size_t km = 0, kv = 1, kf = 2;  // exp_avg, exp_avg_sq, exp_avg_sq_fresh
  if (t <= spec_.freeze_step) {
    lamb_step(view, t, grad_scale, lr);
    const double cb = spec_.onebit_lamb.coeff_beta;
    for (size_t k = 0; k < slots; ++k) {
      if (coeffs_[k] != 1.0) ob_.coeff_freeze[k] = cb * ob_.coeff_freeze[k] + (1.0 - cb) * coeffs_[k];
    }
    if (t == spec_.freeze_step) view.resident_state(kf).copy_(view.resident_state(kv));
    return;
  }
  at::Tensor momentum = view.resident_state(km);
  TS_INTERNAL_ASSERT(momentum.defined(), "1-bit Lamb needs its state in memory");
  const LambHyper base = spec_.lamb;
  auto hyper = [&](const PieceView& s) {
    LambHyper h = base;
    const GroupHyper g = group_hyper(spec_, s.group, lr, base.lr, h.weight_decay);
    h.lr = g.lr;
    h.weight_decay = g.weight_decay;
    h.bias_correction = false;
    h.eps_inside_sqrt = false;
    return h;
  };
  if (std::isnan(ob_.scaling[0])) {  // the first compressed step: momentum scales at the end of the warm-up
    std::vector<double> sq(slots, 0.0), count(slots, 0.0);
    for_each_tensor(view, false, false, [&](const PieceView& s, const TensorRange& r) {
      const float* m = s.state[km] + r.offset;
      for (int64_t e = 0; e < r.length; ++e) sq[r.slot] += static_cast<double>(m[e]) * m[e];
      count[r.slot] += static_cast<double>(r.length);
    });
    double united = 0.0;
    for (size_t k = 0; k < slots; ++k) united += std::sqrt(sq[k] / std::max(count[k], 1.0));
    united /= static_cast<double>(std::max<size_t>(slots, 1));
    for (size_t k = 0; k < slots; ++k) {
      const double rms = std::sqrt(sq[k] / std::max(count[k], 1.0));
      ob_.scaling[k] = rms > 0.0 ? united / rms : 1.0;
    }
  }
  // 1. Local momentum, scaled per tensor, and its 1-bit average.
  const at::Tensor m_last = momentum.clone();
  const float* m_last_all = m_last.data_ptr<float>();
  const float b1 = static_cast<float>(base.beta1), b2 = static_cast<float>(base.beta2), eps = static_cast<float>(base.eps);
  for_each_tensor(view, true, false, [&](const PieceView& s, const TensorRange& r) {
    float* m = s.state[km] + r.offset;
    onebit_momentum(s.grad_at(r.offset), s.grad_dtype, grad_scale, m, r.length, b1);
    const float sc = static_cast<float>(ob_.scaling[r.slot]);
    for (int64_t e = 0; e < r.length; ++e) m[e] *= sc;
  });
  if (dp_ && dp_->size() > 1) {
    if (!onebit_) onebit_ = std::make_unique<comm::OneBitAllReduce>(dp_, momentum.numel());
    onebit_->run(momentum);
  }
  // 2. The fresh variance and each tensor's factor.
  std::vector<double> max_ratio(slots, 0.0), up_sq(slots, 0.0), upd_sq(slots, 0.0);
  for_each_tensor(view, false, false, [&](const PieceView& s, const TensorRange& r) {
    const int64_t n = r.length;
    const float* p = s.param + r.offset;
    float* m = s.state[km] + r.offset;
    const float* v = s.state[kv] + r.offset;
    float* vf = s.state[kf] + r.offset;
    const float* ml = m_last_all + s.offset + r.offset;
    const float inv = static_cast<float>(1.0 / ob_.scaling[r.slot]), wd = static_cast<float>(hyper(s).weight_decay);
    double mx = max_ratio[r.slot], a = 0.0, b = 0.0;
    for (int64_t e = 0; e < n; ++e) {
      m[e] *= inv;
      const float g = (m[e] - b1 * ml[e]) / (1.0f - b1);
      vf[e] = b2 * vf[e] + (1.0f - b2) * g * g;
      const float denom = std::sqrt(v[e]) + eps;
      mx = std::max(mx, static_cast<double>(denom / (std::sqrt(vf[e]) + eps)));
      const float up = m[e] / denom, upd = up + wd * p[e];
      a += static_cast<double>(up) * up;
      b += static_cast<double>(upd) * upd;
    }
    max_ratio[r.slot] = mx;
    up_sq[r.slot] += a;
    upd_sq[r.slot] += b;
  });
  coeffs_.assign(slots, 1.0);
  const auto& o = spec_.onebit_lamb;
  for (size_t k = 0; k < slots; ++k) {
    double factor = max_ratio[k];
    if (upd_sq[k] > 0.0 && upd_sq[k] != up_sq[k]) {  // weight decay pulls the factor towards 1
      const double r = std::min(1.0, std::sqrt(up_sq[k]) / std::sqrt(upd_sq[k]));
      factor = factor * r + (1.0 - r);
    }
    factor = std::clamp(factor, o.factor_min, o.factor_max);
    factor = std::clamp(factor, ob_.last_factor[k] * (1.0 - o.factor_threshold), ob_.last_factor[k] * (1.0 + o.factor_threshold));
    ob_.last_factor[k] = factor;
    coeffs_[k] = ob_.coeff_freeze[k] * factor;
  }
  // 3. The update.
  apply_pass(view, hyper);
}

nlohmann::json OneBitLamb::export_scalars(const std::vector<std::string>& names) const {
  if (ob_.coeff_freeze.empty()) return nullptr;
  TS_INTERNAL_ASSERT(names.size() == ob_.coeff_freeze.size(), "1-bit Lamb has ", ob_.coeff_freeze.size(),
                     " tensors' scalars for ", names.size(), " tensors");
  nlohmann::json out = nlohmann::json::object();
  for (size_t slot = 0; slot < names.size(); ++slot) {
    const double sc = ob_.scaling[slot];
    out[names[slot]] = {ob_.coeff_freeze[slot], ob_.last_factor[slot], std::isnan(sc) ? nlohmann::json(nullptr) : nlohmann::json(sc)};
  }
  return {{"onebit_lamb", out}};
}

void OneBitLamb::import_scalars(const nlohmann::json& j, const std::vector<std::string>& names, int64_t steps) {
  ob_ = State();
  if (steps < spec_.freeze_step) return;  // a warm-up checkpoint: they restart
  TS_CHECK(j.is_object() && j.contains("onebit_lamb"), "the checkpoint of a OneBitLamb run past its freeze_step (step ",
           steps, ") has no per-tensor 1-bit Lamb state (engine.optimizer_scalars.onebit_lamb)");
  const auto& by_name = j.at("onebit_lamb");
  for (const auto& name : names) {
    TS_CHECK(by_name.contains(name) && by_name.at(name).is_array() && by_name.at(name).size() == 3,
             "the checkpoint's 1-bit Lamb state has no entry [coeff_freeze, last_factor, scaling_coeff] for parameter '",
             name, "'");
    const auto& e = by_name.at(name);
    ob_.coeff_freeze.push_back(e[0].get<double>());
    ob_.last_factor.push_back(e[1].get<double>());
    ob_.scaling.push_back(e[2].is_null() ? std::numeric_limits<double>::quiet_NaN() : e[2].get<double>());
  }
}

}  // namespace

std::unique_ptr<PartitionOptimizer> make_lamb(OptimizerSpec spec, comm::CommunicatorPtr dp) {
  return std::make_unique<Lamb>(std::move(spec), std::move(dp));
}
std::unique_ptr<PartitionOptimizer> make_onebit_lamb(OptimizerSpec spec, comm::CommunicatorPtr dp) {
  return std::make_unique<OneBitLamb>(std::move(spec), std::move(dp));
}

}  // namespace torchspeed::optim::detail
