// ProcessGrid: rank <-> (pp, dp, tp) coordinates, TP fastest-varying, then DP, then PP
// (Megatron's order: TP peers are neighbouring ranks, on one node when possible), and the
// communicators of each dimension.
#pragma once

#include <vector>

#include "torchspeed/comm/communicator.h"

namespace torchspeed::parallel {

struct GridCoord {
  int pp = 0, dp = 0, tp = 0;
  bool operator==(const GridCoord& o) const { return pp == o.pp && dp == o.dp && tp == o.tp; }
};

class ProcessGrid {
 public:
  // dp = world_size / (tp * pp); a size that does not divide the world is an error.
  ProcessGrid(int world_size, int tp = 1, int pp = 1);

  int world_size() const { return world_; }
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  int dp() const { return dp_; }

  // rank = pp * (dp * tp) + dp * tp + tp
  int rank_of(const GridCoord& c) const;
  GridCoord coord_of(int rank) const;

  // World ranks of `rank`'s groups, in group-rank order.
  std::vector<int> tp_group(int rank) const;   // same (pp, dp)
  std::vector<int> dp_group(int rank) const;   // same (pp, tp)
  std::vector<int> pp_group(int rank) const;   // same (dp, tp): the pipeline
  std::vector<int> model_parallel_group(int rank) const;  // same dp: every tp x pp rank

  // Pipeline neighbours (world ranks), -1 at the ends.
  int pipeline_prev(int rank) const;
  int pipeline_next(int rank) const;
  bool is_first_stage(int rank) const { return coord_of(rank).pp == 0; }
  bool is_last_stage(int rank) const { return coord_of(rank).pp == pp_ - 1; }

 private:
  void check_rank(int rank) const;
  int world_, tp_, pp_, dp_;
};

// The communicators of one rank's place in the grid.
struct ParallelGroups {
  explicit ParallelGroups(const ProcessGrid& g) : grid(g) {}
  ProcessGrid grid;
  GridCoord coord;
  int rank = 0;                  // world rank
  comm::CommunicatorPtr world;
  comm::CommunicatorPtr tp;      // tensor-parallel peers
  comm::CommunicatorPtr dp;      // data-parallel peers (gradient reduction, ZeRO)
  comm::CommunicatorPtr pp;      // the pipeline this rank is a stage of
  comm::CommunicatorPtr mp;      // model-parallel: tp x pp ranks holding one model replica
  // Expert parallelism (DeepSpeed-MoE's ep_size, add_expert_groups): the data-parallel group
  // splits into expert-parallel groups of ep_size consecutive ranks, which hold the experts
  // between them and exchange tokens, and expert-data-parallel groups of the ranks holding the
  // same experts (dp rank mod ep_size), over which the experts' gradients reduce. Null when
  // none were made (ep_size 1).
  comm::CommunicatorPtr ep;
  comm::CommunicatorPtr edp;
  int ep_size() const { return ep ? ep->size() : 1; }
  // Sequence parallelism (DeepSpeed-Ulysses' sequence_parallel_size, parallel/sequence.h):
  // groups of consecutive data-parallel ranks that split each sequence between them. Null when
  // none were made (size 1).
  comm::CommunicatorPtr sp;
  int sp_size() const { return sp ? sp->size() : 1; }
  int prev_stage = -1;           // rank in `pp` of the previous stage, -1 on the first
  int next_stage = -1;           // rank in `pp` of the next stage, -1 on the last
  bool first_stage() const { return coord.pp == 0; }
  bool last_stage() const { return coord.pp == grid.pp() - 1; }
};

// Collective over `world`: builds every group of the grid.
ParallelGroups make_parallel_groups(const comm::CommunicatorPtr& world, const ProcessGrid& grid);
// Collective over the data-parallel group: makes groups.ep and groups.edp for `ep_size` (which
// must divide the data-parallel size; 1 makes none).
void add_expert_groups(ParallelGroups& groups, int ep_size);

}  // namespace torchspeed::parallel
