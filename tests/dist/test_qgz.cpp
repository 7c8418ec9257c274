// ZeRO++ qgZ (Note [Quantized reduce-scatter] in comm/compressed.h): the quantized
// reduce-scatter against the exact sum, computed here from every rank's input in double, within
// the bound the 4-bit blocks allow and not exact (the quantization happened); inf and NaN make
// their block NaN; values on the quantization grid pass exactly. Run at 2 and 4 ranks (every rank its own
// "host") and at 4 ranks as 2 hosts of 2 (TORCHSPEED_COMM_HOST_SIZE=2: the intra-host stage in
// fp32, then 4-bit across). Then the engine: ZeRO-2 and ZeRO-3 with zero_quantized_gradients
// train the tiny GPT to within 1% of the unquantized losses.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "dist_util.h"
#include "torchspeed/comm/compressed.h"
#include "torchspeed/config/config.h"
#include "torchspeed/data/text.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"

using ts_test::world;
namespace ts = torchspeed;
using ts::comm::QuantizedReduceScatter;

namespace {
at::Tensor input(int r, int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(91 + r);
  return at::randn({n}, gen, at::kFloat) * (1.0 + 0.5 * r);
}
}  // namespace

TEST(QuantizedReduceScatter, SumsWithinTheQuantizationBound) {
  auto comm = world()->split(0, world()->rank(), "qgz");
  const int p = comm->size(), me = comm->rank();
  QuantizedReduceScatter qrs(comm);
  const int hosts = qrs.hosts(), local = p / hosts;
  if (comm->hierarchy_hosts() > 1) {
    EXPECT_EQ(hosts, comm->hierarchy_hosts());
    EXPECT_GT(local, 1);
  } else {
    EXPECT_EQ(hosts, p);
  }
  for (int64_t c : {int64_t{1}, int64_t{127}, int64_t{1003}, int64_t{4096}}) {
    SCOPED_TRACE(testing::Message() << c << " elements per chunk, " << p << " ranks, " << hosts << " hosts");
    const at::Tensor mine = input(me, p * c);
    at::Tensor all = at::empty({p, p * c}, at::kFloat);
    comm->all_gather(mine, all);
    at::Tensor out = at::empty({c}, at::kFloat);
    qrs.run(mine, out, ts::comm::ReduceOp::kSum);
    // Host h's partial sum of this rank's chunk (what crosses the link from host h), exact sum
    // in double, and the bound: half a quantization step of every other host's block.
    const int my_host = me / local;
    const at::Tensor chunks = all.view({p, p, c}).select(1, me).to(at::kDouble);  // [rank, c]
    const at::Tensor exact = chunks.sum(0);
    at::Tensor bound = at::zeros({c}, at::kDouble);
    for (int h = 0; h < hosts; ++h) {
      if (h == my_host) continue;
      const at::Tensor partial = chunks.narrow(0, h * local, local).sum(0);
      for (int64_t b = 0; b < c; b += QuantizedReduceScatter::kBlock) {
        const int64_t n = std::min(QuantizedReduceScatter::kBlock, c - b);
        const double step = partial.narrow(0, b, n).abs().max().item<double>() / 7.0;
        bound.narrow(0, b, n).add_(step / 2.0 * 1.0001 + 1e-6);
      }
    }
    const at::Tensor err = (out.to(at::kDouble) - exact).abs();
    EXPECT_TRUE((err <= bound).all().item<bool>()) << "worst excess " << (err - bound).max().item<double>();
    if (c > 1) {  // (one value per block is exact)
      EXPECT_GT(err.max().item<double>(), 1e-4) << "nothing was quantized";
    }
    at::Tensor avg = at::empty({c}, at::kFloat);
    qrs.run(mine, avg, ts::comm::ReduceOp::kAvg);
    EXPECT_TRUE(at::allclose(avg, out / p, 1e-6, 1e-7));
  }
  // An overflow (inf), a NaN, or a block of NaN only in another host's contribution decodes to
  // NaN for its block only.
  const int64_t c = 512;
  at::Tensor x = input(me, p * c);
  const int last = p - 1;  // whose chunk gets rank 0's bad values; another host than rank 0's
  if (me == 0) {
    x[last * c + 5] = std::numeric_limits<float>::infinity();
    x[last * c + 130] = std::numeric_limits<float>::quiet_NaN();
    x.narrow(0, last * c + 384, 128).fill_(std::numeric_limits<float>::quiet_NaN());
  }
  at::Tensor out = at::empty({c}, at::kFloat);
  qrs.run(x, out, ts::comm::ReduceOp::kSum);
  if (me == last && last / local != 0) {
    for (int64_t b : {0, 1, 3}) EXPECT_TRUE(at::isnan(out.narrow(0, 128 * b, 128)).all().item<bool>()) << "block " << b;
    EXPECT_TRUE(at::isfinite(out.narrow(0, 256, 128)).all().item<bool>());
  } else if (me != last) {
    EXPECT_TRUE(at::isfinite(out).all().item<bool>());
  }
  // Blocks far below float's normal range quantize without overflowing 1 / scale.
  const int64_t m = 256;
  std::vector<float> tiny(m), back(m, 0.0f);
  for (int64_t i = 0; i < m; ++i) tiny[i] = 1e-39f * static_cast<float>((i % 15) - 7);
  std::vector<uint8_t> wire(static_cast<size_t>((QuantizedReduceScatter::wire_bytes(m) + 3) / 4 * 4));
  QuantizedReduceScatter::encode(tiny.data(), m, wire.data());
  QuantizedReduceScatter::decode_add(wire.data(), m, back.data());
  for (int64_t i = 0; i < m; ++i) EXPECT_NEAR(back[i], tiny[i], 1e-43f) << i;
}

TEST(QuantizedReduceScatter, ValuesOnTheGridPassExactly) {
  // Block max 7 s: every multiple k s (|k| <= 7) is one of the 15 codes.
  const int64_t n = 300;
  std::vector<float> x(n), y(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) x[i] = 0.25f * static_cast<float>((i % 15) - 7);
  std::vector<uint8_t> wire(static_cast<size_t>((QuantizedReduceScatter::wire_bytes(n) + 3) / 4 * 4));
  EXPECT_EQ(QuantizedReduceScatter::wire_bytes(n), 4 * 3 + 150);
  QuantizedReduceScatter::encode(x.data(), n, wire.data());
  QuantizedReduceScatter::decode_add(wire.data(), n, y.data());
  EXPECT_EQ(x, y);
}

// ZeRO-2 and ZeRO-3 with zero_quantized_gradients against the same runs without: the losses stay
// within 1% over 12 steps of the tiny GPT on fortunes, they are not equal (the quantization
// happened), and the parameters are the same on every rank. At stage 2 also with bf16
// communication (the quantized path takes fp32 in and gives the bucket's dtype back).
TEST(QuantizedReduceScatter, ZeroStages2And3TrainLikeTheUnquantizedRuns) {
  ts::models::GPTConfig g;
  g.vocab = 256;
  g.seq_len = 32;
  g.d_model = 32;
  g.n_layer = 2;
  g.n_head = 2;
  g.dropout = 0.0;
  ts::data::TextCorpus corpus = ts::data::TextCorpus::load("/usr/share/games/fortunes", 0.1, g.seq_len + 1);
  struct Case {
    int stage;
    const char* comm_dtype;
  };
  for (const Case cs : {Case{2, "fp32"}, Case{3, "fp32"}, Case{2, "bf16"}}) {
    SCOPED_TRACE(testing::Message() << "stage " << cs.stage << ", communication " << cs.comm_dtype);
    auto run = [&](bool qgz) {
      nlohmann::json j = {{"train_micro_batch_size_per_gpu", 4},
                          {"gradient_accumulation_steps", 1},
                          {"communication_data_type", cs.comm_dtype},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
                          {"zero_optimization",
                           {{"stage", cs.stage}, {"reduce_bucket_size", 20000}, {"stage3_param_persistence_threshold", 0},
                            {"zero_quantized_gradients", qgz}}}};
      const auto cfg = ts_test::parse_config(j);
      EXPECT_EQ(cfg.zero.quantized_gradients, qgz);
      auto groups = ts_test::dp_groups();
      auto engine = ts::initialize(groups, ts::models::gpt_spec(g, 7), cfg);
      ts::data::TextLoader loader(corpus.train, g.seq_len, 4, world()->rank(), world()->size(), 5);
      std::vector<double> losses;
      for (int s = 0; s < 12; ++s) losses.push_back(engine->train_batch(loader));
      return std::make_pair(losses, engine->master_params());
    };
    const auto [plain, p_plain] = run(false);
    const auto [quant, p_quant] = run(true);
    double worst = 0;
    for (size_t s = 0; s < plain.size(); ++s) {
      EXPECT_NEAR(quant[s], plain[s], 0.01 * plain[s]) << "step " << s + 1;
      worst = std::max(worst, std::fabs(quant[s] / plain[s] - 1));
    }
    if (world()->rank() == 0) {
      std::printf("qgZ, stage %d, %s communication: %zu steps, losses %.4f -> %.4f (plain %.4f -> %.4f), worst step %.3f%% apart\n",
                  cs.stage, cs.comm_dtype, plain.size(), quant.front(), quant.back(), plain.front(), plain.back(), 100 * worst);
    }
    EXPECT_NE(quant.back(), plain.back()) << "the quantized run equals the plain one: nothing was quantized";
    EXPECT_LT(quant.back(), quant.front() - 0.5) << "it learns";
    for (const auto& [name, t] : p_quant) {
      at::Tensor root = t.clone();
      world()->broadcast(root, 0);
      EXPECT_TRUE(at::equal(root, t)) << name << " differs from rank 0's";
    }
  }
}
