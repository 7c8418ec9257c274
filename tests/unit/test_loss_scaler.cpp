// The loss scaler against sequences derived by hand from DeepSpeed's DynamicLossScaler rules
// (deepspeed/runtime/fp16/loss_scaler.py): scale 2^4, window 3, hysteresis 2, min 1.
#include <gtest/gtest.h>

#include "torchspeed/precision/loss_scaler.h"
#include "torchspeed/base/error.h"

using torchspeed::precision::LossScaler;
using torchspeed::precision::LossScalerOptions;

namespace {
std::vector<double> run(LossScaler s, const std::vector<bool>& overflows) {
  std::vector<double> out;
  for (bool o : overflows) {
    s.update(o);
    out.push_back(s.scale());
  }
  return out;
}
const std::vector<bool> kPattern = {false, false, false, true, false, true, true, false, false, false};
}  // namespace

TEST(LossScaler, HysteresisAbsorbsAnOverflowThenHalves) {
  // it0-2 clean: the window of 3 completes at it2 -> 32. it3 overflow: hysteresis 2 -> 1, scale
  // kept. it4 clean. it5 overflow: hysteresis exhausted -> 16. it6 overflow -> 8 (hysteresis is
  // not restored by clean steps unless a window completes). it7-9 clean: (9 - 6) % 3 == 0 -> 16.
  LossScaler s(LossScalerOptions().initial_scale_power(4).scale_window(3).hysteresis(2));
  EXPECT_EQ(s.scale(), 16.0);
  EXPECT_EQ(run(s, kPattern), (std::vector<double>{16, 16, 32, 32, 32, 16, 8, 8, 8, 16}));
}

TEST(LossScaler, ConsecutiveHysteresisRestoresOnEveryCleanStep) {
  // As above, but the clean step it4 restores hysteresis to 2, so it5 is absorbed and only it6
  // halves: 32 -> 16; the window completes at it9 -> 32.
  LossScaler s(LossScalerOptions().initial_scale_power(4).scale_window(3).hysteresis(2).consecutive_hysteresis(true));
  EXPECT_EQ(run(s, kPattern), (std::vector<double>{16, 16, 32, 32, 32, 32, 16, 16, 16, 32}));
}

TEST(LossScaler, HysteresisOneHalvesAtOnceAndStopsAtTheMinimum) {
  LossScaler s(LossScalerOptions().initial_scale_power(4).scale_window(3).hysteresis(1).min_scale(4));
  s.update(true);
  EXPECT_EQ(s.scale(), 8.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 4.0);
  EXPECT_THROW(s.update(true), torchspeed::Error);  // overflow at the minimum: DeepSpeed raises
  LossScaler lenient(LossScalerOptions().initial_scale_power(3).hysteresis(1).min_scale(4).raise_error_at_min_scale(false));
  lenient.update(true);
  lenient.update(true);
  lenient.update(true);
  EXPECT_EQ(lenient.scale(), 4.0);
}

TEST(LossScaler, DefaultsAreDeepSpeeds) {
  LossScaler s;
  EXPECT_EQ(s.scale(), 65536.0);  // 2^16
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);  // hysteresis 2 absorbs the first overflow
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0);
  for (int i = 0; i < 999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 32768.0);
  s.update(false);  // 1000 clean steps after the last overflow
  EXPECT_EQ(s.scale(), 65536.0);
}

TEST(LossScaler, StaticScaleNeverMoves) {
  LossScaler s(LossScalerOptions().dynamic(false).static_scale(128));
  EXPECT_EQ(run(s, kPattern), std::vector<double>(kPattern.size(), 128.0));
}

TEST(LossScaler, StateRoundTrips) {
  LossScaler a(LossScalerOptions().initial_scale_power(4).scale_window(3).hysteresis(2));
  for (bool o : {false, false, false, true, false}) a.update(o);
  LossScaler b(LossScalerOptions().initial_scale_power(4).scale_window(3).hysteresis(2));
  b.load_state(a.state());
  const std::vector<bool> rest = {true, true, false, false, false};
  EXPECT_EQ(run(a, rest), run(b, rest));
  EXPECT_THROW(b.load_state(nlohmann::json{{"nope", 1}}), torchspeed::Error);
}
