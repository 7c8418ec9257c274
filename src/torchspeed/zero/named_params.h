// The model's trainable parameters as the ZeRO optimizer takes them: by name, with the layer
// that owns each, the later layers sharing it, whether its gradient counts in the global norm
// and its parameter group.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

#include "torchspeed/nn/layer_stack.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero {

// A parameter group with its own hyperparameters (torch::optim's param groups): the parameters
// `match` claims by name (as in named_parameters() of the layers; the first group that claims
// a parameter gets it, the rest stay in the optimizer's own group). An unset lr follows the
// schedule; a set one is scaled by the schedule as the optimizer's lr is.
struct ParamGroup {
  std::function<bool(const std::string& name, const at::Tensor& param)> match;
  ParamGroupOptions options;
};
// GPT-2/Megatron's rule: biases and norm weights (every parameter with one dimension) take no
// weight decay; embeddings neither when `embeddings` (names ending in the embedding modules'
// "tok.weight"/"pos.weight", or any name containing "embed").
ParamGroup no_weight_decay_group(bool embeddings);

// Every trainable parameter of `stack`'s layers ("<layer>.<param>", layer order), or of `root`
// when `stack` is empty (layer -1), each once: a parameter several layers use (tied) belongs
// to the first, the others are in also_used_by. `counted(name, param)` says whether its
// gradient counts in the global norm (a copy another rank also holds counts once); its group is
// the first of `groups` that matches (1-based; 0 the optimizer's own).
using NormPolicy = std::function<bool(const std::string& name, const at::Tensor& param)>;
std::vector<NamedParam> collect_params(const torch::nn::Module& root, const nn::LayerStack& stack,
                                       const NormPolicy& counted, const std::vector<ParamGroup>& groups);

}  // namespace torchspeed::zero
