// The SIMD reduction kernels against plain LibTorch arithmetic: fp32 accumulation rounded once,
// bit-identical to c10's conversions (including NaN, infinities and ties), for every length
// (vector body and scalar tail).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "torchspeed/comm/detail/reduce_kernels.h"

using torchspeed::comm::ReduceOp;

TEST(ReduceKernels, HalfTypesMatchFp32ReferenceBitForBit) {
  for (auto dt : {at::kBFloat16, at::kHalf}) {
    for (int p : {2, 3, 4, 8}) {
      for (int64_t n : {1, 15, 16, 17, 1000}) {
        std::vector<at::Tensor> xs;
        for (int j = 0; j < p; ++j) xs.push_back(at::randn({n}).mul(j + 1).to(dt));
        // Specials: NaN, inf, a value that rounds on a tie.
        xs[0][0] = std::numeric_limits<float>::quiet_NaN();
        if (n > 1) xs[1][n - 1] = std::numeric_limits<float>::infinity();
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
          at::Tensor acc = xs[0].to(at::kFloat);
          for (int j = 1; j < p; ++j) {
            at::Tensor x = xs[j].to(at::kFloat);
            acc = op == ReduceOp::kMax ? at::maximum(acc, x) : op == ReduceOp::kMin ? at::minimum(acc, x) : acc + x;
          }
          if (op == ReduceOp::kAvg) acc = acc / p;
          at::Tensor want = acc.to(dt);
          std::vector<const void*> ptrs;
          for (auto& x : xs) ptrs.push_back(x.data_ptr());
          at::Tensor out = at::empty({n}, dt);
          torchspeed::comm::detail::reduce_pieces(dt, op, ptrs.data(), p, n, out.data_ptr());
          // NaN compares unequal: compare as bits after mapping every NaN to one pattern.
          at::Tensor w = at::where(want.isnan(), at::zeros_like(want), want);
          at::Tensor g = at::where(out.isnan(), at::zeros_like(out), out);
          ASSERT_TRUE(at::equal(w.view(at::kShort), g.view(at::kShort)) && at::equal(want.isnan(), out.isnan()))
              << dt << " p=" << p << " n=" << n << " op=" << torchspeed::comm::reduce_op_name(op);
        }
      }
    }
  }
}

TEST(ReduceKernels, OutputMayAliasAPiece) {
  at::Tensor a = at::arange(37, at::kFloat), b = at::ones({37});
  const void* ptrs[2] = {a.data_ptr(), b.data_ptr()};
  torchspeed::comm::detail::reduce_pieces(at::kFloat, ReduceOp::kSum, ptrs, 2, 37, a.data_ptr());
  EXPECT_TRUE(at::equal(a, at::arange(37, at::kFloat) + 1));
}
