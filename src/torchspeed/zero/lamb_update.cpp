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
#include <cmath>
#include <limits>

#include "torchspeed/runtime/error.h"
#include "torchspeed/zero/detail/units.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero {

using StepPiece = detail::Piece;
using detail::Unit;

namespace {
// Slot of each (unit, parameter): first[u] + its index in the unit.
std::vector<size_t> tensor_slots(const std::vector<std::unique_ptr<Unit>>& units) {
  std::vector<size_t> first(units.size() + 1, 0);
  for (size_t u = 0; u < units.size(); ++u) first[u + 1] = first[u] + units[u]->params.size();
  return first;
}

// fn(parameter index in the unit, offset in the piece, length) for each tensor range of a piece.
template <typename Fn>
void for_each_tensor(const Unit& u, const StepPiece& s, Fn&& fn) {
  const int64_t lo = u.update_begin + s.begin, hi = lo + s.length;
  for (size_t k = 0; k < u.params.size(); ++k) {
    const auto& p = u.params[k];
    const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
    if (a < b) fn(k, a - lo, b - a);
  }
}
}  // namespace

void ZeroOptimizer::lamb_update(float grad_scale, double lr) {
  const std::vector<size_t> first = tensor_slots(units_);
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
        for_each_tensor(u, s, [&](size_t k, int64_t off, int64_t n) {
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
  lamb_coeffs_.assign(first.back(), 1.0);
  for (size_t slot = 0; slot < first.back(); ++slot) lamb_coeffs_[slot] = optim::lamb_coeff({sums[2 * slot], sums[2 * slot + 1]}, opt_.lamb);

  // Pass 2: the update with each tensor's coefficient.
  lamb_apply_pass(first, hyper);
}

void ZeroOptimizer::lamb_apply_pass(const std::vector<size_t>& first,
                                    const std::function<optim::LambHyper(const detail::Piece&)>& hyper) {
  const size_t km = has_master_ ? 1 : 0;  // exp_avg, then exp_avg_sq
  const optim::ParamOut out_kind = param_out(/*master_is_param=*/!has_master_);
  size_t cached = SIZE_MAX;
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
        for_each_tensor(u, s, [&](size_t k, int64_t off, int64_t n) {
          optim::lamb_apply(p + off, state[km] + off, state[km + 1] + off, n, h, lamb_coeffs_[first[s.unit] + k],
                            out ? out + off * es : nullptr, out_kind);
        });
      },
      /*read=*/true, /*write=*/true);
  if (cached != SIZE_MAX) end_update(*units_[cached], dest);
}

// Note [1-bit Lamb]
// DeepSpeed's OnebitLamb (deepspeed/runtime/fp16/onebit/lamb.py; stage 0 only, so every tensor is
// whole on each rank, though a piece may cut it). Steps t <= freeze_step are Lamb without bias
// correction on averaged gradients (lamb_update), and each tensor keeps an EMA of its trust
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
void ZeroOptimizer::onebit_lamb_update(float grad_scale, double lr) {
  const std::vector<size_t> first = tensor_slots(units_);
  const size_t slots = first.back();
  if (ob_.coeff_freeze.size() != slots) {
    ob_.coeff_freeze.assign(slots, 0.0);
    ob_.last_factor.assign(slots, 1.0);
    ob_.scaling.assign(slots, std::numeric_limits<double>::quiet_NaN());
  }
  const size_t km = has_master_ ? 1 : 0, kv = km + 1, kf = km + 2;  // exp_avg, exp_avg_sq, exp_avg_sq_fresh
  const int64_t t = step_count_;
  if (t <= opt_.freeze_step) {
    lamb_update(grad_scale, lr);
    const double cb = opt_.onebit_lamb.coeff_beta;
    for (size_t k = 0; k < slots; ++k) {
      if (lamb_coeffs_[k] != 1.0) ob_.coeff_freeze[k] = cb * ob_.coeff_freeze[k] + (1.0 - cb) * lamb_coeffs_[k];
    }
    if (t == opt_.freeze_step) store_->resident(kf).copy_(store_->resident(kv));
    return;
  }
  at::Tensor momentum = store_->resident(km);
  TS_INTERNAL_ASSERT(momentum.defined(), "1-bit Lamb needs its state in memory");
  const optim::LambHyper base = opt_.lamb;
  auto hyper = [&](const StepPiece& s) {
    optim::LambHyper h = base;
    const GroupHyper g = group_hyper(s.group, lr, base.lr, h.weight_decay);
    h.lr = g.lr;
    h.weight_decay = g.weight_decay;
    h.bias_correction = false;
    h.eps_inside_sqrt = false;
    return h;
  };
  // Per-tensor sums over this rank's pieces (stage 0: every tensor is here whole).
  auto per_tensor = [&](auto&& fn) {
    store_->visit(
        [&](size_t i, float* const* state) {
          const StepPiece& s = pieces_[i];
          for_each_tensor(*units_[s.unit], s, [&](size_t k, int64_t off, int64_t n) { fn(s, state, first[s.unit] + k, off, n); });
        },
        /*read=*/true, /*write=*/true);
  };
  if (std::isnan(ob_.scaling[0])) {  // the first compressed step: momentum scales at the end of the warm-up
    std::vector<double> sq(slots, 0.0), count(slots, 0.0);
    per_tensor([&](const StepPiece&, float* const* state, size_t slot, int64_t off, int64_t n) {
      const float* m = state[km] + off;
      for (int64_t e = 0; e < n; ++e) sq[slot] += static_cast<double>(m[e]) * m[e];
      count[slot] += static_cast<double>(n);
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
  size_t cached = SIZE_MAX;
  at::Tensor grad;
  per_tensor([&](const StepPiece& s, float* const* state, size_t slot, int64_t off, int64_t n) {
    if (cached != s.unit) {
      grad = update_grad(*units_[s.unit]);
      cached = s.unit;
    }
    ++timings_.optimizer_sub_groups;
    const int64_t es = static_cast<int64_t>(grad.element_size());
    float* m = state[km] + off;
    optim::onebit_momentum(static_cast<const char*>(grad.data_ptr()) + (s.begin + off) * es, grad.scalar_type(), grad_scale,
                           m, n, b1);
    const float sc = static_cast<float>(ob_.scaling[slot]);
    for (int64_t e = 0; e < n; ++e) m[e] *= sc;
  });
  grad = at::Tensor();
  if (dp_size_ > 1) {
    if (!onebit_) onebit_ = std::make_unique<comm::OneBitAllReduce>(dp_, momentum.numel());
    onebit_->run(momentum);
  }
  // 2. The fresh variance and each tensor's factor.
  std::vector<double> max_ratio(slots, 0.0), up_sq(slots, 0.0), upd_sq(slots, 0.0);
  cached = SIZE_MAX;
  at::Tensor params;
  per_tensor([&](const StepPiece& s, float* const* state, size_t slot, int64_t off, int64_t n) {
    if (!has_master_ && cached != s.unit) {
      params = update_dest(*units_[s.unit]);
      cached = s.unit;
    }
    const float* p = (has_master_ ? state[0] : params.data_ptr<float>() + s.begin) + off;
    float* m = state[km] + off;
    const float* v = state[kv] + off;
    float* vf = state[kf] + off;
    const float* ml = m_last_all + units_[s.unit]->part_offset + s.begin + off;
    const float inv = static_cast<float>(1.0 / ob_.scaling[slot]), wd = static_cast<float>(hyper(s).weight_decay);
    double mx = max_ratio[slot], a = 0.0, b = 0.0;
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
    max_ratio[slot] = mx;
    up_sq[slot] += a;
    upd_sq[slot] += b;
  });
  params = at::Tensor();
  lamb_coeffs_.assign(slots, 1.0);
  const auto& o = opt_.onebit_lamb;
  for (size_t k = 0; k < slots; ++k) {
    double factor = max_ratio[k];
    if (upd_sq[k] > 0.0 && upd_sq[k] != up_sq[k]) {  // weight decay pulls the factor towards 1
      const double r = std::min(1.0, std::sqrt(up_sq[k]) / std::sqrt(upd_sq[k]));
      factor = factor * r + (1.0 - r);
    }
    factor = std::clamp(factor, o.factor_min, o.factor_max);
    factor = std::clamp(factor, ob_.last_factor[k] * (1.0 - o.factor_threshold), ob_.last_factor[k] * (1.0 + o.factor_threshold));
    ob_.last_factor[k] = factor;
    lamb_coeffs_[k] = ob_.coeff_freeze[k] * factor;
  }
  // 3. The update.
  lamb_apply_pass(first, hyper);
}

nlohmann::json ZeroOptimizer::export_scalars() const {
  if (opt_.type != optim::OptimizerType::kOneBitLamb || ob_.coeff_freeze.empty()) return nullptr;
  nlohmann::json out = nlohmann::json::object();
  size_t slot = 0;
  for (const auto& u : units_) {
    for (const auto& p : u->params) {
      const double sc = ob_.scaling[slot];
      out[p.name] = {ob_.coeff_freeze[slot], ob_.last_factor[slot], std::isnan(sc) ? nlohmann::json(nullptr) : nlohmann::json(sc)};
      ++slot;
    }
  }
  return {{"onebit_lamb", out}};
}

void ZeroOptimizer::import_scalars(const nlohmann::json& j) {
  ob_ = OneBitLambState();
  if (opt_.type != optim::OptimizerType::kOneBitLamb || step_count_ < opt_.freeze_step) return;  // a warm-up checkpoint: they restart
  TS_CHECK(j.is_object() && j.contains("onebit_lamb"), "the checkpoint of a OneBitLamb run past its freeze_step (step ",
           step_count_, ") has no per-tensor 1-bit Lamb state (engine.optimizer_scalars.onebit_lamb)");
  const auto& by_name = j.at("onebit_lamb");
  for (const auto& u : units_) {
    for (const auto& p : u->params) {
      TS_CHECK(by_name.contains(p.name) && by_name.at(p.name).is_array() && by_name.at(p.name).size() == 3,
               "the checkpoint's 1-bit Lamb state has no entry [coeff_freeze, last_factor, scaling_coeff] for parameter '",
               p.name, "'");
      const auto& e = by_name.at(p.name);
      ob_.coeff_freeze.push_back(e[0].get<double>());
      ob_.last_factor.push_back(e[1].get<double>());
      ob_.scaling.push_back(e[2].is_null() ? std::numeric_limits<double>::quiet_NaN() : e[2].get<double>());
    }
  }
}

}  // namespace torchspeed::zero
