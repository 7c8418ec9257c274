// ZeroOptimizer: data-parallel training state of one model replica across the DP group —
// parameters as views into per-unit flat buffers, gradient reduction in buckets during backward,
// partitioning of master weights, optimizer state, gradients and parameters, and the optimizer
// step over this rank's partition. One class per ZeRO strategy behind this interface (Note [ZeRO
// strategies] in zero_optimizer.cpp); make_zero_optimizer() picks it from the stage. Which
// optimizer runs is the other axis: an optim::PartitionOptimizer that the strategy shows its
// partition to (Note [Strategy x optimizer] in optim/partition_optimizer.h).
#pragma once

#include <nlohmann/json.hpp>
#include <torch/arg.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/comm/compressed.h"
#include "torchspeed/optim/partition_optimizer.h"
#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/zero/partition_layout.h"
#include "torchspeed/zero/partition_store.h"

namespace torchspeed::zero {

namespace detail {
struct Unit;
struct Piece;
}

// DeepSpeed's zero_optimization.stage.
enum class Stage { k0 = 0, k1 = 1, k2 = 2, k3 = 3 };
Stage stage_of(int stage);  // throws for anything but 0-3
inline int stage_number(Stage s) { return static_cast<int>(s); }

struct ZeroOptions {
  TORCH_ARG(Stage, stage) = Stage::k0;
  // Elements per gradient bucket (stages 0-2); stage 3 buckets are the layers.
  TORCH_ARG(int64_t, reduce_bucket_numel) = 500000000;
  // Each bucket is reduced as soon as it is complete, during backward (DeepSpeed's reduction of
  // a full IPG bucket), so gradients never all live at once. With overlap_comm the reduction
  // runs asynchronously while backward goes on; without it the gradient hook waits for it.
  TORCH_ARG(bool, overlap_comm) = false;
  // false defers every reduction to finish_backward (pipeline stages: the tied weights'
  // gradients are summed across stages first).
  TORCH_ARG(bool, reduce_in_backward) = true;
  // Average gradients with reduce-scatter where a rank updates only its shard (stages 1-3),
  // else with all-reduce (DeepSpeed's zero_optimization.reduce_scatter).
  TORCH_ARG(bool, reduce_scatter) = true;
  // ZeRO++ qgZ (stages 2-3): reduce-scatter fp32 gradients with 4-bit blocks across hosts
  // (Note [Quantized reduce-scatter] in comm/compressed.h); its stages advance as backward's
  // gradient hooks poll it (overlap_comm), or when step() waits for it.
  TORCH_ARG(bool, quantized_gradients) = false;
  // ZeRO++ hpZ (stage 3): a unit's forward all-gather leaves each rank a secondary shard of
  // 1/hpz_partition_size of it, and its later gathers until the next step run within a group of
  // that many consecutive data-parallel ranks (Note [Hierarchical partitioning] in
  // partitioned.cpp). Must divide the data-parallel size; 1: off.
  TORCH_ARG(int, hpz_partition_size) = 1;
  // ZeRO++ qwZ (stage 3): the parameters' all-gather across the data-parallel group sends each
  // shard as int8 blocks (Note [Quantized all-gather] in comm/compressed.h); every rank computes
  // with the same dequantized values. The shards and masters stay exact.
  TORCH_ARG(bool, quantized_weights) = false;
  // Most elements one fused optimizer call updates (DeepSpeed's sub_group_size): the step runs
  // over the partition in sub-groups of at most this size.
  TORCH_ARG(int64_t, sub_group_numel) = 1000000000;
  // Stage 3: elements gathered ahead of the layer that runs.
  TORCH_ARG(int64_t, prefetch_bucket_numel) = 50000000;
  // Stage 3: units (layers) with fewer elements stay whole on every rank.
  TORCH_ARG(int64_t, param_persistence_threshold) = 100000;
  // Stage 3: most elements gathered at once, prefetches included.
  TORCH_ARG(int64_t, max_live_parameters) = 1000000000;
  TORCH_ARG(precision::Precision, precision) = precision::Precision::kFP32;
  // dtype of gradient reductions; Undefined = the dtype of the buffer reduced (fp16 for fp16
  // training).
  TORCH_ARG(at::ScalarType, communication_dtype) = at::ScalarType::Undefined;
  // dtype gradients accumulate in across micro-steps (DeepSpeed's data_types.grad_accum_dtype):
  // kFloat (the default: also for bf16 training, as DeepSpeed's bf16 optimizer does) or
  // kBFloat16 for bf16 training (accumulate in the parameters' dtype, half the memory).
  TORCH_ARG(at::ScalarType, grad_accum_dtype) = at::kFloat;
  TORCH_ARG(double, gradient_predivide_factor) = 1.0;
  TORCH_ARG(bool, prescale_gradients) = false;
  // The other ranks holding the rest of the model (pipeline stages): the gradient norm and the
  // overflow decision cover the whole model. Null: this rank holds all of it.
  TORCH_ARG(comm::CommunicatorPtr, norm_group) = nullptr;
  // Expert parallelism (parallel/expert.h): the expert-parallel group and the
  // expert-data-parallel group, over which parameters marked as experts (NamedParam::expert)
  // reduce, partition and gather instead of the data-parallel group (Note [Expert units] in
  // zero_optimizer.cpp). Null: no expert parallelism.
  TORCH_ARG(comm::CommunicatorPtr, expert_parallel) = nullptr;
  TORCH_ARG(comm::CommunicatorPtr, expert_data_parallel) = nullptr;
  // Where the optimizer partition (masters, moments) lives; null: a MemoryStore (RAM).
  TORCH_ARG(PartitionStorePtr, state_store) = nullptr;
  // Stage 3: where idle parameter shards live; null: RAM. With one, the fp32 masters are a
  // separate copy (in the state store) also for fp32 training.
  TORCH_ARG(ShardStorePtr, param_store) = nullptr;
};

// The optimizer algorithm and its hyperparameters (optim/partition_optimizer.h).
using optim::OptimizerSpec;
using optim::ParamGroupOptions;

struct NamedParam {
  std::string name;
  at::Tensor param;  // the model's leaf parameter; replaced (set_data) by a view into a unit
  int layer = -1;    // LayerStack layer that owns it (-1 for plain modules)
  std::vector<int> also_used_by;  // later layers sharing it (tied weights, e.g. an LM head)
  // false for a copy of a weight another stage also holds (a tied weight on its later stages):
  // its gradient counts once in the global norm.
  bool count_in_norm = true;
  int group = 0;  // parameter group (OptimizerSpec::groups)
  // This rank's experts of an expert-parallel layer (parallel::mark_expert): reduced over the
  // expert-data-parallel group; its whole value spans the expert-parallel group's ranks.
  bool expert = false;
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
  int64_t optimizer_state = 0; // moments (with offload: the store's buffer pool)
  int64_t offloaded = 0;       // optimizer state kept in a slower tier (not counted in total())
  int64_t peak_transient = 0;  // largest transient use seen: gathered layers, bucket buffers
  int64_t total() const { return params + gradients + master + optimizer_state; }
};

struct Timings {
  double reduce_wait_s = 0.0;  // waiting for gradient reductions in step()
  double optimizer_s = 0.0;    // norm, clipping and the fused update
  double allgather_s = 0.0;    // re-gathering updated parameters (stage 1/2) and layers (stage 3)
  int64_t buckets_launched_in_backward = 0;  // reductions started by gradient hooks (overlap)
  int64_t buckets_launched_after = 0;        // reductions started once backward returned
  int64_t optimizer_sub_groups = 0;          // fused optimizer calls (sub_group_size pieces)
};

// Bytes of transient buffers (gathered layers, buckets) live now and at most.
struct TransientBytes {
  int64_t now = 0, peak = 0;
  void add(int64_t delta) { peak = std::max(peak, now += delta); }
};

// What the engine calls around each layer of a LayerStack when the strategy gathers parameters
// per layer (stage 3); the strategies that keep parameters whole have none.
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  virtual void before_forward(int layer) = 0;
  // Returns the layer's output, wrapped so that its backward gathers the layer first.
  virtual at::Tensor after_forward(int layer, const at::Tensor& output, bool grad_enabled) = 0;
};

class ZeroOptimizer {
 public:
  virtual ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Backward of the micro-step that ends an accumulation window reduces across ranks
  // (replicated gradients); partitioned gradients reduce every micro-step.
  void begin_backward(bool boundary);
  void finish_backward();

  // Waits for reductions, checks overflow (agreed across the DP group), unscales, clips,
  // updates the local partition and re-gathers parameters. On overflow nothing is updated.
  StepResult step(double loss_scale, double clip_norm, double lr, std::optional<double> beta1);
  void zero_grad();

  // Null unless the strategy gathers parameters layer by layer (stage 3).
  virtual LayerHooks* layer_hooks() { return nullptr; }

  Stage strategy() const { return strategy_; }
  int64_t num_params() const { return total_numel_; }
  int64_t steps_taken() const { return step_count_; }
  // Optimizer scalars a checkpoint keeps beside the partition (1-bit Lamb's per-tensor
  // coefficients, by parameter name; null when there are none). import_scalars after
  // import_partition: it applies DeepSpeed's rule for a checkpoint of the warm-up.
  nlohmann::json export_scalars() const;
  void import_scalars(const nlohmann::json& scalars);
  MemoryReport memory() const;
  const Timings& timings() const { return timings_; }
  at::ScalarType grad_accum_dtype() const { return accum_dtype_; }

  // Every parameter's fp32 master value, full shape, by name in model order. Collective over the
  // DP group (sharded strategies gather the partitions).
  std::vector<std::pair<std::string, at::Tensor>> gather_master();

  // This rank's optimizer partition: fp32 "master" weights, "exp_avg" and "exp_avg_sq" (SGD:
  // "momentum"), each [partition elements]; and the step count. Restoring re-derives the model's
  // parameters from the masters (and re-gathers them where sharded). Collective.
  // copy=false returns views of the live buffers where it can (valid until the next step).
  std::vector<std::pair<std::string, at::Tensor>> export_partition(bool copy = true) const;
  // Tensors nobody else holds are adopted as the live buffers instead of copied.
  void import_partition(std::vector<std::pair<std::string, at::Tensor>> tensors, int64_t steps);

  // The same partition for a checkpoint without ever holding an offloaded kind whole: kinds in
  // RAM as views of the live buffers (valid until the next step), the rest as a stream that
  // calls fn(k, data, n) with the next n elements of streamed[k], in partition order for each k
  // (Note [Streamed partitions]).
  using ElementSink = std::function<void(size_t kind, const float* data, int64_t n)>;
  struct PartitionExport {
    std::vector<std::pair<std::string, at::Tensor>> resident;
    std::vector<std::string> streamed;  // each fp32 [partition elements]
    std::function<void(const ElementSink&)> stream;
  };
  PartitionExport export_partition_streamed() const;
  // Restores from a reader of elements [begin, begin + n) of a kind ("master", state_kinds()):
  // whole tensors for kinds in RAM, piece by piece for kinds in a slower tier. Collective.
  using PartitionReader = std::function<void(const std::string& kind, int64_t begin, int64_t n, float* dst)>;
  void import_partition(const PartitionReader& read, int64_t steps);

  // Where each parameter's elements sit in every rank's partition (what a checkpoint needs to
  // reshard). The same on every rank.
  PartitionLayout layout() const;
  // Optimizer state kinds export_partition returns besides "master".
  std::vector<std::string> state_kinds() const;

  // Names and shapes in model order (for checkpoints and reports).
  std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes() const;
  // Each parameter's group, by name in model order.
  std::vector<std::pair<std::string, int>> param_groups() const;

 protected:
  // `sharded`: rank r updates only its shard of each unit and the shards are all-gathered after
  // the step (stages 1-3); else every rank updates whole units (stage 0).
  ZeroOptimizer(Stage strategy, comm::CommunicatorPtr dp, ZeroOptions options, OptimizerSpec optimizer,
                bool sharded);
  // Builds the units from parameter lists (each becomes one unit), allocates the buffers and
  // registers the gradient hooks. Called by the strategy's constructor.
  void build(std::vector<std::vector<NamedParam>> units);

  // --- what a strategy decides -------------------------------------------------------------
  // Whether a unit's parameters stay whole on every rank (else only while its layer runs).
  virtual bool keeps_whole(const detail::Unit& u) const { return true; }
  // Whether backward reduces in every micro-step (else only in the accumulation boundary's).
  virtual bool reduces_every_micro_step() const = 0;
  // Allocates a unit's strategy state: gradient buffers, stage 3 shards (called once per unit
  // by build(), after every unit's partition range is known).
  virtual void allocate(detail::Unit& u) = 0;
  // A parameter's gradient for this micro-step is in its .grad: all of it, or (first=false)
  // a further contribution to add (Note [Gradients in several calls]).
  virtual void on_gradient(size_t unit, size_t param, bool first) = 0;
  // Every parameter of the unit has its gradient.
  virtual void on_unit_complete(size_t unit) {}
  virtual void launch(size_t unit) = 0;
  virtual void finalize(size_t unit) = 0;
  // The unit's gradient over this rank's owned shard [rank*shard, +shard) and over its update
  // range [update_begin, +part_size), after all reductions finished.
  virtual at::Tensor owned_grad(detail::Unit& u) = 0;
  virtual at::Tensor update_grad(detail::Unit& u) = 0;
  virtual void reset_grads() = 0;
  virtual int64_t gradient_bytes() const = 0;
  // Parameters whose layer is not gathered right now (stage 3), before backward and after it.
  virtual void release_idle() {}
  virtual void before_import() {}
  // Where the step writes a unit's updated parameters: update_dest(u), or a staging buffer
  // the strategy stores in end_update (offloaded stage 3 shards).
  virtual at::Tensor begin_update(detail::Unit& u) { return update_dest(u); }
  virtual void end_update(detail::Unit& u, const at::Tensor& dest) {}
  // Whether the fp32 masters are a copy separate from the parameters (always for bf16/fp16).
  virtual bool separate_master() const { return options_.precision() != precision::Precision::kFP32; }
  at::Tensor update_dest(detail::Unit& u);

  // Gradient buffer of a unit in the communication dtype, scaled for DeepSpeed's averaging;
  // sets `op`. Tracks its bytes when it is a separate buffer.
  at::Tensor comm_buffer(detail::Unit& u, comm::ReduceOp& op);
  // Starts the data-parallel average of unit `ui`'s gradient (comm_buffer) and queues it in
  // in_flight_: a reduce-scatter into u.recv (this rank's shard) with `scatter`, else an
  // all-reduce in place. Returns the buffer being reduced.
  at::Tensor start_reduction(size_t ui, bool scatter);
  // Undoes the predivide factor after the reduction (postscale) on `buf`.
  void after_reduce(at::Tensor& buf) const;
  void poll_finished();
  at::ScalarType storage_dtype() const;
  at::ScalarType comm_dtype(at::ScalarType buffer) const;

  comm::CommunicatorPtr dp_;
  ZeroOptions options_;
  Stage strategy_;
  bool sharded_;
  int dp_size_, dp_rank_;
  int ep_size_ = 1;  // expert-parallel size (1: none)
  at::ScalarType accum_dtype_;
  std::vector<std::unique_ptr<detail::Unit>> units_;
  int64_t total_numel_ = 0;
  int64_t part_numel_ = 0;  // elements of this rank's partition buffers
  std::vector<size_t> in_flight_;  // launched, not finalized, in launch order
  TransientBytes transient_;
  Timings timings_;

 private:
  void register_hooks();
  void on_grad_ready(size_t unit, size_t index);
  void launch_ready();
  void wait_reductions();
  // How updated masters are written to the model's parameters; fp32 training updates them in
  // place (kNone) unless the masters are a separate copy (restoring a checkpoint).
  optim::ParamOut param_out(bool master_is_param) const;
  void gather_updated();
  // The partition as optimizer_ sees it (zero_optimizer.cpp).
  class StepView;
  std::unique_ptr<optim::PartitionOptimizer> optimizer_;
  std::unique_ptr<comm::QuantizedReduceScatter> qgz_;  // options_.quantized_gradients()
  // Whether backward reduces the gradients of step step_count_ + 1 (the 1-bit optimizers leave
  // each rank's own gradient on their compressed steps).
  bool reduces_next_step() const { return optimizer_->reduces_gradients(step_count_ + 1); }
  // Every parameter's name in slot order (optim::TensorRange::slot).
  std::vector<std::string> tensor_names() const;

  // import_partition's work once the kinds marked in `have` are already in the resident store.
  void import_from(const PartitionReader& read, const std::vector<bool>& have, int64_t steps);
  // A kind's whole [part] tensor: the resident one (copied when `copy`), or read from the store.
  at::Tensor read_kind(size_t kind, bool copy) const;
  // Cuts the partition into pieces, opens the store, makes the units' buffers, writes the state.
  void open_store();
  void make_unit_buffers(detail::Unit& u, at::Tensor& exact);
  // The partition state: kinds_ = ["master" (when a separate fp32 copy)] + state_kinds(), each
  // fp32 [part], visited in pieces_ (Note [Step pieces]).
  PartitionStorePtr store_;
  std::vector<std::string> kinds_;
  bool has_master_ = false;
  std::vector<detail::Piece> pieces_;
  // The AccumulateGrad nodes our hooks sit on, kept alive (std::shared_ptr in LibTorch 1.13,
  // c10::intrusive_ptr in 2.x: whatever grad_accumulator returns).
  using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<GradAccumulatorPtr> grad_accumulators_;
  bool reduce_now_ = false;
  int next_launch_ = -1;
  int64_t step_count_ = 0;
};

// `params` in model order, each tensor once (tied parameters deduplicated by the caller).
// `num_layers` > 0 for a LayerStack (stage 3 needs it): then each param has its layer.
std::unique_ptr<ZeroOptimizer> make_zero_optimizer(std::vector<NamedParam> params, int num_layers,
                                                   comm::CommunicatorPtr dp, ZeroOptions options,
                                                   OptimizerSpec optimizer);

}  // namespace torchspeed::zero
