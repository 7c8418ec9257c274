// 1-bit Adam (DeepSpeed's OnebitAdam) and its compressed all-reduce:
//  - the all-reduce against the algorithm written in plain tensor ops for every rank in this
//    process (worker and server error feedback over two rounds), and its bytes against an fp32
//    all-reduce's, as the communicator counts them;
//  - training the fortunes GPT past the warm-up (the Adam family with a linearly decaying lr), fp32
//    and fp16: the loss stays within 5% of uncompressed Adam after the same steps, a compressed
//    step sends at most 1/20 of the bytes of a warm-up step (1/15 in fp16, whose warm-up reduces
//    16-bit gradients), and every rank holds the same parameters.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <filesystem>

#include "dist_util.h"
#include "torchspeed/comm/compressed.h"
#include "torchspeed/data/text.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"

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
// `type` against its uncompressed peer (Adam for the Adam family, Lamb for OneBitLamb).
void check_training(const std::string& type, bool fp16) {
  const int dp = world()->size();
  ts::models::GPTConfig g;
  g.vocab = 256;
  g.seq_len = 32;
  g.d_model = 64;
  g.n_layer = 2;
  g.n_head = 4;
  auto corpus = ts::data::TextCorpus::load(ts::data::kDefaultCorpus, 0.1, g.seq_len + 1);
  const int steps = 60, freeze = 15;
  // 0/1 Adam: variance steps at t = 1-4, 6-12 by 2, 16-28 by 4; local steps from t = 32,
  // synchronised every step, then every 2nd (t >= 40), then every 4th (t >= 48).
  const int var_freeze = 30;
  const bool zero_one = type == "ZeroOneAdam";
  // Steps (0-based) whose bytes are compared: an exact-reduction step, a compressed one, and for
  // 0/1 Adam a local step without synchronisation.
  const int exact_s = zero_one ? 27 : type == "OneBitLamb" ? 2 * freeze - 1 : freeze - 1;
  const int compressed_s = zero_one ? 30 : steps - 1, local_s = 56;
  struct Run {
    std::vector<double> losses;
    int64_t warmup_step_bytes = 0, compressed_step_bytes = 0, local_step_bytes = 0, last_step_bytes = 0;
    std::vector<std::pair<std::string, at::Tensor>> params;
  };
  auto train = [&](const std::string& type) {
    // Lamb's step is lr times a trust ratio ||p|| / ||update|| (about 0.05 here): a larger lr.
    const bool lamb = type == "Lamb" || type == "OneBitLamb";
    // 0/1 Adam (and its Adam reference) at 1e-3: its variance, updated at 12 steps of the warm-up
    // without bias correction, makes its steps larger still, and at 3e-3 or 2e-3 some runs at 2
    // ranks diverged (+15% to +28%) on some BLAS kernels even with the decay below.
    const double adam_lr = zero_one ? 1e-3 : 3e-3;
    nlohmann::json params = {{"lr", lamb ? 4e-2 : adam_lr}, {"weight_decay", 0.01}};
    if (type == "OneBitAdam") params["freeze_step"] = freeze;
    // 1-bit Lamb's frozen coefficient is an EMA of the warm-up's trust ratios without bias
    // correction (coeff_beta 0.9, as DeepSpeed): a warm-up of 30 steps lets it reach 96%.
    if (type == "OneBitLamb") params["freeze_step"] = 2 * freeze;
    if (type == "ZeroOneAdam") {
      params.update({{"var_freeze_step", var_freeze}, {"var_update_scaler", 4}, {"local_step_scaler", 8},
                     {"local_step_clipper", 4}});
    }
    if (type != "Adam" && type != "Lamb") params["comm_backend_name"] = "mpi";
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 8},
                        {"gradient_clipping", 1.0},
                        {"optimizer", {{"type", type}, {"params", params}}}};
    // The Adam family decays its lr linearly to 0 over the run, as DeepSpeed's 1-bit Adam recipes
    // (BERT: WarmupDecayLR). At a constant lr the run is chaotic: the frozen variance has no bias
    // correction (DeepSpeed's algorithm) and reaches 1.5% of its value in a 15-step warm-up, so
    // elements with small gradients take steps ~8x Adam's; whether that diverges by step 60
    // depended on the BLAS kernel's rounding (OpenBLAS SkylakeX/Cooperlake: fp16 loss 5.4 vs
    // 3.3; Haswell: +0.5%) and on the rank count. Decayed, 1-bit Adam stays within 0.5% of Adam
    // and 0/1 Adam (at its lower lr) within 4.3%, at 2-4 ranks on OpenBLAS's auto, Haswell and
    // Prescott kernels (1.13) and MKL's AVX2 and AVX-512 ones (2.15).
    if (!lamb) {
      j["scheduler"] = {{"type", "WarmupDecayLR"},
                        {"params",
                         {{"warmup_min_lr", 0}, {"warmup_max_lr", params["lr"]}, {"warmup_num_steps", 0},
                          {"total_num_steps", steps}}}};
    }
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
      if (s == exact_s) run.warmup_step_bytes = moved;
      if (s == compressed_s) run.compressed_step_bytes = moved;
      if (s == local_s) run.local_step_bytes = moved;
      if (s == steps - 1) run.last_step_bytes = moved;
    }
    run.params = engine->master_params();
    return run;
  };
  const Run adam = train(type == "OneBitLamb" ? "Lamb" : "Adam"), onebit = train(type);
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
  EXPECT_LE(std::abs(lo - la), 0.05 * la) << type << "'s loss " << lo << " vs " << la << " uncompressed";
  if (dp > 1) {
    // One bit per element against an fp32 gradient's 32 (fp16 training reduces 16-bit gradients
    // in its warm-up, so there the ratio is about 1/16).
    const double bound = fp16 ? 15.0 : 20.0;
    EXPECT_LE(static_cast<double>(onebit.compressed_step_bytes), static_cast<double>(onebit.warmup_step_bytes) / bound)
        << onebit.compressed_step_bytes << " vs " << onebit.warmup_step_bytes;
    EXPECT_LE(static_cast<double>(onebit.last_step_bytes), static_cast<double>(onebit.warmup_step_bytes) / bound)
        << onebit.last_step_bytes << " vs " << onebit.warmup_step_bytes;
    if (zero_one) {  // a local step sends scalars (the gradient norm, the loss) and nothing else
      EXPECT_LE(onebit.local_step_bytes, 256) << onebit.local_step_bytes << " bytes in a local step";
    }
  }
  // The replicas agree: every rank's parameters equal rank 0's (0/1 Adam's after its last
  // synchronisation, step 60).
  for (const auto& [name, t] : onebit.params) {
    at::Tensor mine = t.contiguous().clone(), root = mine.clone();
    world()->broadcast(root, 0);
    EXPECT_TRUE(at::equal(mine, root)) << name << " differs by " << (mine - root).abs().max().item<double>();
  }
  if (world()->rank() == 0) {
    std::printf("%s %s dp %d, %d steps: loss of the last 10 steps %.4f uncompressed, %.4f compressed (%+.2f%%); "
                "bytes per step %ld exact, %ld compressed (1/%.1f), %ld last%s\n",
                type.c_str(), fp16 ? "fp16" : "fp32", dp, steps, la, lo, 100.0 * (lo - la) / la,
                static_cast<long>(onebit.warmup_step_bytes), static_cast<long>(onebit.compressed_step_bytes),
                static_cast<double>(onebit.warmup_step_bytes) / std::max<double>(1.0, onebit.compressed_step_bytes),
                static_cast<long>(onebit.last_step_bytes),
                zero_one ? ts::concat(", ", onebit.local_step_bytes, " in a local step").c_str() : "");
  }
}
}  // namespace

TEST(OneBit, AdamPastItsWarmUpTrainsLikeAdamWithAThirtySecondOfTheBytes) { check_training("OneBitAdam", /*fp16=*/false); }
TEST(OneBit, Fp16AdamPastItsWarmUpTrainsLikeFp16Adam) { check_training("OneBitAdam", /*fp16=*/true); }
TEST(OneBit, ZeroOneAdamTrainsLikeAdamWithLocalStepsAndCompressedSyncs) { check_training("ZeroOneAdam", /*fp16=*/false); }

TEST(OneBit, LambPastItsWarmUpTrainsLikeLambWithAThirtySecondOfTheBytes) { check_training("OneBitLamb", /*fp16=*/false); }

// 1-bit Lamb's state past the warm-up is the moments, the fresh variance and three scalars per
// tensor: a checkpoint must hold all of it. On one rank (no compression errors, which DeepSpeed
// drops on load too) a run resumed from its checkpoint continues bit-exactly.
TEST(OneBit, LambCheckpointResumesBitExactly) {
  auto self = world()->split(world()->rank(), 0, "self");
  auto groups = ts::parallel::make_parallel_groups(self, ts::parallel::ProcessGrid(1));
  ts::config::WorldShape shape;
  shape.world_size = 1;
  const auto cfg = ts::config::Config::parse(
      {{"train_micro_batch_size_per_gpu", 4},
       {"optimizer", {{"type", "OneBitLamb"}, {"params", {{"lr", 2e-3}, {"weight_decay", 0.01}, {"freeze_step", 6}, {"max_coeff", 0.3}}}}}},
      shape);
  ts::models::GPTConfig g;
  g.vocab = 64;
  g.seq_len = 16;
  g.d_model = 32;
  g.n_layer = 1;
  g.n_head = 2;
  auto batch = [&](int s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + s);
    at::Tensor x = at::randint(0, g.vocab, {4, g.seq_len + 1}, gen, at::kLong);
    return std::make_pair(x.narrow(1, 0, g.seq_len).contiguous(), x.narrow(1, 1, g.seq_len).contiguous());
  };
  auto run = [&](auto& engine, int from, int to) {
    std::vector<double> l;
    for (int s = from; s < to; ++s) l.push_back(engine->train_batch([&] { return batch(s); }));
    return l;
  };
  // Per world size too: CTest runs the np2, np3 and np4 variants side by side in one folder.
  const std::string dir = "onebit_lamb_ckpt_np" + std::to_string(world()->size()) + "_" + std::to_string(world()->rank());
  auto straight = ts::initialize(groups, ts::models::gpt_spec(g, 5), cfg);
  const auto want = run(straight, 0, 14);
  auto first = ts::initialize(groups, ts::models::gpt_spec(g, 5), cfg);
  run(first, 0, 10);
  first->save_checkpoint(dir);
  auto resumed = ts::initialize(groups, ts::models::gpt_spec(g, 99), cfg);  // other weights until loaded
  ASSERT_TRUE(resumed->load_checkpoint(dir));
  const auto got = run(resumed, 10, 14);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], want[10 + i]) << "step " << 11 + i;
  const auto a = straight->master_params(), b = resumed->master_params();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  std::filesystem::remove_all(dir);
}
