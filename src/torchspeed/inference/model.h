// A decoder for serving, built from the same model description as training (models::GPTConfig:
// GPT-2, Llama, Mistral, Qwen2/3, SmolLM): the trained weights (fp32, bf16 or int8 linears), a
// forward over a ragged batch of sequence chunks that reads and writes the paged KV cache
// (rotary positions applied to queries and keys as they are written; grouped-query attention
// reads each KV head for its query group), and the same forward split Megatron-style over a
// tensor-parallel group (heads and the MLP split column- then row-parallel with the
// tensor_parallel/ slicing, two all-reduces of [tokens, d] per layer).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <memory>
#include <vector>

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/peft.h"
#include "torchspeed/comm/communicator.h"
#include "torchspeed/inference/kv_cache.h"
#include "torchspeed/inference/linear.h"
#include "torchspeed/inference/scheduler.h"
#include "torchspeed/models/gpt.h"

namespace torchspeed::inference {

// The KV cache dtype `--kv-cache-dtype auto` picks: fp32 beside fp32 weights, bf16 beside the
// compact formats (whose users chose memory over the last bits).
inline at::ScalarType default_kv_dtype(WeightFormat f) { return f == WeightFormat::kFP32 ? at::kFloat : at::kBFloat16; }

class InferenceModel {
 public:
  // `tp`: null or a group of size 1 for one process. `bf16_dot`: bf16 and int8 weights
  // multiply with bf16 dot products where the CPU has them, on AMX tiles where it has those
  // (ServingLinear).
  InferenceModel(const checkpoint::Model& model, WeightFormat format, comm::CommunicatorPtr tp = nullptr,
                 bool bf16_dot = true);
  bool bf16_dot() const { return head_.bf16_dot(); }
  bool amx() const { return head_.amx(); }

  const models::GPTConfig& config() const { return cfg_; }
  int64_t local_heads() const { return heads_; }
  int64_t local_kv_heads() const { return kv_heads_; }  // what the KV cache holds per layer
  int64_t head_dim() const { return hd_; }
  // Bytes of weights one decode step reads on this rank.
  int64_t weight_bytes() const;
  int64_t num_params() const { return cfg_.num_params(); }

  // Runs the chunks; returns fp32 logits [rows, vocab]: for each chunk with want_logits, its
  // last token's row (every token's with all_logits), in plan order.
  at::Tensor forward(const StepPlan& plan, KVCache& cache) { return run(plan, cache, true); }
  // The same pass, returning the rows' final hidden states (after the final norm, before the LM
  // head: [rows, d]) instead of their logits (embeddings).
  at::Tensor hidden(const StepPlan& plan, KVCache& cache) { return run(plan, cache, false); }
  // A LoRA adapter (Note [LoRA]) the forward applies to the chunks that name it, split over the
  // tensor-parallel group as the linears it updates. Returns its id (1, 2, ...). Every TP rank
  // adds the same adapters in the same order.
  int32_t add_adapter(const checkpoint::peft::Adapter& adapter);
  int32_t num_adapters() const { return static_cast<int32_t>(lora_.size()); }
  // Collective calls this rank made on its TP group per forward (0 without TP).
  int64_t collectives_per_forward() const { return tp_ ? 2 * cfg_.n_layer : 0; }

 private:
  at::Tensor run(const StepPlan& plan, KVCache& cache, bool logits);
  struct Layer {
    at::Tensor ln1_w, ln1_b, ln2_w, ln2_b;  // biases: LayerNorm only
    at::Tensor q_norm, k_norm;              // Qwen3's per-head RMSNorm weights [head_dim]
    ServingLinear qkv, proj, fc, mlp;  // fc, mlp: a dense MLP
    // A Mixture-of-Experts MLP instead (Note [Serving experts]): the router (fp32 always), each
    // expert's [gate; up] and down linears, Qwen2-MoE's shared expert and its gate. With --tp the
    // experts spread over the ranks: this rank's are experts [expert_first, + expert_fc.size()).
    bool moe = false;
    ServingLinear router, shared_fc, shared_mlp, shared_gate;
    std::vector<ServingLinear> expert_fc, expert_mlp;
    int64_t expert_first = 0;
  };
  // x += the MoE MLP of layer L over its input h [N, d].
  void experts_add(const Layer& L, const at::Tensor& h, int64_t decode_rows, at::Tensor& x) const;
  // One adapter's update of one fused linear (Note [Serving LoRA]): u = A x for the stacked A
  // of its modules, then each module's rows of the output += B_t u_t, the scale folded into B.
  // A's input and the modules' rows are this rank's part of the linear's. Stored in fp32 beside
  // fp32 weights, else in bf16 (the row kernel's copy; the GEMM path widens them).
  struct LoraModule {
    int64_t lo = 0, rows = 0, col = 0, r = 0;  // output rows [lo, lo + rows), u's columns [col, col + r)
    at::Tensor Bt;                              // [r, rows] (B transposed), fp32 or bf16
  };

 public:
  using LoraModuleView = LoraModule;  // for the row kernel in model.cpp

 private:
  struct LoraPair {
    at::Tensor A;  // [R, in], fp32 or bf16
    std::vector<LoraModule> modules;
    bool present = false;
  };
  struct LoraGroup;  // rows of a forward that one adapter updates
  void lora_add(const std::vector<LoraGroup>& groups, int64_t layer, checkpoint::peft::Fused which, const at::Tensor& x,
                at::Tensor& out) const;
  at::Tensor split_qkv_rows(const at::Tensor& full) const;
  void norm_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& out) const;
  // q/k norms and rotary positions of each row's query and key heads, in place in qkv.
  void position_qk(at::Tensor& qkv, const std::vector<int64_t>& pos, const Layer& L) const;
  void attention(const StepPlan& plan, int64_t layer, const at::Tensor& q, KVCache& cache,
                 const std::vector<at::Tensor>& ctx_slots, at::Tensor& out);
  models::GPTConfig cfg_;
  comm::CommunicatorPtr tp_;
  int64_t heads_, kv_heads_, hd_, kv_first_ = 0;
  Activation gelu_ = Activation::kGelu;  // inside the fc kernel
  at::Tensor tok_, pos_, lnf_w_, lnf_b_;  // pos_: learned positions only
  at::Tensor rope_cos_, rope_sin_;        // [seq_len, head_dim / 2]: rotary positions only
  ServingLinear head_;
  std::vector<Layer> layers_;
  std::vector<std::vector<std::array<LoraPair, checkpoint::peft::kFusedCount>>> lora_;  // [adapter - 1][layer][fused]
};

}  // namespace torchspeed::inference
