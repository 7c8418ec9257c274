// `torchspeed bench overlap` (2 ranks): backward with bucketed gradient reduction overlapped
// (overlap_comm) beside backward followed by one reduction, and backward alone (no reduction),
// alternating each iteration. Hidden fraction = (serial - overlapped) / (serial - alone).
#include <torch/torch.h>

#include <cstdio>

#include "bench_report.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/base/error.h"

namespace torchspeed::bench {

int run_overlap(const BenchArgs& args) {
  auto world = comm::Communicator::world();
  TS_CHECK(world->size() == 2, "bench overlap runs on 2 ranks (torchspeed bench overlap -n 2)");
  const int64_t width = args.quick ? 256 : 1024, layers = 8, batch = args.quick ? 8 : 32;
  const int iters = args.quick ? 3 : 12;
  BenchReport report("overlap");
  report.machine() = describe_machine(2);
  auto make = [&](comm::CommunicatorPtr comm, bool overlap, int64_t bucket) {
    torch::manual_seed(0);
    nn::LayerStack model;
    for (int i = 0; i < layers; ++i) {
      model->add("fc" + std::to_string(i), torch::nn::Linear(width, width));
      model->add("act" + std::to_string(i), torch::nn::GELU());
    }
    model->set_loss([](const at::Tensor& o, const at::Tensor& t) { return torch::mse_loss(o, t); });
    config::WorldShape shape;
    shape.world_size = comm->size();
    auto cfg = config::Config::parse({{"train_micro_batch_size_per_gpu", batch},
                                      {"optimizer", {{"type", "AdamW"}}},
                                      {"zero_optimization", {{"stage", 0}, {"overlap_comm", overlap},
                                                             {"reduce_bucket_size", bucket}}}},
                                     shape);
    return initialize(parallel::make_parallel_groups(comm, parallel::ProcessGrid(comm->size())), model, cfg);
  };
  auto self = world->split(world->rank(), 0, "self");
  const int64_t params = layers * (width * width + width);
  auto alone = make(self, false, params);               // no reduction at all
  auto serial = make(world, false, params);             // one bucket, reduced after backward
  auto overlapped = make(world, true, params / layers); // a bucket per layer, during backward
  std::vector<double> t_alone, t_serial, t_overlap;
  auto measure = [&](Engine& e, std::vector<double>& out) {
    at::Tensor x = at::randn({batch, width}), y = at::randn({batch, width});
    auto before = e.timings();
    e.backward(e.forward(x, y));
    e.step();
    auto after = e.timings();
    // backward, plus the wait for reductions still in flight when it returned
    out.push_back(after.backward_s - before.backward_s + after.reduce_wait_s - before.reduce_wait_s);
  };
  for (int i = 0; i < iters; ++i) {
    world->barrier();
    measure(*alone, t_alone);
    world->barrier();
    if (i % 2) {
      measure(*serial, t_serial);
      world->barrier();
      measure(*overlapped, t_overlap);
    } else {
      measure(*overlapped, t_overlap);
      world->barrier();
      measure(*serial, t_serial);
    }
  }
  // The slower rank decides.
  for (auto* v : {&t_alone, &t_serial, &t_overlap}) {
    at::Tensor t = at::tensor(*v, at::kDouble);
    world->all_reduce(t, comm::ReduceOp::kMax);
    *v = std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  }
  const double a = median(t_alone), s = median(t_serial), o = median(t_overlap);
  const double comm_time = s - a, hidden = comm_time > 0 ? (s - o) / comm_time : 0.0;
  if (world->rank() == 0) {
    std::printf("bench overlap: dp 2, %ld x Linear(%ld) + GELU, batch %ld, fp32 gradients %.1f MB\n",
                static_cast<long>(layers), static_cast<long>(width), static_cast<long>(batch), params * 4 / 1e6);
    std::printf("  backward alone                  %8.4f s\n", a);
    std::printf("  backward, then one reduction    %8.4f s  (communication %.4f s)\n", s, comm_time);
    std::printf("  backward with overlapped buckets %7.4f s\n", o);
    std::printf("  communication hidden: %.0f%%\n", 100 * hidden);
    report.add_result({{"case", "backward_alone"}, {"seconds", t_alone}, {"seconds_median", a}});
    report.add_result({{"case", "backward_then_reduce"}, {"seconds", t_serial}, {"seconds_median", s}});
    report.add_result({{"case", "backward_overlapped"}, {"seconds", t_overlap}, {"seconds_median", o}});
    report.add_target("fraction of gradient communication hidden behind backward", hidden, 0.70);
    report.finish(args);
  }
  return 0;
}

}  // namespace torchspeed::bench
