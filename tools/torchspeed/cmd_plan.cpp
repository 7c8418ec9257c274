// `torchspeed plan`: predicts per-rank memory and step time of GPT training for every layout of a
// cluster (dp x tp x pp, ZeRO stage, offload, micro-batch, checkpointing) and ranks them
// (plan/plan.h, Note [Plan model]).
//   torchspeed plan --cluster C.json (--config TRAIN.json | --layers L --hidden D --heads A
//                   --seq T --vocab V [--batch B] [--bf16]) [--top K] [--layout SPEC] [--json F]
//   torchspeed plan --calibrate --out C.json -n R [--hostfile F] (model options) [--max-micro M]
// --calibrate measures this machine for the model: a block's forward + backward at each
// micro-batch size and tensor-parallel slice (1 thread and every core), the fused Adam update,
// and all-reduce within a host and across hosts (R ranks, launched by mpirun), and writes a
// cluster file the plan reads.
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "bench_report.h"
#include "commands.h"
#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/comm/communicator.h"
#include "torchspeed/config/config.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/optim/fused_optimizers.h"
#include "torchspeed/plan/plan.h"
#include "torchspeed/base/cpu.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"
#include "torchspeed/comm/runtime.h"
#include "torchspeed/tensor_parallel/layers.h"

namespace torchspeed::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The median of `runs` timings of f after one warm-up call.
template <typename F>
double median_time(int runs, F&& f) {
  f();
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto s = Clock::now();
    f();
    t.push_back(seconds_since(s));
  }
  return bench::median(std::move(t));
}

// One rank's share of a GPT block under tensor parallelism `tp`: the LayerNorms, q/k/v and the
// MLP's first layer column-split (3d/tp, 4d/tp outputs), causal attention over heads/tp, the
// two row-split projections (d/tp, 4d/tp inputs), with the all-reduces of models::GPTBlockTP
// over `group` (two in forward, two in backward; none at tp 1): a rank's block as training runs
// it, waits for its partners included. Forward (+ backward), seconds.
double time_block(const plan::ModelSpec& m, int64_t micro, int tp, at::ScalarType dtype, bool backward,
                  const comm::CommunicatorPtr& group) {
  const int64_t d = m.hidden, T = m.seq, H = m.heads / tp, hd = d / m.heads;
  auto opts = at::TensorOptions().dtype(dtype);
  auto param = [&](std::vector<int64_t> shape) { return (at::randn(shape, opts) * 0.02).set_requires_grad(true); };
  at::Tensor w_qkv = param({3 * d / tp, d}), b_qkv = param({3 * d / tp}), w_proj = param({d, d / tp}), b_proj = param({d});
  at::Tensor w_fc = param({4 * d / tp, d}), b_fc = param({4 * d / tp}), w_out = param({d, 4 * d / tp}), b_out = param({d});
  at::Tensor g1 = param({d}), g2 = param({d}), n1 = param({d}), n2 = param({d});
  at::Tensor x = at::randn({micro, T, d}, opts).set_requires_grad(true);
  return median_time(7, [&] {
    at::AutoGradMode grad(backward);
    auto in = [&](const at::Tensor& t) { return tp > 1 ? tensor_parallel::copy_to_region(t, group) : t; };
    auto out_of = [&](const at::Tensor& t) { return tp > 1 ? tensor_parallel::reduce_from_region(t, group) : t; };
    at::Tensor a = in(at::layer_norm(x, {d}, g1, n1));
    auto parts = at::linear(a, w_qkv, b_qkv).view({micro, T, 3, H, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
    at::Tensor y;
    if (dtype == at::kFloat) {  // as models::GPTBlock: fused attention in fp32, spelled out in bf16
      y = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, 0.0, true);
    } else {
      at::Tensor att = at::matmul(parts[0], parts[1].transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
      att = att.masked_fill(at::ones({T, T}, att.options().dtype(at::kBool)).triu(1), -std::numeric_limits<float>::infinity());
      y = at::matmul(att.softmax(-1), parts[2]);
    }
    at::Tensor h = x + out_of(at::linear(y.transpose(1, 2).reshape({micro, T, H * hd}), w_proj, b_proj));
    at::Tensor out = h + out_of(at::linear(at::gelu(at::linear(in(at::layer_norm(h, {d}, g2, n2)), w_fc, b_fc)), w_out, b_out));
    if (!backward) return;
    out.sum().backward();
    for (auto* t : {&x, &w_qkv, &w_fc}) t->mutable_grad() = at::Tensor();
  });
}

double time_adam(int64_t n) {
  std::vector<float> p(static_cast<size_t>(n), 0.5f), g(static_cast<size_t>(n), 0.01f), m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
  optim::AdamHyper h;
  h.step = 1;
  return median_time(3, [&] {
    optim::adam_step(p.data(), g.data(), at::kFloat, 1.0f, m.data(), v.data(), n, h, nullptr, optim::ParamOut::kNone);
  });
}

int64_t mem_total_bytes();

struct CalibrationRequest {
  plan::ModelSpec model;
  bool bf16 = false;
  int64_t max_micro = 8;
};

// The measuring part of --calibrate, on every rank at once (under mpirun, or alone): a block's
// forward + backward and forward alone at each micro-batch size and tp slice, the Adam update,
// then all-reduce within a host and across hosts. Every rank measures while the others do the
// same, as training runs them; the times are averaged over ranks. Rank 0 writes the cluster.
int calibrate_worker(const CalibrationRequest& q, const std::string& out) {
  const Runtime& rt = init();
  auto world = comm::Communicator::world();
  const plan::ModelSpec& m = q.model;
  {
    // Host and tensor-parallel groups below assume every node runs as many ranks.
    at::Tensor lo = at::full({1}, rt.local_size, at::kInt), hi = lo.clone();
    world->all_reduce(lo, comm::ReduceOp::kMin);
    world->all_reduce(hi, comm::ReduceOp::kMax);
    TS_CHECK(lo.item<int>() == hi.item<int>(), "plan --calibrate: the nodes run ", lo.item<int>(), " to ", hi.item<int>(),
             " ranks; give every host the same slots");
  }
  auto mean_over_ranks = [&](double v) {
    at::Tensor t = at::full({1}, v, at::kDouble);
    world->all_reduce(t);
    return t.item<double>() / world->size();
  };
  plan::ClusterSpec c;
  c.nodes = rt.num_nodes;
  c.devices_per_node = rt.local_size;
  c.measured_devices = rt.world_size;
  // A node's cores are its machine's; network-namespace hosts on one machine (the same boot id
  // on every rank) share them, each getting its share.
  const bool one_machine = [&] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string id;
    in >> id;
    at::Tensor h = at::full({1}, static_cast<int64_t>(std::hash<std::string>{}(id) >> 1), at::kLong), lo = h.clone();
    world->all_reduce(h, comm::ReduceOp::kMax);
    world->all_reduce(lo, comm::ReduceOp::kMin);
    return h.item<int64_t>() == lo.item<int64_t>();
  }();
  // The machine's cores, not this rank's affinity: the launcher binds each rank to its share.
  const int cores = cpu::features().logical_cores;
  c.cores_per_node = one_machine ? std::max(1, cores * rt.local_size / rt.world_size) : cores;
  c.memory = static_cast<double>(mem_total_bytes()) / rt.local_size;
  c.overlap = 0.0;  // a CPU rank's communication runs on the cores its backward computes on
  c.source = concat("torchspeed plan --calibrate: ", cpu::features().model_name, ", ", cpu::features().affinity_cores, " cores, ",
                    rt.world_size, " ranks of ", rt.intra_op_threads, " threads");
  const at::ScalarType dtype = q.bf16 ? at::kBFloat16 : at::kFloat;
  if (rt.rank == 0)
    std::printf("plan --calibrate: GPT block (d %ld, %ld heads, seq %ld, %s) on %d ranks at once (%d per node, %d threads each)\n",
                static_cast<long>(m.hidden), static_cast<long>(m.heads), static_cast<long>(m.seq), q.bf16 ? "bf16" : "fp32",
                rt.world_size, rt.local_size, rt.intra_op_threads);
  for (int tp = 1; tp <= rt.local_size; ++tp) {
    if (m.heads % tp || rt.local_size % tp) continue;
    // Tensor-parallel groups of consecutive ranks within a node, as the process grid makes them.
    auto group = world->split(rt.rank / tp, rt.rank, concat("plan-tp", tp));
    for (int64_t micro = 1; micro <= q.max_micro; micro *= 2) {
      world->barrier();
      const double both = mean_over_ranks(time_block(m, micro, tp, dtype, true, group));
      world->barrier();
      const double fwd = mean_over_ranks(time_block(m, micro, tp, dtype, false, group));
      const double flops = static_cast<double>(micro * m.seq) *
                           (6.0 * static_cast<double>(m.block_params()) / tp + 12.0 * static_cast<double>(m.hidden * m.seq) / tp);
      c.compute.push_back({micro * m.seq, m.hidden, tp, flops / both, fwd / both, /*with_tp_comm=*/true, q.bf16 ? "bf16" : "fp32"});
      if (rt.rank == 0)
        std::printf("  tp %d micro %3ld: forward + backward %8.2f ms (%6.1f GFLOP/s), forward %5.1f%%\n", tp, static_cast<long>(micro),
                    both * 1e3, flops / both / 1e9, 100 * fwd / both);
    }
  }
  const int64_t n = int64_t{4} << 20;
  world->barrier();
  c.optimizer_rate = static_cast<double>(n) / mean_over_ranks(time_adam(n));
  if (rt.rank == 0) std::printf("  Adam update: %.1fM parameters/s per rank\n", c.optimizer_rate / 1e6);

  auto host = world->split(rt.rank / rt.local_size, rt.rank, "plan-host");
  auto leaders = world->split(rt.local_rank == 0 ? 0 : 1, rt.rank, "plan-leaders");
  const int64_t bytes = int64_t{64} << 20;
  // (seconds of a 64 MiB all-reduce, of a 4 KiB one), median of 5, on the ranks taking part.
  auto measure = [&](const comm::CommunicatorPtr& g, bool take_part) -> std::pair<double, double> {
    at::Tensor big = at::ones({bytes / 4}), tiny = at::ones({1024});
    double tb = 0, tt = 0;
    if (take_part && g->size() > 1) {
      tb = median_time(5, [&] { g->all_reduce(big); });
      tt = median_time(5, [&] { g->all_reduce(tiny); });
    }
    world->barrier();
    return {tb, tt};
  };
  auto as_link = [&](int ranks, std::pair<double, double> t, const char* what) {
    plan::Link l{2.0 * (ranks - 1) / ranks * static_cast<double>(bytes) / t.first, t.second};
    if (rt.rank == 0)
      std::printf("  %s all-reduce over %d ranks: bus bandwidth %.2f GB/s, latency %.1f us\n", what, ranks, l.bandwidth / 1e9,
                  l.latency * 1e6);
    return l;
  };
  const auto intra = measure(host, true);
  c.intra = host->size() > 1 ? as_link(host->size(), intra, "within a node:") : plan::Link{1e12, 0};  // nothing crosses
  if (rt.num_nodes > 1) c.inter = as_link(leaders->size(), measure(leaders, rt.local_rank == 0), "across nodes: ");
  if (rt.rank == 0) {
    checkpoint::write_file_atomic(out, c.to_json().dump(2) + "\n");
    std::printf("wrote %s\n", out.c_str());
  }
  shutdown();
  return 0;
}

int64_t mem_total_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (in >> key >> kb) {
    if (key == "MemTotal:") return kb * 1024;
    in.ignore(256, '\n');
  }
  return 0;
}
}  // namespace

Runner add_plan(CLI::App& app, const Invocation& inv) {
  auto* cmd = app.add_subcommand("plan", "Predict memory and step time of every training layout on a cluster, and rank them");
  struct Opts {
    std::string cluster, config, layout, json, out, hostfile;
    plan::ModelSpec model;
    bool calibrate = false;
    plan::TrainingSpec training;
    int top = 10, ranks = 0, nodes = 0, devices_per_node = 0;
    int64_t max_micro = 8;
    double memory = 0;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--cluster", o->cluster, "Cluster file (JSON: plan --calibrate writes one; see plan/plan.h)");
  cmd->add_option("--config", o->config, "A torchspeed train config: its model, batch, bf16 and ZeRO bucket settings");
  for (auto [flag, field] : std::vector<std::pair<const char*, int64_t*>>{{"--layers", &o->model.layers}, {"--hidden", &o->model.hidden},
                                                                          {"--heads", &o->model.heads}, {"--seq", &o->model.seq},
                                                                          {"--vocab", &o->model.vocab}})
    cmd->add_option(flag, *field, "Model shape")->check(CLI::PositiveNumber);
  cmd->add_option("--experts", o->model.experts, "Mixture of Experts: SwiGLU experts per block (0: dense)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", o->model.top_k, "Mixture of Experts: experts per token")->check(CLI::PositiveNumber);
  cmd->add_option("--expert-ff", o->model.expert_ff, "Mixture of Experts: an expert's width (0: 4 hidden)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--tiled-mlp", o->training.tiled_mlp, "ALST's tiled MLP: slices of the sequence (torchspeed.tiled_mlp)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--tiled-loss", o->training.tiled_loss, "ALST's tiled loss: slices of the sequence (torchspeed.tiled_loss)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--batch", o->training.global_batch, "Global batch (samples per step)")->check(CLI::PositiveNumber);
  cmd->add_flag("--bf16", o->training.bf16, "bf16 training (fp32 masters)");
  cmd->add_option("--nodes", o->nodes, "Override the cluster's nodes")->check(CLI::PositiveNumber);
  cmd->add_option("--devices-per-node", o->devices_per_node, "Override the cluster's devices (ranks) per node")->check(CLI::PositiveNumber);
  cmd->add_option("--memory", o->memory, "Override memory per device, bytes")->check(CLI::PositiveNumber);
  cmd->add_option("--top", o->top, "Layouts to print")->check(CLI::PositiveNumber);
  cmd->add_option("--layout", o->layout, "Estimate one layout: dp=2,tp=1,pp=1,zero=2,micro=4,ckpt=0[,offload=optimizer]");
  cmd->add_option("--json", o->json, "Write the estimates as JSON to FILE");
  cmd->add_flag("--calibrate", o->calibrate, "Measure this machine for the model and write --out");
  cmd->add_option("--out", o->out, "Where --calibrate writes the cluster file");
  cmd->add_option("-n,--num-ranks", o->ranks, "--calibrate: ranks (devices) per node x nodes to measure communication with")->check(CLI::PositiveNumber);
  cmd->add_option("--hostfile", o->hostfile, "--calibrate: hosts to measure the inter-node link across");
  cmd->add_option("--max-micro", o->max_micro, "--calibrate: the largest micro-batch to measure (powers of two up to it)")->check(CLI::PositiveNumber);
  return [o, cmd, &inv]() {
    plan::ModelSpec& m = o->model;
    // Flags given on the command line win over the config's values.
    const plan::TrainingSpec flags = o->training;
    if (!o->config.empty()) {
      for (const char* f : {"--layers", "--hidden", "--heads", "--seq", "--vocab", "--experts", "--top-k", "--expert-ff"})
        TS_CHECK(cmd->count(f) == 0, "give the model by --config or by --layers/--hidden/..., not both (", f, ")");
      const nlohmann::json j = config::read_json_file(o->config);
      const auto gpt = models::GPTConfig::from_json(j.value("model", nlohmann::json::object()));
      m.layers = gpt.n_layer, m.hidden = gpt.d_model, m.heads = gpt.n_head, m.seq = gpt.seq_len, m.vocab = gpt.vocab;
      m.tied = gpt.tie_embeddings;
      if (gpt.moe.enabled()) m.experts = gpt.moe.num_experts, m.top_k = gpt.moe.k, m.expert_ff = gpt.experts().d_ff;
      auto section = [&](const char* key) {
        if (!j.contains(key)) return nlohmann::json::object();
        TS_CHECK(j[key].is_object(), o->config, ": ", key, " must be an object");
        return j[key];
      };
      auto number = [&](const nlohmann::json& obj, const std::string& path, const char* key, double fallback) {
        if (!obj.contains(key)) return fallback;
        TS_CHECK(obj[key].is_number(), o->config, ": ", path, key, " must be a number for plan, not ", obj[key].dump());
        return obj[key].get<double>();
      };
      auto flag = [&](const nlohmann::json& obj, const std::string& path, const char* key, bool fallback) {
        if (!obj.contains(key)) return fallback;
        TS_CHECK(obj[key].is_boolean(), o->config, ": ", path, key, " must be true or false, not ", obj[key].dump());
        return obj[key].get<bool>();
      };
      plan::TrainingSpec& t = o->training;
      if (j.contains("train_batch_size")) {
        t.global_batch = static_cast<int64_t>(number(j, "", "train_batch_size", 0));
      } else {
        TS_CHECK(cmd->count("--batch") > 0, o->config, " has no train_batch_size (the global batch depends on dp): give --batch");
      }
      // 16-bit training either way: bf16 or fp16 (2-byte parameters, fp32 masters).
      t.bf16 = flag(section("bf16"), "bf16.", "enabled", false) || flag(section("fp16"), "fp16.", "enabled", false);
      const auto types = section("data_types");
      if (types.contains("grad_accum_dtype")) t.grad_bytes = types["grad_accum_dtype"] == "fp32" ? 4 : 2;
      const auto z = section("zero_optimization");
      t.reduce_bucket_size = static_cast<int64_t>(number(z, "zero_optimization.", "reduce_bucket_size", 5e8));
      t.prefetch_bucket_size = static_cast<int64_t>(number(z, "zero_optimization.", "stage3_prefetch_bucket_size", 5e7));
      if (z.contains("overlap_comm")) t.overlap_comm = flag(z, "zero_optimization.", "overlap_comm", false);
      t.quantized_gradients = flag(z, "zero_optimization.", "zero_quantized_gradients", false);
      t.quantized_weights = flag(z, "zero_optimization.", "zero_quantized_weights", false);
      t.hpz_partition_size = static_cast<int>(number(z, "zero_optimization.", "zero_hpz_partition_size", 1));
      const auto ts = section("torchspeed");
      t.tiled_mlp = static_cast<int64_t>(number(ts, "torchspeed.", "tiled_mlp", 0));
      t.tiled_loss = static_cast<int64_t>(number(ts, "torchspeed.", "tiled_loss", 0));
      TS_CHECK(t.hpz_partition_size >= 1, o->config, ": zero_optimization.zero_hpz_partition_size must be >= 1, not ", t.hpz_partition_size);
      // The scores are stored unless the fused kernel runs: fp32 without attention dropout
      // (Note [Causal attention] in models/gpt.cpp).
      t.flash_attention = !t.bf16 && gpt.dropout == 0.0;
    } else {
      for (const char* f : {"--layers", "--hidden", "--heads", "--seq", "--vocab"})
        TS_CHECK(cmd->count(f) > 0, "plan: give the model by --config FILE or all of --layers --hidden --heads --seq --vocab (", f, " is missing)");
      o->training.flash_attention = !o->training.bf16;
    }
    if (cmd->count("--batch")) o->training.global_batch = flags.global_batch;
    if (cmd->count("--bf16")) o->training.bf16 = true, o->training.flash_attention = false;
    TS_CHECK(m.hidden % m.heads == 0, "--hidden ", m.hidden, " is not a multiple of --heads ", m.heads);

    // Options of --calibrate alone, and of the plan alone: refused where they would do nothing.
    if (!o->calibrate) {
      for (const char* f : {"--out", "-n", "--hostfile", "--max-micro"})
        TS_CHECK(cmd->count(f) == 0, "plan: ", f, " belongs to --calibrate");
    } else {
      for (const char* f : {"--cluster", "--layout", "--json", "--top", "--batch", "--nodes", "--devices-per-node", "--memory"})
        TS_CHECK(cmd->count(f) == 0, "plan --calibrate: ", f, " does not apply (it measures this machine)");
    }
    if (o->calibrate) {
      TS_CHECK(!o->out.empty(), "--calibrate needs --out FILE");
      CalibrationRequest q{m, o->training.bf16, o->max_micro};
      if (launcher::under_launcher()) return calibrate_worker(q, o->out);
      const int ranks = o->ranks > 0 ? o->ranks : 1;
      if (ranks == 1 && o->hostfile.empty()) return calibrate_worker(q, o->out);
      // Note [Relaunching a command]: the ranks run this command again and, under the launcher,
      // measure (calibrate_worker); --out is made absolute for ranks on other hosts.
      launcher::Relaunch r;
      r.num_ranks = ranks, r.hostfile = o->hostfile, r.self_path = inv.self_path, r.args = inv.args;
      r.drop = {"--out"};
      r.append = {"--out", std::filesystem::absolute(o->out).string()};
      const int rc = launcher::relaunch_under_mpirun(r);
      TS_CHECK(rc == 0, "plan --calibrate: the measurement on ", ranks, " ranks failed (exit ", rc, ")");
      return 0;
    }

    TS_CHECK(!o->cluster.empty(), "plan needs --cluster FILE (write one with plan --calibrate, or by hand: plan/plan.h)");
    plan::ClusterSpec c = plan::ClusterSpec::from_json(config::read_json_file(o->cluster));
    if (o->nodes > 0) c.nodes = o->nodes;
    if (o->devices_per_node > 0) c.devices_per_node = o->devices_per_node;
    if (o->memory > 0) c.memory = o->memory;
    std::vector<plan::Estimate> estimates;
    if (!o->layout.empty()) {
      plan::Layout l;
      std::stringstream ss(o->layout);
      std::string kv;
      while (std::getline(ss, kv, ',')) {
        const auto eq = kv.find('=');
        TS_CHECK(eq != std::string::npos, "--layout: '", kv, "' is not KEY=VALUE");
        const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
        if (k == "offload") {
          TS_CHECK(v == "none" || v == "optimizer" || v == "optimizer+params", "--layout offload: none, optimizer or optimizer+params, not ", v);
          l.offload = v == "none" ? plan::Offload::kNone : v == "optimizer" ? plan::Offload::kOptimizer : plan::Offload::kOptimizerAndParams;
          continue;
        }
        int64_t n = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
        TS_CHECK(ec == std::errc() && end == v.data() + v.size(), "--layout ", k, ": '", v, "' is not a whole number");
        if (k == "dp") l.dp = static_cast<int>(n);
        else if (k == "tp") l.tp = static_cast<int>(n);
        else if (k == "pp") l.pp = static_cast<int>(n);
        else if (k == "zero") l.zero = static_cast<int>(n);
        else if (k == "micro") l.micro = n;
        else if (k == "ckpt") l.checkpointing = n != 0;
        else if (k == "sp") l.sp = static_cast<int>(n);
        else if (k == "ep") l.ep = static_cast<int>(n);
        else TS_CHECK(false, "--layout: unknown key '", k, "' (dp, tp, pp, sp, ep, zero, micro, ckpt, offload)");
      }
      if (l.dp > 0 && l.sp > 0 && l.dp % l.sp == 0 && l.micro > 0)
        l.accumulation = o->training.global_batch / (static_cast<int64_t>(l.dp / l.sp) * l.micro);
      const std::string bad = plan::check_layout(m, c, o->training, l);
      TS_CHECK(bad.empty(), "--layout ", o->layout, ": ", bad);
      estimates.push_back(plan::estimate(m, c, o->training, l));
    } else {
      estimates = plan::search(m, c, o->training);
    }
    std::printf("torchspeed plan: GPT %ld layers, d %ld, %ld heads, seq %ld, vocab %ld: %.2fM parameters%s; batch %ld, %s%s\n",
                static_cast<long>(m.layers), static_cast<long>(m.hidden), static_cast<long>(m.heads), static_cast<long>(m.seq),
                static_cast<long>(m.vocab), static_cast<double>(m.params()) / 1e6,
                m.experts > 0 ? concat(", ", m.experts, " experts of width ", m.ff(), " per block, ", m.top_k, " per token").c_str() : "",
                static_cast<long>(o->training.global_batch), o->training.bf16 ? "bf16" : "fp32",
                o->training.tiled_mlp > 1 || o->training.tiled_loss > 1
                    ? concat(", tiled MLP ", o->training.tiled_mlp, " / loss ", o->training.tiled_loss).c_str()
                    : "");
    std::printf("  cluster: %d nodes x %d devices, %.2f GB each%s%s\n", c.nodes, c.devices_per_node, c.memory / 1e9,
                c.source.empty() ? "" : "; ", c.source.c_str());
    // Memory in GB, or MB for small models.
    const bool small = !estimates.empty() && estimates.front().memory.total() < 1e9;
    const double unit = small ? 1e6 : 1e9;
    std::printf("%-60s %9s %9s %9s %9s | %9s %8s %8s %8s %8s %8s %8s %9s %9s\n", "layout", small ? "mem MB" : "mem GB", "states", "act",
                "buf", "step s", "compute", "bubble", "tp/pp", "dp", "a2a", "optim", "a2a MB", "TFLOP/s");
    int shown = 0;
    for (const auto& e : estimates) {
      if (shown++ >= o->top) break;
      const auto& mem = e.memory;
      const auto& t = e.time;
      std::printf("%-60s %9.3f %9.3f %9.3f %9.3f | %9.4f %8.4f %8.4f %8.4f %8.4f %8.4f %8.4f %9.2f %9.3f%s\n", e.layout.describe().c_str(),
                  mem.total() / unit, (mem.params + mem.grads + mem.optimizer) / unit, mem.activations / unit, mem.buffers / unit,
                  t.total(), t.compute, t.bubble, t.tp_comm + t.pp_comm, t.dp_comm, t.a2a_comm, t.optimizer + t.offload,
                  e.a2a_bytes / 1e6, e.flops_per_device / 1e12,
                  e.fits ? "" : e.why_not.empty() ? "  does not fit" : ("  not estimated: " + e.why_not).c_str());
    }
    if (!o->json.empty()) {
      nlohmann::json j = {{"model", m.to_json()}, {"cluster", c.to_json()}, {"estimates", nlohmann::json::array()}};
      for (const auto& e : estimates) j["estimates"].push_back(plan::to_json(e));
      checkpoint::write_file_atomic(o->json, j.dump(2) + "\n");
    }
    return 0;
  };
}

}  // namespace torchspeed::cli
