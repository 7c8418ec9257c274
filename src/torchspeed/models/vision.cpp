// MLP and CNN stacks.
#include "torchspeed/models/vision.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

namespace torchspeed::models {
namespace {
nn::LossFn cross_entropy() {
  return [](const at::Tensor& logits, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(logits.to(at::kFloat), y);
  };
}
}  // namespace

nn::LayerStack make_mlp(int64_t in, int64_t hidden, int64_t classes) {
  nn::LayerStack s;
  s->add("flatten", torch::nn::Flatten());
  s->add("fc1", torch::nn::Linear(in, hidden));
  s->add("act1", torch::nn::ReLU());
  s->add("fc2", torch::nn::Linear(hidden, hidden));
  s->add("act2", torch::nn::ReLU());
  s->add("out", torch::nn::Linear(hidden, classes));
  s->set_loss(cross_entropy());
  return s;
}

nn::LayerStack make_cnn(int64_t classes) {
  nn::LayerStack s;
  s->add("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)));
  s->add("act1", torch::nn::ReLU());
  s->add("pool1", torch::nn::MaxPool2d(2));
  s->add("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)));
  s->add("act2", torch::nn::ReLU());
  s->add("pool2", torch::nn::MaxPool2d(2));
  s->add("flatten", torch::nn::Flatten());
  s->add("fc", torch::nn::Linear(32 * 7 * 7, 128));
  s->add("act3", torch::nn::ReLU());
  s->add("out", torch::nn::Linear(128, classes));
  s->set_loss(cross_entropy());
  return s;
}

}  // namespace torchspeed::models
