// LossScaler: DeepSpeed's fp16 loss scaling, one implementation for every path. Static
// (loss_scale > 0: constant) or dynamic: start at 2^initial_scale_power; on overflow the step is
// skipped and, once `hysteresis` overflows have been absorbed, the scale halves (never below
// min_loss_scale); after loss_scale_window steps without overflow it doubles.
// bf16 and fp32 use a static scale of 1 (overflow still skips the step).
#pragma once

#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include <cstdint>

namespace torchspeed::precision {

enum class Precision { kFP32, kBF16, kFP16 };
const char* precision_name(Precision p);

struct LossScalerOptions {
  TORCH_ARG(bool, dynamic) = true;
  TORCH_ARG(double, static_scale) = 1.0;
  TORCH_ARG(int, initial_scale_power) = 16;
  TORCH_ARG(int, scale_window) = 1000;
  TORCH_ARG(int, hysteresis) = 2;  // DeepSpeed's delayed_shift
  TORCH_ARG(bool, consecutive_hysteresis) = false;
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, scale_factor) = 2.0;
  // Throw when an overflow happens at the minimum scale (DeepSpeed's raise_error_at_min_scale).
  TORCH_ARG(bool, raise_error_at_min_scale) = true;
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = LossScalerOptions());
  static LossScaler none() { return LossScaler(LossScalerOptions().dynamic(false).static_scale(1.0)); }

  double scale() const { return scale_; }
  // Records one optimizer step's outcome (overflow = the step is skipped) and updates the scale.
  void update(bool overflow);
  const LossScalerOptions& options() const { return options_; }

  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t iter_ = 0;
  int64_t last_overflow_iter_ = -1;
  int hysteresis_left_;
};

}  // namespace torchspeed::precision
