// The pipeline executor: runs one stage's instruction list (pipeline/schedule.h) for a batch,
// one handler per instruction, with its own activation protocol and receive-buffer pools. The
// model and the optimizer are reached through StageOps, so the executor knows nothing of ZeRO.
// See Note [Pipeline executor] in executor.cpp.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <utility>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/pipeline/schedule.h"

namespace torchspeed::pipeline {

// Micro-batch (inputs, targets); the first stage uses the inputs, the last the targets.
using MicroBatchSource = std::function<std::pair<at::Tensor, at::Tensor>()>;

// What a stage does to its model and optimizer.
struct StageOps {
  std::function<at::Tensor(const at::Tensor&)> forward;  // the stage's layers
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;  // last stage: (output, target)
  // Around each backward; `boundary` marks the batch's last, whose gradient reduction is
  // deferred to ReduceGrads (finish_backward is then called there).
  std::function<void(bool boundary)> begin_backward;
  std::function<void()> finish_backward;
  std::function<void()> reduce_tied_grads;
  std::function<void()> optimizer_step;
};

struct PipelineTimings {
  // Time in forward and backward instructions, and the schedule's wall time up to the gradient
  // reductions; 1 - busy / schedule is the stage's bubble.
  double busy_s = 0, schedule_s = 0;
};

class Executor {
 public:
  // `pp`: the pipeline's communicator; prev/next: the neighbours' ranks in it (-1 at the ends).
  Executor(comm::CommunicatorPtr pp, int prev, int next, int stage, int stages, ScheduleKind kind, StageOps ops);

  // One batch of `micro_batches`: with `train` the schedule (ending with the optimizer step),
  // without it the forwards only. The loss of each micro-batch's backward is scaled by
  // loss_scale / micro_batches. Returns the mean loss over the micro-batches, on every stage.
  double run(const MicroBatchSource& next, int micro_batches, bool train, double loss_scale);
  const PipelineTimings& timings() const { return timings_; }

 private:
  void on(const LoadMicroBatch& i);
  void on(const RecvActivation& i);
  void on(const Forward& i);
  void on(const SendActivation& i);
  void on(const RecvGrad& i);
  void on(const Backward& i);
  void on(const SendGrad& i);
  void on(const ReduceTiedGrads& i);
  void on(const ReduceGrads& i);
  void on(const OptimizerStep& i);
  void wait_sends();

  comm::CommunicatorPtr pp_;
  int prev_, next_, stage_, stages_;
  ScheduleKind kind_;
  StageOps ops_;
  PipelineTimings timings_;
  // The activation's shape and dtype, exchanged once (Note [Pipeline executor]).
  std::vector<int64_t> shape_sent_, shape_recv_;
  at::ScalarType dtype_recv_ = at::kFloat;
  std::vector<at::Tensor> act_pool_, grad_pool_;  // free receive buffers
  // The batch in progress.
  struct Batch {
    const MicroBatchSource* next = nullptr;
    int micro_batches = 0;
    bool train = false;
    double scale = 1.0, loss_sum = 0.0;
    std::vector<at::Tensor> inputs, outputs, targets, grads, received;
    std::vector<comm::WorkPtr> sends;  // each owns its tensor; waited for before the step
  } b_;
};

}  // namespace torchspeed::pipeline
