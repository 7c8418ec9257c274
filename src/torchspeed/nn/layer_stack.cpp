// LayerStack's forward and loss.
#include "torchspeed/nn/layer_stack.h"

#include "torchspeed/base/error.h"

namespace torchspeed::nn {

at::Tensor LayerStackImpl::forward(at::Tensor x) {
  for (size_t i = 0; i < layers_.size(); ++i) x = run_layer(i, x);
  return x;
}

at::Tensor LayerStackImpl::loss(const at::Tensor& output, const at::Tensor& target) const {
  TS_CHECK(loss_, "this LayerStack has no loss function: call set_loss() when building it");
  return loss_(output, target);
}

}  // namespace torchspeed::nn
