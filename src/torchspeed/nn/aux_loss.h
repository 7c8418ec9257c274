// Auxiliary losses that layers add to the training loss without returning them (Note
// [Load-balancing loss] in models/moe.h): a layer attaches its coefficient-weighted loss l to its
// output with attach(); backward passes the output's gradient through and gives l the gradient
// s, the factor the engine multiplies the loss by before backward (loss scale / gradient
// accumulation steps), which the engine and the pipeline executor set with set_backward_scale.
// So the gradient reaches the layer through any schedule (pipeline stages, activation
// checkpointing's replay) without the loss travelling beside the activations, as Megatron-core's
// MoEAuxLossAutoScaler does.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace torchspeed::nn {

struct AuxLoss {
  // `out` unchanged (a copy), with l [scalar fp32, with its graph] attached. In collect mode l is
  // appended to the collected list instead and `out` returned.
  static at::Tensor attach(const at::Tensor& out, const at::Tensor& l);
  static void set_backward_scale(double s);
  static double backward_scale();
  // Collect mode (the plain-LibTorch reference): the caller adds the sum of take_collected() to
  // its own loss and calls backward on it.
  static void collect(bool on);
  static std::vector<at::Tensor> take_collected();
};

}  // namespace torchspeed::nn
