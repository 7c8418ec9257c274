// LR schedules against DeepSpeed's formulas, evaluated by hand at chosen steps.
#include <gtest/gtest.h>

#include <cmath>

#include "torchspeed/config/config.h"
#include "torchspeed/optim/lr_schedule.h"

using torchspeed::config::Config;
using torchspeed::optim::LRSchedule;

namespace {
torchspeed::config::SchedulerConfig sched(const nlohmann::json& s) {
  return Config::parse({{"train_batch_size", 1}, {"scheduler", s}}).scheduler;
}
}  // namespace

TEST(LRSchedule, WarmupLRLogAndLinear) {
  LRSchedule log(sched({{"type", "WarmupLR"}, {"params", {{"warmup_min_lr", 0.001}, {"warmup_max_lr", 0.01}, {"warmup_num_steps", 10}}}}), 0.5);
  EXPECT_DOUBLE_EQ(log.lr_at(0), 0.001);                                        // log(1) = 0
  EXPECT_NEAR(log.lr_at(4), 0.001 + 0.009 * std::log(5.0) / std::log(10.0), 1e-15);
  EXPECT_DOUBLE_EQ(log.lr_at(10), 0.01);
  EXPECT_DOUBLE_EQ(log.lr_at(1000), 0.01);
  // Before the first scheduler step DeepSpeed leaves the optimizer's lr in place.
  EXPECT_DOUBLE_EQ(log.lr(), 0.5);
  log.step();
  EXPECT_DOUBLE_EQ(log.lr(), 0.001);
  LRSchedule lin(sched({{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 0.01}, {"warmup_num_steps", 10}, {"warmup_type", "linear"}}}}), 0.5);
  EXPECT_NEAR(lin.lr_at(4), 0.004, 1e-15);
}

TEST(LRSchedule, WarmupDecayLR) {
  LRSchedule s(sched({{"type", "WarmupDecayLR"}, {"params", {{"warmup_max_lr", 0.01}, {"warmup_num_steps", 10}, {"total_num_steps", 110}, {"warmup_type", "linear"}}}}), 0.5);
  EXPECT_NEAR(s.lr_at(5), 0.005, 1e-15);
  EXPECT_NEAR(s.lr_at(10), 0.01 * (110 - 10) / 100.0, 1e-15);
  EXPECT_NEAR(s.lr_at(60), 0.01 * (110 - 60) / 100.0, 1e-15);
  EXPECT_DOUBLE_EQ(s.lr_at(200), 0.0);  // clamped at 0
}

TEST(LRSchedule, WarmupCosineLR) {
  LRSchedule s(sched({{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 110}, {"warmup_num_steps", 10}, {"warmup_min_ratio", 0.1}, {"cos_min_ratio", 0.01}, {"warmup_type", "linear"}}}}), 0.2);
  EXPECT_NEAR(s.lr_at(5), 0.2 * (0.1 + 0.5 * 0.9), 1e-15);
  // After warm-up: real step = it - warmup + 1 over total - warmup.
  const double r60 = 0.01 + 0.99 * (1 + std::cos(M_PI * 51.0 / 100.0)) / 2;
  EXPECT_NEAR(s.lr_at(60), 0.2 * r60, 1e-15);
  EXPECT_NEAR(s.lr_at(109), 0.2 * 0.01, 1e-15);
}

TEST(LRSchedule, OneCycleLRAndMomentum) {
  LRSchedule s(sched({{"type", "OneCycle"}, {"params", {{"cycle_min_lr", 0.001}, {"cycle_max_lr", 0.011}, {"cycle_first_step_size", 10}, {"decay_lr_rate", 0.5}, {"decay_step_size", 4}, {"cycle_min_mom", 0.8}, {"cycle_max_mom", 0.9}}}}), 0.5);
  EXPECT_DOUBLE_EQ(s.lr(), 0.001);  // set at creation, as DeepSpeed's OneCycle does
  EXPECT_NEAR(s.lr_at(5), 0.006, 1e-15);   // halfway up
  EXPECT_NEAR(s.lr_at(10), 0.011, 1e-15);  // peak
  EXPECT_NEAR(s.lr_at(15), 0.006, 1e-15);  // halfway down (second step size = first)
  // Past the cycle (20 steps): decay by 1 + rate * (it - 20 + 1) / decay_step_size.
  EXPECT_NEAR(s.lr_at(23), 0.001 / (1 + 0.5 * 4 / 4.0), 1e-15);
  for (int i = 0; i < 6; ++i) s.step();  // last iteration 5
  ASSERT_TRUE(s.beta1().has_value());
  EXPECT_NEAR(*s.beta1(), 0.85, 1e-12);  // momentum falls as lr rises
}

TEST(LRSchedule, LRRangeTestAndConstant) {
  LRSchedule s(sched({{"type", "LRRangeTest"}, {"params", {{"lr_range_test_min_lr", 0.001}, {"lr_range_test_step_size", 10}, {"lr_range_test_step_rate", 2.0}, {"lr_range_test_staircase", true}}}}), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(8), 0.001);          // floor(9 / 10) = 0
  EXPECT_DOUBLE_EQ(s.lr_at(9), 0.001 * 3.0);    // floor(10 / 10) = 1
  LRSchedule none(torchspeed::config::SchedulerConfig{}, 0.25);
  EXPECT_DOUBLE_EQ(none.lr(), 0.25);
  none.step();
  EXPECT_DOUBLE_EQ(none.lr(), 0.25);
  EXPECT_EQ(none.state()["last_batch_iteration"], 0);
}
