// `torchspeed bench pipeline` (2 ranks): the measured bubble of 1F1B at pp 2 for 2, 4, 8 and 16
// micro-batches beside the theoretical (p - 1) / (m + p - 1), and tokens/s of gpt-medium at
// pp 2 beside dp 2 on the same global batch, alternating which runs first.
// Measured bubble of a stage = 1 - (time in its forward and backward instructions) / (the
// schedule's wall time up to the gradient reductions); the two stages' mean is reported.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "bench_report.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"

namespace torchspeed::bench {
namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

Engine::MicroBatchSource random_tokens(int64_t micro, int64_t seq, int seed) {
  auto gen = std::make_shared<at::Generator>(at::make_generator<at::CPUGeneratorImpl>(seed));
  return [gen, micro, seq] {
    at::Tensor t = at::randint(0, 256, {micro, seq + 1}, *gen, at::kLong);
    return std::make_pair(t.narrow(1, 0, seq).contiguous(), t.narrow(1, 1, seq).contiguous());
  };
}

}  // namespace

int run_pipeline(const BenchArgs& args) {
  auto world = comm::Communicator::world();
  TS_CHECK(world->size() == 2, "bench pipeline runs on 2 ranks (torchspeed bench pipeline -n 2)");
  const bool root = world->rank() == 0;
  models::GPTConfig gpt;  // gpt-medium
  gpt.seq_len = args.quick ? 64 : 256;
  gpt.d_model = args.quick ? 128 : 384;
  gpt.n_layer = args.quick ? 2 : 6;
  gpt.n_head = 4;
  const int batches = args.quick ? 1 : 3;
  const auto spec = models::gpt_spec(gpt, 1);
  BenchReport report("pipeline");
  report.machine() = describe_machine(2);
  auto make = [&](int pp, int gas) {
    config::WorldShape shape;
    shape.world_size = 2;
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                        {"gradient_accumulation_steps", gas},
                        {"optimizer", {{"type", "AdamW"}}},
                        {"zero_optimization", {{"stage", 1}}},
                        {"pipeline", {{"stages", pp}, {"schedule", "1f1b"}}}};
    auto cfg = config::Config::parse(j, shape);
    return initialize(parallel::make_parallel_groups(world, parallel::ProcessGrid(2, 1, pp)), spec, cfg);
  };
  if (root) {
    std::printf("bench pipeline: gpt %ld layers d_model %ld seq %ld, micro-batch 1 sequence, 2 ranks\n",
                static_cast<long>(gpt.n_layer), static_cast<long>(gpt.d_model), static_cast<long>(gpt.seq_len));
    std::printf("  %-16s %10s %12s %8s\n", "micro-batches", "bubble", "theoretical", "ratio");
  }
  double worst = 0;
  for (int m : {2, 4, 8, 16}) {
    auto e = make(2, m);
    auto next = random_tokens(1, gpt.seq_len, 10 + world->rank() * 0);
    e->train_batch(next);  // warm-up (shapes exchanged, buffers allocated)
    const auto before = e->timings();
    for (int b = 0; b < batches; ++b) e->train_batch(next);
    const auto after = e->timings();
    const double busy = after.pipeline_busy_s - before.pipeline_busy_s;
    const double total = after.pipeline_schedule_s - before.pipeline_schedule_s;
    at::Tensor bubble = at::full({1}, 1.0 - busy / total, at::kDouble);
    world->all_reduce(bubble, comm::ReduceOp::kAvg);
    const double measured = bubble.item<double>(), theory = 1.0 / (m + 1);
    worst = std::max(worst, measured / theory);
    if (root) {
      std::printf("  %-16d %9.1f%% %11.1f%% %8.2f\n", m, 100 * measured, 100 * theory, measured / theory);
      report.add_result({{"case", "1f1b_bubble"}, {"micro_batches", m}, {"measured", measured}, {"theoretical", theory},
                         {"busy_s", busy}, {"schedule_s", total}});
    }
  }
  // Throughput: the same global batch (8 sequences) at pp 2 (8 micro-batches) and dp 2 (4 each).
  std::vector<double> t_pp, t_dp;
  auto pp = make(2, 8), dp = make(1, 4);
  auto next = random_tokens(1, gpt.seq_len, 20 + world->rank());
  pp->train_batch(next);
  dp->train_batch(next);
  for (int b = 0; b < batches + 1; ++b) {
    auto timed = [&](Engine& e, std::vector<double>& out) {
      world->barrier();
      const double t0 = now();
      e.train_batch(next);
      world->barrier();
      out.push_back(now() - t0);
    };
    if (b % 2) {
      timed(*pp, t_pp);
      timed(*dp, t_dp);
    } else {
      timed(*dp, t_dp);
      timed(*pp, t_pp);
    }
  }
  const double tokens = 8.0 * gpt.seq_len;
  if (root) {
    std::printf("  gpt tokens/s, global batch 8: pp 2 %.0f, dp 2 %.0f (pp/dp %.2f)\n", tokens / median(t_pp),
                tokens / median(t_dp), median(t_dp) / median(t_pp));
    report.add_result({{"case", "throughput"}, {"pp2_seconds", t_pp}, {"dp2_seconds", t_dp},
                       {"pp2_tokens_per_s", tokens / median(t_pp)}, {"dp2_tokens_per_s", tokens / median(t_dp)}});
    report.add_target("worst measured / theoretical 1F1B bubble (pp 2, m = 2..16)", worst, 1.25, false);
    report.finish(args);
  }
  return 0;
}

}  // namespace torchspeed::bench
