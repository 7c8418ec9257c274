// The serving engine's scheduler: the waiting and running sequences and the KV block pool in,
// one step's plan out. Each step runs every running decode first (one token each, with n-gram
// drafts to verify for greedy ones), then chunks of running prompts, then admits waiting
// sequences in arrival order (FastGen's Dynamic SplitFuse, vLLM's chunked prefill) while the
// token budget, the sequence slots and the blocks allow. When a decode finds no free block the
// most recently admitted sequences are preempted (their blocks freed, recomputed later from the
// front of the queue). No model, no tensors, no threads: tests drive it with a BlockPool alone
// (tests/unit/test_scheduler.cpp), and the engine (serving_engine.h) samples, streams and ends
// requests around it.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "torchspeed/inference/kv_cache.h"

namespace torchspeed::inference {

// One sequence's part of a forward pass: tokens at positions [start, start + tokens.size()),
// attending to every earlier position of the sequence (already in the cache).
struct SeqChunk {
  int64_t start = 0;
  std::vector<int64_t> tokens;
  std::vector<int32_t> blocks;  // the sequence's block table (covers start + tokens.size())
  bool all_logits = false;      // logits for every token of the chunk, not just the last
  bool want_logits = true;      // false: a prompt chunk that is not the prompt's end
  // A decode token followed by draft tokens to verify (speculative decoding): every row is
  // computed as a decode row (the row kernels, attention row by row over the positions up to
  // its own), so each gets the bits it would get decoded alone. Needs all_logits.
  bool speculative = false;
  int32_t adapter = 0;  // the LoRA adapter the chunk runs with (InferenceModel::add_adapter's id; 0: none)
};

// One forward pass over several sequences.
struct StepPlan {
  std::vector<SeqChunk> seqs;
  // Flat int64 form, for sending the plan to the other tensor-parallel ranks.
  std::vector<int64_t> serialize() const;
  static StepPlan deserialize(const std::vector<int64_t>& flat);
};

// Speculative decoding (Note [Speculative decoding] in scheduler.cpp), as vLLM's
// --speculative-config: n-gram prompt lookup proposes up to num_speculative_tokens tokens for
// each greedy decode, and one forward pass verifies them.
struct SpeculativeOptions {
  TORCH_ARG(int64_t, num_speculative_tokens) = 0;  // 0: off
  TORCH_ARG(int64_t, prompt_lookup_max) = 4;       // the longest n-gram matched
  TORCH_ARG(int64_t, prompt_lookup_min) = 1;       // the shortest
  TORCH_ARG(int64_t, disable_by_batch_size) = 0;   // no drafts while more sequences run (0: no limit)
  // (TORCH_ARG leaves the struct's members private.)
 public:
  // vLLM's JSON (`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`);
  // a key we do not honour is refused by name.
  static SpeculativeOptions from_json(const std::string& text);
};

// n-gram prompt lookup: the tokens that followed the latest earlier occurrence of the last n
// tokens, for the largest n in [min_n, max_n] that occurs earlier; at most k of them (none when
// no such n-gram occurs).
std::vector<int64_t> ngram_propose(const std::vector<int64_t>& tokens, int64_t min_n, int64_t max_n, int64_t k);

struct SchedulerOptions {
  TORCH_ARG(int64_t, max_num_seqs) = 16;             // sequences in one forward pass
  TORCH_ARG(int64_t, max_num_batched_tokens) = 256;  // tokens in one forward pass
  TORCH_ARG(int64_t, context) = 1024;                // the model's positions (drafts stay within)
  TORCH_ARG(SpeculativeOptions, speculative) = SpeculativeOptions();
};

// What the scheduler reads and changes of a request. The engine's sequences extend it with
// sampling, text and delivery.
struct ScheduledSequence {
  uint64_t id = 0;
  std::vector<int64_t> tokens;  // prompt, then generated
  int64_t computed = 0;         // tokens whose keys and values are in the cache
  int64_t generated = 0;        // tokens generated so far
  int64_t max_tokens = 1;       // tokens it may generate
  bool greedy = false;          // temperature 0: may be speculated on
  bool prompt_lp_pending = false;  // prompt logprobs wanted: every prompt row's logits, no cache lookup
  int32_t adapter = 0;          // LoRA adapter (0: the base model)
  std::vector<int32_t> blocks;       // its block table
  std::vector<uint64_t> block_keys;  // prefix keys of blocks [0, size) (published or matched)
  // The prefix cache's root for the sequence: each adapter's KV entries are its own.
  uint64_t cache_root() const { return adapter == 0 ? 0 : ~uint64_t{0} - static_cast<uint64_t>(adapter); }
  virtual ~ScheduledSequence() = default;
};

// One step: the plan, the sequence of each of its chunks, and what the step did to the queues.
struct StepDecision {
  StepPlan plan;
  std::vector<ScheduledSequence*> order;  // plan.seqs[i] is order[i]'s
  int64_t admitted = 0;                   // waiting -> running
  int64_t preempted = 0;                  // running -> the front of waiting
  uint64_t prefix_queries = 0, prefix_hits = 0;  // tokens looked up in the prefix cache, and found
  bool empty() const { return plan.seqs.empty(); }
};

class Scheduler {
 public:
  // `pool` (with its prefix cache when caching() is on) stays the caller's; the scheduler takes
  // and releases its blocks.
  Scheduler(const SchedulerOptions& options, BlockPool& pool, int64_t block_size);

  // A new sequence, at the back of the queue.
  void add(std::unique_ptr<ScheduledSequence> s);
  // Takes `s` (running or waiting) out of the scheduler, for the caller to end; its blocks are
  // still held (the caller releases them).
  std::unique_ptr<ScheduledSequence> remove(const ScheduledSequence* s);
  // Plans the next forward pass (see the file's comment); empty when there is nothing to run.
  StepDecision schedule();

  const std::vector<std::unique_ptr<ScheduledSequence>>& running() const { return running_; }
  const std::deque<std::unique_ptr<ScheduledSequence>>& waiting() const { return waiting_; }
  bool idle() const { return running_.empty() && waiting_.empty(); }
  const SchedulerOptions& options() const { return options_; }

 private:
  bool ensure_blocks(ScheduledSequence& s, int64_t positions);
  void preempt_last(StepDecision& d);

  SchedulerOptions options_;
  BlockPool& pool_;
  int64_t block_size_;
  std::deque<std::unique_ptr<ScheduledSequence>> waiting_;  // arrival order, preempted ones first
  std::vector<std::unique_ptr<ScheduledSequence>> running_;  // admission order
};

}  // namespace torchspeed::inference
