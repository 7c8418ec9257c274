// The whole model's weights on every rank from a ZeRO / tensor / pipeline parallel job, for
// Engine::master_params and save_16bit_model (and consolidated exports).
#pragma once

#include <torch/nn/module.h>

#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/parallel/process_grid.h"
#include "torchspeed/pipeline/tied_weights.h"

namespace torchspeed::checkpoint {

// From `local` (this rank's parameters, whole within its model slice, as
// ZeroOptimizer::gather_master returns them): tensor-parallel slices merged by each parameter's
// split in `model` (collective over groups.tp), every pipeline stage's parameters shared with
// the other stages (collective over groups.pp), tied weights' later copies left out (the first
// stage's name holds them). In model order.
NamedTensors gather_model(NamedTensors local, const parallel::ParallelGroups& groups,
                          const torch::nn::Module& model, const pipeline::StagePlan& plan);

// The weights in `dtype` as one safetensors file (metadata format "pt", as Hugging Face and
// torch's save_file write it), atomically; the folder is made when missing.
void save_model_file(const std::string& path, const NamedTensors& params, at::ScalarType dtype);

}  // namespace torchspeed::checkpoint
