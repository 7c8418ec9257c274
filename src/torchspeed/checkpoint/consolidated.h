// A consolidated model checkpoint: DIR/model.safetensors (every parameter, full, fp32, with the
// model's own names) and DIR/config.json (the training config, model section included), both
// written atomically. What `torchspeed generate` loads and any safetensors reader can read.
// Sharded, exactly resumable training checkpoints build on this (see the checkpoint issue).
#pragma once

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <string>

#include "torchspeed/checkpoint/safetensors.h"
#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::checkpoint {

void save_consolidated(const std::string& dir, const NamedTensors& params, const nlohmann::json& config,
                       int64_t step);

// The LayerStack's parameters by the names the engine uses ("layer.param"), tied ones once.
NamedTensors stack_parameters(nn::LayerStack& stack);

// Copies every tensor of DIR/model.safetensors into the stack's parameters; a missing or extra
// name or a shape mismatch is an error naming the parameter and both shapes.
void load_into(nn::LayerStack& stack, const std::string& dir);

nlohmann::json load_config(const std::string& dir);

}  // namespace torchspeed::checkpoint
