// Note [Fused block operators]
// The Llama-family block spelled out in ATen (as transformers writes it) spends a third of a
// training step outside its matrix products on this CPU (SmolLM2-135M's shape, fp32, 2 ranks:
// 1.2 s of a 4.4 s step, bench train's breakdown): RMSNorm is eight element-wise passes forward
// and backward, rotary positions a cat of four products, and every narrow of the fused qkv and
// gate/up projections comes back in backward as a zero-filled full-size gradient that autograd
// then adds up. Each operator here is one autograd node:
//   rms_norm        forward one read for the sum of squares and one read/write; backward two
//                   reads of x and dy per row, the weight's gradient summed per 64-row chunk
//                   (fixed chunks: the same sums whatever the thread count)
//   split_qkv_rope  forward writes q, k, v in attention's layout with the rotation applied and
//                   KV heads repeated; backward writes the one qkv gradient, rotated back, the
//                   repeated heads' gradients summed (what repeat_interleave's backward does)
//   swiglu          backward writes gate and up gradients straight into one tensor
// Arithmetic is in fp32 (fp64 for fp64 inputs), each output rounded once to the input's dtype;
// RMSNorm rounds the normalised value before the weight multiplies it, as transformers does.
#include "torchspeed/nn/fused_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "torchspeed/base/error.h"

namespace torchspeed::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename T>
using acc_t = std::conditional_t<std::is_same<T, double>::value, double, float>;

// Sum of a[i] * b[i] in 16 independent lanes (so the compiler vectorises it), then across them.
template <typename T, typename U, typename A = acc_t<T>>
A dot(const T* a, const U* b, int64_t n) {
  A lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] += static_cast<A>(a[i + j]) * static_cast<A>(b[i + j]);
  }
  A s = 0;
  for (; i < n; ++i) s += static_cast<A>(a[i]) * static_cast<A>(b[i]);
  for (int j = 0; j < 16; ++j) s += lanes[j];
  return s;
}

constexpr int64_t kRowChunk = 64;

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
    const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
    const int64_t D = x.size(-1), N = x.numel() / std::max<int64_t>(D, 1);
    at::Tensor y = at::empty_like(x);
    at::Tensor rstd = at::empty({N}, x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
      using A = acc_t<scalar_t>;
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* wp = w.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      A* rp = rstd.data_ptr<A>();
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          const scalar_t* xr = xp + n * D;
          scalar_t* yr = yp + n * D;
          const A r = A(1) / std::sqrt(dot(xr, xr, D) / static_cast<A>(D) + static_cast<A>(eps));
          rp[n] = r;
          for (int64_t i = 0; i < D; ++i) {
            const scalar_t t = static_cast<scalar_t>(static_cast<A>(xr[i]) * r);
            yr[i] = static_cast<scalar_t>(static_cast<A>(wp[i]) * static_cast<A>(t));
          }
        }
      });
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor dy = grads[0].contiguous();
    const int64_t D = x.size(-1), N = x.numel() / std::max<int64_t>(D, 1);
    const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
    at::Tensor dx = at::empty_like(x);
    at::Tensor dw_parts = at::zeros({std::max<int64_t>(chunks, 1), D}, rstd.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_backward", [&] {
      using A = acc_t<scalar_t>;
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* wp = w.data_ptr<scalar_t>();
      const scalar_t* gp = dy.data_ptr<scalar_t>();
      const A* rp = rstd.data_ptr<A>();
      scalar_t* dxp = dx.data_ptr<scalar_t>();
      A* dwp = dw_parts.data_ptr<A>();
      at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
        std::vector<A> g(D);
        for (int64_t c = cb; c < ce; ++c) {
          A* dw = dwp + c * D;
          for (int64_t n = c * kRowChunk; n < std::min(N, (c + 1) * kRowChunk); ++n) {
            const scalar_t* xr = xp + n * D;
            const scalar_t* dyr = gp + n * D;
            const A r = rp[n];
            // g = dy * w; the normalised t = x r; dx = r (g - t mean(g t)).
            A gt_lanes[16] = {};
            A gt = 0;
            int64_t i = 0;
            for (; i + 16 <= D; i += 16) {
              for (int j = 0; j < 16; ++j) {
                const A gi = static_cast<A>(dyr[i + j]) * static_cast<A>(wp[i + j]);
                const A ti = static_cast<A>(xr[i + j]) * r;
                g[i + j] = gi;
                gt_lanes[j] += gi * ti;
                dw[i + j] += static_cast<A>(dyr[i + j]) * static_cast<A>(static_cast<scalar_t>(ti));
              }
            }
            for (; i < D; ++i) {
              const A gi = static_cast<A>(dyr[i]) * static_cast<A>(wp[i]);
              const A ti = static_cast<A>(xr[i]) * r;
              g[i] = gi;
              gt += gi * ti;
              dw[i] += static_cast<A>(dyr[i]) * static_cast<A>(static_cast<scalar_t>(ti));
            }
            for (int j = 0; j < 16; ++j) gt += gt_lanes[j];
            const A m = gt / static_cast<A>(D);
            scalar_t* dxr = dxp + n * D;
            for (int64_t k = 0; k < D; ++k) dxr[k] = static_cast<scalar_t>(r * (g[k] - static_cast<A>(xr[k]) * r * m));
          }
        }
      });
    });
    return {dx, dw_parts.sum(0).to(w.scalar_type()), at::Tensor()};
  }
};

struct SwigluFn : torch::autograd::Function<SwigluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& f) {
    const int64_t F = f.size(-1) / 2;
    const at::Tensor gate = f.narrow(-1, 0, F), up = f.narrow(-1, F, F);
    at::Tensor s = at::silu(gate);
    at::Tensor out = s * up;
    ctx->save_for_backward({f, s});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &f = saved[0], &s = saved[1];
    const int64_t F = f.size(-1) / 2;
    const at::Tensor& dy = grads[0];
    at::Tensor df = at::empty_like(f, at::MemoryFormat::Contiguous);
    at::Tensor dgate = df.narrow(-1, 0, F), dup = df.narrow(-1, F, F);
    at::mul_out(dup, dy, s);
    at::silu_backward_out(dgate, dy * f.narrow(-1, F, F), f.narrow(-1, 0, F));
    return {df};
  }
};

// Rotates one head (rotate-half convention) from src into dst; c, s: the position's hd/2 values.
// inverse: the transpose of the rotation (backward).
template <typename T, typename A>
inline void rotate(const A* src, T* dst, const float* c, const float* s, int64_t half, bool inverse) {
  const A sign = inverse ? A(-1) : A(1);
  for (int64_t i = 0; i < half; ++i) {
    const A x1 = src[i], x2 = src[i + half], ci = c[i], si = s[i] * sign;
    dst[i] = static_cast<T>(x1 * ci - x2 * si);
    dst[i + half] = static_cast<T>(x2 * ci + x1 * si);
  }
}

struct SplitQkvRopeFn : torch::autograd::Function<SplitQkvRopeFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv_in, int64_t H, int64_t KV, int64_t hd,
                               const at::Tensor& cos, const at::Tensor& sin) {
    const at::Tensor qkv = qkv_in.contiguous();
    const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), G = H / KV, half = hd / 2;
    const bool rope = cos.numel() > 0;
    at::Tensor q = at::empty({B, H, T, hd}, qkv.options()), k = at::empty_like(q), v = at::empty_like(q);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "split_qkv_rope", [&] {
      using A = acc_t<scalar_t>;
      const scalar_t* in = qkv.data_ptr<scalar_t>();
      scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
      const float* cp = rope ? cos.data_ptr<float>() : nullptr;
      const float* sp = rope ? sin.data_ptr<float>() : nullptr;
      at::parallel_for(0, B * T, 8, [&](int64_t begin, int64_t end) {
        std::vector<A> buf(hd);
        std::vector<scalar_t> rot(hd);
        for (int64_t bt = begin; bt < end; ++bt) {
          const int64_t b = bt / T, t = bt % T;
          const scalar_t* row = in + bt * W;
          auto at_head = [&](scalar_t* base, int64_t h) { return base + ((b * H + h) * T + t) * hd; };
          auto head_in = [&](int64_t h, scalar_t* dst) {  // one input head, rotated when rope
            const scalar_t* src = row + h * hd;
            if (!rope) {
              for (int64_t i = 0; i < hd; ++i) dst[i] = src[i];
              return;
            }
            for (int64_t i = 0; i < hd; ++i) buf[i] = static_cast<A>(src[i]);
            rotate(buf.data(), dst, cp + t * half, sp + t * half, half, false);
          };
          for (int64_t h = 0; h < H; ++h) head_in(h, at_head(qp, h));
          for (int64_t j = 0; j < KV; ++j) {
            head_in(H + j, rot.data());
            const scalar_t* vsrc = row + (H + KV + j) * hd;
            for (int64_t g = 0; g < G; ++g) {
              scalar_t* kd = at_head(kp, j * G + g);
              scalar_t* vd = at_head(vp, j * G + g);
              for (int64_t i = 0; i < hd; ++i) kd[i] = rot[i], vd[i] = vsrc[i];
            }
          }
        }
      });
    });
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["shape"] = std::vector<int64_t>{B, T, W, H, KV, hd};
    return {q, k, v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &cos = saved[0], &sin = saved[1];
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t B = shape[0], T = shape[1], W = shape[2], H = shape[3], KV = shape[4], hd = shape[5];
    const int64_t G = H / KV, half = hd / 2;
    const bool rope = cos.numel() > 0;
    at::ScalarType dtype = at::kFloat;
    for (const auto& g : grads)
      if (g.defined()) dtype = g.scalar_type();
    // Read in place with their strides (SDPA's gradients are [B, T, H, hd] buffers seen as
    // [B, H, T, hd]); only a head dimension that is not contiguous is copied.
    std::array<at::Tensor, 3> d;
    for (int i = 0; i < 3; ++i) {
      d[i] = grads[i].defined() ? grads[i] : at::zeros({B, H, T, hd}, at::TensorOptions().dtype(dtype));
      if (d[i].stride(3) != 1 || d[i].scalar_type() != dtype) d[i] = d[i].to(dtype).contiguous();
    }
    at::Tensor dqkv = at::empty({B, T, W}, d[0].options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "split_qkv_rope_backward", [&] {
      using A = acc_t<scalar_t>;
      const scalar_t *dq = d[0].data_ptr<scalar_t>(), *dk = d[1].data_ptr<scalar_t>(), *dv = d[2].data_ptr<scalar_t>();
      scalar_t* out = dqkv.data_ptr<scalar_t>();
      const float* cp = rope ? cos.data_ptr<float>() : nullptr;
      const float* sp = rope ? sin.data_ptr<float>() : nullptr;
      at::parallel_for(0, B * T, 8, [&](int64_t begin, int64_t end) {
        std::vector<A> sum(hd);
        for (int64_t bt = begin; bt < end; ++bt) {
          const int64_t b = bt / T, t = bt % T;
          scalar_t* row = out + bt * W;
          // The gradient of heads [h0, h0 + n) summed, rotated back when rope, into dst.
          auto head_out = [&](int which, int64_t h0, int64_t n, bool rotated, scalar_t* dst) {
            const scalar_t* base = which == 0 ? dq : which == 1 ? dk : dv;
            const auto st = d[which].strides();
            for (int64_t i = 0; i < hd; ++i) sum[i] = 0;
            for (int64_t h = h0; h < h0 + n; ++h) {
              const scalar_t* src = base + b * st[0] + h * st[1] + t * st[2];
              for (int64_t i = 0; i < hd; ++i) sum[i] += static_cast<A>(src[i]);
            }
            if (rotated && rope) {
              rotate(sum.data(), dst, cp + t * half, sp + t * half, half, true);
            } else {
              for (int64_t i = 0; i < hd; ++i) dst[i] = static_cast<scalar_t>(sum[i]);
            }
          };
          for (int64_t h = 0; h < H; ++h) head_out(0, h, 1, true, row + h * hd);
          for (int64_t j = 0; j < KV; ++j) {
            head_out(1, j * G, G, true, row + (H + j) * hd);
            head_out(2, j * G, G, false, row + (H + KV + j) * hd);
          }
        }
      });
    });
    return {dqkv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TS_CHECK(x.device().is_cpu() && weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
               weight.size(0) == x.size(-1),
           "rms_norm: x ", x.scalar_type(), " ", x.sizes(), " and weight ", weight.scalar_type(), " ", weight.sizes(),
           " must be CPU tensors of one dtype, the weight as wide as x's last dimension");
  return RmsNormFn::apply(x, weight, eps);
}

at::Tensor swiglu(const at::Tensor& f) {
  TS_CHECK(f.size(-1) % 2 == 0, "swiglu: the last dimension (", f.size(-1), ") must be [gate | up], even");
  return SwigluFn::apply(f);
}

std::array<at::Tensor, 3> split_qkv_rope(const at::Tensor& qkv, int64_t H, int64_t KV, int64_t hd, const at::Tensor& cos,
                                         const at::Tensor& sin) {
  TS_CHECK(qkv.dim() == 3 && qkv.device().is_cpu() && KV > 0 && H % KV == 0 && qkv.size(2) == (H + 2 * KV) * hd,
           "split_qkv_rope: qkv ", qkv.sizes(), " is not [B, T, (", H, " + 2 x ", KV, ") x ", hd, "]");
  if (cos.defined()) {
    TS_CHECK(hd % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                 sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == hd / 2 && cos.sizes() == sin.sizes(),
             "split_qkv_rope: rotary tables must be contiguous fp32 [positions, ", hd / 2, "], got ", cos.sizes());
    TS_CHECK(qkv.size(1) <= cos.size(0), "sequence of ", qkv.size(1), " tokens is longer than the model's seq_len ",
             cos.size(0));
  }
  // Custom autograd nodes take defined tensors only: no rotation is an empty table.
  const at::Tensor none = at::empty({0}, at::kFloat);
  auto out = SplitQkvRopeFn::apply(qkv, H, KV, hd, cos.defined() ? cos : none, sin.defined() ? sin : none);
  return {out[0], out[1], out[2]};
}

}  // namespace torchspeed::nn
