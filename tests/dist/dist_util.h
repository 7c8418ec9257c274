// Helpers shared by the multi-rank tests.
#pragma once

#include <ATen/ATen.h>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/config/config.h"
#include "torchspeed/models/gpt.h"
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

// The tiny GPT of the parity tests: vocabulary 64, 8 tokens, d 16, 4 heads.
inline torchspeed::models::GPTConfig tiny_gpt(int64_t n_layer) {
  torchspeed::models::GPTConfig c;
  c.vocab = 64;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_layer = n_layer;
  c.n_head = 4;
  return c;
}

// Micro-batch m of step `step` for data-parallel rank d: [mb, 8] tokens and their next tokens,
// from a generator seeded by seed + 100 step + 10 m + d (every rank can recompute any batch).
inline std::pair<at::Tensor, at::Tensor> lm_batch(uint64_t seed, int step, int m, int d, int64_t mb = 2) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + step * 100 + m * 10 + d);
  at::Tensor t = at::randint(0, 64, {mb, 9}, gen, at::kLong);
  return {t.narrow(1, 0, 8).contiguous(), t.narrow(1, 1, 8).contiguous()};
}
}  // namespace ts_test
