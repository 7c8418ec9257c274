// `torchspeed bench adam`: the fused AdamW kernel beside torch::optim::AdamW on 50M parameters,
// alternating which runs first, with identical inputs; results compared to 1e-6.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "bench_report.h"
#include "torchspeed/optim/fused_optimizers.h"
#include "torchspeed/base/error.h"

namespace torchspeed::bench {

int run_adam(const BenchArgs& args) {
  const int64_t n = args.quick ? 2000000 : 50000000;
  const int steps = args.quick ? 3 : 8;
  BenchReport report("adam");
  report.machine() = describe_machine(1);
  // LibTorch's optimizer sees the model as its real parameter tensors (here 50 tensors).
  const int64_t tensors = 50, per = n / tensors;
  std::vector<at::Tensor> ref_params;
  for (int64_t i = 0; i < tensors; ++i) ref_params.push_back(torch::randn({per}).set_requires_grad(true));
  at::Tensor flat = at::cat(ref_params).detach().clone();
  at::Tensor m = at::zeros_like(flat), v = at::zeros_like(flat);
  torch::optim::AdamW opt(ref_params, torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.1));
  optim::AdamHyper h;
  h.lr = 1e-3; h.beta1 = 0.9; h.beta2 = 0.95; h.weight_decay = 0.1;
  std::vector<double> t_fused, t_torch;
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  for (int step = 1; step <= steps; ++step) {
    at::Tensor g = torch::randn({per * tensors});
    for (int64_t i = 0; i < tensors; ++i) ref_params[i].mutable_grad() = g.narrow(0, i * per, per).clone();
    auto run_fused = [&] {
      h.step = step;
      auto t0 = now();
      optim::adam_step(flat.data_ptr<float>(), g.data_ptr(), at::kFloat, 1.0f, m.data_ptr<float>(),
                       v.data_ptr<float>(), flat.numel(), h, nullptr, optim::ParamOut::kNone);
      t_fused.push_back(secs(t0, now()));
    };
    auto run_torch = [&] {
      auto t0 = now();
      opt.step();
      t_torch.push_back(secs(t0, now()));
    };
    if (step % 2) { run_fused(); run_torch(); } else { run_torch(); run_fused(); }
  }
  const double diff = ((flat - at::cat(ref_params).detach()).abs().max() / flat.abs().max()).item<double>();
  // The first step of each allocates LibTorch's state: compare steady steps.
  std::vector<double> f(t_fused.begin() + 1, t_fused.end()), t(t_torch.begin() + 1, t_torch.end());
  const double tf = median(f), tt = median(t);
  const double bytes = 4.0 * n * 7;  // read p, g, m, v; write p, m, v
  std::printf("bench adam: %ld parameters in %ld tensors, %d threads\n", static_cast<long>(n),
              static_cast<long>(tensors), at::get_num_threads());
  std::printf("  fused AdamW          %8.4f s/step  %6.1f GB/s\n", tf, bytes / tf / 1e9);
  std::printf("  torch::optim::AdamW  %8.4f s/step  %6.1f GB/s\n", tt, bytes / tt / 1e9);
  std::printf("  speed-up %.2fx, max relative difference after %d steps %.2e\n", tt / tf, steps, diff);
  report.add_result({{"impl", "torchspeed_fused"}, {"params", n}, {"seconds", t_fused}, {"seconds_median", tf}});
  report.add_result({{"impl", "torch_optim_adamw"}, {"params", n}, {"seconds", t_torch}, {"seconds_median", tt}});
  report.add_target("fused AdamW speed-up over torch::optim::AdamW", tt / tf, 4.0);
  report.add_target("max relative parameter difference", diff, 1e-6, /*higher_is_better=*/false);
  report.finish(args);
  return 0;
}

}  // namespace torchspeed::bench
