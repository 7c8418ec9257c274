// ZeroOptimizer: data-parallel training state of one model replica across the DP group —
// parameters as views into per-unit flat buffers, gradient reduction in buckets during backward,
// ZeRO stage 0-3 partitioning of master weights, optimizer state, gradients and parameters, and
// the fused optimizer step. See Note [Units] in zero_optimizer.cpp.
#pragma once

#include <torch/arg.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/optim/fused_optimizers.h"
#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/zero/partition_layout.h"

namespace torch::autograd {
struct Node;
}

namespace torchspeed::zero {

struct ZeroOptions {
  TORCH_ARG(int, stage) = 0;
  // Elements per gradient bucket (stages 0-2); stage 3 buckets are the layers.
  TORCH_ARG(int64_t, reduce_bucket_numel) = 500000000;
  // Reduce buckets during backward as they complete (else all after backward).
  TORCH_ARG(bool, overlap_comm) = false;
  // Stage 3: elements gathered ahead of the layer that runs.
  TORCH_ARG(int64_t, prefetch_bucket_numel) = 50000000;
  // Stage 3: units (layers) with fewer elements stay whole on every rank.
  TORCH_ARG(int64_t, param_persistence_threshold) = 100000;
  // Stage 3: most elements gathered at once, prefetches included.
  TORCH_ARG(int64_t, max_live_parameters) = 1000000000;
  TORCH_ARG(precision::Precision, precision) = precision::Precision::kFP32;
  // dtype of gradient reductions; Undefined = the gradients' own dtype (fp16 for fp16 training).
  TORCH_ARG(at::ScalarType, communication_dtype) = at::ScalarType::Undefined;
  TORCH_ARG(double, gradient_predivide_factor) = 1.0;
  TORCH_ARG(bool, prescale_gradients) = false;
  // The other ranks holding the rest of the model (pipeline stages): the gradient norm and the
  // overflow decision cover the whole model. Null: this rank holds all of it.
  TORCH_ARG(comm::CommunicatorPtr, norm_group) = nullptr;
};

struct OptimizerSpec {
  std::string type = "AdamW";  // Adam, AdamW, SGD
  optim::AdamHyper adam;
  optim::SgdHyper sgd;
};

struct NamedParam {
  std::string name;
  at::Tensor param;  // the model's leaf parameter; replaced (set_data) by a view into a unit
  int layer = -1;    // LayerStack layer that owns it (-1 for plain modules)
  std::vector<int> also_used_by;  // later layers sharing it (tied weights, e.g. an LM head)
  // false for a copy of a weight another stage also holds (a tied weight on its later stages):
  // its gradient counts once in the global norm.
  bool count_in_norm = true;
};

struct StepResult {
  bool overflow = false;
  double grad_norm = 0.0;  // global L2 norm of the unscaled gradients, before clipping
};

// Bytes this rank holds, by kind.
struct MemoryReport {
  int64_t params = 0;          // model parameters (full or shards), compute dtype
  int64_t gradients = 0;       // persistent gradient buffers (full for stage 0/1, partitions for 2/3)
  int64_t master = 0;          // fp32 master weights (bf16/fp16 training)
  int64_t optimizer_state = 0; // moments
  int64_t peak_transient = 0;  // largest transient use seen: gathered layers, bucket buffers
  int64_t total() const { return params + gradients + master + optimizer_state; }
};

struct Timings {
  double reduce_wait_s = 0.0;  // waiting for gradient reductions in step()
  double optimizer_s = 0.0;    // norm, clipping and the fused update
  double allgather_s = 0.0;    // re-gathering updated parameters (stage 1/2) and layers (stage 3)
  int64_t buckets_launched_in_backward = 0;  // reductions started by gradient hooks (overlap)
  int64_t buckets_launched_after = 0;        // reductions started once backward returned
};

class ZeroOptimizer {
 public:
  // `params` in model order, each tensor once (tied parameters deduplicated by the caller).
  // `num_layers` > 0 for a LayerStack (stage 3 needs it): then each param has its layer.
  ZeroOptimizer(std::vector<NamedParam> params, int num_layers, comm::CommunicatorPtr dp,
                ZeroOptions options, OptimizerSpec optimizer);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Backward of the micro-step that ends an accumulation window reduces across ranks
  // (stage 0/1); stage 2/3 reduce every micro-step.
  void begin_backward(bool boundary);
  void finish_backward();

  // Waits for reductions, checks overflow (agreed across the DP group), unscales, clips,
  // updates the local partition and re-gathers parameters. On overflow nothing is updated.
  StepResult step(double loss_scale, double clip_norm, double lr, std::optional<double> beta1);
  void zero_grad();

  // Stage 3, around each layer of a LayerStack.
  void pre_layer_forward(int layer);
  at::Tensor post_layer_forward(int layer, const at::Tensor& output, bool grad_enabled);
  void gather_for_backward(int layer);  // called by the autograd hook of post_layer_forward

  int stage() const { return options_.stage(); }
  int64_t num_params() const { return total_numel_; }
  int64_t steps_taken() const { return step_count_; }
  MemoryReport memory() const;
  const Timings& timings() const { return timings_; }

  // Every parameter's fp32 master value, full shape, by name in model order. Collective over the
  // DP group (stage 1-3 gather the partitions).
  std::vector<std::pair<std::string, at::Tensor>> gather_master();

  // This rank's optimizer partition: fp32 "master" weights, "exp_avg" and "exp_avg_sq" (SGD:
  // "momentum"), each [partition elements]; and the step count. Restoring re-derives the model's
  // parameters from the masters (and re-gathers them for stages 1-2). Collective.
  // copy=false returns views of the live buffers where it can (valid until the next step).
  std::vector<std::pair<std::string, at::Tensor>> export_partition(bool copy = true) const;
  // Tensors nobody else holds are adopted as the live buffers instead of copied.
  void import_partition(std::vector<std::pair<std::string, at::Tensor>> tensors, int64_t steps);

  // Where each parameter's elements sit in every rank's partition (what a checkpoint needs to
  // reshard). The same on every rank.
  PartitionLayout layout() const;
  // Optimizer state kinds export_partition returns besides "master".
  std::vector<std::string> state_kinds() const;

  // Names and shapes in model order (for checkpoints and reports).
  std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes() const;

 private:
  struct Unit;
  void build_units(std::vector<NamedParam> params, int num_layers);
  void allocate(std::vector<at::Tensor> originals);
  void register_hooks();
  void on_grad_ready(size_t unit, size_t index);
  void launch_ready();
  void launch(size_t unit);
  void finalize(size_t unit);
  void poll_finished();
  void gather(size_t unit, bool async);
  void ensure_gathered(size_t unit);
  void release(size_t unit);
  void prefetch_after(int layer, int direction);
  void track(int64_t delta);

  at::ScalarType storage_dtype() const;
  at::ScalarType comm_dtype() const;
  // How updated masters are written to the model's parameters; fp32 training updates them in
  // place (kNone) unless the masters are a separate copy (restoring a checkpoint).
  optim::ParamOut param_out(bool master_is_param) const;
  bool transient_grads() const { return options_.stage() >= 2; }

  comm::CommunicatorPtr dp_;
  ZeroOptions options_;
  OptimizerSpec opt_;
  int dp_size_, dp_rank_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<std::vector<size_t>> layer_units_;  // stage 3: units each layer needs
  int64_t total_numel_ = 0;
  int64_t part_numel_ = 0;  // elements of this rank's partition buffers

  at::Tensor master_;     // fp32 [part]: bf16/fp16 training
  at::Tensor exp_avg_;    // fp32 [part] (SGD: momentum)
  at::Tensor exp_avg_sq_; // fp32 [part]
  at::Tensor grad_part_;  // storage dtype [part]: stage 2/3 gradient partition

  // The AccumulateGrad nodes our hooks sit on, kept alive (std::shared_ptr in LibTorch 1.13,
  // c10::intrusive_ptr in 2.x: whatever grad_accumulator returns).
  using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<GradAccumulatorPtr> grad_accumulators_;
  bool reduce_now_ = false;
  int next_launch_ = -1;
  std::vector<size_t> in_flight_;  // launched, not finalized, in launch order
  int64_t step_count_ = 0;
  int64_t transient_bytes_ = 0, peak_transient_ = 0;
  Timings timings_;
};

}  // namespace torchspeed::zero
