// Engine wiring: components built from the config, DeepSpeed's verbs and step semantics.
#include "torchspeed/engine/engine.h"
#include "torchspeed/nn/aux_loss.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <utility>

#include <unistd.h>

#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/offload/optimizer_swapper.h"
#include "torchspeed/offload/param_swapper.h"
#include "torchspeed/parallel/expert.h"
#include "torchspeed/parallel/sequence.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/tensor_parallel/layers.h"
#include "torchspeed/engine/wiring.h"

namespace torchspeed {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void check_supported(const config::Config& c, const parallel::ParallelGroups& g) {
  c.check_batch_sizes();
  TS_CHECK(c.world_size == g.grid.world_size(), "the config was resolved for ", c.world_size,
           " ranks but the job has ", g.grid.world_size(), "; pass the job's world size to Config::load");
  TS_CHECK(c.dp == g.dp->size(), "the config's data-parallel size ", c.dp,
           " differs from the data-parallel group's ", g.dp->size());
  TS_CHECK(c.sp == g.sp_size(), "the config's sequence_parallel_size ", c.sp, " differs from the job's sequence-parallel ",
           "groups (", g.sp_size(), " ranks; make them with parallel::add_sequence_groups)");
  TS_CHECK(c.pp == 1 || c.zero.stage <= 1, "pipeline.stages ", c.pp, " with zero_optimization.stage ", c.zero.stage,
           ": pipeline parallelism combines with ZeRO stages 0 and 1 (as in DeepSpeed)");
}

}  // namespace

Engine::Engine(parallel::ParallelGroups groups, std::shared_ptr<torch::nn::Module> root,
               nn::LayerStack stack, torch::nn::AnyModule any, config::Config config, StagePlan plan,
               std::vector<ParamGroup> param_groups)
    : groups_(std::move(groups)),
      param_groups_(std::move(param_groups)),
      root_(std::move(root)),
      stack_(std::move(stack)),
      any_(std::move(any)),
      config_(std::move(config)),
      precision_(wiring::precision_of(config_)),
      scaler_(wiring::loss_scaler_of(config_)),
      schedule_(config_.scheduler, config_.optimizer.lr,
                config_.optimizer.betas.empty() ? 0.9 : config_.optimizer.betas[0]) {
  check_supported(config_, groups_);
  plan_ = std::move(plan);
  TS_CHECK(plan_.stages == config_.pp, "the engine was built for ", plan_.stages, " pipeline stages but the config has ",
           config_.pp, "; build it with initialize() from a StackSpec");
  TS_CHECK(config_.pipeline.activation_checkpoint_interval == 0 || stack_,
           "pipeline.activation_checkpoint_interval needs a LayerStack model");
  make_checkpoint_comm();
  if (groups_.tp && groups_.tp->size() > 1) tensor_parallel::share_rng_state(*groups_.tp);
  // Tied weights start from their first stage's value (before the optimizer copies them).
  if (stack_) tied_ = pipeline::TiedWeights(plan_, stack_);
  zero::ZeroOptions zo = wiring::zero_options_of(config_);
  zo.norm_group(plan_.stages > 1 || config_.tp > 1 ? groups_.mp : nullptr);  // the norm spans the model's ranks
  // Pipeline stages reduce after the tied weights' gradients are summed (ReduceTiedGrads), so
  // buckets cannot start during the boundary backward.
  if (plan_.stages > 1) zo.reduce_in_backward(false);
  if (config_.zero.offload_optimizer.device == config::OffloadDevice::kNvme ||
      config_.zero.offload_param.device == config::OffloadDevice::kNvme) {
    offload::return_freed_memory_promptly();
  }
  zo.state_store(wiring::make_optimizer_store(config_, groups_.world->rank()));
  zo.param_store(wiring::make_param_store(config_, groups_.world->rank(), precision_ == precision::Precision::kBF16 ? 2 : 4));
  const int layers = stack_ ? static_cast<int>(stack_->size()) : 0;
  // A tied weight's later copy, and a parameter every tensor-parallel rank holds whole, count
  // once in the global norm.
  const bool tp_first = groups_.tp->rank() == 0;
  auto counted = [&](const std::string& name, const at::Tensor& p) {
    return !plan_.is_copy(name) && (tp_first || tensor_parallel::split_of(p));
  };
  // Frozen parameters (a LoRA run's base) stay outside ZeRO, which takes the trainable ones only,
  // so they get the precision's storage here as ZeRO's units give theirs: bf16, or fp32 holding
  // fp16-rounded values.
  if (precision_ != precision::Precision::kFP32) {
    c10::NoGradGuard guard;
    for (auto& p : root_->parameters(/*recurse=*/true)) {
      if (p.requires_grad()) continue;
      p.set_data(precision_ == precision::Precision::kBF16 ? p.detach().to(at::kBFloat16) : p.detach().to(at::kHalf).to(at::kFloat));
    }
  }
  auto params = zero::collect_params(*root_, stack_, counted, param_groups_);
  // Expert parallelism: the experts reduce over the expert-data-parallel group.
  for (const auto& p : params) {
    if (!p.expert) continue;
    const int ep = *parallel::expert_parallel_size(p.param);
    TS_CHECK(ep == groups_.ep_size(), "parameter '", p.name, "' holds 1/", ep, " of its layer's experts but the job's ",
             "expert-parallel groups have ", groups_.ep_size(), " ranks (make them with parallel::add_expert_groups)");
  }
  zo.expert_parallel(groups_.ep).expert_data_parallel(groups_.edp);
  zero_ = zero::make_zero_optimizer(std::move(params), layers, groups_.dp, zo, wiring::optimizer_spec_of(config_, param_groups_));
  layer_hooks_ = zero_->layer_hooks();
  if (config_.compression.enabled()) {
    TS_CHECK(stack_, "compression_training and quantize_training need a LayerStack model (GPT)");
    compression_ = std::make_unique<compression::Schedule>(config_.compression, stack_,
                                                           plan_.stages > 1 ? groups_.pp : nullptr, config_.tp);
  }
  if (config_.random_ltd.enabled) {
    TS_CHECK(stack_, "data_efficiency.data_routing.random_ltd needs a LayerStack model (GPT)");
    TS_CHECK(config_.sp == 1, "data_efficiency.data_routing.random_ltd drops tokens per rank, which sequence parallelism "
             "(sequence_parallel_size ", config_.sp, ") cannot exchange; disable one of them");
    random_ltd_ = std::make_unique<nn::RandomLtd>(config_.random_ltd, stack_, plan_.stages == 1);
  }
  // Activation checkpointing: segments of `interval` layers keep only their input.
  if (stack_ && stack_->fused_loss()) {
    TS_CHECK(plan_.stages == 1, "a fused (tiled) loss runs in one pipeline stage; pipeline.stages is ", plan_.stages);
  }
  if (const int k = config_.pipeline.activation_checkpoint_interval; k > 0) {
    segments_ = nn::interval_segments(body_layers(), k, [this](const at::Tensor& x, size_t b, size_t e) {
      return run_layers(x, b, e, at::GradMode::is_enabled());
    });
  }
  if (groups_.world->rank() == 0 && (config_.tensorboard.enabled || config_.csv_monitor.enabled)) {
    monitor::MonitorConfig mc;
    mc.tensorboard = {config_.tensorboard.enabled, config_.tensorboard.output_path, config_.tensorboard.job_name};
    mc.csv = {config_.csv_monitor.enabled, config_.csv_monitor.output_path, config_.csv_monitor.job_name};
    monitor_ = std::make_unique<monitor::Monitor>(mc);
  }
  if (plan_.stages > 1) make_executor();
  root_->train();
  log::debug("engine: ", zero_->num_params(), " parameters, ZeRO stage ", config_.zero.stage, ", ",
             precision::precision_name(precision_), ", dp ", groups_.dp->size());
}

Engine::~Engine() = default;

at::ScalarType Engine::compute_dtype() const {
  // fp16 runs its math in fp32 on fp16-rounded values: see Note [fp16 on CPU].
  return precision_ == precision::Precision::kBF16 ? at::kBFloat16 : at::kFloat;
}

size_t Engine::body_layers() const {
  if (!stack_) return 0;
  return stack_->fused_loss() ? stack_->size() - 1 : stack_->size();
}

at::Tensor Engine::run(const at::Tensor& input, bool before_fused_loss) {
  at::Tensor x = input;
  if (x.is_floating_point() && x.scalar_type() != compute_dtype()) x = x.to(compute_dtype());
  // fp16.auto_cast: DeepSpeed casts floating inputs to fp16; here fp16 values in fp32 tensors
  // (Note [fp16 on CPU]). Without it inputs keep their precision, as in DeepSpeed.
  if (precision_ == precision::Precision::kFP16 && config_.fp16.auto_cast && x.is_floating_point()) {
    x = x.to(at::kHalf).to(compute_dtype());
  }
  if (!stack_) return any_.forward(x);
  if (compression_) compression_->update(global_steps_ - skipped_steps_);
  if (random_ltd_) random_ltd_->update(global_steps_);
  const bool grad = at::GradMode::is_enabled() && root_->is_training();
  const size_t body = body_layers();
  if (segments_.empty() || !grad) {
    x = run_layers(x, 0, body, grad);
  } else {
    for (const auto& segment : segments_) x = nn::checkpoint(segment, x);
  }
  if (before_fused_loss || body == stack_->size()) return x;
  return run_layers(x, body, stack_->size(), grad);
}

at::Tensor Engine::run_layers(const at::Tensor& input, size_t begin, size_t end, bool grad) {
  at::Tensor x = input;
  for (size_t i = begin; i < end; ++i) {
    if (layer_hooks_) layer_hooks_->before_forward(static_cast<int>(i));
    x = stack_->run_layer(i, x);
    if (layer_hooks_) x = layer_hooks_->after_forward(static_cast<int>(i), x, grad);
  }
  return x;
}

at::Tensor Engine::forward(const at::Tensor& input) {
  TS_CHECK(plan_.stages == 1, "forward(): with pipeline stages use train_batch() and eval_batch()");
  auto t = Clock::now();
  at::Tensor out = run(input);
  forward_s_ += since(t);
  return out;
}

at::Tensor Engine::forward(const at::Tensor& input, const at::Tensor& target) {
  TS_CHECK(stack_ && stack_->has_loss(),
           "forward(input, target) needs a LayerStack with a loss function; call forward(input) "
           "and compute the loss yourself");
  TS_CHECK(plan_.stages == 1, "forward(): with pipeline stages use train_batch() and eval_batch()");
  auto t = Clock::now();
  at::Tensor loss;
  if (const auto& fused = stack_->fused_loss()) {
    // The last layer inside the loss (a tiled LM head and cross-entropy), between its hooks.
    const at::Tensor x = run(input, /*before_fused_loss=*/true);
    const size_t last = stack_->size() - 1;
    const bool grad = at::GradMode::is_enabled() && root_->is_training();
    if (layer_hooks_) layer_hooks_->before_forward(static_cast<int>(last));
    loss = fused(stack_->layer_module(last), x, target);
    if (layer_hooks_) loss = layer_hooks_->after_forward(static_cast<int>(last), loss, grad);
  } else {
    loss = stack_->loss(run(input), target);
  }
  forward_s_ += since(t);
  return loss;
}

bool Engine::is_gradient_accumulation_boundary() const {
  return (micro_steps_ + 1) % config_.gradient_accumulation_steps == 0;
}

void Engine::backward(const at::Tensor& loss) {
  TS_CHECK(root_->is_training(), "backward() in eval mode: call engine.train() first");
  TS_CHECK(loss.defined() && loss.numel() == 1, "backward() needs a scalar loss, got shape ",
           loss.defined() ? loss.sizes() : at::IntArrayRef{});
  auto t = Clock::now();
  zero_->begin_backward(is_gradient_accumulation_boundary());
  const double factor = scaler_.scale() / static_cast<double>(config_.gradient_accumulation_steps);
  at::Tensor scaled = loss.to(at::kFloat) * factor;
  nn::AuxLoss::set_backward_scale(factor);  // the layers' attached auxiliary losses (MoE)
  if (monitor_) window_loss_ += loss.item<double>();
  scaled.backward();
  zero_->finish_backward();
  backward_s_ += since(t);
}

void Engine::step() {
  TS_CHECK(plan_.stages == 1, "step(): with pipeline stages use train_batch()");
  if (is_gradient_accumulation_boundary()) optimizer_step();
  ++micro_steps_;
}

void Engine::optimizer_step() {
  auto r = zero_->step(scaler_.scale(), config_.gradient_clipping, schedule_.lr(), schedule_.beta1());
  scaler_.update(r.overflow);
  if (r.overflow) {
    ++skipped_steps_;
    log::info0("step ", global_steps_ + 1, ": gradient overflow, step skipped; loss scale now ", scaler_.scale());
  } else {
    schedule_.step();
    grad_norm_ = r.grad_norm;
  }
  ++global_steps_;
  if (monitor_ && plan_.stages == 1) {
    write_monitor_events(window_loss_ / static_cast<double>(config_.gradient_accumulation_steps));
  }
  window_loss_ = 0.0;
  if (config_.autotuning.enabled) autotuning_profile();
  if (global_steps_ % config_.steps_per_print == 0) report_progress();
}

// DeepSpeed's engine at each steps_per_print boundary (_report_progress, the wall-clock timers'
// log, see_memory_usage), world rank 0. The timers are this engine's, summed over the steps
// since the last report; a rank's forward and backward include the waits on its peers.
void Engine::report_progress() {
  const EngineTimings t = timings(), r = std::exchange(reported_, t);  // now, and at the last report
  if (!log::is_rank0()) return;
  if (progress_report_) {
    const auto& o = config_.optimizer;
    std::string mom;
    if (o.type == optim::OptimizerType::kSGD) {
      mom = concat(o.momentum);
    } else {
      mom = concat("(", schedule_.beta1().value_or(o.betas.at(0)), ", ", o.betas.at(1), ")");
    }
    log::info("step=", global_steps_, ", skipped=", skipped_steps_, ", lr=[", schedule_.lr(), "], mom=[", mom, "]");
  }
  if (config_.wall_clock_breakdown) {
    auto ms = [](double a, double b) { return concat(static_cast<int64_t>(std::llround((a - b) * 1e3))); };
    std::string line = concat("time (ms) over the last ", config_.steps_per_print, " steps | forward: ",
                              ms(t.forward_s, r.forward_s), " | backward: ", ms(t.backward_s, r.backward_s),
                              " | step: reduce wait ", ms(t.reduce_wait_s, r.reduce_wait_s), ", optimizer ",
                              ms(t.optimizer_s, r.optimizer_s), ", all-gather ", ms(t.allgather_s, r.allgather_s));
    if (executor_) {
      line += concat(" | pipeline: busy ", ms(t.pipeline_busy_s, r.pipeline_busy_s), " of ",
                     ms(t.pipeline_schedule_s, r.pipeline_schedule_s));
    }
    log::info(line);
  }
  if (config_.memory_breakdown) {
    const zero::MemoryReport m = zero_->memory();
    auto mb = [](int64_t b) { return concat(std::llround(static_cast<double>(b) / (1 << 20)), " MB"); };
    long pages = 0, resident = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
      std::fclose(f);
    }
    log::info("memory | parameters ", mb(m.params), " | gradients ", mb(m.gradients), " | fp32 masters ", mb(m.master),
              " | optimizer state ", mb(m.optimizer_state), " | offloaded ", mb(m.offloaded), " | peak transient ",
              mb(m.peak_transient), " | process resident ", mb(static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE)));
  }
}

// DeepSpeed's engine under autotuning (engine.py _autotuning_exit): the mean time of the steps
// after start_profile_step up to end_profile_step, written by rank 0 as the experiment's metrics.
// DeepSpeed exits the process there; a library cannot, so the engine reports autotuning_done()
// and `torchspeed train` stops.
void Engine::autotuning_profile() {
  const auto& a = config_.autotuning;
  if (global_steps_ == a.start_profile_step) {
    groups_.world->barrier();
    profile_start_ = std::chrono::steady_clock::now();
  } else if (global_steps_ == a.end_profile_step && profile_start_) {
    groups_.world->barrier();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - *profile_start_).count();
    const double latency_s = s / static_cast<double>(a.end_profile_step - a.start_profile_step);
    autotuning_metrics_ = {{"latency", latency_s * 1e3},
                           {"throughput", static_cast<double>(config_.train_batch_size) / latency_s},
                           {"FLOPS_per_gpu", flops_per_sample_ * static_cast<double>(config_.train_batch_size) / latency_s /
                                                 static_cast<double>(groups_.world->size())},
                           {"train_micro_batch_size_per_gpu", config_.train_micro_batch_size_per_gpu},
                           {"gradient_accumulation_steps", config_.gradient_accumulation_steps},
                           {"zero_stage", config_.zero.stage},
                           {"steps_timed", a.end_profile_step - a.start_profile_step}};
    if (groups_.world->rank() == 0) {
      const std::string path = a.metric_path.empty() ? "autotuning_metric.json" : a.metric_path;
      checkpoint::write_file_atomic(path, autotuning_metrics_.dump(2) + "\n");
      log::info0("autotuning: wrote metrics to ", path);
    }
  }
}

void Engine::write_monitor_events(std::optional<double> train_loss) {
  // As DeepSpeed's engine: rank 0, at each optimizer step. The loss is rank 0's mean over the
  // window's micro-batches (pipeline: the mean over data-parallel ranks, as DeepSpeed's
  // pipeline engine reports it).
  std::optional<double> scale;
  if (precision_ == precision::Precision::kFP16) scale = scaler_.scale();
  monitor_->write_step(global_steps_ * config_.train_batch_size, train_loss, schedule_.lr(), scale);
}

nlohmann::json Engine::export_state(std::vector<std::pair<std::string, at::Tensor>>& tensors) const {
  tensors = zero_->export_partition();
  return export_counters();
}

nlohmann::json Engine::export_counters() const {
  nlohmann::json j = {{"global_steps", global_steps_}, {"micro_steps", micro_steps_}, {"skipped_steps", skipped_steps_},
          {"optimizer_steps", zero_->steps_taken()}, {"grad_norm", grad_norm_},
          {"loss_scaler", scaler_.state()}, {"lr_schedule", schedule_.state()},
          {"zero_stage", config_.zero.stage}, {"dp", groups_.dp->size()}, {"dp_rank", groups_.dp->rank()}};
  if (auto scalars = zero_->export_scalars(); !scalars.is_null()) j["optimizer_scalars"] = scalars;
  return j;
}

void Engine::check_state(const nlohmann::json& s) {
  TS_CHECK(s.contains("global_steps") && s.contains("micro_steps") && s.contains("skipped_steps") &&
               s.contains("optimizer_steps") && s.contains("loss_scaler") && s.contains("lr_schedule"),
           "engine state is missing global_steps, micro_steps, skipped_steps, optimizer_steps, loss_scaler or "
           "lr_schedule");
}

void Engine::import_state(const nlohmann::json& s, std::vector<std::pair<std::string, at::Tensor>> tensors) {
  check_state(s);
  zero_->import_partition(std::move(tensors), s.at("optimizer_steps").get<int64_t>());
  import_counters(s);
}

void Engine::import_counters(const nlohmann::json& s) {
  global_steps_ = s.at("global_steps").get<int64_t>();
  micro_steps_ = s.at("micro_steps").get<int64_t>();
  skipped_steps_ = s.at("skipped_steps").get<int64_t>();
  grad_norm_ = s.value("grad_norm", 0.0);
  scaler_.load_state(s.at("loss_scaler"));
  schedule_.load_state(s.at("lr_schedule"));
  zero_->import_scalars(s.value("optimizer_scalars", nlohmann::json()));
}

EngineTimings Engine::timings() const {
  const auto& z = zero_->timings();
  EngineTimings t{forward_s_, backward_s_, z.reduce_wait_s, z.optimizer_s, z.allgather_s,
                  z.buckets_launched_in_backward, z.buckets_launched_after, z.optimizer_sub_groups};
  if (executor_) {
    t.pipeline_busy_s = executor_->timings().busy_s;
    t.pipeline_schedule_s = executor_->timings().schedule_s;
  }
  return t;
}

void Engine::make_executor() {
  pipeline::StageOps ops;
  ops.forward = [this](const at::Tensor& x) { return run(x); };
  ops.loss = [this](const at::Tensor& out, const at::Tensor& y) { return stack_->loss(out, y); };
  ops.begin_backward = [this](bool boundary) { zero_->begin_backward(boundary); };
  ops.finish_backward = [this] { zero_->finish_backward(); };
  ops.reduce_tied_grads = [this] { tied_.reduce_grads(); };
  ops.optimizer_step = [this] {
    optimizer_step();
    micro_steps_ += config_.gradient_accumulation_steps;
  };
  executor_ = std::make_unique<pipeline::Executor>(groups_.pp, groups_.prev_stage, groups_.next_stage, plan_.stage,
                                                   plan_.stages, pipeline::schedule_kind(config_.pipeline.schedule),
                                                   std::move(ops));
}

double Engine::mean_over_data_parallel(double v) const {
  at::Tensor t = at::full({1}, v, at::kDouble);
  groups_.dp->all_reduce(t, comm::ReduceOp::kAvg);
  return t.item<double>();
}

double Engine::train_batch(const MicroBatchSource& next) {
  TS_CHECK(root_->is_training(), "train_batch() in eval mode: call engine.train() first");
  const int64_t gas = config_.gradient_accumulation_steps;
  if (executor_) {
    auto t = Clock::now();
    const double loss = executor_->run(next, static_cast<int>(gas), /*train=*/true, scaler_.scale());
    backward_s_ += since(t);
    const double mean = mean_over_data_parallel(loss);
    if (monitor_) write_monitor_events(mean);
    return mean;
  }
  TS_CHECK(micro_steps_ % gas == 0, "train_batch() inside an accumulation window started with forward/backward/step");
  double sum = 0;
  for (int64_t m = 0; m < gas; ++m) {
    auto [x, y] = next();
    at::Tensor loss = forward(parallel::sequence_shard(x, groups_.sp), parallel::sequence_shard(y, groups_.sp));
    backward(loss);
    step();
    sum += loss.item<double>();
  }
  return mean_over_data_parallel(sum / static_cast<double>(gas));
}

double Engine::eval_batch(const MicroBatchSource& next) {
  const bool was_training = root_->is_training();
  eval();
  const int64_t gas = config_.gradient_accumulation_steps;
  double loss = 0;
  {
    c10::NoGradGuard no_grad;
    if (executor_) {
      loss = executor_->run(next, static_cast<int>(gas), /*train=*/false, 1.0);
    } else {
      for (int64_t m = 0; m < gas; ++m) {
        auto [x, y] = next();
        loss += forward(parallel::sequence_shard(x, groups_.sp), parallel::sequence_shard(y, groups_.sp)).item<double>();
      }
      loss /= static_cast<double>(gas);
    }
  }
  if (was_training) train();
  return mean_over_data_parallel(loss);
}

parallel::ParallelGroups make_groups(const Runtime& runtime, const config::Config& config, int ep_size) {
  comm::CommOptions co;
  co.timeout(std::chrono::milliseconds(static_cast<int64_t>(config.torchspeed.comm_timeout_s * 1000)))
      .chunk_bytes(config.torchspeed.comm_chunk_bytes);
  auto world = comm::Communicator::world(co);
  parallel::ProcessGrid grid(runtime.world_size, config.tp, config.pp);
  auto groups = parallel::make_parallel_groups(world, grid);
  parallel::add_expert_groups(groups, ep_size);
  parallel::add_sequence_groups(groups, config.sp);
  return groups;
}

std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, nn::LayerStack model,
                                   const config::Config& config, const std::vector<ParamGroup>& param_groups) {
  std::shared_ptr<torch::nn::Module> root = model.ptr();
  return std::make_unique<Engine>(groups, root, model, torch::nn::AnyModule(), config, StagePlan{}, param_groups);
}

std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, const nn::StackSpec& spec,
                                   const config::Config& config, const std::vector<ParamGroup>& param_groups) {
  const int stages = groups.grid.pp();
  if (stages == 1) return initialize(groups, nn::build(spec), config, param_groups);
  auto layers = pipeline::plan_stage(groups, spec, config.pipeline.partition_method);
  nn::LayerStack local = nn::build(spec, layers.begin, layers.end);
  std::shared_ptr<torch::nn::Module> root = local.ptr();
  return std::make_unique<Engine>(groups, root, local, torch::nn::AnyModule(), config, std::move(layers.plan),
                                  param_groups);
}

std::unique_ptr<Engine> initialize_module(const parallel::ParallelGroups& groups,
                                          std::shared_ptr<torch::nn::Module> root,
                                          torch::nn::AnyModule any, const config::Config& config,
                                          const std::vector<ParamGroup>& param_groups) {
  TS_CHECK(config.zero.stage < 3,
           "ZeRO stage 3 needs a LayerStack model (it gathers parameters layer by layer); build "
           "the model as a torchspeed::nn::LayerStack or use stage 0-2");
  return std::make_unique<Engine>(groups, std::move(root), nn::LayerStack(nullptr), std::move(any),
                                  config, StagePlan{}, param_groups);
}

}  // namespace torchspeed
