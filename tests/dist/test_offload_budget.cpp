// Training whose model states are over 3x the memory each process may use: a GPT of ~130M
// parameters in bf16 (model states = parameters 2 + gradients 2 + fp32 master 4 + moments 8
// bytes per parameter, what one in-memory process holds) under a budget of a third of that on
// top of the process's memory before the model exists. The budget is enforced by a memory
// cgroup the process moves into (v2 memory.max or v1 memory.limit_in_bytes: new memory is charged
// there, and going over it is an OOM kill) where the machine allows one, and the peak RSS over the
// baseline is asserted in every case. Then the same run in memory, outside the cgroup: losses and
// final parameters bit-identical. The offloaded run saves a checkpoint and resumes from it in a new
// engine within the same budget (its state is 12 bytes per parameter: only streaming fits). One
// ZeRO stage per process (OffloadBudget.Stage1/2/3, and 3
// with the parameters offloaded too), at dp 1 and 2.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "dist_util.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/base/memory_cgroup.h"

namespace fs = std::filesystem;
using ts_test::world;

namespace {
int64_t status_kb(const std::string& key) {
  std::ifstream s("/proc/self/status");
  std::string line;
  while (std::getline(s, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  return -1;
}

torchspeed::models::GPTConfig gpt() {
  torchspeed::models::GPTConfig g;
  g.seq_len = 32;
  g.d_model = 512;
  g.n_layer = 40;
  g.n_head = 8;
  return g;
}

// The GPT built layer by layer in bf16 (never the whole model in fp32).
torchspeed::nn::StackSpec bf16_spec() {
  auto spec = torchspeed::models::gpt_spec(gpt(), 5);
  for (auto& l : spec.layers) {
    l.build = [inner = l.build](const torchspeed::nn::TiedTensors& tied) {
      torch::nn::AnyModule m = inner(tied);
      m.ptr()->to(at::kBFloat16);
      return m;
    };
  }
  return spec;
}

nlohmann::json config(int stage, const std::string& nvme, bool params) {
  nlohmann::json zero = {{"stage", stage}, {"reduce_bucket_size", 1000000}, {"sub_group_size", 500000},
                         {"stage3_param_persistence_threshold", 0}, {"stage3_prefetch_bucket_size", 0},
                         {"overlap_comm", false}};
  if (!nvme.empty()) {
    zero["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", nvme}, {"buffer_count", 3},
                                 {"pipeline_read", true}, {"pipeline_write", true}};
  }
  if (params && !nvme.empty()) {
    zero["offload_param"] = {{"device", "nvme"}, {"nvme_path", nvme}, {"buffer_count", 4},
                             {"buffer_size", 4000000}, {"max_in_cpu", 0}};
  }
  return {{"train_micro_batch_size_per_gpu", 1}, {"bf16", {{"enabled", true}}},
          {"data_types", {{"grad_accum_dtype", "bf16"}}}, {"gradient_clipping", 1.0},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}, {"zero_optimization", zero}};
}

struct Run {
  std::unique_ptr<torchspeed::Engine> engine;
  std::vector<double> losses;
};

// Three steps. With `checkpoint`, the run saves after the second step, a new engine (on a new
// model) loads that checkpoint, and it takes the third: under the budget too, so the offloaded
// state streams to and from the checkpoint instead of passing through memory whole.
Run train(int stage, const std::string& nvme, bool params, const std::string& checkpoint = "") {
  Run r;
  auto make = [&] {
    auto stack = torchspeed::nn::build(bf16_spec());
    return torchspeed::initialize(ts_test::dp_groups(), stack, ts_test::parse_config(config(stage, nvme, params)));
  };
  r.engine = make();
  for (int s = 0; s < 3; ++s) {
    if (s == 2 && !checkpoint.empty()) {
      r.engine->save_checkpoint(checkpoint, "two");
      r.engine.reset();
      r.engine = make();
      EXPECT_TRUE(r.engine->load_checkpoint(checkpoint).has_value());
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(10 * s + world()->rank());
    at::Tensor t = at::randint(0, 256, {1, 33}, gen, at::kLong);
    r.losses.push_back(r.engine->train_batch([&] {
      return std::make_pair(t.narrow(1, 0, 32).contiguous(), t.narrow(1, 1, 32).contiguous());
    }));
  }
  return r;
}

void run_stage(int stage, bool params = false) {
  at::Tensor pid = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(pid, 0);
  const std::string dir = (fs::temp_directory_path() / ("ts-offload-budget-" + std::to_string(pid.item<int64_t>()))).string();
  if (world()->rank() == 0) fs::create_directories(dir);
  world()->barrier();

  const int64_t n = gpt().num_params();
  const int64_t states = 16 * n;  // bf16 parameters and gradients, fp32 master and two moments
  const int64_t budget = states / 3;
  const int64_t baseline = status_kb("VmRSS") * 1024;
  { std::ofstream("/proc/self/clear_refs") << "5"; }  // VmHWM restarts from here
  Run off;
  std::string enforced;
  int64_t peak = 0;
  {
    torchspeed::MemoryCgroup cg(budget);
    const bool joined = cg.join(::getpid());
    enforced = joined ? "cgroup " + cg.dir() + " and peak RSS" : "peak RSS only (no memory cgroup here)";
    off = train(stage, dir, params, dir + "/checkpoints");
    peak = status_kb("VmHWM") * 1024 - baseline;  // before anything gathers the whole model to compare
    if (joined) {
      ASSERT_TRUE(cg.leave(::getpid()));  // the in-memory run below needs all of its states
    }
  }
  torchspeed::log::info("ZeRO-", stage, params ? " with parameter offload" : "", " dp ", world()->size(), ": ", n, " parameters, model states ", states / 1000000,
                        " MB, budget ", budget / 1000000, " MB (", enforced, "), offloaded run used ", peak / 1000000,
                        " MB over its baseline of ", baseline / 1000000, " MB");
  EXPECT_GE(states, 3 * budget);
  EXPECT_LE(peak, budget) << "the offloaded run went over its memory budget";
  const auto off_params = off.engine->master_params();
  off.engine.reset();
  Run mem = train(stage, "", false);
  EXPECT_EQ(off.losses, mem.losses);  // bit for bit
  const auto mem_params = mem.engine->master_params();
  ASSERT_EQ(off_params.size(), mem_params.size());
  for (size_t i = 0; i < off_params.size(); ++i)
    EXPECT_TRUE(at::equal(off_params[i].second, mem_params[i].second)) << off_params[i].first;
  world()->barrier();
  if (world()->rank() == 0) fs::remove_all(dir);
}
}  // namespace

TEST(OffloadBudget, Stage1) { run_stage(1); }
TEST(OffloadBudget, Stage2) { run_stage(2); }
TEST(OffloadBudget, Stage3) { run_stage(3); }
TEST(OffloadBudget, Stage3WithParameters) { run_stage(3, /*params=*/true); }
