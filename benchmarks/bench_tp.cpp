// `torchspeed bench tp` (4 ranks): one GPT transformer layer (d 512, 8 heads) at tp 1, 2 and 4:
// the bytes each rank's tensor-parallel communicator moved in one forward + backward, beside
// Megatron's count (2 all-reduces of [batch, seq, d] in forward, 2 in backward), and the
// parameter bytes each rank holds beside 1/tp of the dense layer plus its replicated
// parameters (LayerNorms and the row-parallel layers' biases, which Megatron replicates too).
#include <torch/torch.h>

#include <cstdio>

#include "bench_report.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"
#include "torchspeed/tensor_parallel/layers.h"

namespace torchspeed::bench {

int run_tp(const BenchArgs& args) {
  auto world = comm::Communicator::world();
  TS_CHECK(world->size() == 4, "bench tp runs on 4 ranks (torchspeed bench tp -n 4)");
  const bool root = world->rank() == 0;
  models::GPTConfig c;
  c.d_model = args.quick ? 128 : 512;
  c.n_head = 8;
  c.seq_len = args.quick ? 32 : 128;
  const int64_t B = 4, T = c.seq_len, d = c.d_model;
  BenchReport report("tp");
  report.machine() = describe_machine(4);
  if (root) {
    std::printf("bench tp: one GPT layer, d_model %ld, %ld heads, batch %ld x %ld tokens, fp32\n", static_cast<long>(d),
                static_cast<long>(c.n_head), static_cast<long>(B), static_cast<long>(T));
    std::printf("  %-4s %14s %14s %7s %14s %14s %7s\n", "tp", "comm bytes", "Megatron", "ratio", "param bytes",
                "dense/tp+repl", "ratio");
  }
  int64_t dense_bytes = 0;
  for (int tp : {1, 2, 4}) {
    auto group = world->split(world->rank() / tp, world->rank(), "tp" + std::to_string(tp));
    torch::manual_seed(3);
    models::GPTBlock dense(c);
    std::shared_ptr<torch::nn::Module> layer;
    torch::nn::AnyModule any;
    if (tp == 1) {
      any = torch::nn::AnyModule(dense);
    } else {
      any = torch::nn::AnyModule(models::GPTBlockTP(dense, group));
    }
    layer = any.ptr();
    int64_t local = 0, replicated = 0, split = 0;
    for (const auto& p : layer->parameters()) {
      local += static_cast<int64_t>(p.nbytes());
      (tensor_parallel::split_of(p) ? split : replicated) += static_cast<int64_t>(p.nbytes());
    }
    if (tp == 1) dense_bytes = local;
    const int64_t dense_split = dense_bytes - replicated;  // the dense layer's bytes that TP splits
    const double bound = static_cast<double>(dense_split) / tp + static_cast<double>(replicated);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Tensor x = at::randn({B, T, d}, gen).requires_grad_();
    const auto before = group->stats();
    any.forward(x).pow(2).mean().backward();
    const auto after = group->stats();
    int64_t moved = 0;
    for (const auto& [op, st] : after) {
      const auto it = before.find(op);
      moved += st.bytes - (it == before.end() ? 0 : it->second.bytes);
    }
    const int64_t megatron = tp == 1 ? 0 : 4 * B * T * d * static_cast<int64_t>(sizeof(float));
    if (root) {
      std::printf("  %-4d %14ld %14ld %7.3f %14ld %14.0f %7.3f\n", tp, static_cast<long>(moved), static_cast<long>(megatron),
                  tp == 1 ? 0.0 : static_cast<double>(moved) / megatron, static_cast<long>(local), bound, local / bound);
      report.add_result({{"tp", tp}, {"comm_bytes_per_layer_step", moved}, {"megatron_bytes", megatron},
                         {"param_bytes_per_rank", local}, {"dense_param_bytes", dense_bytes},
                         {"replicated_param_bytes", replicated}, {"split_param_bytes", split}});
      if (tp > 1) {
        report.add_target(concat("tp ", tp, ": communicated bytes / Megatron formula"),
                          static_cast<double>(moved) / megatron, 1.0, false);
        report.add_target(concat("tp ", tp, ": parameter bytes / (dense / tp + replicated)"), local / bound, 1.0, false);
      }
    }
  }
  if (root) report.finish(args);
  return 0;
}

}  // namespace torchspeed::bench
