// Tied weights across pipeline stages: see tied_weights.h.
#include "torchspeed/pipeline/tied_weights.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <map>

#include "torchspeed/pipeline/partition.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

namespace torchspeed::pipeline {

bool StagePlan::is_copy(const std::string& param) const {
  return std::any_of(ties.begin(), ties.end(), [&](const Tie& t) { return t.param == param && !t.owner; });
}

StageLayers plan_stage(const parallel::ParallelGroups& groups, const nn::StackSpec& spec,
                       const std::string& partition_method) {
  const int stages = groups.grid.pp();
  const auto bounds = pipeline::partition(spec, stages, partition_method);
  const int stage = groups.coord.pp;
  StageLayers out;
  out.plan.stage = stage;
  out.plan.stages = stages;
  out.begin = bounds[static_cast<size_t>(stage)];
  out.end = bounds[static_cast<size_t>(stage) + 1];
  // Tied weights held by several stages: one communicator per tie key over those stages (of
  // this rank's pipeline); every rank takes part in every split, in key order.
  std::map<std::string, std::vector<std::pair<int, std::string>>> holders;  // key -> (stage, param)
  for (int s = 0; s < stages; ++s)
    for (size_t i = bounds[static_cast<size_t>(s)]; i < bounds[static_cast<size_t>(s) + 1]; ++i)
      for (const auto& [param, key] : spec.layers[i].ties) holders[key].emplace_back(s, spec.layers[i].name + "." + param);
  for (const auto& [key, list] : holders) {
    std::vector<int> on;
    for (const auto& h : list)
      if (on.empty() || on.back() != h.first) on.push_back(h.first);
    if (on.size() < 2) continue;
    const bool member = std::find(on.begin(), on.end(), stage) != on.end();
    const int color = member ? groups.pp->world_ranks().front() : groups.grid.world_size() + groups.rank;
    auto c = groups.world->split(color, stage, "tied:" + key);
    if (!member) continue;
    for (const auto& [s, param] : list)
      if (s == stage) out.plan.ties.push_back({param, c, s == on.front()});
  }
  log::debug("pipeline stage ", stage, " of ", stages, ": layers ", out.begin, "..", out.end - 1);
  return out;
}

TiedWeights::TiedWeights(const StagePlan& plan, const nn::LayerStack& stack) {
  if (plan.ties.empty()) return;
  const auto named = stack->named_parameters(/*recurse=*/true);
  for (const auto& t : plan.ties) {
    const at::Tensor* p = named.find(t.param);
    TS_CHECK(p, "tied parameter '", t.param, "' is not in this stage's layers");
    c10::NoGradGuard g;
    at::Tensor v = p->detach().contiguous();
    t.comm->broadcast(v, 0);
    if (!v.is_same(*p)) p->detach().copy_(v);
    ties_.emplace_back(*p, t.comm);
  }
}

void TiedWeights::reduce_grads() {
  for (auto& [param, comm] : ties_) {
    at::Tensor g = param.grad();
    if (!g.defined()) g = param.mutable_grad() = at::zeros_like(param);
    comm->all_reduce(g);
  }
}

}  // namespace torchspeed::pipeline
