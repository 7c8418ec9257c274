// Hugging Face folders of the Llama-shaped families in and out: what transformers'
// LlamaForCausalLM (Llama 1-3.2, SmolLM/SmolLM2), MistralForCausalLM, Qwen2ForCausalLM and
// Qwen3ForCausalLM save_pretrained writes and from_pretrained reads. Their config.json maps onto
// our model description (models::GPTConfig: RMSNorm, rotary positions with their scaling,
// SwiGLU, grouped-query attention, the family's biases, Qwen3's q/k norms), their tensors onto
// our names (q/k/v fused into qkv, gate/up into fc; Note [Decoder names] in hf_decoder.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "torchspeed/checkpoint/consolidated.h"

namespace torchspeed::checkpoint::hf {

// The model_type values read here.
bool is_decoder_family(const std::string& model_type);

// Our "model" section from a Llama / Mistral / Qwen2 / Qwen3 config.json (rope settings as
// transformers 4.x writes them, rope_theta + rope_scaling, or 5.x, rope_parameters). A setting
// torchspeed does not compute (another model_type, sliding-window attention, partial rotary
// dimensions, an activation other than SiLU, dynamic/longrope scaling) is an error naming
// `source` and the key.
nlohmann::json model_section_from_decoder(const nlohmann::json& hf_config, const std::string& source);

// The config.json of the family that represents `model_section` (Qwen3 with q/k norms, Qwen2
// with q/k/v biases only, Mistral or Llama otherwise: the section's "family" when it fits);
// `hf_config`: the folder's config as read, whose other keys (token ids, ...) are kept.
nlohmann::json decoder_config(const nlohmann::json& model_section, const nlohmann::json& hf_config, int64_t eos_token_id);

// The model of such a folder with our parameter names, fp32; config = {"model": section,
// "hf_config": config.json}. An unknown or missing tensor is an error naming the file and tensor.
Model load_decoder(const std::string& dir);

// Writes `params` (our names, a model of `model_section` with rotary positions) as a folder of
// its family: config.json, model.safetensors in `dtype`, the tokenizer's files. Returns the
// bytes of model.safetensors.
int64_t save_decoder(const std::string& dir, const NamedTensors& params, const nlohmann::json& model_section,
                     const nlohmann::json& hf_config, at::ScalarType dtype, const std::string& tokenizer_dir = "",
                     int64_t eos_token_id = -1);

}  // namespace torchspeed::checkpoint::hf
