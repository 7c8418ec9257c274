// Trains a CNN on Fashion-MNIST data-parallel with the torchspeed engine.
//   mpirun -np 2 build/bin/fashion_mnist [--epochs N] [--limit N] [--stage S] [--mlp]
//   build/bin/torchspeed launch -n 2 -- build/bin/fashion_mnist
// Each rank trains on its own shard of every epoch; test accuracy is averaged over the ranks.
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "torchspeed/torchspeed.h"
#include "torchspeed/data/idx.h"
#include "torchspeed/models/vision.h"

int main(int argc, char** argv) {
  int epochs = 1, stage = 1;
  int64_t limit = 0;  // 0: all 60,000 training images
  bool mlp = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--epochs") && i + 1 < argc) epochs = std::stoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--limit") && i + 1 < argc) limit = std::stoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--stage") && i + 1 < argc) stage = std::stoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--mlp")) mlp = true;
  }
  const auto& rt = torchspeed::init();
  auto train = torchspeed::data::load_fashion_mnist(torchspeed::data::kFashionMnistDir, true);
  auto test = torchspeed::data::load_fashion_mnist(torchspeed::data::kFashionMnistDir, false);
  if (limit > 0) {
    train.images = train.images.narrow(0, 0, limit);
    train.labels = train.labels.narrow(0, 0, limit);
  }
  const int64_t micro = 64;
  torchspeed::config::WorldShape shape;
  shape.world_size = rt.world_size;
  auto cfg = torchspeed::config::Config::parse(
      {{"train_micro_batch_size_per_gpu", micro},
       {"gradient_clipping", 1.0},
       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-3}, {"weight_decay", 0.01}}}}},
       {"zero_optimization", {{"stage", stage}, {"overlap_comm", true}, {"reduce_bucket_size", 200000}}}},
      shape);
  torch::manual_seed(0);
  auto model = mlp ? torchspeed::models::make_mlp(28 * 28, 256, 10) : torchspeed::models::make_cnn(10);
  auto engine = torchspeed::initialize(rt, model, cfg);
  const auto& dp = engine->groups().dp;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    // This rank's shard of a fresh permutation (the same on every rank: seeded by the epoch).
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + epoch);
    at::Tensor perm = at::randperm(train.images.size(0), gen);
    const int64_t per_rank = perm.size(0) / dp->size();
    at::Tensor mine = perm.narrow(0, dp->rank() * per_rank, per_rank);
    double loss_sum = 0;
    int64_t batches = 0;
    for (int64_t b = 0; b + micro <= per_rank; b += micro, ++batches) {
      at::Tensor idx = mine.narrow(0, b, micro);
      at::Tensor loss = engine->forward(train.images.index_select(0, idx), train.labels.index_select(0, idx));
      engine->backward(loss);
      engine->step();
      loss_sum += loss.item<double>();
    }
    // Test accuracy on this rank's half of the test set, averaged over the ranks.
    engine->eval();
    c10::NoGradGuard no_grad;
    const int64_t t_per = test.images.size(0) / dp->size();
    at::Tensor x = test.images.narrow(0, dp->rank() * t_per, t_per), y = test.labels.narrow(0, dp->rank() * t_per, t_per);
    at::Tensor correct = (engine->forward(x).argmax(1) == y).sum().to(at::kDouble).reshape({1});
    dp->all_reduce(correct);
    engine->train();
    if (rt.is_rank0()) {
      std::printf("epoch %d: train loss %.4f, test accuracy %.2f%% (%d ranks, ZeRO %d, %s)\n", epoch + 1,
                  loss_sum / std::max<int64_t>(batches, 1), 100.0 * correct.item<double>() / (t_per * dp->size()),
                  rt.world_size, stage, mlp ? "MLP" : "CNN");
    }
  }
  engine.reset();
  torchspeed::shutdown();
}
