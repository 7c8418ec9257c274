// ALST's sequence tiling (Arctic Long Sequence Training, Bekman et al. 2025; DeepSpeed's
// TiledMLP and sequence_tiled_compute): a computation that is independent per token runs over
// slices of the sequence, forward without keeping any slice's intermediates, and backward slice
// by slice, each recomputed and backpropagated before the next. Only one slice's intermediates
// exist at a time, forward or backward: the [tokens, d_ff] activations of an MLP, or the
// [tokens, vocab] logits of a loss.
//
// Unlike one checkpoint per slice, the parameters get their gradient once per backward, summed
// over the slices (autograd::grad inside the node, then one return): ZeRO's gradient hooks see a
// parameter's gradient arrive once, as without tiling.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace torchspeed::nn {

// fn(slice of x along dimension 1, its first index, its length).
using TileFn = std::function<at::Tensor(const at::Tensor& x, int64_t start, int64_t length)>;

enum class TileCombine { kConcat, kSum };  // the slices' outputs along dimension 1, or their sum

// fn over `tiles` slices of x (dimension 1; the last may be shorter), combined. `params`: every
// parameter requiring a gradient that fn uses (others get none). With autograd off, or one
// tile, fn(x) whole. fn must not depend on the order the slices run in, except through the
// default CPU generator, whose state is replayed.
at::Tensor tiled(const TileFn& fn, const at::Tensor& x, const std::vector<at::Tensor>& params, int64_t tiles,
                 TileCombine combine);

}  // namespace torchspeed::nn
