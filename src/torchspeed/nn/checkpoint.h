// Activation checkpointing: run a segment of layers keeping only its input; backward replays the
// segment with the RNG state of the first run (so dropout masks are identical) and
// backpropagates through the replay. Parameters receive their gradients through their usual
// AccumulateGrad nodes, so gradient hooks (ZeRO's buckets) work unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace torchspeed::nn {

using Segment = std::function<at::Tensor(const at::Tensor&)>;

// The default CPU generator's state, and restoring it: what a replay draws its dropout from.
at::Tensor rng_state();
void set_rng_state(const at::Tensor& state);

// The result's autograd node keeps a copy of `segment` (whatever it captures by reference must
// outlive the backward of the result). Without grad mode, this is segment(x).
at::Tensor checkpoint(const Segment& segment, const at::Tensor& x);

// DeepSpeed's pipeline.activation_checkpoint_interval over a stack of `layers`: a segment per
// `interval` consecutive layers (the last may be shorter), each `run(x, begin, end)`.
using RangeRunner = std::function<at::Tensor(const at::Tensor& x, size_t begin, size_t end)>;
std::vector<Segment> interval_segments(size_t layers, int interval, const RangeRunner& run);

}  // namespace torchspeed::nn
