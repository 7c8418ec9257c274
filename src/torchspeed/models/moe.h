// Mixture-of-Experts MLP (Note [Mixture of experts]): a router picks k of E SwiGLU experts for
// each token, as DeepSpeed-MoE's top-k gate (capacity factor, token dropping in position order,
// the load-balancing auxiliary loss) and as Mixtral / Qwen2-MoE / Qwen3-MoE route (dropless,
// optional renormalisation of the k weights, Qwen2-MoE's gated shared expert).
#pragma once

#include <torch/nn/module.h>

#include "torchspeed/comm/communicator.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace torchspeed::config {
struct Diagnostics;
}

namespace torchspeed::models {

// The model section's "moe" object. Names follow DeepSpeed's deepspeed.moe.layer.MoE arguments
// where it has them (num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
// drop_tokens) and Hugging Face's configs otherwise.
struct MoEConfig {
  int64_t num_experts = 0;  // 0: a dense MLP
  int64_t k = 2;            // experts per token (DeepSpeed's k; HF's num_experts_per_tok)
  int64_t d_ff = 0;         // each expert's width (HF's moe_intermediate_size; 0: the model's d_ff)
  // Tokens each expert takes in training: ceil(k * tokens / num_experts * capacity_factor), at
  // least min_capacity; a token past its expert's capacity skips it (its residual carries it).
  double capacity_factor = 1.0;
  double eval_capacity_factor = 1.0;
  int64_t min_capacity = 4;
  bool drop_tokens = true;      // false: dropless (every expert takes all its tokens; HF's models)
  // The kept routing weights rescaled to sum to 1 (JSON default: k > 1, as DeepSpeed's top-2 and
  // top-k gates; its top-1 keeps the probability. Mixtral: always; Qwen-MoE: their config's).
  bool norm_topk_prob = true;
  double aux_loss_coef = 0.01;  // the load-balancing loss's weight in the training loss
  // "deepspeed": per layer (Note [Load-balancing loss]), summed over the layers; "transformers":
  // load_balancing_loss_func's form (all k choices counted), per layer, averaged over the layers.
  std::string aux_loss_type = "deepspeed";
  int64_t shared_d_ff = 0;      // Qwen2-MoE's shared expert (0: none), gated by sigmoid(w x)
  // Expert parallelism (DeepSpeed's ep_size): the experts spread over this many data-parallel
  // ranks, tokens sent to their experts' rank and back (Note [Expert parallelism]). How a run
  // lays the model out, not what the model is: to_json and == leave it out.
  int64_t ep_size = 1;
  bool enabled() const { return num_experts > 0; }
  bool operator==(const MoEConfig& o) const;
  // From the model section's "moe" object at `path`; errors go to `diag` naming path.key.
  static MoEConfig from_json(const nlohmann::json& j, const std::string& path, config::Diagnostics& diag);
  nlohmann::json to_json() const;
  // Parameters of one MoE MLP of model width d, and those one token uses (k experts).
  int64_t params(int64_t d) const;
  int64_t active_params(int64_t d) const;
};

// Note [Load-balancing loss]
// Each MoE layer's auxiliary loss l = E * sum_e me_e * ce_e (me: the mean router probability of
// expert e over the layer's tokens; ce: the fraction of tokens whose first choice is e), as
// DeepSpeed's top1gating/top2gating compute it (k > 2: ce counts all k choices and l is divided
// by k, as its topkgating); the training loss is the language-model loss plus aux_loss_coef *
// the sum of the layers' l. With aux_loss_type "transformers" (the HF families' configs), ce
// counts all k choices undivided and the layers' l are averaged, the scale router_aux_loss_coef
// was chosen for (transformers' load_balancing_loss_func pools the tokens of all layers before
// the product, which a layer cannot compute alone; the two agree when the layers route alike).
// Each layer attaches its weighted l to its output in training (nn/aux_loss.h), which gives it
// its gradient in backward. Evaluation losses are the language model's alone.

// The routing of S tokens (exposed for tests): for each token its k experts [S, k] (int64),
// weights [S, k] (fp32; 0 where the token was dropped) and, in training, the layer's auxiliary
// loss l (undefined otherwise).
struct Routing {
  at::Tensor experts, weights, aux;
};
Routing route(const at::Tensor& router_logits, const MoEConfig& c, bool training);

class MoEImpl : public torch::nn::Module {
 public:
  // d: the model width; residual_std: the output projections' initial std; n_layer: the MoE
  // layers the "transformers" auxiliary loss is averaged over.
  MoEImpl(const MoEConfig& c, int64_t d, double residual_std, int64_t n_layer = 1);
  // x [..., d] -> [..., d].
  at::Tensor forward(const at::Tensor& x);
  // Keeps this rank's experts of the expert-parallel group `ep` (gate_up and down become its
  // [num_experts / ep size, ...] block, marked as expert parameters); tokens go to their
  // experts' ranks from now on. Every rank of `ep` calls it, and then runs forward and backward
  // in step with the others (all-to-all exchanges).
  void shard_experts(const comm::CommunicatorPtr& ep);
  MoEConfig cfg;
  int64_t d;
  double aux_weight;  // the layer's l enters the loss times this
  // router [E, d]; gate_up [E, 2 f, d] (rows [gate; up], as our fused fc); down [E, d, f];
  // the shared expert's fc [2 fs, d], proj [d, fs] and gate [1, d].
  at::Tensor router, gate_up, down, shared_fc, shared_proj, shared_gate;
  comm::CommunicatorPtr ep;  // null: every expert here

 private:
  // y = sum over kept routes of weight * expert(x): this rank's experts here, or (ep) each
  // route's expert on its rank.
  at::Tensor experts_here(const at::Tensor& xf, const Routing& r, bool grads);
  at::Tensor experts_across(const at::Tensor& xf, const Routing& r);
  at::Tensor run_experts(const at::Tensor& x, const std::vector<int64_t>& counts) const;
};
TORCH_MODULE(MoE);


// The S * k routes (row s * k + j: token s's j-th choice) grouped by expert: `order` lists them
// expert by expert, in token order within each; counts[e] of them go to expert e. Training and
// serving run each expert over its group.
struct ExpertGroups {
  at::Tensor order;
  std::vector<int64_t> counts;
};
ExpertGroups group_by_expert(const at::Tensor& experts, int64_t num_experts);

}  // namespace torchspeed::models
