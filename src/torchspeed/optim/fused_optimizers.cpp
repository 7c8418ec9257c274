// Fused optimizer kernels. Loops are written per element with the dtype choices hoisted out as
// template parameters, so GCC vectorizes them; target_clones builds an AVX-512 and an AVX2
// version picked at load time, and at::parallel_for splits the range over the intra-op threads.
// Compiled with -fno-math-errno so sqrt vectorizes.
#include "torchspeed/optim/fused_optimizers.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "torchspeed/base/error.h"

namespace torchspeed::optim {
namespace {

constexpr int64_t kGrain = 1 << 14;

inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <bool kBf16>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (kBf16) return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
  return static_cast<const float*>(g)[i];
}

template <ParamOut kOut>
inline void store_out(void* out, int64_t i, float v) {
  if constexpr (kOut == ParamOut::kFP32) static_cast<float*>(out)[i] = v;
  if constexpr (kOut == ParamOut::kBF16) static_cast<uint16_t*>(out)[i] = float_to_bf16(v);
  if constexpr (kOut == ParamOut::kFP16Values) static_cast<float*>(out)[i] = static_cast<float>(c10::Half(v));
}

struct AdamConsts {
  float scale, b1, one_minus_b1, b2, one_minus_b2, decay, wd, sqrt_bc2, eps, neg_step;
  bool adam_w;
};

template <bool kBf16, ParamOut kOut>
inline void adam_body(float* __restrict p, const void* __restrict grad, float* __restrict m,
                      float* __restrict v, int64_t b, int64_t e, const AdamConsts& c,
                      void* __restrict out) {
  for (int64_t i = b; i < e; ++i) {
    float g = load_grad<kBf16>(grad, i) * c.scale;
    float pi = p[i];
    if (c.adam_w) {
      pi = pi * c.decay;                        // p.mul_(1 - lr * wd)
    } else {
      g = g + c.wd * pi;                        // grad.add(p, wd)
    }
    const float mi = m[i] * c.b1 + c.one_minus_b1 * g;              // exp_avg.mul_(b1).add_(g, 1-b1)
    const float vi = v[i] * c.b2 + c.one_minus_b2 * g * g;          // exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
    const float denom = std::sqrt(vi) / c.sqrt_bc2 + c.eps;         // (sqrt(v) / sqrt(bc2)).add_(eps)
    pi = pi + c.neg_step * (mi / denom);                            // p.addcdiv_(m, denom, -lr/bc1)
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    store_out<kOut>(out, i, pi);
  }
}

#define TS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

TS_CLONES void adam_f32(float* p, const void* g, float* m, float* v, int64_t b, int64_t e,
                        const AdamConsts& c, void* out, ParamOut k) {
  switch (k) {
    case ParamOut::kNone: return adam_body<false, ParamOut::kNone>(p, g, m, v, b, e, c, out);
    case ParamOut::kFP32: return adam_body<false, ParamOut::kFP32>(p, g, m, v, b, e, c, out);
    case ParamOut::kBF16: return adam_body<false, ParamOut::kBF16>(p, g, m, v, b, e, c, out);
    case ParamOut::kFP16Values: return adam_body<false, ParamOut::kFP16Values>(p, g, m, v, b, e, c, out);
  }
}

TS_CLONES void adam_bf16(float* p, const void* g, float* m, float* v, int64_t b, int64_t e,
                         const AdamConsts& c, void* out, ParamOut k) {
  switch (k) {
    case ParamOut::kNone: return adam_body<true, ParamOut::kNone>(p, g, m, v, b, e, c, out);
    case ParamOut::kFP32: return adam_body<true, ParamOut::kFP32>(p, g, m, v, b, e, c, out);
    case ParamOut::kBF16: return adam_body<true, ParamOut::kBF16>(p, g, m, v, b, e, c, out);
    case ParamOut::kFP16Values: return adam_body<true, ParamOut::kFP16Values>(p, g, m, v, b, e, c, out);
  }
}

template <bool kBf16>
TS_CLONES double sum_squares_range(const void* g, int64_t b, int64_t e) {
  double acc = 0.0;
  for (int64_t i = b; i < e; ++i) {
    const double x = load_grad<kBf16>(g, i);
    acc += x * x;
  }
  return acc;
}

template <ParamOut kOut>
void write_range(const float* src, int64_t b, int64_t e, void* out) {
  for (int64_t i = b; i < e; ++i) store_out<kOut>(out, i, src[i]);
}

void check_grad_dtype(at::ScalarType t) {
  TS_INTERNAL_ASSERT(t == at::kFloat || t == at::kBFloat16, "optimizer gradient dtype ", t);
}

}  // namespace

void adam_step(float* p, const void* grad, at::ScalarType grad_dtype, float grad_scale, float* m,
               float* v, int64_t n, const AdamHyper& h, void* out, ParamOut out_kind) {
  check_grad_dtype(grad_dtype);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, static_cast<double>(h.step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, static_cast<double>(h.step)) : 1.0;
  AdamConsts c;
  c.scale = grad_scale;
  c.b1 = static_cast<float>(h.beta1);
  c.one_minus_b1 = static_cast<float>(1.0 - h.beta1);
  c.b2 = static_cast<float>(h.beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.wd = static_cast<float>(h.weight_decay);
  c.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.neg_step = static_cast<float>(-(h.lr / bc1));
  c.adam_w = h.adam_w_mode;
  const bool bf16 = grad_dtype == at::kBFloat16;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    if (bf16) adam_bf16(p, grad, m, v, b, e, c, out, out_kind);
    else adam_f32(p, grad, m, v, b, e, c, out, out_kind);
  });
}

void sgd_step(float* p, const void* grad, at::ScalarType grad_dtype, float grad_scale,
              float* buf, int64_t n, const SgdHyper& h, void* out, ParamOut out_kind) {
  check_grad_dtype(grad_dtype);
  TS_INTERNAL_ASSERT(h.momentum == 0.0 || buf != nullptr, "SGD momentum needs a buffer");
  const bool bf16 = grad_dtype == at::kBFloat16;
  const float wd = static_cast<float>(h.weight_decay), mom = static_cast<float>(h.momentum),
              damp = static_cast<float>(1.0 - h.dampening), neg_lr = static_cast<float>(-h.lr);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float g = (bf16 ? load_grad<true>(grad, i) : load_grad<false>(grad, i)) * grad_scale;
      if (wd != 0.0f) g = g + wd * p[i];
      if (mom != 0.0f) {
        buf[i] = h.first_step ? g : buf[i] * mom + damp * g;
        g = h.nesterov ? g + mom * buf[i] : buf[i];
      }
      p[i] = p[i] + neg_lr * g;
      switch (out_kind) {
        case ParamOut::kNone: break;
        case ParamOut::kFP32: store_out<ParamOut::kFP32>(out, i, p[i]); break;
        case ParamOut::kBF16: store_out<ParamOut::kBF16>(out, i, p[i]); break;
        case ParamOut::kFP16Values: store_out<ParamOut::kFP16Values>(out, i, p[i]); break;
      }
    }
  });
}

double sum_squares(const void* grad, at::ScalarType grad_dtype, int64_t n) {
  check_grad_dtype(grad_dtype);
  const bool bf16 = grad_dtype == at::kBFloat16;
  return at::parallel_reduce(
      0, n, kGrain, 0.0,
      [&](int64_t b, int64_t e, double acc) {
        return acc + (bf16 ? sum_squares_range<true>(grad, b, e) : sum_squares_range<false>(grad, b, e));
      },
      [](double a, double b) { return a + b; });
}

void write_params(const float* src, int64_t n, void* out, ParamOut k) {
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    switch (k) {
      case ParamOut::kNone: break;
      case ParamOut::kFP32: write_range<ParamOut::kFP32>(src, b, e, out); break;
      case ParamOut::kBF16: write_range<ParamOut::kBF16>(src, b, e, out); break;
      case ParamOut::kFP16Values: write_range<ParamOut::kFP16Values>(src, b, e, out); break;
    }
  });
}

namespace {
struct LambConsts {
  float scale, b1, one_minus_b1, b2, one_minus_b2, eps, wd;
  bool eps_inside;
};

inline float lamb_update(float p, float m, float v, const LambConsts& c) {
  const float denom = c.eps_inside ? std::sqrt(v + c.eps) : std::sqrt(v) + c.eps;
  return m / denom + c.wd * p;
}

template <bool kBf16>
TS_CLONES LambNorms lamb_moments_range(const float* p, const void* grad, float* m, float* v, int64_t b, int64_t e,
                                       const LambConsts& c) {
  double w = 0.0, u = 0.0;
  for (int64_t i = b; i < e; ++i) {
    const float g = load_grad<kBf16>(grad, i) * c.scale;
    const float mi = m[i] * c.b1 + c.one_minus_b1 * g;
    const float vi = v[i] * c.b2 + c.one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float ui = lamb_update(p[i], mi, vi, c);
    w += static_cast<double>(p[i]) * p[i];
    u += static_cast<double>(ui) * ui;
  }
  return {w, u};
}

template <ParamOut kOut>
TS_CLONES void lamb_apply_range(float* p, const float* m, const float* v, int64_t b, int64_t e, const LambConsts& c,
                                float neg_step, void* out) {
  for (int64_t i = b; i < e; ++i) {
    const float pi = p[i] + neg_step * lamb_update(p[i], m[i], v[i], c);
    p[i] = pi;
    store_out<kOut>(out, i, pi);
  }
}

LambConsts lamb_consts(const LambHyper& h, float grad_scale) {
  return {grad_scale,
          static_cast<float>(h.beta1),
          static_cast<float>(1.0 - h.beta1),
          static_cast<float>(h.beta2),
          static_cast<float>(1.0 - h.beta2),
          static_cast<float>(h.eps),
          static_cast<float>(h.weight_decay),
          h.eps_inside_sqrt};
}
}  // namespace

LambNorms lamb_moments(const float* p, const void* grad, at::ScalarType grad_dtype, float grad_scale, float* m,
                       float* v, int64_t n, const LambHyper& h) {
  check_grad_dtype(grad_dtype);
  const LambConsts c = lamb_consts(h, grad_scale);
  const bool bf16 = grad_dtype == at::kBFloat16;
  return at::parallel_reduce(
      0, n, kGrain, LambNorms{},
      [&](int64_t b, int64_t e, LambNorms acc) {
        const LambNorms r = bf16 ? lamb_moments_range<true>(p, grad, m, v, b, e, c)
                                 : lamb_moments_range<false>(p, grad, m, v, b, e, c);
        return LambNorms{acc.w_sq + r.w_sq, acc.u_sq + r.u_sq};
      },
      [](LambNorms a, LambNorms b) { return LambNorms{a.w_sq + b.w_sq, a.u_sq + b.u_sq}; });
}

double lamb_coeff(const LambNorms& whole, const LambHyper& h) {
  const double w = std::sqrt(whole.w_sq), u = std::sqrt(whole.u_sq);
  if (w == 0.0 || u == 0.0) return 1.0;
  return std::max(h.min_coeff, std::min(h.max_coeff, w / u));
}

void lamb_apply(float* p, const float* m, const float* v, int64_t n, const LambHyper& h, double coeff, void* out,
                ParamOut out_kind) {
  const LambConsts c = lamb_consts(h, 1.0f);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, static_cast<double>(h.step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, static_cast<double>(h.step)) : 1.0;
  const float neg_step = static_cast<float>(-h.lr * std::sqrt(bc2) / bc1 * coeff);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    switch (out_kind) {
      case ParamOut::kNone: return lamb_apply_range<ParamOut::kNone>(p, m, v, b, e, c, neg_step, out);
      case ParamOut::kFP32: return lamb_apply_range<ParamOut::kFP32>(p, m, v, b, e, c, neg_step, out);
      case ParamOut::kBF16: return lamb_apply_range<ParamOut::kBF16>(p, m, v, b, e, c, neg_step, out);
      case ParamOut::kFP16Values: return lamb_apply_range<ParamOut::kFP16Values>(p, m, v, b, e, c, neg_step, out);
    }
  });
}

namespace {
template <bool kBf16>
TS_CLONES void onebit_momentum_range(const void* grad, float scale, float* m, int64_t b, int64_t e, float b1,
                                     float one_minus_b1) {
  for (int64_t i = b; i < e; ++i) m[i] = m[i] * b1 + one_minus_b1 * (load_grad<kBf16>(grad, i) * scale);
}

template <ParamOut kOut>
TS_CLONES void onebit_apply_range(float* p, const float* m, const float* v, int64_t b, int64_t e, float neg_lr,
                                  float eps, float wd, void* out) {
  for (int64_t i = b; i < e; ++i) {
    const float pi = p[i] + neg_lr * (m[i] / (std::sqrt(v[i]) + eps) + wd * p[i]);
    p[i] = pi;
    store_out<kOut>(out, i, pi);
  }
}
}  // namespace

void onebit_momentum(const void* grad, at::ScalarType grad_dtype, float grad_scale, float* m, int64_t n, double beta1) {
  check_grad_dtype(grad_dtype);
  const bool bf16 = grad_dtype == at::kBFloat16;
  const float b1 = static_cast<float>(beta1), omb1 = static_cast<float>(1.0 - beta1);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    if (bf16) onebit_momentum_range<true>(grad, grad_scale, m, b, e, b1, omb1);
    else onebit_momentum_range<false>(grad, grad_scale, m, b, e, b1, omb1);
  });
}

void onebit_apply(float* p, const float* m, const float* v, int64_t n, double lr, double eps, double weight_decay,
                  void* out, ParamOut out_kind) {
  const float neg_lr = static_cast<float>(-lr), e_ = static_cast<float>(eps), wd = static_cast<float>(weight_decay);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    switch (out_kind) {
      case ParamOut::kNone: return onebit_apply_range<ParamOut::kNone>(p, m, v, b, e, neg_lr, e_, wd, out);
      case ParamOut::kFP32: return onebit_apply_range<ParamOut::kFP32>(p, m, v, b, e, neg_lr, e_, wd, out);
      case ParamOut::kBF16: return onebit_apply_range<ParamOut::kBF16>(p, m, v, b, e, neg_lr, e_, wd, out);
      case ParamOut::kFP16Values: return onebit_apply_range<ParamOut::kFP16Values>(p, m, v, b, e, neg_lr, e_, wd, out);
    }
  });
}

}  // namespace torchspeed::optim
