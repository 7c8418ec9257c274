// LoRA fine-tuning (Hu et al., 2021) as PEFT trains it: the base model frozen, a low-rank update
// scale * B (A x) added to the output of each targeted linear, only A and B trained (and so in
// the optimizer, under ZeRO, and in checkpoints). The targets are Hugging Face's module names,
// placed on our fused linears by checkpoint/peft (Note [LoRA]); a trained adapter is written in
// PEFT's format and merged into the base for a model generate / serve / convert read as is.
#pragma once

#include <torch/nn/module.h>

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "torchspeed/checkpoint/peft.h"
#include "torchspeed/models/gpt.h"

namespace torchspeed::models {

// The config's "lora" section (PEFT's LoraConfig keys).
struct LoraOptions {
  int64_t r = 8;
  double alpha = 8;             // lora_alpha (PEFT's default: 8)
  double dropout = 0;           // lora_dropout: on the linear's input, before A, in training
  bool rslora = false;          // use_rslora: scale alpha / sqrt(r)
  std::vector<std::string> target_modules;  // short names ("q_proj", ...); "all-linear": every one
  // Reads {"r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules"}; an unknown key, a
  // target the model lacks or a bad value is an error naming lora.<key>.
  static LoraOptions from_json(const nlohmann::json& j, const GPTConfig& cfg);
  nlohmann::json to_json() const;
  double scale() const;
};

// One block's adapter: for each target module, lora_A [r, in] (PEFT's Kaiming-uniform start:
// U(-1/sqrt(in), 1/sqrt(in))) and lora_B [rows, r] (zeros: the model starts as the base), named
// "<module with _ for .>.lora_A" (e.g. "self_attn_q_proj.lora_A").
class LoraBlockImpl : public torch::nn::Module {
 public:
  LoraBlockImpl(const GPTConfig& cfg, const LoraOptions& options);
  // The update of fused linear `which` for its input x [..., in]: [..., out] (the rows no module
  // targets are zero), or an undefined tensor when no module of it is targeted.
  at::Tensor delta(checkpoint::peft::Fused which, const at::Tensor& x);

  struct Module {
    checkpoint::peft::Target target;
    torch::nn::Module* holder = nullptr;
    at::Tensor A, B;
  };
  std::vector<Module> modules;
  LoraOptions options;
  int64_t fused_out[checkpoint::peft::kFusedCount] = {0, 0, 0, 0};
};
TORCH_MODULE(LoraBlock);

// Sets requires_grad false on every parameter of `m`.
void freeze(torch::nn::Module& m);

// The parameter names of block `layer`'s adapter module `t`, as the stack names them
// ("block3.lora.self_attn_q_proj.lora_A").
std::string lora_param_name(int64_t layer, const checkpoint::peft::Target& t, char which);

// PEFT's adapter from a LoRA run's parameters (our names, as master_params gives them).
checkpoint::peft::Adapter lora_adapter_of(const std::vector<std::pair<std::string, at::Tensor>>& params, const GPTConfig& cfg,
                                          const LoraOptions& options);

// `base` (our names, fp32) with each adapter module's scale * B A added to the rows of its fused
// linear: the merged model (what PEFT's merge_and_unload gives).
std::vector<std::pair<std::string, at::Tensor>> merge_lora(const std::vector<std::pair<std::string, at::Tensor>>& base,
                                                           const checkpoint::peft::Adapter& adapter, const GPTConfig& cfg);

}  // namespace torchspeed::models
