// The training loop (trainer.h).
#include "torchspeed/engine/trainer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "torchspeed/base/error.h"

namespace torchspeed {

using Clock = std::chrono::steady_clock;

Trainer::Trainer(Engine& engine, TrainData data, TrainerOptions options)
    : engine_(engine), data_(std::move(data)), opt_(std::move(options)), step_(engine.global_step()) {
  TS_CHECK(data_.train_step && data_.evaluate, "Trainer: TrainData needs train_step and evaluate");
  TS_CHECK(opt_.steps >= 0 && opt_.log_interval >= 1 && opt_.eval_interval >= 0 && opt_.checkpoint_interval >= 0,
           "Trainer: steps ", opt_.steps, ", log_interval ", opt_.log_interval, ", eval_interval ", opt_.eval_interval,
           ", checkpoint_interval ", opt_.checkpoint_interval, " (intervals >= 0, log_interval >= 1)");
  TS_CHECK(opt_.checkpoint_interval == 0 || !opt_.checkpoint_dir.empty(),
           "Trainer: checkpoint_interval ", opt_.checkpoint_interval, " needs a checkpoint_dir");
}

std::optional<Engine::LoadedCheckpoint> Trainer::resume() {
  TS_CHECK(!opt_.checkpoint_dir.empty(), "Trainer::resume needs a checkpoint_dir");
  auto loaded = engine_.load_checkpoint(opt_.checkpoint_dir);
  if (loaded) {
    if (data_.load_state && loaded->client_state.contains("data")) data_.load_state(loaded->client_state.at("data"));
    step_ = engine_.global_step();
  }
  return loaded;
}

std::string Trainer::save() {
  TS_CHECK(!opt_.checkpoint_dir.empty(), "Trainer::save needs a checkpoint_dir");
  nlohmann::json client = nlohmann::json::object();
  if (data_.state) client["data"] = data_.state();
  const std::string path = engine_.save_checkpoint(opt_.checkpoint_dir, "", client);
  for (auto& o : observers_) o->on_checkpoint(step_, path);
  return path;
}

TrainResult Trainer::run() {
  TrainResult result;
  const auto start = Clock::now();
  auto window_start = start;
  int64_t window_steps = 0;
  bool evaluated_last = false;  // the same on every rank
  const int64_t samples_per_step = engine_.config().train_batch_size;
  while (step_ < opt_.steps) {
    const double step_lr = engine_.lr();  // the lr this step's update uses
    const double loss = data_.train_step(engine_);  // mean over micro-batches and data-parallel ranks
    ++step_;
    ++window_steps;
    monitor::StepReport r;
    r.step = step_;
    r.samples = step_ * samples_per_step;
    r.loss = loss;
    r.lr = step_lr;
    r.loss_scale = engine_.loss_scale();
    r.grad_norm = engine_.grad_norm();
    const auto now = Clock::now();
    const double window_s = std::chrono::duration<double>(now - window_start).count();
    r.tokens_per_s = static_cast<double>(opt_.tokens_per_step * window_steps) / std::max(window_s, 1e-9);
    if (opt_.peak_flops > 0.0) r.mfu = opt_.flops_per_token * r.tokens_per_s / opt_.peak_flops;
    evaluated_last = (opt_.eval_interval > 0 && step_ % opt_.eval_interval == 0) || step_ == opt_.steps;
    if (evaluated_last) {
      r.val_loss = data_.evaluate(engine_);
      result.val_loss = r.val_loss;
    }
    if (step_ % opt_.log_interval == 0) {
      window_start = Clock::now();
      window_steps = 0;
    }
    const double elapsed = std::chrono::duration<double>(now - start).count();
    for (auto& o : observers_) o->on_step(r, elapsed);
    if (engine_.autotuning_done()) {  // an autotuning experiment: timed, its metrics written
      result.autotuning_done = true;
      break;
    }
    if (opt_.checkpoint_interval > 0 && step_ % opt_.checkpoint_interval == 0 && step_ < opt_.steps) save();
    // Every rank agrees after this step: this rank's request, or the stop file that world rank 0 sees.
    const bool asked = (opt_.stop_requested && opt_.stop_requested()) ||
                       (!opt_.stop_file.empty() && engine_.groups().world->rank() == 0 &&
                        std::filesystem::exists(opt_.stop_file));
    at::Tensor stop = at::full({1}, asked ? 1 : 0, at::kInt);
    engine_.groups().world->all_reduce(stop, comm::ReduceOp::kMax);
    if (stop.item<int>() != 0 && step_ < opt_.steps) {
      result.interrupted = true;
      break;
    }
  }
  result.step = step_;
  if (!evaluated_last && !result.interrupted && !result.autotuning_done) result.val_loss = data_.evaluate(engine_);
  for (auto& o : observers_) o->on_end(step_, result.interrupted);
  return result;
}

}  // namespace torchspeed
