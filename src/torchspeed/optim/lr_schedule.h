// Learning-rate schedules with DeepSpeed's names, parameters and formulas
// (deepspeed/runtime/lr_schedules.py): WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
// LRRangeTest, or a constant LR. As in DeepSpeed, the schedule advances once per applied
// optimizer step (a skipped fp16 step does not advance it) and the first step runs at the
// optimizer's LR, except OneCycle and LRRangeTest which set their starting LR at creation.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace torchspeed::optim {

// DeepSpeed's scheduler section, as the config reader fills it (config::SchedulerConfig).
struct ScheduleOptions {
  std::string type;  // "" (constant LR), WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest
  std::map<std::string, double> params;  // every parameter of `type`, defaults filled in
  std::string warmup_type = "log";       // "log" or "linear" (Warmup* schedules)
  double param(const std::string& name) const;
};

class LRSchedule {
 public:
  // `base_lr` is the optimizer's lr; `base_beta1` its first beta (OneCycle cycles it).
  LRSchedule(const ScheduleOptions& config, double base_lr, double base_beta1 = 0.9);

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
  ScheduleOptions config_;
  double base_lr_, base_beta1_;
  int64_t last_batch_iteration_ = -1;
};

}  // namespace torchspeed::optim
