#include "torchspeed/compression/schedule.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <regex>

#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

namespace torchspeed::compression {

// Note [Quantization-aware training]
// DeepSpeed's compression_training swaps a model's Linear and Embedding modules for ones that
// quantize in their forward (deepspeed/compression/basic_layer.py); MoQ (quantize_weight_in_forward
// false, or the older quantize_training section) instead rounds the fp16 working weights after
// each optimizer step (runtime/quantize.py), so the next forward sees them quantized while the
// fp32 masters keep full precision. Both give the forward q(w) and hand the gradient of q(w) to w
// unchanged. We compute both in the forward: the layer quantizes the weight it is about to use
// (straight through), which is the same arithmetic at every ZeRO stage and on pipeline stages,
// and needs no pass over parameters that ZeRO-3 holds in pieces.
// The schedule follows DeepSpeed's counters. `applied` = optimizer steps taken (overflow steps
// excluded). Forward quantization and activation quantization are on once applied >=
// schedule_offset. MoQ quantizes once per applied step after the offset, and once before the
// very first forward when the offset is 0 (engine.py's step-zero check): the forward after
// `applied` steps sees the weights of quantization call number q = applied + 1 (offset 0) or
// applied - offset (offset > 0; none while applied <= offset). At each call the fp16-mixed ratio
// falls by quantize_change_ratio, and a group whose call count reached its period drops a bit
// and doubles its period (the ratio returns to 1). DeepSpeed resets the shared ratio from within
// its parameter loop; here the reset applies to every layer of that call.

namespace {
// Whether the pattern names one of the Hugging Face layers fused into the site ("v_proj" names
// v_proj, though it is also found in the fused layer's vLLM name "qkv_proj").
bool names_part(const std::regex& re, const Site& s) {
  for (const auto& p : s.parts)
    if (std::regex_search(p, re)) return true;
  return false;
}

bool matches(const std::regex& re, const std::string& layer, const Site& s) {
  if (std::regex_search(layer + "." + s.name, re)) return true;
  for (const auto& a : s.aliases)
    if (std::regex_search(a, re)) return true;
  return false;
}

std::string describe(const std::vector<std::pair<std::string, std::vector<Site>>>& layers) {
  std::string out;
  size_t n = 0;
  for (const auto& [layer, sites] : layers) {
    for (const auto& s : sites) {
      if (n++ == 8) return out + ", ...";
      if (!out.empty()) out += ", ";
      out += layer + "." + s.name;
      if (!s.aliases.empty()) out += " (" + s.aliases.front() + ")";
    }
  }
  return out.empty() ? "none" : out;
}
}  // namespace

Schedule::Schedule(const config::CompressionConfig& config, nn::LayerStack& stack, const comm::CommunicatorPtr& stages,
                   int tp)
    : config_(config) {
  TS_CHECK(tp == 1, config_.weight.enabled ? config_.weight.section : std::string("compression_training.activation_quantization"),
           ": quantization-aware training runs on whole layers; with tensor_parallel.tp_size ", tp,
           " each rank holds slices whose quantization groups differ from the model's (use tp 1)");
  for (size_t i = 0; i < stack->size(); ++i) {
    auto* c = dynamic_cast<Compressible*>(stack->layer_module(i).get());
    if (c) layers_.emplace_back(stack->layer_name(i), c->compression_sites());
  }
  if (config_.weight.enabled) {
    bind(config_.weight.groups, false, "weight quantization", weights_, stages);
    for (const auto& g : config_.weight.groups) {
      moq_bits_.push_back(g.start_bits);
      moq_period_.push_back(g.quantization_period);
    }
  }
  if (config_.activation.enabled) bind(config_.activation.groups, true, "activation quantization", inputs_, stages);
  for (auto& b : weights_) {
    b.state->name = b.name;
    b.state->groups_key = config_.weight.section + (config_.weight.every_matrix ? ".quantize_groups"
                                                                               : ".shared_parameters.quantize_groups");
  }
  for (auto& b : inputs_) b.state->name = b.name;
  update(0);
}

void Schedule::bind(const std::vector<config::QuantizeGroupConfig>& groups, bool linear_only, const std::string& what,
                    std::vector<Binding>& out, const comm::CommunicatorPtr& stages) {
  std::map<const SiteState*, std::string> taken;  // site -> the group that has it
  std::vector<int64_t> counts;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& pattern : groups[g].modules) {
      const std::regex re(pattern);
      int64_t n = 0;
      for (const auto& [layer, sites] : layers_) {
        for (const auto& s : sites) {
          if (linear_only && s.kind != Site::Kind::kLinear) continue;
          if (!matches(re, layer, s) || names_part(re, s)) continue;  // parts: below
          ++n;
          const std::string name = layer + "." + s.name;
          if (const auto it = taken.find(s.state); it != taken.end()) {
            // The group's own patterns may overlap (MoQ's one group matches everything).
            TS_CHECK(it->second == groups[g].name, groups[g].path, ".modules: '", pattern, "' matches ", name,
                     ", which ", what, " group '", it->second, "' already has (as in DeepSpeed, a layer is in one group)");
            continue;
          }
          taken[s.state] = groups[g].name;
          out.push_back({s.state, s.kind, s.rows, g, name});
        }
      }
      counts.push_back(n);
    }
    // Hugging Face's separate layers that torchspeed fuses (q_proj, k_proj and v_proj into
    // qkv; gate_proj and up_proj into fc): the group has the fused layer when its patterns name
    // every one of them, and is refused when they name only some.
    const size_t first = counts.size() - groups[g].modules.size();
    for (const auto& [layer, sites] : layers_) {
      for (const auto& s : sites) {
        if (s.parts.empty() || (linear_only && s.kind != Site::Kind::kLinear)) continue;
        std::vector<bool> named(s.parts.size(), false);
        for (size_t k = 0; k < groups[g].modules.size(); ++k) {
          const std::regex re(groups[g].modules[k]);
          // A pattern that also names the fused layer by our or GPT-2's name ("qkv|q_proj") names
          // all of it (not by its vLLM name: "v_proj" is found in "qkv_proj").
          const bool whole = std::regex_search(layer + "." + s.name, re) ||
                             (!s.aliases.empty() && std::regex_search(s.aliases.front(), re));
          bool any = false;
          for (size_t q = 0; q < s.parts.size(); ++q) {
            if (whole || std::regex_search(s.parts[q], re)) named[q] = any = true;
          }
          if (any && names_part(re, s)) ++counts[first + k];  // direct matches were counted above
        }
        const auto n_named = std::count(named.begin(), named.end(), true);
        const std::string name = layer + "." + s.name;
        if (n_named == 0 || (taken.count(s.state) && taken[s.state] == groups[g].name)) continue;
        if (n_named < static_cast<int64_t>(s.parts.size())) {
          std::string given, missing;
          for (size_t q = 0; q < s.parts.size(); ++q) {
            std::string& list = named[q] ? given : missing;
            list += (list.empty() ? "" : ", ") + s.parts[q];
          }
          TS_CHECK(false, groups[g].path, ".modules names ", given, " but not ", missing, ": torchspeed fuses them into one layer (",
                   name, ", ", s.aliases.back(), ") that is quantized as a whole; name all of them");
        }
        if (const auto it = taken.find(s.state); it != taken.end()) {
          TS_CHECK(false, groups[g].path, ".modules name ", s.parts.front(), " and the rest of ", name, ", which ", what,
                   " group '", it->second, "' already has (as in DeepSpeed, a layer is in one group)");
        }
        taken[s.state] = groups[g].name;
        out.push_back({s.state, s.kind, s.rows, g, name});
      }
    }
  }
  if (stages && stages->size() > 1 && !counts.empty()) {
    at::Tensor t = at::tensor(counts, at::kLong);
    stages->all_reduce(t);
    for (size_t i = 0; i < counts.size(); ++i) counts[i] = t[static_cast<int64_t>(i)].item<int64_t>();
  }
  size_t k = 0;
  for (const auto& g : groups) {
    for (const auto& pattern : g.modules) {
      TS_CHECK(counts[k++] > 0, g.path, ".modules: '", pattern, "' matches no ", linear_only ? "linear " : "",
               "layer of the model (its compressible layers: ", describe(layers_), ")");
    }
  }
}

void Schedule::advance_moq(int64_t calls) {
  if (calls < moq_calls_) {  // a checkpoint from earlier: start again
    moq_calls_ = 0;
    moq_ratio_ = 1.0;
    for (size_t g = 0; g < config_.weight.groups.size(); ++g) {
      moq_bits_[g] = config_.weight.groups[g].start_bits;
      moq_period_[g] = config_.weight.groups[g].quantization_period;
    }
  }
  const auto& w = config_.weight;
  while (moq_calls_ < calls) {
    ++moq_calls_;
    if (w.fp16_mixed) moq_ratio_ = moq_ratio_ > 0 ? moq_ratio_ - w.change_ratio : 0.0;
    for (size_t g = 0; g < w.groups.size(); ++g) {
      if (moq_bits_[g] != w.groups[g].target_bits && moq_calls_ >= moq_period_[g]) {
        moq_ratio_ = 1.0;
        moq_period_[g] <<= 1;
        --moq_bits_[g];
        if (w.verbose) {
          log::info0("MoQ: group '", w.groups[g].name, "' now at ", moq_bits_[g], " bits (quantization ", moq_calls_,
                     ", period ", moq_period_[g], ")");
        }
      }
    }
  }
}

void Schedule::update(int64_t applied) {
  if (applied == applied_) return;
  applied_ = applied;
  const auto& w = config_.weight;
  if (w.enabled) {
    int64_t calls = 0;
    if (!w.in_forward) calls = w.schedule_offset == 0 ? applied + 1 : std::max<int64_t>(0, applied - w.schedule_offset);
    if (!w.in_forward) advance_moq(calls);
    const bool on = w.in_forward ? applied >= w.schedule_offset : calls > 0;
    for (auto& b : weights_) {
      const auto& g = w.groups[b.group];
      SiteState& s = *b.state;
      s.weight_bits = !on ? 0 : w.in_forward ? g.target_bits : moq_bits_[b.group];
      // DeepSpeed's forward-quantized embeddings have a scale per token (row).
      s.weight_groups = w.in_forward && b.kind == Site::Kind::kEmbedding ? b.rows : w.quantize_groups;
      s.weight_symmetric = w.symmetric;
      s.weight_stochastic = w.stochastic;
      s.weight_mixed = !w.in_forward && w.fp16_mixed;
      s.weight_keep_ratio = moq_ratio_;
    }
  }
  const auto& a = config_.activation;
  for (auto& b : inputs_) {
    b.state->input_bits = applied >= a.schedule_offset ? a.groups[b.group].bits : 0;
    b.state->input_symmetric = a.symmetric;
  }
}

std::vector<std::string> Schedule::bound(const std::string& group) const {
  std::vector<std::string> out;
  for (const auto* list : {&weights_, &inputs_}) {
    for (const auto& b : *list) {
      const auto& groups = list == &weights_ ? config_.weight.groups : config_.activation.groups;
      if (groups[b.group].name == group) out.push_back(b.name);
    }
  }
  return out;
}

int Schedule::weight_bits(const std::string& group) const {
  for (const auto& b : weights_)
    if (config_.weight.groups[b.group].name == group) return b.state->weight_bits;
  return 0;
}

}  // namespace torchspeed::compression
