#include "torchspeed/plan/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "torchspeed/models/gpt.h"
#include "torchspeed/pipeline/partition.h"
#include "torchspeed/base/error.h"

namespace torchspeed::plan {

namespace {
// Reads a positive number at j[key] (required when `fallback` is NaN), naming the path.
double number(const nlohmann::json& j, const std::string& path, const std::string& key,
              double fallback = std::numeric_limits<double>::quiet_NaN()) {
  if (!j.contains(key)) {
    TS_CHECK(!std::isnan(fallback), path, ".", key, " is missing");
    return fallback;
  }
  TS_CHECK(j[key].is_number(), path, ".", key, " must be a number, not ", j[key].dump());
  const double v = j[key].get<double>();
  TS_CHECK(v >= 0 && std::isfinite(v), path, ".", key, " must be a finite number >= 0, not ", v);
  return v;
}
}  // namespace

namespace {
models::GPTConfig as_gpt(const ModelSpec& m) {
  models::GPTConfig g;
  g.vocab = m.vocab, g.seq_len = m.seq, g.d_model = m.hidden, g.n_layer = m.layers, g.n_head = m.heads;
  g.tie_embeddings = m.tied;
  if (m.experts > 0) {
    g.activation = "swiglu";
    g.mlp_bias = false;
    g.moe.num_experts = m.experts;
    g.moe.k = m.top_k;
    g.moe.d_ff = m.ff();
  }
  return g;
}

// A block's parameters on one tensor-parallel rank: the attention's weight matrices and column-
// parallel biases split, the LayerNorms and the row-parallel bias replicated; the dense MLP
// split likewise, or an MoE block's gate and its experts whole on every tensor-parallel rank,
// the experts 1/ep on each expert-parallel rank.
double block_params_tp(const ModelSpec& m, int tp, int ep = 1) {
  const double d = static_cast<double>(m.hidden), t = tp;
  const double attn = 4 * d + (3 * d * d + 3 * d) / t + (d * d) / t + d;
  if (m.experts > 0) return attn + d * static_cast<double>(m.experts) + m.expert_params() / ep;
  return attn + (4 * d * d + 4 * d) / t + (4 * d * d) / t + d;
}
}  // namespace

double ModelSpec::expert_params() const {
  return static_cast<double>(experts) * 3.0 * static_cast<double>(hidden) * static_cast<double>(ff());
}
int64_t ModelSpec::block_params() const { return static_cast<int64_t>(block_params_tp(*this, 1)); }
int64_t ModelSpec::params() const { return as_gpt(*this).num_params(); }
double ModelSpec::flops_per_token() const { return as_gpt(*this).flops_per_token(); }

ModelSpec ModelSpec::from_json(const nlohmann::json& j) {
  TS_CHECK(j.is_object(), "model must be an object");
  ModelSpec m;
  m.layers = static_cast<int64_t>(number(j, "model", "layers"));
  m.hidden = static_cast<int64_t>(number(j, "model", "hidden"));
  m.heads = static_cast<int64_t>(number(j, "model", "heads"));
  m.seq = static_cast<int64_t>(number(j, "model", "seq"));
  m.vocab = static_cast<int64_t>(number(j, "model", "vocab"));
  if (j.contains("tied")) m.tied = j.at("tied").get<bool>();
  m.experts = static_cast<int64_t>(number(j, "model", "experts", 0));
  m.top_k = static_cast<int64_t>(number(j, "model", "top_k", 2));
  m.expert_ff = static_cast<int64_t>(number(j, "model", "expert_ff", 0));
  TS_CHECK(m.experts == 0 || (m.top_k >= 1 && m.top_k <= m.experts), "model.top_k ", m.top_k, " must be 1..experts (", m.experts, ")");
  TS_CHECK(m.layers > 0 && m.hidden > 0 && m.heads > 0 && m.seq > 0 && m.vocab > 0, "model: layers, hidden, heads, seq and vocab must be > 0");
  TS_CHECK(m.hidden % m.heads == 0, "model.hidden ", m.hidden, " is not a multiple of model.heads ", m.heads);
  return m;
}

nlohmann::json ModelSpec::to_json() const {
  nlohmann::json j = {{"layers", layers}, {"hidden", hidden}, {"heads", heads}, {"seq", seq}, {"vocab", vocab}, {"tied", tied}, {"params", params()}};
  if (experts > 0) j.update({{"experts", experts}, {"top_k", top_k}, {"expert_ff", ff()}});
  return j;
}

ClusterSpec ClusterSpec::from_json(const nlohmann::json& j) {
  TS_CHECK(j.is_object(), "cluster must be an object");
  ClusterSpec c;
  c.nodes = static_cast<int>(number(j, "cluster", "nodes", 1));
  c.devices_per_node = static_cast<int>(number(j, "cluster", "devices_per_node", 1));
  TS_CHECK(c.nodes >= 1 && c.devices_per_node >= 1, "cluster.nodes and cluster.devices_per_node must be >= 1");
  c.memory = number(j, "cluster", "memory");
  c.peak_flops = number(j, "cluster", "peak_flops", 0);
  c.efficiency = number(j, "cluster", "efficiency", 0.5);
  c.memory_bandwidth = number(j, "cluster", "memory_bandwidth", 0);
  c.optimizer_rate = number(j, "cluster", "optimizer_rate", 0);
  c.nvme_bandwidth = number(j, "cluster", "nvme_bandwidth", 0);
  c.overlap = number(j, "cluster", "overlap", 1.0);
  for (const char* k : {"intra", "inter"}) {
    Link& l = std::string(k) == "intra" ? c.intra : c.inter;
    if (!j.contains(k)) {
      TS_CHECK(std::string(k) == "inter" && c.nodes == 1, "cluster.", k, " is missing (an object with bandwidth and latency)");
      continue;
    }
    l.bandwidth = number(j.at(k), std::string("cluster.") + k, "bandwidth");
    l.latency = number(j.at(k), std::string("cluster.") + k, "latency", 0);
    TS_CHECK(l.bandwidth > 0, "cluster.", k, ".bandwidth must be > 0");
  }
  for (const auto& p : j.value("compute", nlohmann::json::array())) {
    ComputePoint cp;
    cp.tokens = p.at("tokens").get<int64_t>();
    cp.hidden = p.at("hidden").get<int64_t>();
    cp.tp = p.value("tp", int64_t{1});
    cp.flops_per_s = p.at("flops_per_s").get<double>();
    cp.forward_share = p.value("forward_share", 1.0 / 3.0);
    cp.with_tp_comm = p.value("with_tp_comm", false);
    cp.dtype = p.value("dtype", std::string());
    c.compute.push_back(cp);
  }
  c.measured_devices = static_cast<int>(number(j, "cluster", "measured_devices", 0));
  c.cores_per_node = static_cast<int>(number(j, "cluster", "cores_per_node", 0));
  c.source = j.value("source", std::string());
  TS_CHECK(c.peak_flops > 0 || !c.compute.empty(), "cluster: give peak_flops (with efficiency) or measured compute points (plan --calibrate)");
  TS_CHECK(c.optimizer_rate > 0, "cluster.optimizer_rate (parameters per second) is missing");
  return c;
}

nlohmann::json ClusterSpec::to_json() const {
  nlohmann::json j = {{"nodes", nodes}, {"devices_per_node", devices_per_node}, {"memory", memory},
                      {"peak_flops", peak_flops}, {"efficiency", efficiency}, {"memory_bandwidth", memory_bandwidth},
                      {"intra", {{"bandwidth", intra.bandwidth}, {"latency", intra.latency}}},
                      {"optimizer_rate", optimizer_rate}, {"nvme_bandwidth", nvme_bandwidth},
                      {"overlap", overlap}, {"measured_devices", measured_devices},
                      {"cores_per_node", cores_per_node}, {"source", source}};
  if (nodes > 1 || inter.bandwidth > 0) j["inter"] = {{"bandwidth", inter.bandwidth}, {"latency", inter.latency}};
  j["compute"] = nlohmann::json::array();
  for (const auto& p : compute)
    j["compute"].push_back({{"tokens", p.tokens}, {"hidden", p.hidden}, {"tp", p.tp}, {"flops_per_s", p.flops_per_s},
                            {"forward_share", p.forward_share}, {"with_tp_comm", p.with_tp_comm},
                            {"dtype", p.dtype}});
  return j;
}

const char* offload_name(Offload o) {
  switch (o) {
    case Offload::kNone: return "none";
    case Offload::kOptimizer: return "optimizer";
    case Offload::kOptimizerAndParams: return "optimizer+params";
  }
  return "?";
}

std::string Layout::describe() const {
  return concat("dp ", dp, " tp ", tp, " pp ", pp, sp > 1 ? concat(" sp ", sp) : "", ep > 1 ? concat(" ep ", ep) : "", " zero ", zero,
                offload == Offload::kNone ? "" : concat(" offload ", offload_name(offload)), " micro ", micro, " x", accumulation,
                checkpointing ? " ckpt" : "");
}

std::vector<Stage> pipeline_stages(const ModelSpec& m, const Layout& l) {
  const double d = static_cast<double>(m.hidden), V = static_cast<double>(m.vocab), t = l.tp;
  const double embed = V * d / t + static_cast<double>(m.seq) * d;  // vocabulary-parallel, positions replicated
  const double block = block_params_tp(m, l.tp, l.ep);
  const double experts = m.experts > 0 ? m.expert_params() / l.ep : 0.0;
  if (l.pp == 1) {
    // One stage: a tied head shares the embedding's weight.
    const double L = static_cast<double>(m.layers);
    return {{embed + L * block + 2 * d + (m.tied ? 0.0 : V * d / t), L * experts, m.layers, true, true}};
  }
  // The engine's default partition_method "parameters": contiguous stages balancing the layers'
  // parameter counts (the last stage keeps its own copy of a tied head).
  std::vector<int64_t> w{static_cast<int64_t>(embed)};
  for (int64_t i = 0; i < m.layers; ++i) w.push_back(static_cast<int64_t>(block));
  w.push_back(static_cast<int64_t>(2 * d + V * d / t));
  const std::vector<size_t> bounds = pipeline::partition_balanced(w, l.pp);
  std::vector<Stage> out;
  for (int s = 0; s < l.pp; ++s) {
    Stage st;
    for (size_t i = bounds[static_cast<size_t>(s)]; i < bounds[static_cast<size_t>(s) + 1]; ++i) {
      st.params += static_cast<double>(w[i]);
      if (i == 0) st.embed = true;
      else if (i == w.size() - 1) st.head = true;
      else ++st.blocks, st.expert_params += experts;
    }
    out.push_back(st);
  }
  return out;
}

double params_per_rank(const ModelSpec& m, const Layout& l) {
  double most = 0;
  for (const auto& s : pipeline_stages(m, l)) most = std::max(most, s.params);
  return most;
}

Memory model_states(double psi, int zero, int dp, bool bf16, Offload offload, int grad_bytes) {
  const double p = bf16 ? 2 : 4, g = grad_bytes, k = bf16 ? 12 : 8;
  Memory mem;
  mem.params = p * psi / (zero >= 3 ? dp : 1);
  mem.grads = g * psi / (zero >= 2 ? dp : 1);
  mem.optimizer = k * psi / (zero >= 1 ? dp : 1);
  if (offload != Offload::kNone) mem.optimizer = 0;
  if (offload == Offload::kOptimizerAndParams) mem.params = 0;
  return mem;
}

namespace {
// A block's rate at n tokens, width d, tp: the measured point of the same width and tp nearest
// in tokens (log scale), else peak x efficiency with a third of the time in forward.
ComputePoint compute_rate(const ClusterSpec& c, int64_t tokens, int64_t hidden, int tp) {
  const ComputePoint* best = nullptr;
  double best_d = 0;
  for (const auto& p : c.compute) {
    if (p.hidden != hidden || p.tp != tp) continue;
    const double dist = std::abs(std::log(static_cast<double>(p.tokens) / static_cast<double>(tokens)));
    if (!best || dist < best_d) best = &p, best_d = dist;
  }
  if (best) {
    TS_CHECK(c.measured_devices == 0 || c.measured_devices == c.world(), "plan: the cluster's compute was measured with ",
             c.measured_devices, " ranks at once, not ", c.world(), ": calibrate again with -n ", c.world());
    return *best;
  }
  TS_CHECK(c.peak_flops > 0, "plan: no measured compute rate for width ", hidden, " at tp ", tp,
           " and no peak_flops: run `torchspeed plan --calibrate` with this model");
  ComputePoint p;
  p.tokens = 0;  // marks "from the peak": the caller adds the elementwise traffic
  p.flops_per_s = c.peak_flops * c.efficiency;
  return p;
}

// Time of a reduce-scatter or all-gather (`all_reduce`: both) of `bytes` over a group of `n`
// ranks spaced `stride` ranks apart (from rank 0; ranks fill nodes in order), hierarchical
// across nodes: within each node, then one exchange per node over its link, which the node's
// other groups use at the same time.
double collective(const ClusterSpec& c, double bytes, int n, int stride, bool all_reduce, double inter_scale = 1.0) {
  if (n <= 1) return 0;
  const int dpn = c.devices_per_node;
  std::vector<int> per_node;
  for (int i = 0; i < n; ++i) {
    const size_t node = static_cast<size_t>(static_cast<int64_t>(i) * stride / dpn);
    if (per_node.size() <= node) per_node.resize(node + 1, 0);
    ++per_node[node];
  }
  int hosts = 0, local = 0;
  for (int r : per_node) {
    if (r > 0) ++hosts;
    local = std::max(local, r);
  }
  const double passes = all_reduce ? 2.0 : 1.0;
  double t = 0;
  if (local > 1) t += passes * (c.intra.latency + (local - 1.0) / local * bytes / c.intra.bandwidth);
  if (hosts > 1) {
    TS_CHECK(c.inter.bandwidth > 0, "plan: the layout crosses nodes but cluster.inter is not given");
    const double sharing = std::max(1.0, static_cast<double>(dpn) / local);  // the node's groups share its link
    t += passes * (c.inter.latency * (hosts - 1) + sharing * (hosts - 1.0) / hosts * bytes * inter_scale / c.inter.bandwidth);
  }
  return t;
}

const Link& inter_link(const ClusterSpec& c) {
  TS_CHECK(c.inter.bandwidth > 0, "plan: the layout crosses nodes but cluster.inter is not given");
  return c.inter;
}
}  // namespace

std::string check_layout(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t, const Layout& l) {
  if (l.dp < 1 || l.tp < 1 || l.pp < 1 || l.micro < 1) return "dp, tp, pp and micro must be >= 1";
  if (l.dp * l.tp * l.pp != c.world())
    return concat("dp x tp x pp = ", l.dp * l.tp * l.pp, " but the cluster has ", c.world(), " devices");
  if (l.zero < 0 || l.zero > 3) return concat("zero must be 0-3, not ", l.zero);
  if (l.tp > c.devices_per_node || c.devices_per_node % l.tp) return concat("tp ", l.tp, " must divide the ", c.devices_per_node, " devices of a node");
  if (m.heads % l.tp || m.vocab % l.tp) return concat("tp ", l.tp, " must divide the heads (", m.heads, ") and the vocabulary (", m.vocab, ")");
  if (l.pp > m.layers) return concat("pp ", l.pp, " exceeds the ", m.layers, " layers");
  if (l.zero >= 2 && l.pp > 1) return "ZeRO stages 2-3 do not combine with a pipeline (as in DeepSpeed)";
  if (l.offload != Offload::kNone && l.zero == 0) return "offload needs ZeRO stage 1-3";
  if (l.offload == Offload::kOptimizerAndParams && l.zero != 3) return "parameter offload needs ZeRO stage 3";
  if (l.zero == 3 && t.hpz_partition_size > 1 && l.dp % t.hpz_partition_size)
    return concat("zero_hpz_partition_size ", t.hpz_partition_size, " must divide dp ", l.dp);
  if (l.sp < 1 || l.ep < 1) return "sp and ep must be >= 1";
  if (l.dp % l.sp) return concat("sp ", l.sp, " must divide dp ", l.dp);
  if (l.sp > 1 && (l.tp > 1 || l.pp > 1)) return "sequence parallelism runs with tp 1 and pp 1";
  if (l.sp > 1 && m.experts > 0) return "sequence parallelism does not take MoE blocks";
  if (m.heads % l.sp || m.seq % l.sp) return concat("sp ", l.sp, " must divide the heads (", m.heads, ") and the sequence (", m.seq, ")");
  if (l.dp % l.ep) return concat("ep ", l.ep, " must divide dp ", l.dp);
  if (l.ep > 1 && (m.experts == 0 || m.experts % l.ep)) return concat("ep ", l.ep, " must divide the experts (", m.experts, ")");
  const int64_t replicas = l.dp / l.sp;
  if (t.global_batch % (replicas * l.micro)) return concat("the batch ", t.global_batch, " is not a multiple of dp / sp x micro");
  if (l.accumulation != t.global_batch / (replicas * l.micro))
    return concat("accumulation must be batch / (dp / sp x micro) = ", t.global_batch / (replicas * l.micro));
  return "";
}

Estimate estimate(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t, const Layout& l) {
  const std::string bad = check_layout(m, c, t, l);
  TS_CHECK(bad.empty(), "plan: layout ", l.describe(), ": ", bad);
  Estimate e;
  e.layout = l;
  const std::vector<Stage> stages = pipeline_stages(m, l);
  const double b = t.bf16 ? 2 : 4, pb = t.bf16 ? 2 : 4, g = t.grad_bytes, k = t.bf16 ? 12 : 8;
  const double d = static_cast<double>(m.hidden), V = static_cast<double>(m.vocab), tp = l.tp;
  const double n = static_cast<double>(l.micro * m.seq) / l.sp;  // tokens of a micro-batch on a rank
  const int64_t mb = l.accumulation;  // micro-batches per step and pipeline

  // Memory (Note [Plan model]): the stage whose rank holds the most.
  const double scores = t.flash_attention ? 0.0 : 5.0 * static_cast<double>(m.heads * m.seq) / tp * (b / 2);
  // The MLP's share of a block's activations: GELU's input and output (8 d / tp), or an MoE
  // block's router logits (fp32) and, per routed copy of a token, its input, the experts'
  // gate-up output and activation, and its output (k (2 d + 3 f)).
  const double mlp_act = m.experts > 0 ? b * static_cast<double>(m.top_k) * (2 * d + 3.0 * static_cast<double>(m.ff())) +
                                              4.0 * static_cast<double>(m.experts)
                                        : b * 8 * d / tp;
  // ALST's tiled MLP keeps none of it past its slice: one slice's set while it is replayed.
  const double mlp_tiles = m.experts == 0 && t.tiled_mlp > 1 ? static_cast<double>(t.tiled_mlp) : 1.0;
  const double block_rest = n * (b * d * (4 + 5 / tp) + 4.0 * static_cast<double>(m.heads) / tp + scores);
  const double block_full = block_rest + n * mlp_act;
  const double block_kept = l.checkpointing ? n * b * d : mlp_tiles > 1 ? block_rest : block_full;
  const double mlp_slice = mlp_tiles > 1 ? n * mlp_act / mlp_tiles : 0.0;
  // The head: its LayerNorm output, the fp32 log-softmax kept for the loss's backward, and in
  // that backward the log-softmax's gradient and the logits' gradient; the tiled loss holds the
  // vocabulary-wide ones for one slice at a time.
  const double loss_tiles = t.tiled_loss > 1 ? static_cast<double>(t.tiled_loss) : 1.0;
  const double head = n * b * d + n / loss_tiles * 3 * (V / tp) * 4;
  const double layer = block_params_tp(m, l.tp, l.ep);
  double psi = 0;  // the most parameters on a stage (its data-parallel collectives)
  for (size_t si = 0; si < stages.size(); ++si) {
    const Stage& st = stages[si];
    psi = std::max(psi, st.params);
    // Dense parameters partition over dp, experts over the expert-data-parallel dp / ep.
    Memory mem = model_states(st.params - st.expert_params, l.zero, l.dp, t.bf16, l.offload, t.grad_bytes);
    if (st.expert_params > 0) {
      const Memory ex = model_states(st.expert_params, l.zero, l.dp / l.ep, t.bf16, l.offload, t.grad_bytes);
      mem.params += ex.params, mem.grads += ex.grads, mem.optimizer += ex.optimizer;
    }
    // hpZ: the secondary partition, 1/h of every gathered layer (Note [Hierarchical partitioning]).
    if (l.zero == 3 && t.hpz_partition_size > 1) mem.params += pb * st.params / t.hpz_partition_size;
    // 1F1B: stage s holds min(pp - s, m) micro-batches' activations.
    const double in_flight = std::min<double>(static_cast<double>(l.pp - static_cast<int>(si)), static_cast<double>(mb));
    mem.activations = in_flight * static_cast<double>(st.blocks) * block_kept + (st.head ? head : 0.0) +
                      (l.checkpointing && st.blocks > 0 ? (mlp_tiles > 1 ? block_rest : block_full) : 0.0) +
                      (st.blocks > 0 ? mlp_slice : 0.0);
    const double bucket = std::min(static_cast<double>(t.reduce_bucket_size), st.params);
    // Stages 0-2 accumulate gradients straight into their flat buffers; stage 3 gathers a layer's
    // gradient whole before its reduce-scatter.
    switch (l.zero) {
      case 0: break;
      case 1: mem.buffers = bucket * g / l.dp; break;
      case 2: mem.buffers = (t.overlap_comm.value_or(false) ? 2 : 1) * bucket * g + bucket * g / l.dp; break;
      default:
        mem.buffers = std::min(static_cast<double>(t.prefetch_bucket_size) + layer, st.params) * pb + layer * g + layer * g / l.dp;
    }
    if (l.offload != Offload::kNone)
      mem.buffers += std::min(static_cast<double>(t.offload_buffer_count * t.offload_buffer_size) * 4, k * st.params / l.dp);
    if (mem.total() > e.memory.total()) e.memory = mem;
  }
  e.fits = e.memory.total() <= c.memory;

  // Step time: the slowest stage sets the pace.
  const ComputePoint rate = compute_rate(c, l.micro * m.seq, m.hidden, l.tp);
  TS_CHECK(rate.tokens == 0 || rate.dtype.empty() || rate.dtype == (t.bf16 ? "bf16" : "fp32"), "plan: the cluster's compute was measured in ",
           rate.dtype, ", the plan is for ", t.bf16 ? "bf16" : "fp32", ": calibrate with", t.bf16 ? " --bf16" : "out --bf16");
  // An MoE block computes its gate and k experts per token.
  const double active_block = m.experts > 0 ? static_cast<double>(m.block_params()) - m.expert_params() +
                                                  m.expert_params() * static_cast<double>(m.top_k) / static_cast<double>(m.experts)
                                            : static_cast<double>(m.block_params());
  const double block_flops = n * (6.0 * active_block / tp + 12.0 * d * static_cast<double>(m.seq) / tp);
  const double head_flops = n * 6.0 * d * V / tp;
  // A checkpointed block runs its forward again in backward.
  const double replayed = l.checkpointing ? 1.0 + rate.forward_share : 1.0;
  double t_block = block_flops * replayed / rate.flops_per_s;
  if (rate.tokens == 0 && c.memory_bandwidth > 0) {
    const double act = (b / 2) * (10 * d + 24 * d / tp + (t.flash_attention ? 0.0 : 5.0 * static_cast<double>(m.heads * m.seq) / tp));
    t_block += n * act * (l.checkpointing ? 4 : 3) / c.memory_bandwidth;
  }
  double t_stage = 0, blocks = 0;
  for (const Stage& st : stages) {
    const double ts = static_cast<double>(st.blocks) * t_block + (st.head ? head_flops / rate.flops_per_s : 0.0);
    if (ts > t_stage) t_stage = ts, blocks = static_cast<double>(st.blocks);
  }
  const double act_bytes = n * d * b;
  const Link& tpl = c.intra;  // tp stays within a node (check_layout)
  // Four all-reduces per block (six when replayed; none more when the measured block included
  // them), two for the vocabulary-parallel embedding and loss.
  const double per_block = rate.with_tp_comm ? 0.0 : l.checkpointing ? 6 : 4;
  const double t_tp = l.tp > 1 ? (blocks * per_block + 2) * (tpl.latency + 2.0 * (tp - 1) / tp * act_bytes / tpl.bandwidth) : 0.0;
  // Stages are dp x tp ranks apart: on several nodes, some boundary crosses a node's link.
  const Link& ppl = c.nodes > 1 && l.dp * l.tp * l.pp > c.devices_per_node ? inter_link(c) : c.intra;
  const double t_pp = l.pp > 1 ? 2 * (ppl.latency + act_bytes / ppl.bandwidth) : 0.0;
  // All-to-all (within a node): Ulysses sends (sp - 1) / sp of each local token's q, k, v (3 d)
  // and attention output (d) in forward, their gradients in backward, again when replayed; the
  // experts' dispatch and combine send (ep - 1) / ep of each token's k routed copies (d each)
  // twice in forward and twice in backward.
  const double replays = l.checkpointing ? 3.0 : 2.0;
  double a2a = 0;
  int exchanges = 0;
  if (l.sp > 1) {
    a2a += blocks * replays * n * 4 * d * b * (l.sp - 1.0) / l.sp;
    exchanges += static_cast<int>(blocks * replays * 2);
  }
  if (l.ep > 1) {
    a2a += blocks * (replays + 1) * n * static_cast<double>(m.top_k) * d * b * (l.ep - 1.0) / l.ep;
    exchanges += static_cast<int>(blocks * (replays + 1) * 2);
  }
  e.a2a_bytes = static_cast<double>(mb) * a2a;
  e.time.a2a_comm = a2a > 0 ? static_cast<double>(mb) * (exchanges * c.intra.latency + a2a / c.intra.bandwidth) : 0.0;
  e.time.compute = static_cast<double>(mb) * t_stage;
  e.time.tp_comm = static_cast<double>(mb) * t_tp;
  e.time.pp_comm = static_cast<double>(mb) * t_pp;
  e.time.bubble = (l.pp - 1) * (t_stage + t_tp + t_pp);
  if (c.cores_per_node > 0 && c.cores_per_node < c.devices_per_node && l.pp > 1) {
    // While the pipeline fills and drains, on average 1 / pp of the node's ranks wait.
    const double dpn = c.devices_per_node, cores = c.cores_per_node;
    const double active = dpn * (1.0 - 1.0 / l.pp);
    e.time.bubble *= (cores / dpn) / std::min(1.0, cores / active);
  }
  const int stride = l.tp;
  double grad_comm = 0, param_comm = 0;
  // ZeRO++: qgZ's bytes across nodes per fp32 byte (4-bit blocks of 128 with an fp32 scale);
  // qwZ's int8 blocks of 2048 with an fp32 scale per parameter; hpZ's group.
  const double qg = l.zero >= 2 && t.quantized_gradients ? (0.5 + 4.0 / 128) / g : 1.0;
  const bool qw = l.zero == 3 && t.quantized_weights;
  const int hpz = l.zero == 3 && t.hpz_partition_size > 1 ? t.hpz_partition_size : 1;
  const double gather_bytes = qw ? psi * (1.0 + 4.0 / 2048) : psi * pb;
  switch (l.zero) {
    case 0: grad_comm = collective(c, psi * g, l.dp, stride, true); break;
    case 1:
      grad_comm = collective(c, psi * g, l.dp, stride, false);
      param_comm = collective(c, psi * pb, l.dp, stride, false);
      break;
    case 2:
      grad_comm = static_cast<double>(mb) * collective(c, psi * g, l.dp, stride, false, qg);
      param_comm = collective(c, psi * pb, l.dp, stride, false);
      break;
    default:
      grad_comm = static_cast<double>(mb) * collective(c, psi * g, l.dp, stride, false, qg);
      // Each micro-batch gathers every layer for forward and again for backward; with hpZ only
      // the step's first gather spans the data-parallel group.
      param_comm = hpz > 1 ? collective(c, gather_bytes, l.dp, stride, false) +
                                 (2.0 * static_cast<double>(mb) - 1) * collective(c, gather_bytes, hpz, stride, false)
                           : static_cast<double>(mb) * 2 * collective(c, gather_bytes, l.dp, stride, false);
  }
  // Stages 0-1 reduce once, during the last micro-batch's backward; stages 2-3 during each.
  const double backward = e.time.compute * 2.0 / 3.0 / (l.zero <= 1 ? static_cast<double>(mb) : 1.0);
  const double hidden = t.overlap_comm.value_or(l.zero == 3) ? std::min(c.overlap * grad_comm, backward) : 0.0;
  e.time.dp_comm = grad_comm - hidden + param_comm;
  const double update = psi / (l.zero >= 1 ? l.dp : 1);  // (experts: psi / ep over dp / ep, the same)
  e.time.optimizer = update / c.optimizer_rate;
  if (l.offload != Offload::kNone) {
    TS_CHECK(c.nvme_bandwidth > 0, "plan: offload needs cluster.nvme_bandwidth");
    const double per_rank_bw = c.nvme_bandwidth / c.devices_per_node;
    double bytes = 2 * k * update;  // states read and written back
    if (l.offload == Offload::kOptimizerAndParams) bytes += (2.0 * static_cast<double>(mb) + 1) * pb * psi / l.dp;
    e.time.offload = bytes / per_rank_bw;
  }
  const double tokens = static_cast<double>(t.global_batch * m.seq);
  e.flops_per_device = m.flops_per_token() * tokens / e.time.total() / c.world();
  return e;
}

std::vector<Estimate> search(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t) {
  std::vector<Estimate> out;
  const int world = c.world();
  for (int tp = 1; tp <= c.devices_per_node; ++tp)
    for (int pp = 1; pp <= m.layers && tp * pp <= world; ++pp) {
      if (world % (tp * pp)) continue;
      const int dp = world / (tp * pp);
      if (t.global_batch % dp) continue;
      const int64_t per_dp = t.global_batch / dp;
      for (int zero = 0; zero <= 3; ++zero)
        for (Offload off : {Offload::kNone, Offload::kOptimizer, Offload::kOptimizerAndParams}) {
          if (off != Offload::kNone && c.nvme_bandwidth <= 0) continue;
          for (int64_t micro = 1; micro <= per_dp; ++micro) {
            if (per_dp % micro) continue;
            for (bool ckpt : {false, true})
            for (int sp = 1; sp <= dp; ++sp)
            for (int ep = 1; ep <= dp; ++ep) {
              if (dp % sp || dp % ep || (sp > 1 && (tp > 1 || pp > 1 || m.experts > 0)) || (ep > 1 && m.experts % ep)) continue;
              const int64_t per_replica = t.global_batch / (dp / sp);
              if (t.global_batch % (dp / sp) || per_replica % micro) continue;
              Layout l{dp, tp, pp, zero, off, micro, per_replica / micro, ckpt};
              l.sp = sp, l.ep = ep;
              if (!check_layout(m, c, t, l).empty()) continue;
              try {
                out.push_back(estimate(m, c, t, l));
              } catch (const Error& err) {  // e.g. no measured rate for this slice: listed, not ranked
                Estimate e;
                e.layout = l;
                e.why_not = err.what();
                e.time.compute = std::numeric_limits<double>::infinity();
                out.push_back(e);
              }
            }
          }
        }
    }
  std::stable_sort(out.begin(), out.end(), [](const Estimate& a, const Estimate& b) {
    if (a.fits != b.fits) return a.fits;
    return a.time.total() < b.time.total();
  });
  return out;
}

nlohmann::json to_json(const Estimate& e) {
  const Layout& l = e.layout;
  return {{"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"sp", l.sp}, {"ep", l.ep}, {"zero", l.zero}, {"offload", offload_name(l.offload)},
          {"micro", l.micro}, {"accumulation", l.accumulation}, {"checkpointing", l.checkpointing},
          {"fits", e.fits},
          {"memory", {{"params", e.memory.params}, {"grads", e.memory.grads}, {"optimizer", e.memory.optimizer},
                      {"activations", e.memory.activations}, {"buffers", e.memory.buffers}, {"total", e.memory.total()}}},
          {"time", {{"compute", e.time.compute}, {"bubble", e.time.bubble}, {"tp_comm", e.time.tp_comm}, {"pp_comm", e.time.pp_comm},
                    {"dp_comm", e.time.dp_comm}, {"optimizer", e.time.optimizer}, {"offload", e.time.offload},
                    {"a2a_comm", e.time.a2a_comm},
                    {"total", e.time.total()}}},
          {"flops_per_device", e.flops_per_device}, {"a2a_bytes", e.a2a_bytes}, {"why_not", e.why_not}};
}

}  // namespace torchspeed::plan
