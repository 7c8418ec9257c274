// precision_advice: the thresholds and the words.
#include "torchspeed/precision/advice.h"

#include <cstdio>

namespace torchspeed::precision {

std::optional<PrecisionAdvice> precision_advice(bool bf16_configured, double fp32_gflops, double bf16_gflops) {
  char buf[512];
  if (bf16_configured && bf16_gflops < 0.67 * fp32_gflops) {
    std::snprintf(buf, sizeof buf,
                  "bf16 matmul runs at %.0f GFLOP/s on this CPU against %.0f for fp32 (measured, 512^3, per "
                  "rank): training in bf16 computes about %.1fx slower. Set bf16.enabled=false (--set "
                  "bf16.enabled=false) unless the memory bf16 saves is what you need.",
                  bf16_gflops, fp32_gflops, fp32_gflops / bf16_gflops);
    return PrecisionAdvice{true, buf};
  }
  if (!bf16_configured && bf16_gflops > 1.5 * fp32_gflops) {
    std::snprintf(buf, sizeof buf,
                  "bf16 matmul runs %.1fx faster than fp32 on this CPU (%.0f vs %.0f GFLOP/s per rank): --set "
                  "bf16.enabled=true trains faster and in half the parameter memory.",
                  bf16_gflops / fp32_gflops, bf16_gflops, fp32_gflops);
    return PrecisionAdvice{false, buf};
  }
  return std::nullopt;
}

}  // namespace torchspeed::precision
