// CPU feature detection, OpenBLAS introspection (through dlsym, so any BLAS may be loaded) and a
// quick GEMM rate measurement.
//
// Note [OpenBLAS core type]
// OpenBLAS picks its kernels once, in a constructor that runs when libblas is loaded, from
// OPENBLAS_CORETYPE or its CPU table. 0.3.21 (Debian 12) has no entry for Sapphire Rapids-era
// CPUs and falls back to Prescott: 33 GFLOP/s sgemm per core instead of 153 with SkylakeX.
// Nothing can switch it after loading, so the value has to be in the environment of the
// process before it starts: the launcher exports it to every rank and the CLI re-executes
// itself once with it (never overriding a value the user set).
#include "torchspeed/base/cpu.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "torchspeed/base/error.h"

namespace torchspeed::cpu {

Features features() {
  Features f;
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (f.model_name.empty() && line.rfind("model name", 0) == 0) {
      auto pos = line.find(':');
      if (pos != std::string::npos) f.model_name = line.substr(pos + 2);
    }
    if (line.rfind("flags", 0) == 0) {
      std::istringstream flags(line.substr(line.find(':') + 1));
      std::set<std::string> set{std::istream_iterator<std::string>(flags), {}};
      auto has = [&](const char* flag) { return set.count(flag) > 0; };
      f.f16c = has("f16c");
      f.avx512_fp16 = has("avx512_fp16");
      f.amx_bf16 = has("amx_bf16");
      break;
    }
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  f.logical_cores = n > 0 ? static_cast<int>(n) : 1;
  cpu_set_t set;
  CPU_ZERO(&set);
  f.affinity_cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : f.logical_cores;
  return f;
}

std::vector<std::string> feature_names(const Features& f) {
  std::vector<std::string> out;
  auto add = [&](bool b, const char* n) { if (b) out.emplace_back(n); };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.avx512_fp16, "avx512_fp16");
  add(f.amx_bf16, "amx_bf16");
  return out;
}

std::string blas_core_name() {
  using Fn = char* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (!fn) return "";
  const char* name = fn();
  return name ? std::string(name) : std::string();
}

bool set_blas_threads(int n) {
  using Fn = void (*)(int);
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!fn) return false;
  fn(n);
  return true;
}

std::string recommended_openblas_coretype() {
  if (std::getenv("OPENBLAS_CORETYPE")) return "";
  return features().avx512f ? "SkylakeX" : "";
}

LibTorchInfo libtorch_info() {
  LibTorchInfo info;
  info.version = TORCH_VERSION;
#ifdef TORCHSPEED_TORCH_PREFIX
  info.prefix = TORCHSPEED_TORCH_PREFIX;
#endif
  std::istringstream config(at::show_config());
  std::string line;
  auto trimmed = [](std::string s) {
    const auto b = s.find_first_not_of(" -\t");
    const auto e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  while (std::getline(config, line)) {
    if (line.find("Math Kernel Library") != std::string::npos) info.mkl = trimmed(line);
    if (line.find("MKL-DNN") != std::string::npos || line.find("oneDNN") != std::string::npos) {
      info.onednn = trimmed(line);
    }
    if (line.find("OpenMP") != std::string::npos && info.openmp.empty()) info.openmp = trimmed(line);
    const auto at = line.find("BLAS_INFO=");
    if (at != std::string::npos) {
      const auto end = line.find(',', at);
      info.blas = line.substr(at + 10, end == std::string::npos ? std::string::npos : end - at - 10);
    }
  }
  return info;
}

double measure_gemm_gflops(const std::string& dtype, int n, int min_runs) {
  at::ScalarType st = dtype == "bf16"   ? at::kBFloat16
                      : dtype == "fp16" ? at::kHalf
                                        : at::kFloat;
  TS_CHECK(dtype == "fp32" || dtype == "bf16" || dtype == "fp16",
           "measure_gemm_gflops: dtype must be fp32, bf16 or fp16, got '", dtype, "'");
  c10::NoGradGuard no_grad;
  auto a = at::randn({n, n}).to(st);
  auto b = at::randn({n, n}).to(st);
  at::Tensor c;
  try {
    c = at::mm(a, b);  // warm-up; fp16 matmul has no CPU kernel in LibTorch 1.13
  } catch (const std::exception&) {
    return 0.0;
  }
  double best = 1e30;
  auto start_all = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    at::mm_out(c, a, b);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_all).count();
    if (i + 1 >= min_runs && total > 0.5) break;
  }
  return 2.0 * n * n * static_cast<double>(n) / best / 1e9;
}

}  // namespace torchspeed::cpu
