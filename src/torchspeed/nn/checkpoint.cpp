// checkpoint(): a custom autograd function that saves the input and the RNG state.
#include "torchspeed/nn/checkpoint.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include <mutex>

namespace torchspeed::nn {
namespace {

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

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `anchor` requires grad so that the result does too, even when x (token ids) does not: the
  // segment's parameters still need their gradients.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor anchor,
                            int64_t segment) {
    ctx->saved_data["segment"] = segment;
    ctx->saved_data["rng"] = rng_state();
    ctx->save_for_backward({x});
    return (*reinterpret_cast<const Segment*>(segment))(x);  // autograd is off in here
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& segment = *reinterpret_cast<const Segment*>(ctx->saved_data["segment"].toInt());
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
  return CheckpointFunction::apply(x, anchor, reinterpret_cast<int64_t>(&segment));
}

}  // namespace torchspeed::nn
