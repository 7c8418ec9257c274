// `torchspeed bench train`: GPT training throughput and MFU of the engine at dp 2 for ZeRO 0-3 x
// fp32/bf16, beside a plain single-process LibTorch loop (2 threads) and PyTorch's
// DistributedDataParallel (gloo, 2 processes), in one run. The GEMM roofline is measured at the
// model's own shapes. The parent process runs the plain loop, then the DDP script, then the
// engine part on 2 ranks (mpirun), and merges the results.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "bench_report.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/runtime/cpu.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/launcher.h"

namespace torchspeed::bench {
namespace {

struct ModelCase {
  std::string name;
  models::GPTConfig gpt;
  int64_t batch;  // global batch (sequences)
};

std::vector<ModelCase> cases(bool quick) {
  models::GPTConfig small;
  small.seq_len = 128; small.d_model = 192; small.n_layer = 4; small.n_head = 6;
  models::GPTConfig medium;
  medium.seq_len = 256; medium.d_model = 384; medium.n_layer = 6; medium.n_head = 6;
  if (quick) return {{"gpt-small", small, 8}};
  return {{"gpt-small", small, 32}, {"gpt-medium", medium, 16}};
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int steps(bool quick) { return quick ? 2 : 5; }

// GEMM rate at the model's shapes (the MLP's [B*T, d] x [d, 4d] and back, and the QKV
// projection), all threads: the roofline a training step can approach.
double model_gemm_gflops(const models::GPTConfig& g, int64_t micro, at::ScalarType dt) {
  const int64_t rows = micro * g.seq_len, d = g.d_model;
  std::vector<std::pair<at::Tensor, at::Tensor>> shapes = {
      {at::randn({rows, d}).to(dt), at::randn({d, 4 * d}).to(dt)},
      {at::randn({rows, 4 * d}).to(dt), at::randn({4 * d, d}).to(dt)},
      {at::randn({rows, d}).to(dt), at::randn({d, 3 * d}).to(dt)}};
  double flops = 0, secs = 0;
  for (auto& [a, b] : shapes) {
    at::Tensor c = at::mm(a, b);
    double best = 1e30;
    for (int i = 0; i < 5; ++i) {
      double t0 = now();
      at::mm_out(c, a, b);
      best = std::min(best, now() - t0);
    }
    flops += 2.0 * a.size(0) * a.size(1) * b.size(1);
    secs += best;
  }
  return flops / secs / 1e9;
}

// Plain LibTorch: the same model, torch::optim::AdamW, one process, every thread.
double plain_loop_tokens_per_s(const ModelCase& mc, bool quick) {
  torch::manual_seed(0);
  auto model = models::make_gpt(mc.gpt);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto step = [&] {
    at::Tensor x = at::randint(0, 256, {mc.batch, mc.gpt.seq_len}, at::kLong);
    at::Tensor y = at::randint(0, 256, {mc.batch, mc.gpt.seq_len}, at::kLong);
    opt.zero_grad();
    model->loss(model->forward(x), y).backward();
    opt.step();
  };
  step();
  const double t0 = now();
  for (int i = 0; i < steps(quick); ++i) step();
  return steps(quick) * mc.batch * mc.gpt.seq_len / (now() - t0);
}

nlohmann::json run_ddp(const ModelCase& mc, bool quick) {
  const std::string script = std::string(TORCHSPEED_SOURCE_DIR) + "/benchmarks/ddp_gpt.py";
  const std::string out = "/tmp/torchspeed_bench_ddp.json";
  std::vector<std::string> argv = {"sh", "-c",
      concat("/usr/bin/python3 ", script, " --seq ", mc.gpt.seq_len, " --d ", mc.gpt.d_model, " --layers ",
             mc.gpt.n_layer, " --heads ", mc.gpt.n_head, " --batch ", mc.batch, " --steps ", steps(quick),
             " --warmup 1 > ", out, " 2>/dev/null")};
  if (launcher::run_command(argv) != 0) return {{"error", "PyTorch DDP baseline failed (apt-get install python3-torch)"}};
  std::ifstream in(out);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  try {
    return nlohmann::json::parse(last);
  } catch (...) {
    return {{"error", "no result from the PyTorch DDP baseline"}};
  }
}

}  // namespace

// The part on 2 ranks: every ZeRO stage x precision through the engine.
int run_train_engine_part(const BenchArgs& args) {
  const Runtime& rt = runtime();
  TS_CHECK(rt.world_size == 2, "bench train's engine part runs on 2 ranks");
  nlohmann::json results = nlohmann::json::array();
  for (const auto& mc : cases(args.quick)) {
    for (bool bf16 : {false, true}) {
      for (int stage : {0, 1, 2, 3}) {
        config::WorldShape shape;
        shape.world_size = 2;
        auto cfg = config::Config::parse(
            {{"train_batch_size", mc.batch}, {"train_micro_batch_size_per_gpu", mc.batch / 2},
             {"bf16", {{"enabled", bf16}}}, {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
             {"zero_optimization", {{"stage", stage}, {"overlap_comm", true}, {"reduce_bucket_size", 2000000},
                                    {"stage3_param_persistence_threshold", 10000}}}},
            shape);
        torch::manual_seed(0);
        auto engine = initialize(rt, models::make_gpt(mc.gpt), cfg);
        const int64_t micro = mc.batch / 2;
        auto step = [&] {
          at::Tensor x = at::randint(0, 256, {micro, mc.gpt.seq_len}, at::kLong);
          at::Tensor y = at::randint(0, 256, {micro, mc.gpt.seq_len}, at::kLong);
          engine->backward(engine->forward(x, y));
          engine->step();
        };
        step();
        engine->groups().world->barrier();
        auto t_before = engine->timings();
        const double t0 = now();
        for (int i = 0; i < steps(args.quick); ++i) step();
        engine->groups().world->barrier();
        const double secs = now() - t0;
        auto t = engine->timings();
        const double math = (t.forward_s - t_before.forward_s) + (t.backward_s - t_before.backward_s);
        if (rt.is_rank0()) {
          results.push_back({{"model", mc.name}, {"stage", stage}, {"precision", bf16 ? "bf16" : "fp32"},
                             {"steps", steps(args.quick)}, {"seconds", secs},
                             {"tokens_per_s", steps(args.quick) * mc.batch * mc.gpt.seq_len / secs},
                             {"forward_backward_s", math}, {"optimizer_s", t.optimizer_s - t_before.optimizer_s},
                             {"reduce_wait_s", t.reduce_wait_s - t_before.reduce_wait_s},
                             {"allgather_s", t.allgather_s - t_before.allgather_s}});
        }
      }
    }
  }
  if (rt.is_rank0()) std::ofstream(args.json_path) << results.dump() << "\n";
  return 0;
}

int run_train(const BenchArgs& args, const std::string& self) {
  BenchReport report("train");
  report.machine() = describe_machine(2);
  const int threads = cpu::features().affinity_cores;
  at::set_num_threads(threads);
  cpu::set_blas_threads(threads);
  std::map<std::string, double> plain, ddp;
  std::map<std::string, std::pair<double, double>> roofline;  // fp32, bf16 GFLOP/s
  for (const auto& mc : cases(args.quick)) {
    std::printf("bench train: %s (%.2fM parameters, %ld tokens per step): plain loop, PyTorch DDP...\n",
                mc.name.c_str(), mc.gpt.num_params() / 1e6, static_cast<long>(mc.batch * mc.gpt.seq_len));
    std::fflush(stdout);
    plain[mc.name] = plain_loop_tokens_per_s(mc, args.quick);
    auto d = run_ddp(mc, args.quick);
    ddp[mc.name] = d.value("tokens_per_s", 0.0);
    roofline[mc.name] = {model_gemm_gflops(mc.gpt, mc.batch / 2, at::kFloat),
                         model_gemm_gflops(mc.gpt, mc.batch / 2, at::kBFloat16)};
    report.add_result({{"model", mc.name}, {"impl", "plain_libtorch_loop"}, {"threads", threads}, {"tokens_per_s", plain[mc.name]}});
    report.add_result({{"model", mc.name}, {"impl", "pytorch_ddp"}, {"result", d}});
    report.add_result({{"model", mc.name}, {"impl", "gemm_roofline"}, {"fp32_gflops", roofline[mc.name].first},
                       {"bf16_gflops", roofline[mc.name].second}});
  }
  std::printf("bench train: the engine on 2 ranks, ZeRO 0-3 x fp32/bf16...\n");
  std::fflush(stdout);
  const std::string part = "/tmp/torchspeed_bench_train_engine.json";
  launcher::LaunchOptions lo;
  lo.num_ranks = 2;
  lo.program = {self, "bench", "train", "--engine-part", "--json", part};
  if (args.quick) lo.program.push_back("--quick");
  TS_CHECK(launcher::run_command(launcher::build_command(lo, launcher::LaunchContext::current())) == 0,
           "the engine part of bench train failed");
  nlohmann::json engine = nlohmann::json::parse(std::ifstream(part));
  std::printf("\n%-11s %-5s %5s %10s %9s %9s %9s %9s\n", "model", "prec", "stage", "tokens/s", "MFU",
              "overhead", "vs plain", "vs DDP");
  for (const auto& r : engine) {
    const std::string model = r["model"], prec = r["precision"];
    const int stage = r["stage"];
    ModelCase mc;
    for (const auto& c : cases(args.quick))
      if (c.name == model) mc = c;
    const double tps = r["tokens_per_s"], flops = mc.gpt.flops_per_token() * tps;
    const double roof = (prec == "bf16" ? roofline[model].second : roofline[model].first) * 1e9;
    const double mfu = flops / roof;  // the roofline was measured with every core of the machine
    const double overhead = 1.0 - r["forward_backward_s"].get<double>() / r["seconds"].get<double>();
    std::printf("%-11s %-5s %5d %10.0f %8.1f%% %8.1f%% %8.2fx %8.2fx\n", model.c_str(), prec.c_str(), stage, tps,
                100 * mfu, 100 * overhead, tps / plain[model], ddp[model] > 0 ? tps / ddp[model] : 0.0);
    nlohmann::json row = r;
    row["mfu_of_model_gemm_roofline"] = mfu;
    row["outside_forward_backward_fraction"] = overhead;
    report.add_result(row);
    if (stage == 2 && prec == "fp32") {
      report.add_target(concat(model, " dp2 ZeRO-2 fp32 tokens/s / PyTorch DDP"), ddp[model] > 0 ? tps / ddp[model] : 0, 1.2);
      report.add_target(concat(model, " dp2 ZeRO-2 fp32 tokens/s / plain LibTorch loop"), tps / plain[model], 1.0);
    }
    if (stage == 2 && (model == "gpt-medium" || args.quick)) {
      report.add_target(concat(model, " ZeRO-2 ", prec, ": fraction of the GEMM roofline"), mfu, 0.6);
      report.add_target(concat(model, " ZeRO-2 ", prec, ": step time outside forward+backward"), overhead, 0.05, false);
    }
  }
  std::printf("plain loop (%d threads):", threads);
  for (auto& [m, v] : plain) std::printf(" %s %.0f tok/s;", m.c_str(), v);
  std::printf(" PyTorch DDP (gloo, 2 processes):");
  for (auto& [m, v] : ddp) std::printf(" %s %.0f tok/s;", m.c_str(), v);
  std::printf("\n");
  report.finish(args);
  return 0;
}

}  // namespace torchspeed::bench
