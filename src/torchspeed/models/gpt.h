// The decoder-only transformer as a LayerStack: "embed" (token embedding, plus a learned position
// embedding where positions are learned; dropout), "block0".."blockN-1" (pre-norm causal
// self-attention and MLP with residuals), "head" (final norm and the LM head, tied to the token
// embedding by default). One description (GPTConfig) covers the families people use: GPT-2 is
// its default instance; Llama, Mistral, Qwen2, Qwen3 and SmolLM set RMSNorm, rotary positions,
// SwiGLU, grouped-query attention, their biases and Qwen3's q/k norms (Note [Model
// description]). The serving model (inference/) is built from the same description. Every
// parallel technique treats it as a stack of layers; the loss is cross-entropy in fp32.
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
#include "torchspeed/models/moe.h"
#include "torchspeed/nn/layer_spec.h"
#include "torchspeed/nn/token_drop.h"
#include "torchspeed/tensor_parallel/layers.h"
#include "torchspeed/nn/layer_stack.h"

namespace torchspeed::models {

// Rotary position embedding's frequency scaling, as Hugging Face configs spell it
// ("rope_scaling": {"rope_type": ...}). kNone: RoPE as published (Su et al.).
struct RopeScaling {
  std::string type = "none";  // "none" | "linear" | "llama3" | "yarn"
  double factor = 1.0;
  // llama3: frequencies below low_freq_factor / original_max_position_embeddings scaled by
  // 1/factor, above high_freq_factor left alone, smoothly between.
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;  // llama3 and yarn (0: the model's seq_len)
  // yarn (Peng et al.): the ramp between beta_fast and beta_slow rotations, and the attention
  // factor that scales cos and sin (0: 0.1 ln(factor) + 1).
  double beta_fast = 32.0, beta_slow = 1.0, attention_factor = 0.0;
  bool truncate = true;
  bool operator==(const RopeScaling& o) const;
};

// Note [Model description]
// One decoder-only transformer, GPT-2's by default. The fields a family changes:
//   n_kv_head  key/value heads (0: n_head); fewer is grouped-query attention: query head h
//              reads KV head h / (n_head / n_kv_head), as Hugging Face's repeat_kv
//   head_dim   0: d_model / n_head (Qwen3 and some Llama shapes set it apart)
//   d_ff       the MLP's width (0: 4 d_model)
//   norm       "layernorm" (weight and bias) or "rmsnorm" (weight only, fp32 inside)
//   positions  "learned" (embed.pos) or "rope" (rotate-half convention, rope_theta, rope_scaling)
//   activation "gelu", "gelu_tanh", or "swiglu": silu(gate) * up, fc's rows are [gate; up]
//   qkv_bias, attn_out_bias, mlp_bias: the linear layers' biases (GPT-2: all; Llama: none;
//              Qwen2: q/k/v only)
//   qk_norm    Qwen3's RMSNorm of each query and key head (over head_dim) before RoPE
//   moe        a Mixture-of-Experts MLP in every block instead of the dense one (models/moe.h:
//              Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSpeed-MoE's gate); SwiGLU experts
// The fused qkv weight's rows are [q: n_head * head_dim | k: n_kv_head * head_dim | v: same].
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
  double layer_norm_eps = 1e-5;  // the eps of every norm, LayerNorm or RMSNorm
  int64_t n_kv_head = 0;
  int64_t head_dim = 0;
  int64_t d_ff = 0;
  std::string norm = "layernorm";
  std::string positions = "learned";
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool qkv_bias = true, attn_out_bias = true, mlp_bias = true;
  bool qk_norm = false;
  MoEConfig moe;  // num_experts 0: dense
  const char* gelu_approximate() const { return activation == "gelu_tanh" ? "tanh" : "none"; }
  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t hd() const { return head_dim > 0 ? head_dim : d_model / n_head; }
  int64_t ff() const { return d_ff > 0 ? d_ff : 4 * d_model; }
  bool rms() const { return norm == "rmsnorm"; }
  bool rope() const { return positions == "rope"; }
  bool swiglu() const { return activation == "swiglu"; }
  // The MoE section with its expert width resolved (d_ff 0: the model's d_ff).
  MoEConfig experts() const {
    MoEConfig m = moe;
    if (m.d_ff == 0) m.d_ff = ff();
    return m;
  }
  int64_t q_width() const { return n_head * hd(); }
  int64_t kv_width() const { return kv_heads() * hd(); }
  // Parameters of one block, of the embedding layer and of the head layer (a tied head: its norm).
  int64_t block_params() const;
  int64_t embed_params() const;
  int64_t head_params() const;
  // Parameters one token's forward uses (an MoE block's k experts, not all): FLOPs count these.
  int64_t active_params() const;

  // From a config's "model" section; errors name the JSON path (model.d_model ...).
  static GPTConfig from_json(const nlohmann::json& j, const std::string& path = "model");
  nlohmann::json to_json() const;
  // Parameters of the model built from this config (tied weights once).
  int64_t num_params() const;
  // Training FLOPs per token: 6 N (forward + backward of the weights; N the active parameters)
  // + 12 n_layer d_model seq_len (attention scores and their backward), as in the PaLM paper.
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
  torch::nn::Embedding tok{nullptr}, pos{nullptr};  // pos: learned positions only
  torch::nn::Dropout drop{nullptr};
  compression::SiteState tok_q, pos_q;
  // Sequence parallelism: the tokens are the group rank's shard, so learned positions start at
  // rank x tokens.
  comm::CommunicatorPtr sp;
};
TORCH_MODULE(GPTEmbedding);

// LayerNorm (weight and bias) or RMSNorm (weight only; Hugging Face's LlamaRMSNorm: computed in
// fp32, the weight applied after casting back to the input's dtype).
class NormImpl : public torch::nn::Module {
 public:
  NormImpl(int64_t dim, double eps, bool rms);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;  // bias: LayerNorm only
  int64_t dim;
  double eps;
  bool rms;
};
TORCH_MODULE(Norm);
Norm copy_norm(const Norm& src);

// Rotary embedding tables for positions [0, positions): cos and sin [positions, head_dim / 2],
// fp32, computed as Hugging Face computes them (inverse frequencies in fp32 from rope_theta and
// rope_scaling, their outer product with the positions, times yarn's attention factor).
struct RopeTables {
  at::Tensor cos, sin;
};
RopeTables rope_tables(const GPTConfig& c, int64_t positions);
// x [B, H, T, hd] rotated by positions 0..T-1 (rotate-half convention), in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& t);

class LoraBlockImpl;  // models/lora.h
struct LoraOptions;

class GPTBlockImpl : public torch::nn::Module, public compression::Compressible, public nn::TokenDroppable {
 public:
  GPTBlockImpl(const GPTConfig& c, int64_t index = 0);
  // [B, T, d] -> [B, T, d]; in training with kept_tokens set (random_ltd), on those tokens only.
  at::Tensor forward(const at::Tensor& x);
  at::Tensor attention(const at::Tensor& x);
  std::vector<compression::Site> compression_sites() override;
  int64_t droppable_index() const override { return index; }
  int64_t droppable_count() const override { return n_layer; }
  Norm ln1{nullptr}, ln2{nullptr}, q_norm{nullptr}, k_norm{nullptr};  // q/k norms: qk_norm only
  torch::nn::Linear qkv{nullptr}, attn_proj{nullptr}, fc{nullptr}, mlp_proj{nullptr};  // fc, mlp_proj: dense MLP
  MoE moe{nullptr};  // the Mixture-of-Experts MLP instead (GPTConfig::moe)
  torch::nn::Dropout drop{nullptr};
  int64_t n_head, n_kv_head, head_dim;
  int64_t index;  // the block's place in the stack (GPT-2's h.<index>)
  int64_t n_layer;
  std::string gelu_approximate;
  bool swiglu;
  RopeTables rope;  // undefined tensors with learned positions
  compression::SiteState qkv_q, attn_proj_q, fc_q, mlp_proj_q;
  // Sequence parallelism (parallel/sequence.h): x holds the group rank's shard of each
  // sequence; attention exchanges heads for tokens around itself.
  comm::CommunicatorPtr sp;
  // ALST's tiled MLP: in training, the dense MLP runs on this many slices of the sequence, each
  // checkpointed (its [tokens, d_ff] activations exist for one slice at a time, forward and
  // backward). 0 or 1: whole.
  int64_t mlp_tiles = 0;
  // LoRA (models/lora.h): freezes the block's own parameters and adds the adapter's, registered
  // last as "lora"; its updates join the linears' outputs.
  void add_lora(const GPTConfig& c, const LoraOptions& options);
  std::shared_ptr<LoraBlockImpl> lora;
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
  Norm ln_f{nullptr};
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
  Norm ln1{nullptr}, ln2{nullptr}, q_norm{nullptr}, k_norm{nullptr};  // replicated
  tensor_parallel::ColumnParallelLinear qkv{nullptr}, fc{nullptr};
  tensor_parallel::RowParallelLinear attn_proj{nullptr}, mlp_proj{nullptr};
  torch::nn::Dropout drop{nullptr};
  // A Mixture-of-Experts block: the dense block's MoE MLP, whole on every tensor-parallel rank
  // (its input is replicated there), instead of fc and mlp_proj.
  MoE moe{nullptr};
  int64_t local_heads, local_kv_heads, head_dim;
  // Fewer KV heads than ranks: this many consecutive ranks (kv_group) share one KV head.
  int64_t kv_replicas = 1;
  comm::CommunicatorPtr kv_group;
  std::string gelu_approximate;
  bool swiglu;
  RopeTables rope;
};
TORCH_MODULE(GPTBlockTP);

class GPTHeadTPImpl : public torch::nn::Module {
 public:
  // `tied`: the vocabulary-parallel embedding's weight slice, or undefined.
  GPTHeadTPImpl(const GPTHead& dense, const at::Tensor& tied, const comm::CommunicatorPtr& tp);
  at::Tensor forward(const at::Tensor& x);  // -> this rank's logits [B, T, vocab/tp]
  Norm ln_f{nullptr};
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
// With `lora`, every loaded weight is frozen and each block gets an adapter (LoRA fine-tuning;
// not with tensor parallelism).
// With `ep` (model.moe.ep_size > 1: ParallelGroups::ep), each MoE block keeps its rank's
// experts of the dense layer (MoEImpl::shard_experts).
using InitTensors = std::shared_ptr<const std::map<std::string, at::Tensor>>;
nn::StackSpec gpt_spec(const GPTConfig& config, uint64_t seed, comm::CommunicatorPtr tp = nullptr,
                       InitTensors init = nullptr, std::shared_ptr<const LoraOptions> lora = nullptr,
                       comm::CommunicatorPtr ep = nullptr);
// Builds the whole stack, seeded from the seed last given to torch::manual_seed.
nn::LayerStack make_gpt(const GPTConfig& config);

// DeepSpeed-Ulysses over `sp` (parallel/sequence.h; null or size 1: the spec unchanged): the
// embedding's learned positions offset to the rank's shard, every block's attention exchanging
// heads for tokens. Needs the dense (not tensor-parallel) layers and dense MLPs: an MoE block's
// per-rank expert capacity and load-balancing loss would differ from the unsplit sequence's.
nn::StackSpec sequence_parallel(nn::StackSpec spec, const GPTConfig& config, comm::CommunicatorPtr sp);
// ALST's tiling (Arctic Long Sequence Training, Bekman et al. 2025): each block's dense MLP over
// `mlp_tiles` slices of the sequence, and the LM head with its cross-entropy over `loss_tiles`
// slices (a fused loss: the [tokens, vocab] logits never exist whole in training); each slice
// checkpointed. 0 or 1: no tiling. Needs the dense (not tensor-parallel) head for the loss.
nn::StackSpec tiled(nn::StackSpec spec, const GPTConfig& config, int64_t mlp_tiles, int64_t loss_tiles);

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
