// `torchspeed bench linear` (1 rank): the serving linears of one decode step of the d768 GPT (12
// layers of qkv 2304x768, proj 768x768, fc 3072x768, mlp 768x3072: 85M weights) at 1, 2, 16, 64
// and 256 rows, per weight format and kernel (Note [Serving linear kernels], [bf16 dot
// products], [AMX tiles]), beside what a LibTorch user would call instead: at::linear on fp32
// weights (MKL) and on bf16 input and weights (oneDNN, AMX where the CPU has it; bf16 output, as a
// bf16 model keeps its activations, so the peer converts nothing per linear). Prints the
// median time of the 48 linears, the weight bytes streamed per second and the GFLOP/s.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_report.h"
#include "torchspeed/inference/linear.h"

namespace torchspeed::bench {

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t out, in;
};

double time_ms(const std::function<void()>& f, int reps) {
  f();  // warm
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = Clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
  }
  return median(t);
}

}  // namespace

int run_linear(const BenchArgs& args) {
  using inference::ServingLinear;
  using inference::WeightFormat;
  const std::vector<Shape> layer{{2304, 768}, {768, 768}, {3072, 768}, {768, 3072}};
  const int layers = args.quick ? 2 : 12;
  const std::vector<int64_t> row_counts = args.quick ? std::vector<int64_t>{1, 16} : std::vector<int64_t>{1, 2, 16, 64, 256};
  BenchReport report("linear");
  report.machine() = describe_machine(1);
  report.machine()["threads"] = at::get_num_threads();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> dense, dense_bf16;
  for (int l = 0; l < layers; ++l) {
    for (const Shape& s : layer) {
      dense.push_back(at::randn({s.out, s.in}, gen) * 0.02);
      dense_bf16.push_back(dense.back().to(at::kBFloat16));
    }
  }
  int64_t params = 0;
  for (const auto& w : dense) params += w.numel();
  std::printf("bench linear: %d linears of the d768 GPT (%.1fM weights), %d threads; median ms of all of them\n",
              static_cast<int>(dense.size()), static_cast<double>(params) / 1e6, at::get_num_threads());
  std::printf("  %-26s %6s %10s %10s %10s\n", "kernel", "rows", "ms", "GB/s", "GFLOP/s");
  struct Kernel {
    std::string name;
    std::function<void(const at::Tensor&, const at::Tensor&, int64_t)> run;  // x768, x3072, rows
    int64_t bytes = 0;
  };
  std::vector<Kernel> kernels;
  kernels.push_back({"torch fp32 (at::linear)", [&](const at::Tensor& a, const at::Tensor& b, int64_t) {
                       for (const auto& w : dense) (void)at::linear(w.size(1) == 768 ? a : b, w);
                     }, params * 4});
  kernels.push_back({"torch bf16 (at::linear)", [&](const at::Tensor& a, const at::Tensor& b, int64_t) {
                       const at::Tensor a16 = a.to(at::kBFloat16), b16 = b.to(at::kBFloat16);
                       for (const auto& w : dense_bf16) (void)at::linear(w.size(1) == 768 ? a16 : b16, w);
                     }, params * 2});
  // Our kernels: (format, bf16 dot products, AMX), those this CPU runs.
  struct Ours {
    WeightFormat format;
    bool dot, amx;
    const char* name;
  };
  std::vector<Ours> ours{{WeightFormat::kFP32, false, false, "ours fp32"},
                         {WeightFormat::kBF16, false, false, "ours bf16 widened"},
                         {WeightFormat::kInt8, false, false, "ours int8 widened"}};
  if (inference::have_bf16_dot()) {
    ours.push_back({WeightFormat::kBF16, true, false, "ours bf16 dot products"});
    ours.push_back({WeightFormat::kInt8, true, false, "ours int8 dot products"});
  }
  if (inference::have_amx()) {
    ours.push_back({WeightFormat::kBF16, true, true, "ours bf16 AMX"});
    // int8 on tiles from kVnniRows + 1 rows up, VPDPBUSD below (Note [AMX tiles])
    ours.push_back({WeightFormat::kInt8, true, true, inference::have_avx512_vnni() ? "ours int8 AMX/VNNI" : "ours int8 AMX"});
  }
  for (const Ours& o : ours) {
    auto lin = std::make_shared<std::vector<ServingLinear>>();
    int64_t bytes = 0;
    for (const auto& w : dense) {
      lin->emplace_back(w, at::Tensor(), o.format, o.dot, o.amx);
      bytes += lin->back().weight_bytes();
    }
    kernels.push_back({o.name, [lin](const at::Tensor& a, const at::Tensor& b, int64_t rows) {
                         for (const auto& L : *lin) (void)L.forward(L.in_features() == 768 ? a : b, rows);
                       }, bytes});
  }
  std::map<std::string, std::map<int64_t, double>> ms;
  for (int64_t rows : row_counts) {
    const at::Tensor a = at::randn({rows, 768}, gen), b = at::randn({rows, 3072}, gen);
    const int reps = args.quick ? 3 : rows >= 64 ? 7 : 21;
    for (const Kernel& k : kernels) {
      const double t = time_ms([&] { k.run(a, b, rows); }, reps);
      ms[k.name][rows] = t;
      const double gbs = static_cast<double>(k.bytes) / (t * 1e6), gflops = 2.0 * static_cast<double>(params * rows) / (t * 1e6);
      std::printf("  %-26s %6ld %10.3f %10.1f %10.1f\n", k.name.c_str(), static_cast<long>(rows), t, gbs, gflops);
      report.add_result({{"kernel", k.name}, {"rows", rows}, {"ms", t}, {"weight_gb_per_s", gbs}, {"gflop_per_s", gflops}});
    }
  }
  // Side by side: the best of ours for each format against torch's bf16 linear, at 1 and 16 rows.
  for (const char* fmt : {"bf16", "int8"}) {
    for (int64_t rows : {int64_t{1}, int64_t{16}}) {
      double best = 1e30;
      for (const Ours& o : ours) {
        if (inference::weight_format_name(o.format) == std::string(fmt)) best = std::min(best, ms[o.name][rows]);
      }
      const double ratio = ms["torch bf16 (at::linear)"][rows] / best;
      std::printf("bench linear: %s weights, %ld rows: %.2fx torch's bf16 linear\n", fmt, static_cast<long>(rows), ratio);
      report.add_result({{"format", fmt}, {"rows", rows}, {"speedup_vs_torch_bf16", ratio}});
      report.add_target(std::string(fmt) + " weights, " + std::to_string(rows) + " rows, vs torch bf16 at::linear", ratio, 1.0);
    }
  }
  report.finish(args);
  return 0;
}

}  // namespace torchspeed::bench
