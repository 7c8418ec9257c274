// PartitionOptimizer: an optimizer algorithm over one rank's flat fp32 partition, whatever cut
// the partition out of the model. ZeRO's strategies (zero/) decide which elements a rank holds,
// reduce its gradients and gather its parameters; the optimizer only updates what it is shown,
// through a PartitionView, and keeps its own state kinds there (Note [Strategy x optimizer]).
//
// Note [Strategy x optimizer]
// ZeRO has two independent axes: how the training state is partitioned (stages 0-3, offload,
// ZeRO++) and which optimizer runs (Adam, AdamW, SGD, Lamb, 1-bit Adam, 0/1 Adam, 1-bit Lamb).
// ZeroOptimizer owns the first; a PartitionOptimizer, chosen once by make_partition_optimizer,
// is the second. The view hands out the partition piece by piece (a unit's update range in one
// parameter group, at most sub_group_size elements: Note [Step pieces] in zero/), each with its
// gradient, the fp32 values being updated (separate masters, or the model's fp32 parameters),
// the optimizer's state kinds and where the updated parameters go. Per-tensor algorithms (Lamb)
// see which parameter tensors each piece covers and sum their statistics over the ranks that
// hold other parts of the same tensors. The 1-bit family compresses the whole momentum, so it
// needs every rank to hold the whole state in memory (stage 0, no offload): the strategy checks
// needs_replicated_state() and refuses the pairing otherwise.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/optim/fused_optimizers.h"
#include "torchspeed/optim/optimizer_type.h"

namespace torchspeed::optim {

// Hyperparameters of one parameter group; unset fields take the optimizer's own.
struct ParamGroupOptions {
  std::optional<double> lr;  // scheduled lr x (this lr / the optimizer's lr)
  std::optional<double> weight_decay;
};

struct OptimizerSpec {
  OptimizerType type = OptimizerType::kAdamW;
  AdamHyper adam;
  SgdHyper sgd;
  LambHyper lamb;
  // OneBitAdam, OneBitLamb: optimizer steps of plain Adam / Lamb (no bias correction) on averaged
  // gradients before the momentum is averaged by the 1-bit all-reduce instead (freeze_step).
  int64_t freeze_step = 100000;
  // ZeroOneAdam (Note [0/1 Adam] in onebit_optimizers.cpp).
  struct ZeroOne {
    int64_t var_freeze_step = 100000, var_update_scaler = 16, local_step_scaler = 32678, local_step_clipper = 16;
  } zero_one;
  // OneBitLamb past its warm-up (Note [1-bit Lamb] in lamb_optimizers.cpp).
  struct OneBitLamb {
    double coeff_beta = 0.9, factor_max = 4.0, factor_min = 0.5, factor_threshold = 0.1;
  } onebit_lamb;
  // Groups 1..n; group 0 is the optimizer's own hyperparameters.
  std::vector<ParamGroupOptions> groups;
};

// A run of one parameter tensor inside a piece: `slot` numbers the tensors of the partition in
// model order (the same numbering on every rank), `offset` is relative to the piece.
struct TensorRange {
  size_t slot = 0;
  int64_t offset = 0, length = 0;
};

// One piece of the partition in a pass.
struct PieceView {
  int64_t offset = 0;  // where the piece starts in the partition
  int64_t length = 0;
  int group = 0;  // parameter group
  // The piece's gradient ([length] of grad_dtype), in passes that asked for it; else null.
  const void* grad = nullptr;
  at::ScalarType grad_dtype = at::kFloat;
  // [length] fp32 values being updated: the separate masters, or the model's fp32 parameters.
  float* param = nullptr;
  // Where updated values are written as out_kind, in passes that update (null: `param` is the
  // model's parameter, or a pass that only reads).
  void* out = nullptr;
  ParamOut out_kind = ParamOut::kNone;
  // The optimizer's state kinds (state_kinds() order), [length] each.
  float* const* state = nullptr;
  // The parameter tensors the piece covers, in order.
  const std::vector<TensorRange>* tensors = nullptr;

  const void* grad_at(int64_t off) const {
    return static_cast<const char*>(grad) + off * static_cast<int64_t>(c10::elementSize(grad_dtype));
  }
  void* out_at(int64_t off) const {
    return out ? static_cast<char*>(out) + off * static_cast<int64_t>(out_element_size()) : nullptr;
  }
  // Writes param[off, off + n) to the model's copy (nothing where param is the model's).
  void write_out(int64_t off, int64_t n) const {
    if (out) write_params(param + off, n, out_at(off), out_kind);
  }
  size_t out_element_size() const { return out_kind == ParamOut::kBF16 ? 2 : 4; }
};

// What an optimizer step sees of the partition.
class PartitionView {
 public:
  virtual ~PartitionView() = default;
  // fn(piece) for every piece in partition order. `with_grad`: piece.grad is set. `updates`: the
  // pass changes the parameters (piece.out is set where they are a separate copy, and the strategy
  // stores what the pass left in them); else piece.param is only read.
  virtual void visit(bool with_grad, bool updates, const std::function<void(const PieceView&)>& fn) = 0;
  virtual int64_t numel() const = 0;       // elements of the partition
  virtual size_t num_tensors() const = 0;  // parameter tensors it covers (TensorRange::slot < this)
  // A state kind's whole [numel] tensor when the state lives in memory, else undefined.
  virtual at::Tensor resident_state(size_t kind) = 0;
  // Sums `values` (per-tensor statistics) over the ranks holding other parts of the same
  // tensors; nothing where every tensor is whole on this rank. Collective.
  virtual void sum_tensor_stats(std::vector<double>& values) = 0;
};

class PartitionOptimizer {
 public:
  virtual ~PartitionOptimizer() = default;
  PartitionOptimizer(const PartitionOptimizer&) = delete;
  PartitionOptimizer& operator=(const PartitionOptimizer&) = delete;

  OptimizerType type() const { return spec_.type; }
  const OptimizerSpec& spec() const { return spec_; }
  // fp32 [partition] tensors kept beside the masters, in the order pieces see them.
  virtual std::vector<std::string> state_kinds() const = 0;
  // Whether each element's update depends on that element alone, so any partitioning works
  // (expert parallelism's groups too).
  virtual bool elementwise() const { return false; }
  // Whether every rank must hold the whole state in memory (the 1-bit family compresses the
  // whole momentum): ZeRO stage 0 without offload.
  virtual bool needs_replicated_state() const { return false; }
  // Whether backward averages the gradients of step t (1-based); false: each rank keeps its own.
  virtual bool reduces_gradients(int64_t t) const { return true; }
  // Step t (1-based): the gradients times grad_scale (unscaling and clipping), lr the scheduled
  // learning rate, beta1 a scheduled momentum (OneCycle). Collective for the 1-bit family.
  virtual void step(PartitionView& view, int64_t t, float grad_scale, double lr, std::optional<double> beta1) = 0;
  // Scalars a checkpoint keeps beside the partition, by tensor name (`names` in slot order);
  // null when there are none.
  virtual nlohmann::json export_scalars(const std::vector<std::string>& names) const { return nullptr; }
  // After import of a checkpoint taken at step `steps` (restart() already ran).
  virtual void import_scalars(const nlohmann::json& scalars, const std::vector<std::string>& names, int64_t steps) {}
  // A checkpoint's partition was loaded: what checkpoints do not keep (compression errors,
  // schedules) restarts, as DeepSpeed's load_state_dict does.
  virtual void restart() {}

 protected:
  explicit PartitionOptimizer(OptimizerSpec spec) : spec_(std::move(spec)) {}
  OptimizerSpec spec_;
};

// A piece's parameter group: its lr (the scheduled lr scaled by the group's over the optimizer's
// base_lr) and weight decay (`weight_decay` unless the group sets one).
struct GroupHyper {
  double lr, weight_decay;
};
GroupHyper group_hyper(const OptimizerSpec& spec, int group, double lr, double base_lr, double weight_decay);

// The implementation of spec.type; `dp` is the group the 1-bit family averages over (null: one
// rank). Throws for kNone.
std::unique_ptr<PartitionOptimizer> make_partition_optimizer(OptimizerSpec spec, comm::CommunicatorPtr dp);

// Adam / AdamW / SGD over every piece, one fused pass (also the variance steps of 0/1 Adam).
void elementwise_step(const OptimizerSpec& spec, PartitionView& view, int64_t t, float grad_scale, double lr,
                      std::optional<double> beta1);

}  // namespace torchspeed::optim
