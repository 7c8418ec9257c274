// Pipeline and tensor parallelism against a single process: the tiny GPT (tied embedding and LM
// head) trained with tp x pp x dp gives the same parameters and losses after several steps as
// one process training the whole model on the same global batches, for 1F1B and GPipe, with
// ZeRO-1 and with activation checkpointing.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dist_util.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"

using ts_test::world;
namespace ts = torchspeed;

namespace {

ts::models::GPTConfig tiny() {
  ts::models::GPTConfig c;
  c.vocab = 64;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_layer = 4;
  c.n_head = 4;
  return c;
}

// Micro-batch m of step `step` for data-parallel rank d: [mb, seq] tokens and next tokens.
std::pair<at::Tensor, at::Tensor> data(int step, int m, int d, int64_t mb) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step * 100 + m * 10 + d);
  at::Tensor t = at::randint(0, 64, {mb, 9}, gen, at::kLong);
  return {t.narrow(1, 0, 8).contiguous(), t.narrow(1, 1, 8).contiguous()};
}

nlohmann::json base_config(int micro, int gas, int stage) {
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", gas},
          {"gradient_clipping", 1.0},
          // eps 1e-6: the key part of the qkv bias has an exactly zero gradient (softmax ignores a
          // shift of every score), so its gradient is rounding noise, which Adam with a tiny eps
          // would turn into full-size steps in arbitrary directions in both runs.
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}, {"eps", 1e-6}}}}},
          {"zero_optimization", {{"stage", stage}}}};
}

struct Case {
  int pp;
  std::string schedule = "1f1b";
  int zero = 0;
  int ckpt_interval = 0;
  std::string partition = "parameters";
  int tp = 1;
};

Case with_tp(int pp, int tp, int zero = 0, int ckpt_interval = 0) {
  Case c{pp, "1f1b", zero, ckpt_interval};
  c.tp = tp;
  return c;
}

void check_parity(const Case& c) {
  const int world_size = world()->size(), dp = world_size / (c.pp * c.tp);
  const int64_t mb = 2;
  const int gas = 4, steps = 3;
  SCOPED_TRACE(testing::Message() << "tp " << c.tp << " pp " << c.pp << " dp " << dp << " " << c.schedule << " zero " << c.zero
                                  << " checkpoint interval " << c.ckpt_interval << " " << c.partition);
  const auto spec = ts::models::gpt_spec(tiny(), 42);

  // The reference: one process, the whole model, each micro-batch the dp ranks' ones together.
  auto self = world()->split(world()->rank(), 0, "self");
  ts::config::WorldShape one;
  one.world_size = 1;
  auto ref = ts::initialize(ts::parallel::make_parallel_groups(self, ts::parallel::ProcessGrid(1)), spec,
                            ts::config::Config::parse(base_config(mb * dp, gas, 0), one));
  std::vector<double> ref_losses;
  for (int s = 0; s < steps; ++s) {
    int m = 0;
    ref_losses.push_back(ref->train_batch([&] {
      std::vector<at::Tensor> xs, ys;
      for (int d = 0; d < dp; ++d) {
        auto [x, y] = data(s, m, d, mb);
        xs.push_back(x);
        ys.push_back(y);
      }
      ++m;
      return std::make_pair(at::cat(xs), at::cat(ys));
    }));
  }

  nlohmann::json j = base_config(mb, gas, c.zero);
  j["pipeline"] = {{"stages", c.pp}, {"schedule", c.schedule}, {"partition_method", c.partition},
                   {"activation_checkpoint_interval", c.ckpt_interval}};
  j["tensor_parallel"] = {{"tp_size", c.tp}};
  ts::config::WorldShape shape;
  shape.world_size = world_size;
  auto cfg = ts::config::Config::parse(j, shape);
  auto groups = ts::parallel::make_parallel_groups(world(), ts::parallel::ProcessGrid(world_size, c.tp, c.pp));
  // The tensor-parallel model is built with the group it splits over.
  auto engine = ts::initialize(groups, ts::models::gpt_spec(tiny(), 42, groups.tp), cfg);
  EXPECT_EQ(engine->num_stages(), c.pp);
  // A stage builds only its own layers, tensor-parallel ranks their slices.
  if (c.pp * c.tp > 1) {
    EXPECT_LT(engine->num_parameters(), ref->num_parameters());
  }
  for (int s = 0; s < steps; ++s) {
    int m = 0;
    const double loss = engine->train_batch([&] { return data(s, m++, groups.coord.dp, mb); });
    EXPECT_NEAR(loss, ref_losses[static_cast<size_t>(s)], 1e-5 * std::abs(ref_losses[static_cast<size_t>(s)]))
        << "step " << s;
  }
  EXPECT_EQ(engine->global_step(), steps);
  auto got = engine->master_params(), want = ref->master_params();
  ASSERT_EQ(got.size(), want.size());
  double diff_sq = 0, norm_sq = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].first, want[i].first);
    ASSERT_EQ(got[i].second.sizes(), want[i].second.sizes()) << want[i].first;
    const double d = (got[i].second - want[i].second).norm().item<double>(), w = want[i].second.norm().item<double>();
    diff_sq += d * d;
    norm_sq += w * w;
    // Per tensor a looser bound: Adam turns rounding-level gradient differences of near-zero
    // elements into differences of up to its step size.
    EXPECT_LE(d / w, 1e-4) << want[i].first;
  }
  EXPECT_LE(std::sqrt(diff_sq / norm_sq), 1e-5) << "whole model";
  // The model moved (the test would pass trivially otherwise).
  auto fresh = ts::nn::build(spec);
  EXPECT_GT((want[1].second - fresh->named_parameters()[want[1].first]).abs().max().item<double>(), 1e-3);
}

}  // namespace

TEST(PipelineParity, MatchesOneProcess) {
  const int n = world()->size();
  if (n == 2) {
    check_parity({2});
    check_parity({2, "gpipe"});
    check_parity({2, "1f1b", 1});
    check_parity({2, "1f1b", 0, 1});
    check_parity({2, "1f1b", 0, 0, "type:block"});
    check_parity({1, "1f1b", 2, 1});       // dp 2, ZeRO-2 with checkpointing every layer (tied weights)
    check_parity({1, "1f1b", 3, 1});       // dp 2, ZeRO-3 with checkpointing every layer
  } else if (n == 4) {
    check_parity({4});
    check_parity({4, "1f1b", 0, 0, "uniform"});
    check_parity({2, "1f1b", 1});          // pp 2 x dp 2, ZeRO-1
    check_parity({2, "gpipe", 0, 2});      // pp 2 x dp 2, checkpointing every 2 layers
  } else {
    GTEST_SKIP() << "runs at 2 or 4 ranks";
  }
}

TEST(TensorParallelParity, MatchesOneProcess) {
  const int n = world()->size();
  if (n == 2) {
    check_parity(with_tp(1, 2));             // tp 2
    check_parity(with_tp(1, 2, 0, 1));       // tp 2, checkpointing
    check_parity(with_tp(1, 2, 3, 2));       // tp 2, ZeRO-3 (dp 1) with checkpointing
  } else if (n == 4) {
    check_parity(with_tp(1, 2, 1));          // tp 2 x dp 2, ZeRO-1
    check_parity(with_tp(1, 2, 3));          // tp 2 x dp 2, ZeRO-3
    check_parity(with_tp(1, 2, 3, 1));       // tp 2 x dp 2, ZeRO-3 with checkpointing
    check_parity(with_tp(2, 2));             // tp 2 x pp 2
    check_parity(with_tp(1, 4));             // tp 4
  } else if (n == 8) {
    check_parity(with_tp(2, 2, 1));          // tp 2 x pp 2 x dp 2, ZeRO-1
  } else {
    GTEST_SKIP() << "runs at 2, 4 or 8 ranks";
  }
}
