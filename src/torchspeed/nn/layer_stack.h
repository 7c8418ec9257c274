// LayerStack: a model as an ordered stack of named layers and a loss function (DESIGN.md, "One
// idea at the centre"). One activation tensor flows from layer to layer; every parallel and
// memory technique (ZeRO-3 gathering, pipeline stages, activation checkpointing) is a way of
// placing, sharding or replaying this stack. Lives below zero/, pipeline/ and engine/, which
// all run it.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace torchspeed::nn {

// loss(output of the last layer, target) -> scalar loss.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
// A loss that runs the last layer itself (ALST's tiled loss: the LM head and cross-entropy a
// slice of the sequence at a time, so the logits never exist whole): (the last layer, the
// output of the layer before it, target) -> the scalar loss LossFn gives on the last layer's
// output.
using FusedLossFn = std::function<at::Tensor(const std::shared_ptr<torch::nn::Module>& last, const at::Tensor& x,
                                             const at::Tensor& target)>;

class LayerStackImpl : public torch::nn::Module {
 public:
  LayerStackImpl() = default;

  // Appends a layer; `module` is any LibTorch module (holder or shared_ptr) with
  // forward(Tensor) -> Tensor.
  template <typename ModuleType>
  LayerStackImpl& add(const std::string& name, ModuleType module) {
    auto registered = register_module(name, std::move(module));
    layers_.emplace_back(name, torch::nn::AnyModule(registered));
    return *this;
  }
  LayerStackImpl& add_any(const std::string& name, torch::nn::AnyModule module) {
    register_module(name, module.ptr());
    layers_.emplace_back(name, std::move(module));
    return *this;
  }
  LayerStackImpl& set_loss(LossFn loss) {
    loss_ = std::move(loss);
    return *this;
  }
  // Training's loss then runs the last layer through `fused` (the engine calls it in place of
  // the last layer and loss()); forward() and loss() are unchanged.
  LayerStackImpl& set_fused_loss(FusedLossFn fused) {
    fused_loss_ = std::move(fused);
    return *this;
  }
  const FusedLossFn& fused_loss() const { return fused_loss_; }

  size_t size() const { return layers_.size(); }
  const std::string& layer_name(size_t i) const { return layers_.at(i).first; }
  std::shared_ptr<torch::nn::Module> layer_module(size_t i) const { return layers_.at(i).second.ptr(); }
  at::Tensor run_layer(size_t i, const at::Tensor& x) { return layers_.at(i).second.forward(x); }

  // Runs every layer.
  at::Tensor forward(at::Tensor x);
  bool has_loss() const { return static_cast<bool>(loss_); }
  const LossFn& loss_fn() const { return loss_; }
  at::Tensor loss(const at::Tensor& output, const at::Tensor& target) const;

 private:
  std::vector<std::pair<std::string, torch::nn::AnyModule>> layers_;
  LossFn loss_;
  FusedLossFn fused_loss_;
};
TORCH_MODULE(LayerStack);

}  // namespace torchspeed::nn
