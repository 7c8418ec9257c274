// AuxLoss: the autograd function that gives an attached loss its gradient, and its switches.
#include "torchspeed/nn/aux_loss.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <atomic>
#include <mutex>
#include <utility>

namespace torchspeed::nn {
namespace {
std::atomic<double> g_backward_scale{1.0};
std::atomic<bool> g_collect{false};
std::mutex g_mu;
std::vector<at::Tensor> g_collected;

struct AuxLossScaler : public torch::autograd::Function<AuxLossScaler> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor out, at::Tensor /*loss*/) { return out.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list grads) {
    return {grads[0], at::full({}, g_backward_scale.load(), at::kFloat)};
  }
};
}  // namespace

at::Tensor AuxLoss::attach(const at::Tensor& out, const at::Tensor& l) {
  if (g_collect.load()) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_collected.push_back(l);
    return out;
  }
  return AuxLossScaler::apply(out, l.to(at::kFloat));
}

void AuxLoss::set_backward_scale(double s) { g_backward_scale.store(s); }
double AuxLoss::backward_scale() { return g_backward_scale.load(); }
void AuxLoss::collect(bool on) { g_collect.store(on); }
std::vector<at::Tensor> AuxLoss::take_collected() {
  std::lock_guard<std::mutex> lock(g_mu);
  return std::exchange(g_collected, {});
}

}  // namespace torchspeed::nn
