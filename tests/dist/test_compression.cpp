// Quantization-aware training through the engine (compression_training, MoQ) against the
// reference (reference.h: plain LibTorch, torch::optim::AdamW) training the same GPT on the same
// global batches, whose layers are set by hand to the quantization DeepSpeed's schedule gives at
// each step (written out below, not computed by compression/schedule). At every ZeRO stage
// (stage 3 quantizes weights it gathered), and with the real GPT-2 W8A8 config of
// DeepSpeedExamples on fp16.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dist_util.h"
#include "reference.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"

using ts_test::world;
namespace ts = torchspeed;

namespace {
ts::models::GPTConfig tiny() { return ts_test::tiny_gpt(2); }

std::pair<at::Tensor, at::Tensor> data(int step, int m, int d) { return ts_test::lm_batch(700, step, m, d); }

std::vector<ts_test::MicroBatch> global_batch(int s, int gas, int dp) {
  return ts_test::global_micro_batches(gas, dp, [s](int m, int d) { return data(s, m, d); });
}

std::vector<ts::models::GPTBlockImpl*> blocks(ts::nn::LayerStack& stack) {
  std::vector<ts::models::GPTBlockImpl*> out;
  for (size_t i = 0; i < stack->size(); ++i)
    if (auto* b = dynamic_cast<ts::models::GPTBlockImpl*>(stack->layer_module(i).get())) out.push_back(b);
  return out;
}

// Trains `steps` steps with the engine and the reference; `set_reference(step, blocks)` puts the
// reference's layers in the state of that step. Returns the engine's mean losses.
std::vector<double> run(const nlohmann::json& j, int steps,
                        const std::function<void(int, std::vector<ts::models::GPTBlockImpl*>&)>& set_reference,
                        double tolerance) {
  const int dp = world()->size();
  const auto cfg = ts_test::parse_config(j);
  const int gas = static_cast<int>(cfg.gradient_accumulation_steps);
  const auto spec = ts::models::gpt_spec(tiny(), 11);
  ts_test::ReferenceTrainer ref(ts::nn::build(spec), cfg);
  auto ref_blocks = blocks(ref.model());
  auto engine = ts::initialize(ts_test::dp_groups(), spec, cfg);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    set_reference(s, ref_blocks);
    const double want = ref.step(global_batch(s, gas, dp));
    int m = 0;
    const double got = engine->train_batch([&] { return data(s, m++, world()->rank()); });
    at::Tensor mean = at::full({1}, got / dp, at::kDouble);
    world()->all_reduce(mean);
    EXPECT_NEAR(mean.item<double>(), want, tolerance * std::abs(want)) << "step " << s;
    losses.push_back(mean.item<double>());
  }
  const auto want = ref.params();
  for (const auto& [name, value] : engine->master_params()) {
    // Parameters: within 5e-5 (lr 3e-3; the data-parallel sums' order moves weights by ~1e-7,
    // which Adam's normalised steps and the quantizers' rounding carry into the parameters).
    EXPECT_LE((value - want.at(name)).abs().max().item<double>(), 5e-5) << name;
  }
  return losses;
}

nlohmann::json base(int stage) {
  return {{"train_micro_batch_size_per_gpu", 2},
          {"gradient_accumulation_steps", 2},
          {"gradient_clipping", 1.0},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
          {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 500}, {"stage3_param_persistence_threshold", 0}}}};
}
}  // namespace

// W4 in every forward on the attention (GPT-2's names), W8 with 4 scales per tensor on the MLP
// (ours), A8 at the MLP's inputs from the second step.
TEST(Compression, ForwardQuantizationMatchesTheReferenceAtEveryZeroStage) {
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << "ZeRO " << stage << ", dp " << world()->size());
    nlohmann::json j = base(stage);
    j["compression_training"] = {
        {"weight_quantization",
         {{"shared_parameters", {{"enabled", true}, {"quantize_weight_in_forward", true}, {"quantize_groups", 4}}},
          {"different_groups",
           {{"attn", {{"params", {{"start_bits", 4}, {"target_bits", 4}}}, {"modules", {"attn.c_attn", "attn.c_proj"}}}},
            {"mlp", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"block\\d+\\.fc", "mlp_proj"}}}}}}}},
        {"activation_quantization",
         {{"shared_parameters", {{"enabled", true}, {"schedule_offset", 1}}},
          {"different_groups", {{"a8", {{"params", {{"bits", 8}}}, {"modules", {"mlp.c_fc", "mlp.c_proj"}}}}}}}}};
    const auto with = run(j, 4, [](int step, auto& bs) {
      for (auto* b : bs) {
        for (auto* q : {&b->qkv_q, &b->attn_proj_q}) { q->weight_bits = 4; q->weight_groups = 4; }
        for (auto* q : {&b->fc_q, &b->mlp_proj_q}) {
          q->weight_bits = 8;
          q->weight_groups = 4;
          q->input_bits = step >= 1 ? 8 : 0;
        }
      }
    }, 2e-5);
    if (stage == 0) {
      // The quantization is there: the same run without it trains differently.
      const auto without = run(base(0), 4, [](int, auto&) {}, 2e-5);
      EXPECT_GT(std::abs(with.back() - without.back()), 1e-4);
    }
  }
}

// MoQ: start 10, target 8, period 1, offset 1, fp16-mixed with a 0.3 fall. DeepSpeed quantizes
// after steps 2, 3, ... (the first after the offset), so the forward of step s (s applied) uses
// call s - 1: bits 9 (period 1 reached at call 1, period now 2), 8 (call 2), 8, 8; the ratio
// falls 1 - 0.3 at each call and returns to 1 when a bit drops: 1, 1, 0.7, 0.4.
TEST(Compression, MoqScheduleMatchesTheReference) {
  for (int stage : {1, 3}) {
    SCOPED_TRACE(testing::Message() << "ZeRO " << stage);
    nlohmann::json j = base(stage);
    j["compression_training"] = {
        {"weight_quantization",
         {{"shared_parameters", {{"enabled", true}, {"schedule_offset", 1}, {"quantize_groups", 2},
                                 {"fp16_mixed_quantize", {{"enabled", true}, {"quantize_change_ratio", 0.3}}}}},
          {"different_groups", {{"moq", {{"params", {{"start_bits", 10}, {"target_bits", 8}, {"quantization_period", 1}}},
                                         {"modules", {"qkv", "fc"}}}}}}}}};
    const std::vector<int> bits = {0, 0, 9, 8, 8, 8};
    const std::vector<double> ratio = {0, 0, 1.0, 1.0, 0.7, 0.4};
    run(j, 6, [&](int step, auto& bs) {
      for (auto* b : bs) {
        for (auto* q : {&b->qkv_q, &b->fc_q}) {
          q->weight_bits = bits[step];
          q->weight_groups = 2;
          q->weight_mixed = true;
          q->weight_keep_ratio = ratio[step];
        }
      }
    }, 2e-5);
  }
}

// DeepSpeedExamples' GPT-2 W8A8 config, unchanged (fp16, the four GPT-2 linear layers by their
// Hugging Face names): it binds every block's linear layers and trains with finite, falling
// losses; and it trains differently from the same config without compression_training.
TEST(Compression, DeepSpeedExamplesGpt2W8A8ConfigTrains) {
  ts::config::WorldShape shape;
  shape.world_size = world()->size();
  const std::string path = std::string(TS_DS_REAL_DIR) + "/DeepSpeedExamples__compression__gpt2__config__ds_config_W8A8_Qgroup64_fp16.json";
  auto cfg = ts::config::Config::load(path, shape);
  ASSERT_TRUE(cfg.compression.weight.enabled && cfg.compression.activation.enabled);
  ts::models::GPTConfig c = tiny();
  c.d_model = 64;  // quantize_groups 64 divides every weight
  const auto spec = ts::models::gpt_spec(c, 5);
  auto engine = ts::initialize(ts_test::dp_groups(), spec, cfg);
  ASSERT_NE(engine->compression(), nullptr);
  EXPECT_EQ(engine->compression()->bound("wq1"),
            (std::vector<std::string>{"block0.qkv", "block1.qkv", "block0.attn_proj", "block1.attn_proj", "block0.fc",
                                      "block1.fc", "block0.mlp_proj", "block1.mlp_proj"}));
  EXPECT_EQ(engine->compression()->bound("aq1").size(), 8u);
  auto plain_cfg = cfg;
  plain_cfg.compression = {};
  auto plain = ts::initialize(ts_test::dp_groups(), spec, plain_cfg);
  std::vector<double> a, b;
  for (int s = 0; s < 6; ++s) {  // the same batch each step: its loss falls
    int m = 0, n = 0;
    a.push_back(engine->train_batch([&] { return data(0, m++, world()->rank()); }));
    b.push_back(plain->train_batch([&] { return data(0, n++, world()->rank()); }));
    EXPECT_TRUE(std::isfinite(a.back()));
  }
  EXPECT_LT(a.back(), a.front());
  EXPECT_NE(a.back(), b.back());
}

// data_efficiency random_ltd through the engine against the reference whose block 1 keeps the
// tokens DeepSpeed's schedule gives (min 4, max 8 over 4 steps in steps of 2: 4, 4, 6, 6), both
// drawing the kept tokens from the default generator seeded alike before each step. That parity
// needs one rank (with several, each rank draws for its own rows); with several the test checks
// that tokens are dropped.
TEST(RandomLtd, EngineMatchesTheReferenceKeepingTheSameTokens) {
  for (int stage : {0, 3}) {
    SCOPED_TRACE(testing::Message() << "ZeRO " << stage);
    nlohmann::json j = base(stage);
    j["data_efficiency"] = {
        {"enabled", true},
        {"data_routing",
         {{"enabled", true},
          {"random_ltd",
           {{"enabled", true}, {"total_layer_num", 2}, {"random_ltd_layer_num", 1}, {"random_ltd_layer_id", {1}},
            {"model_mask_name", nullptr}, {"model_type", "decoder"}, {"hidden_state_order", "batch_seq_dim"},
            {"random_ltd_schedule", {{"min_value", 4}, {"max_value", 8}, {"schedule_type", "fixed_linear"},
                                     {"schedule_config", {{"require_steps", 4}, {"seq_per_step", 2}}}}}}}}}};
    const std::vector<int64_t> kept = {4, 4, 6, 6};
    const auto cfg = ts_test::parse_config(j);
    if (world()->size() > 1) {
      // Several ranks: each draws for its own rows, so no one reference draw matches. The engine
      // still drops tokens: its first loss differs from the same engine keeping them all.
      auto plain_cfg = cfg;
      plain_cfg.random_ltd = {};
      const auto spec = ts::models::gpt_spec(tiny(), 11);
      auto engine = ts::initialize(ts_test::dp_groups(), spec, cfg);
      auto plain = ts::initialize(ts_test::dp_groups(), spec, plain_cfg);
      int m = 0, n = 0;
      const double a = engine->train_batch([&] { return data(0, m++, world()->rank()); });
      const double b = plain->train_batch([&] { return data(0, n++, world()->rank()); });
      EXPECT_TRUE(std::isfinite(a));
      EXPECT_GT(std::abs(a - b), 1e-6);
      continue;
    }
    const auto spec = ts::models::gpt_spec(tiny(), 11);
    ts_test::ReferenceTrainer ref(ts::nn::build(spec), cfg);
    auto ref_blocks = blocks(ref.model());
    auto engine = ts::initialize(ts_test::dp_groups(), spec, cfg);
    double first = 0.0;
    for (int s = 0; s < 4; ++s) {
      ref_blocks[1]->kept_tokens = kept[s];
      torch::manual_seed(100 + s);
      const double want = ref.step(global_batch(s, 2, 1));
      torch::manual_seed(100 + s);
      int m = 0;
      const double got = engine->train_batch([&] { return data(s, m++, 0); });
      EXPECT_NEAR(got, want, 1e-6 * std::abs(want)) << "step " << s;
      if (s == 0) first = got;
    }
    const auto want = ref.params();
    for (const auto& [name, value] : engine->master_params())
      EXPECT_LE((value - want.at(name)).abs().max().item<double>(), 1e-5) << name;
    // And tokens were dropped: keeping them all, the first step's loss differs.
    ts_test::ReferenceTrainer full(ts::nn::build(spec), cfg);
    EXPECT_GT(std::abs(full.step(global_batch(0, 2, 1)) - first), 1e-6);
  }
}
