// ZeRO++ hpZ and qwZ at stage 3 (Note [Hierarchical partitioning] in zero/partitioned.cpp,
// Note [Quantized all-gather] in comm/compressed.h), run at 2 and 4 ranks and at 4 ranks as 2
// hosts of 2 (TORCHSPEED_COMM_HOST_SIZE=2).
//  - hpZ trains the tiny GPT like the plain LibTorch reference (reference.h) and bit for bit like
//    stage 3 without it, while the data-parallel group all-gathers each layer once per step
//    instead of twice per micro-step: the other gathers ran within groups of hpz ranks.
//  - qwZ sends a quarter of the bytes in the same all-gathers, trains within 1% of the
//    unquantized losses without equalling them, keeps every rank's parameters the same, and
//    with hpZ added gives the same numbers again (the secondary shards hold the decoded values).
//  - An hpZ size that does not divide the data-parallel size is refused by its key.
//  - The int8 blocks themselves: each element within half its block's step of the input, exact on
//    the grid, a non-finite block NaN, fp32 and bf16 both ways.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "dist_util.h"
#include "reference.h"
#include "torchspeed/comm/compressed.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"

using ts_test::world;
namespace ts = torchspeed;

namespace {
constexpr int kGas = 2, kSteps = 4;

std::pair<at::Tensor, at::Tensor> data(int step, int m, int d) { return ts_test::lm_batch(900, step, m, d); }

nlohmann::json config(int hpz, bool qwz, bool bf16 = false) {
  return {{"train_micro_batch_size_per_gpu", 2},
          {"gradient_accumulation_steps", kGas},
          {"gradient_clipping", 0.5},
          {"bf16", {{"enabled", bf16}}},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-2}, {"weight_decay", 0.01}, {"eps", 1e-6}}}}},
          {"zero_optimization",
           {{"stage", 3}, {"stage3_param_persistence_threshold", 0}, {"stage3_prefetch_bucket_size", 3000},
            {"zero_hpz_partition_size", hpz}, {"zero_quantized_weights", qwz}}}};
}

struct Trained {
  std::vector<double> losses;  // this rank's
  std::vector<std::pair<std::string, at::Tensor>> params;
  ts::comm::OpStats gathers;  // the data-parallel group's all-gathers while training
};

Trained train(const nlohmann::json& j, ts_test::ReferenceTrainer* ref = nullptr) {
  const auto cfg = ts_test::parse_config(j);
  const int dp = world()->size();
  auto groups = ts_test::dp_groups();
  auto engine = ts::initialize(groups, ts::models::gpt_spec(ts_test::tiny_gpt(3), 7), cfg);
  const auto before = groups.dp->stats()["all_gather"];
  Trained run;
  for (int s = 0; s < kSteps; ++s) {
    int m = 0;
    run.losses.push_back(engine->train_batch([&] { return data(s, m++, world()->rank()); }));
    if (!ref) continue;
    const double want = ref->step(ts_test::global_micro_batches(kGas, dp, [s](int mm, int d) { return data(s, mm, d); }));
    at::Tensor mean = at::full({1}, run.losses.back() / dp, at::kDouble);  // the reference's loss: over ranks
    world()->all_reduce(mean);
    EXPECT_NEAR(mean.item<double>(), want, 1e-5 * std::abs(want)) << "step " << s;
  }
  const auto after = groups.dp->stats()["all_gather"];
  run.gathers = {after.ops - before.ops, after.bytes - before.bytes, after.sent - before.sent};
  run.params = engine->master_params();
  return run;
}

void expect_same_on_every_rank(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  for (const auto& [name, t] : params) {
    at::Tensor root = t.clone();
    world()->broadcast(root, 0);
    EXPECT_TRUE(at::equal(root, t)) << name << " differs from rank 0's";
  }
}
}  // namespace

TEST(ZeroPlusPlus, HpzMatchesTheReferenceAndStage3BitForBit) {
  const int dp = world()->size();
  const int hpz = dp >= 4 ? dp / 2 : dp;  // at 2 ranks the group is the whole group: hpZ is a no-op
  const auto cfg = ts_test::parse_config(config(hpz, false));
  ts_test::ReferenceTrainer ref(ts::nn::build(ts::models::gpt_spec(ts_test::tiny_gpt(3), 7)), cfg);
  const Trained with = train(config(hpz, false), &ref);
  const Trained without = train(config(1, false));
  EXPECT_EQ(with.losses, without.losses);
  ASSERT_EQ(with.params.size(), without.params.size());
  const auto want = ref.params();
  for (size_t i = 0; i < with.params.size(); ++i) {
    const auto& [name, value] = with.params[i];
    EXPECT_TRUE(at::equal(value, without.params[i].second)) << name;
    EXPECT_LE(ts_test::rel_diff(value, want.at(name)), 1e-5) << name;
  }
  // The tiny GPT's units: the embedding, each block, the head's layer norm (the head's weight is
  // the embedding's). Without hpZ each micro-step gathers every unit for forward and again for
  // backward across the group, and the embedding once more for the tied head's forward (in
  // backward it stays gathered until its last gradient); with hpZ each unit is gathered across
  // the group once per step, by the first forward, and every other gather stays in the hpZ group.
  const int64_t units = ts_test::tiny_gpt(3).n_layer + 2;
  EXPECT_EQ(without.gathers.ops, kSteps * kGas * (2 * units + 1));
  if (hpz < dp) {
    EXPECT_EQ(with.gathers.ops, kSteps * units);
    EXPECT_LT(with.gathers.bytes * 2 * kGas, without.gathers.bytes);
  } else {
    EXPECT_EQ(with.gathers.ops, without.gathers.ops);
  }
  if (world()->rank() == 0) {
    std::printf("hpZ %d of dp %d: %lld all-gathers across the group (%lld bytes), without hpZ %lld (%lld bytes)\n", hpz, dp,
                static_cast<long long>(with.gathers.ops), static_cast<long long>(with.gathers.bytes),
                static_cast<long long>(without.gathers.ops), static_cast<long long>(without.gathers.bytes));
  }
}

TEST(ZeroPlusPlus, QwzTrainsLikeTheUnquantizedRunOnAQuarterOfTheBytes) {
  const int dp = world()->size();
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    const Trained plain = train(config(1, false, bf16));
    const Trained quant = train(config(1, true, bf16));
    double worst = 0;
    for (size_t s = 0; s < plain.losses.size(); ++s) {
      EXPECT_NEAR(quant.losses[s], plain.losses[s], 0.01 * plain.losses[s]) << "step " << s;
      worst = std::max(worst, std::fabs(quant.losses[s] / plain.losses[s] - 1));
    }
    EXPECT_NE(quant.losses, plain.losses) << "nothing was quantized";
    expect_same_on_every_rank(quant.params);
    // The same gathers, each row 1 byte per element plus a scale per block instead of 4 (bf16: 2).
    EXPECT_EQ(quant.gathers.ops, plain.gathers.ops);
    const double ratio = static_cast<double>(quant.gathers.bytes) / static_cast<double>(plain.gathers.bytes);
    EXPECT_LT(ratio, bf16 ? 0.51 : 0.26);
    EXPECT_GT(ratio, bf16 ? 0.49 : 0.24);
    if (dp >= 4) {  // hpZ on top: the backward gathers copy the forward's decoded values
      const Trained both = train(config(dp / 2, true, bf16));
      EXPECT_EQ(both.losses, quant.losses);
      for (size_t i = 0; i < both.params.size(); ++i)
        EXPECT_TRUE(at::equal(both.params[i].second, quant.params[i].second)) << both.params[i].first;
    }
    if (world()->rank() == 0) {
      std::printf("qwZ %s dp %d: losses %.4f -> %.4f (plain %.4f -> %.4f), worst step %.3f%% apart, %.3f of the "
                  "all-gather bytes\n",
                  bf16 ? "bf16" : "fp32", dp, quant.losses.front(), quant.losses.back(), plain.losses.front(),
                  plain.losses.back(), 100 * worst, ratio);
    }
  }
}

TEST(ZeroPlusPlus, HpzSizeMustDivideTheDataParallelSize) {
  const int dp = world()->size();
  const auto cfg = ts_test::parse_config(config(dp + 1, false));
  try {
    auto engine = ts::initialize(ts_test::dp_groups(), ts::models::gpt_spec(ts_test::tiny_gpt(2), 7), cfg);
    FAIL() << "hpZ " << dp + 1 << " accepted at dp " << dp;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("zero_optimization.zero_hpz_partition_size"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not divide the data-parallel size"), std::string::npos) << e.what();
  }
}

TEST(Int8Blocks, DecodeWithinHalfAStepOfEachBlock) {
  using ts::comm::Int8Blocks;
  for (int64_t n : {int64_t{1}, int64_t{3}, Int8Blocks::kBlock, 3 * Int8Blocks::kBlock + 5}) {
    SCOPED_TRACE(testing::Message() << n << " elements");
    EXPECT_EQ(Int8Blocks::wire_bytes(n) % 4, 0);
    EXPECT_GE(Int8Blocks::wire_bytes(n), n + 4 * ((n + Int8Blocks::kBlock - 1) / Int8Blocks::kBlock));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5 + n);
    at::Tensor x = at::randn({n}, gen, at::kFloat) * at::exp(at::randn({n}, gen, at::kFloat));
    std::vector<uint32_t> wire(static_cast<size_t>(Int8Blocks::wire_bytes(n) / 4));
    auto* bytes = reinterpret_cast<uint8_t*>(wire.data());
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor in = x.to(dtype);
      Int8Blocks::encode(in, bytes);
      at::Tensor out = at::empty({n}, dtype);
      Int8Blocks::decode(bytes, out);
      const at::Tensor xd = in.to(at::kDouble), yd = out.to(at::kDouble);
      bool quantized = false;
      for (int64_t lo = 0; lo < n; lo += Int8Blocks::kBlock) {
        const int64_t len = std::min(Int8Blocks::kBlock, n - lo);
        const double step = xd.narrow(0, lo, len).abs().max().item<double>() / 127;
        // Half a step, plus bf16's own rounding of the decoded value (2^-9 relative).
        const at::Tensor err = (yd.narrow(0, lo, len) - xd.narrow(0, lo, len)).abs();
        const at::Tensor allowed = 0.5 * step * (1 + 1e-6) + (dtype == at::kBFloat16 ? 4e-3 : 0.0) * xd.narrow(0, lo, len).abs();
        EXPECT_TRUE((err <= allowed).all().item<bool>()) << "block at " << lo << ": worst " << (err - allowed).max().item<double>();
        quantized = quantized || (err > 0).any().item<bool>();
      }
      if (n > 3) {
        EXPECT_TRUE(quantized) << "every value came back exactly";
      }
    }
  }
  // On the grid (multiples of max / 127): exact; a block with an inf decodes to NaN, the next is unaffected.
  const int64_t n = Int8Blocks::kBlock + 2;
  at::Tensor grid = (at::arange(n, at::kFloat).remainder(255) - 127) * 0.25f;
  grid[Int8Blocks::kBlock + 1] = std::numeric_limits<float>::infinity();
  std::vector<uint32_t> wire(static_cast<size_t>(Int8Blocks::wire_bytes(n) / 4));
  Int8Blocks::encode(grid, reinterpret_cast<uint8_t*>(wire.data()));
  at::Tensor out = at::empty({n}, at::kFloat);
  Int8Blocks::decode(reinterpret_cast<uint8_t*>(wire.data()), out);
  EXPECT_TRUE(at::equal(out.narrow(0, 0, Int8Blocks::kBlock), grid.narrow(0, 0, Int8Blocks::kBlock)));
  EXPECT_TRUE(out.narrow(0, Int8Blocks::kBlock, 2).isnan().all().item<bool>());
}
