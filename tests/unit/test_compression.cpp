// Quantization-aware training (compression/): DeepSpeed's quantizers against their formulas
// written out here from deepspeed/compression/utils.py and runtime/quantize.py, the straight-
// through gradient, MoQ's bit schedule and fp16-mixed ratio step by step, the binding of
// DeepSpeed's module patterns to GPT's layers (our names and GPT-2's), and the config's
// refusals naming their keys.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>

#include "test_util.h"
#include "torchspeed/compression/quantize.h"
#include "torchspeed/compression/schedule.h"
#include "torchspeed/config/config.h"
#include "torchspeed/models/gpt.h"

namespace ts = torchspeed;
using nlohmann::json;
using ts::compression::quantize;

namespace {

// DeepSpeed's SymQuantizer, AsymQuantizer, TernaryQuantizer and BinaryQuantizer, line by line.
at::Tensor ds_sym(const at::Tensor& in, int bits, int64_t groups) {
  const double q_range = std::pow(2.0, bits);
  at::Tensor input = in.reshape({groups, -1});
  at::Tensor max_input = at::amax(at::abs(input), -1).view({groups, -1});
  at::Tensor scale = 2 * max_input / q_range;
  return ((input / scale).round().clamp(-q_range / 2, q_range / 2 - 1) * scale).reshape(in.sizes());
}
at::Tensor ds_asym(const at::Tensor& in, int bits, int64_t groups) {
  const double q_range = std::pow(2.0, bits);
  at::Tensor input = in.reshape({groups, -1});
  at::Tensor min_value = input.amin(-1, true), max_value = input.amax(-1, true);
  at::Tensor scale = (max_value - min_value) / q_range;
  at::Tensor zero_point = (min_value / scale).round() * scale;
  return (((input - zero_point) / scale).round().clamp(0, q_range - 1) * scale + zero_point).reshape(in.sizes());
}
at::Tensor ds_ternary(const at::Tensor& in, int64_t groups) {
  at::Tensor input_flat = in.reshape({groups, -1});
  const int64_t n = input_flat.size(1);
  at::Tensor m = input_flat.norm(1, {1}).div(n);
  at::Tensor thres = (0.7 * m).view({-1, 1});
  at::Tensor pos = (input_flat > thres).to(in.scalar_type()), neg = (input_flat < -thres).to(in.scalar_type());
  at::Tensor mask = (input_flat.abs() > thres).to(in.scalar_type());
  at::Tensor alpha = ((mask * input_flat).abs().sum({1}) / mask.sum({1})).view({-1, 1});
  return (alpha * pos - alpha * neg).reshape(in.sizes());
}
at::Tensor ds_binary(const at::Tensor& in, int64_t groups) {
  at::Tensor input_flat = in.reshape({groups, -1});
  const int64_t n = input_flat.size(1);
  at::Tensor m = input_flat.norm(1, {1}, /*keepdim=*/true).div(n);
  return input_flat.sign().mul(m).reshape(in.sizes());
}

ts::models::GPTConfig tiny(bool tie = true) {
  ts::models::GPTConfig c;
  c.vocab = 32;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.tie_embeddings = tie;
  return c;
}

ts::config::Config parse(const json& compression) {
  json j = {{"train_batch_size", 4}};
  j.update(compression);
  return ts::config::Config::parse(j);
}

json weight_quant(const json& shared, const json& groups) {
  json s = {{"enabled", true}};
  if (shared.is_object()) s.update(shared);
  return {{"compression_training", {{"weight_quantization", {{"shared_parameters", s}, {"different_groups", groups}}}}}};
}

std::string errors_of(const json& j) { return ts_test::config_errors([&] { parse(j); }); }

}  // namespace

TEST(Compression, QuantizersEqualDeepSpeedsFormulas) {
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({12, 16});
  for (int bits : {8, 4, 3}) {
    for (int64_t groups : {1, 4, 12}) {
      SCOPED_TRACE(testing::Message() << bits << " bits, " << groups << " groups");
      EXPECT_TRUE(at::equal(quantize(x, bits, groups, true), ds_sym(x, bits, groups)));
      EXPECT_TRUE(at::allclose(quantize(x, bits, groups, false), ds_asym(x, bits, groups), 0, 1e-6));
      // At most 2^bits values per group, each within half a step of its input.
      const at::Tensor q = quantize(x, bits, groups, true).reshape({groups, -1});
      for (int64_t g = 0; g < groups; ++g) {
        EXPECT_LE(std::get<0>(at::_unique(q[g])).numel(), int64_t{1} << bits);
      }
      const at::Tensor step = 2 * x.reshape({groups, -1}).abs().amax(-1, true) / std::pow(2.0, bits);
      const at::Tensor near = (q - x.reshape({groups, -1})).abs() <= (step * 0.5 + 1e-6);
      const at::Tensor top = x.reshape({groups, -1}) >= (step * (std::pow(2.0, bits - 1) - 1));
      EXPECT_TRUE((near | top).all().item<bool>());
    }
  }
  for (int64_t groups : {1, 3}) {
    EXPECT_TRUE(at::allclose(quantize(x, 2, groups, true), ds_ternary(x, groups)));
    EXPECT_TRUE(at::allclose(quantize(x, 1, groups, true), ds_binary(x, groups)));
    EXPECT_LE(std::get<0>(at::_unique(quantize(x, 2, groups, true))).numel(), 3 * groups);
  }
  // bf16 in, bf16 out; the math in fp32.
  const at::Tensor b = x.to(at::kBFloat16);
  EXPECT_EQ(quantize(b, 8, 4, true).scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(quantize(b, 8, 4, true), ds_sym(b.to(at::kFloat), 8, 4).to(at::kBFloat16)));
  ts_test::expect_error([&] { quantize(x, 8, 5, true); }, "5 groups do not divide a tensor of 192 elements");
}

TEST(Compression, StochasticRoundingAddsTheNoiseBeforeRounding) {
  torch::manual_seed(4);
  const at::Tensor x = torch::randn({4, 8});
  const at::Tensor noise = torch::rand({4, 8}) - 0.5;
  // runtime/quantize.py quantize_highbit: (x / scale + p).round().clamp(...) * scale.
  const at::Tensor scale = 2 * x.reshape({2, -1}).abs().amax(-1, true) / 256.0;
  const at::Tensor want = ((x.reshape({2, -1}) / scale + noise.reshape({2, -1})).round().clamp(-128, 127) * scale).reshape({4, 8});
  EXPECT_TRUE(at::allclose(quantize(x, 8, 2, true, noise), want, 0, 1e-7));
  EXPECT_FALSE(at::equal(quantize(x, 8, 2, true, noise), quantize(x, 8, 2, true)));
}

TEST(Compression, GradientsPassStraightThrough) {
  torch::manual_seed(5);
  const at::Tensor w = torch::randn({6, 4}, torch::requires_grad());
  const at::Tensor x = torch::randn({3, 4}, torch::requires_grad());
  ts::compression::SiteState s;
  s.weight_bits = 4;
  s.weight_groups = 2;
  s.input_bits = 8;
  const at::Tensor wq = ts::compression::weight_of(s, w);
  const at::Tensor xq = ts::compression::input_of(s, x);
  EXPECT_TRUE(at::equal(wq.detach(), quantize(w.detach(), 4, 2, true)));
  // Activations: a scale per token (row).
  EXPECT_TRUE(at::equal(xq.detach(), ds_sym(x.detach(), 8, 3)));
  const at::Tensor c = torch::randn({3, 6});
  (at::linear(xq, wq) * c).sum().backward();
  // d/dw of sum(c * x_q w_q^T) with identity through the quantizers: c^T x_q.
  EXPECT_TRUE(at::allclose(w.grad(), c.t().matmul(xq.detach()), 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(x.grad(), c.matmul(wq.detach()), 1e-6, 1e-6));
}

TEST(Compression, PatternsBindToOurNamesAndGpt2Names) {
  auto cfg = parse(weight_quant({{"quantize_weight_in_forward", true}, {"quantize_groups", 4}},
                                {{"wq1", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"attn.c_attn", "mlp.c_proj"}}}},
                                 {"wq2", {{"params", {{"start_bits", 4}, {"target_bits", 4}}}, {"modules", {"block1\\.fc", "wte"}}}}}));
  auto stack = ts::models::make_gpt(tiny(false));
  ts::compression::Schedule s(cfg.compression, stack, nullptr, 1);
  EXPECT_EQ(s.bound("wq1"), (std::vector<std::string>{"block0.qkv", "block1.qkv", "block0.mlp_proj", "block1.mlp_proj"}));
  EXPECT_EQ(s.bound("wq2"), (std::vector<std::string>{"block1.fc", "embed.tok"}));
  // In-forward quantization from step 0 (schedule_offset 0): target bits, the config's groups;
  // an embedding has a scale per token.
  auto* block1 = dynamic_cast<ts::models::GPTBlockImpl*>(stack->layer_module(2).get());
  auto* embed = dynamic_cast<ts::models::GPTEmbeddingImpl*>(stack->layer_module(0).get());
  ASSERT_TRUE(block1 && embed);
  EXPECT_EQ(block1->qkv_q.weight_bits, 8);
  EXPECT_EQ(block1->fc_q.weight_bits, 4);
  EXPECT_EQ(block1->fc_q.weight_groups, 4);
  EXPECT_EQ(block1->attn_proj_q.weight_bits, 0);
  EXPECT_EQ(embed->tok_q.weight_groups, 32);
  // The forward uses the quantized weight.
  const at::Tensor x = torch::randn({2, 5, 16});
  const at::Tensor y = block1->forward(x);
  block1->qkv_q = block1->fc_q = block1->mlp_proj_q = {};
  EXPECT_FALSE(at::allclose(y, block1->forward(x), 1e-5, 1e-5));

  // A pattern that matches nothing names its group and the model's layers.
  auto none = parse(weight_quant({}, {{"wq1", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"attention.self"}}}}}));
  auto stack2 = ts::models::make_gpt(tiny());
  ts_test::expect_error([&] { ts::compression::Schedule(none.compression, stack2, nullptr, 1); },
                        "compression_training.weight_quantization.different_groups.wq1.modules: 'attention.self' matches no "
                        "layer of the model (its compressible layers: embed.tok (transformer.wte)");
  // A layer in two groups, as DeepSpeed refuses it.
  auto twice = parse(weight_quant({}, {{"a", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"qkv"}}}},
                                       {"b", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"c_attn"}}}}}));
  ts_test::expect_error([&] { ts::compression::Schedule(twice.compression, stack2, nullptr, 1); },
                        "different_groups.b.modules: 'c_attn' matches block0.qkv, which weight quantization group 'a' already has");
  // Activations are quantized at the input of linear layers only.
  auto act = parse({{"compression_training",
                     {{"activation_quantization",
                       {{"shared_parameters", {{"enabled", true}}},
                        {"different_groups", {{"aq", {{"params", {{"bits", 8}}}, {"modules", {"wpe"}}}}}}}}}}});
  ts_test::expect_error([&] { ts::compression::Schedule(act.compression, stack2, nullptr, 1); },
                        "different_groups.aq.modules: 'wpe' matches no linear layer");
  ts_test::expect_error([&] { ts::compression::Schedule(cfg.compression, stack2, nullptr, 2); },
                        "with tensor_parallel.tp_size 2");
}

TEST(Compression, LlamaConfigsNameTheSeparateProjections) {
  // A Llama config names q_proj, k_proj, v_proj and gate_proj, up_proj: together they are our
  // fused qkv and fc layers; some of them alone are refused by name.
  ts::models::GPTConfig c = tiny();
  c.n_kv_head = 1, c.norm = "rmsnorm", c.positions = "rope", c.activation = "swiglu";
  c.qkv_bias = c.attn_out_bias = c.mlp_bias = false;
  auto stack = ts::models::make_gpt(c);
  auto cfg = parse(weight_quant({}, {{"attn", {{"params", {{"start_bits", 8}, {"target_bits", 8}}},
                                               {"modules", {"q_proj", "k_proj", "v_proj", "o_proj"}}}},
                                     {"mlp", {{"params", {{"start_bits", 4}, {"target_bits", 4}}},
                                              {"modules", {"layers\\.1\\.mlp\\.(gate|up)_proj"}}}}}));
  ts::compression::Schedule s(cfg.compression, stack, nullptr, 1);
  EXPECT_EQ(s.bound("attn"), (std::vector<std::string>{"block0.attn_proj", "block1.attn_proj", "block0.qkv", "block1.qkv"}));
  EXPECT_EQ(s.bound("mlp"), (std::vector<std::string>{"block1.fc"}));
  auto* block1 = dynamic_cast<ts::models::GPTBlockImpl*>(stack->layer_module(2).get());
  ASSERT_TRUE(block1);
  EXPECT_EQ(block1->qkv_q.weight_bits, 8);
  EXPECT_EQ(block1->fc_q.weight_bits, 4);
  // A pattern naming the fused layer by our name and a part of it names the whole layer.
  auto both = parse(weight_quant({}, {{"wq", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"qkv|q_proj"}}}}}));
  auto stack3 = ts::models::make_gpt(c);
  EXPECT_EQ(ts::compression::Schedule(both.compression, stack3, nullptr, 1).bound("wq"),
            (std::vector<std::string>{"block0.qkv", "block1.qkv"}));
  auto part = parse(weight_quant({}, {{"wq", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"q_proj", "v_proj"}}}}}));
  auto stack2 = ts::models::make_gpt(c);
  ts_test::expect_error([&] { ts::compression::Schedule(part.compression, stack2, nullptr, 1); },
                        "different_groups.wq.modules names model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj but "
                        "not model.layers.0.self_attn.k_proj: torchspeed fuses them into one layer (block0.qkv, "
                        "model.layers.0.self_attn.qkv_proj) that is quantized as a whole; name all of them");
}

TEST(Compression, OffsetsFollowDeepSpeedsCounters) {
  // Forward quantization and activations: on once `applied` reaches schedule_offset.
  auto cfg = parse({{"compression_training",
                     {{"weight_quantization",
                       {{"shared_parameters", {{"enabled", true}, {"quantize_weight_in_forward", true}, {"schedule_offset", 3}}},
                        {"different_groups", {{"w", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"qkv"}}}}}}}},
                      {"activation_quantization",
                       {{"shared_parameters", {{"enabled", true}, {"schedule_offset", 2}, {"quantization_type", "asymmetric"}}},
                        {"different_groups", {{"a", {{"params", {{"bits", 4}}}, {"modules", {"fc"}}}}}}}}}}});
  auto stack = ts::models::make_gpt(tiny());
  ts::compression::Schedule s(cfg.compression, stack, nullptr, 1);
  auto* b = dynamic_cast<ts::models::GPTBlockImpl*>(stack->layer_module(1).get());
  const std::vector<int> want_w = {0, 0, 0, 8, 8}, want_a = {0, 0, 4, 4, 4};
  for (int applied = 0; applied < 5; ++applied) {
    s.update(applied);
    EXPECT_EQ(b->qkv_q.weight_bits, want_w[applied]) << applied;
    EXPECT_EQ(b->fc_q.input_bits, want_a[applied]) << applied;
    EXPECT_FALSE(b->fc_q.input_symmetric);
  }
}

TEST(Compression, MoqDropsABitEachPeriodAndDoublesIt) {
  // DeepSpeed's Quantizer (runtime/quantize.py) with start 12, target 8, period 2, offset 0:
  // call q (q = applied + 1 at offset 0) drops a bit when q reaches the period, which doubles.
  auto cfg = parse(weight_quant({{"quantize_groups", 2}, {"fp16_mixed_quantize", {{"enabled", true}, {"quantize_change_ratio", 0.25}}}},
                                {{"moq", {{"params", {{"start_bits", 12}, {"target_bits", 8}, {"quantization_period", 2}}},
                                          {"modules", {"."}}}}}));
  auto stack = ts::models::make_gpt(tiny());
  ts::compression::Schedule s(cfg.compression, stack, nullptr, 1);
  auto* b = dynamic_cast<ts::models::GPTBlockImpl*>(stack->layer_module(1).get());
  // Written out from the Quantizer: ratio -= 0.25 each call (from 1), back to 1 when bits drop.
  const std::vector<int> bits = {12, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 9, 9, 9, 9, 8, 8, 8};
  const std::vector<double> ratio = {0.75, 1.0, 0.75, 1.0, 0.75, 0.5, 0.25, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 1.0, 0.75, 0.5};
  for (size_t q = 1; q <= bits.size(); ++q) {
    s.update(static_cast<int64_t>(q) - 1);
    EXPECT_EQ(b->qkv_q.weight_bits, bits[q - 1]) << "call " << q;
    EXPECT_DOUBLE_EQ(b->qkv_q.weight_keep_ratio, ratio[q - 1]) << "call " << q;
    EXPECT_TRUE(b->qkv_q.weight_mixed);
    EXPECT_EQ(b->qkv_q.weight_groups, 2);
  }
  EXPECT_EQ(s.weight_bits("moq"), 8);
  // Back to an earlier step (a checkpoint): the same state as a run that got there directly.
  s.update(3);
  EXPECT_EQ(b->qkv_q.weight_bits, 10);
  EXPECT_DOUBLE_EQ(b->qkv_q.weight_keep_ratio, 1.0);

  // quantize_training (MoQ's tutorial): every matrix, offset 100 by default; the first
  // quantization follows the step after the offset.
  auto moq = ts::config::Config::parse({{"train_batch_size", 4},
                                        {"fp16", {{"enabled", true}}},
                                        {"quantize_training",
                                         {{"enabled", true}, {"quantizer_kernel", true},
                                          {"quantize_bits", {{"start_bits", 16}, {"target_bits", 8}}},
                                          {"quantize_schedule", {{"quantize_period", 4}, {"schedule_offset", 2}}},
                                          {"quantize_groups", 8}, {"quantize_algo", {{"q_type", "asymmetric"}}}}}});
  ts::compression::Schedule m(moq.compression, stack, nullptr, 1);
  EXPECT_EQ(m.bound("quantize_training").size(), 2u + 2 * 4u);  // tok, pos and every block's linears (tied head)
  const std::vector<int> moq_bits = {0, 0, 0, 16, 16, 16, 15};  // applied 0..6: calls 0,0,0,1,2,3,4
  for (int applied = 0; applied < 7; ++applied) {
    m.update(applied);
    EXPECT_EQ(b->qkv_q.weight_bits, moq_bits[applied]) << applied;
    EXPECT_FALSE(b->qkv_q.weight_symmetric);
    EXPECT_EQ(b->qkv_q.weight_groups, 8);
  }
}

TEST(Compression, ConfigRefusalsNameTheirKeys) {
  const json group = {{"w", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"qkv"}}}}};
  EXPECT_NE(errors_of(weight_quant({{"quantize_weight_in_forward", true}, {"rounding", "stochastic"}}, group))
                .find("compression_training.weight_quantization.shared_parameters.rounding: \"stochastic\" applies to MoQ"),
            std::string::npos);
  EXPECT_NE(errors_of(weight_quant({}, {{"w", {{"params", {{"start_bits", 4}, {"target_bits", 8}}}, {"modules", {"qkv"}}}}}))
                .find("different_groups.w.params.start_bits: 4 is below target_bits 8"),
            std::string::npos);
  EXPECT_NE(errors_of(weight_quant({}, {{"w", {{"params", {{"start_bits", 8}, {"target_bits", 8}}}, {"modules", {"(qkv"}}}}}))
                .find("different_groups.w.modules: '(qkv' is not a valid regular expression"),
            std::string::npos);
  EXPECT_NE(errors_of(weight_quant({{"quantization_type", "asymmetric"}}, {{"w", {{"params", {{"start_bits", 2}, {"target_bits", 2}}}, {"modules", {"qkv"}}}}}))
                .find("2 bits (ternary) needs quantization_type \"symmetric\""),
            std::string::npos);
  EXPECT_NE(errors_of(weight_quant({}, json::object())).find("different_groups"), std::string::npos);
  const auto act = [](const json& shared, int bits) {
    json s = {{"enabled", true}};
    if (shared.is_object()) s.update(shared);
    return json{{"compression_training", {{"activation_quantization", {{"shared_parameters", s},
        {"different_groups", {{"a", {{"params", {{"bits", bits}}}, {"modules", {"fc"}}}}}}}}}}};
  };
  EXPECT_NE(errors_of(act({{"range_calibration", "static"}}, 8))
                .find("activation_quantization.shared_parameters.range_calibration: \"static\""),
            std::string::npos);
  EXPECT_NE(errors_of(act({}, 6)).find("different_groups.a.params.bits: 6: activations are quantized to 4 or 8 bits"),
            std::string::npos);
  EXPECT_EQ(errors_of(act({}, 4)), "");
  for (const char* method : {"sparse_pruning", "row_pruning", "head_pruning", "channel_pruning"}) {
    EXPECT_NE(errors_of({{"compression_training", {{method, {{"shared_parameters", {{"enabled", true}}}}}}}})
                  .find(std::string("compression_training.") + method + ".shared_parameters: enabled is true"),
              std::string::npos)
        << method;
    EXPECT_EQ(errors_of({{"compression_training", {{method, {{"shared_parameters", {{"enabled", false}, {"method", "l1"}}}}}}}}), "")
        << method;
  }
  EXPECT_NE(errors_of({{"compression_training", {{"layer_reduction", {{"enabled", true}}}}}})
                .find("compression_training.layer_reduction.enabled: layer reduction"),
            std::string::npos);
  EXPECT_NE(errors_of({{"compression_training", {{"weight_quantizaton", json::object()}}}})
                .find("did you mean \"weight_quantization\""),
            std::string::npos);
  json both = weight_quant({}, group);
  both["quantize_training"] = {{"enabled", true}};
  EXPECT_NE(errors_of(both).find("quantize_training.enabled: quantize_training and compression_training.weight_quantization both"),
            std::string::npos);
  EXPECT_NE(errors_of({{"quantize_training", {{"enabled", true}, {"quantize_eigenvalue", true}}}})
                .find("quantize_training.quantize_eigenvalue: eigenvalue-scheduled MoQ is not available"),
            std::string::npos);
}
