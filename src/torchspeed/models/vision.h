// Small image classifiers as LayerStacks (every ZeRO stage applies): an MLP and a CNN for 28x28
// grey images, cross-entropy loss. They show that the engine is not GPT-only.
#pragma once

#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::models {

nn::LayerStack make_mlp(int64_t in_features, int64_t hidden, int64_t classes);
nn::LayerStack make_cnn(int64_t classes);

}  // namespace torchspeed::models
