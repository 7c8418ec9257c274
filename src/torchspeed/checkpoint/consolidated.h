// The full model in one file: DIR/model.safetensors (every parameter, whole, with the model's
// own names) and DIR/config.json (the training config, model section included), written
// atomically; consolidation of a sharded training checkpoint into it (DeepSpeed's
// zero_to_fp32); and loading a model for generation from any of these forms.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <string>

#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::checkpoint {

void save_consolidated(const std::string& dir, const NamedTensors& params, const nlohmann::json& config,
                       int64_t step);

// The LayerStack's parameters by the names the engine uses ("layer.param"), tied ones once.
NamedTensors stack_parameters(nn::LayerStack& stack);

struct Model {
  NamedTensors params;       // fp32 unless converted otherwise, model order
  nlohmann::json config;     // the training config with its "model" section
  int64_t step = 0;
  std::string source;        // the file the parameters came from (for errors)
};

// Every parameter whole, in fp32, from a training checkpoint's shards: PATH is a tag folder
// (holding manifest.json) or a folder with `latest`. Files are verified against the manifest.
Model consolidate(const std::string& path);

// A model to generate from, found at PATH: a .safetensors file written by `torchspeed convert`
// (config in its metadata), a GGUF file (gguf.h), a folder with model.safetensors and
// config.json, a training checkpoint (consolidated on the fly), a Hugging Face folder of a
// family torchspeed runs (hf_gpt2.h, hf_decoder.h), or a run folder holding model/ or
// checkpoints/.
Model load_model(const std::string& path);

// Copies `model`'s tensors into the stack's parameters; a missing or extra name or a shape
// mismatch is an error naming the parameter and both shapes.
void load_into(nn::LayerStack& stack, const Model& model);

}  // namespace torchspeed::checkpoint
