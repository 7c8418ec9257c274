// Pipeline schedules as data (DESIGN.md convention 8): a pure function of (stages, stage,
// micro-batches) returns the instruction list one stage executes for one training batch, so
// schedules are tested without running a model. GPipe runs every forward, then every backward;
// 1F1B (PipeDream-flush) runs stages - stage - 1 warm-up forwards, then alternates one forward
// and one backward, then the remaining backwards, so a stage never holds more than
// stages - stage micro-batches of activations.
#pragma once

#include <string>
#include <variant>
#include <vector>

namespace torchspeed::pipeline {

struct LoadMicroBatch { int mb; };   // first stage: inputs; last stage: targets
struct Forward { int mb; };
struct Backward { int mb; };
struct SendActivation { int mb; };  // to the next stage
struct RecvActivation { int mb; };  // from the previous stage
struct SendGrad { int mb; };        // to the previous stage
struct RecvGrad { int mb; };        // from the next stage
struct ReduceTiedGrads {};          // sum tied weights' gradients across the stages holding them
struct ReduceGrads {};              // data-parallel gradient reduction
struct OptimizerStep {};

using Instruction = std::variant<LoadMicroBatch, Forward, Backward, SendActivation, RecvActivation, SendGrad,
                                 RecvGrad, ReduceTiedGrads, ReduceGrads, OptimizerStep>;

enum class ScheduleKind { kGPipe, k1F1B };
ScheduleKind schedule_kind(const std::string& name);  // "gpipe" or "1f1b"

std::vector<Instruction> gpipe(int stages, int stage, int micro_batches);
std::vector<Instruction> one_f_one_b(int stages, int stage, int micro_batches);
std::vector<Instruction> make_schedule(ScheduleKind kind, int stages, int stage, int micro_batches);

// Compact text, e.g. "L0 F0 SA0": L load, F forward, B backward, SA/RA send/receive activation,
// SG/RG send/receive gradient, TIED, REDUCE, STEP.
std::string to_string(const Instruction& i);
std::string to_string(const std::vector<Instruction>& is);

}  // namespace torchspeed::pipeline
