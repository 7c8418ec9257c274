// tiled(): see tiled.h.
#include "torchspeed/nn/tiled.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>

#include "torchspeed/nn/checkpoint.h"
#include "torchspeed/base/error.h"

namespace torchspeed::nn {
namespace {

// What backward replays, owned by the node (Note [Owned state in autograd nodes]).
struct TileHolder : torch::CustomClassHolder {
  TileHolder(TileFn f, std::vector<at::Tensor> p, int64_t t, TileCombine c)
      : fn(std::move(f)), params(std::move(p)), tiles(t), combine(c) {}
  TileFn fn;
  std::vector<at::Tensor> params;
  int64_t tiles;
  TileCombine combine;
  // [start, length) of each slice of a sequence of T.
  std::vector<std::pair<int64_t, int64_t>> slices(int64_t T) const {
    const int64_t n = std::max<int64_t>(1, std::min(tiles, T)), len = (T + n - 1) / n;
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t s = 0; s < T; s += len) out.emplace_back(s, std::min(len, T - s));
    return out;
  }
};

struct TiledFunction : public torch::autograd::Function<TiledFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::TensorList params,
                            c10::intrusive_ptr<TileHolder> holder) {
    ctx->saved_data["rng"] = rng_state();
    ctx->save_for_backward({x});
    std::vector<at::Tensor> outs;
    at::Tensor sum;
    for (auto [s, n] : holder->slices(x.size(1))) {
      at::Tensor y = holder->fn(x.narrow(1, s, n), s, n);  // autograd is off in here
      if (holder->combine == TileCombine::kSum) {
        sum = sum.defined() ? sum + y : y;
      } else {
        outs.push_back(std::move(y));
      }
    }
    ctx->saved_data["holder"] = c10::IValue::make_capsule(std::move(holder));
    return sum.defined() ? sum : at::cat(outs, 1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto capsule = ctx->saved_data["holder"].toCapsule();
    const TileHolder& h = static_cast<const TileHolder&>(*capsule);
    const at::Tensor x = ctx->get_saved_variables()[0];
    const bool x_grad = x.requires_grad() || x.grad_fn();
    const size_t np = h.params.size();
    std::vector<at::Tensor> param_grads(np), x_grads;
    const at::Tensor now = rng_state();
    set_rng_state(ctx->saved_data["rng"].toTensor());
    for (auto [s, n] : h.slices(x.size(1))) {
      at::Tensor xs = x.narrow(1, s, n).detach();
      if (x_grad && xs.is_floating_point()) xs.requires_grad_(true);
      at::Tensor y;
      {
        c10::AutoGradMode enable(true);
        y = h.fn(xs, s, n);
      }
      std::vector<at::Tensor> inputs;
      if (xs.requires_grad()) inputs.push_back(xs);
      inputs.insert(inputs.end(), h.params.begin(), h.params.end());
      const at::Tensor g = h.combine == TileCombine::kSum ? grads[0] : grads[0].narrow(1, s, n);
      std::vector<at::Tensor> got;
      if (y.requires_grad() && !inputs.empty()) {
        got = torch::autograd::grad({y}, inputs, {g}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
      } else {
        got.assign(inputs.size(), at::Tensor());
      }
      size_t k = 0;
      if (xs.requires_grad()) {
        x_grads.push_back(got[k].defined() ? got[k] : at::zeros_like(xs));
        ++k;
      }
      for (size_t i = 0; i < np; ++i, ++k) {
        if (!got[k].defined()) continue;
        param_grads[i] = param_grads[i].defined() ? param_grads[i] + got[k] : got[k];
      }
    }
    set_rng_state(now);
    torch::autograd::variable_list out;
    out.push_back(x_grads.empty() ? at::Tensor() : at::cat(x_grads, 1));
    for (auto& g : param_grads) out.push_back(g);
    out.push_back(at::Tensor());  // the holder
    return out;
  }
};

}  // namespace

at::Tensor tiled(const TileFn& fn, const at::Tensor& x, const std::vector<at::Tensor>& params, int64_t tiles,
                 TileCombine combine) {
  TS_CHECK(x.dim() >= 2, "tiled: the input of shape ", x.sizes(), " has no sequence dimension (1)");
  if (tiles <= 1 || x.size(1) < 2 || !at::GradMode::is_enabled()) return fn(x, 0, x.size(1));
  std::vector<at::Tensor> trainable;
  for (const auto& p : params)
    if (p.requires_grad()) trainable.push_back(p);
  // As a TensorList: autograd counts each parameter as an input of the node (a std::vector
  // would be one opaque argument).
  auto holder = c10::make_intrusive<TileHolder>(fn, trainable, tiles, combine);
  return TiledFunction::apply(x, at::TensorList(trainable), std::move(holder));
}

}  // namespace torchspeed::nn
