// Section readers that live in their own files, called by Config::parse (config.cpp).
#pragma once

#include "torchspeed/config/config.h"
#include "torchspeed/config/json_reader.h"

namespace torchspeed::config::detail {

// Accepts every key of a disabled part without reading it: nothing in it takes effect.
inline void accept_all(JsonReader& r, const nlohmann::json& j) {
  if (!j.is_object()) return;
  for (const auto& item : j.items()) r.accept(item.key());
}

// compression_training: weight and activation quantization; the pruning methods and
// layer_reduction are accepted when disabled and refused by name when enabled.
void read_compression_training(JsonReader& r, CompressionConfig& c);
// quantize_training: MoQ as DeepSpeed's MoQ tutorial configures it.
void read_quantize_training(JsonReader& r, CompressionConfig& c);

// data_efficiency: random_ltd under data_routing; data_sampling (curriculum learning) is
// accepted when disabled and refused by name when enabled.
void read_data_efficiency(JsonReader& r, RandomLtdConfig& c);

}  // namespace torchspeed::config::detail
