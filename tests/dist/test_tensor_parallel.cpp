// Each tensor-parallel layer against its dense counterpart at tp = world size (2 and 4):
// outputs, input gradients and each rank's slice of the weight gradients.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dist_util.h"
#include "torchspeed/tensor_parallel/layers.h"

using ts_test::world;
namespace tpl = torchspeed::tensor_parallel;

namespace {
at::Tensor randn(std::vector<int64_t> shape, int seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat);
}
void expect_close(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_LE((a - b).abs().max().item<double>(), 1e-5 * (1 + b.abs().max().item<double>())) << what;
}
}  // namespace

TEST(TensorParallel, ColumnThenRowEqualsTheDenseMlp) {
  auto tp = world();
  const int r = tp->rank(), n = tp->size();
  const int64_t d = 8, h = 16;
  at::Tensor w1 = randn({h, d}, 1), b1 = randn({h}, 2), w2 = randn({d, h}, 3), b2 = randn({d}, 4);
  at::Tensor x = randn({3, 5, d}, 5);
  // Dense.
  at::Tensor dw1 = w1.clone().requires_grad_(), db1 = b1.clone().requires_grad_(), dw2 = w2.clone().requires_grad_(),
             db2 = b2.clone().requires_grad_(), dx = x.clone().requires_grad_();
  at::Tensor dense = at::linear(at::gelu(at::linear(dx, dw1, db1)), dw2, db2);
  dense.pow(2).sum().backward();
  // Parallel.
  tpl::ColumnParallelLinear col(w1, b1, tp);
  tpl::RowParallelLinear row(w2, b2, tp);
  at::Tensor px = x.clone().requires_grad_();
  at::Tensor out = row(at::gelu(col(px)));
  out.pow(2).sum().backward();
  expect_close(out, dense.detach(), "output");
  expect_close(px.grad(), dx.grad(), "input gradient");
  expect_close(col->weight.grad(), tpl::slice(dw1.grad(), {0, 1}, r, n), "column weight gradient");
  expect_close(col->bias.grad(), tpl::slice(db1.grad(), {0, 1}, r, n), "column bias gradient");
  expect_close(row->weight.grad(), tpl::slice(dw2.grad(), {1, 1}, r, n), "row weight gradient");
  expect_close(row->bias.grad(), db2.grad(), "row bias gradient (replicated)");
  ASSERT_TRUE(tpl::split_of(col->weight).has_value());
  EXPECT_FALSE(tpl::split_of(row->bias).has_value());
}

TEST(TensorParallel, GatheredColumnAndChunkedSplitRoundTrip) {
  auto tp = world();
  const int n = tp->size();
  at::Tensor w = randn({3 * 4 * n, 6}, 7), x = randn({2, 6}, 8);
  tpl::ColumnParallelLinear col(w, at::Tensor(), tp, /*gather_output=*/true, /*chunks=*/3);
  at::Tensor px = x.clone().requires_grad_();
  at::Tensor out = col(px);
  // Gathered output is the rank-order concatenation of the slices, which for chunks=3 is the
  // dense output with each third's pieces regrouped by rank.
  std::vector<at::Tensor> parts;
  for (int k = 0; k < n; ++k) parts.push_back(tpl::slice(w, {0, 3}, k, n));
  expect_close(out, at::linear(x, at::cat(parts, 0)), "gathered output");
  expect_close(tpl::merge(parts, {0, 3}), w, "merge inverts slice");
  out.sum().backward();
  expect_close(px.grad(), at::linear(at::ones({2, 3 * 4 * n}), at::cat(parts, 0).t()), "input gradient");
}

TEST(TensorParallel, VocabParallelEmbeddingAndCrossEntropyEqualTheDenseOnes) {
  auto tp = world();
  const int r = tp->rank(), n = tp->size();
  const int64_t vocab = 8 * n, d = 6;
  at::Tensor w = randn({vocab, d}, 9);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(10);
  at::Tensor tokens = at::randint(0, vocab, {4, 7}, gen, at::kLong);
  at::Tensor targets = at::randint(0, vocab, {4, 7}, gen, at::kLong);
  // Dense: embedding, logits with the tied weight, cross-entropy.
  at::Tensor dw = w.clone().requires_grad_();
  at::Tensor dh = at::embedding(dw, tokens);
  at::Tensor dlogits = at::matmul(dh, dw.t());
  at::Tensor dloss = torch::nn::functional::cross_entropy(dlogits.reshape({-1, vocab}), targets.reshape({-1}));
  dloss.backward();
  // Parallel.
  tpl::VocabParallelEmbedding emb(w, tp);
  at::Tensor h = emb(tokens);
  at::Tensor logits = at::matmul(tpl::copy_to_region(h, tp), emb->weight.t());  // [4, 7, vocab/tp]
  at::Tensor loss = tpl::vocab_parallel_cross_entropy(logits.reshape({-1, vocab / n}), targets.reshape({-1}), tp);
  expect_close(h, dh.detach(), "embedding output");
  EXPECT_NEAR(loss.item<double>(), dloss.item<double>(), 1e-5);
  loss.backward();
  expect_close(emb->weight.grad(), tpl::slice(dw.grad(), {0, 1}, r, n), "tied weight gradient");
}

TEST(TensorParallel, TheGraphOwnsItsCommunicator) {
  // The region functions' backward all-reduces over a communicator the graph keeps: the caller
  // may drop its own (here the only other reference) between forward and backward.
  auto world_comm = world();
  const int n = world_comm->size();
  ASSERT_GT(n, 1) << "registered at 2 and 4 ranks: one rank has no region functions";
  at::Tensor x = randn({4, 6}, 7).requires_grad_();
  at::Tensor y;
  std::weak_ptr<torchspeed::comm::Communicator> alive;
  {
    auto tp = world_comm->split(0, world_comm->rank(), "owned-by-graph");
    alive = tp;
    // Each rank's own part of a gathered output: the backward of copy_to_region sums them.
    at::Tensor gathered = tpl::gather_from_region(tpl::copy_to_region(x, tp) * (tp->rank() + 1), tp);
    y = gathered.narrow(-1, tp->rank() * 6, 6);
  }
  ASSERT_FALSE(alive.expired()) << "the graph keeps the communicator alive";
  y.sum().backward();
  // d/dx of sum_r (r + 1) x over the ranks' parts: n (n + 1) / 2 everywhere.
  EXPECT_TRUE(x.grad().equal(at::full({4, 6}, n * (n + 1) / 2.0)));
  y = at::Tensor();
  EXPECT_TRUE(alive.expired()) << "freeing the graph releases the communicator";
}
