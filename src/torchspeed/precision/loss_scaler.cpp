// DeepSpeed's DynamicLossScaler.update_scale, step for step (deepspeed/runtime/fp16/loss_scaler.py).
#include "torchspeed/precision/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "torchspeed/base/error.h"

namespace torchspeed::precision {

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kBF16: return "bf16";
    case Precision::kFP16: return "fp16";
    default: return "fp32";
  }
}

LossScaler::LossScaler(LossScalerOptions options) : options_(options) {
  TS_CHECK(options_.scale_window() >= 1, "loss scaler: loss_scale_window must be >= 1");
  TS_CHECK(options_.hysteresis() >= 1, "loss scaler: hysteresis must be >= 1");
  TS_CHECK(options_.dynamic() || options_.static_scale() > 0, "loss scaler: a static scale must be > 0");
  scale_ = options_.dynamic() ? std::ldexp(1.0, options_.initial_scale_power()) : options_.static_scale();
  hysteresis_left_ = options_.hysteresis();
}

void LossScaler::update(bool overflow) {
  if (!options_.dynamic()) {
    ++iter_;
    return;
  }
  if (overflow) {
    if (options_.hysteresis() == 1 || hysteresis_left_ == 1) {
      TS_CHECK(!(scale_ == options_.min_scale() && options_.raise_error_at_min_scale()),
               "fp16 gradients overflow at the minimum loss scale ", options_.min_scale(),
               " (fp16.min_loss_scale): training diverged; lower the learning rate, enable "
               "gradient_clipping, or use bf16");
      scale_ = std::max(scale_ / options_.scale_factor(), options_.min_scale());
    } else {
      --hysteresis_left_;
    }
    last_overflow_iter_ = iter_;
  } else {
    if (options_.consecutive_hysteresis()) hysteresis_left_ = options_.hysteresis();
    if ((iter_ - last_overflow_iter_) % options_.scale_window() == 0) {
      if (!options_.consecutive_hysteresis()) hysteresis_left_ = options_.hysteresis();
      scale_ *= options_.scale_factor();
    }
  }
  ++iter_;
}

nlohmann::json LossScaler::state() const {
  return {{"scale", scale_}, {"iter", iter_}, {"last_overflow_iter", last_overflow_iter_},
          {"hysteresis_left", hysteresis_left_}};
}

void LossScaler::load_state(const nlohmann::json& s) {
  TS_CHECK(s.is_object() && s.contains("scale") && s.contains("iter"),
           "loss scaler state: expected {scale, iter, last_overflow_iter, hysteresis_left}, got ", s.dump());
  scale_ = s.at("scale").get<double>();
  iter_ = s.at("iter").get<int64_t>();
  last_overflow_iter_ = s.value("last_overflow_iter", int64_t{-1});
  hysteresis_left_ = s.value("hysteresis_left", options_.hysteresis());
}

}  // namespace torchspeed::precision
