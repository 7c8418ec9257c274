// Point-to-point rings (blocking and non-blocking, several tags in flight) and collectives on
// sub-groups built from a ProcessGrid.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "dist_util.h"
#include "torchspeed/parallel/process_grid.h"

using ts_test::rank_data;
using ts_test::world;

TEST(PointToPoint, NonBlockingRingWithSeveralTagsInFlight) {
  auto& w = *world();
  const int p = w.size(), r = w.rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  for (auto dt : {at::kFloat, at::kBFloat16, at::kLong, at::kByte}) {
    std::vector<at::Tensor> recv_bufs;
    std::vector<torchspeed::comm::WorkPtr> works;
    // Post receives first for tags 0..3 with different sizes, then the sends in reverse tag
    // order: matching is by tag, not by posting order.
    const std::vector<int64_t> sizes = {0, 1, 4097, 1 << 20};
    for (int tag = 0; tag < 4; ++tag) {
      recv_bufs.push_back(at::empty({sizes[tag]}, dt));
      works.push_back(w.recv_async(recv_bufs.back(), prev, tag));
    }
    std::vector<at::Tensor> send_bufs;
    for (int tag = 3; tag >= 0; --tag) {
      send_bufs.push_back(rank_data(r * 10 + tag, sizes[tag], dt));
      works.push_back(w.send_async(send_bufs.back(), next, tag));
    }
    for (auto& wk : works) wk->wait();
    for (int tag = 0; tag < 4; ++tag) {
      EXPECT_TRUE(at::equal(recv_bufs[tag], rank_data(prev * 10 + tag, sizes[tag], dt)))
          << "dtype " << dt << " tag " << tag;
    }
  }
}

TEST(PointToPoint, BlockingPairExchange) {
  auto& w = *world();
  if (w.size() % 2) GTEST_SKIP() << "needs an even number of ranks";
  const int r = w.rank(), peer = r ^ 1;
  at::Tensor mine = rank_data(r, 12345, at::kFloat), theirs = at::empty({12345});
  if (r % 2 == 0) {
    w.send(mine, peer, 7);
    w.recv(theirs, peer, 7);
  } else {
    w.recv(theirs, peer, 7);
    w.send(mine, peer, 7);
  }
  EXPECT_TRUE(at::equal(theirs, rank_data(peer, 12345, at::kFloat)));
}

TEST(SubGroups, GridGroupsReduceAmongTheirMembersOnly) {
  auto& w = world();
  if (w->size() != 4) GTEST_SKIP() << "the 2x2 grid needs 4 ranks";
  for (auto [tp, pp] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {2, 2}}) {
    torchspeed::parallel::ProcessGrid grid(4, tp, pp);
    auto g = torchspeed::parallel::make_parallel_groups(w, grid);
    const int r = w->rank();
    auto check = [&](const torchspeed::comm::CommunicatorPtr& c, const std::vector<int>& members,
                     const char* what) {
      ASSERT_EQ(c->size(), static_cast<int>(members.size())) << what;
      EXPECT_EQ(c->world_ranks(), members) << what;
      EXPECT_EQ(members.at(c->rank()), r) << what;
      // Sum of world ranks over the group, in fp32 and bf16 (through the direct algorithm).
      int64_t want = 0;
      for (int m : members) want += m;
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        at::Tensor t = at::full({3001}, r, at::kFloat).to(dt);
        c->all_reduce(t);
        EXPECT_EQ(t[3000].item<float>(), static_cast<float>(want)) << what << " " << dt;
      }
      at::Tensor gathered = at::empty({c->size()}, at::kLong);
      c->all_gather(at::full({1}, r, at::kLong), gathered);
      EXPECT_TRUE(at::equal(gathered, at::tensor(members, at::kLong))) << what;
    };
    check(g.tp, grid.tp_group(r), "tp");
    check(g.dp, grid.dp_group(r), "dp");
    check(g.pp, grid.pp_group(r), "pp");
    check(g.mp, grid.model_parallel_group(r), "mp");
    // Pipeline neighbours exchange over the pp group.
    if (pp > 1) {
      at::Tensor x = at::full({8}, r, at::kFloat);
      if (!g.last_stage()) g.pp->send(x, g.next_stage, 1);
      if (!g.first_stage()) {
        at::Tensor y = at::empty({8});
        g.pp->recv(y, g.prev_stage, 1);
        EXPECT_EQ(y[0].item<float>(), static_cast<float>(grid.pipeline_prev(r)));
      }
    }
  }
}
