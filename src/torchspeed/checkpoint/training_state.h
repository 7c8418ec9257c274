// What a training checkpoint holds beyond the protocol of sharded.h: the shard file names, the
// RNG state in the manifest, each model slice's entry (its ZeRO layout, shard files and
// parameters, with how tied and tensor-parallel parameters join), and the check on load that a
// slice matches the model it is loaded into.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchspeed/checkpoint/sharded.h"
#include "torchspeed/pipeline/tied_weights.h"
#include "torchspeed/tensor_parallel/layers.h"
#include "torchspeed/zero/partition_layout.h"

namespace torchspeed::checkpoint {

// "rank00003.safetensors".
std::string shard_file(int world_rank);

// The CPU generator's state as hex text, and back (`what` names the field in errors).
std::string cpu_rng_state();
void set_cpu_rng_state(const std::string& hex, const std::string& what);

// One parameter of a model slice as the manifest records it.
struct SliceParam {
  std::string name;
  std::vector<int64_t> shape;
  bool copy = false;                            // a tied weight's later stage's copy
  std::optional<tensor_parallel::Split> split;  // how the tensor-parallel slices join
};

// The parameters of this rank's slice as the manifest records them: `shapes` (the optimizer's,
// in model order), tied copies by `plan`, tensor-parallel splits by `model`'s parameters.
std::vector<SliceParam> slice_params_of(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                                        const torch::nn::Module& model, const pipeline::StagePlan& plan);

// The entry of the model slice at (pp, tp): its ZeRO layout over its data-parallel group,
// the shard file of each data-parallel rank (`dp_world_ranks`, in data-parallel order; at
// stage 0 only the first rank writes one), and its parameters in model order.
nlohmann::json slice_entry(int pp, int tp, const zero::PartitionLayout& layout,
                           const std::vector<int>& dp_world_ranks, const std::vector<SliceParam>& params);

// manifest["zero"]["slices"] and manifest["params"] from every rank's slice entry (JSON text,
// "" from ranks that hold none), in rank order.
void add_slices(nlohmann::json& manifest, const std::vector<std::string>& entries);

// What a job must share with the checkpoint it loads: the tensor x pipeline grid (only the
// data-parallel size and ZeRO stage may change), the optimizer type, and for its slice at
// grid coordinates (pp, tp) exactly the parameters `params` with their shapes. Throws, naming
// the checkpoint and the first difference.
struct LoadTarget {
  int tp_size = 1, pp_size = 1;  // the grid
  int pp = 0, tp = 0;            // this rank's slice
  std::string optimizer;
  std::vector<std::pair<std::string, std::vector<int64_t>>> params;
};
void check_compatible(const Opened& checkpoint, const LoadTarget& job);

}  // namespace torchspeed::checkpoint
