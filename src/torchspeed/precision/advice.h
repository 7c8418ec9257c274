// Which compute precision this CPU runs faster, from measured GEMM rates: what `torchspeed
// train` tells a user whose configured precision is the slow one here.
#pragma once

#include <optional>
#include <string>

namespace torchspeed::precision {

struct PrecisionAdvice {
  bool warning = false;  // the configured precision is much slower (a warning), else a hint
  std::string message;
};

// `bf16_configured`: the run computes in bf16 (else fp32). Rates in GFLOP/s, per rank. A warning
// when bf16 is configured and computes at under 2/3 of fp32's rate; a hint when fp32 is
// configured and bf16 runs over 1.5x faster; nothing otherwise.
std::optional<PrecisionAdvice> precision_advice(bool bf16_configured, double fp32_gflops, double bf16_gflops);

}  // namespace torchspeed::precision
