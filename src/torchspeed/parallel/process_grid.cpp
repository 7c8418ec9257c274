// Grid arithmetic and group construction (communicator splits with the grid's colors).
#include "torchspeed/parallel/process_grid.h"

#include "torchspeed/base/error.h"

namespace torchspeed::parallel {

ProcessGrid::ProcessGrid(int world_size, int tp, int pp) : world_(world_size), tp_(tp), pp_(pp) {
  TS_CHECK(world_size >= 1, "ProcessGrid: world size must be >= 1, got ", world_size);
  TS_CHECK(tp >= 1 && pp >= 1, "ProcessGrid: tp and pp must be >= 1, got tp=", tp, " pp=", pp);
  TS_CHECK(world_size % (tp * pp) == 0, "ProcessGrid: tp (", tp, ") x pp (", pp, ") = ", tp * pp,
           " does not divide the world size ", world_size,
           "; choose sizes whose product divides it (data parallelism takes the rest)");
  dp_ = world_size / (tp * pp);
}

void ProcessGrid::check_rank(int rank) const {
  TS_CHECK(rank >= 0 && rank < world_, "ProcessGrid: rank ", rank, " outside the world of ",
           world_);
}

int ProcessGrid::rank_of(const GridCoord& c) const {
  TS_CHECK(c.pp >= 0 && c.pp < pp_ && c.dp >= 0 && c.dp < dp_ && c.tp >= 0 && c.tp < tp_,
           "ProcessGrid: coordinate (pp ", c.pp, ", dp ", c.dp, ", tp ", c.tp,
           ") outside the grid (pp ", pp_, ", dp ", dp_, ", tp ", tp_, ")");
  return c.pp * dp_ * tp_ + c.dp * tp_ + c.tp;
}

GridCoord ProcessGrid::coord_of(int rank) const {
  check_rank(rank);
  GridCoord c;
  c.tp = rank % tp_;
  c.dp = (rank / tp_) % dp_;
  c.pp = rank / (tp_ * dp_);
  return c;
}

std::vector<int> ProcessGrid::tp_group(int rank) const {
  GridCoord c = coord_of(rank);
  std::vector<int> out;
  for (int t = 0; t < tp_; ++t) out.push_back(rank_of({c.pp, c.dp, t}));
  return out;
}

std::vector<int> ProcessGrid::dp_group(int rank) const {
  GridCoord c = coord_of(rank);
  std::vector<int> out;
  for (int d = 0; d < dp_; ++d) out.push_back(rank_of({c.pp, d, c.tp}));
  return out;
}

std::vector<int> ProcessGrid::pp_group(int rank) const {
  GridCoord c = coord_of(rank);
  std::vector<int> out;
  for (int p = 0; p < pp_; ++p) out.push_back(rank_of({p, c.dp, c.tp}));
  return out;
}

std::vector<int> ProcessGrid::model_parallel_group(int rank) const {
  GridCoord c = coord_of(rank);
  std::vector<int> out;
  for (int p = 0; p < pp_; ++p)
    for (int t = 0; t < tp_; ++t) out.push_back(rank_of({p, c.dp, t}));
  return out;
}

int ProcessGrid::pipeline_prev(int rank) const {
  GridCoord c = coord_of(rank);
  return c.pp == 0 ? -1 : rank_of({c.pp - 1, c.dp, c.tp});
}

int ProcessGrid::pipeline_next(int rank) const {
  GridCoord c = coord_of(rank);
  return c.pp == pp_ - 1 ? -1 : rank_of({c.pp + 1, c.dp, c.tp});
}

ParallelGroups make_parallel_groups(const comm::CommunicatorPtr& world, const ProcessGrid& grid) {
  TS_CHECK(world && world->size() == grid.world_size(), "make_parallel_groups: the grid is for ",
           grid.world_size(), " ranks but the communicator has ", world ? world->size() : 0);
  ParallelGroups g(grid);
  g.rank = world->rank();
  g.coord = grid.coord_of(g.rank);
  const GridCoord& c = g.coord;
  g.world = world;
  // Colors identify the group; keys order members by their coordinate along the group.
  g.tp = world->split(c.pp * grid.dp() + c.dp, c.tp, "tp");
  g.dp = world->split(c.pp * grid.tp() + c.tp, c.dp, "dp");
  g.pp = world->split(c.dp * grid.tp() + c.tp, c.pp, "pp");
  g.mp = world->split(c.dp, c.pp * grid.tp() + c.tp, "mp");
  g.prev_stage = c.pp == 0 ? -1 : c.pp - 1;
  g.next_stage = c.pp == grid.pp() - 1 ? -1 : c.pp + 1;
  return g;
}

void add_expert_groups(ParallelGroups& g, int ep_size) {
  TS_CHECK(ep_size >= 1 && g.dp && g.dp->size() % ep_size == 0, "model.moe.ep_size ", ep_size,
           " must divide the data-parallel size ", g.dp ? g.dp->size() : 0, " (the experts spread over ep_size ",
           "data-parallel ranks)");
  TS_CHECK(!g.ep, "the expert-parallel groups exist already");
  if (ep_size == 1) return;
  const int d = g.dp->rank();
  // DeepSpeed's layout: expert-parallel groups of consecutive data-parallel ranks.
  g.ep = g.dp->split(d / ep_size, d % ep_size, "ep");
  g.edp = g.dp->split(d % ep_size, d / ep_size, "edp");
}

}  // namespace torchspeed::parallel
