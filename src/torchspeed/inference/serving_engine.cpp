#include "torchspeed/inference/serving_engine.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "torchspeed/data/text.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

namespace torchspeed::inference {

using Clock = std::chrono::steady_clock;

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  ++counts[i];
  sum += v;
  ++count;
}

namespace {
std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 30};
}
// Plan headers on the TP group: > 0 a plan of that many int64s follows, 0 keep-alive, -1 stop.
constexpr int64_t kKeepAlive = 0, kStop = -1;
}  // namespace

// A request as the engine holds it: the scheduler's part (tokens, blocks; scheduler.h), then
// sampling, text and delivery.
struct ServingEngine::Sequence : ScheduledSequence {
  int64_t prompt_len = 0;
  SamplingParams params;
  Sampler sampler;
  TextStream text;
  Sink sink;
  Clock::time_point submitted, last_token;
  int64_t prompt_lp_count = 0;  // prompt logprobs produced (a preempted prompt recomputes: not twice)
  std::vector<GeneratedToken> new_tokens, prompt_lps;
  bool stopped = false;
  Sequence(const SamplingParams& p, int64_t eos) : params(p), sampler(p, eos), text(p.stop) {
    greedy = p.temperature <= 0;
    max_tokens = p.max_tokens;
  }
};

KVCacheOptions resolve_kv(const KVCacheOptions& kv, const InferenceModel& model) {
  if (kv.budget_mb() > 0) return kv;
  // Auto: 256 MB, or two sequences of the model's whole context where that is more (a Llama of
  // 8192 positions needs 377 MB per sequence in fp32).
  const double block = static_cast<double>(KVCache::bytes_per_block(model.config().n_layer, model.local_kv_heads(), model.head_dim(), kv));
  const double two_full = 2.0 * static_cast<double>(blocks_for(model.config().seq_len, kv.block_size())) * block;
  KVCacheOptions out = kv;
  out.budget_mb(std::max(256.0, two_full / 1048576.0 + 1.0));
  return out;
}

ServingEngine::ServingEngine(std::shared_ptr<InferenceModel> model, const EngineOptions& options_in, comm::CommunicatorPtr tp)
    : model_(std::move(model)),
      options_(EngineOptions(options_in).kv(resolve_kv(options_in.kv(), *model_))),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      cache_(std::make_unique<KVCache>(model_->config().n_layer, model_->local_kv_heads(), model_->head_dim(), options_.kv())),
      pool_(cache_->num_blocks(), options_.prefix_caching() ? cache_->block_size() : 0),
      sched_(SchedulerOptions()
                 .max_num_seqs(options_.max_num_seqs())
                 .max_num_batched_tokens(options_.max_num_batched_tokens())
                 .context(model_->config().seq_len)
                 .speculative(options_.speculative()),
             pool_, cache_->block_size()),
      tokenizer_(options_.tokenizer() ? options_.tokenizer() : std::make_shared<data::ByteTokenizer>()),
      eos_(tokenizer_->eos_id()) {
  TS_CHECK(tokenizer_->vocab_size() <= model_->config().vocab, "the tokenizer (", tokenizer_->source(), ") has ",
           tokenizer_->vocab_size(), " tokens, more than the model's vocabulary of ", model_->config().vocab);
  TS_CHECK(options_.max_queue() >= 1, "--max-queue must be at least 1 (a request's choices wait there before they run), got ",
           options_.max_queue());
  // Test hook (the server's failure tests): TORCHSPEED_INFERENCE_FAULT=step:N makes the N-th
  // forward pass throw, as a failed TP peer or an allocation would.
  if (const char* f = std::getenv("TORCHSPEED_INFERENCE_FAULT"); f && std::string(f).rfind("step:", 0) == 0) {
    fault_step_ = std::strtoull(f + 5, nullptr, 10);
  }
  const int64_t full = blocks_for(model_->config().seq_len, cache_->block_size());
  TS_CHECK(cache_->num_blocks() >= full, "--kv-cache-mb ", options_.kv().budget_mb(), " holds ", cache_->num_blocks(),
           " blocks of ", cache_->block_size(), " tokens; one sequence of the model's full context (",
           model_->config().seq_len, " tokens) needs ", full, ": raise --kv-cache-mb");
  ls_.ttft = Histogram(latency_buckets());
  ls_.itl = Histogram(latency_buckets());
  publish_stats();
}

ServingEngine::~ServingEngine() {
  try {
    if (thread_.joinable() || (tp_ && !followers_stopped_)) stop(false);
  } catch (const std::exception& e) {
    log::error("inference engine: stopping failed: ", e.what());
  }
}

std::optional<uint64_t> ServingEngine::submit(std::vector<int64_t> prompt, const SamplingParams& params, Sink sink,
                                       int32_t adapter) {
  std::vector<Submission> one;
  one.push_back({std::move(prompt), params, std::move(sink), adapter});
  const auto ids = submit_all(std::move(one));
  if (!ids) return std::nullopt;
  return ids->front();
}

std::optional<std::vector<uint64_t>> ServingEngine::submit_all(std::vector<Submission> group) {
  const int64_t ctx = model_->config().seq_len, vocab = model_->config().vocab;
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (Submission& sub : group) {
    const auto& prompt = sub.prompt;
    const SamplingParams& params = sub.params;
    TS_CHECK(!prompt.empty(), "the prompt is empty");
    TS_CHECK(params.max_tokens >= 1, "max_tokens must be at least 1, got ", params.max_tokens);
    TS_CHECK(static_cast<int64_t>(prompt.size()) + params.max_tokens <= ctx, "the prompt (",
             prompt.size(), " tokens) and max_tokens (", params.max_tokens, ") exceed the model's context of ", ctx,
             " tokens");
    for (int64_t t : prompt) TS_CHECK(t >= 0 && t < vocab, "prompt token ", t, " is outside the vocabulary [0, ", vocab, ")");
    TS_CHECK(sub.adapter >= 0 && sub.adapter <= model_->num_adapters(), "LoRA adapter ", sub.adapter, " is not loaded (",
             model_->num_adapters(), " are)");
    auto s = std::make_unique<Sequence>(params, eos_);
    s->adapter = sub.adapter;
    if (params.grammar) {
      // Note [Structured output]: the vocabulary's trie, built by the first request that needs it.
      std::call_once(trie_once_, [&] { trie_ = std::make_shared<const TokenTrie>(*tokenizer_, vocab); });
      std::vector<int64_t> ends = params.eos_token_ids;
      if (eos_ >= 0) ends.push_back(eos_);
      ends.insert(ends.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
      s->sampler.constrain(std::make_unique<GrammarMatcher>(params.grammar, trie_, std::move(ends)));
    }
    s->prompt_len = static_cast<int64_t>(prompt.size());
    s->tokens = std::move(sub.prompt);
    s->sink = std::move(sub.sink);
    s->prompt_lp_pending = params.prompt_logprobs;
    seqs.push_back(std::move(s));
  }
  const auto now = Clock::now();
  std::vector<uint64_t> ids;
  std::lock_guard<std::mutex> g(mu_);
  if (stopping_ || queued_.load() + static_cast<int64_t>(seqs.size()) > options_.max_queue()) return std::nullopt;
  for (auto& s : seqs) {
    s->id = next_id_++;
    s->submitted = now;
    ids.push_back(s->id);
    inbox_.push_back(std::move(s));
    ++queued_;
  }
  cv_.notify_one();
  return ids;
}

void ServingEngine::cancel(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  cancelled_.insert(id);
  cv_.notify_one();
}

void ServingEngine::admit_inbox() {
  std::set<uint64_t> cancelled;
  bool abort_all = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    while (!inbox_.empty()) {
      sched_.add(std::move(inbox_.front()));
      inbox_.pop_front();
    }
    cancelled.swap(cancelled_);
    abort_all = stopping_ && !drain_;
  }
  auto gone = [&](const std::unique_ptr<ScheduledSequence>& s) { return abort_all || cancelled.count(s->id) > 0; };
  std::vector<const ScheduledSequence*> running, waiting;
  for (const auto& s : sched_.running()) {
    if (gone(s)) running.push_back(s.get());
  }
  for (const auto& s : sched_.waiting()) {
    if (gone(s)) waiting.push_back(s.get());
  }
  for (const ScheduledSequence* s : running) finish(static_cast<Sequence&>(*sched_.remove(s)), "abort");
  for (const ScheduledSequence* s : waiting) {
    finish(static_cast<Sequence&>(*sched_.remove(s)), "abort");
    --queued_;
  }
}

void ServingEngine::finish(Sequence& s, const std::string& reason) {
  pool_.release(s.blocks);
  RequestEvent ev;
  ev.text = s.text.take(true);
  ev.tokens = std::move(s.new_tokens);
  ev.prompt = std::move(s.prompt_lps);
  ev.finished = true;
  ev.finish_reason = reason;
  ev.prompt_tokens = s.prompt_len;
  ev.completion_tokens = s.generated;
  ++ls_.requests_finished;
  deliver(s, ev);
}

void ServingEngine::deliver(Sequence& s, const RequestEvent& ev) {
  if (!s.sink) return;
  try {
    s.sink(ev);
  } catch (const std::exception& e) {
    // A receiver that throws (a client's answer that cannot be built) loses its request, not
    // the engine: no more events, and the sequence ends on the next step.
    log::error("inference engine: the receiver of request ", s.id, " failed: ", e.what(), "; cancelling it");
    s.sink = nullptr;
    if (!ev.finished) cancel(s.id);
  }
}

void ServingEngine::send_plan(const StepPlan* plan) {
  if (!tp_) return;
  std::vector<int64_t> flat;
  if (plan) flat = plan->serialize();
  at::Tensor header = at::tensor(std::vector<int64_t>{plan ? static_cast<int64_t>(flat.size()) : kStop}, at::kLong);
  tp_->broadcast(header, 0);
  if (plan) tp_->broadcast(at::tensor(flat, at::kLong), 0);
}

void ServingEngine::follow(InferenceModel& model, const EngineOptions& options, const comm::CommunicatorPtr& tp) {
  KVCache cache(model.config().n_layer, model.local_kv_heads(), model.head_dim(), resolve_kv(options.kv(), model));
  while (true) {
    at::Tensor header = at::empty({1}, at::kLong);
    comm::WorkPtr w = tp->broadcast_async(header, 0);
    // Idle servers wait here: sleep between polls instead of spinning a core.
    for (int polls = 0; !w->is_completed(); ++polls) {
      if (polls > 2000) std::this_thread::sleep_for(std::chrono::microseconds(200));
      else std::this_thread::yield();
    }
    const int64_t n = header.item<int64_t>();
    if (n == kStop) return;
    if (n == kKeepAlive) continue;
    at::Tensor flat = at::empty({n}, at::kLong);
    tp->broadcast(flat, 0);
    const int64_t* p = flat.data_ptr<int64_t>();
    model.forward(StepPlan::deserialize(std::vector<int64_t>(p, p + n)), cache);
  }
}

std::vector<std::vector<float>> ServingEngine::embed(const std::vector<std::vector<int64_t>>& inputs, Pooling pooling, bool normalize) {
  const int64_t ctx = model_->config().seq_len, vocab = model_->config().vocab;
  for (const auto& in : inputs) {
    TS_CHECK(!in.empty(), "an input to embed is empty");
    TS_CHECK(static_cast<int64_t>(in.size()) <= ctx, "an input of ", in.size(), " tokens exceeds the model's context of ", ctx, " tokens");
    TS_CHECK(blocks_for(static_cast<int64_t>(in.size()), cache_->block_size()) <= pool_.total(), "an input of ", in.size(),
             " tokens needs more KV-cache blocks than the cache has (", pool_.total(), ")");
    for (int64_t t : in) TS_CHECK(t >= 0 && t < vocab, "token ", t, " is outside the vocabulary [0, ", vocab, ")");
  }
  // On the loop's thread: free blocks of the engine's own cache for the pass (so tensor-parallel
  // followers, which run every plan on their caches, write only where nothing lives), given back
  // after it.
  auto work = [&] {
    std::vector<std::vector<float>> out;
    for (const auto& in : inputs) {
      const int64_t need = blocks_for(static_cast<int64_t>(in.size()), cache_->block_size());
      if (!pool_.can_allocate(need)) throw EngineBusy("the KV cache has no room for this input now; retry");
      StepPlan plan;
      SeqChunk c;
      c.tokens = in;
      c.blocks = pool_.allocate(need);
      c.all_logits = pooling == Pooling::kMean;
      plan.seqs.push_back(c);
      at::Tensor h;
      try {
        send_plan(&plan);
        h = model_->hidden(plan, *cache_);  // [rows, d]
      } catch (...) {
        pool_.release(c.blocks);
        throw;
      }
      pool_.release(c.blocks);
      at::Tensor v = pooling == Pooling::kMean ? h.mean(0) : h[h.size(0) - 1];
      if (normalize) v = v / v.norm().clamp_min(1e-12);
      v = v.contiguous().to(at::kFloat);
      out.emplace_back(v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
    }
    return out;
  };
  std::packaged_task<std::vector<std::vector<float>>()> task(work);
  auto result = task.get_future();
  bool queued = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    TS_CHECK(!stopping_, "the engine is stopping");
    if (loop_running_) {  // the loop runs it before its next step, or as it ends
      tasks_.emplace_back([&task] { task(); });
      cv_.notify_all();
      queued = true;
    }
  }
  if (!queued) task();
  return result.get();
}

void ServingEngine::run_tasks() {
  std::deque<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> g(mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) t();  // a packaged task: an exception goes to its caller
}

bool ServingEngine::step() {
  run_tasks();
  admit_inbox();
  StepDecision d = sched_.schedule();
  queued_ += d.preempted - d.admitted;
  ls_.preemptions += static_cast<uint64_t>(d.preempted);
  ls_.prefix_cache_queries += d.prefix_queries;
  ls_.prefix_cache_hits += d.prefix_hits;
  const StepPlan& plan = d.plan;
  const bool work = !d.empty();
  if (work) {
    const auto t0 = Clock::now();
    if (fault_step_ > 0 && ls_.steps + 1 == fault_step_) {
      throw std::runtime_error(concat("injected failure of forward pass ", fault_step_, " (TORCHSPEED_INFERENCE_FAULT)"));
    }
    send_plan(&plan);
    const at::Tensor logits = model_->forward(plan, *cache_);
    const int64_t vocab = logits.size(1);
    const float* L = logits.data_ptr<float>();
    int64_t row = 0;
    std::vector<Sequence*> done;
    const auto now = Clock::now();
    for (size_t i = 0; i < d.order.size(); ++i) {
      Sequence& s = static_cast<Sequence&>(*d.order[i]);
      const SeqChunk& c = plan.seqs[i];
      const int64_t nt = static_cast<int64_t>(c.tokens.size());
      const int64_t rows = c.want_logits ? (c.all_logits ? nt : 1) : 0;
      if (c.all_logits) {
        for (int64_t k = 0; k < nt; ++k) {
          const int64_t target = c.start + k + 1;
          if (target >= s.prompt_len) break;
          if (target <= s.prompt_lp_count) continue;  // recomputed after a preemption
          ++s.prompt_lp_count;
          GeneratedToken g;
          g.id = s.tokens[static_cast<size_t>(target)];
          g.logprobs = Sampler::logprobs_of(L + (row + k) * vocab, vocab, g.id, std::max<int64_t>(s.params.logprobs, 0));
          s.prompt_lps.push_back(std::move(g));
        }
      }
      // The next token from one row of logits; true when the sequence is finished.
      auto take = [&](const float* logits_row) {
        GeneratedToken g;
        g.id = s.sampler.sample(logits_row, vocab, &g.logprobs, s.tokens, s.prompt_len);
        s.tokens.push_back(g.id);
        ++s.generated;
        ++ls_.generated_tokens;
        if (s.generated == 1) {
          ls_.ttft.observe(std::chrono::duration<double>(now - s.submitted).count());
          ls_.prompt_tokens += static_cast<uint64_t>(s.prompt_len);
        } else {
          ls_.itl.observe(std::chrono::duration<double>(now - s.last_token).count());
        }
        s.last_token = now;
        auto among = [&](const std::vector<int64_t>& ids) { return std::find(ids.begin(), ids.end(), g.id) != ids.end(); };
        if (((g.id == eos_ || among(s.params.eos_token_ids)) && !s.params.ignore_eos) || among(s.params.stop_token_ids)) {
          s.stopped = true;  // the end-of-text token, or a stop token: its text never shown
        } else {
          // Stop strings count from min_tokens on (vLLM's check_stop); EOS and stop tokens
          // were held back by the sampler until then.
          s.stopped = s.text.append(g.id < tokenizer_->vocab_size() ? tokenizer_->token_bytes(g.id) : std::string(),
                                    /*stops=*/s.generated >= s.params.min_tokens);
        }
        // Structured output whose value is whole and cannot go on: the text ends here (a
        // model without an end token could not say so).
        if (!s.stopped && s.sampler.matcher() && s.sampler.matcher()->finished()) s.stopped = true;
        s.new_tokens.push_back(std::move(g));
        return s.stopped || s.generated >= s.params.max_tokens ||
               static_cast<int64_t>(s.tokens.size()) >= model_->config().seq_len;
      };
      bool finished = false, sampled = false;
      if (c.speculative) {
        // Note [Speculative decoding]: row k's input is valid while the drafts before it were
        // the model's own choices; its logits give the next token.
        ls_.spec_draft_tokens += static_cast<uint64_t>(nt - 1);
        for (int64_t k = 0; k < nt && !finished; ++k) {
          ++s.computed;
          const int64_t want = k + 1 < nt ? c.tokens[static_cast<size_t>(k + 1)] : -1;
          finished = take(L + (row + k) * vocab);
          if (s.tokens.back() != want) break;
          ++ls_.spec_accepted_tokens;
        }
        sampled = true;
      } else {
        s.computed += nt;
        if (s.computed >= s.prompt_len) s.prompt_lp_pending = false;
        if (s.computed == static_cast<int64_t>(s.tokens.size())) {
          finished = take(L + (row + rows - 1) * vocab);
          sampled = true;
        }
      }
      if (pool_.caching()) {  // blocks that became full: published for later sequences
        const int64_t bs = cache_->block_size();
        for (auto b = static_cast<int64_t>(s.block_keys.size()); (b + 1) * bs <= s.computed; ++b) {
          s.block_keys.push_back(pool_.publish(b > 0 ? s.block_keys[static_cast<size_t>(b - 1)] : s.cache_root(),
                                               s.tokens.data() + b * bs, s.blocks[static_cast<size_t>(b)]));
        }
      }
      if (finished) {
        done.push_back(&s);
      } else if (sampled && s.sink) {
        RequestEvent ev;
        ev.text = s.text.take(false);
        ev.tokens = std::move(s.new_tokens);
        s.new_tokens.clear();
        ev.prompt = std::move(s.prompt_lps);
        s.prompt_lps.clear();
        ev.prompt_tokens = s.prompt_len;
        ev.completion_tokens = s.generated;
        deliver(s, ev);
      }
      row += rows;
    }
    for (Sequence* s : done) {
      finish(*s, s->stopped ? "stop" : "length");
      sched_.remove(s);
    }
    ++ls_.steps;
    ls_.busy_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  publish_stats();
  return work;
}

void ServingEngine::publish_stats() {
  std::lock_guard<std::mutex> g(mu_);
  stats_ = ls_;
  stats_.running = static_cast<int64_t>(sched_.running().size());
  stats_.waiting = static_cast<int64_t>(sched_.waiting().size() + inbox_.size());
  stats_.blocks_used = pool_.used();
  stats_.blocks_free = pool_.free();
  stats_.blocks_total = pool_.total();
  stats_.prefix_cache_blocks = pool_.cached_blocks();
  stats_.block_size = cache_->block_size();
  if (tp_) {
    for (const auto& [name, st] : tp_->stats()) {
      stats_.tp_collectives += static_cast<uint64_t>(st.ops);
      stats_.tp_bytes += static_cast<uint64_t>(st.bytes);
    }
  }
}

void ServingEngine::run_until_idle() {
  while (true) {
    const bool worked = step();
    std::lock_guard<std::mutex> g(mu_);
    if (!worked && inbox_.empty() && sched_.idle()) return;
  }
}

void ServingEngine::loop() {
  struct Done {
    ServingEngine* e;
    ~Done() {
      e->run_tasks();  // an embed() queued as the loop ended still gets its answer
      std::lock_guard<std::mutex> g(e->mu_);
      e->loop_running_ = false;
      e->done_cv_.notify_all();
    }
  } done{this};
  while (true) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      auto ready = [&] {
        return stopping_ || !inbox_.empty() || !cancelled_.empty() || !sched_.idle() || !tasks_.empty();
      };
      if (tp_) {
        if (!cv_.wait_for(lk, std::chrono::seconds(1), ready)) {
          lk.unlock();
          at::Tensor header = at::tensor(std::vector<int64_t>{kKeepAlive}, at::kLong);
          tp_->broadcast(header, 0);
          continue;
        }
      } else {
        cv_.wait(lk, ready);
      }
      if (stopping_ && (!drain_ || (inbox_.empty() && sched_.idle()))) break;
    }
    try {
      step();
    } catch (const std::exception& e) {
      // A failed forward (a TP peer gone, out of memory) ends every request with "abort"
      // instead of leaving clients hanging; the loop then stops.
      log::error("inference engine: ", e.what(), "; aborting all requests");
      {
        std::lock_guard<std::mutex> g(mu_);
        stopping_ = true;
        drain_ = false;
        failure_ = e.what();
        failed_ = true;
      }
      admit_inbox();
      publish_stats();
      try {
        followers_stopped_ = true;
        send_plan(nullptr);
      } catch (const std::exception&) {
      }
      return;
    }
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    drain_ = false;
  }
  admit_inbox();  // aborts whatever is left
  publish_stats();
  followers_stopped_ = true;
  try {
    send_plan(nullptr);
  } catch (const std::exception& e) {
    log::error("inference engine: telling the tensor-parallel ranks to stop failed: ", e.what());
  }
}

void ServingEngine::start() {
  TS_CHECK(!thread_.joinable(), "the inference engine is already running");
  {
    std::lock_guard<std::mutex> g(mu_);
    loop_running_ = true;
  }
  thread_ = std::thread([this] { loop(); });
}

void ServingEngine::run() {
  {
    std::lock_guard<std::mutex> g(mu_);
    TS_CHECK(!thread_.joinable() && !loop_running_, "the inference engine is already running");
    loop_running_ = true;
  }
  loop();
}

void ServingEngine::stop(bool drain, double drain_timeout_s) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    stopping_ = true;
    drain_ = drain;
    cv_.notify_all();
    // Wait for the loop (on our thread_ or a run() caller's) to finish what it has, until the
    // deadline; then what is left is aborted (its sinks get "abort").
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(drain_timeout_s, 1e7)));
    if (drain && !done_cv_.wait_until(lk, until, [&] { return !loop_running_; })) {
      log::warn("inference engine: ", stats_.running + stats_.waiting, " requests still unfinished after the ", drain_timeout_s, " s drain deadline: aborting them");
      drain_ = false;
      cv_.notify_all();
    }
    if (!thread_.joinable()) done_cv_.wait(lk, [&] { return !loop_running_; });
  }
  if (thread_.joinable()) {
    thread_.join();  // the loop told the followers
  } else if (tp_ && !followers_stopped_) {
    followers_stopped_ = true;
    try {
      send_plan(nullptr);
    } catch (const std::exception& e) {
      log::error("inference engine: telling the tensor-parallel ranks to stop failed: ", e.what());
    }
  }
  followers_stopped_ = true;
}

bool ServingEngine::accepting() const {
  std::lock_guard<std::mutex> g(mu_);
  return !stopping_;
}

bool ServingEngine::failed() const { return failed_.load(); }

std::string ServingEngine::failure() const {
  std::lock_guard<std::mutex> g(mu_);
  return failure_;
}

EngineStats ServingEngine::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

}  // namespace torchspeed::inference
