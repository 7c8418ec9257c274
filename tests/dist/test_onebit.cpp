// 1-bit Adam (DeepSpeed's OnebitAdam) and its compressed all-reduce:
//  - the all-reduce against the algorithm written in plain tensor ops for every rank in this
//    process (worker and server error feedback over two rounds), and its bytes against an fp32
//    all-reduce's, as the communicator counts them;
//  - training the fortunes GPT past the warm-up, fp32 and fp16: the loss stays within 5% of
//    uncompressed Adam after the same steps, a compressed step sends at most 1/20 of the bytes of
//    a warm-up step (1/15 in fp16, whose warm-up reduces 16-bit gradients), and every rank holds
//    the same parameters.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>

#include "dist_util.h"
#include "torchspeed/comm/compressed.h"
#include "torchspeed/data/text.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"

using ts_test::world;
namespace ts = torchspeed;

namespace {
// Bytes this rank sent to its peers, over every op.
int64_t total_bytes(const ts::comm::CommStats& s) {
  int64_t b = 0;
  for (const auto& [op, st] : s) b += st.sent;
  return b;
}

at::Tensor sign_pm1(const at::Tensor& x) { return at::where(x >= 0, at::ones_like(x), -at::ones_like(x)); }
float rms(const at::Tensor& x) {
  return static_cast<float>(std::sqrt(x.to(at::kDouble).pow(2).sum().item<double>() / static_cast<double>(x.numel())));
}

// Rank r's input of round k.
at::Tensor input(int r, int k, int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + 10 * r + k);
  return at::randn({n}, gen, at::kFloat) * (1.0 + r);
}
}  // namespace

TEST(OneBit, AllReduceFollowsTheAlgorithmAndMovesAThirtySecondOfTheBytes) {
  auto comm = world()->split(0, world()->rank(), "onebit");
  const int n = comm->size(), me = comm->rank();
  for (int64_t numel : {1000, 4096, 12345}) {
    SCOPED_TRACE(testing::Message() << numel << " elements over " << n << " ranks");
    ts::comm::OneBitAllReduce ar(comm, numel);
    const int64_t L = ar.padded_numel(), C = L / n;
    EXPECT_EQ(L % (8 * n), 0);
    // The reference: every rank's worker error and every server's error, in plain tensor ops.
    std::vector<at::Tensor> we(n, at::zeros({L})), se(n, at::zeros({C}));
    for (int k = 0; k < 2; ++k) {
      std::vector<at::Tensor> signs(n);
      std::vector<float> scales(n);
      for (int r = 0; r < n; ++r) {
        at::Tensor x = we[r].clone();
        x.narrow(0, 0, numel).add_(input(r, k, numel));
        scales[r] = rms(x);
        signs[r] = sign_pm1(x);
        we[r] = x - scales[r] * signs[r];
      }
      at::Tensor want = at::empty({L});
      for (int s = 0; s < n; ++s) {
        at::Tensor y = se[s].clone();
        for (int r = 0; r < n; ++r) y += signs[r].narrow(0, s * C, C) * (scales[r] / static_cast<float>(n));
        const float ss = rms(y);
        se[s] = y - ss * sign_pm1(y);
        want.narrow(0, s * C, C).copy_(ss * sign_pm1(y));
      }
      at::Tensor buf = input(me, k, numel);
      const auto before = comm->stats();
      ar.run(buf);
      const int64_t moved = total_bytes(comm->stats()) - total_bytes(before);
      EXPECT_LE((buf - want.narrow(0, 0, numel)).abs().max().item<double>(), 1e-6) << "round " << k;
      EXPECT_LE((ar.worker_error() - we[me]).abs().max().item<double>(), 1e-5) << "round " << k;
      EXPECT_LE((ar.server_error() - se[me]).abs().max().item<double>(), 1e-5) << "round " << k;
      // Against an fp32 all-reduce of the same buffer.
      const auto before_fp32 = comm->stats();
      at::Tensor plain = input(me, k, numel);
      comm->all_reduce(plain);
      const int64_t fp32 = total_bytes(comm->stats()) - total_bytes(before_fp32);
      EXPECT_LE(static_cast<double>(moved), static_cast<double>(fp32) / 20.0) << moved << " vs " << fp32;
      if (me == 0 && k == 1) {
        std::printf("1-bit all-reduce of %ld elements over %d ranks: %ld bytes vs %ld for fp32 (1/%.1f)\n",
                    static_cast<long>(numel), n, static_cast<long>(moved), static_cast<long>(fp32),
                    static_cast<double>(fp32) / static_cast<double>(moved));
      }
    }
  }
}

namespace {
void check_training(bool fp16) {
  const int dp = world()->size();
  ts::models::GPTConfig g;
  g.vocab = 256;
  g.seq_len = 32;
  g.d_model = 64;
  g.n_layer = 2;
  g.n_head = 4;
  auto corpus = ts::data::TextCorpus::load(ts::data::kDefaultCorpus, 0.1, g.seq_len + 1);
  const int steps = 60, freeze = 15;
  struct Run {
    std::vector<double> losses;
    int64_t warmup_step_bytes = 0, compressed_step_bytes = 0;
    std::vector<std::pair<std::string, at::Tensor>> params;
  };
  auto train = [&](const std::string& type) {
    nlohmann::json params = {{"lr", 3e-3}, {"weight_decay", 0.01}};
    if (type == "OneBitAdam") {
      params["freeze_step"] = freeze;
      params["comm_backend_name"] = "mpi";
    }
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 8},
                        {"gradient_clipping", 1.0},
                        {"optimizer", {{"type", type}, {"params", params}}}};
    if (fp16) j["fp16"] = {{"enabled", true}, {"initial_scale_power", 12}};  // as DeepSpeed's 1-bit examples
    const auto cfg = ts_test::parse_config(j);
    auto groups = ts_test::dp_groups();
    auto dpc = groups.dp;
    auto engine = ts::initialize(groups, ts::models::gpt_spec(g, 3), cfg);
    ts::data::TextLoader loader(corpus.train, g.seq_len, 8, dpc->rank(), dp, 5);
    Run run;
    for (int s = 0; s < steps; ++s) {
      const auto before = dpc->stats();
      run.losses.push_back(engine->train_batch([&] {
        auto b = loader.next();
        return std::make_pair(b.inputs, b.targets);
      }));
      const int64_t moved = total_bytes(dpc->stats()) - total_bytes(before);
      if (s == freeze - 1) run.warmup_step_bytes = moved;
      if (s == steps - 1) run.compressed_step_bytes = moved;
    }
    run.params = engine->master_params();
    return run;
  };
  const Run adam = train("Adam"), onebit = train("OneBitAdam");
  auto tail_mean = [](const std::vector<double>& l) {
    double s = 0;
    for (size_t i = l.size() - 10; i < l.size(); ++i) s += l[i];
    return s / 10.0;
  };
  // Losses are this rank's; average over ranks.
  at::Tensor m = at::tensor({tail_mean(adam.losses), tail_mean(onebit.losses), adam.losses.front()}, at::kDouble);
  world()->all_reduce(m, ts::comm::ReduceOp::kAvg);
  const double la = m[0].item<double>(), lo = m[1].item<double>(), first = m[2].item<double>();
  EXPECT_LT(la, first - 0.5) << "Adam did not train";
  EXPECT_LE(std::abs(lo - la), 0.05 * la) << "1-bit Adam's loss " << lo << " vs Adam's " << la;
  if (dp > 1) {
    // One bit per element against an fp32 gradient's 32 (fp16 training reduces 16-bit gradients
    // in its warm-up, so there the ratio is about 1/16).
    const double bound = fp16 ? 15.0 : 20.0;
    EXPECT_LE(static_cast<double>(onebit.compressed_step_bytes), static_cast<double>(onebit.warmup_step_bytes) / bound)
        << onebit.compressed_step_bytes << " vs " << onebit.warmup_step_bytes;
  }
  // The replicas stay identical: every rank's parameters equal rank 0's.
  for (const auto& [name, t] : onebit.params) {
    at::Tensor mine = t.contiguous().clone(), root = mine.clone();
    world()->broadcast(root, 0);
    EXPECT_TRUE(at::equal(mine, root)) << name;
  }
  if (world()->rank() == 0) {
    std::printf("%s dp %d, %d steps (warm-up %d): loss of the last 10 steps %.4f with Adam, %.4f with 1-bit Adam (%+.2f%%); "
                "bytes per step %ld warm-up, %ld compressed (1/%.1f)\n",
                fp16 ? "fp16" : "fp32", dp, steps, freeze, la, lo, 100.0 * (lo - la) / la, static_cast<long>(onebit.warmup_step_bytes),
                static_cast<long>(onebit.compressed_step_bytes),
                static_cast<double>(onebit.warmup_step_bytes) / std::max<double>(1.0, onebit.compressed_step_bytes));
  }
}
}  // namespace

TEST(OneBit, AdamPastItsWarmUpTrainsLikeAdamWithAThirtySecondOfTheBytes) { check_training(/*fp16=*/false); }
TEST(OneBit, Fp16AdamPastItsWarmUpTrainsLikeFp16Adam) { check_training(/*fp16=*/true); }
