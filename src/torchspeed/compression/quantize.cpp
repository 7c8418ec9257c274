#include "torchspeed/compression/quantize.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "torchspeed/base/error.h"

namespace torchspeed::compression {

at::Tensor quantize(const at::Tensor& x_in, int bits, int64_t groups, bool symmetric, const at::Tensor& noise) {
  TS_CHECK(bits >= 1 && bits <= 16, "quantize: ", bits, " bits is outside [1, 16]");
  TS_CHECK(groups >= 1 && x_in.numel() % groups == 0, "quantize: ", groups, " groups do not divide a tensor of ",
           x_in.numel(), " elements ", x_in.sizes());
  c10::NoGradGuard no_grad;
  const at::Tensor x = x_in.detach().to(at::kFloat).reshape({groups, -1});
  at::Tensor out;
  if (bits >= 3) {
    const double range = static_cast<double>(int64_t{1} << bits);
    at::Tensor r = noise.defined() ? noise.to(at::kFloat).reshape({groups, -1}) : at::Tensor();
    if (symmetric) {
      const at::Tensor scale = 2.0 * x.abs().amax(-1, /*keepdim=*/true) / range;
      at::Tensor v = x / scale;
      if (r.defined()) v = v + r;
      out = v.round().clamp(-range / 2, range / 2 - 1) * scale;
    } else {
      const at::Tensor lo = x.amin(-1, true), hi = x.amax(-1, true);
      const at::Tensor scale = (hi - lo) / range;
      const at::Tensor zero = (lo / scale).round() * scale;
      at::Tensor v = (x - zero) / scale;
      if (r.defined()) v = v + r;
      out = v.round().clamp(0, range - 1) * scale + zero;
    }
  } else if (bits == 2) {
    const int64_t n = x.size(1);
    const at::Tensor thres = 0.7 * x.abs().sum(-1, true) / static_cast<double>(n);
    const at::Tensor pos = (x > thres).to(at::kFloat), neg = (x < -thres).to(at::kFloat);
    const at::Tensor mask = (x.abs() > thres).to(at::kFloat);
    const at::Tensor alpha = (mask * x).abs().sum(-1, true) / mask.sum(-1, true);
    out = alpha * pos - alpha * neg;
  } else {
    const int64_t n = x.size(1);
    out = x.sign() * (x.abs().sum(-1, true) / static_cast<double>(n));
  }
  return out.reshape(x_in.sizes()).to(x_in.scalar_type());
}

at::Tensor straight_through(const at::Tensor& x, const at::Tensor& q) { return x + (q - x).detach(); }

at::Tensor weight_of(const SiteState& s, const at::Tensor& w) {
  if (s.weight_bits == 0) return w;
  TS_CHECK(w.numel() % s.weight_groups == 0, s.groups_key, ": ", s.weight_groups, " groups do not divide ", s.name,
           "'s weight of shape ", w.sizes(), " (", w.numel(), " elements)");
  at::Tensor noise;
  if (s.weight_stochastic) noise = at::empty(w.sizes(), w.options().dtype(at::kFloat)).uniform_(-0.5, 0.5);
  at::Tensor q = quantize(w, s.weight_bits, s.weight_groups, s.weight_symmetric, noise);
  if (s.weight_mixed) {
    c10::NoGradGuard no_grad;
    q = (s.weight_keep_ratio * w.detach().to(at::kFloat) + (1.0 - s.weight_keep_ratio) * q.to(at::kFloat))
            .to(w.scalar_type());
  }
  return straight_through(w, q);
}

at::Tensor input_of(const SiteState& s, const at::Tensor& x) {
  if (s.input_bits == 0) return x;
  const int64_t tokens = x.numel() / x.size(-1);
  return straight_through(x, quantize(x, s.input_bits, tokens, s.input_symmetric));
}

}  // namespace torchspeed::compression
