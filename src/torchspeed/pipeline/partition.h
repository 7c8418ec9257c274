// Cutting a stack of layers into pipeline stages, as DeepSpeed's PipelineModule partition_method:
// "uniform" (balanced layer counts), "parameters" (balanced parameter counts) and "type:REGEX"
// (balanced counts of the layers whose name matches REGEX, case-insensitive; GPT: type:block).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "torchspeed/nn/layer_spec.h"

namespace torchspeed::pipeline {

// Stage s holds layers [bounds[s], bounds[s+1]); bounds has stages + 1 entries, from 0 to the
// number of layers. Contiguous parts minimising the heaviest part's weight; every stage gets at
// least one layer.
std::vector<size_t> partition_balanced(const std::vector<int64_t>& weights, int stages);

// By `method` over the spec's layers.
std::vector<size_t> partition(const nn::StackSpec& spec, int stages, const std::string& method);

}  // namespace torchspeed::pipeline
