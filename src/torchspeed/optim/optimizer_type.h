// Which optimizer algorithm runs, named once: the config reader turns DeepSpeed's "type" string
// into this enum, and every component after it (ZeRO's step, the state it keeps, checkpoints)
// switches on the enum instead of comparing strings.
#pragma once

#include <optional>
#include <string_view>

namespace torchspeed::optim {

enum class OptimizerType {
  kNone,         // no optimizer section
  kAdam,         // Adam (L2 or decoupled weight decay, DeepSpeed's adam_w_mode)
  kAdamW,        // AdamW (decoupled weight decay)
  kSGD,          // SGD with momentum, dampening, Nesterov
  kLamb,         // DeepSpeed's FusedLamb
  kOneBitAdam,   // DeepSpeed's OnebitAdam
  kZeroOneAdam,  // DeepSpeed's ZeroOneAdam (0/1 Adam)
  kOneBitLamb,   // DeepSpeed's OnebitLamb
};

// DeepSpeed's name of the type ("AdamW", "OneBitAdam", ...; "" for kNone): the string configs,
// checkpoints and messages carry.
const char* optimizer_name(OptimizerType t);
// The type of one of the names optimizer_name() gives, exactly; nullopt for anything else.
std::optional<OptimizerType> optimizer_type_named(std::string_view name);

// The optimizers that compress their communication after a warm-up (1-bit Adam, 0/1 Adam, 1-bit
// Lamb): their own all-reduce of the momentum instead of ZeRO's gradient reduction.
inline bool is_one_bit(OptimizerType t) {
  return t == OptimizerType::kOneBitAdam || t == OptimizerType::kZeroOneAdam || t == OptimizerType::kOneBitLamb;
}
// Adam's update rule (Adam, AdamW, and 1-bit Adam / 0/1 Adam).
inline bool is_adam(OptimizerType t) {
  return t == OptimizerType::kAdam || t == OptimizerType::kAdamW || t == OptimizerType::kOneBitAdam ||
         t == OptimizerType::kZeroOneAdam;
}

}  // namespace torchspeed::optim
