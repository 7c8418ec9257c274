// Parameter groups against torch::optim::AdamW with the same groups, and bf16 gradient
// accumulation in fp32 (data_types.grad_accum_dtype) against plain LibTorch arithmetic on the
// same bf16 gradients: the references are computed here in one process, never by the engine.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dist_util.h"
#include "torchspeed/engine/engine.h"

using torchspeed::config::Config;
using ts_test::world;

namespace {

constexpr int64_t kBatch = 16, kIn = 12, kHidden = 32, kOut = 4;

torchspeed::parallel::ParallelGroups groups() { return ts_test::dp_groups(); }
Config parse(const nlohmann::json& j) { return ts_test::parse_config(j); }

torchspeed::nn::LayerStack make_model() {
  torch::manual_seed(4321);
  torchspeed::nn::LayerStack s;
  s->add("fc1", torch::nn::Linear(kIn, kHidden));
  s->add("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  s->add("act", torch::nn::Functional(torch::tanh));
  s->add("fc2", torch::nn::Linear(kHidden, kOut));
  s->set_loss([](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out.to(at::kFloat), t); });
  return s;
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({kBatch, kIn}, gen), at::randn({kBatch, kOut}, gen)};
}

std::map<std::string, at::Tensor> named(torchspeed::nn::LayerStack& m) {
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < m->size(); ++i)
    for (auto& item : m->layer_module(i)->named_parameters()) out[m->layer_name(i) + "." + item.key()] = item.value();
  return out;
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).norm() / std::max(b.norm().item<double>(), 1e-12)).item<double>();
}

}  // namespace

// Three groups: the engine's no-decay rule (biases, LayerNorm), fc2.weight with its own lr, the
// rest with the optimizer's own hyperparameters; a warm-up schedule scales every group's lr.
TEST(EngineGroups, ParamGroupsMatchTorchOptimGroups) {
  const int dp = world()->size(), rank = world()->rank();
  const double lr = 0.01, wd = 0.1, fc2_lr = 0.03;
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage << " dp " << dp);
    Config cfg = parse({{"train_batch_size", kBatch},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", lr}, {"weight_decay", wd}}}}},
                        {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", lr},
                                                                         {"warmup_num_steps", 3}, {"warmup_type", "linear"}}}}},
                        {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 200},
                                               {"stage3_param_persistence_threshold", 0}}}});
    torchspeed::ParamGroup fc2;
    fc2.match = [](const std::string& name, const at::Tensor&) { return name == "fc2.weight"; };
    fc2.options.lr = fc2_lr;
    auto engine = torchspeed::initialize(groups(), make_model(), cfg,
                                         {torchspeed::no_weight_decay_group(false), fc2});

    auto ref = make_model();
    auto params = named(ref);
    std::vector<at::Tensor> no_decay, fc2_w, rest;
    for (auto& [name, p] : params) {
      if (p.dim() <= 1) no_decay.push_back(p);
      else if (name == "fc2.weight") fc2_w.push_back(p);
      else rest.push_back(p);
    }
    ASSERT_EQ(no_decay.size(), 4u);  // fc1.bias, norm.weight, norm.bias, fc2.bias
    using torch::optim::AdamWOptions;
    std::vector<torch::optim::OptimizerParamGroup> pg;
    pg.emplace_back(rest, std::make_unique<AdamWOptions>(AdamWOptions(lr).weight_decay(wd)));
    pg.emplace_back(no_decay, std::make_unique<AdamWOptions>(AdamWOptions(lr).weight_decay(0.0)));
    pg.emplace_back(fc2_w, std::make_unique<AdamWOptions>(AdamWOptions(fc2_lr).weight_decay(wd)));
    torch::optim::AdamW opt(pg, AdamWOptions(lr));
    torchspeed::optim::LRSchedule schedule(cfg.scheduler, lr);

    const int64_t micro = kBatch / dp;
    for (int step = 0; step < 5; ++step) {
      auto [x, y] = batch(step);
      opt.zero_grad();
      ref->loss(ref->forward(x), y).backward();
      const double factor = schedule.lr() / lr;
      opt.param_groups()[0].options().set_lr(lr * factor);
      opt.param_groups()[1].options().set_lr(lr * factor);
      opt.param_groups()[2].options().set_lr(fc2_lr * factor);
      opt.step();
      schedule.step();
      engine->backward(engine->forward(x.narrow(0, rank * micro, micro), y.narrow(0, rank * micro, micro)));
      engine->step();
    }
    for (auto& [name, value] : engine->master_params()) {
      EXPECT_LE(rel_diff(value, params.at(name).detach()), 1e-5) << name;
    }
  }
}

TEST(EngineGroups, NoDecayGroupTakesOneDimensionalAndEmbeddingParameters) {
  auto g = torchspeed::no_weight_decay_group(true);
  EXPECT_TRUE(g.match("ln1.bias", at::zeros({4})));
  EXPECT_TRUE(g.match("ln1.weight", at::zeros({4})));
  EXPECT_TRUE(g.match("embed.tok.weight", at::zeros({4, 4})));
  EXPECT_TRUE(g.match("tok.weight", at::zeros({4, 4})));
  EXPECT_FALSE(g.match("qkv.weight", at::zeros({4, 4})));
  EXPECT_FALSE(torchspeed::no_weight_decay_group(false).match("tok.weight", at::zeros({4, 4})));
  EXPECT_EQ(*g.options.weight_decay, 0.0);
}

// bf16 training, 8 micro-steps per step, SGD(lr 1): the step moves each fp32 master by exactly
// the accumulated gradient, so the masters show how gradients were summed. The reference runs
// the same bf16 model on every rank's micro-batches in this process and sums its bf16
// gradients as the engine must: fp32 accumulation over micro-steps, then the mean over ranks
// (stages 0-1: of the fp32 sums; stage 2: each micro-step's bf16 mean, rounded once, then
// summed in fp32).
TEST(EngineGroups, Bf16GradientsAccumulateInFp32) {
  const int dp = world()->size(), rank = world()->rank();
  constexpr int kMicro = 8;
  for (int stage : {0, 1, 2}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage << " dp " << dp);
    Config cfg = parse({{"train_micro_batch_size_per_gpu", 2},
                        {"gradient_accumulation_steps", kMicro},
                        {"bf16", {{"enabled", true}}},
                        {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 1.0}}}}},
                        {"zero_optimization", {{"stage", stage}}}});
    auto engine = torchspeed::initialize(groups(), make_model(), cfg);

    // The reference model: the same initial values, rounded to bf16 like the engine's.
    auto ref = make_model();
    auto params = named(ref);
    std::map<std::string, at::Tensor> master, acc;
    for (auto& [name, p] : params) {
      master[name] = p.detach().clone();
      torch::NoGradGuard g;
      p.set_data(p.detach().to(at::kBFloat16));
      acc[name] = at::zeros_like(master[name]);
    }
    auto [x, y] = batch(0);
    for (int m = 0; m < kMicro; ++m) {
      std::map<std::string, at::Tensor> sum_of_ranks;
      for (int r = 0; r < dp; ++r) {
        for (auto& [name, p] : params) p.mutable_grad().reset();
        const int64_t row = ((m * dp + r) * 2) % kBatch;
        at::Tensor out = ref->forward(x.narrow(0, row, 2).to(at::kBFloat16));
        (ref->loss(out, y.narrow(0, row, 2)).to(at::kFloat) * (1.0 / kMicro)).backward();
        for (auto& [name, p] : params) {
          at::Tensor g = p.grad().to(at::kFloat);
          if (stage <= 1) acc[name] = acc[name] + g / dp;
          sum_of_ranks[name] = sum_of_ranks.count(name) ? sum_of_ranks[name] + g : g;
        }
        if (r == rank) {  // the engine sees this rank's micro-batch
          engine->backward(engine->forward(x.narrow(0, row, 2), y.narrow(0, row, 2)));
          engine->step();
        }
      }
      if (stage == 2) {  // each micro-step's mean over ranks is a bf16 reduce-scatter result
        for (auto& [name, s] : sum_of_ranks) acc[name] = acc[name] + (s / dp).to(at::kBFloat16).to(at::kFloat);
      }
    }
    EXPECT_EQ(engine->global_step(), 1);
    double worst = 0.0;
    for (auto& [name, value] : engine->master_params()) {
      const at::Tensor moved = master.at(name) - value;  // the engine's accumulated gradient
      const double d = rel_diff(moved, acc.at(name));
      worst = std::max(worst, d);
      EXPECT_LE(d, 2e-6) << name;
    }
    if (world()->rank() == 0) std::printf("stage %d: accumulated gradient max rel diff %.2e\n", stage, worst);
  }
}

// fp32 accumulation is closer to an exact (fp64) sum of the same bf16 gradients than bf16
// accumulation is: what grad_accum_dtype fp32 buys.
TEST(EngineGroups, Fp32AccumulationBeatsBf16Accumulation) {
  const int rank = world()->rank(), dp = world()->size();
  constexpr int kMicro = 32;
  std::map<std::string, double> err;
  std::map<std::string, at::Tensor> exact;
  for (const std::string accum : {"fp32", "bf16"}) {
    Config cfg = parse({{"train_micro_batch_size_per_gpu", 1}, {"gradient_accumulation_steps", kMicro},
                        {"bf16", {{"enabled", true}}}, {"data_types", {{"grad_accum_dtype", accum}}},
                        {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 1.0}}}}}});
    auto engine = torchspeed::initialize(groups(), make_model(), cfg);
    auto before = engine->master_params();
    // The exact sum, from a bf16 model in this process (fp64 accumulation).
    auto ref = make_model();
    auto params = named(ref);
    for (auto& [name, p] : params) {
      torch::NoGradGuard g;
      p.set_data(p.detach().to(at::kBFloat16));
    }
    std::map<std::string, at::Tensor> sum;
    auto [x, y] = batch(1);
    for (int m = 0; m < kMicro; ++m) {
      for (int r = 0; r < dp; ++r) {
        const int64_t row = (m * dp + r) % kBatch;
        for (auto& [name, p] : params) p.mutable_grad().reset();
        (ref->loss(ref->forward(x.narrow(0, row, 1).to(at::kBFloat16)), y.narrow(0, row, 1)).to(at::kFloat) *
         (1.0 / kMicro)).backward();
        for (auto& [name, p] : params) {
          at::Tensor g = p.grad().to(at::kDouble) / dp;
          sum[name] = sum.count(name) ? sum[name] + g : g;
        }
        if (r == rank) {
          engine->backward(engine->forward(x.narrow(0, row, 1), y.narrow(0, row, 1)));
          engine->step();
        }
      }
    }
    auto after = engine->master_params();
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < after.size(); ++i) {
      at::Tensor moved = (before[i].second - after[i].second).to(at::kDouble);
      num += (moved - sum.at(after[i].first)).pow(2).sum().item<double>();
      den += sum.at(after[i].first).pow(2).sum().item<double>();
    }
    err[accum] = std::sqrt(num / den);
  }
  if (rank == 0) std::printf("relative error of the accumulated gradient: fp32 %.2e, bf16 %.2e\n", err["fp32"], err["bf16"]);
  EXPECT_LT(err["fp32"], 1e-5);
  EXPECT_GT(err["bf16"], 4.0 * err["fp32"]);
}
