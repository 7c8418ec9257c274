#include "torchspeed/optim/optimizer_type.h"

namespace torchspeed::optim {
namespace {
constexpr OptimizerType kTypes[] = {OptimizerType::kAdam,       OptimizerType::kAdamW,       OptimizerType::kSGD,
                                    OptimizerType::kLamb,       OptimizerType::kOneBitAdam,  OptimizerType::kZeroOneAdam,
                                    OptimizerType::kOneBitLamb};
}

const char* optimizer_name(OptimizerType t) {
  switch (t) {
    case OptimizerType::kNone: return "";
    case OptimizerType::kAdam: return "Adam";
    case OptimizerType::kAdamW: return "AdamW";
    case OptimizerType::kSGD: return "SGD";
    case OptimizerType::kLamb: return "Lamb";
    case OptimizerType::kOneBitAdam: return "OneBitAdam";
    case OptimizerType::kZeroOneAdam: return "ZeroOneAdam";
    case OptimizerType::kOneBitLamb: return "OneBitLamb";
  }
  return "";
}

std::optional<OptimizerType> optimizer_type_named(std::string_view name) {
  for (OptimizerType t : kTypes) {
    if (name == optimizer_name(t)) return t;
  }
  return std::nullopt;
}

}  // namespace torchspeed::optim
