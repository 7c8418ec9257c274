// The training components' options from a DeepSpeed config: the precision and the loss scaler
// (bf16, fp16 sections), the optimizer (optimizer section, parameter groups) and ZeRO
// (zero_optimization, data_types, communication_data_type, gradient pre-division). The config
// was validated when loaded (config/config.cpp); these only map it.
#pragma once

#include <vector>

#include "torchspeed/config/config.h"
#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/zero/named_params.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero {

precision::Precision precision_of(const config::Config& c);
precision::LossScaler loss_scaler_of(const config::Config& c);  // LossScaler::none() without fp16
OptimizerSpec optimizer_spec_of(const config::Config& c, const std::vector<ParamGroup>& groups);
// Everything but norm_group, which depends on the process grid the engine runs in.
ZeroOptions zero_options_of(const config::Config& c);

}  // namespace torchspeed::zero
