#include "torchspeed/inference/engine.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "torchspeed/data/text.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/logging.h"

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

// Note [Speculative decoding]
// A decode step reads every weight to produce one token per sequence; at small batches it is
// bound by those bytes, and k more rows cost little more than one. Speculative decoding guesses
// k next tokens cheaply and verifies them in one forward pass: the chunk [last token, d1..dk]
// gives logits after each; the model's own choice after the last token is taken, and while it
// equals the next draft, the choice after that draft too. Every verified token is one the plain
// decode would have produced: the chunk's rows run as decode rows (the same linear kernels, each
// row's attention over the positions up to its own; SeqChunk::speculative), so their logits
// have the bits a lone decode would give, and only greedy requests are speculated on (a sampled
// token would need rejection sampling, which draws other random numbers than plain decoding).
// Rejected drafts leave keys and values past the sequence's computed positions; they are
// overwritten when those positions are computed. The guesses come from the sequence itself
// (n-gram prompt lookup, vLLM's "ngram" method, llama.cpp's lookup decoding): the tokens that
// followed the latest earlier occurrence of its last n tokens. Code and documents being edited
// repeat themselves, and there most drafts are accepted. /metrics reports drafts and
// acceptances.
std::vector<int64_t> ngram_propose(const std::vector<int64_t>& tokens, int64_t min_n, int64_t max_n, int64_t k) {
  const auto L = static_cast<int64_t>(tokens.size());
  for (int64_t n = std::min(max_n, L - 1); n >= std::max<int64_t>(min_n, 1); --n) {
    const int64_t* suffix = tokens.data() + L - n;
    for (int64_t i = L - n - 1; i >= 0; --i) {
      if (std::equal(suffix, suffix + n, tokens.data() + i)) {
        const int64_t from = i + n, to = std::min(L, from + k);
        if (from < to) return std::vector<int64_t>(tokens.begin() + from, tokens.begin() + to);
      }
    }
  }
  return {};
}

SpeculativeOptions SpeculativeOptions::from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  TS_CHECK(!j.is_discarded() && j.is_object(), "--speculative-config: a JSON object, e.g. {\"method\": \"ngram\", "
           "\"num_speculative_tokens\": 4}");
  SpeculativeOptions o;
  auto integer = [&](const char* key, int64_t lo, int64_t hi) {
    const auto& v = j.at(key);
    TS_CHECK(v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi, "--speculative-config: \"", key,
             "\" must be an integer in [", lo, ", ", hi, "], got ", v.dump());
    return v.get<int64_t>();
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "method") {
      TS_CHECK(v.is_string() && (v == "ngram"), "--speculative-config: \"method\" ", v.dump(),
               " is not supported; \"ngram\" (prompt lookup) is");
    } else if (key == "num_speculative_tokens") {
      o.num_speculative_tokens(integer("num_speculative_tokens", 1, 16));
    } else if (key == "prompt_lookup_max") {
      o.prompt_lookup_max(integer("prompt_lookup_max", 1, 64));
    } else if (key == "prompt_lookup_min") {
      o.prompt_lookup_min(integer("prompt_lookup_min", 1, 64));
    } else if (key == "disable_by_batch_size") {
      o.disable_by_batch_size(integer("disable_by_batch_size", 1, 1 << 20));
    } else {
      TS_CHECK(false, "--speculative-config: key \"", key, "\" is not supported (known: method, num_speculative_tokens, "
               "prompt_lookup_max, prompt_lookup_min, disable_by_batch_size)");
    }
  }
  TS_CHECK(j.contains("method"), "--speculative-config: \"method\" is required (\"ngram\")");
  TS_CHECK(j.contains("num_speculative_tokens"), "--speculative-config: \"num_speculative_tokens\" is required");
  if (!j.contains("prompt_lookup_max") && j.contains("prompt_lookup_min")) o.prompt_lookup_max(o.prompt_lookup_min());
  TS_CHECK(o.prompt_lookup_min() <= o.prompt_lookup_max(), "--speculative-config: prompt_lookup_min ", o.prompt_lookup_min(),
           " exceeds prompt_lookup_max ", o.prompt_lookup_max());
  return o;
}

struct Engine::Sequence {
  uint64_t id = 0;
  std::vector<int64_t> tokens;  // prompt, then generated
  int64_t prompt_len = 0, computed = 0, generated = 0;
  std::vector<int32_t> blocks;
  std::vector<uint64_t> block_keys;  // prefix keys of blocks [0, size) (published or matched)
  SamplingParams params;
  Sampler sampler;
  TextStream text;
  Sink sink;
  Clock::time_point submitted, last_token;
  bool prompt_lp_pending = false;
  int64_t prompt_lp_count = 0;  // prompt logprobs produced (a preempted prompt recomputes: not twice)
  std::vector<GeneratedToken> new_tokens, prompt_lps;
  bool stopped = false;
  int32_t adapter = 0;  // LoRA adapter (0: the base model)
  // The prefix cache's root for the sequence: each adapter's KV entries are its own.
  uint64_t cache_root() const { return adapter == 0 ? 0 : ~uint64_t{0} - static_cast<uint64_t>(adapter); }
  Sequence(const SamplingParams& p, int64_t eos) : params(p), sampler(p, eos), text(p.stop) {}
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

Engine::Engine(std::shared_ptr<InferenceModel> model, const EngineOptions& options_in, comm::CommunicatorPtr tp)
    : model_(std::move(model)),
      options_(EngineOptions(options_in).kv(resolve_kv(options_in.kv(), *model_))),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      cache_(std::make_unique<KVCache>(model_->config().n_layer, model_->local_kv_heads(), model_->head_dim(), options_.kv())),
      pool_(cache_->num_blocks(), options_.prefix_caching() ? cache_->block_size() : 0),
      tokenizer_(options_.tokenizer() ? options_.tokenizer() : std::make_shared<data::ByteTokenizer>()),
      eos_(tokenizer_->eos_id()) {
  TS_CHECK(tokenizer_->vocab_size() <= model_->config().vocab, "the tokenizer (", tokenizer_->source(), ") has ",
           tokenizer_->vocab_size(), " tokens, more than the model's vocabulary of ", model_->config().vocab);
  TS_CHECK(options_.max_num_seqs() > 0, "--max-num-seqs must be positive, got ", options_.max_num_seqs());
  TS_CHECK(options_.max_num_batched_tokens() > 0, "--max-batched-tokens must be positive, got ",
           options_.max_num_batched_tokens());
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

Engine::~Engine() {
  try {
    if (thread_.joinable() || (tp_ && !followers_stopped_)) stop(false);
  } catch (const std::exception& e) {
    log::error("inference engine: stopping failed: ", e.what());
  }
}

std::optional<uint64_t> Engine::submit(std::vector<int64_t> prompt, const SamplingParams& params, Sink sink,
                                       int32_t adapter) {
  std::vector<Submission> one;
  one.push_back({std::move(prompt), params, std::move(sink), adapter});
  const auto ids = submit_all(std::move(one));
  if (!ids) return std::nullopt;
  return ids->front();
}

std::optional<std::vector<uint64_t>> Engine::submit_all(std::vector<Submission> group) {
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

void Engine::cancel(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  cancelled_.insert(id);
  cv_.notify_one();
}

void Engine::admit_inbox() {
  std::set<uint64_t> cancelled;
  bool abort_all = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    while (!inbox_.empty()) {
      waiting_.push_back(std::move(inbox_.front()));
      inbox_.pop_front();
    }
    cancelled.swap(cancelled_);
    abort_all = stopping_ && !drain_;
  }
  auto gone = [&](const std::unique_ptr<Sequence>& s) { return abort_all || cancelled.count(s->id) > 0; };
  for (size_t i = 0; i < running_.size();) {
    if (gone(running_[i])) {
      finish(*running_[i], "abort");
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  for (size_t i = 0; i < waiting_.size();) {
    if (gone(waiting_[i])) {
      finish(*waiting_[i], "abort");
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
      --queued_;
    } else {
      ++i;
    }
  }
}

bool Engine::ensure_blocks(Sequence& s, int64_t positions) {
  const int64_t need = blocks_for(positions, cache_->block_size()) - static_cast<int64_t>(s.blocks.size());
  if (need <= 0) return true;
  if (!pool_.can_allocate(need)) return false;
  const auto got = pool_.allocate(need);
  s.blocks.insert(s.blocks.end(), got.begin(), got.end());
  return true;
}

void Engine::preempt_last() {
  std::unique_ptr<Sequence> s = std::move(running_.back());
  running_.pop_back();
  pool_.release(s->blocks);
  s->block_keys.clear();
  s->computed = 0;
  ++ls_.preemptions;
  waiting_.push_front(std::move(s));
  ++queued_;
}

bool Engine::schedule(StepPlan& plan, std::vector<Sequence*>& order) {
  int64_t budget = options_.max_num_batched_tokens();
  const SpeculativeOptions& spec = options_.speculative();
  const int64_t spec_k = spec.disable_by_batch_size() > 0 && static_cast<int64_t>(running_.size()) > spec.disable_by_batch_size()
                             ? 0
                             : spec.num_speculative_tokens();
  auto add = [&](Sequence& s, int64_t n) {
    SeqChunk c;
    c.start = s.computed;
    c.tokens.assign(s.tokens.begin() + s.computed, s.tokens.begin() + s.computed + n);
    c.blocks = s.blocks;
    c.adapter = s.adapter;
    const bool last = s.computed + n == static_cast<int64_t>(s.tokens.size());
    c.all_logits = s.prompt_lp_pending;
    c.want_logits = last || c.all_logits;
    plan.seqs.push_back(std::move(c));
    order.push_back(&s);
    budget -= n;
  };
  // Running decodes (one token left to compute) first. A decode that finds no free block
  // preempts the most recently admitted sequences, itself last; those are all later in
  // running_, so none of them is in this step's plan yet.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence& s = *running_[i];
    if (static_cast<int64_t>(s.tokens.size()) - s.computed != 1) continue;
    bool fits = ensure_blocks(s, s.computed + 1);
    while (!fits && running_.back().get() != &s) {
      preempt_last();
      fits = ensure_blocks(s, s.computed + 1);
    }
    if (!fits) {
      preempt_last();  // s itself
      break;
    }
    std::vector<int64_t> drafts;
    if (spec_k > 0 && s.params.temperature <= 0 && !s.prompt_lp_pending) {
      // Drafts within max_tokens, the context and the budget, with blocks that are free now.
      const auto len = static_cast<int64_t>(s.tokens.size());
      const int64_t k = std::min({spec_k, s.params.max_tokens - s.generated - 1, model_->config().seq_len - len, budget - 1});
      if (k > 0) drafts = ngram_propose(s.tokens, spec.prompt_lookup_min(), spec.prompt_lookup_max(), k);
      if (!drafts.empty() && !ensure_blocks(s, s.computed + 1 + static_cast<int64_t>(drafts.size()))) drafts.clear();
    }
    add(s, 1);
    if (!drafts.empty()) {  // the decode token, then its drafts, every row's logits
      SeqChunk& c = plan.seqs.back();
      c.tokens.insert(c.tokens.end(), drafts.begin(), drafts.end());
      c.all_logits = c.want_logits = c.speculative = true;
      budget -= static_cast<int64_t>(drafts.size());
    }
  }
  // Then prompt chunks of running sequences, with the blocks that are free: preempting here
  // could take a sequence already planned above.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence& s = *running_[i];
    const int64_t remaining = static_cast<int64_t>(s.tokens.size()) - s.computed;
    if (remaining <= 1) continue;
    const int64_t n = std::min(remaining, budget);
    if (!ensure_blocks(s, s.computed + n)) break;
    add(s, n);
  }
  // Waiting requests in arrival order (preempted ones first), while blocks and slots allow.
  while (budget > 0 && !waiting_.empty() && static_cast<int64_t>(running_.size()) < options_.max_num_seqs()) {
    Sequence& s = *waiting_.front();
    const bool lookup = s.computed == 0 && pool_.caching() && !s.prompt_lp_pending;
    if (lookup) {
      // The longest cached run of whole blocks, leaving at least the last token to compute (its
      // logits give the next token). Prompt logprobs need every prompt token's logits: no lookup.
      const int64_t bs = cache_->block_size();
      s.blocks = pool_.match(s.tokens, (static_cast<int64_t>(s.tokens.size()) - 1) / bs, s.block_keys, s.cache_root());
      s.computed = static_cast<int64_t>(s.blocks.size()) * bs;
    }
    const int64_t n = std::min(static_cast<int64_t>(s.tokens.size()) - s.computed, budget);
    if (!ensure_blocks(s, s.computed + n)) {
      pool_.release(s.blocks);  // the matched blocks wait in the cache with the sequence
      s.block_keys.clear();
      s.computed = 0;
      break;
    }
    if (lookup) {
      ls_.prefix_cache_queries += s.tokens.size();
      ls_.prefix_cache_hits += static_cast<uint64_t>(s.computed);
    }
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    --queued_;
    add(s, n);
  }
  return !plan.seqs.empty();
}

void Engine::finish(Sequence& s, const std::string& reason) {
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

void Engine::deliver(Sequence& s, const RequestEvent& ev) {
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

void Engine::send_plan(const StepPlan* plan) {
  if (!tp_) return;
  std::vector<int64_t> flat;
  if (plan) flat = plan->serialize();
  at::Tensor header = at::tensor(std::vector<int64_t>{plan ? static_cast<int64_t>(flat.size()) : kStop}, at::kLong);
  tp_->broadcast(header, 0);
  if (plan) tp_->broadcast(at::tensor(flat, at::kLong), 0);
}

void Engine::follow(InferenceModel& model, const EngineOptions& options, const comm::CommunicatorPtr& tp) {
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

std::vector<std::vector<float>> Engine::embed(const std::vector<std::vector<int64_t>>& inputs, Pooling pooling, bool normalize) {
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

void Engine::run_tasks() {
  std::deque<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> g(mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) t();  // a packaged task: an exception goes to its caller
}

bool Engine::step() {
  run_tasks();
  admit_inbox();
  StepPlan plan;
  std::vector<Sequence*> order;
  const bool work = schedule(plan, order);
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
    for (size_t i = 0; i < order.size(); ++i) {
      Sequence& s = *order[i];
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
      running_.erase(std::find_if(running_.begin(), running_.end(), [&](const auto& p) { return p.get() == s; }));
    }
    ++ls_.steps;
    ls_.busy_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  publish_stats();
  return work;
}

void Engine::publish_stats() {
  std::lock_guard<std::mutex> g(mu_);
  stats_ = ls_;
  stats_.running = static_cast<int64_t>(running_.size());
  stats_.waiting = static_cast<int64_t>(waiting_.size() + inbox_.size());
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

void Engine::run_until_idle() {
  while (true) {
    const bool worked = step();
    std::lock_guard<std::mutex> g(mu_);
    if (!worked && inbox_.empty() && running_.empty() && waiting_.empty()) return;
  }
}

void Engine::loop() {
  struct Done {
    Engine* e;
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
        return stopping_ || !inbox_.empty() || !cancelled_.empty() || !running_.empty() || !waiting_.empty() || !tasks_.empty();
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
      if (stopping_ && (!drain_ || (inbox_.empty() && waiting_.empty() && running_.empty()))) break;
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

void Engine::start() {
  TS_CHECK(!thread_.joinable(), "the inference engine is already running");
  {
    std::lock_guard<std::mutex> g(mu_);
    loop_running_ = true;
  }
  thread_ = std::thread([this] { loop(); });
}

void Engine::run() {
  {
    std::lock_guard<std::mutex> g(mu_);
    TS_CHECK(!thread_.joinable() && !loop_running_, "the inference engine is already running");
    loop_running_ = true;
  }
  loop();
}

void Engine::stop(bool drain, double drain_timeout_s) {
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

bool Engine::accepting() const {
  std::lock_guard<std::mutex> g(mu_);
  return !stopping_;
}

bool Engine::failed() const { return failed_.load(); }

std::string Engine::failure() const {
  std::lock_guard<std::mutex> g(mu_);
  return failure_;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

}  // namespace torchspeed::inference
