// The serving scheduler: see scheduler.h.
#include "torchspeed/inference/scheduler.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "torchspeed/base/error.h"

namespace torchspeed::inference {

std::vector<int64_t> StepPlan::serialize() const {
  std::vector<int64_t> f{static_cast<int64_t>(seqs.size())};
  for (const SeqChunk& s : seqs) {
    f.insert(f.end(), {s.start, static_cast<int64_t>(s.tokens.size()), static_cast<int64_t>(s.blocks.size()),
                       (s.all_logits ? 1 : 0) | (s.want_logits ? 2 : 0) | (s.speculative ? 4 : 0) |
                                                               (static_cast<int64_t>(s.adapter) << 3)});
    f.insert(f.end(), s.tokens.begin(), s.tokens.end());
    f.insert(f.end(), s.blocks.begin(), s.blocks.end());
  }
  return f;
}

StepPlan StepPlan::deserialize(const std::vector<int64_t>& f) {
  StepPlan p;
  size_t i = 0;
  auto next = [&]() {
    TS_INTERNAL_ASSERT(i < f.size(), "step plan truncated at ", i);
    return f[i++];
  };
  const int64_t n = next();
  for (int64_t s = 0; s < n; ++s) {
    SeqChunk c;
    c.start = next();
    const int64_t nt = next(), nb = next(), flags = next();
    c.all_logits = flags & 1;
    c.want_logits = flags & 2;
    c.speculative = flags & 4;
    c.adapter = static_cast<int32_t>(flags >> 3);
    for (int64_t k = 0; k < nt; ++k) c.tokens.push_back(next());
    for (int64_t k = 0; k < nb; ++k) c.blocks.push_back(static_cast<int32_t>(next()));
    p.seqs.push_back(std::move(c));
  }
  return p;
}

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

Scheduler::Scheduler(const SchedulerOptions& options, BlockPool& pool, int64_t block_size)
    : options_(options), pool_(pool), block_size_(block_size) {
  TS_CHECK(options_.max_num_seqs() > 0, "--max-num-seqs must be positive, got ", options_.max_num_seqs());
  TS_CHECK(options_.max_num_batched_tokens() > 0, "--max-batched-tokens must be positive, got ",
           options_.max_num_batched_tokens());
  TS_CHECK(block_size_ > 0, "the KV cache's block size must be positive, got ", block_size_);
}

void Scheduler::add(std::unique_ptr<ScheduledSequence> s) { waiting_.push_back(std::move(s)); }

std::unique_ptr<ScheduledSequence> Scheduler::remove(const ScheduledSequence* s) {
  auto same = [&](const std::unique_ptr<ScheduledSequence>& p) { return p.get() == s; };
  std::unique_ptr<ScheduledSequence> out;
  if (auto it = std::find_if(running_.begin(), running_.end(), same); it != running_.end()) {
    out = std::move(*it);
    running_.erase(it);
  } else if (auto w = std::find_if(waiting_.begin(), waiting_.end(), same); w != waiting_.end()) {
    out = std::move(*w);
    waiting_.erase(w);
  }
  TS_INTERNAL_ASSERT(out, "scheduler: sequence ", s ? s->id : 0, " is neither running nor waiting");
  return out;
}

bool Scheduler::ensure_blocks(ScheduledSequence& s, int64_t positions) {
  const int64_t need = blocks_for(positions, block_size_) - static_cast<int64_t>(s.blocks.size());
  if (need <= 0) return true;
  if (!pool_.can_allocate(need)) return false;
  const auto got = pool_.allocate(need);
  s.blocks.insert(s.blocks.end(), got.begin(), got.end());
  return true;
}

void Scheduler::preempt_last(StepDecision& d) {
  std::unique_ptr<ScheduledSequence> s = std::move(running_.back());
  running_.pop_back();
  pool_.release(s->blocks);
  s->block_keys.clear();
  s->computed = 0;
  ++d.preempted;
  waiting_.push_front(std::move(s));
}

StepDecision Scheduler::schedule() {
  StepDecision d;
  int64_t budget = options_.max_num_batched_tokens();
  const SpeculativeOptions& spec = options_.speculative();
  const int64_t spec_k = spec.disable_by_batch_size() > 0 && static_cast<int64_t>(running_.size()) > spec.disable_by_batch_size()
                             ? 0
                             : spec.num_speculative_tokens();
  auto add = [&](ScheduledSequence& s, int64_t n) {
    SeqChunk c;
    c.start = s.computed;
    c.tokens.assign(s.tokens.begin() + s.computed, s.tokens.begin() + s.computed + n);
    c.blocks = s.blocks;
    c.adapter = s.adapter;
    const bool last = s.computed + n == static_cast<int64_t>(s.tokens.size());
    c.all_logits = s.prompt_lp_pending;
    c.want_logits = last || c.all_logits;
    d.plan.seqs.push_back(std::move(c));
    d.order.push_back(&s);
    budget -= n;
  };
  // Running decodes (one token left to compute) first. A decode that finds no free block
  // preempts the most recently admitted sequences, itself last; those are all later in
  // running_, so none of them is in this step's plan yet.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    ScheduledSequence& s = *running_[i];
    if (static_cast<int64_t>(s.tokens.size()) - s.computed != 1) continue;
    bool fits = ensure_blocks(s, s.computed + 1);
    while (!fits && running_.back().get() != &s) {
      preempt_last(d);
      fits = ensure_blocks(s, s.computed + 1);
    }
    if (!fits) {
      preempt_last(d);  // s itself
      break;
    }
    std::vector<int64_t> drafts;
    if (spec_k > 0 && s.greedy && !s.prompt_lp_pending) {
      // Drafts within max_tokens, the context and the budget, with blocks that are free now.
      const auto len = static_cast<int64_t>(s.tokens.size());
      const int64_t k = std::min({spec_k, s.max_tokens - s.generated - 1, options_.context() - len, budget - 1});
      if (k > 0) drafts = ngram_propose(s.tokens, spec.prompt_lookup_min(), spec.prompt_lookup_max(), k);
      if (!drafts.empty() && !ensure_blocks(s, s.computed + 1 + static_cast<int64_t>(drafts.size()))) drafts.clear();
    }
    add(s, 1);
    if (!drafts.empty()) {  // the decode token, then its drafts, every row's logits
      SeqChunk& c = d.plan.seqs.back();
      c.tokens.insert(c.tokens.end(), drafts.begin(), drafts.end());
      c.all_logits = c.want_logits = c.speculative = true;
      budget -= static_cast<int64_t>(drafts.size());
    }
  }
  // Then prompt chunks of running sequences, with the blocks that are free: preempting here
  // could take a sequence already planned above.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    ScheduledSequence& s = *running_[i];
    const int64_t remaining = static_cast<int64_t>(s.tokens.size()) - s.computed;
    if (remaining <= 1) continue;
    const int64_t n = std::min(remaining, budget);
    if (!ensure_blocks(s, s.computed + n)) break;
    add(s, n);
  }
  // Waiting requests in arrival order (preempted ones first), while blocks and slots allow.
  while (budget > 0 && !waiting_.empty() && static_cast<int64_t>(running_.size()) < options_.max_num_seqs()) {
    ScheduledSequence& s = *waiting_.front();
    const bool lookup = s.computed == 0 && pool_.caching() && !s.prompt_lp_pending;
    if (lookup) {
      // The longest cached run of whole blocks, leaving at least the last token to compute (its
      // logits give the next token). Prompt logprobs need every prompt token's logits: no lookup.
      s.blocks = pool_.match(s.tokens, (static_cast<int64_t>(s.tokens.size()) - 1) / block_size_, s.block_keys,
                             s.cache_root());
      s.computed = static_cast<int64_t>(s.blocks.size()) * block_size_;
    }
    const int64_t n = std::min(static_cast<int64_t>(s.tokens.size()) - s.computed, budget);
    if (!ensure_blocks(s, s.computed + n)) {
      pool_.release(s.blocks);  // the matched blocks wait in the cache with the sequence
      s.block_keys.clear();
      s.computed = 0;
      break;
    }
    if (lookup) {
      d.prefix_queries += s.tokens.size();
      d.prefix_hits += static_cast<uint64_t>(s.computed);
    }
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    ++d.admitted;
    add(s, n);
  }
  return d;
}

}  // namespace torchspeed::inference
