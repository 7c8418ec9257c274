// The serving scheduler without a model (as pipeline/schedule is tested without one): a
// BlockPool and sequences in, step plans out. The engine's part of a step (computing the chunks,
// sampling a token) is played by `run`, which appends token 100 + id.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "torchspeed/inference/scheduler.h"

using namespace torchspeed::inference;

namespace {

ScheduledSequence* seq(Scheduler& s, uint64_t id, std::vector<int64_t> prompt, int64_t max_tokens = 16, bool greedy = false) {
  auto p = std::make_unique<ScheduledSequence>();
  p->id = id;
  p->tokens = std::move(prompt);
  p->max_tokens = max_tokens;
  p->greedy = greedy;
  ScheduledSequence* raw = p.get();
  s.add(std::move(p));
  return raw;
}

// What the engine does with a plain step's plan: every chunk computed, and a sequence whose
// tokens are all computed gets its next one.
void run(const StepDecision& d) {
  for (size_t i = 0; i < d.order.size(); ++i) {
    ScheduledSequence& s = *d.order[i];
    s.computed += static_cast<int64_t>(d.plan.seqs[i].tokens.size());
    if (s.computed == static_cast<int64_t>(s.tokens.size())) {
      s.tokens.push_back(100 + static_cast<int64_t>(s.id));
      ++s.generated;
    }
  }
}

std::vector<int64_t> range(int64_t from, int64_t n) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(from + i);
  return v;
}

}  // namespace

TEST(Scheduler, DecodesFirstThenPromptChunksThenAdmissionsUnderTheBudget) {
  BlockPool pool(64);
  Scheduler s(SchedulerOptions().max_num_batched_tokens(8), pool, 4);
  ScheduledSequence* a = seq(s, 1, range(0, 6));
  ScheduledSequence* b = seq(s, 2, range(10, 10));
  StepDecision d = s.schedule();
  ASSERT_EQ(d.order, (std::vector<ScheduledSequence*>{a, b}));
  EXPECT_EQ(d.admitted, 2);
  EXPECT_EQ(d.plan.seqs[0].tokens, range(0, 6));  // a's whole prompt, its last row's logits
  EXPECT_TRUE(d.plan.seqs[0].want_logits);
  EXPECT_EQ(d.plan.seqs[1].tokens, range(10, 2));  // b's first chunk: the budget's last 2 tokens
  EXPECT_FALSE(d.plan.seqs[1].want_logits);
  EXPECT_EQ(d.plan.seqs[0].blocks.size(), 2u);
  run(d);
  d = s.schedule();  // a decodes first (one token), then b's next 7
  ASSERT_EQ(d.order, (std::vector<ScheduledSequence*>{a, b}));
  EXPECT_EQ(d.plan.seqs[0].start, 6);
  EXPECT_EQ(d.plan.seqs[0].tokens, std::vector<int64_t>{101});
  EXPECT_EQ(d.plan.seqs[1].start, 2);
  EXPECT_EQ(d.plan.seqs[1].tokens, range(12, 7));
  EXPECT_EQ(d.admitted, 0);
  // The plan crosses to the other tensor-parallel ranks as it is.
  const StepPlan back = StepPlan::deserialize(d.plan.serialize());
  ASSERT_EQ(back.seqs.size(), 2u);
  EXPECT_EQ(back.seqs[1].tokens, d.plan.seqs[1].tokens);
  EXPECT_EQ(back.seqs[1].blocks, d.plan.seqs[1].blocks);
  EXPECT_EQ(back.seqs[1].want_logits, d.plan.seqs[1].want_logits);
}

TEST(Scheduler, SequenceSlotsLimitAdmissionAndRemovalFreesThem) {
  BlockPool pool(64);
  Scheduler s(SchedulerOptions().max_num_seqs(1), pool, 4);
  ScheduledSequence* a = seq(s, 1, range(0, 3));
  ScheduledSequence* b = seq(s, 2, range(0, 3));
  StepDecision d = s.schedule();
  EXPECT_EQ(d.order, std::vector<ScheduledSequence*>{a});
  EXPECT_EQ(s.waiting().size(), 1u);
  std::unique_ptr<ScheduledSequence> gone = s.remove(a);  // finished: the caller releases its blocks
  pool.release(gone->blocks);
  d = s.schedule();
  EXPECT_EQ(d.order, std::vector<ScheduledSequence*>{b});
  EXPECT_EQ(pool.used(), 1);
  s.remove(b);
  EXPECT_TRUE(s.idle());
}

TEST(Scheduler, ADecodeWithoutBlocksPreemptsTheLatestAdmitted) {
  BlockPool pool(4);  // 16 slots: two prompts of 8 fill them
  Scheduler s(SchedulerOptions().max_num_batched_tokens(64), pool, 4);
  ScheduledSequence* a = seq(s, 1, range(0, 8));
  ScheduledSequence* b = seq(s, 2, range(20, 8));
  StepDecision d = s.schedule();
  ASSERT_EQ(d.order.size(), 2u);
  EXPECT_EQ(pool.free(), 0);
  run(d);
  // Both decode and need a third block; a goes first and takes b's: b is preempted, back at the
  // front of the queue with nothing computed, and cannot be admitted again this step.
  d = s.schedule();
  EXPECT_EQ(d.order, std::vector<ScheduledSequence*>{a});
  EXPECT_EQ(d.preempted, 1);
  EXPECT_EQ(d.admitted, 0);
  ASSERT_EQ(s.waiting().size(), 1u);
  EXPECT_EQ(s.waiting().front().get(), b);
  EXPECT_EQ(b->computed, 0);
  EXPECT_TRUE(b->blocks.empty());
  EXPECT_EQ(a->blocks.size(), 3u);
  // Once a ends, b comes back and recomputes its prompt and its generated token.
  pool.release(s.remove(a)->blocks);
  d = s.schedule();
  EXPECT_EQ(d.order, std::vector<ScheduledSequence*>{b});
  EXPECT_EQ(d.plan.seqs[0].start, 0);
  EXPECT_EQ(d.plan.seqs[0].tokens.size(), 9u);
}

TEST(Scheduler, PrefixCacheHitsStartAfterTheSharedBlocks) {
  BlockPool pool(16, 4);  // prefix caching on
  Scheduler s(SchedulerOptions(), pool, 4);
  ScheduledSequence* a = seq(s, 1, range(0, 10));
  StepDecision d = s.schedule();
  EXPECT_EQ(d.prefix_queries, 10u);
  EXPECT_EQ(d.prefix_hits, 0u);
  run(d);
  // The engine publishes a's full blocks as they are computed.
  for (int64_t b = 0; b < 2; ++b) {
    a->block_keys.push_back(pool.publish(b > 0 ? a->block_keys[b - 1] : 0, a->tokens.data() + b * 4, a->blocks[b]));
  }
  std::vector<int64_t> prompt = range(0, 8);  // the same first two blocks, then its own
  prompt.insert(prompt.end(), {50, 51, 52});
  ScheduledSequence* b = seq(s, 2, prompt);
  d = s.schedule();
  ASSERT_EQ(d.order.size(), 2u);  // a's decode, then b admitted
  EXPECT_EQ(d.order[1], b);
  EXPECT_EQ(d.prefix_queries, 11u);
  EXPECT_EQ(d.prefix_hits, 8u);
  EXPECT_EQ(d.plan.seqs[1].start, 8);
  EXPECT_EQ(d.plan.seqs[1].tokens, (std::vector<int64_t>{50, 51, 52}));
  EXPECT_EQ(std::vector<int32_t>(b->blocks.begin(), b->blocks.begin() + 2),
            std::vector<int32_t>(a->blocks.begin(), a->blocks.begin() + 2));  // shared, not copied
}

TEST(Scheduler, GreedyDecodesCarryNgramDrafts) {
  BlockPool pool(16);
  Scheduler s(SchedulerOptions().speculative(SpeculativeOptions().num_speculative_tokens(3)), pool, 4);
  ScheduledSequence* g = seq(s, 1, {7, 1, 2, 3, 9, 1, 2}, 16, /*greedy=*/true);
  ScheduledSequence* t = seq(s, 2, {7, 1, 2, 3, 9, 1, 2}, 16, /*greedy=*/false);
  run(s.schedule());
  g->tokens.back() = 3, t->tokens.back() = 3;  // both chose 3: "1 2 3" was seen before
  StepDecision d = s.schedule();
  ASSERT_EQ(d.order, (std::vector<ScheduledSequence*>{g, t}));
  // The greedy one verifies "9 1 2" (what followed "1 2 3") after its decode token; the sampled
  // one gets none (its tokens would need rejection sampling).
  EXPECT_EQ(d.plan.seqs[0].tokens, (std::vector<int64_t>{3, 9, 1, 2}));
  EXPECT_TRUE(d.plan.seqs[0].speculative && d.plan.seqs[0].all_logits);
  EXPECT_EQ(d.plan.seqs[1].tokens, std::vector<int64_t>{3});
  EXPECT_FALSE(d.plan.seqs[1].speculative);
}
