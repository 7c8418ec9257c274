// The serving library against independent references: the paged forward against the training
// model's plain LibTorch forward (whole sequences, prefill in chunks, then token by token), the
// KV block pool's exact accounting and prefix cache, speculative decoding, and the scheduler's
// promise that a request's tokens do not depend on what it is batched with, the chunk size or
// preemption (the kernels: test_serving_kernels.cpp; the sampler and the text stream:
// test_sampler.cpp).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <atomic>
#include <limits>
#include <thread>
#include <map>

#include "test_util.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/inference/serving_engine.h"
#include "torchspeed/inference/linear_bf16.h"
#include "torchspeed/models/gpt.h"

using namespace torchspeed;
using namespace torchspeed::inference;

namespace {
models::GPTConfig small_cfg() {
  models::GPTConfig c;
  c.vocab = 256;
  c.seq_len = 64;
  c.d_model = 64;  // head_dim 16: the AVX-512 attention kernel runs
  c.n_layer = 2;
  c.n_head = 4;
  return c;
}

// A trained-looking model: random weights scaled up so the next-token distribution is peaked
// (as after training), making greedy choices well separated from rounding noise.
struct Fixture {
  models::GPTConfig cfg = small_cfg();
  nn::LayerStack stack{nullptr};
  checkpoint::Model model;
  explicit Fixture(const models::GPTConfig& c = small_cfg()) : cfg(c) {
    torch::manual_seed(7);
    stack = models::make_gpt(cfg);
    {
      torch::NoGradGuard g;
      for (auto& p : stack->parameters()) {
        if (p.dim() == 2) p.mul_(4.0);
      }
    }
    model.params = checkpoint::stack_parameters(stack);
    model.config = {{"model", cfg.to_json()}};
    model.source = "test model";
  }
  // The training model's logits for a whole sequence [T, vocab].
  at::Tensor reference(const std::vector<int64_t>& toks) {
    torch::NoGradGuard g;
    stack->eval();
    return stack->forward(at::tensor(toks, at::kLong).unsqueeze(0)).squeeze(0);
  }
};

std::vector<int64_t> prompt_of(int i, int len) {
  std::vector<int64_t> p;
  for (int k = 0; k < len; ++k) p.push_back((i * 37 + k * 11 + 5) % 256);
  return p;
}

EngineOptions opts(int64_t budget, int64_t seqs, double kv_mb = 4) {
  return EngineOptions().max_num_batched_tokens(budget).max_num_seqs(seqs).max_queue(1000).kv(
      KVCacheOptions().block_size(8).budget_mb(kv_mb));
}
}  // namespace

TEST(BlockPool, ExactAccounting) {
  BlockPool pool(10);
  EXPECT_EQ(pool.total(), 10);
  auto a = pool.allocate(3), b = pool.allocate(7);
  EXPECT_EQ(pool.free(), 0);
  EXPECT_EQ(pool.used(), 10);
  std::set<int32_t> ids(a.begin(), a.end());
  ids.insert(b.begin(), b.end());
  EXPECT_EQ(ids.size(), 10u);  // never the same block twice
  ts_test::expect_error([&] { pool.allocate(1); }, "asked for 1 blocks, 0 of 10 are free");
  pool.release(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(pool.free(), 3);
  auto c = pool.allocate(2);
  EXPECT_EQ(pool.used() + pool.free(), pool.total());
  std::vector<int32_t> again = c;
  pool.release(c);
  EXPECT_THROW(pool.release(again), torchspeed::Error);  // a double free is caught
}

TEST(BlockPool, PrefixCacheSharesFullBlocksAndEvictsLeastRecentlyReleased) {
  BlockPool pool(6, 4);
  ASSERT_TRUE(pool.caching());
  std::vector<int64_t> toks;
  for (int64_t i = 0; i < 14; ++i) toks.push_back(100 + i);
  auto a = pool.allocate(3);
  uint64_t key = 0;
  std::vector<uint64_t> keys;
  for (size_t i = 0; i < 3; ++i) keys.push_back(key = pool.publish(key, toks.data() + 4 * i, a[i]));
  EXPECT_EQ(pool.cached_blocks(), 3);
  // The same tokens published from another block: the first block stays the prefix's, the other
  // unpublished (its key is the existing one).
  auto dup = pool.allocate(1);
  EXPECT_EQ(pool.publish(0, toks.data(), dup[0]), keys[0]);
  EXPECT_EQ(pool.cached_blocks(), 3);
  pool.release(dup);
  // A second sequence with the same first 12 tokens shares the three blocks.
  std::vector<uint64_t> got_keys;
  auto shared = pool.match(toks, 3, got_keys);
  EXPECT_EQ(shared, a);
  EXPECT_EQ(got_keys, keys);
  EXPECT_EQ(pool.used(), 3);  // a and the match hold the same 3 blocks
  pool.release(a);
  EXPECT_EQ(pool.used(), 3);  // still referenced by the match
  pool.release(shared);
  EXPECT_EQ(pool.used(), 0);
  EXPECT_EQ(pool.free(), 6);  // cached blocks count as free
  // At most max_blocks, and only as far as the tokens agree: block 1's tokens after another
  // first block are another prefix.
  auto first = pool.match(toks, 1, got_keys);
  EXPECT_EQ(first, std::vector<int32_t>{a[0]});
  pool.release(first);
  auto changed = toks;
  changed[5] = 7;
  auto part = pool.match(changed, 3, got_keys);
  EXPECT_EQ(part, std::vector<int32_t>{a[0]});
  EXPECT_EQ(pool.used(), 1);
  pool.release(part);
  std::vector<int64_t> shifted(toks.begin() + 4, toks.end());
  EXPECT_TRUE(pool.match(shifted, 2, got_keys).empty());
  EXPECT_EQ(pool.used(), 0);
  // Allocation takes the 3 empty blocks first, then evicts the cached ones, the sequence's tail
  // (released first) before its head.
  auto fresh = pool.allocate(3);
  EXPECT_EQ(pool.cached_blocks(), 3);
  auto one = pool.allocate(1);
  EXPECT_EQ(one[0], a[2]);
  EXPECT_EQ(pool.cached_blocks(), 2);
  EXPECT_EQ(pool.match(toks, 3, got_keys).size(), 2u);  // blocks 0 and 1 are still there
  std::vector<int32_t> held = {a[0], a[1]};
  pool.release(held);
  auto rest = pool.allocate(2);
  EXPECT_EQ(pool.cached_blocks(), 0);
  EXPECT_TRUE(pool.match(toks, 3, got_keys).empty());
  EXPECT_EQ(pool.free(), 0);
  ts_test::expect_error([&] { pool.allocate(1); }, "asked for 1 blocks, 0 of 6 are free");
  pool.release(fresh);
  pool.release(one);
  pool.release(rest);
  EXPECT_EQ(pool.free(), 6);
  BlockPool off(4);
  EXPECT_FALSE(off.caching());
  EXPECT_TRUE(off.match(toks, 3, got_keys).empty());
}

TEST(KVCache, SlotsFollowTheBlockTable) {
  std::vector<int64_t> slots;
  append_slots({5, 2}, 4, 2, 7, slots);
  EXPECT_EQ(slots, (std::vector<int64_t>{22, 23, 8, 9, 10}));
  EXPECT_EQ(blocks_for(9, 4), 3);
  KVCache cache(2, 4, 12, KVCacheOptions().block_size(16).budget_mb(1));
  EXPECT_EQ(cache.num_blocks(), (1 << 20) / KVCache::bytes_per_block(2, 4, 12, KVCacheOptions().block_size(16)));
  EXPECT_LE(cache.bytes(), 1 << 20);
}

namespace {
// The families' variants of the description (models/gpt.h), each small.
std::vector<std::pair<std::string, models::GPTConfig>> family_cfgs() {
  std::vector<std::pair<std::string, models::GPTConfig>> out{{"gpt2", small_cfg()}};
  models::GPTConfig llama = small_cfg();
  llama.norm = "rmsnorm", llama.positions = "rope", llama.activation = "swiglu", llama.n_kv_head = 2;
  llama.d_ff = 96, llama.qkv_bias = llama.attn_out_bias = llama.mlp_bias = false, llama.tie_embeddings = false;
  llama.rope_theta = 500000;
  llama.rope_scaling.type = "llama3", llama.rope_scaling.factor = 8, llama.rope_scaling.original_max_position_embeddings = 16;
  out.push_back({"llama3", llama});
  models::GPTConfig qwen2 = llama;
  qwen2.qkv_bias = true, qwen2.rope_scaling = {}, qwen2.rope_scaling.type = "yarn", qwen2.rope_scaling.factor = 4;
  qwen2.rope_scaling.original_max_position_embeddings = 16, qwen2.n_kv_head = 1;
  out.push_back({"qwen2", qwen2});
  models::GPTConfig qwen3 = llama;
  qwen3.qk_norm = true, qwen3.head_dim = 32, qwen3.rope_scaling = {}, qwen3.tie_embeddings = true;
  out.push_back({"qwen3", qwen3});
  return out;
}
}  // namespace

// The paged forward of every family (rotary positions written into the cache, grouped-query
// heads reading their KV head, RMSNorm, SwiGLU, q/k norms) equals the training stack's forward.
TEST(InferenceModel, PagedForwardMatchesTheTrainingModelForEveryFamily) {
  for (const auto& [name, cfg] : family_cfgs()) {
    Fixture f(cfg);
    InferenceModel m(f.model, WeightFormat::kFP32);
    EXPECT_EQ(m.local_kv_heads(), cfg.kv_heads()) << name;
    KVCache cache(cfg.n_layer, m.local_kv_heads(), m.head_dim(), KVCacheOptions().block_size(8).budget_mb(1));
    const auto toks = prompt_of(5, 48);
    const at::Tensor ref = f.reference(toks);
    std::vector<int32_t> table{3, 1, 6, 0, 4, 2};
    std::vector<at::Tensor> got;
    StepPlan prompt;
    prompt.seqs.push_back({0, std::vector<int64_t>(toks.begin(), toks.begin() + 20), table, true, true});
    got.push_back(m.forward(prompt, cache));
    for (int64_t pos = 20; pos < 48; ++pos) {
      StepPlan plan;
      plan.seqs.push_back({pos, {toks[static_cast<size_t>(pos)]}, table, false, true});
      got.push_back(m.forward(plan, cache));
    }
    const at::Tensor all = at::cat(got, 0);
    EXPECT_GT((ref.max() - ref.min()).item<double>(), 1.0) << name;
    EXPECT_LT((all - ref).abs().max().item<double>(), 1e-4) << name;
  }
}

TEST(InferenceModel, PagedForwardMatchesTheTrainingModel) {
  Fixture f;
  InferenceModel m(f.model, WeightFormat::kFP32);
  KVCache cache(f.cfg.n_layer, m.local_kv_heads(), m.head_dim(), KVCacheOptions().block_size(8).budget_mb(1));
  const auto toks = prompt_of(3, 40);
  const at::Tensor ref = f.reference(toks);
  // Scattered blocks, prompt in chunks of 13, 1, 6, then the rest token by token.
  std::vector<int32_t> table{9, 2, 7, 0, 5};
  std::vector<at::Tensor> got;
  int64_t pos = 0;
  for (int64_t n : {13, 1, 6}) {
    StepPlan plan;
    plan.seqs.push_back({pos, std::vector<int64_t>(toks.begin() + pos, toks.begin() + pos + n), table, true, true});
    got.push_back(m.forward(plan, cache));
    pos += n;
  }
  for (; pos < 40; ++pos) {
    StepPlan plan;
    plan.seqs.push_back({pos, {toks[static_cast<size_t>(pos)]}, table, false, true});
    got.push_back(m.forward(plan, cache));
  }
  const at::Tensor all = at::cat(got, 0);
  EXPECT_LT((all - ref).abs().max().item<double>(), 1e-4) << "max abs diff";
}

// A bf16 or int8 KV cache: keys and values rounded once when written (int8: each (token, KV head)
// row with its own scale). Decoding token by token (the AVX-512 kernel reading the slots) gives
// the logits of the whole sequence as one prompt chunk (matmul attention over the same rounded
// keys and values), and stays near the fp32 model.
TEST(InferenceModel, RoundedKVCacheDecodeMatchesPromptAttention) {
  Fixture f;
  InferenceModel m(f.model, WeightFormat::kFP32);
  const int64_t fp32_block = KVCache::bytes_per_block(2, 4, 12, KVCacheOptions().block_size(8));
  EXPECT_EQ(KVCache::bytes_per_block(2, 4, 12, KVCacheOptions().block_size(8).dtype(at::kBFloat16)) * 2, fp32_block);
  EXPECT_EQ(KVCache::bytes_per_block(2, 4, 12, KVCacheOptions().block_size(8).dtype(at::kChar)) * 3, fp32_block);  // 12 + 4 of 48
  for (const at::ScalarType dtype : {at::kBFloat16, at::kChar}) {
    const std::string what = dtype == at::kChar ? "int8" : "bf16";
    const auto kvo = KVCacheOptions().block_size(8).budget_mb(1).dtype(dtype);
    const auto toks = prompt_of(5, 40);
    const std::vector<int32_t> table{3, 8, 1, 6, 4};
    KVCache whole_cache(f.cfg.n_layer, m.local_kv_heads(), m.head_dim(), kvo);
    StepPlan whole;
    whole.seqs.push_back({0, toks, table, true, true});
    const at::Tensor prompt = m.forward(whole, whole_cache);
    KVCache cache(f.cfg.n_layer, m.local_kv_heads(), m.head_dim(), kvo);
    std::vector<at::Tensor> got;
    for (int64_t pos = 0; pos < 40; ++pos) {
      StepPlan plan;
      plan.seqs.push_back({pos, {toks[static_cast<size_t>(pos)]}, table, false, true});
      got.push_back(m.forward(plan, cache));
    }
    const at::Tensor decoded = at::cat(got, 0);
    EXPECT_LT((decoded - prompt).abs().max().item<double>(), 1e-3) << what;
    const at::Tensor ref = f.reference(toks);
    const double diff = (decoded - ref).abs().max().item<double>(), scale = ref.abs().max().item<double>();
    EXPECT_GT(diff, 0.0) << what;  // the rounding is real
    EXPECT_LT(diff, 0.02 * scale) << what;
  }
  ts_test::expect_error([&] { KVCache c(2, 4, 12, KVCacheOptions().dtype(at::kHalf)); }, "fp32, bf16 or int8");
}

TEST(InferenceModel, RefusesTensorsThatAreNotAGPTs) {
  Fixture f;
  f.model.params.emplace_back("block9.extra", at::zeros({2}));
  ts_test::expect_error([&] { InferenceModel m(f.model, WeightFormat::kFP32); }, "\"block9.extra\" is not part of a model with config");
}

namespace {
struct Collected {
  std::vector<int64_t> tokens;
  std::string text, reason;
  int events = 0;
};

std::vector<Collected> run_requests(Fixture& f, const EngineOptions& o, const std::vector<int>& which, bool sampled,
                                    uint64_t* preemptions = nullptr, WeightFormat fmt = WeightFormat::kFP32) {
  auto model = std::make_shared<InferenceModel>(f.model, fmt);
  ServingEngine engine(model, o);
  std::vector<Collected> out(which.size());
  for (size_t i = 0; i < which.size(); ++i) {
    SamplingParams p;
    p.temperature = sampled ? 0.9 : 0.0;
    p.top_p = sampled ? 0.95 : 1.0;
    p.seed = 100 + which[i];
    p.max_tokens = 12 + which[i] % 5;
    if (which[i] % 3 == 1) {  // penalties and bias read the sequence's own history only
      p.repetition_penalty = 1.3;
      p.frequency_penalty = 0.4;
      p.presence_penalty = 0.2;
      p.logit_bias = {{static_cast<int64_t>(which[i]) * 11 % 256, 2.5f}};
    } else if (which[i] % 3 == 2) {
      p.min_p = 0.05;
      p.min_tokens = 4;
    }
    Collected* c = &out[i];
    auto id = engine.submit(prompt_of(which[i], 5 + (which[i] * 7) % 30), p, [c](const RequestEvent& ev) {
      for (const auto& t : ev.tokens) c->tokens.push_back(t.id);
      c->text += ev.text;
      ++c->events;
      if (ev.finished) c->reason = ev.finish_reason;
    });
    EXPECT_TRUE(id.has_value());
  }
  engine.run_until_idle();
  const EngineStats st = engine.stats();
  EXPECT_EQ(st.blocks_used, 0);  // every block came back
  EXPECT_EQ(st.blocks_free, st.blocks_total);
  EXPECT_EQ(st.requests_finished, which.size());
  if (preemptions) *preemptions = st.preemptions;
  return out;
}
}  // namespace

TEST(Engine, TokensDoNotDependOnBatchingChunksOrPreemption) {
  Fixture f;
  std::vector<int> all;
  for (int i = 0; i < 16; ++i) all.push_back(i);
  for (bool sampled : {false, true}) {
    std::vector<Collected> alone;
    for (int i : all) alone.push_back(run_requests(f, opts(256, 1), {i}, sampled)[0]);
    const auto batched = run_requests(f, opts(256, 16), all, sampled);
    const auto chunked = run_requests(f, opts(7, 16), all, sampled);  // prompts split in 7-token chunks
    // A cache of 10 blocks of 8 tokens for 16 sequences of up to 50: preemption and recompute.
    const double tiny = 10.0 * KVCache::bytes_per_block(f.cfg.n_layer, f.cfg.n_head, f.cfg.d_model / f.cfg.n_head,
                                                        KVCacheOptions().block_size(8)) / (1024.0 * 1024.0);
    uint64_t preemptions = 0;
    const auto preempted = run_requests(f, opts(64, 16, tiny), all, sampled, &preemptions);
    EXPECT_GT(preemptions, 0u);
    // Both at once: 7-token prompt chunks beside decodes in a cache that keeps running out.
    uint64_t preemptions_chunked = 0;
    const auto preempted_chunked = run_requests(f, opts(7, 16, tiny), all, sampled, &preemptions_chunked);
    EXPECT_GT(preemptions_chunked, 0u);
    for (size_t i = 0; i < all.size(); ++i) {
      EXPECT_EQ(alone[i].reason, "length");
      EXPECT_EQ(static_cast<int>(alone[i].tokens.size()), 12 + all[i] % 5);
      EXPECT_EQ(batched[i].tokens, alone[i].tokens) << "request " << i << (sampled ? " sampled" : " greedy");
      EXPECT_EQ(chunked[i].tokens, alone[i].tokens) << "request " << i << (sampled ? " sampled" : " greedy");
      EXPECT_EQ(preempted[i].tokens, alone[i].tokens) << "request " << i << (sampled ? " sampled" : " greedy");
      EXPECT_EQ(preempted_chunked[i].tokens, alone[i].tokens) << "request " << i << (sampled ? " sampled" : " greedy");
      EXPECT_EQ(batched[i].text, alone[i].text);
    }
  }
}

// bf16 weights (with bf16 dot products where the CPU has them), and int8 and 4-bit weights where they
// use the same dot products: one kernel for every row count, so a prompt chunk of any length
// and any batch give the same tokens.
TEST(Engine, Bf16TokensDoNotDependOnBatchingOrChunks) {
  // (weights, KV cache dtype): the int8 cache quantizes each row once, when written.
  std::vector<std::pair<WeightFormat, at::ScalarType>> cases{{WeightFormat::kBF16, at::kBFloat16}, {WeightFormat::kBF16, at::kChar}};
  if (have_bf16_dot()) cases.insert(cases.end(), {{WeightFormat::kInt8, at::kBFloat16}, {WeightFormat::kQ4_0, at::kBFloat16}, {WeightFormat::kQ4_1, at::kBFloat16}});
  for (const auto& [fmt, kv_dtype] : cases) {
    Fixture f;
    std::vector<int> all;
    for (int i = 0; i < 16; ++i) all.push_back(i);
    std::vector<Collected> alone;
    for (int i : all) {
      alone.push_back(run_requests(f, opts(256, 1).kv(KVCacheOptions().block_size(8).budget_mb(4).dtype(kv_dtype)), {i},
                                   false, nullptr, fmt)[0]);
    }
    auto bf16_kv = [kv = kv_dtype](EngineOptions o) { return o.kv(KVCacheOptions(o.kv()).dtype(kv)); };
    const auto batched = run_requests(f, bf16_kv(opts(256, 16)), all, false, nullptr, fmt);
    const auto chunked = run_requests(f, bf16_kv(opts(7, 16)), all, false, nullptr, fmt);
    for (size_t i = 0; i < all.size(); ++i) {
      EXPECT_EQ(batched[i].tokens, alone[i].tokens) << weight_format_name(fmt) << " request " << i;
      EXPECT_EQ(chunked[i].tokens, alone[i].tokens) << weight_format_name(fmt) << " request " << i;
    }
    // A 33-token prompt alone in 7-token chunks: its first steps want no logits at all (the
    // forward passes no row to the head; a crash in serve before this test existed).
    const auto alone_chunked = run_requests(f, bf16_kv(opts(7, 1)), {4}, false, nullptr, fmt);
    EXPECT_EQ(alone_chunked[0].tokens, alone[4].tokens) << weight_format_name(fmt);
  }
}

// Note [Prefix caching]: requests that share a 24-token start (3 blocks of 8) give the same
// tokens with the cache as without it, greedy and sampled, fp32 and bf16 weights, whether they
// arrive together (the second computes what the first published in the same run) or one after
// another; and the cache is used (hits counted).
TEST(Engine, PrefixCacheGivesTheSameTokens) {
  Fixture f;
  std::vector<int64_t> system;
  for (int k = 0; k < 24; ++k) system.push_back((k * 29 + 3) % 256);
  auto prompt = [&](int i) {
    std::vector<int64_t> p = system;
    for (int k = 0; k < 3 + i % 7; ++k) p.push_back((i * 13 + k * 5 + 1) % 256);
    return p;
  };
  for (WeightFormat fmt : {WeightFormat::kFP32, WeightFormat::kBF16}) {
    auto model = std::make_shared<InferenceModel>(f.model, fmt);
    for (bool sampled : {false, true}) {
      auto run = [&](bool caching, bool one_by_one, EngineStats* st) {
        ServingEngine engine(model, opts(256, 16).prefix_caching(caching));
        std::vector<std::vector<int64_t>> out(8);
        for (int i = 0; i < 8; ++i) {
          SamplingParams p;
          p.temperature = sampled ? 0.8 : 0.0;
          p.seed = 7 + i;
          p.max_tokens = 10;
          auto* o = &out[static_cast<size_t>(i)];
          EXPECT_TRUE(engine.submit(prompt(i), p, [o](const RequestEvent& ev) {
            for (const auto& t : ev.tokens) o->push_back(t.id);
          }));
          if (one_by_one) engine.run_until_idle();
        }
        engine.run_until_idle();
        *st = engine.stats();
        EXPECT_EQ(st->blocks_used, 0);
        return out;
      };
      EngineStats off_st, seq_st, together_st;
      const auto off = run(false, true, &off_st);
      const auto seq = run(true, true, &seq_st);
      const auto together = run(true, false, &together_st);
      const std::string what = std::string(weight_format_name(fmt)) + (sampled ? " sampled" : " greedy");
      EXPECT_EQ(seq, off) << what;
      EXPECT_EQ(together, off) << what;
      EXPECT_EQ(off_st.prefix_cache_hits, 0u);
      EXPECT_EQ(seq_st.prefix_cache_hits, 7u * 24u) << what;  // every request after the first finds the system prompt
      EXPECT_GT(seq_st.prefix_cache_queries, seq_st.prefix_cache_hits);
      EXPECT_GT(seq_st.prefix_cache_blocks, 0);
    }
  }
}

TEST(Speculative, NgramProposalsAndConfig) {
  using V = std::vector<int64_t>;
  // The latest earlier occurrence of the longest suffix: "1 2 3" occurs at 0 and 4; after the
  // one at 4 come 9 9.
  EXPECT_EQ(ngram_propose({1, 2, 3, 7, 1, 2, 3, 9, 9, 1, 2, 3}, 1, 3, 2), (V{9, 9}));
  EXPECT_EQ(ngram_propose({1, 2, 3, 7, 1, 2, 3, 9, 9, 1, 2, 3}, 1, 3, 5), (V{9, 9, 1, 2, 3}));
  EXPECT_EQ(ngram_propose({5, 6, 7, 8}, 1, 3, 4), V{});        // nothing repeats
  EXPECT_EQ(ngram_propose({4, 1, 5, 2, 1}, 1, 3, 2), (V{5, 2}));  // only the 1-gram "1" occurs earlier
  EXPECT_EQ(ngram_propose({4, 1, 5, 2, 1}, 2, 3, 2), V{});     // not when 2-grams are the least
  EXPECT_EQ(ngram_propose({3, 3}, 1, 4, 4), (V{3}));            // up to the end of the sequence
  EXPECT_EQ(ngram_propose({3}, 1, 4, 4), V{});
  const auto o = SpeculativeOptions::from_json(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})");
  EXPECT_EQ(o.num_speculative_tokens(), 3);
  EXPECT_EQ(o.prompt_lookup_min(), 2);
  EXPECT_EQ(o.prompt_lookup_max(), 2);
  ts_test::expect_error([] { SpeculativeOptions::from_json(R"({"method": "eagle", "num_speculative_tokens": 3})"); },
                        "\"method\" \"eagle\" is not supported");
  ts_test::expect_error([] { SpeculativeOptions::from_json(R"({"method": "ngram", "num_speculative_tokens": 3, "model": "x"})"); },
                        "key \"model\" is not supported");
  ts_test::expect_error([] { SpeculativeOptions::from_json(R"({"method": "ngram", "num_speculative_tokens": 0})"); },
                        "\"num_speculative_tokens\" must be an integer in [1, 16]");
  ts_test::expect_error([] { SpeculativeOptions::from_json(R"({"method": "ngram"})"); }, "\"num_speculative_tokens\" is required");
  ts_test::expect_error([] { SpeculativeOptions::from_json("[1]"); }, "--speculative-config: a JSON object");
  ts_test::expect_error(
      [] { SpeculativeOptions::from_json(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2})"); },
      "prompt_lookup_min 3 exceeds prompt_lookup_max 2");
}

// Note [Speculative decoding]: greedy tokens and their logprobs are those of plain decoding,
// alone and in a batch with sampled requests (which are not speculated on), for fp32 and bf16
// weights; on repetitive prompts most drafts are accepted, and fewer steps are run.
TEST(Engine, SpeculativeDecodingGivesThePlainTokens) {
  Fixture f;
  auto prompt = [](int i) {
    std::vector<int64_t> p;
    for (int r = 0; r < 3; ++r) {
      for (int k = 0; k < 6 + i % 3; ++k) p.push_back((i * 31 + k * 7 + 2) % 256);
    }
    return p;
  };
  for (WeightFormat fmt : {WeightFormat::kFP32, WeightFormat::kBF16}) {
    auto model = std::make_shared<InferenceModel>(f.model, fmt);
    struct Out {
      std::vector<int64_t> tokens;
      std::vector<double> logprobs;
      std::string reason;
    };
    auto run = [&](int64_t k, const std::vector<int>& which, EngineStats* st) {
      EngineOptions o = opts(256, 16);
      if (k > 0) o.speculative(SpeculativeOptions().num_speculative_tokens(k).prompt_lookup_max(3));
      ServingEngine engine(model, o);
      std::vector<Out> out(which.size());
      for (size_t i = 0; i < which.size(); ++i) {
        SamplingParams p;
        p.temperature = which[i] % 4 == 3 ? 0.9 : 0.0;  // every fourth sampled
        if (which[i] % 4 == 1) {  // greedy on penalized logits: drafts are checked against those
          p.repetition_penalty = 1.2;
          p.presence_penalty = 0.3;
        }
        p.seed = 3 + which[i];
        p.max_tokens = 20 + which[i] % 7;
        p.logprobs = 2;
        Out* r = &out[i];
        EXPECT_TRUE(engine.submit(prompt(which[i]), p, [r](const RequestEvent& ev) {
          for (const auto& t : ev.tokens) {
            r->tokens.push_back(t.id);
            r->logprobs.push_back(t.logprobs.logprob);
            for (const auto& [id, lp] : t.logprobs.top) r->logprobs.push_back(static_cast<double>(id) + lp);
          }
          if (ev.finished) r->reason = ev.finish_reason;
        }));
      }
      engine.run_until_idle();
      *st = engine.stats();
      EXPECT_EQ(st->blocks_used, 0);
      return out;
    };
    std::vector<int> all;
    for (int i = 0; i < 12; ++i) all.push_back(i);
    EngineStats plain_st, spec_st, alone_st;
    const auto plain = run(0, all, &plain_st);
    const auto spec = run(4, all, &spec_st);
    for (size_t i = 0; i < all.size(); ++i) {
      const std::string what = std::string(weight_format_name(fmt)) + " request " + std::to_string(i);
      EXPECT_EQ(spec[i].tokens, plain[i].tokens) << what;
      EXPECT_EQ(spec[i].logprobs, plain[i].logprobs) << what;
      EXPECT_EQ(spec[i].reason, plain[i].reason) << what;
      if (all[i] % 4 != 3) {
        const auto alone = run(4, {all[i]}, &alone_st);
        EXPECT_EQ(alone[0].tokens, plain[i].tokens) << what << " alone";
      }
    }
    EXPECT_EQ(plain_st.spec_draft_tokens, 0u);
    EXPECT_GT(spec_st.spec_draft_tokens, 0u);
    EXPECT_GT(spec_st.spec_accepted_tokens, 0u);
    EXPECT_EQ(spec_st.generated_tokens, plain_st.generated_tokens);
    EXPECT_LT(spec_st.steps, plain_st.steps);
  }
}

TEST(Engine, SubmitAllQueuesEveryChoiceOrNone) {
  Fixture f;
  auto model = std::make_shared<InferenceModel>(f.model, WeightFormat::kFP32);
  ServingEngine e(model, opts(64, 4).max_queue(4));
  SamplingParams p;
  p.max_tokens = 2;
  auto group = [&](int n) {
    std::vector<ServingEngine::Submission> g;
    for (int i = 0; i < n; ++i) g.push_back({prompt_of(i, 6), p, nullptr});
    return g;
  };
  EXPECT_FALSE(e.submit_all(group(5)).has_value());  // more than the queue holds
  EXPECT_EQ(e.stats().waiting, 0);
  const auto three = e.submit_all(group(3));
  ASSERT_TRUE(three.has_value());
  EXPECT_EQ(three->size(), 3u);
  EXPECT_FALSE(e.submit_all(group(2)).has_value());  // 3 + 2 > 4: none of the two
  EXPECT_TRUE(e.submit_all(group(1)).has_value());
  // A bad choice refuses the whole group before anything is queued.
  auto bad = group(2);
  bad[1].prompt.push_back(300);
  e.run_until_idle();
  ts_test::expect_error([&] { e.submit_all(std::move(bad)); }, "prompt token 300 is outside the vocabulary");
  EXPECT_EQ(e.stats().waiting, 0);
  EXPECT_EQ(e.stats().blocks_used, 0);
}

TEST(Engine, StopStringsQueueLimitAndCancel) {
  Fixture f;
  auto model = std::make_shared<InferenceModel>(f.model, WeightFormat::kFP32);
  // Greedy text first, then the same request stopping at a piece of it.
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 20;
  std::vector<int64_t> full;
  {
    ServingEngine e(model, opts(64, 4));
    e.submit(prompt_of(1, 6), p, [&](const RequestEvent& ev) { for (auto& t : ev.tokens) full.push_back(t.id); });
    e.run_until_idle();
  }
  ASSERT_EQ(full.size(), 20u);
  std::string bytes;
  for (int64_t t : full) bytes += static_cast<char>(t);
  const std::string stop = bytes.substr(8, 2);
  const size_t at = bytes.find(stop);
  SamplingParams ps = p;
  ps.stop = {stop};
  std::string text, reason;
  int64_t completion = 0;
  {
    ServingEngine e(model, opts(64, 4));
    e.submit(prompt_of(1, 6), ps, [&](const RequestEvent& ev) {
      text += ev.text;
      if (ev.finished) {
        reason = ev.finish_reason;
        completion = ev.completion_tokens;
      }
    });
    e.run_until_idle();
  }
  EXPECT_EQ(reason, "stop");
  EXPECT_EQ(text, sanitize_utf8(bytes.substr(0, at)));
  EXPECT_EQ(completion, static_cast<int64_t>(at + stop.size()));
  // Queue limit and cancellation: the blocks of a cancelled request come back.
  ServingEngine e(model, EngineOptions().max_queue(2).max_num_seqs(4).kv(KVCacheOptions().block_size(8).budget_mb(2)));
  std::string r1;
  auto id1 = e.submit(prompt_of(2, 10), p, [&](const RequestEvent& ev) { if (ev.finished) r1 = ev.finish_reason; });
  auto id2 = e.submit(prompt_of(3, 10), p, nullptr);
  EXPECT_TRUE(id1 && id2);
  EXPECT_FALSE(e.submit(prompt_of(4, 10), p, nullptr).has_value());  // queue full
  e.step();
  EXPECT_GT(e.stats().blocks_used, 0);
  e.cancel(*id1);
  e.cancel(*id2);
  e.step();
  EXPECT_EQ(r1, "abort");
  EXPECT_EQ(e.stats().blocks_used, 0);
  EXPECT_EQ(e.stats().running, 0);
  ts_test::expect_error([&] { e.submit(prompt_of(5, 60), p, nullptr); }, "exceed the model's context of 64");
}

// Prompt logprobs (echo with logprobs) once per prompt token, with the values of an unpreempted
// run, when a sequence is preempted in the middle of its prompt and recomputed (they were
// appended twice before).
TEST(Engine, PromptLogprobsOnceEachUnderPreemption) {
  Fixture f;
  auto model = std::make_shared<InferenceModel>(f.model, WeightFormat::kFP32);
  auto run = [&](const EngineOptions& o, uint64_t* preemptions) {
    ServingEngine e(model, o);
    std::vector<std::vector<GeneratedToken>> lps(12);
    for (int i = 0; i < 12; ++i) {
      SamplingParams p;
      p.temperature = 0;
      p.max_tokens = 10;
      p.logprobs = 1;
      p.prompt_logprobs = true;
      auto* out = &lps[static_cast<size_t>(i)];
      e.submit(prompt_of(i, 40), p, [out](const RequestEvent& ev) { out->insert(out->end(), ev.prompt.begin(), ev.prompt.end()); });
    }
    e.run_until_idle();
    *preemptions = e.stats().preemptions;
    return lps;
  };
  uint64_t none = 0, some = 0;
  const auto ref = run(opts(256, 1), &none);
  const double tiny = 12.0 * KVCache::bytes_per_block(f.cfg.n_layer, f.cfg.n_head, f.cfg.d_model / f.cfg.n_head,
                                                      KVCacheOptions().block_size(8)) / (1024.0 * 1024.0);
  const auto got = run(opts(9, 12, tiny), &some);
  EXPECT_EQ(none, 0u);
  EXPECT_GT(some, 0u);
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(ref[i].size(), 39u);
    ASSERT_EQ(got[i].size(), 39u) << "request " << i;
    for (size_t k = 0; k < ref[i].size(); ++k) {
      EXPECT_EQ(got[i][k].id, ref[i][k].id);
      EXPECT_NEAR(got[i][k].logprobs.logprob, ref[i][k].logprobs.logprob, 1e-4);
    }
  }
}

// NaN logits (a broken model) rank last instead of breaking std::sort's strict weak order.
TEST(Engine, DrainDeadlineAndThrowingReceivers) {
  Fixture f;
  auto model = std::make_shared<InferenceModel>(f.model, WeightFormat::kFP32);
  {
    ServingEngine e(model, opts(64, 4));
    std::atomic<int> aborted{0};
    SamplingParams p;
    p.max_tokens = 50;
    p.ignore_eos = true;
    for (int i = 0; i < 4; ++i) {
      e.submit(prompt_of(i, 8), p, [&](const RequestEvent& ev) {
        if (ev.finished && ev.finish_reason == "abort") ++aborted;
        if (!ev.finished) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      });
    }
    e.start();
    const auto t0 = std::chrono::steady_clock::now();
    e.stop(/*drain=*/true, /*drain_timeout_s=*/0.05);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
    EXPECT_EQ(aborted.load(), 4);
    EXPECT_FALSE(e.accepting());
    EXPECT_FALSE(e.failed());
  }
  {
    // A receiver that throws loses its own request; the others and the engine go on.
    ServingEngine e(model, opts(64, 4));
    std::string r2;
    int calls = 0;
    SamplingParams p;
    p.max_tokens = 5;
    e.submit(prompt_of(1, 8), p, [&](const RequestEvent&) {
      ++calls;
      throw std::runtime_error("boom in a sink");
    });
    e.submit(prompt_of(2, 8), p, [&](const RequestEvent& ev) { if (ev.finished) r2 = ev.finish_reason; });
    e.run_until_idle();
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(r2, "length");
    EXPECT_FALSE(e.failed());
    EXPECT_EQ(e.stats().blocks_used, 0);
    EXPECT_EQ(e.stats().requests_finished, 2u);
  }
}

// A checkpoint whose tensors disagree with its config (issue 35: the serving kernels index by the
// config's widths and read past the buffers) is refused before anything is built, with the
// tensor, its shape and the expected one named (Note [Serving tensor shapes]).
TEST(InferenceModel, RefusesTensorsWhoseShapesDisagreeWithTheConfig) {
  auto with = [](const Fixture& f, const std::string& name, const at::Tensor& t) {
    checkpoint::Model m = f.model;
    bool found = false;
    for (auto& [n, p] : m.params) {
      if (n == name) p = t, found = true;
    }
    EXPECT_TRUE(found) << name;
    return m;
  };
  for (const auto& [family, cfg] : family_cfgs()) {
    Fixture f(cfg);
    const int64_t d = cfg.d_model, qkv = cfg.q_width() + 2 * cfg.kv_width();
    // One row short of the fused q/k/v.
    auto m = with(f, "block1.qkv.weight", at::zeros({qkv - 1, d}));
    ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); },
                          "test model: tensor \"block1.qkv.weight\" has shape [" + std::to_string(qkv - 1) + ", " +
                              std::to_string(d) + "], but the model's config needs [" + std::to_string(qkv) + ", " +
                              std::to_string(d) + "]");
    // A norm's weight too short, an MLP weight transposed, the embedding's vocabulary smaller.
    m = with(f, "block0.ln2.weight", at::ones({d / 2}));
    ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kBF16); },
                          "tensor \"block0.ln2.weight\" has shape [" + std::to_string(d / 2) + "], but the model's config needs [" +
                              std::to_string(d) + "]");
    m = with(f, "block0.mlp_proj.weight", at::zeros({cfg.ff(), d}));
    ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kInt8); },
                          "tensor \"block0.mlp_proj.weight\" has shape [" + std::to_string(cfg.ff()) + ", " + std::to_string(d) + "]");
    m = with(f, "embed.tok.weight", at::zeros({cfg.vocab - 1, d}));
    ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); }, "tensor \"embed.tok.weight\" has shape [255, ");
    // Integer data is no weight, whatever its shape.
    m = with(f, "block1.attn_proj.weight", at::zeros({d, cfg.q_width()}, at::kInt));
    ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); },
                          "tensor \"block1.attn_proj.weight\" has dtype Int; a model's weights are floating point");
    if (cfg.qkv_bias) {
      m = with(f, "block0.qkv.bias", at::zeros({qkv + 5}));
      ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); }, "tensor \"block0.qkv.bias\" has shape [");
    }
    if (cfg.qk_norm) {
      m = with(f, "block1.k_norm.weight", at::ones({cfg.hd() / 2}));
      ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); }, "tensor \"block1.k_norm.weight\" has shape [16]");
    }
    if (!cfg.tie_embeddings) {
      m = with(f, "head.weight", at::zeros({cfg.vocab, d + 1}));
      ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); }, "tensor \"head.weight\" has shape [256, 65]");
    }
    // A missing tensor and a repeated one are named too; the model itself still builds.
    m = f.model;
    m.params.erase(m.params.begin() + 1);
    ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); }, "the model has no tensor \"" + f.model.params[1].first);
    m = f.model;
    m.params.push_back(m.params.front());
    ts_test::expect_error([&] { InferenceModel s(m, WeightFormat::kFP32); }, "tensor \"embed.tok.weight\" is listed twice");
    EXPECT_NO_THROW(InferenceModel(f.model, WeightFormat::kFP32)) << family;
  }
  // A serving linear checks its own bias against its weight (the kernels read bias[out]).
  ts_test::expect_error([] { ServingLinear l(at::zeros({8, 4}), at::zeros({7}), WeightFormat::kFP32); },
                        "a linear bias must be floating point [8] for a weight [8, 4], got [7]");
  ts_test::expect_error([] { ServingLinear l(at::zeros({8}), at::Tensor(), WeightFormat::kFP32); },
                        "a linear weight must be 2-D, got [8]");
}
