// Config::to_json: the resolved config as DeepSpeed JSON (what `torchspeed config` prints and a
// checkpoint records).
#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/config/keys.h"

namespace torchspeed::config {

nlohmann::json Config::to_json() const {
  using nlohmann::json;
  // The sections of declared keys come from their tables (Note [Config keys declared once]).
  auto offload = [](const OffloadConfig& o, bool optimizer) {
    json j = keys_to_json(o, detail::offload_keys(optimizer));
    j["device"] = offload_device_name(o.device);
    return j;
  };
  json j = keys_to_json(*this, detail::root_keys());
  j["train_batch_size"] = train_batch_size;
  j["train_micro_batch_size_per_gpu"] = train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  j["communication_data_type"] = communication_data_type.empty() ? json(nullptr) : json(communication_data_type);
  j["data_types"] = {{"grad_accum_dtype", grad_accum_dtype.empty() ? "fp32" : grad_accum_dtype}};
  j["fp16"] = keys_to_json(fp16, detail::fp16_keys());
  j["bf16"] = {{"enabled", bf16.enabled}};
  if (optimizer.type != optim::OptimizerType::kNone) {
    json p = {{"lr", optimizer.lr}, {"weight_decay", optimizer.weight_decay}};
    if (optimizer.type == optim::OptimizerType::kSGD) {
      p["momentum"] = optimizer.momentum;
      p["dampening"] = optimizer.dampening;
      p["nesterov"] = optimizer.nesterov;
    } else {
      p["betas"] = optimizer.betas;
      p["eps"] = optimizer.eps;
      p["bias_correction"] = optimizer.bias_correction;
      if (optimizer.type == optim::OptimizerType::kOneBitAdam) {
        p["freeze_step"] = optimizer.freeze_step;
      } else if (optimizer.type == optim::OptimizerType::kZeroOneAdam) {
        p["var_freeze_step"] = optimizer.var_freeze_step;
        p["var_update_scaler"] = optimizer.var_update_scaler;
        p["local_step_scaler"] = optimizer.local_step_scaler;
        p["local_step_clipper"] = optimizer.local_step_clipper;
      } else if (optimizer.type == optim::OptimizerType::kOneBitLamb) {
        p["freeze_step"] = optimizer.freeze_step;
        p["max_coeff"] = optimizer.max_coeff;
        p["min_coeff"] = optimizer.min_coeff;
        p["coeff_beta"] = optimizer.coeff_beta;
        p["factor_max"] = optimizer.factor_max;
        p["factor_min"] = optimizer.factor_min;
        p["factor_threshold"] = optimizer.factor_threshold;
      } else if (optimizer.type == optim::OptimizerType::kLamb) {
        p["max_coeff"] = optimizer.max_coeff;
        p["min_coeff"] = optimizer.min_coeff;
        p["eps_inside_sqrt"] = optimizer.eps_inside_sqrt;
      } else {
        p["adam_w_mode"] = optimizer.adam_w_mode;
      }
    }
    j["optimizer"] = {{"type", optimizer.name()}, {"params", p}};
  }
  if (!scheduler.type.empty()) {
    json p(scheduler.params);
    for (const char* flag : {"cycle_momentum", "lr_range_test_staircase"}) {
      if (p.contains(flag)) p[flag] = p[flag].get<double>() != 0.0;
    }
    if (scheduler.type.rfind("Warmup", 0) == 0) p["warmup_type"] = scheduler.warmup_type;
    j["scheduler"] = {{"type", scheduler.type}, {"params", p}};
  }
  j["zero_optimization"] = keys_to_json(zero, detail::zero_keys());
  j["zero_optimization"]["offload_optimizer"] = offload(zero.offload_optimizer, true);
  j["zero_optimization"]["offload_param"] = offload(zero.offload_param, false);
  const auto& a = activation_checkpointing;
  j["activation_checkpointing"] = keys_to_json(a, detail::activation_checkpointing_keys());
  j["activation_checkpointing"]["number_checkpoints"] = a.number_checkpoints ? json(*a.number_checkpoints) : json(nullptr);
  j["pipeline"] = keys_to_json(pipeline, detail::pipeline_keys());
  j["tensor_parallel"] = {{"tp_size", tensor_parallel.tp_size}};
  j["aio"] = keys_to_json(aio, detail::aio_keys());
  j["checkpoint"] = keys_to_json(checkpoint, detail::checkpoint_keys());
  j["csv_monitor"] = keys_to_json(csv_monitor, detail::monitor_keys());
  j["tensorboard"] = keys_to_json(tensorboard, detail::monitor_keys());
  j["torchspeed"] = keys_to_json(torchspeed, detail::torchspeed_keys());
  for (const auto& [k, v] : sections.items()) j[k] = v;
  j["world"] = {{"world_size", world_size}, {"tp", tp}, {"pp", pp}, {"dp", dp}, {"sp", sp}};
  return j;
}

std::string key_reference() {
  using detail::offload_defaults;
  return keys_reference("", detail::root_keys()) + keys_reference("fp16", detail::fp16_keys()) +
         keys_reference("zero_optimization", detail::zero_keys()) +
         keys_reference("zero_optimization.offload_optimizer", detail::offload_keys(true), offload_defaults(true)) +
         keys_reference("zero_optimization.offload_param", detail::offload_keys(false), offload_defaults(false)) +
         keys_reference("aio", detail::aio_keys()) +
         keys_reference("activation_checkpointing", detail::activation_checkpointing_keys()) +
         keys_reference("pipeline", detail::pipeline_keys()) + keys_reference("checkpoint", detail::checkpoint_keys()) +
         keys_reference("csv_monitor, tensorboard", detail::monitor_keys()) +
         keys_reference("torchspeed", detail::torchspeed_keys());
}

}  // namespace torchspeed::config
