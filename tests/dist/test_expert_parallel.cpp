// Expert parallelism's pieces on 2-4 ranks: Communicator::all_to_all with uneven and zero counts
// (and its error for counts that do not add up), and the MoE layer with its experts spread over
// the ranks (MoEImpl::shard_experts) against the same layer whole on every rank: each rank's
// output and input gradient equal to the whole layer's on that rank's tokens, each rank's expert
// gradients the sum over all ranks of the whole layer's gradients of its experts (what ZeRO then
// reduces over the expert-data-parallel group), the router's gradient the rank's own. With token
// dropping, k 1 and 2, the dropless form, and every token to the first rank's expert (the
// others receive none and still take part in both exchanges, forward and backward).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dist_util.h"
#include "torchspeed/models/moe.h"
#include "torchspeed/parallel/expert.h"
#include "torchspeed/base/error.h"

using ts_test::world;
namespace ts = torchspeed;

namespace {

TEST(AllToAll, UnevenAndEmptyBlocks) {
  auto w = world();
  const int n = w->size(), me = w->rank();
  auto rows = [](int from, int to) -> int64_t { return (from + 2 * to) % 3; };  // 0, 1 or 2 rows
  std::vector<int64_t> send, recv;
  std::vector<at::Tensor> blocks;
  for (int j = 0; j < n; ++j) {
    send.push_back(rows(me, j));
    recv.push_back(rows(j, me));
    // Row i of the block for j: [100 me + j, i, -1].
    for (int64_t i = 0; i < rows(me, j); ++i) blocks.push_back(at::tensor({100.0f * me + j, float(i), -1.0f}).view({1, 3}));
  }
  const at::Tensor in = blocks.empty() ? at::empty({0, 3}) : at::cat(blocks);
  int64_t total = 0;
  for (int64_t r : recv) total += r;
  at::Tensor out = at::full({total, 3}, 7.0f);
  w->all_to_all(in, send, out, recv);
  int64_t at_ = 0;
  for (int j = 0; j < n; ++j) {
    for (int64_t i = 0; i < rows(j, me); ++i, ++at_) {
      EXPECT_FLOAT_EQ(out[at_][0].item<float>(), 100.0f * j + me) << "row " << i << " from rank " << j;
      EXPECT_FLOAT_EQ(out[at_][1].item<float>(), float(i));
    }
  }
  // The differentiable form sends the gradient back the way the rows came.
  at::Tensor x = in.clone().requires_grad_(true);
  at::Tensor y = ts::parallel::all_to_all(x, w, send, recv);
  EXPECT_TRUE(y.equal(out));
  (y * y).sum().backward();
  EXPECT_TRUE(x.grad().equal(2 * in));
  // Counts that do not match the tensors are refused before anything is sent.
  EXPECT_THROW(w->all_to_all(in, std::vector<int64_t>(static_cast<size_t>(n), 99), out, recv), ts::Error);
  EXPECT_THROW(w->all_to_all(in, send, out, std::vector<int64_t>(static_cast<size_t>(n + 1), 0)), ts::Error);
}

struct Case {
  int64_t experts, k;
  bool drop;
  double capacity_factor;
  bool all_to_first = false;  // every rank's tokens pick expert 0: the other ranks receive none
};

void check_layer(const Case& c) {
  auto w = world();
  const int P = w->size(), me = w->rank();
  SCOPED_TRACE(testing::Message() << c.experts << " experts, k " << c.k << (c.drop ? " capacity " : " dropless ")
                                  << c.capacity_factor << ", " << P << " ranks");
  ts::models::MoEConfig mc;
  mc.num_experts = c.experts;
  mc.k = c.k;
  mc.d_ff = 8;
  mc.drop_tokens = c.drop;
  mc.capacity_factor = c.capacity_factor;
  mc.min_capacity = 0;
  mc.aux_loss_coef = 0.0;
  const int64_t d = 12, S = 10;
  torch::manual_seed(3);  // the same weights on every rank
  ts::models::MoE whole(mc, d, 0.02);
  torch::manual_seed(3);
  ts::models::MoE split(mc, d, 0.02);
  split->shard_experts(w);
  ASSERT_EQ(split->gate_up.size(0), c.experts / P);
  EXPECT_EQ(ts::parallel::expert_parallel_size(split->gate_up), P);
  EXPECT_FALSE(ts::parallel::expert_parallel_size(split->router).has_value());
  // Each rank its own tokens; rank 1's all lean to expert 0 so other experts get none from it.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + me);
  at::Tensor x = at::randn({2, S / 2, d}, gen);
  if (me == 1 || c.all_to_first) x = x * 0.1 + whole->router[0].detach().view({1, 1, d}) * 20;
  const at::Tensor probe = at::randn({2, S / 2, d}, gen);

  at::Tensor xw = x.clone().requires_grad_(true), xs = x.clone().requires_grad_(true);
  const at::Tensor yw = whole->forward(xw), ys = split->forward(xs);
  (yw * probe).sum().backward();
  (ys * probe).sum().backward();
  EXPECT_TRUE(at::allclose(ys, yw, 1e-5, 1e-6)) << (ys - yw).abs().max().item<double>();
  EXPECT_TRUE(at::allclose(xs.grad(), xw.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(split->router.grad(), whole->router.grad(), 1e-5, 1e-7));
  // This rank's experts' gradients: every rank's tokens' contributions.
  for (const auto& [name, mine, full] : {std::make_tuple("gate_up", split->gate_up, whole->gate_up),
                                         std::make_tuple("down", split->down, whole->down)}) {
    at::Tensor sum = full.grad().clone();
    w->all_reduce(sum);
    const at::Tensor want = ts::parallel::local_experts(sum, me, P);
    EXPECT_TRUE(at::allclose(mine.grad(), want, 1e-5, 1e-7)) << name << ": " << (mine.grad() - want).abs().max().item<double>();
  }
  // Evaluation (no gradients) exchanges too, and agrees.
  {
    torch::NoGradGuard g;
    whole->eval();
    split->eval();
    EXPECT_TRUE(at::allclose(split->forward(x), whole->forward(x), 1e-5, 1e-6));
  }
}

TEST(ExpertParallelMoE, MatchesTheWholeLayer) {
  const int P = world()->size();
  check_layer({2 * P, 2, true, 1.0});
  check_layer({2 * P, 1, true, 0.5});  // tight capacity: many routes dropped
  check_layer({P, 2, false, 1.0});     // dropless, one expert per rank
  check_layer({2 * P, 1, false, 1.0, /*all_to_first=*/true});
}

TEST(ExpertParallelMoE, RefusesExpertsThatDoNotDivide) {
  const int P = world()->size();
  ASSERT_GT(P, 1) << "registered at 2 and 4 ranks";
  ts::models::MoEConfig mc;
  mc.num_experts = P + 1;
  mc.k = 1;
  mc.d_ff = 4;
  ts::models::MoE m(mc, 8, 0.02);
  EXPECT_THROW(m->shard_experts(world()), ts::Error);
}

}  // namespace
