// LoRA adapters in PEFT's format (what peft's save_pretrained writes and PeftModel.from_pretrained
// reads): adapter_config.json and adapter_model.safetensors, whose tensors are named after the
// Hugging Face module they adapt ("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight").
// Here each such module is placed in our model description: the rows of our fused linears its
// output is (q/k/v in qkv, gate/up in fc), so that training and serving add its update where the
// module's output lands. Note [LoRA].
#pragma once

#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "torchspeed/models/gpt.h"

namespace torchspeed::checkpoint::peft {

// Our fused linears of a block that LoRA updates reach.
enum class Fused { kQKV = 0, kProj = 1, kFC = 2, kMLP = 3 };
inline constexpr int kFusedCount = 4;

// One module LoRA can target, in every block: its Hugging Face name within the block, the fused
// linear its output is part of, which output rows [row0, row0 + rows) and its input width.
struct Target {
  std::string module;  // "self_attn.q_proj", "mlp.down_proj", "attn.c_attn", ...
  std::string short_name;  // the name target_modules uses: "q_proj", "c_attn", ...
  Fused fused;
  int64_t row0 = 0, rows = 0, in = 0;
};
// Llama-family names (q/k/v/o_proj, gate/up/down_proj) for a model with rotary positions,
// GPT-2's (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) for one with learned positions.
std::vector<Target> targets(const models::GPTConfig& cfg);
// PEFT's name of `target`'s lora_A ('A') or lora_B ('B') weight in block `layer`.
std::string tensor_name(const models::GPTConfig& cfg, int64_t layer, const Target& target, char which);

// One adapter: A [r, in] and B [out, r] per (layer, target) as PEFT stores them (fp32; undefined
// where the module is not adapted), and the settings that shape its forward.
struct Adapter {
  std::string source;  // the folder (errors name it)
  nlohmann::json config;  // adapter_config.json as read or to be written
  int64_t r = 8;
  double alpha = 8;
  bool rslora = false;  // use_rslora: the scale is alpha / sqrt(r), not alpha / r
  std::vector<std::vector<at::Tensor>> A, B;  // [layer][target index]
  // The factor the module's update B A x is multiplied by (r: that module's own rank).
  double scale(int64_t module_rank) const;
};

// Reads the folder for a base model of `cfg`. A setting that changes the forward and that we do
// not compute (DoRA, LoRA biases, modules_to_save, alpha_pattern, layer replication, targets
// outside the blocks' linears) is refused by its key; a tensor that is no target of this model,
// or whose shape disagrees with the model, by its name and file.
Adapter load(const std::string& dir, const models::GPTConfig& cfg);

// Writes `a` as PEFT's folder: adapter_config.json (PEFT's keys for a LoRA of `a`'s rank, alpha
// and targets; base_model_name_or_path `base_model`) and adapter_model.safetensors (fp32, atomic).
void save(const std::string& dir, const Adapter& a, const models::GPTConfig& cfg, const std::string& base_model = "");

}  // namespace torchspeed::checkpoint::peft
