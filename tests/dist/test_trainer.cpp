// The library Trainer (engine/trainer.h) on several ranks: its observers see every step with the
// validation cadence, checkpoints land at their interval, a stop asked by one rank stops every
// rank after the same step, and resuming from that checkpoint continues exactly as the
// uninterrupted run (the data's position included).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <filesystem>

#include "dist_util.h"
#include "torchspeed/engine/trainer.h"

using torchspeed::Engine;
using torchspeed::TrainData;
using torchspeed::Trainer;
using torchspeed::TrainerOptions;
using ts_test::world;

namespace {

constexpr int64_t kMicro = 4, kIn = 8, kOut = 4;

// Batches drawn from a seed and a position: the state a checkpoint keeps.
struct Loader {
  struct Batch {
    at::Tensor inputs, targets;
  };
  int64_t position = 0;
  int rank = 0;
  Batch next() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * (position++) + rank);
    at::Tensor x = at::randn({kMicro, kIn}, gen);
    return {x, x.narrow(1, 0, kOut) * 2.0};
  }
  nlohmann::json state() const { return {{"position", position}}; }
  void load_state(const nlohmann::json& s) { position = s.at("position").get<int64_t>(); }
};

std::unique_ptr<Engine> make_engine() {
  torch::manual_seed(7);
  torchspeed::nn::LayerStack s;
  s->add("fc1", torch::nn::Linear(kIn, 32)).add("act", torch::nn::Functional(torch::tanh)).add("fc2", torch::nn::Linear(32, kOut));
  s->set_loss([](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out.to(at::kFloat), t); });
  auto cfg = ts_test::parse_config({{"train_micro_batch_size_per_gpu", kMicro},
                                    {"gradient_accumulation_steps", 2},
                                    {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                                    {"zero_optimization", {{"stage", 2}}}});
  return torchspeed::initialize(ts_test::dp_groups(), s, cfg);
}

// Every report, in order.
struct Recorder final : torchspeed::monitor::StepObserver {
  std::vector<torchspeed::monitor::StepReport> steps;
  std::vector<int64_t> checkpoints;
  int ends = 0;
  bool interrupted = false;
  void on_step(const torchspeed::monitor::StepReport& r, double) override { steps.push_back(r); }
  void on_checkpoint(int64_t step, const std::string&) override { checkpoints.push_back(step); }
  void on_end(int64_t, bool i) override {
    ++ends;
    interrupted = i;
  }
};

std::string shared_dir(const std::string& name) {
  std::string dir = (std::filesystem::temp_directory_path() / ("ts_trainer_" + name)).string();
  if (world()->rank() == 0) std::filesystem::remove_all(dir);
  world()->barrier();
  return dir;
}

}  // namespace

TEST(Trainer, ObserversCadenceStopAgreementAndExactResume) {
  const int rank = world()->rank();
  TrainerOptions opt;
  opt.steps = 8;
  opt.eval_interval = 3;
  opt.checkpoint_interval = 2;
  opt.tokens_per_step = 100;

  // The uninterrupted run.
  std::vector<double> whole_losses;
  {
    auto engine = make_engine();
    Loader train{0, rank};
    opt.checkpoint_dir = shared_dir("whole");
    Trainer t(*engine, TrainData::of(train, [&] { return Loader{1 << 20, rank}; }, 2), opt);
    auto rec = std::make_shared<Recorder>();
    t.add_observer(rec);
    const auto result = t.run();
    EXPECT_EQ(result.step, 8);
    EXPECT_FALSE(result.interrupted);
    ASSERT_TRUE(result.val_loss.has_value());
    ASSERT_EQ(rec->steps.size(), 8u);
    for (size_t i = 0; i < rec->steps.size(); ++i) {
      const auto& r = rec->steps[i];
      EXPECT_EQ(r.step, static_cast<int64_t>(i) + 1);
      EXPECT_EQ(r.samples, r.step * engine->config().train_batch_size);
      EXPECT_EQ(r.val_loss.has_value(), r.step % 3 == 0 || r.step == 8) << "step " << r.step;
      EXPECT_GT(r.tokens_per_s, 0.0);
      whole_losses.push_back(r.loss);
    }
    EXPECT_EQ(*result.val_loss, *rec->steps.back().val_loss);
    EXPECT_EQ(rec->checkpoints, (std::vector<int64_t>{2, 4, 6}));  // not at the last step
    EXPECT_TRUE(std::filesystem::exists(opt.checkpoint_dir + "/global_step6"));
    EXPECT_EQ(rec->ends, 1);
    EXPECT_LT(whole_losses.back(), whole_losses.front());
  }

  // The same run, stopped by the last rank alone after step 5, then resumed from the checkpoint
  // of step 4: every rank stopped after step 5, and steps 5-8 repeat the uninterrupted losses.
  const int last = world()->size() - 1;
  opt.checkpoint_dir = shared_dir("stopped");
  {
    auto engine = make_engine();
    Loader train{0, rank};
    int64_t seen = 0;
    opt.stop_requested = [&] { return rank == last && seen == 5; };
    Trainer t(*engine, TrainData::of(train, [&] { return Loader{1 << 20, rank}; }, 2), opt);
    auto rec = std::make_shared<Recorder>();
    t.add_observer(rec);
    t.add_observer(std::make_shared<torchspeed::monitor::StepCallback>([&](const auto& r) { seen = r.step; }));
    const auto result = t.run();
    EXPECT_TRUE(result.interrupted);
    EXPECT_EQ(result.step, 5);
    ASSERT_TRUE(result.val_loss.has_value());  // the last one measured: step 3's
    EXPECT_EQ(*result.val_loss, *rec->steps.at(2).val_loss);
    EXPECT_TRUE(rec->interrupted);
    for (size_t i = 0; i < rec->steps.size(); ++i) EXPECT_EQ(rec->steps[i].loss, whole_losses[i]);
  }
  opt.stop_requested = nullptr;
  {
    auto engine = make_engine();
    Loader train{0, rank};
    Trainer t(*engine, TrainData::of(train, [&] { return Loader{1 << 20, rank}; }, 2), opt);
    auto loaded = t.resume();
    ASSERT_TRUE(loaded.has_value());
    EXPECT_EQ(t.step(), 4);
    EXPECT_EQ(train.position, 4 * 2);  // two micro-batches per step
    auto rec = std::make_shared<Recorder>();
    t.add_observer(rec);
    const auto result = t.run();
    EXPECT_EQ(result.step, 8);
    ASSERT_EQ(rec->steps.size(), 4u);
    for (const auto& r : rec->steps) EXPECT_EQ(r.loss, whole_losses[static_cast<size_t>(r.step - 1)]) << "step " << r.step;
  }
}
