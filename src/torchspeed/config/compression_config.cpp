// compression_training and quantize_training, with DeepSpeed's keys and defaults
// (deepspeed/compression/config.py and constants.py; docs/_tutorials/MoQ-tutorial.md).
#include <regex>

#include "torchspeed/config/detail/sections.h"

namespace torchspeed::config::detail {
namespace {

// The module patterns of a group: a list of regular expressions (DeepSpeed re.search()es them
// in module names). Each must compile.
std::vector<std::string> read_modules(JsonReader& g) {
  std::vector<std::string> out;
  const auto* v = g.raw("modules");
  if (!v) {
    g.error("modules", "is required: the list of module-name patterns this group applies to");
    return out;
  }
  if (!v->is_array() || v->empty()) {
    g.error("modules", concat("expected a non-empty list of module-name patterns, found ", json_type_name(*v)));
    return out;
  }
  for (const auto& m : *v) {
    if (!m.is_string()) {
      g.error("modules", concat("expected strings, found ", json_type_name(m)));
      continue;
    }
    try {
      std::regex re(m.get<std::string>());
    } catch (const std::regex_error& e) {
      g.error("modules", concat("'", m.get<std::string>(), "' is not a valid regular expression: ", e.what()));
      continue;
    }
    out.push_back(m.get<std::string>());
  }
  return out;
}

// different_groups: {"name": {"params": {...}, "modules": [...], "related_modules": ...}}.
template <typename ReadParams>
std::vector<QuantizeGroupConfig> read_groups(JsonReader& part, bool enabled, const std::string& what,
                                             ReadParams read_params) {
  std::vector<QuantizeGroupConfig> out;
  const auto* raw = part.raw("different_groups");
  if (!raw) {
    if (enabled) part.error("different_groups", concat("is required when ", what, " is enabled (as in DeepSpeed)"));
    return out;
  }
  auto groups = part.child("different_groups");
  if (!groups) return out;
  if (enabled && raw->empty()) part.error("different_groups", concat("names no group: ", what, " would change nothing"));
  for (const auto& item : raw->items()) {
    auto g = groups->child(item.key());
    if (!g) continue;
    QuantizeGroupConfig q;
    q.name = item.key();
    q.path = groups->path_of(item.key());
    q.modules = read_modules(*g);
    g->accept("related_modules");  // used by the pruning methods only
    if (auto p = g->child("params")) {
      read_params(*p, q);
      p->finish();
    } else {
      g->error("params", "is required");
    }
    g->finish();
    out.push_back(std::move(q));
  }
  return out;
}

void read_weight_quantization(JsonReader& r, WeightQuantizationConfig& c) {
  c.section = "compression_training.weight_quantization";
  if (auto s = r.child("shared_parameters")) {
    c.enabled = s->get_bool("enabled", false);
    if (!c.enabled) {
      accept_all(*s, *r.raw("shared_parameters"));
      s->finish();
    } else {
      s->get_bool("quantizer_kernel", false);  // DeepSpeed's CUDA kernel: the same quantizer here
      c.schedule_offset = s->get_int("schedule_offset", 0, 0);
      c.quantize_groups = s->get_int("quantize_groups", 1, 1, int64_t{1} << 30);
      c.verbose = s->get_bool("quantize_verbose", false);
      c.symmetric = s->get_string("quantization_type", "symmetric", {"symmetric", "asymmetric"}) == "symmetric";
      c.in_forward = s->get_bool("quantize_weight_in_forward", false);
      c.stochastic = s->get_string("rounding", "nearest", {"nearest", "stochastic"}) == "stochastic";
      if (auto m = s->child("fp16_mixed_quantize")) {
        c.fp16_mixed = m->get_bool("enabled", false);
        c.change_ratio = m->get_double("quantize_change_ratio", 0.001, 0.0, 1.0);
        m->finish();
      }
      // DeepSpeed's forward quantizers (SymQuantizer ...) round to nearest and never blend.
      if (c.in_forward && c.stochastic) {
        s->error("rounding", "\"stochastic\" applies to MoQ (quantize_weight_in_forward: false); DeepSpeed's "
                             "quantize_weight_in_forward quantizers round to nearest");
      }
      if (c.in_forward && c.fp16_mixed) {
        s->error("fp16_mixed_quantize", "applies to MoQ (quantize_weight_in_forward: false), not to "
                                        "quantize_weight_in_forward");
      }
      s->finish();
    }
  }
  c.groups = read_groups(r, c.enabled, "weight quantization", [&](JsonReader& p, QuantizeGroupConfig& q) {
    if (!p.has("start_bits")) p.error("start_bits", "is required");
    if (!p.has("target_bits")) p.error("target_bits", "is required");
    q.start_bits = static_cast<int>(p.get_int("start_bits", 16, 1, 16));
    q.target_bits = static_cast<int>(p.get_int("target_bits", 16, 1, 16));
    q.quantization_period = p.get_int("quantization_period", 1, 0);
    if (q.start_bits < q.target_bits) {
      p.error("start_bits", concat(q.start_bits, " is below target_bits ", q.target_bits,
                                   " (precision only falls, from start_bits to target_bits)"));
    }
    // Ternary (2 bits) and binary (1 bit) weights are symmetric, rounded to nearest.
    if (c.enabled && q.target_bits <= 2 && (!c.symmetric || c.stochastic)) {
      p.error("target_bits", concat(q.target_bits, " bits (", q.target_bits == 2 ? "ternary" : "binary",
                                    ") needs quantization_type \"symmetric\" and rounding \"nearest\", as in DeepSpeed"));
    }
    if (c.enabled && c.in_forward && q.start_bits != q.target_bits) {
      p.error("start_bits", concat(q.start_bits, " differs from target_bits ", q.target_bits,
                                   ": quantize_weight_in_forward quantizes to target_bits from the start; the "
                                   "start_bits schedule is MoQ's (quantize_weight_in_forward: false)"));
    }
  });
  r.finish();
}

void read_activation_quantization(JsonReader& r, ActivationQuantizationConfig& c) {
  if (auto s = r.child("shared_parameters")) {
    c.enabled = s->get_bool("enabled", false);
    if (!c.enabled) {
      accept_all(*s, *r.raw("shared_parameters"));
    } else {
      c.symmetric = s->get_string("quantization_type", "symmetric", {"symmetric", "asymmetric"}) == "symmetric";
      const std::string range = s->get_string("range_calibration", "dynamic", {"dynamic", "static"});
      if (range == "static") {
        s->error("range_calibration", "\"static\" (a running min/max per module, DeepSpeed's QuantAct) is not "
                                      "available; \"dynamic\" quantizes each token with its own range");
      }
      c.schedule_offset = s->get_int("schedule_offset", 1000, 0);
    }
    s->finish();
  }
  c.groups = read_groups(r, c.enabled, "activation quantization", [&](JsonReader& p, QuantizeGroupConfig& q) {
    if (!p.has("bits")) p.error("bits", "is required");
    q.bits = static_cast<int>(p.get_int("bits", 8, 1, 16));
    if (c.enabled && q.bits != 4 && q.bits != 8) {
      p.error("bits", concat(q.bits, ": activations are quantized to 4 or 8 bits, as in DeepSpeed"));
    }
  });
  r.finish();
}

// A compression method torchspeed does not run: accepted when its shared_parameters.enabled is
// false, refused by name otherwise.
void read_unavailable(JsonReader& r, const nlohmann::json& j, const std::string& why) {
  const auto* sp = j.is_object() && j.contains("shared_parameters") ? &j["shared_parameters"] : nullptr;
  const bool enabled = sp && sp->is_object() && sp->value("enabled", false) == true;
  if (enabled) r.error("shared_parameters", concat("enabled is true: ", why));
  accept_all(r, j);
}

}  // namespace

void read_compression_training(JsonReader& r, CompressionConfig& c) {
  if (auto s = r.child("weight_quantization")) read_weight_quantization(*s, c.weight);
  if (auto s = r.child("activation_quantization")) read_activation_quantization(*s, c.activation);
  const std::string pruning = "pruning is not available in torchspeed (quantization-aware training is)";
  for (const auto& [key, why] : std::vector<std::pair<std::string, std::string>>{
           {"sparse_pruning", "sparse " + pruning},
           {"row_pruning", "row " + pruning},
           {"head_pruning", "head " + pruning},
           {"channel_pruning", "channel pruning (of Conv2d layers) is not available in torchspeed"}}) {
    if (auto s = r.child(key)) read_unavailable(*s, *r.raw(key), why);
  }
  if (auto s = r.child("layer_reduction")) {
    if (s->get_bool("enabled", false)) {
      s->error("enabled", "layer reduction (initialising a smaller student from a teacher model) is not available in "
                          "torchspeed");
    }
    accept_all(*s, *r.raw("layer_reduction"));
    s->finish();
  }
  r.finish();
}

void read_quantize_training(JsonReader& r, CompressionConfig& c) {
  const bool enabled = r.get_bool("enabled", false);
  WeightQuantizationConfig w;
  w.enabled = enabled;
  w.every_matrix = true;
  w.section = "quantize_training";
  w.in_forward = false;
  w.verbose = r.get_bool("quantize_verbose", false);
  r.get_bool("quantizer_kernel", false);  // DeepSpeed's CUDA kernel: the same quantizer here
  std::string type = r.get_string("quantize_type", "symmetric", {"symmetric", "asymmetric"});
  w.quantize_groups = r.get_int("quantize_groups", 1, 1, int64_t{1} << 30);
  QuantizeGroupConfig g;
  g.name = "quantize_training";
  g.path = "quantize_training";
  g.modules = {".*"};
  if (auto b = r.child("quantize_bits")) {
    g.start_bits = static_cast<int>(b->get_int("start_bits", 16, 1, 16));
    g.target_bits = static_cast<int>(b->get_int("target_bits", 16, 1, 16));
    if (g.start_bits < g.target_bits) {
      b->error("start_bits", concat(g.start_bits, " is below target_bits ", g.target_bits));
    }
    b->finish();
  }
  // The tutorial's defaults: a period of 100 steps, starting after 100.
  g.quantization_period = 100;
  w.schedule_offset = 100;
  if (auto s = r.child("quantize_schedule")) {
    g.quantization_period = s->get_int("quantize_period", 100, 0);
    w.schedule_offset = s->get_int("schedule_offset", 100, 0);
    s->finish();
  }
  std::string rounding = "nearest";
  if (auto a = r.child("quantize_algo")) {
    type = a->get_string("q_type", type, {"symmetric", "asymmetric"});
    rounding = a->get_string("rounding", "nearest", {"nearest", "stochastic"});
    a->finish();
  }
  w.symmetric = type == "symmetric";
  w.stochastic = rounding == "stochastic";
  if (auto m = r.child("fp16_mixed_quantize")) {
    w.fp16_mixed = m->get_bool("enabled", false);
    w.change_ratio = m->get_double("quantize_change_ratio", 0.001, 0.0, 1.0);
    m->finish();
  }
  if (enabled && g.target_bits <= 2 && (!w.symmetric || w.stochastic)) {
    r.error("quantize_bits", concat("target_bits ", g.target_bits, " needs symmetric quantization rounded to nearest"));
  }
  if (r.get_bool("quantize_eigenvalue", false) && enabled) {
    r.error("quantize_eigenvalue", "eigenvalue-scheduled MoQ is not available (DeepSpeed itself refuses it: "
                                   "\"Eigenvalue based MoQ is temporarily disabled\")");
  }
  if (const auto* e = r.raw("eigenvalue"); e && e->is_object() && e->value("enabled", false) == true && enabled) {
    r.error("eigenvalue", "eigenvalue-scheduled MoQ is not available (DeepSpeed itself refuses it)");
  }
  r.finish();
  if (!enabled) return;
  if (c.weight.enabled) {
    r.error("enabled", concat("quantize_training and ", c.weight.section, " both quantize weights; enable one of them"));
    return;
  }
  w.groups.push_back(std::move(g));
  c.weight = std::move(w);
}

}  // namespace torchspeed::config::detail
