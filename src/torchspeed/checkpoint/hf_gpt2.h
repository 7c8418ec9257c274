// Hugging Face GPT-2 folders in and out: what transformers' GPT2LMHeadModel.save_pretrained
// writes and from_pretrained reads (config.json with model_type "gpt2"; model.safetensors, or
// shards listed in model.safetensors.index.json; the tokenizer's files beside them).
//
// Our GPT is GPT-2's architecture (pre-LayerNorm blocks, learned positions, a head tied to the
// token embedding), so the parameters map one to one; GPT-2's projections are transformers'
// Conv1D (x @ W + b with W stored [in, out]) where ours are torch.nn.Linear ([out, in]), so the
// four projection weights of each block are transposed on the way in and out. See Note
// [GPT-2 names] in hf_gpt2.cpp for the table.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/hf_decoder.h"

namespace torchspeed::checkpoint::hf {

// Whether `dir` is a Hugging Face model folder: config.json with a "model_type".
bool is_hf_folder(const std::string& dir);

// The model of a Hugging Face folder of any family torchspeed runs: GPT-2 here, Llama, Mistral,
// Qwen2, Qwen3 (and SmolLM, which is Llama) through hf_decoder.h; another model_type is an
// error naming it.
Model load_hf(const std::string& dir);

// The safetensors files of a Hugging Face folder: model.safetensors, or the shards named by
// model.safetensors.index.json (each once, in the index's order).
std::vector<std::string> safetensors_files(const std::string& dir);

// Copies the tokenizer at `tokenizer_dir` (a tokenizer.json, a vocab.json, or a folder: its
// tokenizer files and generation_config.json) into `dir`; nothing when empty.
void copy_tokenizer_files(const std::string& dir, const std::string& tokenizer_dir);

// Our "model" section (vocab, seq_len, d_model, n_layer, n_head, dropout, tie_embeddings,
// activation, layer_norm_eps) from a GPT-2 config.json. A setting our GPT cannot compute
// (another model_type, n_inner other than 4 n_embd, an activation other than GELU, attention
// scaled by layer index, cross-attention) is an error naming `source` and the key.
nlohmann::json model_section_from_gpt2(const nlohmann::json& hf_config, const std::string& source);

// GPT-2's config.json for a model section; `eos_token_id` < 0: none (a vocabulary without
// GPT-2's <|endoftext|>).
nlohmann::json gpt2_config(const nlohmann::json& model_section, int64_t eos_token_id);

// The model of a GPT-2 folder with our parameter names, in fp32; config = {"model": section,
// "hf_config": config.json as read}. Buffers transformers stores beside the parameters in old
// checkpoints (attn.bias, attn.masked_bias) are skipped; any other unknown tensor is an error
// naming the file and tensor.
Model load_gpt2(const std::string& dir);

// Writes `params` (our names, a GPT of `model_section`) as a GPT-2 folder at `dir`: config.json
// and model.safetensors in `dtype`, replacing what is there atomically file by file. With
// `tokenizer_dir`, its tokenizer files (tokenizer.json, vocab.json, merges.txt,
// tokenizer_config.json, special_tokens_map.json) are copied beside them. Returns the bytes of
// model.safetensors.
int64_t save_gpt2(const std::string& dir, const NamedTensors& params, const nlohmann::json& model_section,
                  at::ScalarType dtype, const std::string& tokenizer_dir = "", int64_t eos_token_id = -1);

}  // namespace torchspeed::checkpoint::hf
