// Engine: DeepSpeed's engine verbs for LibTorch models. initialize() builds it from a config;
// then per micro-batch: forward, backward (scales the loss by 1/grad_accum and the loss scale),
// step (updates only at accumulation boundaries, as DeepSpeed's does). The engine wires
// components (ZeroOptimizer, LossScaler, LRSchedule) and owns no feature logic.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "torchspeed/compression/schedule.h"
#include "torchspeed/config/config.h"
#include "torchspeed/monitor/ds_monitor.h"
#include "torchspeed/nn/checkpoint.h"
#include "torchspeed/nn/layer_spec.h"
#include "torchspeed/nn/layer_stack.h"
#include "torchspeed/nn/token_drop.h"
#include "torchspeed/pipeline/executor.h"
#include "torchspeed/pipeline/tied_weights.h"
#include "torchspeed/optim/lr_schedule.h"
#include "torchspeed/parallel/process_grid.h"
#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/comm/runtime.h"
#include "torchspeed/zero/named_params.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed {

struct EngineTimings {
  double forward_s = 0, backward_s = 0, reduce_wait_s = 0, optimizer_s = 0, allgather_s = 0;
  int64_t buckets_launched_in_backward = 0, buckets_launched_after = 0;
  int64_t optimizer_sub_groups = 0;  // fused optimizer calls so far (zero_optimization.sub_group_size)
  // Pipeline stages: time in forward and backward instructions, and the schedule's wall time up
  // to the gradient reductions; 1 - busy / schedule is the stage's bubble.
  double pipeline_busy_s = 0, pipeline_schedule_s = 0;
};

using StagePlan = pipeline::StagePlan;  // where this rank's layers sit in a pipeline
using ParamGroup = zero::ParamGroup;    // a parameter group with its own lr and weight decay
using zero::no_weight_decay_group;      // GPT-2/Megatron's no-decay group

class Engine {
 public:
  // A LayerStack (every ZeRO stage) or any module with forward(Tensor) -> Tensor (stages 0-2).
  Engine(parallel::ParallelGroups groups, std::shared_ptr<torch::nn::Module> root,
         nn::LayerStack stack, torch::nn::AnyModule any, config::Config config, StagePlan plan = {},
         std::vector<ParamGroup> param_groups = {});
  ~Engine();

  // The model's output. Floating inputs are cast to the compute dtype.
  at::Tensor forward(const at::Tensor& input);
  // A LayerStack's loss on (input, target).
  at::Tensor forward(const at::Tensor& input, const at::Tensor& target);
  void backward(const at::Tensor& loss);

  // One training batch of gradient_accumulation_steps micro-batches, each (inputs, targets)
  // from `next`, ending with the optimizer step; DeepSpeed's train_batch. With pipeline stages
  // it runs the config's schedule (pipeline.schedule: 1f1b or gpipe): the first stage uses the
  // inputs, the last the targets, activations and gradients travel point to point. Returns the
  // batch's mean loss (over micro-batches and data-parallel ranks) on every rank.
  // With sequence parallelism (sequence_parallel_size > 1) `next` gives whole sequences, the
  // same on every rank of a sequence-parallel group, and each rank keeps its shard
  // (parallel::sequence_shard, as DeepSpeed's UlyssesSPDataLoaderAdapter); forward(input,
  // target) takes the rank's shard itself.
  using MicroBatchSource = pipeline::MicroBatchSource;
  double train_batch(const MicroBatchSource& next);
  // The mean loss of gradient_accumulation_steps micro-batches, forward only.
  double eval_batch(const MicroBatchSource& next);
  // Any loader whose next() returns a batch with .inputs and .targets (data::TextLoader).
  template <typename Loader, typename = decltype(std::declval<Loader&>().next().inputs)>
  double train_batch(Loader& loader) {
    return train_batch(MicroBatchSource([&loader] {
      auto b = loader.next();
      return std::make_pair(b.inputs, b.targets);
    }));
  }
  template <typename Loader, typename = decltype(std::declval<Loader&>().next().inputs)>
  double eval_batch(Loader& loader) {
    return eval_batch(MicroBatchSource([&loader] {
      auto b = loader.next();
      return std::make_pair(b.inputs, b.targets);
    }));
  }
  int stage() const { return plan_.stage; }
  int num_stages() const { return plan_.stages; }
  // Call once per micro-batch, after backward; updates at accumulation boundaries.
  void step();
  void zero_grad() { zero_->zero_grad(); }

  bool is_gradient_accumulation_boundary() const;
  int64_t global_step() const { return global_steps_; }
  int64_t micro_steps() const { return micro_steps_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  double lr() const { return schedule_.lr(); }
  // Under autotuning (config autotuning.enabled): true once end_profile_step is done and the
  // metrics are written (DeepSpeed's engine exits there); the metrics, null before.
  bool autotuning_done() const { return !autotuning_metrics_.is_null(); }
  const nlohmann::json& autotuning_metrics() const { return autotuning_metrics_; }
  // Training FLOPs of one sample, for the FLOPS_per_gpu metric (0: unknown).
  void set_flops_per_sample(double flops) { flops_per_sample_ = flops; }
  double loss_scale() const { return scaler_.scale(); }
  // DeepSpeed's report every steps_per_print optimizer steps, world rank 0, to the log: the
  // progress line "step=N, skipped=K, lr=[..], mom=[..]"; with wall_clock_breakdown the time per
  // phase since the last report; with memory_breakdown this rank's memory by kind. An
  // application that prints its own progress (torchspeed train) turns the progress line off.
  void set_progress_report(bool on) { progress_report_ = on; }
  // Global L2 norm of the last step's unscaled gradients (before clipping).
  double grad_norm() const { return grad_norm_; }

  std::shared_ptr<torch::nn::Module> module() const { return root_; }
  // The quantization-aware training schedule (compression_training, quantize_training), or null.
  const compression::Schedule* compression() const { return compression_.get(); }
  void train() { root_->train(true); }
  void eval() { root_->train(false); }
  bool is_training() const { return root_->is_training(); }

  const config::Config& config() const { return config_; }
  const parallel::ParallelGroups& groups() const { return groups_; }
  precision::Precision precision() const { return precision_; }
  at::ScalarType compute_dtype() const;
  zero::MemoryReport memory() const { return zero_->memory(); }
  EngineTimings timings() const;
  int64_t num_parameters() const { return zero_->num_params(); }
  // The training state a checkpoint needs: this rank's optimizer partition (tensors) and the
  // counters, loss scaler and LR schedule (JSON). import_state restores all of it; a later step
  // is then bit-identical to one taken without the interruption.
  nlohmann::json export_state(std::vector<std::pair<std::string, at::Tensor>>& tensors) const;
  void import_state(const nlohmann::json& state, std::vector<std::pair<std::string, at::Tensor>> tensors);

  // DeepSpeed's checkpoint verbs, collective over every rank of the job (see
  // checkpoint/sharded.h). save_checkpoint writes DIR/TAG (default "global_step<N>") at an
  // accumulation boundary and points DIR/latest at it: every rank's optimizer partition, the
  // counters, loss scaler, LR schedule, each rank's RNG state and `client_state` (e.g. the data
  // loader's position). Returns DIR/TAG.
  std::string save_checkpoint(const std::string& dir, const std::string& tag = "",
                              const nlohmann::json& client_state = nlohmann::json::object());
  struct LoadedCheckpoint {
    std::string path;
    nlohmann::json client_state;  // what this rank (or rank 0, for a job of another size) saved
  };
  // Loads DIR/TAG (default: the tag DIR/latest names), also one written at another
  // data-parallel size or ZeRO stage. nullopt when TAG is "" and DIR has no checkpoint. Every
  // file is verified first: on any error every rank throws and the engine is unchanged.
  std::optional<LoadedCheckpoint> load_checkpoint(const std::string& dir, const std::string& tag = "");

  // Full fp32 master weights by name, the whole model on every rank (collective over every
  // rank; with pipeline stages each tied weight once, under its first stage's name).
  std::vector<std::pair<std::string, at::Tensor>> master_params();
  // DeepSpeed's save_16bit_model: the whole model's weights in the training dtype (bf16, fp16;
  // fp32 for fp32 training) in one safetensors file DIR/FILENAME, written atomically by world
  // rank 0. At ZeRO stage 3 only with zero_optimization.gather_16bit_weights_on_model_save (as
  // in DeepSpeed, without it nothing is written and every rank returns false). Collective.
  bool save_16bit_model(const std::string& dir, const std::string& filename = "model.safetensors");

 private:
  // The stack's forward; with `before_fused_loss`, every layer but the last when the stack has
  // a fused loss (LayerStackImpl::set_fused_loss), which forward(input, target) then runs.
  at::Tensor run(const at::Tensor& input, bool before_fused_loss = false);
  size_t body_layers() const;  // the layers before the fused loss (all without one)
  at::Tensor run_layers(const at::Tensor& x, size_t begin, size_t end, bool grad);
  void optimizer_step();
  double mean_over_data_parallel(double v) const;
  nlohmann::json export_counters() const;
  // import_state's checks of the JSON part, and the counters, scaler and schedule it restores.
  static void check_state(const nlohmann::json& state);
  void import_counters(const nlohmann::json& state);
  // DeepSpeed's monitor events of the step just taken (world rank 0, tensorboard/csv_monitor).
  void write_monitor_events(std::optional<double> train_loss);
  void make_checkpoint_comm();
  void make_executor();
  void autotuning_profile();
  void report_progress();

  parallel::ParallelGroups groups_;
  std::vector<ParamGroup> param_groups_;
  zero::LayerHooks* layer_hooks_ = nullptr;  // the optimizer's, when it gathers per layer
  comm::CommunicatorPtr checkpoint_comm_;  // the world, apart: see Note [Checkpoint protocol]
  std::shared_ptr<torch::nn::Module> root_;
  nn::LayerStack stack_;      // empty for plain modules
  torch::nn::AnyModule any_;  // plain modules
  config::Config config_;
  precision::Precision precision_;
  std::unique_ptr<zero::ZeroOptimizer> zero_;
  precision::LossScaler scaler_;
  optim::LRSchedule schedule_;
  int64_t micro_steps_ = 0, global_steps_ = 0, skipped_steps_ = 0;
  double grad_norm_ = 0.0;
  double forward_s_ = 0, backward_s_ = 0;
  StagePlan plan_;
  pipeline::TiedWeights tied_;                 // with pipeline stages
  std::unique_ptr<pipeline::Executor> executor_;  // with pipeline stages
  std::unique_ptr<compression::Schedule> compression_;  // compression_training / quantize_training
  std::unique_ptr<nn::RandomLtd> random_ltd_;           // data_efficiency random_ltd
  std::vector<nn::Segment> segments_;          // activation checkpointing: a segment per interval
  std::unique_ptr<monitor::Monitor> monitor_;  // world rank 0, when a monitor is enabled
  double window_loss_ = 0.0;                   // sum of this accumulation window's losses (monitor)
  std::optional<std::chrono::steady_clock::time_point> profile_start_;  // autotuning
  nlohmann::json autotuning_metrics_;
  double flops_per_sample_ = 0.0;
  bool progress_report_ = true;
  EngineTimings reported_{};  // timings() at the last steps_per_print report
};

// Builds the process grid and its groups from the config over every rank of the job, and the
// expert-parallel groups for `ep_size` (a MoE model's model.moe.ep_size).
parallel::ParallelGroups make_groups(const Runtime& runtime, const config::Config& config, int ep_size = 1);

// From a spec: with pipeline.stages > 1 each rank builds only its stage's layers (partitioned by
// pipeline.partition_method), and tied weights are kept equal across stages.
std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, const nn::StackSpec& spec,
                                   const config::Config& config,
                                   const std::vector<ParamGroup>& param_groups = {});
inline std::unique_ptr<Engine> initialize(const Runtime& runtime, const nn::StackSpec& spec,
                                          const config::Config& config,
                                          const std::vector<ParamGroup>& param_groups = {}) {
  return initialize(make_groups(runtime, config), spec, config, param_groups);
}

// A LayerStack (every ZeRO stage), over groups the caller built (several engines can share
// communicators) or over every rank of the job.
std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, nn::LayerStack model,
                                   const config::Config& config,
                                   const std::vector<ParamGroup>& param_groups = {});
inline std::unique_ptr<Engine> initialize(const Runtime& runtime, nn::LayerStack model,
                                          const config::Config& config,
                                          const std::vector<ParamGroup>& param_groups = {}) {
  return initialize(make_groups(runtime, config), std::move(model), config, param_groups);
}

std::unique_ptr<Engine> initialize_module(const parallel::ParallelGroups& groups,
                                          std::shared_ptr<torch::nn::Module> root,
                                          torch::nn::AnyModule any, const config::Config& config,
                                          const std::vector<ParamGroup>& param_groups = {});

// Any LibTorch module with forward(Tensor) -> Tensor (ZeRO stages 0-2).
template <typename ModuleHolder>
std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, ModuleHolder model,
                                   const config::Config& config, const std::vector<ParamGroup>& param_groups = {}) {
  return initialize_module(groups, model.ptr(), torch::nn::AnyModule(model), config, param_groups);
}
template <typename ModuleHolder>
std::unique_ptr<Engine> initialize(const Runtime& runtime, ModuleHolder model,
                                   const config::Config& config, const std::vector<ParamGroup>& param_groups = {}) {
  return initialize(make_groups(runtime, config), std::move(model), config, param_groups);
}

}  // namespace torchspeed
