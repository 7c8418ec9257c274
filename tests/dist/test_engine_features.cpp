// Engine behaviour that parity alone does not show: clipping against a hand computation, fp16
// loss scaling with an overflow injected on one rank (every rank skips, parameters unchanged,
// the LR schedule does not advance), fp16 parameter rounding, and memory accounting.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "dist_util.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/base/memory_counter.h"

using torchspeed::config::Config;
using ts_test::world;

namespace {
torchspeed::parallel::ParallelGroups groups() { return ts_test::dp_groups(); }
Config parse(const nlohmann::json& j) { return ts_test::parse_config(j); }
torchspeed::nn::LayerStack one_linear(std::vector<float> w) {
  torchspeed::nn::LayerStack s;
  auto lin = torch::nn::Linear(torch::nn::LinearOptions(static_cast<int64_t>(w.size()), 1).bias(false));
  {
    torch::NoGradGuard g;
    lin->weight.copy_(at::tensor(w).view({1, -1}));
  }
  s->add("lin", lin);
  s->set_loss([](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out.to(at::kFloat), t); });
  return s;
}
}  // namespace

TEST(EngineFeatures, ClippingMatchesAHandComputation) {
  // w = [1, 1], x = [3, 4], target 0: out = 7, loss = out^2, dloss/dw = 2 * 7 * x = [42, 56],
  // |g| = 70. Clip at 7: g' = g * 7 / (70 + 1e-6). SGD lr 1: w' = w - g'.
  for (int stage : {0, 1, 2, 3}) {
    Config cfg = parse({{"train_micro_batch_size_per_gpu", 1}, {"gradient_clipping", 7.0},
                        {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 1.0}}}}},
                        {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}});
    auto engine = torchspeed::initialize(groups(), one_linear({1.0f, 1.0f}), cfg);
    engine->backward(engine->forward(at::tensor({3.0f, 4.0f}).view({1, 2}), at::zeros({1, 1})));
    engine->step();
    EXPECT_NEAR(engine->grad_norm(), 70.0, 1e-4) << "stage " << stage;
    const double c = 7.0 / (70.0 + 1e-6);
    auto w = engine->master_params().at(0).second;
    EXPECT_NEAR(w[0][0].item<double>(), 1.0 - 42.0 * c, 1e-5) << "stage " << stage;
    EXPECT_NEAR(w[0][1].item<double>(), 1.0 - 56.0 * c, 1e-5) << "stage " << stage;
  }
}

TEST(EngineFeatures, Fp16OverflowOnOneRankSkipsTheStepEverywhere) {
  auto w = world();
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    Config cfg = parse({{"train_micro_batch_size_per_gpu", 2},
                        {"fp16", {{"enabled", true}, {"initial_scale_power", 8}, {"hysteresis", 2}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                        {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_min_lr", 0.001}, {"warmup_max_lr", 0.01}, {"warmup_num_steps", 5}}}}},
                        {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}});
    torch::manual_seed(5);
    torchspeed::nn::LayerStack model;
    model->add("fc1", torch::nn::Linear(4, 16));
    model->add("fc2", torch::nn::Linear(16, 2));
    model->set_loss([](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); });
    auto engine = torchspeed::initialize(groups(), model, cfg);
    // fp16 parameters hold fp16-representable values.
    if (stage < 3) {
      for (auto& p : engine->module()->parameters()) EXPECT_TRUE(at::equal(p, p.to(at::kHalf).to(at::kFloat)));
    }
    auto train_step = [&](bool poison) {
      at::Tensor x = at::randn({2, 4}), y = at::randn({2, 2});
      if (poison && w->rank() == w->size() - 1) x[0][0] = std::numeric_limits<float>::infinity();
      engine->backward(engine->forward(x, y));
      engine->step();
    };
    train_step(false);
    EXPECT_EQ(engine->loss_scale(), 256.0);
    const double lr_before = engine->lr();
    auto before = engine->master_params();
    train_step(true);  // only the last rank sees inf
    EXPECT_EQ(engine->skipped_steps(), 1);
    EXPECT_EQ(engine->global_step(), 2);
    EXPECT_EQ(engine->loss_scale(), 256.0);  // hysteresis 2 absorbs the first overflow
    EXPECT_EQ(engine->lr(), lr_before);      // a skipped step does not advance the schedule
    auto after = engine->master_params();
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i].second, after[i].second)) << before[i].first;
    train_step(true);
    EXPECT_EQ(engine->skipped_steps(), 2);
    EXPECT_EQ(engine->loss_scale(), 128.0);  // now it halves
    train_step(false);
    EXPECT_EQ(engine->skipped_steps(), 2);
    EXPECT_NE(engine->lr(), lr_before);
    auto moved = engine->master_params();
    EXPECT_FALSE(at::equal(moved[0].second, after[0].second));
  }
}

TEST(EngineFeatures, MemoryAccountingFollowsTheStage) {
  auto w = world();
  const int dp = w->size();
  torch::manual_seed(3);
  // Gradients accumulate in fp32 by default (4 bytes each), in bf16 with grad_accum_dtype bf16.
  for (const std::string accum : {"fp32", "bf16"}) {
  const double grad_bytes = accum == "fp32" ? 4.0 : 2.0;
  int64_t prev_total = -1;
  for (int stage : {0, 1, 2, 3}) {
    torchspeed::nn::LayerStack model;
    for (int i = 0; i < 4; ++i) model->add("fc" + std::to_string(i), torch::nn::Linear(64, 64));
    Config cfg = parse({{"train_micro_batch_size_per_gpu", 1}, {"bf16", {{"enabled", true}}},
                        {"data_types", {{"grad_accum_dtype", accum}}},
                        {"optimizer", {{"type", "AdamW"}}},
                        {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}});
    auto engine = torchspeed::initialize(groups(), model, cfg);
    auto m = engine->memory();
    const int64_t psi = engine->num_parameters();  // 4 x (64 x 64 + 64)
    EXPECT_EQ(psi, 4 * (64 * 64 + 64));
    // Padding adds at most 16 x dp elements per unit (4 units at most here).
    const double slack = 4.0 * 16 * dp * 16;
    auto near = [&](int64_t got, double want) { EXPECT_NEAR(static_cast<double>(got), want, slack) << "stage " << stage; };
    near(m.params, stage == 3 ? 2.0 * psi / dp : 2.0 * psi);
    near(m.gradients, stage >= 2 ? grad_bytes * psi / dp : grad_bytes * psi);
    near(m.master, stage >= 1 ? 4.0 * psi / dp : 4.0 * psi);
    near(m.optimizer_state, stage >= 1 ? 8.0 * psi / dp : 8.0 * psi);
    if (dp > 1 && prev_total >= 0) {
      EXPECT_LT(m.total(), prev_total) << "stage " << stage;
    }
    prev_total = m.total();
  }
  }
}

TEST(EngineFeatures, OverlapLaunchesBucketsDuringBackward) {
  for (bool overlap : {true, false}) {
    torch::manual_seed(2);
    torchspeed::nn::LayerStack model;
    for (int i = 0; i < 4; ++i) model->add("fc" + std::to_string(i), torch::nn::Linear(32, 32));
    model->set_loss([](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); });
    // A bucket per layer (32 x 32 + 32 = 1056 elements), reduced in fixed order.
    Config cfg = parse({{"train_micro_batch_size_per_gpu", 2}, {"optimizer", {{"type", "AdamW"}}},
                        {"zero_optimization", {{"stage", 1}, {"overlap_comm", overlap}, {"reduce_bucket_size", 1000}}}});
    auto engine = torchspeed::initialize(groups(), model, cfg);
    engine->backward(engine->forward(at::randn({2, 32}), at::randn({2, 32})));
    engine->step();
    auto t = engine->timings();
    EXPECT_EQ(t.buckets_launched_in_backward + t.buckets_launched_after, 4);
    // Every bucket starts from a gradient hook, while backward still runs (with overlap it runs
    // on while the reduction is in flight, without it the hook waits), as DeepSpeed reduces a
    // full bucket in either mode.
    EXPECT_EQ(t.buckets_launched_in_backward, 4);
  }
}

TEST(EngineFeatures, StageTwoNeverHoldsTheWholeGradientInBackward) {
  // ZeRO-2 keeps only this rank's gradient partition: without overlap_comm (DeepSpeed's default)
  // each bucket is reduced when full and its gradient freed, during backward. (With overlap the
  // buckets in flight at once depend on the progress thread's pace; not bounded here.) Eight layers of 256 x 256 (a bucket
  // each): the whole fp32 gradient is 2.1 MB; backward's peak above the state at rest stays
  // near two buckets' worth (the bucket being filled, autograd's next weight gradient, the
  // reduce-scatter output).
  auto& counter = torchspeed::count_cpu_allocations();
  for (bool overlap : {false}) {
    torch::manual_seed(4);
    torchspeed::nn::LayerStack model;
    for (int i = 0; i < 8; ++i) model->add("fc" + std::to_string(i), torch::nn::Linear(256, 256));
    model->set_loss([](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); });
    Config cfg = parse({{"train_micro_batch_size_per_gpu", 2}, {"optimizer", {{"type", "AdamW"}}},
                        {"zero_optimization", {{"stage", 2}, {"overlap_comm", overlap}, {"reduce_bucket_size", 60000}}}});
    auto engine = torchspeed::initialize(groups(), model, cfg);
    const int64_t grad_bytes = engine->num_parameters() * 4;
    // One step first: the gradient partition is allocated by the first backward that needs it.
    engine->backward(engine->forward(at::randn({2, 256}), at::randn({2, 256})));
    engine->step();
    at::Tensor loss = engine->forward(at::randn({2, 256}), at::randn({2, 256}));
    counter.reset_peak();
    const int64_t before = counter.live();
    engine->backward(loss);
    const int64_t peak = counter.peak() - before;
    engine->step();
    EXPECT_LT(peak, grad_bytes / 2) << "overlap_comm " << overlap << ": backward's peak " << peak
                                    << " bytes against a whole gradient of " << grad_bytes;
  }
}

TEST(EngineFeatures, ExportedStateResumesBitIdentically) {
  for (int stage : {0, 1, 2, 3}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(testing::Message() << "stage " << stage << (bf16 ? " bf16" : " fp32"));
      Config cfg = parse({{"train_micro_batch_size_per_gpu", 2}, {"bf16", {{"enabled", bf16}}},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                          {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 10}}}}},
                          {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}});
      auto make = [] {
        torch::manual_seed(9);
        torchspeed::nn::LayerStack m;
        m->add("fc1", torch::nn::Linear(6, 12));
        m->add("fc2", torch::nn::Linear(12, 3));
        m->set_loss([](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o.to(at::kFloat), t); });
        return m;
      };
      auto batch = [](int step) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step * 10 + world()->rank());
        return std::make_pair(at::randn({2, 6}, gen), at::randn({2, 3}, gen));
      };
      auto run = [&](torchspeed::Engine& e, int from, int to) {
        for (int s = from; s < to; ++s) {
          auto [x, y] = batch(s);
          e.backward(e.forward(x, y));
          e.step();
        }
      };
      auto straight = torchspeed::initialize(groups(), make(), cfg);
      run(*straight, 0, 6);
      auto first = torchspeed::initialize(groups(), make(), cfg);
      run(*first, 0, 3);
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      nlohmann::json state = first->export_state(tensors);
      auto resumed = torchspeed::initialize(groups(), make(), cfg);  // fresh weights
      resumed->import_state(state, tensors);
      EXPECT_EQ(resumed->global_step(), 3);
      EXPECT_EQ(resumed->lr(), first->lr());
      run(*resumed, 3, 6);
      auto a = straight->master_params(), b = resumed->master_params();
      for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
    }
  }
}

TEST(EngineFeatures, PredivideAndPrescaleAverageLikeTheDefault) {
  // DeepSpeed's gradient_predivide_factor (divide by f before the sum, by dp/f after) and
  // prescale_gradients (divide by dp before) must give the mean gradient, as the default does.
  // SGD without clipping is sensitive to the gradients' scale.
  auto run = [&](int stage, nlohmann::json extra) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 2},
                        {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}}}}},
                        {"zero_optimization", {{"stage", stage}}}};
    j.update(extra);
    torch::manual_seed(4);
    torchspeed::nn::LayerStack m;
    m->add("fc", torch::nn::Linear(5, 3));
    m->set_loss([](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); });
    auto e = torchspeed::initialize(groups(), m, parse(j));
    for (int s = 0; s < 3; ++s) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + s * 10 + world()->rank());
      e->backward(e->forward(at::randn({2, 5}, gen), at::randn({2, 3}, gen)));
      e->step();
    }
    return e->master_params();
  };
  for (int stage : {0, 2}) {
    auto base = run(stage, nlohmann::json::object());
    for (const auto& extra : {nlohmann::json{{"gradient_predivide_factor", 2.0}},
                              nlohmann::json{{"prescale_gradients", true}}}) {
      auto other = run(stage, extra);
      for (size_t i = 0; i < base.size(); ++i) {
        EXPECT_TRUE(at::allclose(base[i].second, other[i].second, 1e-6, 1e-7)) << "stage " << stage << " " << extra.dump();
      }
    }
  }
}

// Activation checkpointing keeps only each segment's input in forward: the peak of bytes live in
// LibTorch's CPU allocator during forward + backward drops (measured), and the gradients are
// bit-identical because the replay reuses the forward's RNG state (dropout on).
TEST(EngineFeatures, ActivationCheckpointingLowersPeakMemoryWithIdenticalGradients) {
  auto& counter = torchspeed::count_cpu_allocations();
  torchspeed::models::GPTConfig g;
  g.vocab = 64;
  g.seq_len = 64;
  g.d_model = 64;
  g.n_layer = 4;
  g.n_head = 4;
  g.dropout = 0.1;
  auto self = world()->split(world()->rank(), 0, "self");
  auto run = [&](int interval, int64_t* peak) {
    torchspeed::config::WorldShape one;
    one.world_size = 1;
    Config cfg = Config::parse({{"train_micro_batch_size_per_gpu", 16},
                                {"optimizer", {{"type", "AdamW"}}},
                                {"pipeline", {{"activation_checkpoint_interval", interval}}}},
                               one);
    auto e = torchspeed::initialize(torchspeed::parallel::make_parallel_groups(self, torchspeed::parallel::ProcessGrid(1)),
                                    torchspeed::models::gpt_spec(g, 3), cfg);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
    at::Tensor t = at::randint(0, 64, {16, 65}, gen, at::kLong);
    torch::manual_seed(5);  // the dropout masks
    counter.reset_peak();
    const int64_t before = counter.live();
    e->backward(e->forward(t.narrow(1, 0, 64).contiguous(), t.narrow(1, 1, 64).contiguous()));
    *peak = counter.peak() - before;
    std::vector<at::Tensor> grads;
    for (const auto& p : e->module()->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  int64_t peak_plain = 0, peak_ckpt = 0;
  const auto plain = run(0, &peak_plain);
  const auto ckpt = run(1, &peak_ckpt);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(plain[i].equal(ckpt[i])) << "gradient " << i;
  if (world()->rank() == 0) {
    std::printf("activation checkpointing: peak transient bytes %.2f MB -> %.2f MB\n", peak_plain / 1e6, peak_ckpt / 1e6);
  }
  EXPECT_LT(peak_ckpt, peak_plain * 7 / 10);
}

TEST(EngineFeatures, AGraphThatOutlivesAStageThreeEngineIsAnErrorInBackward) {
  // ZeRO-3's layers reach their gatherer through the graph by a weak reference: a backward after
  // the engine is gone names the problem instead of touching freed partitions.
  Config cfg = parse({{"train_micro_batch_size_per_gpu", 2},
                      {"optimizer", {{"type", "SGD"}, {"params", {{"lr", 0.1}}}}},
                      {"zero_optimization", {{"stage", 3}, {"stage3_param_persistence_threshold", 0}}}});
  torchspeed::nn::LayerStack stack;
  for (const char* name : {"a", "b", "c"}) stack->add(name, torch::nn::Linear(4, 4));
  stack->set_loss([](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); });
  auto engine = torchspeed::initialize(groups(), stack, cfg);
  at::Tensor loss = engine->forward(at::ones({2, 4}), at::zeros({2, 4}));
  engine->backward(loss);  // with the engine alive: fine
  engine->step();
  at::Tensor dangling = engine->forward(at::ones({2, 4}), at::zeros({2, 4}));
  engine.reset();
  try {
    dangling.backward();
    FAIL() << "backward after the engine was destroyed did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no longer exists"), std::string::npos) << e.what();
  }
}

// steps_per_print, wall_clock_breakdown, memory_breakdown: every steps_per_print optimizer steps
// world rank 0 logs DeepSpeed's progress line and, when asked, the time per phase and the memory
// by kind; the other ranks log none of it, and set_progress_report(false) drops the progress line.
TEST(EngineFeatures, StepsPerPrintReportsWhatTheBreakdownKeysAsk) {
  auto captured = [](bool breakdown, bool progress) {
    Config cfg = ts_test::parse_config({{"train_micro_batch_size_per_gpu", 2},
                                        {"steps_per_print", 2},
                                        {"wall_clock_breakdown", breakdown},
                                        {"memory_breakdown", breakdown},
                                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"betas", {0.8, 0.95}}}}}},
                                        {"zero_optimization", {{"stage", 2}}}});
    auto e = torchspeed::initialize(ts_test::dp_groups(), torchspeed::models::gpt_spec(ts_test::tiny_gpt(2), 3), cfg);
    e->set_progress_report(progress);
    // The reports are info lines (the tests run at warn); the log writes to file descriptor 2:
    // point it at a file while training.
    const auto level = torchspeed::log::level();
    torchspeed::log::set_level(torchspeed::log::Level::kInfo);
    std::fflush(stderr);
    const std::string path = torchspeed::concat(testing::TempDir(), "/report-", world()->rank(), ".log");
    const int saved = dup(2), fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
    dup2(fd, 2);
    for (int s = 0; s < 5; ++s) {
      int m = 0;
      e->train_batch([&] { return ts_test::lm_batch(40, s, m++, world()->rank()); });
    }
    std::fflush(stderr);
    dup2(saved, 2);
    torchspeed::log::set_level(level);
    close(fd);
    close(saved);
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  auto count = [](const std::string& text, const std::string& needle) {
    int n = 0;
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
    return n;
  };
  const std::string full = captured(true, true), plain = captured(false, true), quiet = captured(true, false);
  const bool rank0 = world()->rank() == 0;
  // Steps 2 and 4 of 5.
  EXPECT_EQ(count(full, "step=2, skipped=0, lr=[0.001], mom=[(0.8, 0.95)]"), rank0 ? 1 : 0) << full;
  EXPECT_EQ(count(full, "step=4, skipped=0"), rank0 ? 1 : 0) << full;
  EXPECT_EQ(count(full, "time (ms) over the last 2 steps | forward: "), rank0 ? 2 : 0) << full;
  EXPECT_EQ(count(full, "memory | parameters "), rank0 ? 2 : 0) << full;
  EXPECT_EQ(count(plain, "step="), rank0 ? 2 : 0) << plain;
  EXPECT_EQ(count(plain, "time (ms)") + count(plain, "memory |"), 0) << plain;
  EXPECT_EQ(count(quiet, "step="), 0) << quiet;
  EXPECT_EQ(count(quiet, "time (ms)"), rank0 ? 2 : 0) << quiet;
}
