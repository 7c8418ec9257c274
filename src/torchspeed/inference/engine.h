// The serving engine: requests in, tokens out, one loop that batches continuously. Each
// iteration the scheduler builds one forward pass under a token budget: every running decode
// first (one token each), then chunks of prompts (FastGen's Dynamic SplitFuse, vLLM's chunked
// prefill), admitting waiting requests while KV blocks and sequence slots allow. A request
// never waits for another to finish; when the cache runs out the latest admitted sequence is
// preempted (its blocks freed, recomputed later). Finished, cancelled and disconnected
// requests return their blocks in the same iteration. With a tensor-parallel group, rank 0
// runs the loop and sends each step's plan to the other ranks, which run `follow`.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "torchspeed/data/tokenizer.h"
#include "torchspeed/inference/kv_cache.h"
#include "torchspeed/inference/model.h"
#include "torchspeed/inference/sampler.h"
#include "torchspeed/inference/text.h"

namespace torchspeed::inference {

// Speculative decoding (Note [Speculative decoding]), as vLLM's --speculative-config: n-gram
// prompt lookup proposes up to num_speculative_tokens tokens for each greedy decode, and one
// forward pass verifies them.
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

struct EngineOptions {
  TORCH_ARG(int64_t, max_num_seqs) = 16;             // sequences in one forward pass
  TORCH_ARG(int64_t, max_num_batched_tokens) = 256;  // tokens in one forward pass
  TORCH_ARG(int64_t, max_queue) = 64;                // waiting requests before submit refuses
  TORCH_ARG(KVCacheOptions, kv) = KVCacheOptions();
  // Full KV blocks shared between sequences that begin with the same tokens (Note [Prefix
  // caching]); vLLM's --enable-prefix-caching, on by default as in vLLM's v1 engine.
  TORCH_ARG(bool, prefix_caching) = true;
  TORCH_ARG(SpeculativeOptions, speculative) = SpeculativeOptions();
  // Token ids to text (and the end-of-text token that ends a sequence); null: bytes.
  TORCH_ARG(data::TokenizerPtr, tokenizer) = nullptr;
};

struct GeneratedToken {
  int64_t id = 0;
  TokenLogprobs logprobs;
};

// What a request's sink receives: new text and tokens, then one event with `finished`.
struct RequestEvent {
  std::string text;                     // new valid UTF-8 text (stop strings never included)
  std::vector<GeneratedToken> tokens;   // tokens generated since the last event
  std::vector<GeneratedToken> prompt;   // once, with prompt_logprobs: prompt tokens 1.. (0 has none)
  bool finished = false;
  std::string finish_reason;            // "stop", "length", "abort"
  int64_t prompt_tokens = 0, completion_tokens = 0;
};
using Sink = std::function<void(const RequestEvent&)>;  // called on the engine's thread

struct Histogram {
  std::vector<double> bounds;        // upper bounds, seconds
  std::vector<uint64_t> counts;      // per bucket (cumulative in to_prometheus)
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v);
};

struct EngineStats {
  int64_t running = 0, waiting = 0, blocks_used = 0, blocks_free = 0, blocks_total = 0, block_size = 0;
  uint64_t requests_finished = 0, prompt_tokens = 0, generated_tokens = 0, preemptions = 0, steps = 0;
  // Prefix caching: tokens looked up in the cache when a sequence was admitted, tokens found
  // there (vLLM's prefix_cache_queries / prefix_cache_hits), and blocks published.
  uint64_t prefix_cache_queries = 0, prefix_cache_hits = 0;
  int64_t prefix_cache_blocks = 0;
  // Speculative decoding: draft tokens proposed and verified, and how many were accepted.
  uint64_t spec_draft_tokens = 0, spec_accepted_tokens = 0;
  Histogram ttft, itl;
  double busy_seconds = 0;  // time spent in forward passes and sampling
  uint64_t tp_collectives = 0, tp_bytes = 0;  // this rank's ops on the tensor-parallel group
};

// `kv` with a budget of 0 made concrete for `model`: 256 MB, or two sequences of its whole
// context where that is more.
KVCacheOptions resolve_kv(const KVCacheOptions& kv, const InferenceModel& model);

// embed() when the KV cache has no room for the input at the moment (a server answers 503).
struct EngineBusy : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Engine {
 public:
  // `tp`: the tensor-parallel group (rank 0 calls this; the others call follow()).
  Engine(std::shared_ptr<InferenceModel> model, const EngineOptions& options, comm::CommunicatorPtr tp = nullptr);
  ~Engine();

  // Queues a request; returns its id, or nullopt when the queue is full. The prompt must fit
  // the context with max_tokens (checked here: TS_CHECK names the limit).
  // `adapter`: the LoRA adapter the request runs with (InferenceModel::add_adapter's id; 0: none).
  std::optional<uint64_t> submit(std::vector<int64_t> prompt, const SamplingParams& params, Sink sink,
                                 int32_t adapter = 0);
  // Several sequences that belong together (a request's prompts x n): every one is checked
  // first (TS_CHECK names the bad one), then all are queued or, when the queue lacks room for
  // all of them, none (nullopt). Ids in the order given.
  struct Submission {
    std::vector<int64_t> prompt;
    SamplingParams params;
    Sink sink;
    int32_t adapter = 0;
  };
  std::optional<std::vector<uint64_t>> submit_all(std::vector<Submission> group);
  // Ends a request (a client that went away): its blocks are freed on the next iteration and
  // its sink gets a finished event with reason "abort".
  void cancel(uint64_t id);

  // The loop on a thread of its own; stop() lets running and waiting requests finish first
  // when `drain` (for at most drain_timeout_s, then aborts the rest), otherwise aborts them;
  // then joins (and tells TP followers to exit).
  void start();
  // The loop on the caller's thread until stop() is called from another one. Preferred for a
  // server: the thread that loaded the model owns LibTorch's OpenMP team, and a second team on
  // another thread costs 12-25% of decode speed on 2 cores (measured).
  void run();
  void stop(bool drain, double drain_timeout_s = 1e30);
  // False once stopping (submit refuses everything then).
  bool accepting() const;
  // A forward pass threw (a TP peer gone, out of memory): every request was aborted and the
  // loop ended; failure() is the error.
  bool failed() const;
  std::string failure() const;
  // Embeddings (vLLM's pooling): per input, the final hidden states (after the final norm) of
  // its last token (kLast) or the mean over its tokens (kMean), L2-normalized when `normalize`.
  // Computed on the engine's thread between two steps (on the caller's when no loop runs), in
  // free blocks of the KV cache (EngineBusy when there are too few now). Throws Error for a bad
  // input or when stopping, and what the forward throws.
  enum class Pooling { kLast, kMean };
  std::vector<std::vector<float>> embed(const std::vector<std::vector<int64_t>>& inputs, Pooling pooling, bool normalize);
  // One iteration on the caller's thread (tests, no thread started): false when idle.
  bool step();
  // Runs steps until every submitted request finished (tests).
  void run_until_idle();

  EngineStats stats() const;
  const InferenceModel& model() const { return *model_; }
  const EngineOptions& options() const { return options_; }
  // The tokenizer in use (bytes when the options gave none).
  const data::TokenizerPtr& tokenizer() const { return tokenizer_; }
  int64_t context_length() const { return model_->config().seq_len; }
  int64_t kv_cache_bytes() const { return cache_->bytes(); }

  // TP ranks other than 0: run every plan rank 0 sends until it says stop.
  static void follow(InferenceModel& model, const EngineOptions& options, const comm::CommunicatorPtr& tp);

 private:
  struct Sequence;
  void admit_inbox();
  void run_tasks();  // the queued embed() calls
  bool schedule(StepPlan& plan, std::vector<Sequence*>& order);
  void finish(Sequence& s, const std::string& reason);
  void deliver(Sequence& s, const RequestEvent& ev);
  void preempt_last();
  bool ensure_blocks(Sequence& s, int64_t positions);
  void send_plan(const StepPlan* plan);
  void loop();
  void publish_stats();

  std::shared_ptr<InferenceModel> model_;
  EngineOptions options_;
  comm::CommunicatorPtr tp_;
  std::unique_ptr<KVCache> cache_;
  BlockPool pool_;
  data::TokenizerPtr tokenizer_;
  int64_t eos_;
  std::once_flag trie_once_;
  std::shared_ptr<const TokenTrie> trie_;  // for structured output, on first use

  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::unique_ptr<Sequence>> inbox_;
  std::deque<std::function<void()>> tasks_;  // run on the loop's thread between steps (embed)
  std::set<uint64_t> cancelled_;
  uint64_t next_id_ = 1;
  bool stopping_ = false, drain_ = true, followers_stopped_ = false;
  bool loop_running_ = false;
  std::atomic<bool> failed_{false};
  uint64_t fault_step_ = 0;  // TORCHSPEED_INFERENCE_FAULT=step:N (tests)
  std::string failure_;
  std::atomic<int64_t> queued_{0};  // inbox + waiting
  EngineStats stats_;  // what stats() returns, copied from ls_ after each step
  EngineStats ls_;     // owned by the loop

  // Owned by the loop.
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::thread thread_;
};

}  // namespace torchspeed::inference
