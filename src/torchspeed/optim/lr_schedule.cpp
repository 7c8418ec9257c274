// The schedule formulas, following deepspeed/runtime/lr_schedules.py.
#include "torchspeed/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "torchspeed/base/error.h"

namespace torchspeed::optim {

double ScheduleOptions::param(const std::string& name) const {
  auto it = params.find(name);
  TS_CHECK(it != params.end(), "scheduler ", type, " has no parameter '", name, "'");
  return it->second;
}

LRSchedule::LRSchedule(const ScheduleOptions& config, double base_lr, double base_beta1)
    : config_(config), base_lr_(base_lr), base_beta1_(base_beta1) {}

double LRSchedule::warmup_gamma(int64_t it) const {
  const double steps = std::max(2.0, config_.param("warmup_num_steps"));
  if (it < steps) {
    if (config_.warmup_type == "linear") return static_cast<double>(it) / steps;
    return std::log(static_cast<double>(it + 1)) / std::log(steps);
  }
  return -1.0;  // past warm-up
}

double LRSchedule::one_cycle_scale(int64_t it) const {
  const double first = config_.param("cycle_first_step_size");
  const double total = first + config_.param("cycle_second_step_size");
  const double step_ratio = first / total;
  const double cycle = std::floor(1.0 + it / total);
  const double x = 1.0 + it / total - cycle;
  return x <= step_ratio ? x / step_ratio : (x - 1.0) / (step_ratio - 1.0);
}

double LRSchedule::lr_at(int64_t it) const {
  const std::string& t = config_.type;
  if (t.empty()) return base_lr_;
  if (t == "WarmupLR" || t == "WarmupDecayLR") {
    if (it < 0) return 0.0;
    const double min_lr = config_.param("warmup_min_lr"), max_lr = config_.param("warmup_max_lr");
    double gamma = warmup_gamma(it);
    if (gamma < 0) {
      gamma = 1.0;
      if (t == "WarmupDecayLR") {
        const double total = config_.param("total_num_steps");
        const double warm = std::max(2.0, config_.param("warmup_num_steps"));
        gamma = std::max(0.0, (total - it) / std::max(1.0, total - warm));
      }
    }
    return min_lr + (max_lr - min_lr) * gamma;
  }
  if (t == "WarmupCosineLR") {
    if (it < 0) return 0.0;
    const double warm = std::max(2.0, config_.param("warmup_num_steps"));
    double ratio;
    if (it < warm) {
      const double g = warmup_gamma(it);
      const double min_ratio = config_.param("warmup_min_ratio");
      ratio = min_ratio + g * (1.0 - min_ratio);
    } else {
      const double real_last = it - warm + 1, real_total = config_.param("total_num_steps") - warm;
      const double cos_min = config_.param("cos_min_ratio");
      ratio = std::max(0.0, cos_min + (1.0 - cos_min) * (1.0 + std::cos(M_PI * real_last / real_total)) / 2.0);
    }
    return base_lr_ * ratio;
  }
  if (t == "OneCycle") {
    const double min_lr = config_.param("cycle_min_lr"), max_lr = config_.param("cycle_max_lr");
    const double total = config_.param("cycle_first_step_size") + config_.param("cycle_second_step_size");
    if (it < 0) return min_lr;
    if (it < total) return min_lr + (max_lr - min_lr) * one_cycle_scale(it);
    const double decay_step = config_.param("decay_step_size");
    if (decay_step <= 0) return min_lr;  // DeepSpeed's skip_lr_decay
    const double interval = (it - total + 1) / decay_step;
    return min_lr / (1.0 + config_.param("decay_lr_rate") * interval);
  }
  if (t == "LRRangeTest") {
    const double min_lr = config_.param("lr_range_test_min_lr");
    if (it < 0) return min_lr;
    double interval = (it + 1) / config_.param("lr_range_test_step_size");
    if (config_.param("lr_range_test_staircase") != 0.0) interval = std::floor(interval);
    return min_lr * (1.0 + interval * config_.param("lr_range_test_step_rate"));
  }
  TS_CHECK(false, "scheduler.type: unknown schedule '", t, "'");
}

double LRSchedule::lr() const {
  // Before the first scheduler step DeepSpeed's Warmup* schedules leave the optimizer's lr in
  // place; OneCycle and LRRangeTest set their starting lr when created.
  if (last_batch_iteration_ < 0 && config_.type.rfind("Warmup", 0) == 0) return base_lr_;
  return lr_at(last_batch_iteration_);
}

std::optional<double> LRSchedule::beta1() const {
  if (config_.type != "OneCycle" || config_.param("cycle_momentum") == 0.0) return std::nullopt;
  const double min_mom = config_.param("cycle_min_mom"), max_mom = config_.param("cycle_max_mom");
  const int64_t it = last_batch_iteration_;
  if (it < 0) return min_mom;
  const double total = config_.param("cycle_first_step_size") + config_.param("cycle_second_step_size");
  if (it < total) return max_mom - (max_mom - min_mom) * one_cycle_scale(it);
  const double decay_step = config_.param("decay_step_size");
  if (decay_step <= 0) return max_mom;
  const double interval = (it - total + 1) / decay_step;
  return max_mom * (1.0 + config_.param("decay_mom_rate") * interval);
}

void LRSchedule::load_state(const nlohmann::json& s) {
  TS_CHECK(s.is_object() && s.contains("last_batch_iteration"),
           "LR schedule state: expected {last_batch_iteration}, got ", s.dump());
  last_batch_iteration_ = s.at("last_batch_iteration").get<int64_t>();
}

}  // namespace torchspeed::optim
