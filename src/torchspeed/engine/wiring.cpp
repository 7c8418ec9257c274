// Config -> component options: see wiring.h.
#include "torchspeed/engine/wiring.h"

#include "torchspeed/offload/optimizer_swapper.h"
#include "torchspeed/offload/param_swapper.h"
#include "torchspeed/base/error.h"

namespace torchspeed::wiring {

precision::Precision precision_of(const config::Config& c) {
  if (c.bf16.enabled) return precision::Precision::kBF16;
  if (c.fp16.enabled) return precision::Precision::kFP16;
  return precision::Precision::kFP32;
}

precision::LossScaler loss_scaler_of(const config::Config& c) {
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

zero::OptimizerSpec optimizer_spec_of(const config::Config& c, const std::vector<zero::ParamGroup>& groups) {
  TS_CHECK(c.optimizer.type != optim::OptimizerType::kNone,
           "the config has no \"optimizer\" section; torchspeed needs one (type Adam, AdamW, SGD, Lamb, OneBitAdam, ZeroOneAdam or OneBitLamb)");
  zero::OptimizerSpec s;
  s.type = c.optimizer.type;
  s.adam.lr = c.optimizer.lr;
  s.adam.beta1 = c.optimizer.betas.at(0);
  s.adam.beta2 = c.optimizer.betas.at(1);
  s.adam.eps = c.optimizer.eps;
  s.adam.weight_decay = c.optimizer.weight_decay;
  s.adam.bias_correction = c.optimizer.bias_correction;
  s.adam.adam_w_mode = c.optimizer.type == optim::OptimizerType::kAdamW || c.optimizer.adam_w_mode;
  s.sgd.lr = c.optimizer.lr;
  s.sgd.momentum = c.optimizer.momentum;
  s.sgd.dampening = c.optimizer.dampening;
  s.sgd.weight_decay = c.optimizer.weight_decay;
  s.sgd.nesterov = c.optimizer.nesterov;
  s.lamb.lr = c.optimizer.lr;
  s.lamb.beta1 = c.optimizer.betas.at(0);
  s.lamb.beta2 = c.optimizer.betas.at(1);
  s.lamb.eps = c.optimizer.eps;
  s.lamb.weight_decay = c.optimizer.weight_decay;
  s.lamb.bias_correction = c.optimizer.bias_correction;
  s.lamb.max_coeff = c.optimizer.max_coeff;
  s.lamb.min_coeff = c.optimizer.min_coeff;
  s.lamb.eps_inside_sqrt = c.optimizer.eps_inside_sqrt;
  s.freeze_step = c.optimizer.freeze_step;
  if (c.optimizer.type == optim::OptimizerType::kOneBitAdam || c.optimizer.type == optim::OptimizerType::kZeroOneAdam) {
    // DeepSpeed's OnebitAdam and ZeroOneAdam: no bias correction, decay in the update.
    s.adam.bias_correction = false;
    s.adam.adam_w_mode = true;
  }
  if (c.optimizer.type == optim::OptimizerType::kOneBitLamb) {  // its warm-up is Lamb without bias correction, eps outside
    s.lamb.bias_correction = false;
    s.lamb.eps_inside_sqrt = false;
  }
  s.zero_one = {c.optimizer.var_freeze_step, c.optimizer.var_update_scaler, c.optimizer.local_step_scaler,
                c.optimizer.local_step_clipper};
  s.onebit_lamb = {c.optimizer.coeff_beta, c.optimizer.factor_max, c.optimizer.factor_min, c.optimizer.factor_threshold};
  for (const auto& g : groups) s.groups.push_back(g.options);
  return s;
}

zero::ZeroOptions zero_options_of(const config::Config& c) {
  at::ScalarType comm_dtype = at::ScalarType::Undefined;  // "": the compute dtype
  if (c.communication_data_type == "fp32") comm_dtype = at::kFloat;
  if (c.communication_data_type == "bf16") comm_dtype = at::kBFloat16;
  if (c.communication_data_type == "fp16") comm_dtype = at::kHalf;
  zero::ZeroOptions zo;
  zo.stage(zero::stage_of(c.zero.stage))
      .grad_accum_dtype(c.grad_accum_dtype == "bf16" ? at::kBFloat16 : at::kFloat)
      .reduce_bucket_numel(c.zero.reduce_bucket_size)
      .overlap_comm(c.zero.overlap_comm)
      .reduce_scatter(c.zero.reduce_scatter)
      .quantized_gradients(c.zero.quantized_gradients)
      .hpz_partition_size(c.zero.hpz_partition_size)
      .quantized_weights(c.zero.quantized_weights)
      .sub_group_numel(c.zero.sub_group_size)
      .prefetch_bucket_numel(c.zero.prefetch_bucket_size)
      .param_persistence_threshold(c.zero.param_persistence_threshold)
      .max_live_parameters(c.zero.max_live_parameters)
      .precision(precision_of(c))
      .communication_dtype(comm_dtype)
      .gradient_predivide_factor(c.gradient_predivide_factor)
      .prescale_gradients(c.prescale_gradients);
  return zo;
}

offload::AioOptions aio_options_of(const config::Config& c) {
  offload::AioOptions o;
  o.block_size(c.aio.block_size)
      .queue_depth(static_cast<int>(c.aio.queue_depth * c.aio.intra_op_parallelism))  // every thread's requests
      .single_submit(c.aio.single_submit)
      .overlap_events(c.aio.overlap_events);
  return o;
}

zero::PartitionStorePtr make_optimizer_store(const config::Config& c, int global_rank) {
  const auto& o = c.zero.offload_optimizer;
  if (o.device != config::OffloadDevice::kNvme) return nullptr;
  offload::SwapperOptions so;
  so.path(concat(o.nvme_path, "/torchspeed-optimizer-rank", global_rank, ".swap"))
      .buffer_count(o.buffer_count)
      .group_numel(c.zero.sub_group_size)
      .pipeline_read(o.pipeline_read)
      .pipeline_write(o.pipeline_write)
      .aio(aio_options_of(c));
  return std::make_shared<offload::OptimizerSwapper>(so);
}

zero::ShardStorePtr make_param_store(const config::Config& c, int global_rank, int64_t element_size) {
  const auto& o = c.zero.offload_param;
  if (o.device != config::OffloadDevice::kNvme) return nullptr;
  offload::ParamSwapperOptions po;
  po.path(concat(o.nvme_path, "/torchspeed-params-rank", global_rank, ".swap"))
      .buffer_count(o.buffer_count)
      .buffer_bytes(o.buffer_size * element_size)
      .max_in_cpu_bytes(o.max_in_cpu * element_size)
      .aio(aio_options_of(c));
  return std::make_shared<offload::ParamSwapper>(po);
}

}  // namespace torchspeed::wiring
