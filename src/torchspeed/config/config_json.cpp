// Config::to_json: the resolved config as DeepSpeed JSON (what `torchspeed config` prints and a
// checkpoint records).
#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/json_reader.h"

namespace torchspeed::config {

nlohmann::json Config::to_json() const {
  using nlohmann::json;
  auto offload = [](const OffloadConfig& o, bool optimizer) {
    json j{{"device", offload_device_name(o.device)}, {"nvme_path", o.nvme_path}, {"pin_memory", o.pin_memory},
           {"buffer_count", o.buffer_count}};
    if (optimizer) {
      j["ratio"] = o.ratio;
      j["pipeline_read"] = o.pipeline_read;
      j["pipeline_write"] = o.pipeline_write;
      j["fast_init"] = o.fast_init;
    } else {
      j["buffer_size"] = o.buffer_size;
      j["max_in_cpu"] = o.max_in_cpu;
    }
    return j;
  };
  auto monitor = [](const MonitorConfig& m) {
    return json{{"enabled", m.enabled}, {"output_path", m.output_path}, {"job_name", m.job_name}};
  };
  json j;
  j["train_batch_size"] = train_batch_size;
  j["train_micro_batch_size_per_gpu"] = train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  j["steps_per_print"] = steps_per_print;
  j["wall_clock_breakdown"] = wall_clock_breakdown;
  j["prescale_gradients"] = prescale_gradients;
  j["gradient_predivide_factor"] = gradient_predivide_factor;
  j["gradient_clipping"] = gradient_clipping;
  j["communication_data_type"] = communication_data_type.empty() ? json(nullptr) : json(communication_data_type);
  j["data_types"] = {{"grad_accum_dtype", grad_accum_dtype.empty() ? "fp32" : grad_accum_dtype}};
  j["seed"] = seed;
  j["memory_breakdown"] = memory_breakdown;
  j["fp16"] = {{"enabled", fp16.enabled}, {"auto_cast", fp16.auto_cast},
               {"loss_scale", fp16.loss_scale}, {"initial_scale_power", fp16.initial_scale_power},
               {"loss_scale_window", fp16.loss_scale_window}, {"hysteresis", fp16.hysteresis},
               {"consecutive_hysteresis", fp16.consecutive_hysteresis},
               {"min_loss_scale", fp16.min_loss_scale}};
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
  const ZeroConfig& z = zero;
  j["zero_optimization"] = {
      {"stage", z.stage}, {"contiguous_gradients", z.contiguous_gradients},
      {"reduce_scatter", z.reduce_scatter}, {"reduce_bucket_size", z.reduce_bucket_size},
      {"zero_quantized_gradients", z.quantized_gradients},
      {"zero_hpz_partition_size", z.hpz_partition_size},
      {"zero_quantized_weights", z.quantized_weights},
      {"allgather_partitions", z.allgather_partitions},
      {"allgather_bucket_size", z.allgather_bucket_size}, {"overlap_comm", z.overlap_comm},
      {"load_from_fp32_weights", z.load_from_fp32_weights},
      {"elastic_checkpoint", z.elastic_checkpoint},
      {"offload_optimizer", offload(z.offload_optimizer, true)},
      {"offload_param", offload(z.offload_param, false)}, {"sub_group_size", z.sub_group_size},
      {"stage3_prefetch_bucket_size", z.prefetch_bucket_size},
      {"stage3_param_persistence_threshold", z.param_persistence_threshold},
      {"stage3_model_persistence_threshold", z.model_persistence_threshold},
      {"stage3_max_live_parameters", z.max_live_parameters},
      {"stage3_max_reuse_distance", z.max_reuse_distance},
      {"stage3_gather_16bit_weights_on_model_save", z.gather_16bit_weights_on_model_save},
      {"round_robin_gradients", z.round_robin_gradients},
      {"ignore_unused_parameters", z.ignore_unused_parameters}};
  const auto& a = activation_checkpointing;
  j["activation_checkpointing"] = {
      {"partition_activations", a.partition_activations},
      {"contiguous_memory_optimization", a.contiguous_memory_optimization},
      {"cpu_checkpointing", a.cpu_checkpointing},
      {"number_checkpoints", a.number_checkpoints ? json(*a.number_checkpoints) : json(nullptr)},
      {"synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary},
      {"profile", a.profile}};
  j["pipeline"] = {{"stages", pipeline.stages}, {"partition_method", pipeline.partition_method},
                   {"activation_checkpoint_interval", pipeline.activation_checkpoint_interval},
                   {"schedule", pipeline.schedule}};
  j["tensor_parallel"] = {{"tp_size", tensor_parallel.tp_size}};
  j["aio"] = {{"block_size", aio.block_size}, {"queue_depth", aio.queue_depth},
              {"intra_op_parallelism", aio.intra_op_parallelism}, {"single_submit", aio.single_submit},
              {"overlap_events", aio.overlap_events}};
  j["checkpoint"] = {{"tag_validation", checkpoint.tag_validation},
                     {"load_universal", checkpoint.load_universal},
                     {"use_node_local_storage", checkpoint.use_node_local_storage},
                     {"keep_last", checkpoint.keep_last}};
  j["csv_monitor"] = monitor(csv_monitor);
  j["tensorboard"] = monitor(tensorboard);
  j["torchspeed"] = {{"unknown_keys", torchspeed.unknown_keys},
                     {"intra_op_threads", torchspeed.intra_op_threads},
                     {"comm_timeout_s", torchspeed.comm_timeout_s},
                     {"comm_chunk_bytes", torchspeed.comm_chunk_bytes},
                     {"tiled_mlp", torchspeed.tiled_mlp},
                     {"tiled_loss", torchspeed.tiled_loss}};
  j["sequence_parallel_size"] = sp;
  for (const auto& [k, v] : sections.items()) j[k] = v;
  j["world"] = {{"world_size", world_size}, {"tp", tp}, {"pp", pp}, {"dp", dp}, {"sp", sp}};
  return j;
}

}  // namespace torchspeed::config
