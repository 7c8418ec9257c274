// checkpoint(): a custom autograd function that saves the input, the RNG state and (owned) the
// segment to replay.
#include "torchspeed/nn/checkpoint.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include <algorithm>
#include <mutex>

namespace torchspeed::nn {

at::Tensor rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const at::Tensor& s) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

namespace {

// Note [Owned state in autograd nodes]
// State an autograd function needs in backward (the segment to replay here, the communicator
// in tensor_parallel/layers.cpp) is owned by the graph node: a CustomClassHolder in a capsule
// IValue in ctx->saved_data, public API in LibTorch 1.13 and 2.x alike. Passing an object's
// address as an int64 left its lifetime to the caller: a graph that outlived the object would
// have read freed memory in backward.
struct SegmentHolder : torch::CustomClassHolder {
  explicit SegmentHolder(Segment s) : segment(std::move(s)) {}
  Segment segment;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `anchor` requires grad so that the result does too, even when x (token ids) does not: the
  // segment's parameters still need their gradients.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor anchor,
                            c10::intrusive_ptr<SegmentHolder> holder) {
    const Segment& segment = holder->segment;
    ctx->saved_data["segment"] = c10::IValue::make_capsule(std::move(holder));
    ctx->saved_data["rng"] = rng_state();
    ctx->save_for_backward({x});
    return segment(x);  // autograd is off in here
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto capsule = ctx->saved_data["segment"].toCapsule();
    const Segment& segment = static_cast<const SegmentHolder&>(*capsule).segment;
    at::Tensor x = ctx->get_saved_variables()[0];
    at::Tensor input = x.detach();
    if (input.is_floating_point()) input.requires_grad_(true);
    const at::Tensor now = rng_state();
    set_rng_state(ctx->saved_data["rng"].toTensor());
    at::Tensor out;
    {
      c10::AutoGradMode enable(true);
      out = segment(input);
    }
    set_rng_state(now);
    if (out.requires_grad()) torch::autograd::backward({out}, {grads[0]});
    return {input.requires_grad() ? input.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor checkpoint(const Segment& segment, const at::Tensor& x) {
  if (!at::GradMode::is_enabled()) return segment(x);
  static const at::Tensor anchor = at::zeros({}, at::kFloat).requires_grad_(true);
  return CheckpointFunction::apply(x, anchor, c10::make_intrusive<SegmentHolder>(segment));
}

std::vector<Segment> interval_segments(size_t layers, int interval, const RangeRunner& run) {
  std::vector<Segment> out;
  const size_t k = interval > 0 ? static_cast<size_t>(interval) : layers;
  for (size_t b = 0; b < layers && k > 0; b += k) {
    const size_t e = std::min(layers, b + k);
    out.push_back([run, b, e](const at::Tensor& x) { return run(x, b, e); });
  }
  return out;
}

}  // namespace torchspeed::nn
