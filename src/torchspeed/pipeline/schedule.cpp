// GPipe and 1F1B instruction lists.
#include "torchspeed/pipeline/schedule.h"

#include <algorithm>

#include "torchspeed/base/error.h"

namespace torchspeed::pipeline {
namespace {

void check(int stages, int stage, int micro_batches) {
  TS_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline schedule: stage ", stage, " of ", stages);
  TS_CHECK(micro_batches >= 1, "pipeline schedule: ", micro_batches,
           " micro-batches (gradient_accumulation_steps must be >= 1)");
}

void forward(std::vector<Instruction>& out, int stages, int stage, int mb) {
  const bool first = stage == 0, last = stage == stages - 1;
  if (first || last) out.push_back(LoadMicroBatch{mb});
  if (!first) out.push_back(RecvActivation{mb});
  out.push_back(Forward{mb});
  if (!last) out.push_back(SendActivation{mb});
}

void backward(std::vector<Instruction>& out, int stages, int stage, int mb) {
  if (stage != stages - 1) out.push_back(RecvGrad{mb});
  out.push_back(Backward{mb});
  if (stage != 0) out.push_back(SendGrad{mb});
}

void finish(std::vector<Instruction>& out) {
  out.push_back(ReduceTiedGrads{});
  out.push_back(ReduceGrads{});
  out.push_back(OptimizerStep{});
}

}  // namespace

ScheduleKind schedule_kind(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::kGPipe;
  if (name == "1f1b") return ScheduleKind::k1F1B;
  TS_CHECK(false, "pipeline.schedule '", name, "': expected 1f1b or gpipe");
}

std::vector<Instruction> gpipe(int stages, int stage, int micro_batches) {
  check(stages, stage, micro_batches);
  std::vector<Instruction> out;
  for (int mb = 0; mb < micro_batches; ++mb) forward(out, stages, stage, mb);
  for (int mb = 0; mb < micro_batches; ++mb) backward(out, stages, stage, mb);
  finish(out);
  return out;
}

std::vector<Instruction> one_f_one_b(int stages, int stage, int micro_batches) {
  check(stages, stage, micro_batches);
  std::vector<Instruction> out;
  const int warmup = std::min(stages - stage - 1, micro_batches);
  for (int mb = 0; mb < warmup; ++mb) forward(out, stages, stage, mb);
  for (int i = 0; i < micro_batches - warmup; ++i) {
    forward(out, stages, stage, warmup + i);
    backward(out, stages, stage, i);
  }
  for (int mb = micro_batches - warmup; mb < micro_batches; ++mb) backward(out, stages, stage, mb);
  finish(out);
  return out;
}

std::vector<Instruction> make_schedule(ScheduleKind kind, int stages, int stage, int micro_batches) {
  return kind == ScheduleKind::kGPipe ? gpipe(stages, stage, micro_batches)
                                      : one_f_one_b(stages, stage, micro_batches);
}

std::string to_string(const Instruction& i) {
  struct V {
    std::string operator()(const LoadMicroBatch& x) const { return "L" + std::to_string(x.mb); }
    std::string operator()(const Forward& x) const { return "F" + std::to_string(x.mb); }
    std::string operator()(const Backward& x) const { return "B" + std::to_string(x.mb); }
    std::string operator()(const SendActivation& x) const { return "SA" + std::to_string(x.mb); }
    std::string operator()(const RecvActivation& x) const { return "RA" + std::to_string(x.mb); }
    std::string operator()(const SendGrad& x) const { return "SG" + std::to_string(x.mb); }
    std::string operator()(const RecvGrad& x) const { return "RG" + std::to_string(x.mb); }
    std::string operator()(const ReduceTiedGrads&) const { return "TIED"; }
    std::string operator()(const ReduceGrads&) const { return "REDUCE"; }
    std::string operator()(const OptimizerStep&) const { return "STEP"; }
  };
  return std::visit(V{}, i);
}

std::string to_string(const std::vector<Instruction>& is) {
  std::string s;
  for (const auto& i : is) s += (s.empty() ? "" : " ") + to_string(i);
  return s;
}

}  // namespace torchspeed::pipeline
