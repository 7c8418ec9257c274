// `torchspeed plan`'s model: per-rank memory and step time of GPT training for a layout
// (dp x tp x pp, ZeRO stage, offload, micro-batch, activation checkpointing) on a cluster, and
// the search over every feasible layout. Plain arithmetic: no tensors, no communication.
//
// Note [Plan model]
// Memory, bytes per rank, at the peak of a training step (the rank that holds the most):
//  - model states, the ZeRO paper's formulas over this rank's parameters Psi_r (its pipeline
//    stage as partition_method "parameters" balances them, its tensor-parallel slice; each stage
//    is counted and the largest total taken): parameters p bytes, gradients g, optimizer states K
//    (fp32 training: p = g = 4, K = 8 for Adam's two moments; bf16: p = 2, gradients in the
//    fp32 accumulation dtype g = 4, K = 12 with the fp32 master). Stage 1 divides K by dp,
//    stage 2 K and g, stage 3 all three. Optimizer offload to NVMe moves K (and at stage 3 with
//    parameter offload, p) out of memory, leaving the swapper's buffers;
//  - activations, counted from what our GPT block saves for backward, per token of a micro-batch
//    (n tokens, width d, b bytes of the compute dtype): the block's input, the two LayerNorm
//    outputs and the residual sum (4 d, replicated under tensor parallelism), and q, k, v, the
//    attention output and its transposed copy, the MLP's input to GELU and GELU's output
//    (3 + 1 + 1 + 4 + 4 = 13 d, divided by tp): 17 d per token for a dense block (without
//    flash attention, the scores, their softmax and dropout mask add 5 a T / tp bytes in 16-bit,
//    Korthikanti et al.). With
//    checkpointing only the block's input (d) stays, plus one block's full set while it is
//    replayed. The head keeps its LayerNorm output (d) and the fp32 log-softmax (V / tp), and
//    its backward adds the log-softmax's and the logits' gradients (2 V / tp). 1F1B keeps
//    min(pp - s, m) micro-batches on stage s;
//  - buffers: the gradient bucket being reduced (reduce_bucket_size elements, or the rank's
//    parameters if fewer) at stage 2, its reduce-scatter output at stages 1-2 (stages 0-2
//    accumulate into their flat gradient buffers), and at stage 3 the gathered parameters (the
//    prefetch bucket plus the running layer, at most all of them) and one layer's gradient
//    before its reduce-scatter.
// Sequence parallelism (Layout::sp, Ulysses) divides a rank's tokens n by sp: every activation
// above is per local token (attention's q, k, v and output cover the whole sequence for 1/sp
// of the heads: the same bytes). ALST's tiled MLP keeps none of the MLP's 8 d / tp past its
// slice (one slice's set while replayed), the tiled loss the vocabulary-wide 3 V / tp for one
// slice at a time. An MoE block (ModelSpec::experts) keeps its router's fp32 logits and, per
// routed copy of a token, k (2 d + 3 f) (dispatched input, gate-up output, activation, output)
// instead of the MLP's; its experts are 1/ep per rank and partitioned over dp / ep.
// All-to-all bytes a rank sends per block and micro-batch: sp's (sp - 1) / sp x 4 d per local
// token in forward, backward (and the replay); ep's (ep - 1) / ep x k d per token, dispatch and
// combine, forward and backward; timed on the node's link with a latency per exchange.
// Step time, seconds: compute of the slowest pipeline stage, (m + pp - 1) micro-batches with
// the bubble, at the rate measured for this block shape (`--calibrate`) or else the GEMMs at the
// device's peak times its efficiency plus the block's elementwise traffic (Korthikanti et al.'s
// activation bytes, 10 d + 24 d / tp (+ 5 a T / tp without flash attention) per token in 16-bit,
// written in forward, read and their gradients written in backward, written again when
// replayed) at its memory bandwidth (on a CPU node with more ranks than cores, the bubble is shortened: the
// ranks still computing get the idle ranks' cores); tensor-parallel all-reduces (4 per block per micro-batch, 6 with
// checkpointing); pipeline sends (2 per micro-batch); data-parallel collectives, each on the
// slowest link its group crosses, hierarchical across hosts (the link carries (h-1)/h of the
// bytes of a reduce-scatter or all-gather, twice that for an all-reduce), the gradient
// reduction hidden behind backward by the cluster's overlap fraction; the optimizer update of
// this rank's partition; and with offload, the optimizer states' (and parameters') NVMe traffic.
// ZeRO++ (TrainingSpec, from the config's zero_optimization): qgZ scales the gradients' bytes
// across nodes by (1/2 + 4/128) / 4 of fp32 (4-bit blocks of 128 with a scale); qwZ sends every
// stage-3 gather as int8 blocks of 2048 with a scale; hpZ h runs every gather but a step's first
// within h consecutive data-parallel ranks and adds their secondary partition, p Psi_r / h, to
// memory. Quantizing and decoding are not timed: on 2 hosts benchmarks/plan_check.sh found the
// predicted step 0.81x of the measured one for ZeRO-3 with all three, 1.14x for plain ZeRO-3.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torchspeed::plan {

// A GPT as models::GPTConfig builds it (learned positions, tied head by default).
struct ModelSpec {
  int64_t layers = 12, hidden = 768, heads = 12, seq = 1024, vocab = 50257;
  bool tied = true;
  // Mixture of Experts (models/moe.h): every block's MLP is `experts` SwiGLU experts of width
  // expert_ff (0: 4 hidden), top_k per token, behind DeepSpeed-MoE's gate. 0: dense.
  int64_t experts = 0, top_k = 2, expert_ff = 0;
  int64_t ff() const { return expert_ff > 0 ? expert_ff : 4 * hidden; }
  double expert_params() const;  // one block's experts, all of them
  // As models::GPTConfig counts them.
  int64_t params() const;
  int64_t block_params() const;
  double flops_per_token() const;  // training: 6 per parameter, 12 L d T for attention
  static ModelSpec from_json(const nlohmann::json& j);  // {"layers", "hidden", ...}
  nlohmann::json to_json() const;
};

// A link class: all-reduce bus bandwidth (bytes/s) and per-collective latency (s).
struct Link {
  double bandwidth = 0, latency = 0;
};

// One measured compute point: a block's forward + backward at n tokens, width d, tp, as one of
// the cluster's ranks runs it while every other rank does the same.
struct ComputePoint {
  int64_t tokens = 0, hidden = 0, tp = 1;
  double flops_per_s = 0;      // forward + backward
  double forward_share = 1.0 / 3.0;  // forward's part of that time (what a replay costs again)
  bool with_tp_comm = false;   // the block's tensor-parallel all-reduces are in the time
  std::string dtype;           // "fp32" or "bf16" ("" unknown)
};

struct ClusterSpec {
  int nodes = 1, devices_per_node = 1;
  double memory = 0;           // bytes per device
  double peak_flops = 0;       // per device, in the compute dtype
  double efficiency = 0.5;     // GEMM rate / peak, when no measured point applies
  // Bytes/s a device moves between its memory and its cores: the elementwise work of a block
  // (LayerNorm, softmax, GELU, dropout, residuals) runs at this rate, not at the GEMM rate
  // (0: counted in `efficiency`).
  double memory_bandwidth = 0;
  Link intra, inter;           // within a node, across nodes (per node's link)
  double optimizer_rate = 0;   // parameters per second one device updates (Adam)
  double nvme_bandwidth = 0;   // bytes/s per node (read and write each)
  double overlap = 1.0;        // fraction of gradient reduction that backward can hide
  // From --calibrate: measured with `measured_devices` ranks running at once (on a CPU they share
  // cores, so the points hold only for that many devices).
  std::vector<ComputePoint> compute;
  int measured_devices = 0;
  // CPU nodes (0: devices own their compute, as GPUs): when a node's ranks outnumber its cores,
  // the measured rates are shares of the cores, and a rank idle in the pipeline bubble gives its
  // share to the ranks still computing.
  int cores_per_node = 0;
  std::string source;          // where the numbers came from
  int world() const { return nodes * devices_per_node; }
  static ClusterSpec from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;
};

enum class Offload { kNone, kOptimizer, kOptimizerAndParams };  // to NVMe
const char* offload_name(Offload o);

struct Layout {
  int dp = 1, tp = 1, pp = 1, zero = 0;
  Offload offload = Offload::kNone;
  int64_t micro = 1, accumulation = 1;
  bool checkpointing = false;
  // Sequence parallelism (Ulysses: sp consecutive data-parallel ranks split each sequence; the
  // batch counts dp / sp sequences per micro-step) and expert parallelism (ep data-parallel
  // ranks hold a block's experts between them; ZeRO partitions the experts over dp / ep).
  int sp = 1, ep = 1;
  std::string describe() const;
};

struct TrainingSpec {
  int64_t global_batch = 8;
  bool bf16 = false;
  int64_t reduce_bucket_size = 500000000;          // elements (DeepSpeed's default)
  int64_t prefetch_bucket_size = 50000000;         // stage3_prefetch_bucket_size
  // Gradient reduction overlapping backward; unset: DeepSpeed's default (on at stage 3 only).
  std::optional<bool> overlap_comm;
  int grad_bytes = 4;  // the gradient accumulation dtype's (fp32, the engine's default)
  // Fused (flash) attention never stores the [T, T] scores (ours, LibTorch 2.x's SDPA); without
  // it, softmax and dropout over them add 5 a T bytes per token to a block's activations.
  bool flash_attention = true;
  int64_t offload_buffer_count = 5, offload_buffer_size = 100000000;  // elements
  // ZeRO++ (zero_optimization), on the layouts whose stage takes them: qgZ (stages 2-3) sends
  // 4-bit gradient blocks across nodes; qwZ (stage 3) all-gathers int8 blocks; hpZ (stage 3,
  // h > 1) keeps a secondary partition of 1/h so that every gather but a step's first runs
  // within h consecutive data-parallel ranks.
  bool quantized_gradients = false, quantized_weights = false;
  int hpz_partition_size = 1;
  // ALST's tiling (torchspeed.tiled_mlp, tiled_loss): slices of the sequence (0: none).
  int64_t tiled_mlp = 0, tiled_loss = 0;
};

struct Memory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, buffers = 0;
  double total() const { return params + grads + optimizer + activations + buffers; }
};

struct StepTime {
  double compute = 0, bubble = 0, tp_comm = 0, pp_comm = 0, dp_comm = 0, optimizer = 0, offload = 0;
  double a2a_comm = 0;  // sequence and expert parallelism's all-to-all exchanges
  double total() const { return compute + bubble + tp_comm + pp_comm + dp_comm + optimizer + offload + a2a_comm; }
};

struct Estimate {
  Layout layout;
  Memory memory;
  StepTime time;
  double flops_per_device = 0;  // the model's training FLOPs per second per device
  double a2a_bytes = 0;         // bytes one rank sends by all-to-all per step (sp and ep)
  bool fits = false;
  std::string why_not;  // search: why it could not be estimated (fits is false)
};

// One pipeline stage on one tensor-parallel rank, as the engine's default partition_method
// ("parameters") cuts the stack [embedding, blocks..., head].
struct Stage {
  double params = 0;
  double expert_params = 0;  // of `params`: this rank's experts (partitioned over dp / ep)
  int64_t blocks = 0;
  bool embed = false, head = false;
};
std::vector<Stage> pipeline_stages(const ModelSpec& m, const Layout& l);
// Parameters on the rank that holds the most (pipeline stage and tp slice).
double params_per_rank(const ModelSpec& m, const Layout& l);
// Why the engine would refuse the layout on this cluster and batch, or "".
std::string check_layout(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t, const Layout& l);
// The ZeRO paper's model states per rank, bytes (no activations, no buffers); gradients in
// `grad_bytes` (4: fp32 accumulation, the engine's default; 2: the paper's fp16 gradients).
Memory model_states(double psi, int zero, int dp, bool bf16, Offload offload, int grad_bytes = 4);
Estimate estimate(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t, const Layout& l);
// Every layout of the cluster's devices that the engine accepts (tp divides heads and a node,
// pp divides layers, ZeRO 2-3 without pipeline, offload needs a stage, the batch divides),
// estimated; sorted fastest first, those that do not fit after those that do.
std::vector<Estimate> search(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t);
nlohmann::json to_json(const Estimate& e);

}  // namespace torchspeed::plan
