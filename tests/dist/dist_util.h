// Helpers shared by the multi-rank tests.
#pragma once

#include <ATen/ATen.h>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/config/config.h"
#include "torchspeed/parallel/process_grid.h"

namespace ts_test {
// The world communicator created by dist_main.
torchspeed::comm::CommunicatorPtr& world();

// Data parallelism over the whole world (new communicators each call), and a config resolved
// for the world's size.
inline torchspeed::parallel::ParallelGroups dp_groups() {
  auto w = world();
  return torchspeed::parallel::make_parallel_groups(w, torchspeed::parallel::ProcessGrid(w->size()));
}
inline torchspeed::config::Config parse_config(const nlohmann::json& j) {
  torchspeed::config::WorldShape shape;
  shape.world_size = world()->size();
  return torchspeed::config::Config::parse(j, shape);
}

// Deterministic per-rank data: every rank can recompute any rank's input.
inline at::Tensor rank_data(int rank, int64_t n, at::ScalarType dtype, bool integral = false) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  if (n == 0) return at::empty({0}, dtype);
  if (dtype == at::kByte) return at::randint(0, 40, {n}, gen, at::kByte);
  if (integral || !at::isFloatingType(dtype)) return at::randint(-50, 50, {n}, gen, at::kLong).to(dtype);
  return at::randn({n}, gen, at::kFloat).to(dtype);
}
}  // namespace ts_test
