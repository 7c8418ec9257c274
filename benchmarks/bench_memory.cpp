// `torchspeed bench memory`: bytes per rank for a ~100M-parameter model at dp 1/2/4 x ZeRO 0-3 x
// fp32/bf16, measured in LibTorch's CPU allocator (runtime/memory_counter.h) beside the ZeRO
// paper's formulas: the model states at rest after initialize, and the peaks while forward,
// backward and step of one training step run, beside the formula plus the activation and
// bucket terms that explain them (Note [Predicted peaks]). Launched on 4 ranks; for dp < 4 the
// first dp ranks train and the others wait.
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench_report.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/memory_counter.h"

namespace torchspeed::bench {
namespace {

int64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// ZeRO paper, mixed precision (K = 12: fp32 master, momentum, variance): params 2 bytes; fp32
// training has no separate master (K = 8) and 4-byte params. Gradients in the accumulation
// dtype, `grad_bytes`: the paper's 2 for fp16 gradients; 4 for the engine's default fp32
// accumulation also in bf16 training (DeepSpeed's bf16 optimizer does the same; 2 with
// data_types.grad_accum_dtype bf16).
double formula(int stage, bool bf16, int dp, double psi, double grad_bytes) {
  const double p = bf16 ? 2 : 4, g = grad_bytes, k = bf16 ? 12 : 8;
  switch (stage) {
    case 0:
      return (p + g + k) * psi;
    case 1:
      return (p + g) * psi + k * psi / dp;
    case 2:
      return p * psi + (g + k) * psi / dp;
    default:
      return (p + g + k) * psi / dp;
  }
}

// The benchmark's model, batch and buckets. Every unit is a whole number of layers, so the
// bucket terms are exact multiples of one layer.
struct Dims {
  int64_t width = 0, layers = 12, batch = 0;
  int64_t layer() const { return width * width + width; }  // elements of one Linear(width, width)
  int64_t act() const { return batch * width; }     // elements of one activation [batch, width]
  int64_t bucket() const { return 2 * layer(); }    // reduce_bucket_size: units of 2 layers
  int64_t prefetch() const { return 2 * layer(); }  // stage3_prefetch_bucket_size
  int64_t max_live() const { return 3 * layer(); }  // stage3_max_live_parameters: 3 layers
};

struct Case {
  int dp = 1, stage = 0;
  bool overlap = false, bf16 = false;
};

// Note [Predicted peaks]
// What is live above the model states (the formula) at the moment each verb is expected to
// peak, for this stack of L Linear layers with an MSE loss (A = batch x width elements of one
// activation, b = bytes of the compute dtype, 4 or 2; s = elements of one layer; U = 2 s, the
// gradient unit of stages 0-2, one layer at stage 3; Psi the parameters):
//   forward, act: every layer's output is kept for backward (L A b), bf16 adds the input cast
//     (A b) and the loss's fp32 copy of the output (4 A); the loss adds its elementwise
//     temporary (4 A). buf, stage 3: the gathered layers, the running one and those
//     prefetched, at most stage3_max_live_parameters (3 s b).
//   backward, the larger of two moments:
//     while the last layer's backward runs - act: forward's activations without the loss
//       temporary plus an activation gradient in and out (2 A b); buf: one layer's gradient as
//       autograd returns it (s b) before the hook moves it into the unit's buffer, and then
//       without overlap_comm the unit being reduced while the hook waits (stage 2: its full
//       gradient, U b, and for stages 1-2 the reduce-scatter output, U b / dp), with
//       overlap_comm two units' full gradients (the one filling, the one being reduced) and a
//       reduce-scatter output (2 U b + U b / dp), and stage 3's gathered layers (3 s b);
//     when backward returns - act: none (freed); buf: with overlap_comm the last two units
//       still being reduced; without it nothing (every bucket was reduced in its hook, as
//       DeepSpeed reduces a full bucket whether or not it overlaps).
//   step: buf, what backward left in flight; the update runs in place over the partitions.
// With overlap_comm the prediction assumes each unit's reduction finishes while the next
// fills (DeepSpeed's two-bucket model); a measured peak above it means reductions were still
// in flight, holding their units' full gradients (the ratio column shows it).
struct Terms {
  double act = 0, buf = 0;
  double total() const { return act + buf; }
};
struct Prediction {
  Terms forward, backward, step;
};

Prediction predict(const Case& c, const Dims& d) {
  const double b = c.bf16 ? 2 : 4, A = static_cast<double>(d.act()),
               s = static_cast<double>(d.layer());
  const double L = static_cast<double>(d.layers);
  const double U = c.stage == 3 ? s : static_cast<double>(d.bucket()), dp = c.dp;
  const bool overlap = c.overlap && c.stage >= 2;
  const double gathered = c.stage == 3 ? 3 * s * b : 0.0;
  const double kept = L * A * b + (c.bf16 ? A * b + 4 * A : 0.0);
  const double in_flight = overlap ? 2 * U * b + U * b / dp : 0.0;
  Prediction p;
  p.forward = {kept + 4 * A, gathered};
  const double waited = overlap || c.stage == 0 || c.stage == 3 ? 0.0 : (c.stage == 2 ? U * b : 0.0) + U * b / dp;
  const Terms during{kept + 2 * A * b, s * b + in_flight + waited + gathered};
  Terms after;
  if (overlap) after.buf = in_flight;
  p.backward = during.total() >= after.total() ? during : after;
  p.step = after;
  return p;
}

struct Measured {
  double rest = 0, forward = 0, backward = 0, step = 0;  // bytes live; peaks of each verb
};

}  // namespace

int run_memory(const BenchArgs& args) {
  auto world = comm::Communicator::world();
  const int rank = world->rank();
  TS_CHECK(world->size() == 4, "bench memory runs on 4 ranks (torchspeed bench memory -n 4)");
  CountingAllocator& counter = count_cpu_allocations();
  Dims dims;
  dims.width = args.quick ? 512 : 2880;  // 12 x 2880^2 = 99.6M parameters
  dims.batch = args.quick ? 64 : 128;
  BenchReport report("memory");
  report.machine() = describe_machine(4);
  std::vector<Case> cases;
  for (int dp : {1, 2, 4})
    for (bool bf16 : {false, true})
      for (auto [stage, overlap] : std::vector<std::pair<int, bool>>{
               {0, false}, {1, false}, {2, false}, {2, true}, {3, true}})
        cases.push_back({dp, stage, overlap, bf16});
  if (rank == 0) {
    std::printf(
        "bench memory: %ld x Linear(%ld, %ld), MSE loss, micro-batch %ld rows;\n"
        "reduce_bucket_size %ld (2 layers), stage3_prefetch_bucket_size %ld (2 layers),\n"
        "stage3_max_live_parameters %ld (3 layers).\n"
        "At rest after initialize, MB per rank: the engine's accounting, the bytes live in\n"
        "LibTorch's CPU allocator (allocated, measured) and the ZeRO formula (gradients in the\n"
        "accumulation dtype, fp32).\n",
        static_cast<long>(dims.layers), static_cast<long>(dims.width),
        static_cast<long>(dims.width), static_cast<long>(dims.batch),
        static_cast<long>(dims.bucket()), static_cast<long>(dims.prefetch()),
        static_cast<long>(dims.max_live()));
    std::printf("%3s %5s %3s %5s %9s %9s %9s %9s %9s %9s %9s %7s\n", "dp", "stage", "ovl", "prec",
                "params", "grads", "master", "optim", "accounted", "allocated", "formula", "ratio");
  }
  std::vector<std::pair<Case, std::pair<Measured, Prediction>>> peaks;  // rank 0's, printed after
  std::vector<double> formulas;
  for (int dp : {1, 2, 4}) {
    auto group = world->split(rank < dp ? 0 : 1, rank, "dp" + std::to_string(dp));
    for (const Case& c : cases) {
      if (c.dp != dp) continue;
      if (rank < dp) {
        parallel::ParallelGroups groups =
            parallel::make_parallel_groups(group, parallel::ProcessGrid(dp));
        config::WorldShape shape;
        shape.world_size = dp;
        auto cfg = config::Config::parse({{"train_micro_batch_size_per_gpu", dims.batch},
                                          {"bf16", {{"enabled", c.bf16}}},
                                          {"optimizer", {{"type", "AdamW"}}},
                                          {"zero_optimization",
                                           {{"stage", c.stage},
                                            {"overlap_comm", c.overlap},
                                            {"reduce_bucket_size", dims.bucket()},
                                            {"stage3_prefetch_bucket_size", dims.prefetch()},
                                            {"stage3_max_live_parameters", dims.max_live()},
                                            {"stage3_param_persistence_threshold", 10000}}}},
                                         shape);
        // The inputs are the caller's, allocated before anything is counted.
        auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
        const at::Tensor x = at::randn({dims.batch, dims.width}, gen),
                         y = at::randn({dims.batch, dims.width}, gen);
        const int64_t rss0 = rss_bytes();
        int64_t total = 0, rss = 0, live = 0;
        zero::MemoryReport m;
        Measured meas;
        double psi = 0;
        {
          const int64_t live0 = counter.live();  // before the model exists
          torch::manual_seed(0);
          nn::LayerStack model;
          for (int i = 0; i < dims.layers; ++i)
            model->add("fc" + std::to_string(i), torch::nn::Linear(dims.width, dims.width));
          model->set_loss([](const at::Tensor& out, const at::Tensor& target) {
            return torch::mse_loss(out.to(at::kFloat), target);
          });
          auto engine = initialize(groups, model, cfg);
          live =
              counter.live() - live0;  // the model's own parameters are now views into the engine's
          m = engine->memory();
          total = m.total();
          psi = static_cast<double>(engine->num_parameters());
          rss = rss_bytes() - rss0;
          // One step first, so that the measured one sees the steady state (every buffer a step
          // allocates once exists); then each verb alone, the peak reset before it.
          engine->backward(engine->forward(x, y));
          engine->step();
          meas.rest = static_cast<double>(counter.live() - live0);
          counter.reset_peak();
          at::Tensor loss = engine->forward(x, y);
          meas.forward = static_cast<double>(counter.peak() - live0);
          counter.reset_peak();
          engine->backward(loss);
          meas.backward = static_cast<double>(counter.peak() - live0);
          loss = at::Tensor();
          counter.reset_peak();
          engine->step();
          meas.step = static_cast<double>(counter.peak() - live0);
        }
        const double grad_bytes = cfg.grad_accum_dtype == "bf16" ? 2.0 : 4.0;
        const double f = formula(c.stage, c.bf16, dp, psi, grad_bytes);
        const double ratio = live / f;
        // Allowed: 10% of the formula plus one configured bucket of gradients.
        const double allowed = 0.10 * f + static_cast<double>(dims.bucket()) * (c.bf16 ? 2.0 : 4.0);
        if (rank == 0) {
          const char* prec = c.bf16 ? "bf16" : "fp32";
          std::printf("%3d %5d %3s %5s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %7.3f\n", dp,
                      c.stage, c.overlap ? "on" : "off", prec, m.params / 1e6, m.gradients / 1e6,
                      m.master / 1e6, m.optimizer_state / 1e6, total / 1e6, live / 1e6, f / 1e6,
                      ratio);
          const Prediction pred = predict(c, dims);
          report.add_result({{"dp", dp},
                             {"stage", c.stage},
                             {"overlap_comm", c.overlap},
                             {"precision", prec},
                             {"params_bytes", m.params},
                             {"grad_bytes", m.gradients},
                             {"master_bytes", m.master},
                             {"optimizer_bytes", m.optimizer_state},
                             {"accounted_bytes", total},
                             {"allocated_bytes", live},
                             {"formula_bytes", f},
                             {"psi", psi},
                             {"rss_growth_bytes", rss},
                             {"peak_transient_bytes", m.peak_transient},
                             {"rest_bytes", meas.rest},
                             {"forward_peak_bytes", meas.forward},
                             {"backward_peak_bytes", meas.backward},
                             {"step_peak_bytes", meas.step},
                             {"forward_act_bytes", pred.forward.act},
                             {"forward_buf_bytes", pred.forward.buf},
                             {"backward_act_bytes", pred.backward.act},
                             {"backward_buf_bytes", pred.backward.buf},
                             {"step_buf_bytes", pred.step.buf}});
          report.add_target(concat("dp ", dp, " stage ", c.stage, c.overlap ? " overlap" : "", " ",
                                   prec, ": |measured - formula| / (10% formula + bucket)"),
                            std::abs(live - f) / allowed, 1.0, /*higher_is_better=*/false);
          peaks.push_back({c, {meas, pred}});
          formulas.push_back(f);
        }
      }
      world->barrier();
    }
  }
  if (rank == 0) {
    std::printf(
        "\nPeaks of one training step, MB per rank (Note [Predicted peaks] in\n"
        "benchmarks/bench_memory.cpp):\n"
        "  fwd, bwd, step  measured: the most bytes live in LibTorch's CPU allocator while the\n"
        "                  verb ran (each called alone, after a warm-up step; the caller's inputs\n"
        "                  not counted)\n"
        "  states          the ZeRO formula above (params, grads, optimizer states per rank)\n"
        "  rest            bytes live before the step (measured)\n"
        "  act             activations kept for backward, the loss's temporaries and activation\n"
        "                  gradients, at the moment the verb is predicted to peak\n"
        "  buf             gradient buckets (reduce_bucket_size units), reduce-scatter outputs\n"
        "                  and stage 3's gathered layers (prefetch, max live) at that moment\n"
        "  pred            states + act + buf;  ratio = measured / pred\n");
    std::printf(
        "%3s %5s %3s %5s %8s %8s | %8s %8s %7s %7s %6s | %8s %8s %7s %7s %6s | %8s %8s %7s %6s\n",
        "dp", "stage", "ovl", "prec", "states", "rest", "fwd", "pred", "act", "buf", "ratio", "bwd",
        "pred", "act", "buf", "ratio", "step", "pred", "buf", "ratio");
    for (size_t i = 0; i < peaks.size(); ++i) {
      const auto& [c, mp] = peaks[i];
      const auto& [meas, pred] = mp;
      const double f = formulas[i];
      const double pf = f + pred.forward.total(), pb = f + pred.backward.total(),
                   ps = f + pred.step.total();
      const std::string name = concat("dp ", c.dp, " stage ", c.stage, c.overlap ? " overlap" : "",
                                      c.bf16 ? " bf16" : " fp32");
      report.add_target(name + ": forward peak |measured / predicted - 1|",
                        std::abs(meas.forward / pf - 1), 0.1, false);
      report.add_target(name + ": backward peak |measured / predicted - 1|",
                        std::abs(meas.backward / pb - 1), 0.1, false);
      report.add_target(name + ": step peak |measured / predicted - 1|",
                        std::abs(meas.step / ps - 1), 0.1, false);
      std::printf(
          "%3d %5d %3s %5s %8.1f %8.1f | %8.1f %8.1f %7.1f %7.1f %6.3f | %8.1f %8.1f %7.1f %7.1f "
          "%6.3f | %8.1f %8.1f %7.1f %6.3f\n",
          c.dp, c.stage, c.overlap ? "on" : "off", c.bf16 ? "bf16" : "fp32", f / 1e6,
          meas.rest / 1e6, meas.forward / 1e6, pf / 1e6, pred.forward.act / 1e6,
          pred.forward.buf / 1e6, meas.forward / pf, meas.backward / 1e6, pb / 1e6,
          pred.backward.act / 1e6, pred.backward.buf / 1e6, meas.backward / pb, meas.step / 1e6,
          ps / 1e6, pred.step.buf / 1e6, meas.step / ps);
    }
    report.finish(args);
  }
  return 0;
}

}  // namespace torchspeed::bench
