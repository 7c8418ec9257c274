// Optimizer state offloaded to swap files (offload_optimizer.device "nvme") against the same run
// in memory: losses and final parameters bit-identical at ZeRO 1, 2 and 3, fp32 and bf16, with
// and without pipelined swapping; checkpoints of an offloaded run resume bit-exactly (also into
// an in-memory engine); a swap file cut between steps is an error naming it, and the previous
// checkpoint still loads.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>

#include "dist_util.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/models/gpt.h"

namespace fs = std::filesystem;
using torchspeed::config::Config;
using ts_test::world;

namespace {
torchspeed::models::GPTConfig gpt() {
  torchspeed::models::GPTConfig g;
  g.seq_len = 16;
  g.d_model = 48;
  g.n_layer = 3;
  g.n_head = 4;
  return g;
}

// One directory for the whole job (rank 0's pid, broadcast).
std::string shared_dir(const std::string& name) {
  at::Tensor pid = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  world()->broadcast(pid, 0);
  auto d = fs::temp_directory_path() / ("ts-offload-" + name + "-" + std::to_string(pid.item<int64_t>()));
  if (world()->rank() == 0) {
    fs::remove_all(d);
    fs::create_directories(d);
  }
  world()->barrier();
  return d.string();
}

nlohmann::json config(int stage, bool bf16, const std::string& nvme, bool pipelined, bool params = false) {
  nlohmann::json zero = {{"stage", stage}, {"stage3_param_persistence_threshold", 0}, {"reduce_bucket_size", 20000},
                         {"sub_group_size", 7000}};
  if (!nvme.empty()) {
    zero["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", nvme}, {"buffer_count", 3},
                                 {"pipeline_read", pipelined}, {"pipeline_write", pipelined}};
  }
  if (params) {  // buffers of 10000 elements: the larger layers' shards are read in pieces
    zero["offload_param"] = {{"device", "nvme"}, {"nvme_path", nvme}, {"buffer_count", 3},
                             {"buffer_size", 10000}, {"max_in_cpu", 0}};
  }
  nlohmann::json j = {{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 2},
                      {"gradient_clipping", 1.0},
                      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
                      {"zero_optimization", zero}, {"aio", {{"block_size", 65536}, {"queue_depth", 4}}}};
  if (bf16) j["bf16"] = {{"enabled", true}};
  return j;
}

std::unique_ptr<torchspeed::Engine> make(const nlohmann::json& j) {
  return torchspeed::initialize(ts_test::dp_groups(), torchspeed::models::gpt_spec(gpt(), 11), ts_test::parse_config(j));
}

// Micro-batch `i` of this rank.
std::pair<at::Tensor, at::Tensor> batch(int64_t i) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * i + world()->rank());
  at::Tensor t = at::randint(0, 256, {2, 17}, gen, at::kLong);
  return {t.narrow(1, 0, 16).contiguous(), t.narrow(1, 1, 16).contiguous()};
}

std::vector<double> train(torchspeed::Engine& e, int64_t from, int steps) {
  std::vector<double> losses;
  int64_t i = from;
  for (int s = 0; s < steps; ++s) losses.push_back(e.train_batch([&] { return batch(i++); }));
  return losses;
}

void expect_same_params(torchspeed::Engine& a, torchspeed::Engine& b) {
  auto pa = a.master_params(), pb = b.master_params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
}
}  // namespace

TEST(Offload, OptimizerStateOnDiskTrainsBitIdenticallyToMemory) {
  const std::string dir = shared_dir("parity");
  for (int stage : {1, 2, 3})
    for (bool bf16 : {false, true})
      for (bool pipelined : {false, true}) {
        SCOPED_TRACE(testing::Message() << "stage " << stage << (bf16 ? " bf16" : " fp32")
                                        << (pipelined ? " pipelined" : ""));
        auto mem = make(config(stage, bf16, "", false));
        auto off = make(config(stage, bf16, dir, pipelined));
        const auto lm = train(*mem, 0, 4), lo = train(*off, 0, 4);
        EXPECT_EQ(lm, lo);  // bit for bit
        expect_same_params(*mem, *off);
        const auto m = off->memory();
        // The moments (and bf16's masters) are on disk; RAM holds the buffer pool only.
        EXPECT_EQ(mem->memory().offloaded, 0);
        EXPECT_GE(m.offloaded, mem->memory().optimizer_state + mem->memory().master);
        EXPECT_EQ(m.master, 0);
        EXPECT_LT(m.optimizer_state, mem->memory().optimizer_state);
        EXPECT_TRUE(fs::exists(dir + "/torchspeed-optimizer-rank" + std::to_string(world()->rank()) + ".swap"));
      }
  world()->barrier();
  if (world()->rank() == 0) fs::remove_all(dir);
}

TEST(Offload, ParametersOnDiskTrainBitIdenticallyToMemory) {
  // ZeRO-3 with offload_param (and the optimizer state on disk or in memory): the idle shards
  // live in the swap file; fp32 training gets a separate fp32 master.
  const std::string dir = shared_dir("params");
  for (bool bf16 : {false, true})
    for (bool opt_on_disk : {false, true}) {
      SCOPED_TRACE(testing::Message() << (bf16 ? "bf16" : "fp32") << (opt_on_disk ? ", optimizer on disk" : ""));
      auto mem = make(config(3, bf16, "", false));
      nlohmann::json cfg = config(3, bf16, opt_on_disk ? dir : "", true, /*params=*/true);
      if (!opt_on_disk) cfg["zero_optimization"]["offload_param"]["nvme_path"] = dir;
      auto off = make(cfg);
      EXPECT_EQ(train(*mem, 0, 4), train(*off, 0, 4));  // bit for bit
      expect_same_params(*mem, *off);
      // Only the pool's buffers hold parameter shards in RAM: stage 3 with every layer offloaded.
      const int64_t buffer = 10000 * (bf16 ? 2 : 4);  // 3 buffers of 10000 elements, rounded up to the alignment
      EXPECT_GE(off->memory().params, 3 * buffer);
      EXPECT_LE(off->memory().params, 3 * (buffer + 4096));
      EXPECT_GT(off->memory().offloaded, 0);
      EXPECT_TRUE(fs::exists(dir + "/torchspeed-params-rank" + std::to_string(world()->rank()) + ".swap"));
    }
  world()->barrier();
  if (world()->rank() == 0) fs::remove_all(dir);
}

TEST(Offload, AnOffloadedRunResumesBitExactlyFromItsCheckpoint) {
  const std::string dir = shared_dir("resume");
  for (int stage : {1, 3}) {
    SCOPED_TRACE(testing::Message() << "stage " << stage);
    auto cfg = config(stage, /*bf16=*/true, dir + "/swap", true, /*params=*/stage == 3);
    if (world()->rank() == 0) fs::create_directories(dir + "/swap");
    world()->barrier();
    std::vector<double> straight;
    {
      auto a = make(cfg);
      train(*a, 0, 2);
      a->save_checkpoint(dir + "/ckpt" + std::to_string(stage));
      straight = train(*a, 4, 3);
    }
    {
      auto b = make(cfg);  // a new engine: its swap file is made afresh, then loaded
      ASSERT_TRUE(b->load_checkpoint(dir + "/ckpt" + std::to_string(stage)));
      EXPECT_EQ(train(*b, 4, 3), straight);
    }
    // The checkpoint does not depend on where the state lived.
    auto c = make(config(stage, true, "", false));
    ASSERT_TRUE(c->load_checkpoint(dir + "/ckpt" + std::to_string(stage)));
    EXPECT_EQ(train(*c, 4, 3), straight);
  }
  world()->barrier();
  if (world()->rank() == 0) fs::remove_all(dir);
}

TEST(Offload, ASwapFileCutBetweenStepsIsAnErrorAndTheCheckpointSurvives) {
  const std::string dir = shared_dir("cut");
  auto cfg = config(2, false, dir, false);
  auto e = make(cfg);
  train(*e, 0, 1);
  e->save_checkpoint(dir + "/ckpt");
  const std::string swap = dir + "/torchspeed-optimizer-rank" + std::to_string(world()->rank()) + ".swap";
  fs::resize_file(swap, fs::file_size(swap) / 3);  // every rank's file: every rank fails the same step
  try {
    train(*e, 2, 1);
    ADD_FAILURE() << "a step over a cut swap file succeeded";
  } catch (const torchspeed::Error& err) {
    const std::string m = err.what();
    EXPECT_NE(m.find("short read at offset"), std::string::npos) << m;
    EXPECT_NE(m.find(swap), std::string::npos) << m;
  }
  e.reset();
  world()->barrier();
  {
    auto again = make(cfg);
    ASSERT_TRUE(again->load_checkpoint(dir + "/ckpt"));
    auto mem = make(config(2, false, "", false));
    ASSERT_TRUE(mem->load_checkpoint(dir + "/ckpt"));
    EXPECT_EQ(train(*again, 2, 2), train(*mem, 2, 2));
  }  // the engines remove their swap files
  world()->barrier();
  if (world()->rank() == 0) fs::remove_all(dir);
}

TEST(Offload, PipelineStagesOffloadTheirStateAndResumeBitExactly) {
  // pp 2 (x dp 1 at 2 ranks): each stage's optimizer state in its own swap file; the tied
  // embedding and LM head live on both stages. Bit-identical to the stages in memory, and a
  // checkpoint of the offloaded pipeline resumes bit-exactly in new offloaded engines.
  const int n = world()->size();
  const std::string dir = shared_dir("pipeline");
  auto pipeline_config = [&](const std::string& nvme) {
    nlohmann::json j = config(1, /*bf16=*/true, nvme, /*pipelined=*/true);
    j["pipeline"] = {{"stages", 2}};
    return j;
  };
  if (n < 2) {  // one rank cannot hold two stages: the config says so, naming the key
    try {
      ts_test::parse_config(pipeline_config(dir));
      ADD_FAILURE() << "two pipeline stages on one rank were accepted";
    } catch (const torchspeed::config::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("pipeline.stages"), std::string::npos) << e.what();
    }
    if (world()->rank() == 0) fs::remove_all(dir);
    return;
  }
  auto make_pp = [&](const nlohmann::json& j) {
    auto groups = torchspeed::parallel::make_parallel_groups(world(), torchspeed::parallel::ProcessGrid(n, 1, 2));
    auto cfg = torchspeed::config::Config::parse(j, [&] {
      torchspeed::config::WorldShape s;
      s.world_size = n;
      return s;
    }());
    return torchspeed::initialize(groups, torchspeed::models::gpt_spec(gpt(), 11), cfg);
  };
  auto mem = make_pp(pipeline_config(""));
  std::vector<double> straight;
  {
    auto off = make_pp(pipeline_config(dir));
    EXPECT_EQ(off->num_stages(), 2);
    EXPECT_GT(off->memory().offloaded, 0);
    EXPECT_EQ(train(*mem, 0, 4), train(*off, 0, 4));  // bit for bit
    expect_same_params(*mem, *off);
    off->save_checkpoint(dir + "/ckpt");
    straight = train(*off, 8, 2);
  }
  {
    auto resumed = make_pp(pipeline_config(dir));
    ASSERT_TRUE(resumed->load_checkpoint(dir + "/ckpt"));
    EXPECT_EQ(train(*resumed, 8, 2), straight);
  }  // the engines remove their swap files before the folder goes
  mem.reset();
  world()->barrier();
  if (world()->rank() == 0) fs::remove_all(dir);
}
