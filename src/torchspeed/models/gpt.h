// GPT as a LayerStack: "embed" (token + learned position embedding, dropout), "block0".."blockN-1"
// (pre-LayerNorm causal self-attention and 4x GELU MLP with residuals), "head" (final LayerNorm
// and the LM head, tied to the token embedding by default). GPT-2 initialisation. Every parallel
// technique treats it as a stack of layers; the loss is cross-entropy over the vocabulary in fp32.
#pragma once

#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/compression/quantize.h"
#include "torchspeed/nn/layer_spec.h"
#include "torchspeed/nn/token_drop.h"
#include "torchspeed/tensor_parallel/layers.h"
#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::models {

struct GPTConfig {
  int64_t vocab = 256;
  int64_t seq_len = 128;
  int64_t d_model = 128;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  double dropout = 0.0;
  bool tie_embeddings = true;
  // The MLP's GELU: "gelu" (exact, erf) or "gelu_tanh" (the tanh approximation GPT-2 was trained
  // with; Hugging Face calls it "gelu_new"). at::gelu's `approximate` argument: "none" or "tanh".
  std::string activation = "gelu";
  double layer_norm_eps = 1e-5;
  const char* gelu_approximate() const { return activation == "gelu_tanh" ? "tanh" : "none"; }

  // From a config's "model" section; errors name the JSON path (model.d_model ...).
  static GPTConfig from_json(const nlohmann::json& j, const std::string& path = "model");
  nlohmann::json to_json() const;
  // Parameters of the model built from this config (tied weights once).
  int64_t num_params() const;
  // Training FLOPs per token: 6 N (forward + backward of the weights) + 12 n_layer d_model
  // seq_len (attention scores and their backward), as in the PaLM paper's accounting.
  double flops_per_token() const;
};

// The dense layers are compressible (compression/): each linear layer and embedding has a
// quantization state the schedule sets, named as ours ("block3.qkv") and as GPT-2's
// ("transformer.h.3.attn.c_attn"), so DeepSpeed's GPT-2 compression configs apply unchanged.
class GPTEmbeddingImpl : public torch::nn::Module, public compression::Compressible {
 public:
  explicit GPTEmbeddingImpl(const GPTConfig& c);
  at::Tensor forward(const at::Tensor& tokens);  // [B, T] int64 -> [B, T, d]
  std::vector<compression::Site> compression_sites() override;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::Dropout drop{nullptr};
  compression::SiteState tok_q, pos_q;
};
TORCH_MODULE(GPTEmbedding);

class GPTBlockImpl : public torch::nn::Module, public compression::Compressible, public nn::TokenDroppable {
 public:
  GPTBlockImpl(const GPTConfig& c, int64_t index = 0);
  // [B, T, d] -> [B, T, d]; in training with kept_tokens set (random_ltd), on those tokens only.
  at::Tensor forward(const at::Tensor& x);
  at::Tensor attention(const at::Tensor& x);
  std::vector<compression::Site> compression_sites() override;
  int64_t droppable_index() const override { return index; }
  int64_t droppable_count() const override { return n_layer; }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, attn_proj{nullptr}, fc{nullptr}, mlp_proj{nullptr};
  torch::nn::Dropout drop{nullptr};
  int64_t n_head;
  int64_t index;  // the block's place in the stack (GPT-2's h.<index>)
  int64_t n_layer;
  std::string gelu_approximate;
  compression::SiteState qkv_q, attn_proj_q, fc_q, mlp_proj_q;
};
TORCH_MODULE(GPTBlock);

class GPTHeadImpl : public torch::nn::Module, public compression::Compressible {
 public:
  // `tied`: the token embedding's weight [vocab, d], shared (registered here too, so every
  // engine knows this layer uses it); undefined for an untied head.
  GPTHeadImpl(const GPTConfig& c, const at::Tensor& tied);
  at::Tensor forward(const at::Tensor& x);  // [B, T, d] -> logits [B, T, vocab]
  // An untied head is a linear layer ("head", GPT-2's "lm_head"); a tied one has none of its own.
  std::vector<compression::Site> compression_sites() override;
  torch::nn::LayerNorm ln_f{nullptr};
  at::Tensor weight;
  bool is_tied;
  int64_t vocab;
  compression::SiteState weight_q;
};
TORCH_MODULE(GPTHead);

// Tensor-parallel forms, each built from the dense layer (its weights sliced).
class GPTEmbeddingTPImpl : public torch::nn::Module {
 public:
  GPTEmbeddingTPImpl(const GPTEmbedding& dense, const comm::CommunicatorPtr& tp);
  at::Tensor forward(const at::Tensor& tokens);
  tensor_parallel::VocabParallelEmbedding tok{nullptr};
  torch::nn::Embedding pos{nullptr};  // replicated
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(GPTEmbeddingTP);

class GPTBlockTPImpl : public torch::nn::Module {
 public:
  GPTBlockTPImpl(const GPTBlock& dense, const comm::CommunicatorPtr& tp);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};  // replicated
  tensor_parallel::ColumnParallelLinear qkv{nullptr}, fc{nullptr};
  tensor_parallel::RowParallelLinear attn_proj{nullptr}, mlp_proj{nullptr};
  torch::nn::Dropout drop{nullptr};
  int64_t local_heads;
  std::string gelu_approximate;
};
TORCH_MODULE(GPTBlockTP);

class GPTHeadTPImpl : public torch::nn::Module {
 public:
  // `tied`: the vocabulary-parallel embedding's weight slice, or undefined.
  GPTHeadTPImpl(const GPTHead& dense, const at::Tensor& tied, const comm::CommunicatorPtr& tp);
  at::Tensor forward(const at::Tensor& x);  // -> this rank's logits [B, T, vocab/tp]
  torch::nn::LayerNorm ln_f{nullptr};
  at::Tensor weight;  // [vocab/tp, d]
  comm::CommunicatorPtr tp;
};
TORCH_MODULE(GPTHeadTP);

// The stack as a spec (layer i initialised from seed + i; the head tied to the token embedding
// by the key "wte"): what a pipeline stage builds its own layers from.
// With `tp` (a tensor-parallel group of size > 1) the layers are Megatron-style: attention heads
// and the MLP split column- then row-parallel, a vocabulary-parallel embedding and LM head and
// a vocabulary-parallel loss; each rank holds its slice of the dense layer's weights (same
// names), so the model equals the dense one built from the same seed.
// With `init`, every layer's weights are copied from it (our names: "embed.tok.weight",
// "block0.qkv.weight", ...; a tied head has no "head.weight") right after the dense layer is
// built, before any slicing: how `torchspeed train --init-from` starts from a checkpoint. A
// missing tensor or a shape mismatch is an error naming it.
using InitTensors = std::shared_ptr<const std::map<std::string, at::Tensor>>;
nn::StackSpec gpt_spec(const GPTConfig& config, uint64_t seed, comm::CommunicatorPtr tp = nullptr,
                       InitTensors init = nullptr);
// Builds the whole stack, seeded from the seed last given to torch::manual_seed.
nn::LayerStack make_gpt(const GPTConfig& config);

}  // namespace torchspeed::models

namespace torchspeed::models {

struct SampleOptions {
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0: greedy
  int64_t top_k = 0;         // 0: the whole vocabulary
  uint64_t seed = 0;
};

// Extends `prompt` token by token with the model in eval mode (the context is the last seq_len
// tokens). Returns only the new tokens.
std::vector<int64_t> sample(nn::LayerStack& model, const GPTConfig& config,
                            std::vector<int64_t> prompt, const SampleOptions& options);

}  // namespace torchspeed::models
