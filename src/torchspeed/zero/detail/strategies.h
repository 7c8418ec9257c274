// The ZeRO strategies behind ZeroOptimizer (Note [ZeRO strategies] in zero_optimizer.cpp).
// Internal to zero/: users get them from make_zero_optimizer().
#pragma once

#include <memory>
#include <vector>

#include "torchspeed/base/error.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero::detail {

// Stages 0 and 1 (replicated.cpp).
class ReplicatedGradients final : public ZeroOptimizer {
 public:
  ReplicatedGradients(Stage stage, std::vector<NamedParam> params, comm::CommunicatorPtr dp, ZeroOptions options,
                      OptimizerSpec optimizer);

 protected:
  bool reduces_every_micro_step() const override { return false; }
  void allocate(Unit& u) override;
  void on_gradient(size_t unit, size_t param, bool first) override;
  void launch(size_t unit) override;
  void finalize(size_t unit) override;
  at::Tensor owned_grad(Unit& u) override;
  at::Tensor update_grad(Unit& u) override;
  void reset_grads() override;
  int64_t gradient_bytes() const override;

 private:
  bool in_place_ = true;  // .grad views the buffer: see Note [Gradient accumulation dtype]
  bool reduce_scatter_;   // stage 1: only this rank's shard of the sum is needed
};

// Stage 2, and the gradient side of stage 3 (partitioned.cpp).
class PartitionedGradients : public ZeroOptimizer {
 public:
  PartitionedGradients(std::vector<NamedParam> params, comm::CommunicatorPtr dp, ZeroOptions options,
                       OptimizerSpec optimizer);

 protected:
  PartitionedGradients(Stage stage, comm::CommunicatorPtr dp, ZeroOptions options, OptimizerSpec optimizer);
  bool reduces_every_micro_step() const override { return true; }
  void allocate(Unit& u) override;
  void on_gradient(size_t unit, size_t param, bool first) override;
  void launch(size_t unit) override;
  void finalize(size_t unit) override;
  at::Tensor owned_grad(Unit& u) override;
  at::Tensor update_grad(Unit& u) override;
  void reset_grads() override;
  int64_t gradient_bytes() const override;

  at::Tensor& grad_part();
  at::Tensor grad_part_;  // [part] in the accumulation dtype: this rank's gradient partition
  bool reduce_scatter_;   // else all-reduce the bucket and keep this rank's shard
};

class ParameterGatherer;

// Stage 3 (partitioned.cpp): stage 2's gradients, and parameters gathered per layer.
class PartitionedParameters final : public PartitionedGradients {
 public:
  PartitionedParameters(std::vector<NamedParam> params, int num_layers, comm::CommunicatorPtr dp,
                        ZeroOptions options, OptimizerSpec optimizer);
  ~PartitionedParameters() override;
  LayerHooks* layer_hooks() override;

 protected:
  bool keeps_whole(const Unit& u) const override;
  void allocate(Unit& u) override;
  void on_unit_complete(size_t unit) override;
  void release_idle() override;
  void before_import() override;
  at::Tensor begin_update(Unit& u) override;
  void end_update(Unit& u, const at::Tensor& dest) override;
  bool separate_master() const override { return PartitionedGradients::separate_master() || shards_; }

 private:
  bool offloaded(const Unit& u) const;
  ShardStorePtr shards_;  // offload_param: idle shards on disk
  bool shards_open_ = false;
  std::shared_ptr<ParameterGatherer> gatherer_;
};

}  // namespace torchspeed::zero::detail
