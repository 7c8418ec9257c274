// Engine wiring: config -> component options, and DeepSpeed's step semantics.
#include "torchspeed/engine/engine.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <unordered_map>

#include "torchspeed/pipeline/partition.h"
#include "torchspeed/tensor_parallel/layers.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/logging.h"

namespace torchspeed {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

precision::Precision precision_of(const config::Config& c) {
  if (c.bf16.enabled) return precision::Precision::kBF16;
  if (c.fp16.enabled) return precision::Precision::kFP16;
  return precision::Precision::kFP32;
}

at::ScalarType comm_dtype_of(const config::Config& c) {
  if (c.communication_data_type == "fp32") return at::kFloat;
  if (c.communication_data_type == "bf16") return at::kBFloat16;
  if (c.communication_data_type == "fp16") return at::kHalf;
  return at::ScalarType::Undefined;
}

zero::OptimizerSpec optimizer_of(const config::Config& c, const std::vector<ParamGroup>& groups) {
  TS_CHECK(!c.optimizer.type.empty(),
           "the config has no \"optimizer\" section; torchspeed needs one (type Adam, AdamW or SGD)");
  zero::OptimizerSpec s;
  s.type = c.optimizer.type;
  s.adam.lr = c.optimizer.lr;
  s.adam.beta1 = c.optimizer.betas.at(0);
  s.adam.beta2 = c.optimizer.betas.at(1);
  s.adam.eps = c.optimizer.eps;
  s.adam.weight_decay = c.optimizer.weight_decay;
  s.adam.bias_correction = c.optimizer.bias_correction;
  s.adam.adam_w_mode = c.optimizer.type == "AdamW" || c.optimizer.adam_w_mode;
  s.sgd.lr = c.optimizer.lr;
  s.sgd.momentum = c.optimizer.momentum;
  s.sgd.dampening = c.optimizer.dampening;
  s.sgd.weight_decay = c.optimizer.weight_decay;
  s.sgd.nesterov = c.optimizer.nesterov;
  for (const auto& g : groups) s.groups.push_back(g.options);
  return s;
}

precision::LossScaler scaler_of(const config::Config& c) {
  if (!c.fp16.enabled) return precision::LossScaler::none();
  precision::LossScalerOptions o;
  o.dynamic(c.fp16.dynamic())
      .static_scale(c.fp16.dynamic() ? 1.0 : c.fp16.loss_scale)
      .initial_scale_power(c.fp16.initial_scale_power)
      .scale_window(c.fp16.loss_scale_window)
      .hysteresis(c.fp16.hysteresis)
      .consecutive_hysteresis(c.fp16.consecutive_hysteresis)
      .min_scale(c.fp16.min_loss_scale);
  return precision::LossScaler(o);
}

void check_supported(const config::Config& c, const parallel::ParallelGroups& g) {
  c.check_batch_sizes();
  TS_CHECK(c.world_size == g.grid.world_size(), "the config was resolved for ", c.world_size,
           " ranks but the job has ", g.grid.world_size(), "; pass the job's world size to Config::load");
  TS_CHECK(c.dp == g.dp->size(), "the config's data-parallel size ", c.dp,
           " differs from the data-parallel group's ", g.dp->size());
  TS_CHECK(c.pp == 1 || c.zero.stage <= 1, "pipeline.stages ", c.pp, " with zero_optimization.stage ", c.zero.stage,
           ": pipeline parallelism combines with ZeRO stages 0 and 1 (as in DeepSpeed)");
  TS_CHECK(!c.zero.offload_optimizer.enabled() && !c.zero.offload_param.enabled(),
           "zero_optimization.offload_optimizer/offload_param: offload is not available yet; "
           "remove the offload settings (or the deprecated cpu_offload key)");
}

std::vector<zero::NamedParam> collect_params(const std::shared_ptr<torch::nn::Module>& root,
                                             nn::LayerStack stack, const StagePlan& plan, int tp_rank,
                                             const std::vector<ParamGroup>& groups) {
  std::vector<zero::NamedParam> out;
  std::unordered_map<const void*, size_t> seen;  // tied parameters appear once, where first used
  auto add = [&](const std::string& name, const at::Tensor& p, int layer) {
    if (!p.requires_grad()) return;
    auto [it, fresh] = seen.emplace(p.unsafeGetTensorImpl(), out.size());
    if (!fresh) {
      auto& first = out[it->second];
      if (layer >= 0 && layer != first.layer) first.also_used_by.push_back(layer);
      return;
    }
    bool counted = true;
    for (const auto& t : plan.ties)
      if (t.param == name && !t.owner) counted = false;
    // A parameter every tensor-parallel rank holds whole counts once in the norm.
    if (tp_rank > 0 && !tensor_parallel::split_of(p)) counted = false;
    int group = 0;  // the first group that claims it, else the optimizer's own
    for (size_t g = 0; g < groups.size() && group == 0; ++g)
      if (groups[g].match && groups[g].match(name, p)) group = static_cast<int>(g) + 1;
    out.push_back({name, p, layer, {}, counted, group});
  };
  if (stack) {
    for (size_t i = 0; i < stack->size(); ++i) {
      for (const auto& item : stack->layer_module(i)->named_parameters(/*recurse=*/true)) {
        add(stack->layer_name(i) + "." + item.key(), item.value(), static_cast<int>(i));
      }
    }
  } else {
    for (const auto& item : root->named_parameters(/*recurse=*/true)) add(item.key(), item.value(), -1);
  }
  TS_CHECK(!out.empty(), "the model has no trainable parameters");
  return out;
}

}  // namespace

ParamGroup no_weight_decay_group(bool embeddings) {
  ParamGroup g;
  g.options.weight_decay = 0.0;
  g.match = [embeddings](const std::string& name, const at::Tensor& p) {
    if (p.dim() <= 1) return true;  // biases, LayerNorm weights
    if (!embeddings) return false;
    auto ends_with = [&](const std::string& suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    return ends_with("tok.weight") || ends_with("pos.weight") || name.find("embed") != std::string::npos;
  };
  return g;
}

Engine::Engine(parallel::ParallelGroups groups, std::shared_ptr<torch::nn::Module> root,
               nn::LayerStack stack, torch::nn::AnyModule any, config::Config config, StagePlan plan,
               std::vector<ParamGroup> param_groups)
    : groups_(std::move(groups)),
      param_groups_(std::move(param_groups)),
      root_(std::move(root)),
      stack_(std::move(stack)),
      any_(std::move(any)),
      config_(std::move(config)),
      precision_(precision_of(config_)),
      scaler_(scaler_of(config_)),
      schedule_(config_.scheduler, config_.optimizer.lr,
                config_.optimizer.betas.empty() ? 0.9 : config_.optimizer.betas[0]) {
  check_supported(config_, groups_);
  plan_ = std::move(plan);
  TS_CHECK(plan_.stages == config_.pp, "the engine was built for ", plan_.stages, " pipeline stages but the config has ",
           config_.pp, "; build it with initialize() from a StackSpec");
  TS_CHECK(config_.pipeline.activation_checkpoint_interval == 0 || stack_,
           "pipeline.activation_checkpoint_interval needs a LayerStack model");
  make_checkpoint_comm();
  pipe_schedule_ = pipeline::schedule_kind(config_.pipeline.schedule);
  // Tensor-parallel ranks hold the same replicated activations: their dropout masks must agree,
  // so they share tp rank 0's RNG state (reseed them alike afterwards, e.g. by data-parallel rank).
  if (groups_.tp && groups_.tp->size() > 1) {
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state().contiguous();
    }
    groups_.tp->broadcast(state, 0);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  // Tied weights start from their first stage's value (before the optimizer copies them).
  if (stack_) {
    const auto named = stack_->named_parameters(/*recurse=*/true);
    for (const auto& t : plan_.ties) {
      const at::Tensor* p = named.find(t.param);
      TS_CHECK(p, "tied parameter '", t.param, "' is not in this stage's layers");
      c10::NoGradGuard g;
      at::Tensor v = p->detach().contiguous();
      t.comm->broadcast(v, 0);
      if (!v.is_same(*p)) p->detach().copy_(v);
      tied_params_.push_back(*p);
    }
  }
  zero::ZeroOptions zo;
  zo.stage(zero::stage_of(config_.zero.stage))
      .grad_accum_dtype(config_.grad_accum_dtype == "bf16" ? at::kBFloat16 : at::kFloat)
      .reduce_bucket_numel(config_.zero.reduce_bucket_size)
      .overlap_comm(config_.zero.overlap_comm)
      .reduce_scatter(config_.zero.reduce_scatter)
      .sub_group_numel(config_.zero.sub_group_size)
      .prefetch_bucket_numel(config_.zero.prefetch_bucket_size)
      .param_persistence_threshold(config_.zero.param_persistence_threshold)
      .max_live_parameters(config_.zero.max_live_parameters)
      .precision(precision_)
      .communication_dtype(comm_dtype_of(config_))
      .gradient_predivide_factor(config_.gradient_predivide_factor)
      .prescale_gradients(config_.prescale_gradients)
      .norm_group(plan_.stages > 1 || config_.tp > 1 ? groups_.mp : nullptr);
  // Pipeline stages reduce after the tied weights' gradients are summed (ReduceTiedGrads), so
  // buckets cannot start during the boundary backward.
  if (plan_.stages > 1) zo.overlap_comm(false);
  const int layers = stack_ ? static_cast<int>(stack_->size()) : 0;
  zero_ = zero::make_zero_optimizer(collect_params(root_, stack_, plan_, groups_.tp->rank(), param_groups_), layers,
                                    groups_.dp, zo, optimizer_of(config_, param_groups_));
  layer_hooks_ = zero_->layer_hooks();
  // Activation checkpointing: segments of `interval` layers keep only their input.
  if (const int k = config_.pipeline.activation_checkpoint_interval; k > 0) {
    for (size_t b = 0; b < stack_->size(); b += static_cast<size_t>(k)) {
      const size_t e = std::min(stack_->size(), b + static_cast<size_t>(k));
      segments_.push_back([this, b, e](const at::Tensor& x) { return run_layers(x, b, e, at::GradMode::is_enabled()); });
    }
  }
  if (groups_.world->rank() == 0 && (config_.tensorboard.enabled || config_.csv_monitor.enabled)) {
    monitor::MonitorConfig mc;
    mc.tensorboard = {config_.tensorboard.enabled, config_.tensorboard.output_path, config_.tensorboard.job_name};
    mc.csv = {config_.csv_monitor.enabled, config_.csv_monitor.output_path, config_.csv_monitor.job_name};
    monitor_ = std::make_unique<monitor::Monitor>(mc);
  }
  root_->train();
  log::debug("engine: ", zero_->num_params(), " parameters, ZeRO stage ", config_.zero.stage, ", ",
             precision::precision_name(precision_), ", dp ", groups_.dp->size());
}

Engine::~Engine() = default;

at::ScalarType Engine::compute_dtype() const {
  // fp16 runs its math in fp32 on fp16-rounded values: see Note [fp16 on CPU].
  return precision_ == precision::Precision::kBF16 ? at::kBFloat16 : at::kFloat;
}

at::Tensor Engine::run(const at::Tensor& input) {
  at::Tensor x = input;
  if (x.is_floating_point() && x.scalar_type() != compute_dtype()) x = x.to(compute_dtype());
  // fp16.auto_cast: DeepSpeed casts floating inputs to fp16; here fp16 values in fp32 tensors
  // (Note [fp16 on CPU]). Without it inputs keep their precision, as in DeepSpeed.
  if (precision_ == precision::Precision::kFP16 && config_.fp16.auto_cast && x.is_floating_point()) {
    x = x.to(at::kHalf).to(compute_dtype());
  }
  if (!stack_) return any_.forward(x);
  const bool grad = at::GradMode::is_enabled() && root_->is_training();
  if (segments_.empty() || !grad) return run_layers(x, 0, stack_->size(), grad);
  for (const auto& segment : segments_) x = nn::checkpoint(segment, x);
  return x;
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
  at::Tensor loss = stack_->loss(run(input), target);
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
}

void Engine::write_monitor_events(std::optional<double> train_loss) {
  // DeepSpeed's engine: at each optimizer step, on rank 0, the step counted in samples; lr is
  // the schedule's after the step; loss_scale only for fp16. The loss is rank 0's mean over
  // the window's micro-batches (pipeline: the mean over data-parallel ranks, as DeepSpeed's
  // pipeline engine reports it).
  const int64_t samples = global_steps_ * config_.train_batch_size;
  std::vector<monitor::Event> events;
  if (train_loss) events.push_back({"Train/Samples/train_loss", *train_loss, samples});
  events.push_back({"Train/Samples/lr", schedule_.lr(), samples});
  if (precision_ == precision::Precision::kFP16) events.push_back({"Train/Samples/loss_scale", scaler_.scale(), samples});
  monitor_->write_events(events);
}

void Engine::zero_grad() { zero_->zero_grad(); }

nlohmann::json Engine::export_state(std::vector<std::pair<std::string, at::Tensor>>& tensors) const {
  tensors = zero_->export_partition();
  return export_counters();
}

nlohmann::json Engine::export_counters() const {
  return {{"global_steps", global_steps_}, {"micro_steps", micro_steps_}, {"skipped_steps", skipped_steps_},
          {"optimizer_steps", zero_->steps_taken()}, {"grad_norm", grad_norm_},
          {"loss_scaler", scaler_.state()}, {"lr_schedule", schedule_.state()},
          {"zero_stage", config_.zero.stage}, {"dp", groups_.dp->size()}, {"dp_rank", groups_.dp->rank()}};
}

void Engine::import_state(const nlohmann::json& s, std::vector<std::pair<std::string, at::Tensor>> tensors) {
  TS_CHECK(s.contains("global_steps") && s.contains("loss_scaler") && s.contains("lr_schedule"),
           "engine state is missing global_steps, loss_scaler or lr_schedule");
  zero_->import_partition(std::move(tensors), s.at("optimizer_steps").get<int64_t>());
  global_steps_ = s.at("global_steps").get<int64_t>();
  micro_steps_ = s.at("micro_steps").get<int64_t>();
  skipped_steps_ = s.at("skipped_steps").get<int64_t>();
  grad_norm_ = s.value("grad_norm", 0.0);
  scaler_.load_state(s.at("loss_scaler"));
  schedule_.load_state(s.at("lr_schedule"));
}

void Engine::train() { root_->train(true); }
void Engine::eval() { root_->train(false); }

EngineTimings Engine::timings() const {
  EngineTimings t;
  t.forward_s = forward_s_;
  t.backward_s = backward_s_;
  t.reduce_wait_s = zero_->timings().reduce_wait_s;
  t.optimizer_s = zero_->timings().optimizer_s;
  t.allgather_s = zero_->timings().allgather_s;
  t.buckets_launched_in_backward = zero_->timings().buckets_launched_in_backward;
  t.buckets_launched_after = zero_->timings().buckets_launched_after;
  t.optimizer_sub_groups = zero_->timings().optimizer_sub_groups;
  t.pipeline_busy_s = pipe_busy_s_;
  t.pipeline_schedule_s = pipe_schedule_s_;
  return t;
}

parallel::ParallelGroups make_groups(const Runtime& runtime, const config::Config& config) {
  comm::CommOptions co;
  co.timeout(std::chrono::milliseconds(static_cast<int64_t>(config.torchspeed.comm_timeout_s * 1000)))
      .chunk_bytes(config.torchspeed.comm_chunk_bytes);
  auto world = comm::Communicator::world(co);
  parallel::ProcessGrid grid(runtime.world_size, config.tp, config.pp);
  return parallel::make_parallel_groups(world, grid);
}

std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, nn::LayerStack model,
                                   const config::Config& config, const std::vector<ParamGroup>& param_groups) {
  std::shared_ptr<torch::nn::Module> root = model.ptr();
  return std::make_unique<Engine>(groups, root, model, torch::nn::AnyModule(), config, StagePlan{}, param_groups);
}

std::unique_ptr<Engine> initialize(const Runtime& runtime, nn::LayerStack model,
                                   const config::Config& config, const std::vector<ParamGroup>& param_groups) {
  return initialize(make_groups(runtime, config), std::move(model), config, param_groups);
}

std::unique_ptr<Engine> initialize(const parallel::ParallelGroups& groups, const nn::StackSpec& spec,
                                   const config::Config& config, const std::vector<ParamGroup>& param_groups) {
  const int stages = groups.grid.pp();
  if (stages == 1) return initialize(groups, nn::build(spec), config, param_groups);
  const auto bounds = pipeline::partition(spec, stages, config.pipeline.partition_method);
  const int stage = groups.coord.pp;
  StagePlan plan;
  plan.stage = stage;
  plan.stages = stages;
  // Tied weights held by several stages: one communicator per tie key over those stages (of
  // this rank's pipeline); every rank takes part in every split, in key order.
  std::map<std::string, std::vector<std::pair<int, std::string>>> holders;  // key -> (stage, param)
  for (int s = 0; s < stages; ++s)
    for (size_t i = bounds[static_cast<size_t>(s)]; i < bounds[static_cast<size_t>(s) + 1]; ++i)
      for (const auto& [param, key] : spec.layers[i].ties) holders[key].emplace_back(s, spec.layers[i].name + "." + param);
  for (const auto& [key, list] : holders) {
    std::vector<int> on;
    for (const auto& h : list)
      if (on.empty() || on.back() != h.first) on.push_back(h.first);
    if (on.size() < 2) continue;
    const bool member = std::find(on.begin(), on.end(), stage) != on.end();
    const int color = member ? groups.pp->world_ranks().front() : groups.grid.world_size() + groups.rank;
    auto c = groups.world->split(color, stage, "tied:" + key);
    if (!member) continue;
    for (const auto& [s, param] : list)
      if (s == stage) plan.ties.push_back({param, c, s == on.front()});
  }
  nn::LayerStack local = nn::build(spec, bounds[static_cast<size_t>(stage)], bounds[static_cast<size_t>(stage) + 1]);
  log::debug("pipeline stage ", stage, " of ", stages, ": layers ", bounds[static_cast<size_t>(stage)], "..",
             bounds[static_cast<size_t>(stage) + 1] - 1);
  std::shared_ptr<torch::nn::Module> root = local.ptr();
  return std::make_unique<Engine>(groups, root, local, torch::nn::AnyModule(), config, std::move(plan), param_groups);
}

std::unique_ptr<Engine> initialize(const Runtime& runtime, const nn::StackSpec& spec, const config::Config& config,
                                   const std::vector<ParamGroup>& param_groups) {
  return initialize(make_groups(runtime, config), spec, config, param_groups);
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
