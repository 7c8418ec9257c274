// Engine: DeepSpeed's engine verbs for LibTorch models. initialize() builds it from a config;
// then per micro-batch: forward, backward (scales the loss by 1/grad_accum and the loss scale),
// step (updates only at accumulation boundaries, as DeepSpeed's does). The engine wires
// components (ZeroOptimizer, LossScaler, LRSchedule) and owns no feature logic.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <memory>
#include <optional>
#include <string>

#include "torchspeed/config/config.h"
#include "torchspeed/nn/layer_stack.h"
#include "torchspeed/optim/lr_schedule.h"
#include "torchspeed/parallel/process_grid.h"
#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/runtime/runtime.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed {

struct EngineTimings {
  double forward_s = 0, backward_s = 0, reduce_wait_s = 0, optimizer_s = 0, allgather_s = 0;
  int64_t buckets_launched_in_backward = 0, buckets_launched_after = 0;
};

class Engine {
 public:
  // A LayerStack (every ZeRO stage) or any module with forward(Tensor) -> Tensor (stages 0-2).
  Engine(parallel::ParallelGroups groups, std::shared_ptr<torch::nn::Module> root,
         nn::LayerStack stack, torch::nn::AnyModule any, config::Config config);
  ~Engine();

  // The model's output. Floating inputs are cast to the compute dtype.
  at::Tensor forward(const at::Tensor& input);
  // A LayerStack's loss on (input, target).
  at::Tensor forward(const at::Tensor& input, const at::Tensor& target);
  void backward(const at::Tensor& loss);
  // Call once per micro-batch, after backward; updates at accumulation boundaries.
  void step();
  void zero_grad();

  bool is_gradient_accumulation_boundary() const;
  int64_t global_step() const { return global_steps_; }
  int64_t micro_steps() const { return micro_steps_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  double lr() const { return schedule_.lr(); }
  double loss_scale() const { return scaler_.scale(); }
  // Global L2 norm of the last step's unscaled gradients (before clipping).
  double grad_norm() const { return grad_norm_; }

  std::shared_ptr<torch::nn::Module> module() const { return root_; }
  void train();
  void eval();
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

  // Full fp32 master weights by name (collective over the data-parallel group).
  std::vector<std::pair<std::string, at::Tensor>> master_params() { return zero_->gather_master(); }

 private:
  at::Tensor run(const at::Tensor& input);
  nlohmann::json export_counters() const;
  void make_checkpoint_comm();

  parallel::ParallelGroups groups_;
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
};

// Builds the process grid and its groups from the config over every rank of the job.
std::unique_ptr<Engine> initialize(const Runtime& runtime, nn::LayerStack model,
                                   const config::Config& config);
// Over groups the caller built (several engines can share communicators).
std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, nn::LayerStack model,
                                   const config::Config& config);

std::unique_ptr<Engine> initialize_module(const parallel::ParallelGroups& groups,
                                          std::shared_ptr<torch::nn::Module> root,
                                          torch::nn::AnyModule any, const config::Config& config);
parallel::ParallelGroups make_groups(const Runtime& runtime, const config::Config& config);

// Any LibTorch module with forward(Tensor) -> Tensor (ZeRO stages 0-2).
template <typename ModuleHolder>
std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, ModuleHolder model,
                                   const config::Config& config) {
  return initialize_module(groups, model.ptr(), torch::nn::AnyModule(model), config);
}
template <typename ModuleHolder>
std::unique_ptr<Engine> initialize(const Runtime& runtime, ModuleHolder model,
                                   const config::Config& config) {
  return initialize(make_groups(runtime, config), std::move(model), config);
}

}  // namespace torchspeed
