// `torchspeed env`: CPU features, the BLAS core in use, threads, versions and measured GEMM
// rates, so a user sees at once whether this machine runs at its speed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>

#include "commands.h"
#include "torchspeed/base/cpu.h"
#include "torchspeed/comm/runtime.h"

namespace torchspeed::cli {

Runner add_env(CLI::App& app) {
  auto* cmd = app.add_subcommand("env", "Show CPU features, BLAS kernels, threads and GEMM speed");
  auto json = std::make_shared<bool>(false);
  auto size = std::make_shared<int>(1024);
  cmd->add_flag("--json", *json, "Print JSON");
  cmd->add_option("--gemm-size", *size, "Matrix size for the GEMM measurement")->check(CLI::Range(64, 8192));
  return [json, size]() {
    auto f = cpu::features();
    const char* coretype = std::getenv("OPENBLAS_CORETYPE");
    const int cores = f.affinity_cores;
    at::set_num_threads(1);
    cpu::set_blas_threads(1);
    double fp32_1 = cpu::measure_gemm_gflops("fp32", *size);
    double bf16_1 = cpu::measure_gemm_gflops("bf16", *size);
    double fp16_1 = cpu::measure_gemm_gflops("fp16", *size);
    at::set_num_threads(cores);
    cpu::set_blas_threads(cores);
    double fp32_n = cpu::measure_gemm_gflops("fp32", *size);
    double bf16_n = cpu::measure_gemm_gflops("bf16", *size);
    double fp16_n = cpu::measure_gemm_gflops("fp16", *size);
    const auto lt = cpu::libtorch_info();
    nlohmann::json j = {
        {"torchspeed", version()},
        {"libtorch", lt.version},
        {"libtorch_prefix", lt.prefix},
        {"libtorch_blas", lt.blas},
        {"mkl", lt.mkl},
        {"onednn", lt.onednn},
        {"openmp", lt.openmp},
        {"mpi", mpi_library_version()},
        {"cpu", f.model_name},
        {"logical_cores", f.logical_cores},
        {"usable_cores", cores},
        {"features", cpu::feature_names(f)},
        {"blas_core", cpu::blas_core_name()},
        {"OPENBLAS_CORETYPE", coretype ? coretype : ""},
        {"gemm_size", *size},
        {"gemm_gflops", {{"fp32_1_thread", fp32_1}, {"bf16_1_thread", bf16_1},
                         {"fp16_1_thread", fp16_1}, {"fp32_all_cores", fp32_n},
                         {"bf16_all_cores", bf16_n}, {"fp16_all_cores", fp16_n}}}};
    if (*json) {
      std::printf("%s\n", j.dump(2).c_str());
      return 0;
    }
    std::string feats;
    for (const auto& s : cpu::feature_names(f)) feats += s + " ";
    std::printf("torchspeed      %s (%s)\n", version(), mpi_library_version().c_str());
    std::printf("libtorch        %s, headers in %s\n", lt.version.c_str(), lt.prefix.c_str());
    std::printf("                BLAS %s%s%s; oneDNN %s; %s\n", lt.blas.c_str(),
                lt.mkl.empty() ? "" : ": ", lt.mkl.c_str(), lt.onednn.empty() ? "none" : lt.onednn.c_str(),
                lt.openmp.empty() ? "no OpenMP" : lt.openmp.c_str());
    std::printf("cpu             %s\n", f.model_name.c_str());
    std::printf("cores           %d logical, %d usable by this process\n", f.logical_cores, cores);
    std::printf("features        %s\n", feats.c_str());
    if (cpu::blas_core_name().empty()) {
      std::printf("blas core       OpenBLAS not loaded (LibTorch's BLAS is %s)\n", lt.blas.c_str());
    } else {
      std::printf("blas core       OpenBLAS %s (OPENBLAS_CORETYPE=%s)\n", cpu::blas_core_name().c_str(),
                  coretype ? coretype : "unset");
    }
    std::printf("gemm %dx%d    fp32 %.1f GFLOP/s (1 thread), %.1f (%d threads)\n", *size, *size,
                fp32_1, fp32_n, cores);
    std::printf("                bf16 %.1f GFLOP/s (1 thread), %.1f (%d threads)\n", bf16_1, bf16_n,
                cores);
    if (fp16_1 > 0) {
      std::printf("                fp16 %.1f GFLOP/s (1 thread), %.1f (%d threads)\n", fp16_1, fp16_n, cores);
    } else {
      std::printf("                fp16 no CPU matmul kernel in LibTorch %s\n", lt.version.c_str());
    }
    return 0;
  };
}

}  // namespace torchspeed::cli
