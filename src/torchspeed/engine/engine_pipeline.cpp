// Engine::train_batch / eval_batch: the micro-batch loop, and with pipeline stages the executor
// of the schedule's instructions (pipeline/schedule.h), one std::visit per instruction.
//
// Note [Pipeline executor]
// - Activations go to the next stage and gradients back with non-blocking sends (kept alive
//   until the batch ends) and blocking receives; tags are 2*mb (activation) and 2*mb+1
//   (gradient), so each message pairs with exactly its instruction on the neighbour.
// - The activation's shape and dtype are sent once, before the first activation; every later
//   micro-batch must have the same shape (as in DeepSpeed). Gradients have their activation's
//   shape, which the receiving stage knows. Receive buffers are reused: an activation buffer
//   once its gradient has been sent back, a gradient buffer once its backward has run, so a
//   stage allocates only as many as it holds at once (1F1B: stages - stage).
// - The last micro-batch's backward is the accumulation boundary: ZeRO's reduction is deferred
//   to ReduceGrads, after ReduceTiedGrads has summed the tied weights' gradients across the
//   stages holding them (embedding and LM head), so both copies take identical steps.
// - The gradient norm and the overflow decision cover every stage (ZeroOptions::norm_group).
// - The loss is computed on the last stage and broadcast to every stage for logging.
#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <chrono>

#include "torchspeed/engine/engine.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/tensor_parallel/layers.h"

namespace torchspeed {
namespace {

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

}  // namespace

double Engine::mean_over_data_parallel(double v) const {
  at::Tensor t = at::full({1}, v, at::kDouble);
  groups_.dp->all_reduce(t, comm::ReduceOp::kAvg);
  return t.item<double>();
}

double Engine::train_batch(const MicroBatchSource& next) {
  TS_CHECK(root_->is_training(), "train_batch() in eval mode: call engine.train() first");
  if (plan_.stages > 1) return pipeline_batch(next, /*train=*/true);
  TS_CHECK(micro_steps_ % config_.gradient_accumulation_steps == 0,
           "train_batch() inside an accumulation window started with forward/backward/step");
  double sum = 0;
  for (int64_t m = 0; m < config_.gradient_accumulation_steps; ++m) {
    auto [x, y] = next();
    at::Tensor loss = forward(x, y);
    backward(loss);
    step();
    sum += loss.item<double>();
  }
  return mean_over_data_parallel(sum / static_cast<double>(config_.gradient_accumulation_steps));
}

double Engine::eval_batch(const MicroBatchSource& next) {
  const bool was_training = root_->is_training();
  eval();
  double loss = 0;
  {
    c10::NoGradGuard no_grad;
    if (plan_.stages > 1) {
      loss = pipeline_batch(next, /*train=*/false);
    } else {
      double sum = 0;
      for (int64_t m = 0; m < config_.gradient_accumulation_steps; ++m) {
        auto [x, y] = next();
        sum += forward(x, y).item<double>();
      }
      loss = mean_over_data_parallel(sum / static_cast<double>(config_.gradient_accumulation_steps));
    }
  }
  if (was_training) train();
  return loss;
}

void Engine::send_activation(const at::Tensor& t, int mb, std::vector<std::pair<comm::WorkPtr, at::Tensor>>& sends) {
  at::Tensor a = t.detach().contiguous();
  if (act_shape_sent_.empty()) {
    TS_CHECK(a.dim() <= kMetaLen - 2, "pipeline: activations of ", a.dim(), " dimensions (at most ", kMetaLen - 2, ")");
    at::Tensor meta = at::zeros({kMetaLen}, at::kLong);
    meta[0] = dtype_code(a.scalar_type());
    meta[1] = a.dim();
    for (int64_t d = 0; d < a.dim(); ++d) meta[2 + d] = a.size(d);
    groups_.pp->send(meta, groups_.next_stage, kMetaTag);
    act_shape_sent_ = a.sizes().vec();
  }
  TS_CHECK(a.sizes().vec() == act_shape_sent_, "pipeline stage ", plan_.stage, ": activation of micro-batch ", mb,
           " has shape ", a.sizes(), " but the first had ", at::IntArrayRef(act_shape_sent_),
           "; every micro-batch must have the same shape");
  sends.emplace_back(groups_.pp->send_async(a, groups_.next_stage, 2 * mb), a);
}

at::Tensor Engine::recv_activation(int mb) {
  if (act_shape_recv_.empty()) {
    at::Tensor meta = at::empty({kMetaLen}, at::kLong);
    groups_.pp->recv(meta, groups_.prev_stage, kMetaTag);
    act_dtype_recv_ = dtype_of(static_cast<int>(meta[0].item<int64_t>()));
    for (int64_t d = 0; d < meta[1].item<int64_t>(); ++d) act_shape_recv_.push_back(meta[2 + d].item<int64_t>());
  }
  at::Tensor a;
  if (!act_pool_.empty()) {  // a buffer of an earlier micro-batch whose gradient has gone back
    a = std::move(act_pool_.back());
    act_pool_.pop_back();
  } else {
    a = at::empty(act_shape_recv_, at::TensorOptions().dtype(act_dtype_recv_));
  }
  groups_.pp->recv(a, groups_.prev_stage, 2 * mb);
  return a;
}

double Engine::pipeline_batch(const MicroBatchSource& next, bool train) {
  const int M = static_cast<int>(config_.gradient_accumulation_steps);
  const bool first = plan_.stage == 0, last = plan_.stage == plan_.stages - 1;
  std::vector<pipeline::Instruction> program;
  if (train) {
    program = pipeline::make_schedule(pipe_schedule_, plan_.stages, plan_.stage, M);
  } else {  // forwards only
    for (const auto& ins : pipeline::gpipe(plan_.stages, plan_.stage, M)) {
      if (std::holds_alternative<pipeline::LoadMicroBatch>(ins) || std::holds_alternative<pipeline::RecvActivation>(ins) ||
          std::holds_alternative<pipeline::Forward>(ins) || std::holds_alternative<pipeline::SendActivation>(ins))
        program.push_back(ins);
    }
  }
  std::vector<at::Tensor> inputs(M), outputs(M), targets(M), grads(M);
  std::vector<at::Tensor> received(M);  // receive buffers (pooled across micro-batches and batches)
  std::vector<std::pair<comm::WorkPtr, at::Tensor>> sends;  // kept alive until completed
  double loss_sum = 0;
  const double scale = scaler_.scale() / static_cast<double>(M);
  auto t_start = std::chrono::steady_clock::now();
  using Clock = std::chrono::steady_clock;
  double busy = 0;
  bool reducing = false;
  for (const auto& instruction : program) {
    const bool compute = std::holds_alternative<pipeline::Forward>(instruction) ||
                         std::holds_alternative<pipeline::Backward>(instruction);
    if (!reducing && std::holds_alternative<pipeline::ReduceTiedGrads>(instruction)) {
      reducing = true;
      pipe_schedule_s_ += std::chrono::duration<double>(Clock::now() - t_start).count();
    }
    const auto t_ins = Clock::now();
    std::visit(
        [&](const auto& ins) {
          using T = std::decay_t<decltype(ins)>;
          if constexpr (std::is_same_v<T, pipeline::LoadMicroBatch>) {
            auto [x, y] = next();
            if (first) inputs[ins.mb] = x.is_floating_point() ? x.to(compute_dtype()) : x;
            if (last) targets[ins.mb] = y;
          } else if constexpr (std::is_same_v<T, pipeline::RecvActivation>) {
            received[ins.mb] = recv_activation(ins.mb);
            inputs[ins.mb] = received[ins.mb].detach();  // autograd sees an alias; the buffer returns to the pool
            if (train) inputs[ins.mb].requires_grad_(true);
          } else if constexpr (std::is_same_v<T, pipeline::Forward>) {
            at::Tensor out = run(inputs[ins.mb]);
            if (last) {
              out = stack_->loss(out, targets[ins.mb]);
              loss_sum += out.template item<double>();
            }
            outputs[ins.mb] = out;
            if (!train && received[ins.mb].defined()) {
              inputs[ins.mb] = at::Tensor();
              act_pool_.push_back(std::move(received[ins.mb]));
            }
          } else if constexpr (std::is_same_v<T, pipeline::SendActivation>) {
            send_activation(outputs[ins.mb], ins.mb, sends);
            if (!train) outputs[ins.mb] = at::Tensor();
          } else if constexpr (std::is_same_v<T, pipeline::RecvGrad>) {
            if (!grad_pool_.empty() && grad_pool_.back().sizes() == outputs[ins.mb].sizes() &&
                grad_pool_.back().scalar_type() == outputs[ins.mb].scalar_type()) {
              grads[ins.mb] = std::move(grad_pool_.back());
              grad_pool_.pop_back();
            } else {
              grads[ins.mb] = at::empty_like(outputs[ins.mb]);
            }
            groups_.pp->recv(grads[ins.mb], groups_.next_stage, 2 * ins.mb + 1);
          } else if constexpr (std::is_same_v<T, pipeline::Backward>) {
            const bool boundary = ins.mb == M - 1;  // the last backward of both schedules
            zero_->begin_backward(boundary);
            if (last) {
              (outputs[ins.mb].to(at::kFloat) * scale).backward();
            } else {
              torch::autograd::backward({outputs[ins.mb]}, {grads[ins.mb]});
            }
            if (!boundary) zero_->finish_backward();
            outputs[ins.mb] = at::Tensor();
            if (grads[ins.mb].defined()) grad_pool_.push_back(std::move(grads[ins.mb]));
          } else if constexpr (std::is_same_v<T, pipeline::SendGrad>) {
            at::Tensor g = inputs[ins.mb].grad();
            TS_INTERNAL_ASSERT(g.defined(), "stage ", plan_.stage, ": no input gradient for micro-batch ", ins.mb);
            g = g.contiguous();
            sends.emplace_back(groups_.pp->send_async(g, groups_.prev_stage, 2 * ins.mb + 1), g);
            inputs[ins.mb] = at::Tensor();
            act_pool_.push_back(std::move(received[ins.mb]));
          } else if constexpr (std::is_same_v<T, pipeline::ReduceTiedGrads>) {
            for (size_t i = 0; i < tied_params_.size(); ++i) {
              at::Tensor g = tied_params_[i].grad();
              if (!g.defined()) g = tied_params_[i].mutable_grad() = at::zeros_like(tied_params_[i]);
              plan_.ties[i].comm->all_reduce(g);
            }
          } else if constexpr (std::is_same_v<T, pipeline::ReduceGrads>) {
            zero_->finish_backward();
          } else if constexpr (std::is_same_v<T, pipeline::OptimizerStep>) {
            for (auto& [work, tensor] : sends) work->wait();
            sends.clear();
            optimizer_step();
            micro_steps_ += M;
          }
        },
        instruction);
    if (compute) busy += std::chrono::duration<double>(Clock::now() - t_ins).count();
  }
  pipe_busy_s_ += busy;
  if (!reducing) pipe_schedule_s_ += std::chrono::duration<double>(Clock::now() - t_start).count();
  for (auto& [work, tensor] : sends) work->wait();
  if (train) backward_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  // The loss lives on the last stage; every stage reports it.
  at::Tensor loss = at::full({1}, last ? loss_sum / M : 0.0, at::kDouble);
  groups_.pp->broadcast(loss, plan_.stages - 1);
  const double mean = mean_over_data_parallel(loss.item<double>());
  if (train && monitor_) write_monitor_events(mean);
  return mean;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::master_params() {
  auto local = zero_->gather_master();  // collective over the data-parallel group
  if (config_.tp > 1) {  // whole tensors from the tensor-parallel slices
    const auto named = root_->named_parameters(/*recurse=*/true);
    for (auto& [name, t] : local) {
      const at::Tensor* p = named.find(name);
      const auto split = p ? tensor_parallel::split_of(*p) : std::nullopt;
      if (!split) continue;
      at::Tensor all = at::empty({groups_.tp->size() * t.numel()}, at::kFloat);
      groups_.tp->all_gather(t.contiguous().view({-1}), all);
      std::vector<at::Tensor> parts;  // rank order
      for (const auto& c : all.chunk(groups_.tp->size())) parts.push_back(c.view(t.sizes()));
      t = tensor_parallel::merge(parts, *split);
    }
  }
  if (plan_.stages == 1) return local;
  // Copies of tied weights on later stages are left out: the first stage's name holds them.
  std::vector<std::pair<std::string, at::Tensor>> mine;
  for (auto& [name, t] : local) {
    bool copy = false;
    for (const auto& tie : plan_.ties)
      if (tie.param == name && !tie.owner) copy = true;
    if (!copy) mine.emplace_back(name, t);
  }
  // Each stage shares its parameters with the others of its pipeline.
  std::vector<std::pair<std::string, at::Tensor>> all;
  for (int s = 0; s < plan_.stages; ++s) {
    std::string header;
    if (s == plan_.stage) {
      nlohmann::json h = nlohmann::json::array();
      for (const auto& [name, t] : mine) h.push_back({name, t.sizes().vec()});
      header = h.dump();
    }
    const auto headers = comm::all_gather_strings(*groups_.pp, header);
    for (const auto& item : nlohmann::json::parse(headers[static_cast<size_t>(s)])) {
      const std::string name = item.at(0).get<std::string>();
      at::Tensor t;
      if (s == plan_.stage) {
        for (const auto& [n, v] : mine)
          if (n == name) t = v.contiguous();
      } else {
        t = at::empty(item.at(1).get<std::vector<int64_t>>(), at::kFloat);
      }
      groups_.pp->broadcast(t, s);
      all.emplace_back(name, t);
    }
  }
  return all;
}

}  // namespace torchspeed
