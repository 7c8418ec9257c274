// The serving engine: requests in, tokens out, one loop that batches continuously. Each
// iteration the scheduler (scheduler.h: decodes first, then prompt chunks, then admissions,
// under a token budget; the latest admitted sequence preempted when the cache runs out) plans
// one forward pass; the engine runs it, samples, streams text to each request's sink and ends
// finished, cancelled and disconnected requests, whose blocks return in the same iteration. A
// request never waits for another to finish. With a tensor-parallel group, rank 0 runs the loop
// and sends each step's plan to the other ranks, which run `follow`.
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
#include "torchspeed/inference/scheduler.h"
#include "torchspeed/inference/text_stream.h"

namespace torchspeed::inference {

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

class ServingEngine {
 public:
  // `tp`: the tensor-parallel group (rank 0 calls this; the others call follow()).
  ServingEngine(std::shared_ptr<InferenceModel> model, const EngineOptions& options, comm::CommunicatorPtr tp = nullptr);
  ~ServingEngine();

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
  void finish(Sequence& s, const std::string& reason);
  void deliver(Sequence& s, const RequestEvent& ev);
  void send_plan(const StepPlan* plan);
  void loop();
  void publish_stats();

  std::shared_ptr<InferenceModel> model_;
  EngineOptions options_;
  comm::CommunicatorPtr tp_;
  std::unique_ptr<KVCache> cache_;
  BlockPool pool_;
  Scheduler sched_;  // the waiting and running sequences (owned by the loop)
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
  std::atomic<int64_t> queued_{0};  // inbox + the scheduler's waiting
  EngineStats stats_;  // what stats() returns, copied from ls_ after each step
  EngineStats ls_;     // owned by the loop

  std::thread thread_;
};

}  // namespace torchspeed::inference
