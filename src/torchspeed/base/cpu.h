// What this CPU can do and how fast the BLAS under LibTorch runs on it.
// See Note [OpenBLAS core type]: Debian's OpenBLAS 0.3.21 does not recognise recent Intel CPUs
// and runs its Prescott kernels (4.6x slower sgemm) unless OPENBLAS_CORETYPE is set before the
// library loads, so torchspeed sets it for every process it launches.
#pragma once

#include <string>
#include <vector>

namespace torchspeed::cpu {

struct Features {
  std::string model_name;     // from /proc/cpuinfo
  int logical_cores = 1;      // online logical CPUs
  int affinity_cores = 1;     // CPUs this process may run on
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_bf16 = false,
       avx512_fp16 = false, amx_bf16 = false;
};
Features features();
std::vector<std::string> feature_names(const Features& f);  // the flags that are set

// The OpenBLAS core the loaded BLAS runs ("Prescott", "SkylakeX", ...), or "" when the BLAS
// under LibTorch is not OpenBLAS.
std::string blas_core_name();
// Sets OpenBLAS's own thread count (at::set_num_threads does not); false when not OpenBLAS.
bool set_blas_threads(int n);

// The OPENBLAS_CORETYPE value processes should get, or "" when it is set already or the CPU
// needs none (no AVX-512).
std::string recommended_openblas_coretype();

// The LibTorch this build runs on: version, install prefix, and the BLAS, oneDNN and OpenMP
// it was built with (from at::show_config(), so it is what is loaded, not what we hoped for).
struct LibTorchInfo {
  std::string version;  // TORCH_VERSION of the headers we were compiled with
  std::string prefix;   // the install whose headers we were compiled with
  std::string blas;     // BLAS_INFO: "mkl", "open" (OpenBLAS), ...
  std::string mkl;      // MKL's version line, "" without MKL
  std::string onednn;   // oneDNN's (MKL-DNN's) version line, "" without it
  std::string openmp;   // "OpenMP 201511", "" without it
};
LibTorchInfo libtorch_info();

// Measured matmul rate in GFLOP/s for an n x n x n product in the given dtype ("fp32", "bf16",
// "fp16"), best of a few runs with the current thread settings.
double measure_gemm_gflops(const std::string& dtype, int n, int min_runs = 3);

}  // namespace torchspeed::cpu
