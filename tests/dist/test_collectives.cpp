// Every collective x dtype x size against a reference each rank computes from all ranks' inputs.
// Sizes: 0, 1, odd, not divisible by the rank count, and larger than one chunk (chunked and
// pipelined paths). bf16/fp16 sums must equal an fp32 left-to-right sum rounded once, bit for bit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>

#include "dist_util.h"
#include "torchspeed/base/error.h"

using torchspeed::comm::ReduceOp;
using ts_test::rank_data;
using ts_test::world;

namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                             at::kInt,   at::kLong,   at::kByte};
// 1.5M elements: 6 MiB in fp32, so the 4 MiB-chunked paths run with a partial last chunk.
const std::vector<int64_t> kSizes = {0, 1, 7, 1001, 1500007};

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// Reference: fp32 (fp64 for double) left to right in rank order, rounded once to the dtype.
at::Tensor reference(ReduceOp op, int p, int64_t n, at::ScalarType dt, bool integral) {
  at::ScalarType acc_t = dt == at::kDouble ? at::kDouble
                         : at::isFloatingType(dt) ? at::kFloat
                                                  : at::kLong;
  at::Tensor acc = rank_data(0, n, dt, integral).to(acc_t);
  for (int r = 1; r < p; ++r) {
    at::Tensor x = rank_data(r, n, dt, integral).to(acc_t);
    if (op == ReduceOp::kMax) acc = at::maximum(acc, x);
    else if (op == ReduceOp::kMin) acc = at::minimum(acc, x);
    else acc = acc + x;
  }
  if (op == ReduceOp::kAvg) acc = acc / p;
  if (dt == at::kByte) acc = acc.remainder(256);  // uint8 sums wrap, as MPI's do
  return acc.to(dt);
}

std::vector<ReduceOp> ops_for(at::ScalarType dt) {
  if (at::isFloatingType(dt)) return {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};
  return {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, bool exact, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (got.numel() == 0) return;
  if (exact) {
    // Bitwise: compare the raw bytes.
    auto g = got.contiguous().view(at::kByte), w = want.contiguous().view(at::kByte);
    ASSERT_TRUE(at::equal(g, w)) << what << ": max abs diff "
                                 << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  } else {
    ASSERT_TRUE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), 1e-5, 1e-5))
        << what << ": max abs diff "
        << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  }
}

std::string name_of(const char* op, at::ScalarType dt, ReduceOp rop, int64_t n) {
  return torchspeed::concat(op, " ", dt, " ", torchspeed::comm::reduce_op_name(rop), " n=", n);
}

}  // namespace

TEST(Collectives, AllReduceEveryDtypeOpAndSize) {
  auto& w = *world();
  for (auto dt : kDtypes) {
    for (auto op : ops_for(dt)) {
      for (int64_t n : kSizes) {
        // fp32/fp64 sums go through MPI's own reduction order: use integer values so every order
        // is exact. Half types use our fixed-order kernel: random values, exact bits.
        const bool integral = !is_half(dt) && op != ReduceOp::kAvg;
        at::Tensor t = rank_data(w.rank(), n, dt, integral);
        w.all_reduce(t, op);
        expect_equal(t, reference(op, w.size(), n, dt, integral), integral || is_half(dt),
                     name_of("all_reduce", dt, op, n));
      }
    }
  }
}

TEST(Collectives, HalfSumsRoundOnceInFp32) {
  // 1 + 2^-9 four times: bf16 has 8 significand bits, so a pairwise bf16 sum loses every 2^-9
  // term (1 + 2^-9 rounds to 1), while fp32 accumulation keeps them: 4 + 4 * 2^-9 = 4.0078125,
  // which bf16 rounds to 4.0 at p = 2 and to 4.03125 at p = 4 (exactly representable).
  auto& w = *world();
  at::Tensor t = at::full({1000}, 1.0 + 1.0 / 512, at::kFloat).to(at::kBFloat16);
  float exact = 0.0f;
  for (int r = 0; r < w.size(); ++r) exact += t[0].item<float>();
  w.all_reduce(t);
  float want = at::full({1}, exact, at::kFloat).to(at::kBFloat16).item<float>();
  EXPECT_EQ(t[0].item<float>(), want);
  EXPECT_TRUE(at::equal(t, at::full({1000}, want, at::kFloat).to(at::kBFloat16)));
}

TEST(Collectives, ReduceScatterEveryDtypeAndSize) {
  auto& w = *world();
  const int p = w.size();
  for (auto dt : kDtypes) {
    for (auto op : ops_for(dt)) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{1001}, int64_t{700001}}) {
        const bool integral = !is_half(dt) && op != ReduceOp::kAvg;
        at::Tensor in = rank_data(w.rank(), n * p, dt, integral);
        at::Tensor out = at::empty({n}, dt);
        w.reduce_scatter(in, out, op);
        at::Tensor full = reference(op, p, n * p, dt, integral);
        expect_equal(out, full.narrow(0, w.rank() * n, n), integral || is_half(dt),
                     name_of("reduce_scatter", dt, op, n));
      }
    }
  }
}

TEST(Collectives, AllGatherEveryDtypeAndSize) {
  auto& w = *world();
  const int p = w.size();
  for (auto dt : kDtypes) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{1001}, int64_t{700001}}) {
      at::Tensor in = rank_data(w.rank(), n, dt);
      at::Tensor out = at::empty({n * p}, dt);
      w.all_gather(in, out);
      std::vector<at::Tensor> parts;
      for (int r = 0; r < p; ++r) parts.push_back(rank_data(r, n, dt));
      expect_equal(out, at::cat(parts), true, name_of("all_gather", dt, ReduceOp::kSum, n));
    }
  }
}

TEST(Collectives, BroadcastFromEveryRoot) {
  auto& w = *world();
  for (auto dt : kDtypes) {
    for (int root = 0; root < w.size(); ++root) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{1500007}}) {
        at::Tensor t = rank_data(w.rank(), n, dt);
        w.broadcast(t, root);
        expect_equal(t, rank_data(root, n, dt), true, name_of("broadcast", dt, ReduceOp::kSum, n));
      }
    }
  }
}

TEST(Collectives, ManyAsyncOpsCompleteInOrder) {
  auto& w = *world();
  std::vector<at::Tensor> ts;
  std::vector<torchspeed::comm::WorkPtr> works;
  for (int i = 0; i < 24; ++i) {
    int64_t n = (i % 3 == 0) ? 1200003 : 100 + i;
    auto dt = i % 2 ? at::kBFloat16 : at::kFloat;
    ts.push_back(rank_data(w.rank(), n, dt, !is_half(dt)));
    works.push_back(w.all_reduce_async(ts.back()));
  }
  // A blocking op submitted behind the queue must wait its turn and still be right.
  at::Tensor b = rank_data(w.rank(), 777, at::kLong);
  w.all_reduce(b);
  expect_equal(b, reference(ReduceOp::kSum, w.size(), 777, at::kLong, true), true, "blocking behind queue");
  for (size_t i = 0; i < works.size(); ++i) {
    works[i]->wait();
    EXPECT_TRUE(works[i]->is_completed());
    auto dt = ts[i].scalar_type();
    expect_equal(ts[i], reference(ReduceOp::kSum, w.size(), ts[i].numel(), dt, !is_half(dt)), true,
                 torchspeed::concat("async #", i));
  }
}

// With TORCHSPEED_COMM_HOST_SIZE (the hosts_2 variant of this test), every test above ran the
// staged collectives of Note [Hierarchical collectives] for its large sizes; here, that they ran.
TEST(Collectives, StagedAcrossHostsWhenTheLayoutAllows) {
  auto& w = *world();
  const char* hs = std::getenv("TORCHSPEED_COMM_HOST_SIZE");
  const int L = hs ? std::atoi(hs) : 0;
  const int expected = L > 1 && w.size() >= 4 && w.size() % L == 0 && w.size() / L > 1 ? w.size() / L : 0;
  if (hs) {
    EXPECT_EQ(w.hierarchy_hosts(), expected);
  }
  // A group of one rank per host (the ranks of local index 0) has nothing to stage.
  auto firsts = w.split(L > 0 ? w.rank() % L : 0, w.rank(), "firsts");
  EXPECT_EQ(firsts->hierarchy_hosts(), 0);
  if (expected > 0) {
    // Staged sums on hosts' partial sums: fp32 values whose every order is exact agree bitwise
    // with the flat reference above; here a large random fp32 tensor agrees within rounding.
    at::Tensor t = at::randn({300001}, at::TensorOptions().dtype(at::kFloat)).mul_(w.rank() + 1);
    at::Tensor all = at::empty({300001 * w.size()}, at::kFloat);
    w.all_gather(t, all);
    at::Tensor want = all.view({w.size(), -1}).sum(0);
    w.all_reduce(t);
    EXPECT_TRUE(at::allclose(t, want, 1e-5, 1e-4));
    // Every rank holds the same bits.
    at::Tensor mine = t.clone(), gathered = at::empty({300001 * w.size()}, at::kFloat);
    w.all_gather(mine, gathered);
    for (int r = 0; r < w.size(); ++r) EXPECT_TRUE(at::equal(gathered.view({w.size(), -1})[r], mine)) << "rank " << r;
    // all_gather adds nothing, so it is staged for every dtype (which link carries the bytes,
    // benchmarks/multihost_zero.sh counts): odd-sized bf16 and byte chunks land in rank order.
    for (auto dt : {at::kBFloat16, at::kByte}) {
      at::Tensor in = rank_data(w.rank(), 200003, dt), out = at::empty({200003 * w.size()}, dt);
      w.all_gather(in, out);
      for (int r = 0; r < w.size(); ++r) EXPECT_TRUE(at::equal(out.view({w.size(), -1})[r], rank_data(r, 200003, dt))) << dt;
    }
  }
}

// Note [Pipelined stages]: a staged reduce_scatter / all_gather cut into many segments (4 KiB
// here, the last one partial) gives the bits of the same collective in one segment: each
// element is summed in the same order whatever the cut. Integer-valued sums also equal the flat
// reference exactly.
TEST(Collectives, PipelinedSegmentsGiveTheSameBits) {
  auto& w = *world();
  // Runs where ranks are grouped into hosts (the hosts2 variant); there the collectives must be staged.
  if (!std::getenv("TORCHSPEED_COMM_HOST_SIZE")) GTEST_SKIP() << "one host: no staged collectives (the hosts2 variant runs this)";
  ASSERT_GT(w.hierarchy_hosts(), 0) << "TORCHSPEED_COMM_HOST_SIZE is set but the collectives are not staged";
  const int p = w.size();
  auto many = w.split(0, w.rank(), "segments", torchspeed::comm::CommOptions().segment_bytes(4096));
  auto one = w.split(0, w.rank(), "one-segment", torchspeed::comm::CommOptions().segment_bytes(int64_t{1} << 30));
  ASSERT_EQ(many->hierarchy_hosts(), w.hierarchy_hosts());
  const int64_t n = 100003;  // per rank: 98 segments of 1024 fp32 columns, the last of 675
  for (auto dt : {at::kFloat, at::kDouble, at::kInt}) {
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !at::isFloatingType(dt)) continue;
      at::Tensor in = rank_data(w.rank(), n * p, dt, /*integral=*/true);
      at::Tensor a = at::empty({n}, dt), b = at::empty({n}, dt);
      many->reduce_scatter(in, a, op);
      one->reduce_scatter(in, b, op);
      expect_equal(a, b, true, name_of("segmented reduce_scatter", dt, op, n));
      expect_equal(a, reference(op, p, n * p, dt, true).narrow(0, w.rank() * n, n), op == ReduceOp::kSum,
                   name_of("segmented reduce_scatter vs reference", dt, op, n));
    }
  }
  at::Tensor r = at::randn({n * p}).mul_(w.rank() + 1), a = at::empty({n}), b = at::empty({n});
  many->reduce_scatter(r, a);
  one->reduce_scatter(r, b);
  expect_equal(a, b, true, "segmented reduce_scatter of random fp32");
  for (auto dt : {at::kFloat, at::kBFloat16, at::kByte}) {
    at::Tensor in = rank_data(w.rank(), n, dt), out = at::empty({n * p}, dt);
    many->all_gather(in, out);
    for (int q = 0; q < p; ++q) EXPECT_TRUE(at::equal(out.view({p, -1})[q], rank_data(q, n, dt))) << "all_gather " << dt << " rank " << q;
  }
}

TEST(Collectives, StatsCountPayloadBytes) {
  auto& w = *world();
  auto before = w.stats();
  at::Tensor f = at::ones({1000}, at::kFloat), h = at::ones({1000}, at::kBFloat16);
  w.all_reduce(f);
  w.all_reduce(h);
  auto after = w.stats();
  EXPECT_EQ(after["all_reduce"].ops - before["all_reduce"].ops, 2);
  EXPECT_EQ(after["all_reduce"].bytes - before["all_reduce"].bytes, 4000 + 2000);
}

TEST(Collectives, BadInputIsAClearError) {
  auto& w = *world();
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      FAIL() << "expected an error containing '" << needle << "'";
    } catch (const torchspeed::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  at::Tensor m = at::ones({4, 6});
  expect_error([&] { w.all_reduce(m.t()); }, "not contiguous");
  expect_error([&] { w.all_reduce(at::ones({3}, at::kBool)); }, "has dtype Bool");
  expect_error([&] { w.all_reduce(at::empty({3}, at::TensorOptions().device(at::kMeta))); }, "is on meta");
  expect_error([&] { w.all_reduce(at::ones({3}, at::kInt), ReduceOp::kAvg); }, "needs a floating dtype");
  expect_error([&] { w.reduce_scatter(at::ones({w.size() * 3 + 1}), at::ones({3})); }, "equal chunks");
  expect_error([&] { w.all_gather(at::ones({3}), at::ones({3 * w.size() + 2})); }, "must hold");
  expect_error([&] { w.all_gather(at::ones({3}), at::ones({3 * w.size()}, at::kDouble)); }, "differs from output dtype");
  expect_error([&] { w.broadcast(at::ones({3}), w.size()); }, "not a rank of this group");
  expect_error([&] { w.send(at::ones({3}), -1); }, "not a rank of this group");
  expect_error([&] { w.all_reduce(at::Tensor()); }, "undefined tensor");
  // The message names the op and group, so a user can tell which call was wrong.
  expect_error([&] { w.all_reduce(m.t()); }, "all_reduce on group 'world' (rank ");
  // After these errors the communicator is still usable.
  at::Tensor t = at::ones({5});
  w.all_reduce(t);
  EXPECT_EQ(t[0].item<float>(), static_cast<float>(w.size()));
}

TEST(Collectives, AsyncOpsOwnTheirTensors) {
  // Temporaries passed to async ops: once the call returns, only the op refers to them. Sizes
  // of several chunks keep the ops in flight while the allocator below reuses freed memory.
  auto& w = *world();
  const int p = w.size();
  const int64_t n = 1500007, m = 700001;
  at::Tensor x = rank_data(w.rank(), n, at::kFloat);
  auto ar = w.all_reduce_async(x.to(at::kHalf));
  auto rs = w.reduce_scatter_async(rank_data(w.rank(), m * p, at::kBFloat16),
                                   at::empty({m}, at::kBFloat16));
  auto ag = w.all_gather_async(rank_data(w.rank(), m, at::kFloat), at::empty({m * p}));
  // Dropped without wait(): the op still completes, in order, before the blocking one behind it.
  w.all_reduce_async(rank_data(w.rank(), n, at::kLong) * 1);
  for (int i = 0; i < 8; ++i) {
    at::Tensor junk = at::full({n}, 7.0, at::kHalf);
    junk.add_(1.0);
  }
  at::Tensor behind = rank_data(w.rank(), 777, at::kLong);
  w.all_reduce(behind);
  expect_equal(behind, reference(ReduceOp::kSum, p, 777, at::kLong, true), true, "blocking behind");
  ar->wait();
  rs->wait();
  ag->wait();
  for (auto* work : {&ar, &rs, &ag}) {
    EXPECT_TRUE((*work)->is_completed());
    EXPECT_EQ((*work)->exception(), nullptr);
    ASSERT_EQ((*work)->result().size(), 1u);
  }
  expect_equal(ar->result()[0], reference(ReduceOp::kSum, p, n, at::kHalf, false), true,
               "all_reduce of a temporary");
  expect_equal(rs->result()[0],
               reference(ReduceOp::kSum, p, m * p, at::kBFloat16, false).narrow(0, w.rank() * m, m),
               true, "reduce_scatter into a temporary");
  std::vector<at::Tensor> parts;
  for (int r = 0; r < p; ++r) parts.push_back(rank_data(r, m, at::kFloat));
  expect_equal(ag->result()[0], at::cat(parts), true, "all_gather into a temporary");

  // Point to point: a temporary sent (its Work dropped), a temporary received.
  if (w.rank() == 0) {
    w.send_async(x.to(at::kHalf), 1, 5);
  } else if (w.rank() == 1) {
    auto recv = w.recv_async(at::empty({n}, at::kHalf), 0, 5);
    recv->wait();
    ASSERT_EQ(recv->result().size(), 1u);
    expect_equal(recv->result()[0], rank_data(0, n, at::kFloat).to(at::kHalf), true, "recv");
  }
  w.barrier();
}
