// StackSpec: a LayerStack described before it is built (DeepSpeed's LayerSpec/TiedLayerSpec),
// so that a pipeline stage builds only its own layers and never allocates another stage's
// parameters. Layer i is initialised from seed + i, so its weights are the same however the
// stack is cut into stages. Tied parameters (an LM head sharing the token embedding's weight)
// name a tie key: built in one process they are one tensor; on different stages each stage has
// its own copy, which the pipeline engine keeps equal (see pipeline/).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::nn {

using TiedTensors = std::map<std::string, at::Tensor>;  // tie key -> the tensor built first

struct LayerSpec {
  std::string name;
  // Builds the layer; `tied` holds the tie keys already built in this process.
  std::function<torch::nn::AnyModule(const TiedTensors& tied)> build;
  int64_t num_params = -1;                  // -1: counted by building the layer once
  std::map<std::string, std::string> ties;  // parameter name inside the layer -> tie key
};

struct StackSpec {
  std::vector<LayerSpec> layers;
  LossFn loss;
  FusedLossFn fused_loss;  // set on a stack built with its last layer
  uint64_t seed = 0;

  size_t size() const { return layers.size(); }
  // Parameters of layer i (a tied parameter counts in every layer that holds it).
  int64_t layer_params(size_t i) const;
};

inline constexpr size_t kAllLayers = std::numeric_limits<size_t>::max();

// Builds layers [begin, end) with their names. The global RNG state is unchanged afterwards.
LayerStack build(const StackSpec& spec, size_t begin = 0, size_t end = kAllLayers);

}  // namespace torchspeed::nn
