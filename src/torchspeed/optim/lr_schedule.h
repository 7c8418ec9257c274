// Learning-rate schedules with DeepSpeed's names, parameters and formulas
// (deepspeed/runtime/lr_schedules.py): WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
// LRRangeTest, or a constant LR. As in DeepSpeed, the schedule advances once per applied
// optimizer step (a skipped fp16 step does not advance it) and the first step runs at the
// optimizer's LR, except OneCycle and LRRangeTest which set their starting LR at creation.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>

#include "torchspeed/config/config.h"

namespace torchspeed::optim {

class LRSchedule {
 public:
  // `base_lr` is the optimizer's lr; `base_beta1` its first beta (OneCycle cycles it).
  LRSchedule(const config::SchedulerConfig& config, double base_lr, double base_beta1 = 0.9);

  // LR for the next optimizer step.
  double lr() const;
  // beta1 for the next step when the schedule cycles momentum, else nullopt.
  std::optional<double> beta1() const;
  // Called after each applied optimizer step.
  void step() { ++last_batch_iteration_; }
  int64_t last_batch_iteration() const { return last_batch_iteration_; }

  // The LR DeepSpeed's scheduler returns at `iteration` (its get_lr()).
  double lr_at(int64_t iteration) const;

  nlohmann::json state() const { return {{"last_batch_iteration", last_batch_iteration_}}; }
  void load_state(const nlohmann::json& s);

 private:
  double warmup_gamma(int64_t it) const;
  double one_cycle_scale(int64_t it) const;
  config::SchedulerConfig config_;
  double base_lr_, base_beta1_;
  int64_t last_batch_iteration_ = -1;
};

}  // namespace torchspeed::optim
