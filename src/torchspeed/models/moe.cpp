// Mixture-of-Experts MLP: routing (DeepSpeed's top-k gate with capacity, or dropless as the HF
// families), the experts over their tokens; the load-balancing loss attached through nn/aux_loss.h.
#include "torchspeed/models/moe.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>

#include "torchspeed/config/config.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/nn/aux_loss.h"
#include "torchspeed/nn/fused_ops.h"
#include "torchspeed/parallel/expert.h"
#include "torchspeed/base/error.h"

namespace torchspeed::models {

bool MoEConfig::operator==(const MoEConfig& o) const {
  return num_experts == o.num_experts && k == o.k && d_ff == o.d_ff && capacity_factor == o.capacity_factor &&
         eval_capacity_factor == o.eval_capacity_factor && min_capacity == o.min_capacity &&
         drop_tokens == o.drop_tokens && norm_topk_prob == o.norm_topk_prob && aux_loss_coef == o.aux_loss_coef &&
         aux_loss_type == o.aux_loss_type && shared_d_ff == o.shared_d_ff;
}

MoEConfig MoEConfig::from_json(const nlohmann::json& j, const std::string& path, config::Diagnostics& diag) {
  config::JsonReader r(j, path, diag);
  MoEConfig c;
  c.num_experts = r.get_int("num_experts", c.num_experts, 0, 1 << 16);
  c.k = r.get_int("k", c.k, 1, 1 << 16);
  c.d_ff = r.get_int("d_ff", c.d_ff, 0, 1 << 24);
  c.capacity_factor = r.get_double("capacity_factor", c.capacity_factor, 0.0, 1e6);
  c.eval_capacity_factor = r.get_double("eval_capacity_factor", c.eval_capacity_factor, 0.0, 1e6);
  c.min_capacity = r.get_int("min_capacity", c.min_capacity, 0, 1LL << 40);
  c.drop_tokens = r.get_bool("drop_tokens", c.drop_tokens);
  c.norm_topk_prob = r.get_bool("norm_topk_prob", c.k > 1);
  c.aux_loss_coef = r.get_double("aux_loss_coef", c.aux_loss_coef, 0.0, 1e6);
  c.aux_loss_type = r.get_string("aux_loss_type", c.aux_loss_type, {"deepspeed", "transformers"});
  c.shared_d_ff = r.get_int("shared_d_ff", c.shared_d_ff, 0, 1 << 24);
  // DeepSpeed's MoE arguments torchspeed does not compute: accepted at the value that means
  // "off", refused by name otherwise.
  if (r.has("use_rts") && r.get_bool("use_rts", false)) {
    r.error("use_rts", "random token selection is not implemented: tokens past an expert's capacity are dropped in "
                       "position order (set false)");
  }
  if (const nlohmann::json* p = r.raw("noisy_gate_policy"); p && !p->is_null() && !(p->is_string() && *p == "None")) {
    r.error("noisy_gate_policy", "noisy gating (Jitter, RSample) is not implemented (set null)");
  }
  if (r.has("use_residual") && r.get_bool("use_residual", false)) {
    r.error("use_residual", "residual MoE (PR-MoE's dense branch) is not implemented; Qwen2-MoE's gated shared "
                            "expert is shared_d_ff");
  }
  if (r.has("top2_2nd_expert_sampling") && r.get_bool("top2_2nd_expert_sampling", false)) {
    r.error("top2_2nd_expert_sampling", "Gumbel sampling of the second expert is not implemented: it is the second "
                                        "most probable (set false)");
  }
  c.ep_size = r.get_int("ep_size", c.ep_size, 1, 1 << 16);
  r.finish();
  if (c.num_experts > 0 && c.k > c.num_experts) {
    diag.errors.push_back(concat(path, ".k: ", c.k, " experts per token but num_experts is ", c.num_experts));
  }
  if (c.num_experts > 0 && c.num_experts % c.ep_size != 0) {
    diag.errors.push_back(concat(path, ".ep_size: ", c.ep_size, " ranks cannot hold equal parts of ", c.num_experts,
                                 " experts (num_experts must divide by ep_size)"));
  }
  return c;
}

nlohmann::json MoEConfig::to_json() const {
  return {{"num_experts", num_experts},     {"k", k},
          {"d_ff", d_ff},                   {"capacity_factor", capacity_factor},
          {"eval_capacity_factor", eval_capacity_factor}, {"min_capacity", min_capacity},
          {"drop_tokens", drop_tokens},     {"norm_topk_prob", norm_topk_prob},
          {"aux_loss_coef", aux_loss_coef}, {"aux_loss_type", aux_loss_type},
          {"shared_d_ff", shared_d_ff}};
}

int64_t MoEConfig::params(int64_t d) const {
  const int64_t expert = 3 * d_ff * d;
  const int64_t shared = shared_d_ff > 0 ? 3 * shared_d_ff * d + d : 0;
  return num_experts * d + num_experts * expert + shared;
}

int64_t MoEConfig::active_params(int64_t d) const {
  const int64_t shared = shared_d_ff > 0 ? 3 * shared_d_ff * d + d : 0;
  return num_experts * d + k * 3 * d_ff * d + shared;
}

// ---- routing ----

// Note [Mixture of experts]
// route(): p = softmax(router logits) in fp32 over the E experts; each token's k most probable
// experts (at::topk's order among equal probabilities) with weights p. With drop_tokens, each
// expert takes at most C = max(ceil(k S / E * capacity_factor), min_capacity) of the S tokens
// (DeepSpeed: top-1 ceil(S / E * cf), top-2 ceil(2 S / E * cf)): first choices in token order,
// then second choices after all first choices (DeepSpeed's top2gating locations; top1gating
// without random token selection; for k > 2 the choices queue by rank likewise, where
// DeepSpeed's topkgating keeps each expert's most probable tokens); a token past C skips that
// expert. With norm_topk_prob the
// kept weights are divided by their sum (DeepSpeed's top-2 and Mixtral; with k 1 the weight is
// 1), else they stay p (DeepSpeed's top-1, Qwen2-MoE's default). The experts then run over
// their own tokens (gathered, SwiGLU, scattered back times the weight, in expert order as
// transformers' loop adds them); Qwen2-MoE's shared expert adds sigmoid(gate x) * MLP(x).
Routing route(const at::Tensor& router_logits, const MoEConfig& c, bool training) {
  const int64_t S = router_logits.size(0), E = router_logits.size(1), k = c.k;
  const at::Tensor probs = router_logits.to(at::kFloat).softmax(-1);
  auto top = probs.topk(k, -1);
  Routing r;
  at::Tensor values = std::get<0>(top);
  r.experts = std::get<1>(top);
  at::Tensor keep;
  if (c.drop_tokens) {
    const double cf = training ? c.capacity_factor : c.eval_capacity_factor;
    const int64_t cap = std::max<int64_t>(
        static_cast<int64_t>(std::ceil(static_cast<double>(k * S) / static_cast<double>(E) * cf)), c.min_capacity);
    std::vector<at::Tensor> kept;
    at::Tensor before = at::zeros({E}, at::kLong);  // tokens of earlier choices at each expert
    for (int64_t j = 0; j < k; ++j) {
      const at::Tensor mask = at::one_hot(r.experts.select(1, j), E);  // [S, E] int64
      const at::Tensor location = ((mask.cumsum(0) - 1 + before) * mask).sum(1);
      kept.push_back(location < cap);
      before = before + mask.sum(0);
    }
    keep = at::stack(kept, 1);
  }
  at::Tensor w = keep.defined() ? values * keep.to(at::kFloat) : values;
  if (c.norm_topk_prob) {
    w = w / w.sum(-1, /*keepdim=*/true).clamp_min(std::numeric_limits<float>::epsilon());
  }
  r.weights = w;
  if (!training) return r;
  const at::Tensor me = probs.mean(0);
  if (c.aux_loss_type == "transformers") {
    const at::Tensor ce = at::one_hot(r.experts, E).to(at::kFloat).sum(1).mean(0);
    r.aux = (me * ce).sum() * static_cast<double>(E);
  } else if (k <= 2) {
    const at::Tensor ce = at::one_hot(r.experts.select(1, 0), E).to(at::kFloat).mean(0);
    r.aux = (me * ce).sum() * static_cast<double>(E);
  } else {
    const at::Tensor ce = at::one_hot(r.experts, E).to(at::kFloat).sum(1).mean(0);
    r.aux = (me * ce).sum() * static_cast<double>(E) / static_cast<double>(k);
  }
  return r;
}

ExpertGroups group_by_expert(const at::Tensor& experts, int64_t num_experts) {
  const at::Tensor choice = experts.reshape({-1});
  const int64_t n = choice.numel();
  ExpertGroups g;
  g.order = at::argsort(choice * n + at::arange(n, choice.options()));  // by expert, then by route
  const at::Tensor counts = at::bincount(choice, /*weights=*/{}, num_experts).contiguous();
  g.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + num_experts);
  return g;
}

// ---- the layer ----

MoEImpl::MoEImpl(const MoEConfig& c, int64_t d_, double residual_std, int64_t n_layer)
    : cfg(c), d(d_), aux_weight(c.aux_loss_type == "transformers" ? c.aux_loss_coef / static_cast<double>(n_layer)
                                                                   : c.aux_loss_coef) {
  TS_CHECK(c.enabled() && c.d_ff > 0, "MoE layer needs num_experts and d_ff");
  const int64_t E = c.num_experts, f = c.d_ff;
  router = register_parameter("router", at::empty({E, d}).normal_(0.0, 0.02));
  gate_up = register_parameter("gate_up", at::empty({E, 2 * f, d}).normal_(0.0, 0.02));
  down = register_parameter("down", at::empty({E, d, f}).normal_(0.0, residual_std));
  if (c.shared_d_ff > 0) {
    const int64_t fs = c.shared_d_ff;
    shared_fc = register_parameter("shared_fc", at::empty({2 * fs, d}).normal_(0.0, 0.02));
    shared_proj = register_parameter("shared_proj", at::empty({d, fs}).normal_(0.0, residual_std));
    shared_gate = register_parameter("shared_gate", at::empty({1, d}).normal_(0.0, 0.02));
  }
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const auto shape = x.sizes().vec();
  const at::Tensor xf = x.reshape({-1, d});
  const bool training = is_training();
  const bool grads = training && c10::GradMode::is_enabled();
  const Routing r = route(at::linear(xf.to(at::kFloat), router.to(at::kFloat)), cfg, training);
  at::Tensor out = ep ? experts_across(xf, r) : experts_here(xf, r, grads);
  if (shared_fc.defined()) {
    const at::Tensor s = at::linear(nn::swiglu(at::linear(xf, shared_fc)), shared_proj);
    out = out + at::sigmoid(at::linear(xf, shared_gate)) * s;
  }
  if (grads && aux_weight > 0) out = nn::AuxLoss::attach(out, r.aux * aux_weight);
  return out.view(shape);
}

// Rows of x grouped by expert: counts[e] consecutive rows for local expert e, each group through
// its expert. The experts are taken by one unbind, so backward writes each expert's gradient into
// one stacked tensor (indexing gate_up[e] per expert made E zero-filled full-size gradients).
// Undefined when no expert has rows.
at::Tensor MoEImpl::run_experts(const at::Tensor& x, const std::vector<int64_t>& counts) const {
  const std::vector<at::Tensor> gu = gate_up.unbind(0), dn = down.unbind(0);
  std::vector<at::Tensor> ys;
  int64_t first = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    ys.push_back(at::linear(nn::swiglu(at::linear(x.narrow(0, first, counts[e]), gu[e])), dn[e]));
    first += counts[e];
  }
  return ys.empty() ? at::Tensor() : at::cat(ys);
}

namespace {
// The kept routes (weight not 0) in expert order, and how many each expert has.
struct KeptRoutes {
  at::Tensor rows;  // route ids s * k + j
  at::Tensor counts;  // [E] int64
};
KeptRoutes kept_routes(const Routing& r, int64_t E) {
  const at::Tensor live = (r.weights.reshape({-1}) != 0);  // dropped routes: weight 0
  const ExpertGroups groups = group_by_expert(r.experts, E);
  KeptRoutes k;
  k.rows = groups.order.masked_select(live.index_select(0, groups.order));
  k.counts = at::bincount(r.experts.reshape({-1}).index_select(0, k.rows), /*weights=*/{}, E).contiguous();
  return k;
}
std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}
}  // namespace

at::Tensor MoEImpl::experts_here(const at::Tensor& xf, const Routing& r, bool grads) {
  const KeptRoutes kept = kept_routes(r, cfg.num_experts);
  const at::Tensor tokens = at::floor_divide(kept.rows, cfg.k);
  const at::Tensor y = run_experts(xf.index_select(0, tokens), to_vector(kept.counts));
  // Every token dropped (a capacity of 0): a zero term keeps the experts' gradients defined, as
  // ZeRO's hooks expect one per parameter each backward. (An expert no token reached gets the
  // zero rows of its slice of gate_up and down, which are one parameter each.)
  if (!y.defined()) {
    const at::Tensor out = at::zeros_like(xf);
    return grads ? out + ((router.sum() + gate_up.sum() + down.sum()) * 0).to(out.scalar_type()) : out;
  }
  // Added to each token in expert order, as transformers' loop adds them.
  const at::Tensor w = r.weights.reshape({-1}).index_select(0, kept.rows).to(xf.scalar_type()).unsqueeze(1);
  return at::zeros_like(xf).index_add(0, tokens, y * w);
}

// Note [Expert parallelism]
// With ep_size P the E experts spread over the P ranks of an expert-parallel group, L = E / P
// consecutive ones each (DeepSpeed-MoE). Every rank routes its own tokens (capacity from its own
// token count, as without experts parallelism), then the kept routes travel to their experts:
//   1. the routes sorted by expert (so by destination rank), each carrying its token's row;
//      per-expert counts exchanged first (an all-to-all of P x L integers), so every rank knows
//      how many rows each source sends each of its experts;
//   2. dispatch: all-to-all of the rows (variable counts, parallel::all_to_all);
//   3. each local expert runs over the rows it received from every source at once;
//   4. combine: the outputs travel back by the reverse all-to-all, in the order they left, and
//      are added to their tokens times the routing weights, as without parallelism.
// Both exchanges are differentiable (the gradient goes back by the reverse exchange), and every
// rank runs both in every forward and backward, with zero rows where it has none, so the
// collectives stay in step. The shared expert and the router are ordinary replicated
// parameters; the experts' gradients are summed over the expert-data-parallel group by ZeRO.
at::Tensor MoEImpl::experts_across(const at::Tensor& xf, const Routing& r) {
  const int64_t E = cfg.num_experts, P = ep->size(), L = E / P;
  const KeptRoutes kept = kept_routes(r, E);
  // 1. How many rows each source sends each local expert: [P sources, L].
  std::vector<int64_t> per_rank(static_cast<size_t>(P), L);
  at::Tensor recv_counts = at::empty({P * L}, at::kLong);
  ep->all_to_all(kept.counts, per_rank, recv_counts, per_rank);
  const std::vector<int64_t> send = to_vector(kept.counts.view({P, L}).sum(1));
  const std::vector<int64_t> recv = to_vector(recv_counts.view({P, L}).sum(1));
  // 2. Dispatch.
  const at::Tensor tokens = at::floor_divide(kept.rows, cfg.k);
  const at::Tensor got = parallel::all_to_all(xf.index_select(0, tokens), ep, send, recv);  // [M, d]
  // 3. The received rows grouped by local expert (source-major within each), each expert once,
  // then back in arrival order; with no rows, a zero term keeps the chain of exchanges in the graph.
  const int64_t M = got.size(0);
  const at::Tensor expert_of = at::repeat_interleave(at::arange(L, at::kLong).repeat({P}), recv_counts);
  const at::Tensor by_expert = at::argsort(expert_of * std::max<int64_t>(M, 1) + at::arange(M, at::kLong));
  at::Tensor y = run_experts(got.index_select(0, by_expert), to_vector(recv_counts.view({P, L}).sum(0)));
  if (y.defined()) {
    y = y.index_select(0, at::argsort(by_expert));
  } else {
    y = got * 0;
    if (is_training() && c10::GradMode::is_enabled()) y = y + ((gate_up.sum() + down.sum()) * 0).to(y.scalar_type());
  }
  // 4. Combine.
  const at::Tensor back = parallel::all_to_all(y, ep, recv, send);  // [kept routes, d], in kept.rows' order
  const at::Tensor w = r.weights.reshape({-1}).index_select(0, kept.rows).to(xf.scalar_type()).unsqueeze(1);
  return at::zeros_like(xf).index_add(0, tokens, back * w);
}

void MoEImpl::shard_experts(const comm::CommunicatorPtr& group) {
  TS_CHECK(!ep, "the experts are sharded already");
  if (!group || group->size() == 1) return;
  const int P = group->size();
  TS_CHECK(cfg.num_experts % P == 0, "model.moe.num_experts ", cfg.num_experts, " does not divide by ep_size ", P);
  c10::NoGradGuard guard;
  for (at::Tensor* t : {&gate_up, &down}) {
    t->set_data(parallel::local_experts(*t, group->rank(), P).clone());
    parallel::mark_expert(*t, P);
  }
  ep = group;
}

}  // namespace torchspeed::models
