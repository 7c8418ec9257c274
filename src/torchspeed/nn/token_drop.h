// Random layerwise token dropping (DeepSpeed's data_efficiency random_ltd): chosen layers of a
// model run on a random subset of each sequence's tokens; the other tokens skip the layer. The
// subset is sorted, so a causal layer sees its tokens in order, with the causal mask of the
// subset (DeepSpeed's gpt_sample_tokens slices the mask the same way).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "torchspeed/config/config.h"
#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::nn {

// Implemented by layers that can drop tokens (GPT's dense blocks).
class TokenDroppable {
 public:
  virtual ~TokenDroppable() = default;
  // The layer's number among the model's droppable layers, and how many the model has.
  virtual int64_t droppable_index() const = 0;
  virtual int64_t droppable_count() const = 0;
  // Tokens each sequence keeps in training forwards; 0 = all.
  int64_t kept_tokens = 0;
};

// `layer` applied to `keep` tokens of each row of x [B, T, ...], drawn uniformly without
// replacement from the default CPU generator (so activation checkpointing replays the same
// draw) and sorted; the results are put back in their places and the other tokens of x pass
// unchanged. Gradients flow as autograd gives them: a dropped token's straight through.
at::Tensor run_on_kept_tokens(const at::Tensor& x, int64_t keep, const std::function<at::Tensor(const at::Tensor&)>& layer);

// Binds random_ltd's layer list to the droppable layers of a stack (this rank's; errors name the
// config key) and sets their kept tokens for each step.
class RandomLtd {
 public:
  // `whole_model`: the stack is the whole model (not one pipeline stage, which may hold no
  // droppable layer).
  RandomLtd(const config::RandomLtdConfig& config, LayerStack& stack, bool whole_model);
  // Before the forward passes of the step after `global_steps` steps.
  void update(int64_t global_steps);
  int64_t kept() const { return kept_; }

 private:
  config::RandomLtdConfig config_;
  std::vector<TokenDroppable*> layers_;
  int64_t kept_ = 0;
};

}  // namespace torchspeed::nn
