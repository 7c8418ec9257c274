// 0/1 Adam (DeepSpeed's ZeroOneAdam, deepspeed/runtime/fp16/onebit/zoadam.py; stage 0 only).
//
// Note [0/1 Adam]
// Two phases, t = the step being taken (1, 2, ...):
//  - Variance phase (t < var_freeze_step + 2). On steps t % var_interval == 0 backward reduces
//    the gradient as usual and both moments update from the average (plain Adam without bias
//    correction, as 1-bit Adam's warm-up). On the other steps backward leaves each rank's own
//    gradient, which is replaced by its 1-bit average (comm/compressed.h) and only the momentum
//    updates; the variance is frozen between variance steps. var_interval doubles every
//    var_update_scaler variance steps, so the exact reductions thin out exponentially.
//  - Local phase (from t = var_freeze_step + 2). The variance is frozen for good; each rank steps
//    with its own gradient and accumulates its updates u = -sum lr_k upd_k. Every
//    local_step_interval steps the ranks synchronise: each returns to the parameters of the last
//    synchronisation, scales u by sqrt(v) + eps (a sum of lr-weighted momenta), takes its 1-bit
//    average, sets the momentum to its lr-weighted mean (m = -u / sum lr_k) and applies it
//    (p = p_sync + u / (sqrt(v) + eps)), so that every rank again holds the same parameters and
//    momentum. Between synchronisations nothing is communicated (but the scalar gradient norm).
//    local_step_interval doubles every local_step_scaler local steps, up to local_step_clipper.
// The compression errors of both phases live in the one OneBitAllReduce; they are reset when the
// local phase starts (they held gradient errors; now they hold accumulator errors), as in
// DeepSpeed. Differences from DeepSpeed, all on purpose:
//  - DeepSpeed's first step() only initialises (no update); ours updates, as our 1-bit Adam does,
//    so the phase boundaries fall on the same step numbers and the schedule counts from step 1.
//  - At one rank DeepSpeed leaves the momentum unchanged on non-variance steps (it has no
//    compressed all-reduce to run); ours updates it from the gradient, the average of one rank.
//  - The momentum is compressed as one buffer (DeepSpeed under fp16: one per parameter group).
//  - DeepSpeed returns to the synchronised parameters by p -= u. Where the variance is nearly
//    zero (a gradient that is always 0, such as attention's key bias) a compressed momentum
//    makes u / (sqrt(v) + eps) huge, and the cancellation leaves each rank with its own rounding:
//    the replicas drift apart (1e-4 here at 4 ranks). We keep the synchronised parameters
//    (p_sync, one fp32 copy of the partition) and restore them exactly, so replicas stay
//    bit-identical.
//  - A checkpoint keeps step, momentum and variance; the accumulator, the errors and the
//    schedules restart on load, as DeepSpeed's load_state_dict resets them.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "torchspeed/runtime/error.h"
#include "torchspeed/zero/detail/units.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero {
namespace {

// upd = m / (sqrt(v) + eps) + wd p; p -= lr upd; u -= lr upd.
void local_step(float* p, const float* m, const float* v, float* u, int64_t n, float lr, float eps, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float upd = m[i] / (std::sqrt(v[i]) + eps) + wd * p[i];
    p[i] -= lr * upd;
    u[i] -= lr * upd;
  }
}

// Before the 1-bit average: u *= sqrt(v) + eps.
void sync_begin(const float* v, float* u, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) u[i] *= std::sqrt(v[i]) + eps;
}

// After it: m = -u / lrs; p = p_sync = p_sync + u / (sqrt(v) + eps); u = 0.
void sync_end(float* p, float* p_sync, float* m, const float* v, float* u, int64_t n, float inv_lrs, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = -u[i] * inv_lrs;
    p[i] = p_sync[i] = p_sync[i] + u[i] / (std::sqrt(v[i]) + eps);
    u[i] = 0.0f;
  }
}

}  // namespace

bool ZeroOptimizer::zero_one_reduces(int64_t t) const {
  return t < opt_.zero_one.var_freeze_step + 2 && t % zo_.var_interval == 0;
}

void ZeroOptimizer::zero_one_update(float grad_scale, double lr, std::optional<double> beta1) {
  const int64_t t = step_count_;
  const bool local_phase = t >= opt_.zero_one.var_freeze_step + 2;
  const size_t km = has_master_ ? 1 : 0;  // exp_avg in kinds_
  const double base_lr = opt_.adam.lr;
  const float b1 = static_cast<float>(beta1.value_or(opt_.adam.beta1)), eps = static_cast<float>(opt_.adam.eps);
  if (!zo_u_.defined()) zo_u_ = at::zeros({part_numel_}, at::kFloat);
  float* u_all = zo_u_.data_ptr<float>();
  auto u_of = [&](const detail::Piece& s) { return u_all + units_[s.unit]->part_offset + s.begin; };
  if (local_phase && !zo_p_sync_.defined()) zo_p_sync_ = at::empty({part_numel_}, at::kFloat);
  auto p_sync_of = [&](const detail::Piece& s) {
    return zo_p_sync_.data_ptr<float>() + units_[s.unit]->part_offset + s.begin;
  };
  auto grad_of = [&](const at::Tensor& grad, const detail::Piece& s) {
    return static_cast<const char*>(grad.data_ptr()) + s.begin * static_cast<int64_t>(grad.element_size());
  };
  const optim::ParamOut out_kind = param_out(/*master_is_param=*/!has_master_);
  // fn(piece, state, p, out) over the store, the unit's gradient in `grad`, its update destination open.
  auto pass = [&](bool with_grad, auto&& fn) {
    size_t cached = SIZE_MAX;
    at::Tensor grad, dest;
    store_->visit(
        [&](size_t i, float* const* state) {
          const detail::Piece& s = pieces_[i];
          if (cached != s.unit) {
            if (cached != SIZE_MAX) end_update(*units_[cached], dest);
            if (with_grad) grad = update_grad(*units_[s.unit]);
            dest = begin_update(*units_[s.unit]);
            cached = s.unit;
          }
          ++timings_.optimizer_sub_groups;
          const int64_t es = static_cast<int64_t>(dest.element_size());
          float* p = has_master_ ? state[0] : dest.data_ptr<float>() + s.begin;
          void* out = has_master_ ? static_cast<char*>(dest.data_ptr()) + s.begin * es : nullptr;
          fn(s, state, p, out, grad);
        },
        /*read=*/true, /*write=*/true);
    if (cached != SIZE_MAX) end_update(*units_[cached], dest);
  };
  auto write_out = [&](const float* p, int64_t n, void* out) {
    if (out) optim::write_params(p, n, out, out_kind);
  };

  if (!local_phase) {
    if (t % zo_.var_interval == 0) {
      elementwise_update(grad_scale, lr, beta1);  // the averaged gradient: both moments
    } else {
      // The local gradient's 1-bit average updates the momentum; the variance stays.
      pass(true, [&](const detail::Piece& s, float* const*, float*, void*, const at::Tensor& grad) {
        optim::onebit_momentum(grad_of(grad, s), grad.scalar_type(), grad_scale, u_of(s), s.length, 0.0);
      });
      if (dp_size_ > 1) {
        if (!onebit_) onebit_ = std::make_unique<comm::OneBitAllReduce>(dp_, zo_u_.numel());
        onebit_->run(zo_u_);
      }
      pass(false, [&](const detail::Piece& s, float* const* state, float* p, void* out, const at::Tensor&) {
        const GroupHyper g = group_hyper(s.group, lr, base_lr, opt_.adam.weight_decay);
        optim::onebit_momentum(u_of(s), at::kFloat, 1.0f, state[km], s.length, b1);
        optim::onebit_apply(p, state[km], state[km + 1], s.length, g.lr, eps, g.weight_decay, out, out_kind);
      });
      zo_u_.zero_();
    }
    if (t % zo_.var_interval == 0 && ++zo_.var_counter == opt_.zero_one.var_update_scaler) {
      zo_.var_counter = 0;
      zo_.var_interval *= 2;
    }
    if (t + 1 >= opt_.zero_one.var_freeze_step + 2) {  // the local phase starts next step
      if (onebit_) onebit_->reset_errors();
      zo_u_.zero_();
      zo_.lrs = 0.0;
      zo_.have_p_sync = false;
    }
    return;
  }

  // Local phase: a step with this rank's gradient, accumulated in u.
  const bool snapshot = !zo_.have_p_sync;  // the first local step (or the first after a load)
  zo_.have_p_sync = true;
  pass(true, [&](const detail::Piece& s, float* const* state, float* p, void* out, const at::Tensor& grad) {
    if (snapshot) std::copy(p, p + s.length, p_sync_of(s));
    const GroupHyper g = group_hyper(s.group, lr, base_lr, opt_.adam.weight_decay);
    optim::onebit_momentum(grad_of(grad, s), grad.scalar_type(), grad_scale, state[km], s.length, b1);
    local_step(p, state[km], state[km + 1], u_of(s), s.length, static_cast<float>(g.lr), eps,
               static_cast<float>(g.weight_decay));
    write_out(p, s.length, out);
  });
  zo_.lrs += lr;
  if (t % zo_.local_interval == 0) {
    pass(false, [&](const detail::Piece& s, float* const* state, float*, void*, const at::Tensor&) {
      sync_begin(state[km + 1], u_of(s), s.length, eps);
    });
    if (dp_size_ > 1) {
      if (!onebit_) onebit_ = std::make_unique<comm::OneBitAllReduce>(dp_, zo_u_.numel());
      onebit_->run(zo_u_);
    }
    pass(false, [&](const detail::Piece& s, float* const* state, float* p, void* out, const at::Tensor&) {
      const double lrs = group_hyper(s.group, zo_.lrs, base_lr, 0.0).lr;  // this group's sum of lrs
      sync_end(p, p_sync_of(s), state[km], state[km + 1], u_of(s), s.length, lrs > 0.0 ? static_cast<float>(1.0 / lrs) : 0.0f,
               eps);
      write_out(p, s.length, out);
    });
    zo_.lrs = 0.0;
  }
  if (++zo_.local_counter == opt_.zero_one.local_step_scaler) {
    zo_.local_counter = 0;
    zo_.local_interval = std::min(opt_.zero_one.local_step_clipper, 2 * zo_.local_interval);
  }
}

}  // namespace torchspeed::zero
