// Tied weights across pipeline stages (a GPT's token embedding on the first stage and its LM
// head on the last): where this rank's stage sits, one communicator per tied weight over the
// stages holding it, the first stage's value as every copy's start, and the copies' gradients
// summed before the step so that every copy takes the same update.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/nn/layer_spec.h"
#include "torchspeed/nn/layer_stack.h"
#include "torchspeed/parallel/process_grid.h"

namespace torchspeed::pipeline {

// Where this rank's layers sit in a pipeline.
struct StagePlan {
  int stage = 0, stages = 1;
  struct Tie {
    std::string param;            // the parameter's name in this stage ("head.weight")
    comm::CommunicatorPtr comm;   // the stages holding the tied weight, ordered by stage
    bool owner = false;           // the first of them: its value is the initial one
  };
  std::vector<Tie> ties;
  // A later stage's copy of a tied weight: the first stage's parameter holds its name (in
  // checkpoints, the consolidated model) and its gradient counts once in the global norm.
  bool is_copy(const std::string& param) const;
};

// This rank's stage of the pipeline: its layers [begin, end) of spec.layers, by
// `partition_method` (pipeline/partition.h), and its plan. Collective over groups.world (every
// rank takes part in every tie's split, in key order).
struct StageLayers {
  StagePlan plan;
  size_t begin = 0, end = 0;
};
StageLayers plan_stage(const parallel::ParallelGroups& groups, const nn::StackSpec& spec,
                       const std::string& partition_method);

class TiedWeights {
 public:
  TiedWeights() = default;
  // Sets every tied parameter of `stack` to its first stage's value (collective over each
  // tie's communicator). Call before the optimizer copies the parameters.
  TiedWeights(const StagePlan& plan, const nn::LayerStack& stack);
  // Sums each tied parameter's gradient over the stages holding it (a stage whose copy got no
  // gradient adds zeros). The tensors stay the model's (ZeRO re-points their data only).
  void reduce_grads();
  size_t size() const { return ties_.size(); }

 private:
  std::vector<std::pair<at::Tensor, comm::CommunicatorPtr>> ties_;
};

}  // namespace torchspeed::pipeline
