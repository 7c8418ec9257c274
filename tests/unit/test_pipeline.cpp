// Pipeline schedules (run without a model) and stage partitioning.
#include <gtest/gtest.h>

#include <deque>
#include <map>

#include "test_util.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/pipeline/partition.h"
#include "torchspeed/pipeline/schedule.h"

namespace pl = torchspeed::pipeline;

// The exact lists for 4 stages and 8 micro-batches, written out from the schedules' definitions.
TEST(PipelineSchedule, OneFOneBForFourStagesAndEightMicroBatches) {
  const std::vector<std::string> expected = {
      "L0 F0 SA0 L1 F1 SA1 L2 F2 SA2 L3 F3 SA3 RG0 B0 L4 F4 SA4 RG1 B1 L5 F5 SA5 RG2 B2 L6 F6 SA6 RG3 B3 L7 F7 SA7 RG4 B4 RG5 B5 RG6 B6 RG7 B7 TIED REDUCE STEP",
      "RA0 F0 SA0 RA1 F1 SA1 RA2 F2 SA2 RG0 B0 SG0 RA3 F3 SA3 RG1 B1 SG1 RA4 F4 SA4 RG2 B2 SG2 RA5 F5 SA5 RG3 B3 SG3 RA6 F6 SA6 RG4 B4 SG4 RA7 F7 SA7 RG5 B5 SG5 RG6 B6 SG6 RG7 B7 SG7 TIED REDUCE STEP",
      "RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RA2 F2 SA2 RG1 B1 SG1 RA3 F3 SA3 RG2 B2 SG2 RA4 F4 SA4 RG3 B3 SG3 RA5 F5 SA5 RG4 B4 SG4 RA6 F6 SA6 RG5 B5 SG5 RA7 F7 SA7 RG6 B6 SG6 RG7 B7 SG7 TIED REDUCE STEP",
      "L0 RA0 F0 B0 SG0 L1 RA1 F1 B1 SG1 L2 RA2 F2 B2 SG2 L3 RA3 F3 B3 SG3 L4 RA4 F4 B4 SG4 L5 RA5 F5 B5 SG5 L6 RA6 F6 B6 SG6 L7 RA7 F7 B7 SG7 TIED REDUCE STEP",
  };
  for (int s = 0; s < 4; ++s) EXPECT_EQ(pl::to_string(pl::one_f_one_b(4, s, 8)), expected[s]) << "stage " << s;
}

TEST(PipelineSchedule, GPipeForFourStagesAndEightMicroBatches) {
  const std::vector<std::string> expected = {
      "L0 F0 SA0 L1 F1 SA1 L2 F2 SA2 L3 F3 SA3 L4 F4 SA4 L5 F5 SA5 L6 F6 SA6 L7 F7 SA7 RG0 B0 RG1 B1 RG2 B2 RG3 B3 RG4 B4 RG5 B5 RG6 B6 RG7 B7 TIED REDUCE STEP",
      "RA0 F0 SA0 RA1 F1 SA1 RA2 F2 SA2 RA3 F3 SA3 RA4 F4 SA4 RA5 F5 SA5 RA6 F6 SA6 RA7 F7 SA7 RG0 B0 SG0 RG1 B1 SG1 RG2 B2 SG2 RG3 B3 SG3 RG4 B4 SG4 RG5 B5 SG5 RG6 B6 SG6 RG7 B7 SG7 TIED REDUCE STEP",
      "RA0 F0 SA0 RA1 F1 SA1 RA2 F2 SA2 RA3 F3 SA3 RA4 F4 SA4 RA5 F5 SA5 RA6 F6 SA6 RA7 F7 SA7 RG0 B0 SG0 RG1 B1 SG1 RG2 B2 SG2 RG3 B3 SG3 RG4 B4 SG4 RG5 B5 SG5 RG6 B6 SG6 RG7 B7 SG7 TIED REDUCE STEP",
      "L0 RA0 F0 L1 RA1 F1 L2 RA2 F2 L3 RA3 F3 L4 RA4 F4 L5 RA5 F5 L6 RA6 F6 L7 RA7 F7 B0 SG0 B1 SG1 B2 SG2 B3 SG3 B4 SG4 B5 SG5 B6 SG6 B7 SG7 TIED REDUCE STEP",
  };
  for (int s = 0; s < 4; ++s) EXPECT_EQ(pl::to_string(pl::gpipe(4, s, 8)), expected[s]) << "stage " << s;
}

namespace {
// Runs every stage's list together: sends are non-blocking (queued), a receive waits for its
// message. Checks that messages match (same micro-batch, in order), nothing deadlocks, every
// forward precedes its backward, and returns each stage's most activations held at once.
std::vector<int> simulate(pl::ScheduleKind kind, int stages, int mbs) {
  std::vector<std::vector<pl::Instruction>> lists;
  for (int s = 0; s < stages; ++s) lists.push_back(pl::make_schedule(kind, stages, s, mbs));
  std::map<std::pair<int, int>, std::deque<int>> act, grad;  // (from, to) -> micro-batches in flight
  std::vector<size_t> pc(stages, 0);
  std::vector<int> held(stages, 0), peak(stages, 0);
  std::vector<std::vector<int>> state(stages, std::vector<int>(mbs, 0));  // 0 none, 1 forward, 2 backward
  std::vector<std::vector<int>> loads(stages);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      while (pc[s] < lists[s].size()) {
        const auto& ins = lists[s][pc[s]];
        bool blocked = false;
        std::visit(
            [&](const auto& i) {
              using T = std::decay_t<decltype(i)>;
              if constexpr (std::is_same_v<T, pl::RecvActivation>) {
                auto& q = act[{s - 1, s}];
                if (q.empty()) { blocked = true; return; }
                EXPECT_EQ(q.front(), i.mb) << "stage " << s << " receives the wrong activation";
                q.pop_front();
              } else if constexpr (std::is_same_v<T, pl::RecvGrad>) {
                auto& q = grad[{s + 1, s}];
                if (q.empty()) { blocked = true; return; }
                EXPECT_EQ(q.front(), i.mb) << "stage " << s << " receives the wrong gradient";
                q.pop_front();
              } else if constexpr (std::is_same_v<T, pl::SendActivation>) {
                EXPECT_EQ(state[s][i.mb], 1);
                act[{s, s + 1}].push_back(i.mb);
              } else if constexpr (std::is_same_v<T, pl::SendGrad>) {
                EXPECT_EQ(state[s][i.mb], 2);
                grad[{s, s - 1}].push_back(i.mb);
              } else if constexpr (std::is_same_v<T, pl::Forward>) {
                EXPECT_EQ(state[s][i.mb], 0);
                state[s][i.mb] = 1;
                peak[s] = std::max(peak[s], ++held[s]);
              } else if constexpr (std::is_same_v<T, pl::Backward>) {
                EXPECT_EQ(state[s][i.mb], 1) << "backward " << i.mb << " before its forward on stage " << s;
                state[s][i.mb] = 2;
                --held[s];
              } else if constexpr (std::is_same_v<T, pl::LoadMicroBatch>) {
                loads[s].push_back(i.mb);
              }
            },
            ins);
        if (blocked) break;
        ++pc[s];
        progress = true;
      }
    }
  }
  for (int s = 0; s < stages; ++s) {
    EXPECT_EQ(pc[s], lists[s].size()) << "stage " << s << " deadlocked (" << stages << " stages, " << mbs << " mbs)";
    for (int m = 0; m < mbs; ++m) EXPECT_EQ(state[s][m], 2);
    if (s == 0 || s == stages - 1) {
      std::vector<int> all(mbs);
      for (int m = 0; m < mbs; ++m) all[m] = m;
      EXPECT_EQ(loads[s], all) << "stage " << s << " loads";
    } else {
      EXPECT_TRUE(loads[s].empty());
    }
  }
  for (auto& [k, q] : act) EXPECT_TRUE(q.empty());
  for (auto& [k, q] : grad) EXPECT_TRUE(q.empty());
  return peak;
}
}  // namespace

TEST(PipelineSchedule, PropertiesForManyShapes) {
  for (int stages = 1; stages <= 6; ++stages) {
    for (int mbs = 1; mbs <= 12; ++mbs) {
      SCOPED_TRACE(testing::Message() << stages << " stages, " << mbs << " micro-batches");
      const auto peak = simulate(pl::ScheduleKind::k1F1B, stages, mbs);
      for (int s = 0; s < stages; ++s) EXPECT_LE(peak[s], std::min(stages - s, mbs)) << "1F1B stage " << s;
      const auto gp = simulate(pl::ScheduleKind::kGPipe, stages, mbs);
      for (int s = 0; s < stages; ++s) EXPECT_EQ(gp[s], mbs) << "GPipe holds every micro-batch";
    }
  }
  ts_test::expect_error([] { pl::schedule_kind("interleaved"); }, "expected 1f1b or gpipe");
}

TEST(PipelinePartition, BalancedAndUniformAndByType) {
  // Heaviest part minimal, contiguous, every stage non-empty.
  EXPECT_EQ(pl::partition_balanced({1, 1, 1, 1}, 2), (std::vector<size_t>{0, 2, 4}));
  EXPECT_EQ(pl::partition_balanced({10, 1, 1, 1, 1, 10}, 2), (std::vector<size_t>{0, 3, 6}));
  EXPECT_EQ(pl::partition_balanced({5, 0, 0, 0}, 4), (std::vector<size_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(pl::partition_balanced({1, 2, 3, 4, 5, 6, 7, 8, 9}, 3), (std::vector<size_t>{0, 5, 7, 9}));
  ts_test::expect_error([] { pl::partition_balanced({1, 1}, 3); }, "exceeds the model's 2 layers");

  torchspeed::models::GPTConfig c;
  c.n_layer = 6;
  c.d_model = 64;
  const auto spec = torchspeed::models::gpt_spec(c, 1);  // embed, block0..5, head
  EXPECT_EQ(pl::partition(spec, 3, "uniform"), (std::vector<size_t>{0, 3, 6, 8}));
  // type:block balances the six blocks; embed and head ride along with their neighbours.
  EXPECT_EQ(pl::partition(spec, 2, "type:block"), (std::vector<size_t>{0, 4, 8}));
  EXPECT_EQ(pl::partition(spec, 3, "type:^block"), (std::vector<size_t>{0, 3, 5, 8}));
  // parameters: the spec's counts equal the built layers' parameters.
  auto stack = torchspeed::nn::build(spec);
  for (size_t i = 0; i < spec.size(); ++i) {
    int64_t n = 0;
    for (const auto& p : stack->layer_module(i)->parameters()) n += p.numel();
    EXPECT_EQ(spec.layer_params(i), n) << spec.layers[i].name;
  }
  const auto b = pl::partition(spec, 2, "parameters");
  EXPECT_EQ(b.front(), 0u);
  EXPECT_EQ(b.back(), 8u);
  ts_test::expect_error([&] { pl::partition(spec, 2, "type:nothing"); }, "matches 0 layers");
  ts_test::expect_error([&] { pl::partition(spec, 2, "random"); }, "expected uniform, parameters or type:REGEX");
}
