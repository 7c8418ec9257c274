// ProcessGrid arithmetic for every (tp, pp) that divides 8: a bijection between ranks and
// coordinates, TP fastest-varying then DP then PP, groups that partition the world.
#include <gtest/gtest.h>

#include <set>

#include "torchspeed/parallel/process_grid.h"
#include "torchspeed/base/error.h"

using torchspeed::parallel::GridCoord;
using torchspeed::parallel::ProcessGrid;

TEST(ProcessGrid, EveryShapeThatDividesEight) {
  const int world = 8;
  for (int tp : {1, 2, 4, 8}) {
    for (int pp : {1, 2, 4, 8}) {
      if (world % (tp * pp)) continue;
      ProcessGrid g(world, tp, pp);
      SCOPED_TRACE(testing::Message() << "tp " << tp << " pp " << pp);
      EXPECT_EQ(g.dp(), world / (tp * pp));
      std::set<std::tuple<int, int, int>> coords;
      for (int r = 0; r < world; ++r) {
        GridCoord c = g.coord_of(r);
        EXPECT_EQ(g.rank_of(c), r);
        coords.insert({c.pp, c.dp, c.tp});
        // Megatron order: rank = pp * dp * tp + dp_idx * tp + tp_idx.
        EXPECT_EQ(r, c.pp * g.dp() * tp + c.dp * tp + c.tp);
        // Groups: sizes, membership, and the same group seen from each member.
        auto tpg = g.tp_group(r), dpg = g.dp_group(r), ppg = g.pp_group(r), mpg = g.model_parallel_group(r);
        EXPECT_EQ(static_cast<int>(tpg.size()), tp);
        EXPECT_EQ(static_cast<int>(dpg.size()), g.dp());
        EXPECT_EQ(static_cast<int>(ppg.size()), pp);
        EXPECT_EQ(static_cast<int>(mpg.size()), tp * pp);
        for (int m : tpg) EXPECT_EQ(g.tp_group(m), tpg);
        for (int m : dpg) EXPECT_EQ(g.dp_group(m), dpg);
        for (int m : ppg) EXPECT_EQ(g.pp_group(m), ppg);
        for (int m : tpg) EXPECT_EQ(g.coord_of(m).dp, c.dp);
        // TP peers are consecutive ranks.
        for (size_t i = 1; i < tpg.size(); ++i) EXPECT_EQ(tpg[i], tpg[i - 1] + 1);
        // Pipeline neighbours.
        EXPECT_EQ(g.pipeline_prev(r), c.pp == 0 ? -1 : g.rank_of({c.pp - 1, c.dp, c.tp}));
        EXPECT_EQ(g.pipeline_next(r), c.pp == pp - 1 ? -1 : g.rank_of({c.pp + 1, c.dp, c.tp}));
        EXPECT_EQ(g.is_first_stage(r), c.pp == 0);
        EXPECT_EQ(g.is_last_stage(r), c.pp == pp - 1);
      }
      EXPECT_EQ(static_cast<int>(coords.size()), world);
    }
  }
}

TEST(ProcessGrid, SizesThatDoNotDivideAreClearErrors) {
  try {
    ProcessGrid g(8, 3, 1);
    FAIL();
  } catch (const torchspeed::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tp (3) x pp (1) = 3 does not divide the world size 8"), std::string::npos);
  }
  EXPECT_THROW(ProcessGrid(6, 2, 2), torchspeed::Error);
  EXPECT_THROW(ProcessGrid(4, 0, 1), torchspeed::Error);
  ProcessGrid g(4, 2, 1);
  EXPECT_THROW(g.coord_of(4), torchspeed::Error);
  EXPECT_THROW(g.rank_of({0, 2, 0}), torchspeed::Error);
}
