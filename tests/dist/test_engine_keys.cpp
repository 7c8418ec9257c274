// DeepSpeed config keys that change what the engine does, each shown by the behaviour it
// documents: zero_optimization.reduce_scatter (the collective gradients are averaged with),
// sub_group_size (pieces of the optimizer step), fp16.auto_cast (inputs rounded to fp16),
// stage3_gather_16bit_weights_on_model_save (save_16bit_model at stage 3), and the
// tensorboard/csv_monitor sections (files; read back in monitor_train_events).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "dist_util.h"
#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/engine/engine.h"

using torchspeed::config::Config;
using ts_test::world;

namespace {

constexpr int64_t kBatch = 8, kIn = 16, kOut = 8;

torchspeed::parallel::ParallelGroups groups() { return ts_test::dp_groups(); }
Config parse(const nlohmann::json& j) { return ts_test::parse_config(j); }

torchspeed::nn::LayerStack make_model() {
  torch::manual_seed(99);
  torchspeed::nn::LayerStack s;
  s->add("fc1", torch::nn::Linear(kIn, 64));
  s->add("act", torch::nn::Functional(torch::relu));
  s->add("fc2", torch::nn::Linear(64, kOut));
  s->set_loss([](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out.to(at::kFloat), t); });
  return s;
}

nlohmann::json base(int stage) {
  return {{"train_micro_batch_size_per_gpu", kBatch / world()->size() > 0 ? kBatch / world()->size() : 1},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.01}}}}},
          {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 300}, {"stage3_param_persistence_threshold", 0}}}};
}

std::vector<std::pair<std::string, at::Tensor>> train(torchspeed::Engine& e, int steps) {
  const int64_t micro = e.config().train_micro_batch_size_per_gpu;
  for (int s = 0; s < steps; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(10 + s);
    at::Tensor x = at::randn({kBatch, kIn}, gen), y = at::randn({kBatch, kOut}, gen);
    const int64_t row = (world()->rank() * micro) % kBatch;
    e.backward(e.forward(x.narrow(0, row, micro), y.narrow(0, row, micro)));
    e.step();
  }
  return e.master_params();
}

void expect_same(const std::vector<std::pair<std::string, at::Tensor>>& a,
                 const std::vector<std::pair<std::string, at::Tensor>>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    const double d = (a[i].second - b[i].second).abs().max().item<double>();
    EXPECT_LE(d, tol) << a[i].first;
  }
}

}  // namespace

// Stages 1 and 2 average gradients with reduce-scatter by default (a rank updates only its
// shard) and with all-reduce when reduce_scatter is false: the communicator's byte counts show
// which ran, and the trained weights agree.
TEST(EngineKeys, ReduceScatterChoosesTheGradientCollective) {
  if (world()->size() < 2) GTEST_SKIP() << "one rank reduces nothing";
  for (int stage : {1, 2}) {
    std::vector<std::pair<std::string, at::Tensor>> result[2];
    for (bool rs : {true, false}) {
      SCOPED_TRACE(testing::Message() << "stage " << stage << " reduce_scatter " << rs);
      auto g = groups();
      auto cfg = base(stage);
      cfg["zero_optimization"]["reduce_scatter"] = rs;
      auto e = torchspeed::initialize(g, make_model(), parse(cfg));
      auto before = g.dp->stats();
      result[rs] = train(*e, 3);
      auto after = g.dp->stats();
      const int64_t rs_bytes = after["reduce_scatter"].bytes - before["reduce_scatter"].bytes;
      const int64_t ar_bytes = after["all_reduce"].bytes - before["all_reduce"].bytes;
      const int64_t grads = 3 * e->num_parameters() * 4;  // fp32 gradients, 3 steps
      if (rs) {
        EXPECT_GE(rs_bytes, grads);
        EXPECT_LT(ar_bytes, grads / 10);  // the norm's 8 bytes per step
      } else {
        EXPECT_EQ(rs_bytes, 0);
        EXPECT_GE(ar_bytes, grads);
      }
    }
    expect_same(result[0], result[1], 1e-6);
  }
}

// sub_group_size splits the fused optimizer step into pieces of at most that many elements;
// the result is the same bits.
TEST(EngineKeys, SubGroupSizeSplitsTheOptimizerStep) {
  for (int stage : {0, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    auto whole = torchspeed::initialize(groups(), make_model(), parse(base(stage)));
    auto cfg = base(stage);
    cfg["zero_optimization"]["sub_group_size"] = 128;
    auto split = torchspeed::initialize(groups(), make_model(), parse(cfg));
    auto a = train(*whole, 2);
    auto b = train(*split, 2);
    expect_same(a, b, 0.0);
    const int64_t part = split->memory().optimizer_state / 8;  // AdamW: two fp32 moments
    const int64_t calls = split->timings().optimizer_sub_groups / 2;
    EXPECT_GE(calls, (part + 127) / 128);
    EXPECT_LE(calls, (part + 127) / 128 + 8);  // one partial piece per unit at most
    EXPECT_LT(whole->timings().optimizer_sub_groups, split->timings().optimizer_sub_groups);
  }
}

// fp16.auto_cast rounds floating inputs to fp16 before the model sees them; without it they
// keep fp32 precision.
TEST(EngineKeys, Fp16AutoCastRoundsInputs) {
  auto cfg = base(0);
  cfg["fp16"] = {{"enabled", true}, {"auto_cast", true}};
  auto cast = torchspeed::initialize(groups(), make_model(), parse(cfg));
  cfg["fp16"]["auto_cast"] = false;
  auto plain = torchspeed::initialize(groups(), make_model(), parse(cfg));
  cast->eval();
  plain->eval();
  at::Tensor x = at::randn({4, kIn}, at::make_generator<at::CPUGeneratorImpl>(3));
  at::Tensor rounded = x.to(at::kHalf).to(at::kFloat);
  ASSERT_FALSE(rounded.equal(x));
  EXPECT_TRUE(cast->forward(x).equal(plain->forward(rounded)));
  EXPECT_FALSE(plain->forward(x).equal(plain->forward(rounded)));
}

// save_16bit_model writes the whole model in the training dtype; at stage 3 only when
// stage3_gather_16bit_weights_on_model_save is set (DeepSpeed's rule).
TEST(EngineKeys, Save16BitModelGathersAtStage3OnlyWhenAsked) {
  const std::string dir = "engine_keys_16bit_" + std::to_string(world()->size());
  for (int stage : {2, 3}) {
    for (bool gather : {false, true}) {
      SCOPED_TRACE(testing::Message() << "stage " << stage << " gather " << gather);
      world()->barrier();  // every rank has read the previous round's file
      if (world()->rank() == 0) std::filesystem::remove_all(dir);
      world()->barrier();
      auto cfg = base(stage);
      cfg["bf16"] = {{"enabled", true}};
      cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather;
      auto e = torchspeed::initialize(groups(), make_model(), parse(cfg));
      auto masters = train(*e, 2);
      const bool saved = e->save_16bit_model(dir);
      world()->barrier();
      EXPECT_EQ(saved, stage < 3 || gather);
      const std::string file = dir + "/model.safetensors";
      EXPECT_EQ(std::filesystem::exists(file), saved);
      if (!saved) continue;
      auto f = torchspeed::checkpoint::load_safetensors(file);
      ASSERT_EQ(f.tensors.size(), masters.size());
      for (auto& [name, m] : masters) {
        const at::Tensor& t = f.at(name);
        EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
        EXPECT_TRUE(t.equal(m.to(at::kBFloat16))) << name;
      }
    }
  }
  world()->barrier();
}

// The monitors write on world rank 0 only, one point per optimizer step at step = samples.
TEST(EngineKeys, MonitorsWriteOnRankZeroAtSampleSteps) {
  const std::string dir = "engine_keys_monitor_" + std::to_string(world()->size());
  if (world()->rank() == 0) std::filesystem::remove_all(dir);
  world()->barrier();
  auto cfg = base(1);
  cfg["gradient_accumulation_steps"] = 2;
  cfg["csv_monitor"] = {{"enabled", true}, {"output_path", dir}, {"job_name", "job"}};
  auto c = parse(cfg);
  auto e = torchspeed::initialize(groups(), make_model(), c);
  train(*e, 6);  // 3 optimizer steps
  world()->barrier();
  if (world()->rank() != 0) return;
  std::ifstream in(dir + "/job/Train_Samples_lr.csv");
  ASSERT_TRUE(in.good());
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "step,lr\r");
  for (int s = 1; s <= 3; ++s) EXPECT_EQ(lines[s].rfind(std::to_string(s * c.train_batch_size) + ",0.01", 0), 0u) << lines[s];
  EXPECT_TRUE(std::filesystem::exists(dir + "/job/Train_Samples_train_loss.csv"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/job/Train_Samples_loss_scale.csv"));  // fp16 only
}
