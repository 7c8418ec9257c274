// Fused optimizer kernels over flat fp32 partitions: one multithreaded SIMD pass reads the
// gradient (fp32 or bf16, times a scale that folds loss unscaling and clipping in), updates the
// fp32 master, the moments, and writes the parameter's low-precision copy.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace torchspeed::optim {

// How the updated parameter is written to the model's copy.
enum class ParamOut {
  kNone,        // the master is the model's parameter (fp32 training)
  kFP32,        // plain fp32 copy
  kBF16,        // bfloat16 (round to nearest even)
  kFP16Values,  // fp32 storage holding values rounded to fp16 (see Note [fp16 on CPU])
};

struct AdamHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool adam_w_mode = true;       // decoupled weight decay (AdamW) vs L2 added to the gradient
  bool bias_correction = true;
  int64_t step = 1;              // 1-based step count for bias correction
};

struct SgdHyper {
  double lr = 1e-3, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false;
  bool first_step = true;  // momentum buffer starts as the first gradient (PyTorch's rule)
};

// p, m, v: fp32 [n]. grad: [n] of grad_dtype (kFloat or kBFloat16), multiplied by grad_scale.
// out: [n] written as `out_kind` (ignored for kNone). Same arithmetic as torch::optim::AdamW /
// Adam in fp32, element by element.
void adam_step(float* p, const void* grad, at::ScalarType grad_dtype, float grad_scale, float* m,
               float* v, int64_t n, const AdamHyper& h, void* out, ParamOut out_kind);

// momentum_buf: fp32 [n], or nullptr when momentum == 0.
void sgd_step(float* p, const void* grad, at::ScalarType grad_dtype, float grad_scale,
              float* momentum_buf, int64_t n, const SgdHyper& h, void* out, ParamOut out_kind);

// DeepSpeed's FusedLamb (deepspeed/ops/lamb), per parameter tensor:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  u = m / (sqrt(v) + eps) + wd p   (eps_inside_sqrt:
//   m / sqrt(v + eps));  coeff = ||p|| / ||u|| clamped to [min_coeff, max_coeff], 1 when either norm
//   is zero;  p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * coeff * u  (bias correction only in the step).
// A tensor may be cut across pieces and ranks, so the update runs in two passes: lamb_moments
// over each range of a tensor (its sums of squares are added up, across ranks too), then
// lamb_apply with the whole tensor's coefficient.
struct LambHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  double max_coeff = 10.0, min_coeff = 0.01;
  bool bias_correction = true, eps_inside_sqrt = false;
  int64_t step = 1;
};
struct LambNorms {
  double w_sq = 0.0, u_sq = 0.0;  // sums of squares of the parameter and of the update u
};
// Updates m and v of [0, n) (one tensor's range); returns its share of the two norms.
LambNorms lamb_moments(const float* p, const void* grad, at::ScalarType grad_dtype, float grad_scale, float* m,
                       float* v, int64_t n, const LambHyper& h);
// The trust ratio from a whole tensor's sums.
double lamb_coeff(const LambNorms& whole, const LambHyper& h);
// p -= step_size * coeff * u over [0, n), u from the updated m and v; out as in adam_step.
void lamb_apply(float* p, const float* m, const float* v, int64_t n, const LambHyper& h, double coeff, void* out,
                ParamOut out_kind);

// DeepSpeed's OnebitAdam after its warm-up (deepspeed/runtime/fp16/onebit/adam.py): the local
// momentum m = b1 m + (1 - b1) g, which the caller then replaces by its 1-bit average over the
// data-parallel group; then p -= lr (m / (sqrt(v) + eps) + wd p) with v frozen since the warm-up
// (no bias correction in either phase, as DeepSpeed's).
void onebit_momentum(const void* grad, at::ScalarType grad_dtype, float grad_scale, float* m, int64_t n, double beta1);
void onebit_apply(float* p, const float* m, const float* v, int64_t n, double lr, double eps, double weight_decay,
                  void* out, ParamOut out_kind);

// Sum of squares of grad[0..n) accumulated in fp64: the clipping norm's share of this
// partition; inf or NaN when any element is (overflow detection in the same pass).
double sum_squares(const void* grad, at::ScalarType grad_dtype, int64_t n);

// Writes fp32 values to `out` as out_kind (initial parameter copies).
void write_params(const float* src, int64_t n, void* out, ParamOut out_kind);

}  // namespace torchspeed::optim
