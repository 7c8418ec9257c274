// `torchspeed bench memory`: bytes of model states per rank for a ~100M-parameter model at
// dp 1/2/4 x ZeRO 0-3 x fp32/bf16, beside the ZeRO paper's formulas. Launched on 4 ranks; for
// dp < 4 the first dp ranks train and the others wait.
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>

#include "bench_report.h"
#include "torchspeed/runtime/memory_counter.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/runtime/error.h"

namespace torchspeed::bench {
namespace {

// Wraps LibTorch's CPU allocator and counts the bytes of live allocations: an independent
// measurement of what the engine holds (its own accounting is printed beside it).
int64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// ZeRO paper, mixed precision (K = 12: fp32 master, momentum, variance): params 2, grads 2;
// fp32 training has no separate master (K = 8) and 4-byte params and grads.
double formula(int stage, bool bf16, int dp, double psi) {
  const double p = bf16 ? 2 : 4, g = bf16 ? 2 : 4, k = bf16 ? 12 : 8;
  switch (stage) {
    case 0: return (p + g + k) * psi;
    case 1: return (p + g) * psi + k * psi / dp;
    case 2: return p * psi + (g + k) * psi / dp;
    default: return (p + g + k) * psi / dp;
  }
}

}  // namespace

int run_memory(const BenchArgs& args) {
  auto world = comm::Communicator::world();
  const int rank = world->rank();
  TS_CHECK(world->size() == 4, "bench memory runs on 4 ranks (torchspeed bench memory -n 4)");
  CountingAllocator& counter = count_cpu_allocations();
  const int64_t width = args.quick ? 512 : 2880, layers = 12;  // 12 x 2880^2 = 99.6M parameters
  const int64_t bucket = 20000000;
  BenchReport report("memory");
  report.machine() = describe_machine(4);
  if (rank == 0) {
    std::printf("bench memory: %ld x Linear(%ld, %ld); MB per rank: the engine's accounting and the\n"
                "bytes live in LibTorch's CPU allocator after initialize (measured), reduce_bucket_size %ld\n",
                static_cast<long>(layers), static_cast<long>(width), static_cast<long>(width),
                static_cast<long>(bucket));
    std::printf("%3s %5s %5s %9s %9s %9s %9s %9s %9s %9s %7s\n", "dp", "stage", "prec", "params",
                "grads", "master", "optim", "accounted", "allocated", "formula", "ratio");
  }
  for (int dp : {1, 2, 4}) {
    auto group = world->split(rank < dp ? 0 : 1, rank, "dp" + std::to_string(dp));
    for (bool bf16 : {false, true}) {
      for (int stage : {0, 1, 2, 3}) {
        if (rank < dp) {
          parallel::ParallelGroups groups = parallel::make_parallel_groups(group, parallel::ProcessGrid(dp));
          config::WorldShape shape;
          shape.world_size = dp;
          auto cfg = config::Config::parse(
              {{"train_micro_batch_size_per_gpu", 1}, {"bf16", {{"enabled", bf16}}},
               {"optimizer", {{"type", "AdamW"}}},
               {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", bucket},
                                      {"stage3_param_persistence_threshold", 10000}}}},
              shape);
          const int64_t rss0 = rss_bytes();
          int64_t total = 0, rss = 0, live = 0;
          zero::MemoryReport m;
          double psi = 0;
          {
            const int64_t live0 = counter.live();  // before the model exists
            torch::manual_seed(0);
            nn::LayerStack model;
            for (int i = 0; i < layers; ++i) model->add("fc" + std::to_string(i), torch::nn::Linear(width, width));
            auto engine = initialize(groups, model, cfg);
            live = counter.live() - live0;  // the model's own parameters are now views into the engine's
            m = engine->memory();
            total = m.total();
            psi = static_cast<double>(engine->num_parameters());
            rss = rss_bytes() - rss0;
          }
          const double f = formula(stage, bf16, dp, psi);
          const double ratio = live / f;
          // Allowed: 10% of the formula plus one configured bucket of gradients.
          const double allowed = 0.10 * f + bucket * (bf16 ? 2.0 : 4.0);
          if (rank == 0) {
            std::printf("%3d %5d %5s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %7.3f\n", dp, stage,
                        bf16 ? "bf16" : "fp32", m.params / 1e6, m.gradients / 1e6, m.master / 1e6,
                        m.optimizer_state / 1e6, total / 1e6, live / 1e6, f / 1e6, ratio);
            report.add_result({{"dp", dp}, {"stage", stage}, {"precision", bf16 ? "bf16" : "fp32"},
                               {"params_bytes", m.params}, {"grad_bytes", m.gradients},
                               {"master_bytes", m.master}, {"optimizer_bytes", m.optimizer_state},
                               {"accounted_bytes", total}, {"allocated_bytes", live},
                               {"formula_bytes", f}, {"psi", psi},
                               {"rss_growth_bytes", rss}, {"peak_transient_bytes", m.peak_transient}});
            report.add_target(concat("dp ", dp, " stage ", stage, bf16 ? " bf16" : " fp32",
                                     ": |measured - formula| / (10% formula + bucket)"),
                              std::abs(live - f) / allowed, 1.0, /*higher_is_better=*/false);
          }
        }
        world->barrier();
      }
    }
  }
  if (rank == 0) report.finish(args);
  return 0;
}

}  // namespace torchspeed::bench
