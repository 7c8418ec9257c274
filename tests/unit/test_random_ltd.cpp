// Random layerwise token dropping (data_efficiency random_ltd): DeepSpeed's fixed_linear
// schedule written out, the gather/run/scatter of kept tokens (order, causality, gradients), the
// GPT block's use of it (training only), the binding's errors, and an engine trained with it
// against the reference (reference.h) whose blocks keep the same tokens (same generator draws).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>

#include "test_util.h"
#include "torchspeed/config/config.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/nn/token_drop.h"

namespace ts = torchspeed;
using nlohmann::json;

namespace {
json ltd(const json& over = json::object()) {
  json r = {{"enabled", true},
            {"total_layer_num", 12},
            {"random_ltd_layer_num", 10},
            {"random_ltd_layer_id", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}},
            {"model_mask_name", "attention_mask"},
            {"model_type", "decoder"},
            {"hidden_state_order", "batch_seq_dim"},
            {"random_ltd_schedule",
             {{"min_value", 128}, {"max_value", 1024}, {"schedule_type", "fixed_linear"},
              {"schedule_config", {{"require_steps", 400}, {"seq_per_step", 8}}}}}};
  r.update(over);
  return {{"train_batch_size", 4}, {"data_efficiency", {{"enabled", true}, {"data_routing", {{"enabled", true}, {"random_ltd", r}}}}}};
}
std::string errors_of(const json& j) { return ts_test::config_errors([&] { ts::config::Config::parse(j); }); }
}  // namespace

TEST(RandomLtd, ScheduleIsDeepSpeedsFixedLinear) {
  const auto c = ts::config::Config::parse(ltd()).random_ltd;
  ASSERT_TRUE(c.enabled);
  // floor(step / 400 * (1024 - 128) + 128), less its remainder mod 8, at most 1024.
  for (int64_t step : {0, 1, 3, 100, 123, 399, 400, 401, 5000}) {
    int64_t want = static_cast<int64_t>(std::floor(static_cast<double>(step) / 400.0 * 896.0 + 128.0));
    want -= want % 8;
    want = std::min<int64_t>(want, 1024);
    EXPECT_EQ(c.kept(step), want) << step;
  }
  EXPECT_EQ(c.kept(0), 128);
  EXPECT_EQ(c.kept(100), 352);
  EXPECT_EQ(c.kept(123), 400);  // 403.52 -> 403 -> 400
  EXPECT_EQ(c.kept(401), 1024);
}

TEST(RandomLtd, ConfigRefusalsNameTheirKeys) {
  EXPECT_NE(errors_of(ltd({{"random_ltd_layer_num", 9}})).find("random_ltd.random_ltd_layer_num: 9 differs from the 10 layers"),
            std::string::npos);
  EXPECT_NE(errors_of(ltd({{"model_type", "encoder"}})).find("random_ltd.model_type: \"encoder\""), std::string::npos);
  EXPECT_NE(errors_of(ltd({{"hidden_state_order", "seq_batch_dim"}})).find("random_ltd.hidden_state_order"), std::string::npos);
  EXPECT_NE(errors_of(ltd({{"layer_token_lr_schedule", {{"enabled", true}}}})).find("layer_token_lr_schedule.enabled"),
            std::string::npos);
  json sampling = ltd();
  sampling["data_efficiency"]["data_sampling"] = {{"enabled", true}};
  EXPECT_NE(errors_of(sampling).find("data_efficiency.data_sampling.enabled: data sampling"), std::string::npos);
  json off = ltd();
  off["data_efficiency"]["data_sampling"] = {{"enabled", false}, {"num_workers", 2}};
  EXPECT_EQ(errors_of(off), "");
}

TEST(RandomLtd, KeptTokensRunTheLayerInOrderAndTheRestPassBy) {
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({3, 10, 4}, torch::requires_grad());
  // A causal layer: each token becomes the sum of the tokens up to it (of those it is given).
  auto layer = [](const at::Tensor& t) { return t.cumsum(1) * 2; };
  const at::Tensor y = ts::nn::run_on_kept_tokens(x, 4, layer);
  for (int64_t b = 0; b < 3; ++b) {
    const at::Tensor changed = (y[b] != x[b]).any(-1);
    ASSERT_EQ(changed.sum().item<int64_t>(), 4) << b;
    const at::Tensor kept = changed.nonzero().squeeze(-1);  // ascending
    const at::Tensor sub = x[b].index_select(0, kept);
    EXPECT_TRUE(at::allclose(y[b].index_select(0, kept), sub.cumsum(0) * 2));
  }
  y.sum().backward();
  // Kept tokens' gradient through the layer; the others' straight through (1).
  for (int64_t b = 0; b < 3; ++b) {
    const at::Tensor changed = (y[b] != x[b]).any(-1);
    const at::Tensor kept = changed.nonzero().squeeze(-1);
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_TRUE(at::allclose(x.grad()[b][kept[i].item<int64_t>()], at::full({4}, 2.0 * (4 - i)))) << b << " " << i;
    }
    EXPECT_TRUE(at::allclose(x.grad()[b].index_select(0, (~changed).nonzero().squeeze(-1)), at::ones({6, 4})));
  }
  // keep >= T: the whole sequence.
  EXPECT_TRUE(at::allclose(ts::nn::run_on_kept_tokens(x, 10, layer), layer(x)));
}

TEST(RandomLtd, GptBlocksDropTokensInTrainingOnly) {
  ts::models::GPTConfig c;
  c.vocab = 32;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_layer = 3;
  c.n_head = 2;
  auto stack = ts::models::make_gpt(c);
  auto cfg = ts::config::Config::parse(ltd({{"total_layer_num", 3}, {"random_ltd_layer_num", 1}, {"random_ltd_layer_id", {1}},
                                            {"random_ltd_schedule", {{"min_value", 4}, {"max_value", 8},
                                                                     {"schedule_config", {{"require_steps", 4}, {"seq_per_step", 2}}}}}}));
  ts::nn::RandomLtd r(cfg.random_ltd, stack, true);
  auto* b0 = dynamic_cast<ts::models::GPTBlockImpl*>(stack->layer_module(1).get());
  auto* b1 = dynamic_cast<ts::models::GPTBlockImpl*>(stack->layer_module(2).get());
  EXPECT_EQ(b0->kept_tokens, 0);
  EXPECT_EQ(b1->kept_tokens, 4);
  r.update(2);
  EXPECT_EQ(b1->kept_tokens, 6);
  r.update(4);
  EXPECT_EQ(b1->kept_tokens, 8);
  r.update(1);
  const at::Tensor x = torch::randn({2, 8, 16});
  b1->train();
  const at::Tensor y = b1->forward(x);
  // Tokens left out pass unchanged: at least 8 - 4 per row.
  EXPECT_GE((y == x).all(-1).sum().item<int64_t>(), 2 * 4);
  b1->eval();
  EXPECT_TRUE(((b1->forward(x) == x).all(-1)).sum().item<int64_t>() == 0);
  ts_test::expect_error([&] {
    auto bad = ts::config::Config::parse(ltd({{"total_layer_num", 12}, {"random_ltd_layer_num", 1}, {"random_ltd_layer_id", {1}}}));
    ts::nn::RandomLtd(bad.random_ltd, stack, true);
  }, "random_ltd.total_layer_num: 12, but the model has 3 layers");
  ts_test::expect_error([&] {
    auto bad = ts::config::Config::parse(ltd({{"total_layer_num", 3}, {"random_ltd_layer_num", 1}, {"random_ltd_layer_id", {5}}}));
    ts::nn::RandomLtd(bad.random_ltd, stack, true);
  }, "random_ltd_layer_id: layer 5 is beyond the model's 3 layers");
}
