// data_efficiency with DeepSpeed's keys (deepspeed/runtime/data_pipeline/config.py, constants.py
// and data_routing/scheduler.py).
#include <cmath>

#include "torchspeed/config/detail/sections.h"

namespace torchspeed::config {

int64_t RandomLtdConfig::kept(int64_t global_steps) const {
  // __fixed_root_get_value with root_degree 1.
  const double progress = static_cast<double>(global_steps) / static_cast<double>(require_steps);
  int64_t next = static_cast<int64_t>(std::floor(progress * static_cast<double>(max_value - min_value) +
                                                 static_cast<double>(min_value)));
  next -= next % seq_per_step;
  return std::min(next, max_value);
}

namespace detail {

void read_data_efficiency(JsonReader& r, RandomLtdConfig& c) {
  r.get_bool("enabled", false);
  r.get_int("seed", 1234);  // DeepSpeed seeds its data samplers with it; random_ltd draws from the job's generator
  if (auto s = r.child("data_sampling")) {
    if (s->get_bool("enabled", false)) {
      s->error("enabled", "data sampling (curriculum learning over a data analysis) is not available in torchspeed");
    }
    accept_all(*s, *r.raw("data_sampling"));
    s->finish();
  }
  if (auto routing = r.child("data_routing")) {
    routing->get_bool("enabled", false);
    if (auto s = routing->child("random_ltd")) {
      // As DeepSpeed's engine: random_ltd.enabled alone switches it on.
      c.enabled = s->get_bool("enabled", false);
      if (!c.enabled) {
        accept_all(*s, *routing->raw("random_ltd"));
      } else {
        c.total_layer_num = s->get_int("total_layer_num", 0, 1, 1 << 20);
        c.layer_num = s->get_int("random_ltd_layer_num", 0, 0, 1 << 20);
        if (const auto* ids = s->raw("random_ltd_layer_id")) {
          if (!ids->is_array()) {
            s->error("random_ltd_layer_id", concat("expected a list of layer numbers, found ", json_type_name(*ids)));
          } else {
            for (const auto& v : *ids) {
              if (!v.is_number_integer() || v.get<int64_t>() < 0) {
                s->error("random_ltd_layer_id", concat("expected non-negative layer numbers, found ", v.dump()));
                continue;
              }
              c.layer_ids.push_back(v.get<int64_t>());
            }
          }
        } else {
          s->error("random_ltd_layer_id", "is required: the layers that drop tokens");
        }
        for (const char* key : {"total_layer_num", "random_ltd_layer_num"})
          if (!s->has(key)) s->error(key, "is required");
        if (s->has("random_ltd_layer_num") && static_cast<int64_t>(c.layer_ids.size()) != c.layer_num) {
          s->error("random_ltd_layer_num", concat(c.layer_num, " differs from the ", c.layer_ids.size(),
                                                  " layers of random_ltd_layer_id (as DeepSpeed, it must equal them)"));
        }
        // The model's side: our GPT is a decoder with [batch, sequence, hidden] activations and
        // a causal mask it builds itself (model_mask_name names a forward argument it has not).
        s->get_string("model_type", "decoder", {"decoder", "encoder"}) == "encoder"
            ? s->error("model_type", "\"encoder\": torchspeed's GPT is a decoder (causal attention over the kept tokens)")
            : void();
        if (s->get_string("hidden_state_order", "batch_seq_dim", {"batch_seq_dim", "seq_batch_dim"}) == "seq_batch_dim") {
          s->error("hidden_state_order", "\"seq_batch_dim\": torchspeed's GPT carries [batch, sequence, hidden] activations");
        }
        s->accept("model_mask_name");
        if (auto sched = s->child("random_ltd_schedule")) {
          c.min_value = sched->get_int("min_value", 0, 1);
          c.max_value = sched->get_int("max_value", 0, 1);
          for (const char* key : {"min_value", "max_value"})
            if (!sched->has(key)) sched->error(key, "is required");
          if (c.min_value > c.max_value) {
            sched->error("min_value", concat(c.min_value, " is above max_value ", c.max_value));
          }
          sched->get_string("schedule_type", "fixed_linear", {"fixed_linear"});
          if (auto sc = sched->child("schedule_config")) {
            c.require_steps = sc->get_int("require_steps", 1, 1);
            c.seq_per_step = sc->get_int("seq_per_step", 1, 1);
            sc->finish();
          }
          sched->finish();
        } else {
          s->error("random_ltd_schedule", "is required: min_value, max_value and schedule_config");
        }
        if (auto lr = s->child("layer_token_lr_schedule")) {
          if (lr->get_bool("enabled", false)) {
            lr->error("enabled", "the layer-token LR schedule is not available (DeepSpeed raises NotImplementedError)");
          }
          accept_all(*lr, *s->raw("layer_token_lr_schedule"));
          lr->finish();
        }
      }
      s->finish();
    }
    routing->finish();
  }
  r.finish();
}

}  // namespace detail
}  // namespace torchspeed::config
