// The pipeline executor: one handler per instruction of pipeline/schedule.h.
//
// Note [Pipeline executor]
// - Activations go to the next stage and gradients back with non-blocking sends (each Work owns
//   its tensor; all are waited for before the optimizer step and at the batch's end) and
//   blocking receives; tags are 2*mb (activation) and 2*mb+1 (gradient), so each message pairs
//   with exactly its instruction on the neighbour.
// - The activation's shape and dtype are sent once, before the first activation; every later
//   micro-batch must have the same shape (as in DeepSpeed). Gradients have their activation's
//   shape, which the receiving stage knows. Receive buffers are reused: an activation buffer
//   once its gradient has been sent back, a gradient buffer once its backward has run, so a
//   stage allocates only as many as it holds at once (1F1B: stages - stage).
// - The last micro-batch's backward is the accumulation boundary: the data-parallel reduction
//   is deferred to ReduceGrads, after ReduceTiedGrads has summed the tied weights' gradients
//   across the stages holding them (embedding and LM head), so both copies take identical steps.
// - The loss is computed on the last stage and broadcast to every stage for logging.
#include "torchspeed/pipeline/executor.h"
#include "torchspeed/nn/aux_loss.h"

#include <torch/autograd.h>

#include <chrono>
#include <type_traits>

#include "torchspeed/base/error.h"

namespace torchspeed::pipeline {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

constexpr int kMetaTag = 1 << 14;  // above any micro-batch's tags
constexpr int kMetaLen = 10;       // dtype, ndim, up to 8 dims

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TS_CHECK(false, "pipeline: activations of dtype ", t, " cannot be sent between stages");
  }
}
at::ScalarType dtype_of(int code) { return code == 1 ? at::kBFloat16 : code == 2 ? at::kHalf : at::kFloat; }

std::vector<Instruction> forwards_only(int stages, int stage, int micro_batches) {
  std::vector<Instruction> out;
  for (const auto& ins : gpipe(stages, stage, micro_batches)) {
    if (std::holds_alternative<LoadMicroBatch>(ins) || std::holds_alternative<RecvActivation>(ins) ||
        std::holds_alternative<Forward>(ins) || std::holds_alternative<SendActivation>(ins))
      out.push_back(ins);
  }
  return out;
}

}  // namespace

Executor::Executor(comm::CommunicatorPtr pp, int prev, int next, int stage, int stages, ScheduleKind kind, StageOps ops)
    : pp_(std::move(pp)), prev_(prev), next_(next), stage_(stage), stages_(stages), kind_(kind), ops_(std::move(ops)) {}

double Executor::run(const MicroBatchSource& next, int micro_batches, bool train, double loss_scale) {
  const int M = micro_batches;
  const auto program = train ? make_schedule(kind_, stages_, stage_, M) : forwards_only(stages_, stage_, M);
  b_ = Batch{};
  b_.next = &next;
  b_.micro_batches = M;
  b_.train = train;
  b_.scale = loss_scale / static_cast<double>(M);
  for (auto* v : {&b_.inputs, &b_.outputs, &b_.targets, &b_.grads, &b_.received}) v->resize(static_cast<size_t>(M));
  const auto t_start = Clock::now();
  bool reducing = false;
  for (const auto& instruction : program) {
    const bool compute = std::holds_alternative<Forward>(instruction) || std::holds_alternative<Backward>(instruction);
    if (!reducing && std::holds_alternative<ReduceTiedGrads>(instruction)) {
      reducing = true;
      timings_.schedule_s += since(t_start);
    }
    const auto t = Clock::now();
    std::visit([this](const auto& ins) { on(ins); }, instruction);
    if (compute) timings_.busy_s += since(t);
  }
  if (!reducing) timings_.schedule_s += since(t_start);
  wait_sends();
  // The loss lives on the last stage; every stage reports it.
  const bool last = stage_ == stages_ - 1;
  at::Tensor loss = at::full({1}, last ? b_.loss_sum / M : 0.0, at::kDouble);
  pp_->broadcast(loss, stages_ - 1);
  b_ = Batch{};
  return loss.item<double>();
}

void Executor::wait_sends() {
  for (auto& work : b_.sends) work->wait();
  b_.sends.clear();
}

void Executor::on(const LoadMicroBatch& i) {
  auto [x, y] = (*b_.next)();
  if (stage_ == 0) b_.inputs[i.mb] = x;
  if (stage_ == stages_ - 1) b_.targets[i.mb] = y;
}

void Executor::on(const RecvActivation& i) {
  if (shape_recv_.empty()) {
    at::Tensor meta = at::empty({kMetaLen}, at::kLong);
    pp_->recv(meta, prev_, kMetaTag);
    dtype_recv_ = dtype_of(static_cast<int>(meta[0].item<int64_t>()));
    for (int64_t d = 0; d < meta[1].item<int64_t>(); ++d) shape_recv_.push_back(meta[2 + d].item<int64_t>());
  }
  at::Tensor a;
  if (!act_pool_.empty()) {  // a buffer of an earlier micro-batch whose gradient has gone back
    a = std::move(act_pool_.back());
    act_pool_.pop_back();
  } else {
    a = at::empty(shape_recv_, at::TensorOptions().dtype(dtype_recv_));
  }
  pp_->recv(a, prev_, 2 * i.mb);
  b_.received[i.mb] = a;
  b_.inputs[i.mb] = a.detach();  // autograd sees an alias; the buffer returns to the pool
  if (b_.train) b_.inputs[i.mb].requires_grad_(true);
}

void Executor::on(const Forward& i) {
  at::Tensor out = ops_.forward(b_.inputs[i.mb]);
  if (stage_ == stages_ - 1) {
    out = ops_.loss(out, b_.targets[i.mb]);
    b_.loss_sum += out.item<double>();
  }
  b_.outputs[i.mb] = out;
  if (!b_.train && b_.received[i.mb].defined()) {
    b_.inputs[i.mb] = at::Tensor();
    act_pool_.push_back(std::move(b_.received[i.mb]));
  }
}

void Executor::on(const SendActivation& i) {
  at::Tensor a = b_.outputs[i.mb].detach().contiguous();
  if (shape_sent_.empty()) {
    TS_CHECK(a.dim() <= kMetaLen - 2, "pipeline: activations of ", a.dim(), " dimensions (at most ", kMetaLen - 2, ")");
    at::Tensor meta = at::zeros({kMetaLen}, at::kLong);
    meta[0] = dtype_code(a.scalar_type());
    meta[1] = a.dim();
    for (int64_t d = 0; d < a.dim(); ++d) meta[2 + d] = a.size(d);
    pp_->send(meta, next_, kMetaTag);
    shape_sent_ = a.sizes().vec();
  }
  TS_CHECK(a.sizes().vec() == shape_sent_, "pipeline stage ", stage_, ": activation of micro-batch ", i.mb,
           " has shape ", a.sizes(), " but the first had ", at::IntArrayRef(shape_sent_),
           "; every micro-batch must have the same shape");
  b_.sends.push_back(pp_->send_async(a, next_, 2 * i.mb));
  if (!b_.train) b_.outputs[i.mb] = at::Tensor();
}

void Executor::on(const RecvGrad& i) {
  const at::Tensor& out = b_.outputs[i.mb];
  at::Tensor& g = b_.grads[i.mb];
  if (!grad_pool_.empty() && grad_pool_.back().sizes() == out.sizes() &&
      grad_pool_.back().scalar_type() == out.scalar_type()) {
    g = std::move(grad_pool_.back());
    grad_pool_.pop_back();
  } else {
    g = at::empty_like(out);
  }
  pp_->recv(g, next_, 2 * i.mb + 1);
}

void Executor::on(const Backward& i) {
  const bool boundary = i.mb == b_.micro_batches - 1;  // the last backward of both schedules
  ops_.begin_backward(boundary);
  nn::AuxLoss::set_backward_scale(b_.scale);  // the stage's attached auxiliary losses (MoE)
  if (stage_ == stages_ - 1) {
    (b_.outputs[i.mb].to(at::kFloat) * b_.scale).backward();
  } else {
    torch::autograd::backward({b_.outputs[i.mb]}, {b_.grads[i.mb]});
  }
  if (!boundary) ops_.finish_backward();
  b_.outputs[i.mb] = at::Tensor();
  if (b_.grads[i.mb].defined()) grad_pool_.push_back(std::move(b_.grads[i.mb]));
}

void Executor::on(const SendGrad& i) {
  at::Tensor g = b_.inputs[i.mb].grad();
  TS_INTERNAL_ASSERT(g.defined(), "stage ", stage_, ": no input gradient for micro-batch ", i.mb);
  b_.sends.push_back(pp_->send_async(g.contiguous(), prev_, 2 * i.mb + 1));
  b_.inputs[i.mb] = at::Tensor();
  act_pool_.push_back(std::move(b_.received[i.mb]));
}

void Executor::on(const ReduceTiedGrads&) { ops_.reduce_tied_grads(); }
void Executor::on(const ReduceGrads&) { ops_.finish_backward(); }

void Executor::on(const OptimizerStep&) {
  wait_sends();
  ops_.optimizer_step();
}

}  // namespace torchspeed::pipeline
