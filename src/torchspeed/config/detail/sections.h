// Section readers that live in their own files, called by Config::parse (config.cpp), and the
// helpers they share.
#pragma once

#include "torchspeed/config/config.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/config/keys.h"

namespace torchspeed::config::detail {

// Accepts every key of a disabled part without reading it: nothing in it takes effect.
inline void accept_all(JsonReader& r, const nlohmann::json& j) {
  if (!j.is_object()) return;
  for (const auto& item : j.items()) r.accept(item.key());
}

// A DeepSpeed option whose other value torchspeed does not implement: the value it always has
// is accepted; the other is refused with the key's path and why.
inline void only(JsonReader& r, const std::string& key, bool supported, bool fallback, const std::string& why) {
  if (r.has(key) && r.get_bool(key, fallback) != supported) r.error(key, why);
}
// A DeepSpeed tuning knob with no counterpart here: accepted with a warning saying so when set.
inline void no_effect(JsonReader& r, const std::string& key, const std::string& why) {
  r.accept(key);  // known: warned here, never reported as unknown
  if (r.has(key)) r.warn(key, concat("has no effect in torchspeed: ", why));
}

// Hugging Face's "auto" values in the raw JSON, replaced before any section is read (Note ["auto"
// values] in auto_values.cpp); each replacement is a warning in `diag`.
void resolve_auto(nlohmann::json& j, const AutoValues& a, Diagnostics& diag);

// The sections of plain keys (plain_sections.cpp): each one's key table and reader.
const KeyTable<Config>& root_keys();  // the top-level scalars
const KeyTable<FP16Config>& fp16_keys();
void read_fp16(JsonReader& r, FP16Config& c);
const KeyTable<ActivationCheckpointingConfig>& activation_checkpointing_keys();
void read_activation_checkpointing(JsonReader& r, ActivationCheckpointingConfig& c);
const KeyTable<PipelineConfig>& pipeline_keys();
void read_pipeline(JsonReader& r, PipelineConfig& c);
const KeyTable<CheckpointConfig>& checkpoint_keys();
void read_checkpoint(JsonReader& r, CheckpointConfig& c);
const KeyTable<MonitorConfig>& monitor_keys();  // csv_monitor, tensorboard
void read_monitor(JsonReader& r, MonitorConfig& c);
const KeyTable<TorchspeedConfig>& torchspeed_keys();
void read_torchspeed(JsonReader& r, TorchspeedConfig& c, Diagnostics& diag);

// optimizer and scheduler (optimizer_sections.cpp).
void read_optimizer(JsonReader& r, OptimizerConfig& c);
void read_scheduler(JsonReader& r, SchedulerConfig& c);
// zero_optimization with offload_optimizer / offload_param, and aio (zero_section.cpp).
const KeyTable<ZeroConfig>& zero_keys();
const KeyTable<OffloadConfig>& offload_keys(bool optimizer);
OffloadConfig offload_defaults(bool optimizer);
const KeyTable<AioConfig>& aio_keys();
void read_zero(JsonReader& r, ZeroConfig& c);
void read_aio(JsonReader& r, AioConfig& c);

// compression_training: weight and activation quantization; the pruning methods and
// layer_reduction are accepted when disabled and refused by name when enabled.
void read_compression_training(JsonReader& r, CompressionConfig& c);
// quantize_training: MoQ as DeepSpeed's MoQ tutorial configures it.
void read_quantize_training(JsonReader& r, CompressionConfig& c);

// data_efficiency: random_ltd under data_routing; data_sampling (curriculum learning) is
// accepted when disabled and refused by name when enabled.
void read_data_efficiency(JsonReader& r, RandomLtdConfig& c);

}  // namespace torchspeed::config::detail
