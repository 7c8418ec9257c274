// 1-bit Adam and 0/1 Adam over a partition (DeepSpeed's OnebitAdam and ZeroOneAdam, stage 0 only:
// they compress the whole momentum, which every rank holds).
//
// 1-bit Adam past its warm-up: backward left each rank's own gradient (no reduction), the
// momentum is updated from it and replaced by its 1-bit average over the data-parallel group
// (comm/compressed.h), then the parameters step with the variance frozen at the end of the
// warm-up. Every rank ends with the same momentum and parameters.
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

#include "torchspeed/comm/compressed.h"
#include "torchspeed/optim/detail/optimizers.h"
#include "torchspeed/base/error.h"

namespace torchspeed::optim::detail {
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


// The 1-bit average of a whole [numel] buffer over dp (nothing at one rank or without a group),
// made on first use.
class OneBitAverage {
 public:
  explicit OneBitAverage(comm::CommunicatorPtr dp) : dp_(std::move(dp)) {}
  void run(const at::Tensor& buffer) {
    if (!dp_ || dp_->size() <= 1) return;
    if (!op_) op_ = std::make_unique<comm::OneBitAllReduce>(dp_, buffer.numel());
    op_->run(buffer);
  }
  void reset_errors() {
    if (op_) op_->reset_errors();
  }

 private:
  comm::CommunicatorPtr dp_;
  std::unique_ptr<comm::OneBitAllReduce> op_;
};

class OneBitAdam final : public PartitionOptimizer {
 public:
  OneBitAdam(OptimizerSpec spec, comm::CommunicatorPtr dp) : PartitionOptimizer(std::move(spec)), onebit_(std::move(dp)) {}
  std::vector<std::string> state_kinds() const override { return {"exp_avg", "exp_avg_sq"}; }
  bool needs_replicated_state() const override { return true; }
  bool reduces_gradients(int64_t t) const override { return t <= spec_.freeze_step; }
  void restart() override { onebit_.reset_errors(); }

  void step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double> beta1) override {
    if (t <= spec_.freeze_step) {  // the warm-up: Adam on averaged gradients
      elementwise_step(spec_, view, t, grad_scale, lr, beta1);
      return;
    }
    at::Tensor momentum = view.resident_state(0);
    TS_INTERNAL_ASSERT(momentum.defined(), "1-bit Adam needs its momentum in memory");
    const AdamHyper& a = spec_.adam;
    // Local momentum, then its average, one bit per element (Note [1-bit all-reduce]).
    view.visit(/*with_grad=*/true, /*updates=*/false, [&](const PieceView& s) {
      onebit_momentum(s.grad, s.grad_dtype, grad_scale, s.state[0], s.length, a.beta1);
    });
    onebit_.run(momentum);
    // The update with the frozen variance.
    view.visit(/*with_grad=*/false, /*updates=*/true, [&](const PieceView& s) {
      const GroupHyper g = group_hyper(spec_, s.group, lr, a.lr, a.weight_decay);
      onebit_apply(s.param, s.state[0], s.state[1], s.length, g.lr, a.eps, g.weight_decay, s.out, s.out_kind);
    });
  }

 private:
  OneBitAverage onebit_;
};

class ZeroOneAdam final : public PartitionOptimizer {
 public:
  ZeroOneAdam(OptimizerSpec spec, comm::CommunicatorPtr dp) : PartitionOptimizer(std::move(spec)), onebit_(std::move(dp)) {}
  std::vector<std::string> state_kinds() const override { return {"exp_avg", "exp_avg_sq"}; }
  bool needs_replicated_state() const override { return true; }
  bool reduces_gradients(int64_t t) const override {
    return t < spec_.zero_one.var_freeze_step + 2 && t % zo_.var_interval == 0;
  }
  void restart() override {
    onebit_.reset_errors();  // not checkpointed, as in DeepSpeed
    zo_ = Schedule();        // nor the schedules and the accumulator
    if (u_.defined()) u_.zero_();
  }
  void step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double> beta1) override;

 private:
  OneBitAverage onebit_;
  // The schedules and the local steps' lr sum, which checkpoints do not keep.
  struct Schedule {
    int64_t var_interval = 1, var_counter = 0, local_interval = 1, local_counter = 0;
    double lrs = 0.0;  // the scheduled lrs summed since the last synchronisation
    bool have_p_sync = false;
  } zo_;
  at::Tensor u_;       // fp32 [part]: the compressed gradient, then the local updates' sum
  at::Tensor p_sync_;  // fp32 [part]: the parameters of the last synchronisation
};

void ZeroOneAdam::step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double> beta1) {
  const auto& zo = spec_.zero_one;
  const AdamHyper& a = spec_.adam;
  const bool local_phase = t >= zo.var_freeze_step + 2;
  const float b1 = static_cast<float>(beta1.value_or(a.beta1)), eps = static_cast<float>(a.eps);
  if (!u_.defined()) u_ = at::zeros({view.numel()}, at::kFloat);
  float* u_all = u_.data_ptr<float>();
  auto u_of = [&](const PieceView& s) { return u_all + s.offset; };
  if (local_phase && !p_sync_.defined()) p_sync_ = at::empty({view.numel()}, at::kFloat);
  auto p_sync_of = [&](const PieceView& s) { return p_sync_.data_ptr<float>() + s.offset; };

  if (!local_phase) {
    if (t % zo_.var_interval == 0) {
      elementwise_step(spec_, view, t, grad_scale, lr, beta1);  // the averaged gradient: both moments
    } else {
      // The local gradient's 1-bit average updates the momentum; the variance stays.
      view.visit(/*with_grad=*/true, /*updates=*/false, [&](const PieceView& s) {
        onebit_momentum(s.grad, s.grad_dtype, grad_scale, u_of(s), s.length, 0.0);
      });
      onebit_.run(u_);
      view.visit(/*with_grad=*/false, /*updates=*/true, [&](const PieceView& s) {
        const GroupHyper g = group_hyper(spec_, s.group, lr, a.lr, a.weight_decay);
        onebit_momentum(u_of(s), at::kFloat, 1.0f, s.state[0], s.length, b1);
        onebit_apply(s.param, s.state[0], s.state[1], s.length, g.lr, eps, g.weight_decay, s.out, s.out_kind);
      });
      u_.zero_();
    }
    if (t % zo_.var_interval == 0 && ++zo_.var_counter == zo.var_update_scaler) {
      zo_.var_counter = 0;
      zo_.var_interval *= 2;
    }
    if (t + 1 >= zo.var_freeze_step + 2) {  // the local phase starts next step
      onebit_.reset_errors();
      u_.zero_();
      zo_.lrs = 0.0;
      zo_.have_p_sync = false;
    }
    return;
  }

  // Local phase: a step with this rank's gradient, accumulated in u.
  const bool snapshot = !zo_.have_p_sync;  // the first local step (or the first after a load)
  zo_.have_p_sync = true;
  view.visit(/*with_grad=*/true, /*updates=*/true, [&](const PieceView& s) {
    if (snapshot) std::copy(s.param, s.param + s.length, p_sync_of(s));
    const GroupHyper g = group_hyper(spec_, s.group, lr, a.lr, a.weight_decay);
    onebit_momentum(s.grad, s.grad_dtype, grad_scale, s.state[0], s.length, b1);
    local_step(s.param, s.state[0], s.state[1], u_of(s), s.length, static_cast<float>(g.lr), eps,
               static_cast<float>(g.weight_decay));
    s.write_out(0, s.length);
  });
  zo_.lrs += lr;
  if (t % zo_.local_interval == 0) {
    view.visit(/*with_grad=*/false, /*updates=*/false, [&](const PieceView& s) { sync_begin(s.state[1], u_of(s), s.length, eps); });
    onebit_.run(u_);
    view.visit(/*with_grad=*/false, /*updates=*/true, [&](const PieceView& s) {
      const double lrs = group_hyper(spec_, s.group, zo_.lrs, a.lr, 0.0).lr;  // this group's sum of lrs
      sync_end(s.param, p_sync_of(s), s.state[0], s.state[1], u_of(s), s.length, lrs > 0.0 ? static_cast<float>(1.0 / lrs) : 0.0f,
               eps);
      s.write_out(0, s.length);
    });
    zo_.lrs = 0.0;
  }
  if (++zo_.local_counter == zo.local_step_scaler) {
    zo_.local_counter = 0;
    zo_.local_interval = std::min(zo.local_step_clipper, 2 * zo_.local_interval);
  }
}

}  // namespace

std::unique_ptr<PartitionOptimizer> make_onebit_adam(OptimizerSpec spec, comm::CommunicatorPtr dp) {
  return std::make_unique<OneBitAdam>(std::move(spec), std::move(dp));
}
std::unique_ptr<PartitionOptimizer> make_zero_one_adam(OptimizerSpec spec, comm::CommunicatorPtr dp) {
  return std::make_unique<ZeroOneAdam>(std::move(spec), std::move(dp));
}

}  // namespace torchspeed::optim::detail
