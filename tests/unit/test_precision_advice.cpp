// precision_advice: warns about the slow precision, hints at the fast one, stays quiet between.
#include <gtest/gtest.h>

#include "torchspeed/precision/advice.h"

using torchspeed::precision::precision_advice;

TEST(PrecisionAdvice, Bf16MuchSlowerThanFp32WarnsWithTheRatesAndTheKey) {
  // The AVX-512 CPU without AVX512-BF16: bf16 25 GFLOP/s, fp32 150.
  auto a = precision_advice(true, 150, 25);
  ASSERT_TRUE(a);
  EXPECT_TRUE(a->warning);
  EXPECT_NE(a->message.find("25 GFLOP/s"), std::string::npos) << a->message;
  EXPECT_NE(a->message.find("150 for fp32"), std::string::npos) << a->message;
  EXPECT_NE(a->message.find("6.0x slower"), std::string::npos) << a->message;
  EXPECT_NE(a->message.find("bf16.enabled=false"), std::string::npos) << a->message;
}

TEST(PrecisionAdvice, Fp32WhereBf16IsFasterHints) {
  // AVX512-BF16: bf16 225, fp32 104.
  auto a = precision_advice(false, 104, 225);
  ASSERT_TRUE(a);
  EXPECT_FALSE(a->warning);
  EXPECT_NE(a->message.find("2.2x faster"), std::string::npos) << a->message;
  EXPECT_NE(a->message.find("bf16.enabled=true"), std::string::npos) << a->message;
}

TEST(PrecisionAdvice, NothingToSayWhenTheConfiguredOneIsFastOrClose) {
  EXPECT_FALSE(precision_advice(true, 104, 225));   // bf16 configured and fast
  EXPECT_FALSE(precision_advice(false, 150, 25));   // fp32 configured and fast
  EXPECT_FALSE(precision_advice(true, 100, 80));    // bf16 slower, but within 1.5x
  EXPECT_FALSE(precision_advice(false, 100, 140));  // bf16 faster, but under 1.5x
}
