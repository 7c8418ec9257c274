#include <torch/torch.h>
#include <torchspeed/torchspeed.h>

#include <cstdio>
#include <vector>

// Data-parallel training with ZeRO-2 on every rank mpirun starts:
//   mpirun -np 2 build/bin/quickstart
int main() {
  const auto& rt = torchspeed::init();  // MPI, this rank, threads
  torchspeed::config::WorldShape world;
  world.world_size = rt.world_size;
  auto cfg = torchspeed::config::Config::parse(nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 32,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_max_lr": 0.01}},
    "zero_optimization": {"stage": 2}
  })"), world);  // or Config::load("ds_config.json", world)

  torch::manual_seed(0);  // the same initial weights on every rank
  torchspeed::nn::LayerStack model;
  model->add("fc1", torch::nn::Linear(16, 64)).add("act", torch::nn::GELU()).add("fc2", torch::nn::Linear(64, 4));
  model->set_loss([](const at::Tensor& logits, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(logits.to(at::kFloat), y);
  });
  auto engine = torchspeed::initialize(rt, model, cfg);

  // A task to learn: the class is which of the first four inputs is largest. Each rank draws
  // its own micro-batches; the engine averages the gradients over the ranks.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rt.rank);
  std::vector<double> losses;
  for (int step = 1; step <= 300; ++step) {
    at::Tensor x = at::randn({32, 16}, gen), y = x.narrow(1, 0, 4).argmax(1);
    at::Tensor loss = engine->forward(x, y);
    engine->backward(loss);  // scales by 1/gradient_accumulation_steps (and fp16's loss scale)
    engine->step();          // the optimizer step at each accumulation boundary
    losses.push_back(loss.item<double>());
  }
  auto mean = [&](size_t from) { double s = 0; for (size_t i = from; i < from + 20; ++i) s += losses[i]; return s / 20; };
  const double first = mean(0), last = mean(losses.size() - 20);
  if (rt.rank == 0) std::printf("mean loss of the first 20 steps %.3f, of the last 20 %.3f\n", first, last);
  torchspeed::shutdown();
  return last < first / 4 ? 0 : 1;  // it learned, or the example fails
}
