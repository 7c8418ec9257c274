// DeepSpeed config parsing: each section is read by one function with DeepSpeed's defaults
// (deepspeed/runtime/config.py, zero/config.py, fp16 loss scaler, lr_schedules.py), then batch
// sizes are resolved with DeepSpeed's rules against the world shape.
#include "torchspeed/config/config.h"

#include <functional>
#include <set>
#include <fstream>
#include <sstream>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/config/detail/sections.h"

namespace torchspeed::config {
namespace {

constexpr int64_t kMax32 = INT32_MAX;

// DeepSpeed features torchspeed does not have. A section that is absent or disabled is accepted
// with a warning; one that is enabled is an error naming it.
const std::vector<std::string> kForeignSections = {
    "amp", "flops_profiler", "comms_logger", "elasticity",
    "sparse_attention", "wandb", "comet",
    "eigenvalue", "progressive_layer_drop", "curriculum_learning", "nebula",
    "weight_quantization", "hybrid_engine", "torch_autocast"};
// DeepSpeed flags that change nothing in torchspeed (warned, not refused).
const std::vector<std::string> kIgnoredFlags = {
    "disable_allgather", "dump_state", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "dataloader_drop_last", "sparse_gradients", "fp32_allreduce",
    "gradient_accumulation_dtype", "use_data_before_expert_parallel_", "graph_harvesting",
    "steps_per_print_all_ranks", "cuda_visible_devices"};
// Sections validated by the components that own them.
const std::vector<std::string> kOwnedSections = {"model", "data", "train", "lora"};

void read_fp16(JsonReader& r, FP16Config& c) {
  c.enabled = r.get_bool("enabled", false);
  c.auto_cast = r.get_bool("auto_cast", false);
  c.loss_scale = r.get_double("loss_scale", 0.0, 0.0);
  c.initial_scale_power = static_cast<int>(r.get_int("initial_scale_power", 16, 0, 64));
  c.loss_scale_window = static_cast<int>(r.get_int("loss_scale_window", 1000, 1, kMax32));
  c.hysteresis = static_cast<int>(r.get_int("hysteresis", 2, 1, kMax32));
  c.consecutive_hysteresis = r.get_bool("consecutive_hysteresis", false);
  c.min_loss_scale = r.get_double("min_loss_scale", 1.0, 0.0);
  r.accept("fp16_master_weights_and_grads");
  if (r.get_bool("fp16_master_weights_and_grads", false)) {
    r.error("fp16_master_weights_and_grads",
            "torchspeed keeps fp32 master weights; this DeepSpeed option is not supported");
  }
  r.finish();
}

void read_optimizer(JsonReader& r, OptimizerConfig& c) {
  // Names as DeepSpeed compares them (lower case): "OnebitAdam" is OneBitAdam.
  c.type = r.get_string("type", "", {"Adam", "AdamW", "SGD", "Lamb", "OneBitAdam", "ZeroOneAdam",
                                     "OneBitLamb", "Adagrad", "MuAdam", "MuAdamW", "MuSGD"});
  if (c.type.empty() && r.has("type") == false) r.error("type", "is required in an optimizer section");
  if (c.type != "" && c.type != "Adam" && c.type != "AdamW" && c.type != "SGD" && c.type != "Lamb" && !c.one_bit()) {
    r.error("type", concat("\"", c.type, "\" is a DeepSpeed optimizer torchspeed does not have; "
                        "use Adam, AdamW, SGD, Lamb, OneBitAdam, ZeroOneAdam or OneBitLamb"));
  }
  auto p = r.child("params");
  if (!p) {
    if (c.type == "SGD") c.lr = 1e-3;
    return r.finish();
  }
  c.lr = p->get_double("lr", 1e-3, 0.0);
  c.weight_decay = p->get_double("weight_decay", 0.0, 0.0);
  if (c.type == "SGD") {
    c.momentum = p->get_double("momentum", 0.0, 0.0);
    c.dampening = p->get_double("dampening", 0.0, 0.0);
    c.nesterov = p->get_bool("nesterov", false);
  } else {
    c.betas = p->get_double_list("betas", {0.9, 0.999}, 2);
    for (double b : c.betas) {
      if (b < 0.0 || b >= 1.0) p->error("betas", concat("each beta must be in [0, 1), got ", b));
    }
    c.eps = p->get_double("eps", 1e-8, 0.0);
    c.bias_correction = p->get_bool("bias_correction", true);
    if (c.one_bit()) {  // deepspeed.runtime.fp16.onebit's OnebitAdam, ZeroOneAdam and OnebitLamb
      const char* name = c.type == "OneBitAdam" ? "1-bit Adam" : c.type == "ZeroOneAdam" ? "0/1 Adam" : "1-bit Lamb";
      if (c.type == "ZeroOneAdam") {
        c.var_freeze_step = p->get_int("var_freeze_step", 100000, 0);
        c.var_update_scaler = p->get_int("var_update_scaler", 16, 1);
        c.local_step_scaler = p->get_int("local_step_scaler", 32678, 1);
        c.local_step_clipper = p->get_int("local_step_clipper", 16, 1);
      } else {
        c.freeze_step = p->get_int("freeze_step", 100000, 0);
      }
      if (c.type == "OneBitLamb") {
        c.max_coeff = p->get_double("max_coeff", 10.0, 0.0);
        c.min_coeff = p->get_double("min_coeff", 0.01, 0.0);
        if (c.min_coeff > c.max_coeff) p->error("min_coeff", concat(c.min_coeff, " is above max_coeff ", c.max_coeff));
        c.coeff_beta = p->get_double("coeff_beta", 0.9, 0.0, 0.999999);
        c.factor_max = p->get_double("factor_max", 4.0, 0.0);
        c.factor_min = p->get_double("factor_min", 0.5, 0.0);
        if (c.factor_min > c.factor_max) p->error("factor_min", concat(c.factor_min, " is above factor_max ", c.factor_max));
        c.factor_threshold = p->get_double("factor_threshold", 0.1, 0.0);
      }
      if (c.bias_correction && p->has("bias_correction")) {
        p->warn("bias_correction", concat(name, " has no bias correction (DeepSpeed ignores this flag too)"));
      }
      c.bias_correction = false;
      if (p->get_bool("eps_inside_sqrt", false)) {
        p->warn("eps_inside_sqrt", concat(name, " adds eps outside the square root (DeepSpeed ignores this flag too)"));
      }
      if (p->get_bool("cuda_aware", false)) p->warn("cuda_aware", "no effect: the buffers are in host memory");
      // Every backend DeepSpeed names runs over torchspeed's MPI communicator.
      p->get_string("comm_backend_name", "nccl", {"nccl", "mpi", "gloo", "compressed", "hccl"});
      if (p->has("max_grad_norm")) {
        p->error("max_grad_norm", "is not an optimizer parameter (as in DeepSpeed); use the top-level gradient_clipping");
      }
    } else if (c.type == "Lamb") {  // deepspeed.ops.lamb.FusedLamb's parameters
      c.max_coeff = p->get_double("max_coeff", 10.0, 0.0);
      c.min_coeff = p->get_double("min_coeff", 0.01, 0.0);
      if (c.min_coeff > c.max_coeff) p->error("min_coeff", concat(c.min_coeff, " is above max_coeff ", c.max_coeff));
      c.eps_inside_sqrt = p->get_bool("eps_inside_sqrt", false);
      if (p->has("max_grad_norm")) {
        p->error("max_grad_norm", "is not an optimizer parameter (as in DeepSpeed); use the top-level gradient_clipping");
      }
    } else {
      c.adam_w_mode = p->get_bool("adam_w_mode", true);
      if (c.type == "AdamW" && !c.adam_w_mode) {
        p->error("adam_w_mode", "AdamW always decouples weight decay; use type Adam for L2 decay");
      }
      p->accept("torch_adam");
      p->accept("fused");
    }
    if (p->get_bool("amsgrad", false)) p->error("amsgrad", "AMSGrad is not supported");
  }
  p->finish();
  r.finish();
}

void read_scheduler(JsonReader& r, SchedulerConfig& c) {
  c.type = r.get_string("type", "", {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                     "LRRangeTest"});
  if (c.type.empty()) {
    if (!r.has("type")) r.error("type", "is required in a scheduler section");
    return r.finish();
  }
  // Name -> default; NaN marks a parameter DeepSpeed requires.
  const double kRequired = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::pair<std::string, double>> spec;
  if (c.type == "WarmupLR" || c.type == "WarmupDecayLR") {
    spec = {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 0.001}, {"warmup_num_steps", 1000}};
    if (c.type == "WarmupDecayLR") spec.push_back({"total_num_steps", kRequired});
  } else if (c.type == "WarmupCosineLR") {
    spec = {{"total_num_steps", kRequired}, {"warmup_min_ratio", 0.0},
            {"warmup_num_steps", 1000}, {"cos_min_ratio", 0.0001}};
  } else if (c.type == "OneCycle") {
    spec = {{"cycle_min_lr", kRequired}, {"cycle_max_lr", kRequired}, {"decay_lr_rate", 0.0},
            {"cycle_first_step_size", 2000}, {"cycle_second_step_size", -1},
            {"cycle_first_stair_count", 0}, {"cycle_second_stair_count", -1},
            {"decay_step_size", 0}, {"cycle_momentum", 1}, {"cycle_min_mom", 0.8},
            {"cycle_max_mom", 0.9}, {"decay_mom_rate", 0.0}};
  } else {  // LRRangeTest
    spec = {{"lr_range_test_min_lr", 0.001}, {"lr_range_test_step_size", 2000},
            {"lr_range_test_step_rate", 1.0}, {"lr_range_test_staircase", 0}};
  }
  auto p = r.child("params");
  if (!p) {
    for (auto& [name, def] : spec) {
      if (std::isnan(def)) r.error("params", concat("needs \"", name, "\" for ", c.type));
      c.params[name] = def;
    }
    return r.finish();
  }
  for (auto& [name, def] : spec) {
    if (name == "cycle_momentum" || name == "lr_range_test_staircase") {
      c.params[name] = p->get_bool(name, def != 0.0) ? 1.0 : 0.0;
      continue;
    }
    auto v = p->get_opt_double(name);
    if (!v && std::isnan(def)) p->error(name, concat("is required for ", c.type));
    c.params[name] = v.value_or(std::isnan(def) ? 0.0 : def);
  }
  if (c.type.rfind("Warmup", 0) == 0) c.warmup_type = p->get_string("warmup_type", "log", {"log", "linear"});
  p->accept("last_batch_iteration");
  if (c.type == "OneCycle") {
    if (c.params["cycle_second_step_size"] < 0) c.params["cycle_second_step_size"] = c.params["cycle_first_step_size"];
    if (c.params["cycle_second_stair_count"] < 0) c.params["cycle_second_stair_count"] = c.params["cycle_first_stair_count"];
  }
  p->finish();
  r.finish();
}

void read_offload(JsonReader& r, OffloadConfig& c, bool optimizer) {
  c.device = r.get_string("device", "none", {"none", "cpu", "nvme"});
  c.nvme_path = r.get_string("nvme_path", "");
  c.pin_memory = r.get_bool("pin_memory", false);
  c.buffer_count = r.get_int("buffer_count", optimizer ? 4 : 5, 1);
  if (c.pin_memory) r.warn("pin_memory", "has no effect without a device: there are no transfers to pin for");
  if (c.device == "cpu") {
    r.warn("device", "\"cpu\": on this CPU-only machine the state already lives in host memory, where it stays "
                     "(nothing is offloaded); \"nvme\" moves it to files under nvme_path");
  }
  if (optimizer) {
    c.ratio = r.get_double("ratio", 1.0, 0.0, 1.0);
    if (c.ratio != 1.0) {
      r.error("ratio", "a partial offload (a share of the step on the device) needs a device; torchspeed offloads "
                       "all of the optimizer state (ratio 1.0)");
    }
    c.pipeline_read = r.get_bool("pipeline_read", false);
    c.pipeline_write = r.get_bool("pipeline_write", false);
    r.deprecated("pipeline", "\"pipeline_read\" and \"pipeline_write\"");
    if (r.get_bool("pipeline", false)) c.pipeline_read = c.pipeline_write = true;
    c.fast_init = r.get_bool("fast_init", false);
    if (c.fast_init) r.warn("fast_init", "has no effect: swap files are always initialised by streaming the "
                                         "initial state through the buffer pool");
    if (c.device == "nvme" && c.buffer_count < 2) {
      r.error("buffer_count", "must be at least 2 with \"nvme\" (one buffer updated while another is read or written)");
    }
  } else {
    c.buffer_size = r.get_int("buffer_size", 100000000, 1);
    c.max_in_cpu = r.get_int("max_in_cpu", 1000000000, 0);
    if (c.device == "nvme" && c.buffer_count < 2) {
      r.error("buffer_count", "must be at least 2 with \"nvme\" (one buffer reading ahead, one for the rest)");
    }
  }
  if (c.device == "nvme" && c.nvme_path.empty()) r.error("nvme_path", "is required when device is \"nvme\"");
  r.finish();
}

void read_aio(JsonReader& r, AioConfig& c) {
  c.block_size = r.get_int("block_size", 1048576, 512);
  if (c.block_size % 512 != 0) r.error("block_size", "must be a multiple of 512 bytes (direct I/O)");
  c.queue_depth = r.get_int("queue_depth", 8, 1, 4096);
  auto a = r.get_opt_int("intra_op_parallelism", 1, 1024);
  auto b = r.get_opt_int("thread_count", 1, 1024);
  // DeepSpeed's aio handle runs intra_op_parallelism threads, each with queue_depth requests in
  // flight; one io_uring ring keeps the same number in flight from one thread (offload/aio.h).
  c.intra_op_parallelism = a ? *a : b ? *b : 1;
  if (c.queue_depth * c.intra_op_parallelism > 4096) {
    r.error(a ? "intra_op_parallelism" : "thread_count",
            concat("queue_depth ", c.queue_depth, " x ", c.intra_op_parallelism, " requests in flight is over 4096"));
  }
  c.single_submit = r.get_bool("single_submit", false);
  c.overlap_events = r.get_bool("overlap_events", true);
  if (r.get_bool("use_gds", false)) r.error("use_gds", "GPUDirect Storage needs a GPU");
  r.finish();
}

// DeepSpeed accepts stage-3 keys with and without the "stage3_" prefix.
int64_t get_stage3_int(JsonReader& r, const std::string& name, int64_t def) {
  auto a = r.get_opt_int("stage3_" + name, 0);
  auto b = r.get_opt_int(name, 0);
  return a ? *a : b ? *b : def;
}

// A DeepSpeed option whose other value torchspeed does not implement: the value it always has
// is accepted; the other is refused with the key's path and why.
void only(JsonReader& r, const std::string& key, bool supported, bool fallback, const std::string& why) {
  if (r.has(key) && r.get_bool(key, fallback) != supported) r.error(key, why);
}
// A DeepSpeed tuning knob with no counterpart here: accepted with a warning saying so when set.
void no_effect(JsonReader& r, const std::string& key, const std::string& why) {
  r.accept(key);  // known: warned here, never reported as unknown
  if (r.has(key)) r.warn(key, concat("has no effect in torchspeed: ", why));
}

void read_autotuning(JsonReader& r, AutotuningConfig& c) {
  c.enabled = r.get_bool("enabled", false);
  c.fast = r.get_bool("fast", true);
  if (!c.fast) {
    r.error("fast", "false (DeepSpeed then also tunes each ZeRO stage's bucket and prefetch sizes) is not supported; "
                    "torchspeed autotune tunes ZeRO stages and micro-batch sizes, DeepSpeed's fast mode");
  }
  c.overwrite = r.get_bool("overwrite", true);
  c.results_dir = r.get_string("results_dir", c.results_dir);
  c.exps_dir = r.get_string("exps_dir", c.exps_dir);
  if (r.has("metric_path") && r.raw("metric_path") && !r.raw("metric_path")->is_null()) c.metric_path = r.get_string("metric_path", "");
  c.start_profile_step = r.get_int("start_profile_step", 3, 1);
  c.end_profile_step = r.get_int("end_profile_step", 5, 1);
  if (c.end_profile_step <= c.start_profile_step) {
    r.error("end_profile_step", concat(c.end_profile_step, " must be after start_profile_step ", c.start_profile_step));
  }
  c.metric = r.get_string("metric", "throughput", {"latency", "throughput", "flops"});
  c.tuner_type = r.get_string("tuner_type", "gridsearch", {"gridsearch", "random", "model_based"});
  if (c.tuner_type == "model_based") {
    r.error("tuner_type", "\"model_based\" (DeepSpeed's XGBoost cost model) is not available; use gridsearch or random");
  }
  c.tuner_early_stopping = r.get_int("tuner_early_stopping", 5, 1);
  c.tuner_num_trials = r.get_int("tuner_num_trials", 50, 1);
  if (r.has("max_train_batch_size") && r.raw("max_train_batch_size") && !r.raw("max_train_batch_size")->is_null()) {
    c.max_train_batch_size = r.get_int("max_train_batch_size", 0, 1);
  }
  c.min_train_batch_size = r.get_int("min_train_batch_size", 1, 1);
  c.min_train_micro_batch_size_per_gpu = r.get_int("min_train_micro_batch_size_per_gpu", 1, 1);
  c.max_train_micro_batch_size_per_gpu = r.get_int("max_train_micro_batch_size_per_gpu", 1024, 1);
  if (c.min_train_micro_batch_size_per_gpu > c.max_train_micro_batch_size_per_gpu) {
    r.error("min_train_micro_batch_size_per_gpu", concat(c.min_train_micro_batch_size_per_gpu,
                                                         " is above max_train_micro_batch_size_per_gpu ",
                                                         c.max_train_micro_batch_size_per_gpu));
  }
  c.num_tuning_micro_batch_sizes = r.get_int("num_tuning_micro_batch_sizes", 3, 1);
  // How DeepSpeed's autotuner passes tuned values to a user's script on its command line;
  // `torchspeed autotune` runs `torchspeed train` and passes them in the experiment's config.
  no_effect(r, "arg_mappings", "torchspeed autotune writes the tuned values into each experiment's config");
  if (r.get_int("mp_size", 1, 1) != 1) {
    r.error("mp_size", "model parallelism is set by tensor_parallel.tp_size and pipeline.stages in torchspeed");
  }
  if (const auto* mi = r.raw("model_info"); mi && mi->is_object() && mi->value("profile", false) == true) {
    r.error("model_info", "profile: true (DeepSpeed's model-information profiling run) is not supported; "
                          "torchspeed knows the model's size from its config");
  }
  // DeepSpeed's tuner estimates memory from them; ours runs each experiment instead.
  no_effect(r, "model_info", "torchspeed autotune measures each experiment instead of estimating from the model's size");
  no_effect(r, "model_info_path", "torchspeed autotune does not profile model information");
  r.finish();
}

void read_zero(JsonReader& r, ZeroConfig& c) {
  c.stage = static_cast<int>(r.get_int("stage", 0, 0, 3));
  c.contiguous_gradients = r.get_bool("contiguous_gradients", true);
  c.reduce_scatter = r.get_bool("reduce_scatter", true);
  c.reduce_bucket_size = r.get_int("reduce_bucket_size", 500000000, 1);
  c.allgather_partitions = r.get_bool("allgather_partitions", true);
  c.allgather_bucket_size = r.get_int("allgather_bucket_size", 500000000, 1);
  c.overlap_comm = r.get_bool("overlap_comm", c.stage == 3);
  c.load_from_fp32_weights = r.get_bool("load_from_fp32_weights", true);
  c.elastic_checkpoint = r.get_bool("elastic_checkpoint", false);
  c.sub_group_size = r.get_int("sub_group_size", 1000000000, 1);
  c.prefetch_bucket_size = get_stage3_int(r, "prefetch_bucket_size", 50000000);
  c.param_persistence_threshold = get_stage3_int(r, "param_persistence_threshold", 100000);
  c.model_persistence_threshold = get_stage3_int(r, "model_persistence_threshold", INT64_MAX);
  c.max_live_parameters = get_stage3_int(r, "max_live_parameters", 1000000000);
  c.max_reuse_distance = get_stage3_int(r, "max_reuse_distance", 1000000000);
  c.gather_16bit_weights_on_model_save =
      r.get_bool("stage3_gather_16bit_weights_on_model_save", false) ||
      r.get_bool("gather_16bit_weights_on_model_save", false) ||
      r.get_bool("stage3_gather_fp16_weights_on_model_save", false);
  c.round_robin_gradients = r.get_bool("round_robin_gradients", false);
  c.ignore_unused_parameters = r.get_bool("ignore_unused_parameters", true);
  // What torchspeed always does (or has no counterpart of), said once per key (docs/config.md
  // lists every key's treatment).
  // Layout and collective choices with the same result either way: false warns.
  if (!c.contiguous_gradients) {
    r.warn("contiguous_gradients", "torchspeed always copies gradients into contiguous buffers (its flat units); "
                                   "false has no effect");
  }
  if (!c.allgather_partitions) {
    r.warn("allgather_partitions", "torchspeed always all-gathers updated partitions (no broadcast variant); "
                                   "false has no effect");
  }
  only(r, "load_from_fp32_weights", true, true,
       "torchspeed always restores parameters from the checkpoint's fp32 masters");
  only(r, "ignore_unused_parameters", true, true,
       "torchspeed reduces zeros for parameters without gradients; false (an error for them) is not available");
  no_effect(r, "allgather_bucket_size", "updated parameters are all-gathered unit by unit (reduce_bucket_size)");
  no_effect(r, "round_robin_gradients", "it spreads gradient copies to a device's host offload; gradients here are already in host memory");
  no_effect(r, "stage3_model_persistence_threshold", "every unit below stage3_param_persistence_threshold stays whole");
  no_effect(r, "model_persistence_threshold", "every unit below stage3_param_persistence_threshold stays whole");
  no_effect(r, "stage3_max_reuse_distance", "stage 3 releases a layer as soon as its forward or backward ends");
  no_effect(r, "max_reuse_distance", "stage 3 releases a layer as soon as its forward or backward ends");
  // ZeRO++ hpZ and qwZ act on stage 3's parameter gathers (DeepSpeed ignores them below stage 3;
  // here they are refused, never accepted and ignored). Whether hpZ's size divides the
  // data-parallel size is checked when the engine knows that size.
  c.hpz_partition_size = static_cast<int>(r.get_int("zero_hpz_partition_size", 1, 1, 1 << 20));
  if (c.hpz_partition_size > 1 && c.stage != 3) {
    r.error("zero_hpz_partition_size", concat("ZeRO++ hierarchical partitioning (hpZ) keeps a secondary copy of stage 3's "
                                              "parameter shards: it needs stage 3, and stage is ", c.stage));
  }
  c.quantized_weights = r.get_bool("zero_quantized_weights", false);
  if (c.quantized_weights && c.stage != 3) {
    r.error("zero_quantized_weights", concat("ZeRO++ quantized weights (qwZ) quantize stage 3's parameter all-gather: they "
                                             "need stage 3, and stage is ", c.stage));
  }
  // qgZ: DeepSpeed applies it at stage 3; the same reduce-scatter serves stage 2 here.
  c.quantized_gradients = r.get_bool("zero_quantized_gradients", false);
  if (c.quantized_gradients && c.stage < 2) {
    r.error("zero_quantized_gradients", concat("ZeRO++ quantized gradients (qgZ) quantize the gradients' reduce-scatter: they need "
                                               "stage 2 or 3, and stage is ", c.stage));
  }
  if (c.quantized_gradients && !c.reduce_scatter) {
    r.error("zero_quantized_gradients", "ZeRO++ quantized gradients (qgZ) replace the reduce-scatter, and reduce_scatter is false");
  }
  only(r, "zero_quantized_nontrainable_weights", false, false,
       "ZeRO++ quantized non-trainable weights are not available in torchspeed yet");
  if (r.get_int("mics_shard_size", -1) > 0) {
    r.error("mics_shard_size", "MiCS (sharding within sub-groups) is not available in torchspeed");
  }
  only(r, "mics_hierarchical_params_gather", false, false, "MiCS is not available in torchspeed");
  // Implementation choices of DeepSpeed's with no counterpart here (same results either way).
  no_effect(r, "legacy_stage1", "torchspeed has one stage-1 implementation");
  no_effect(r, "use_multi_rank_bucket_allreduce", "buckets are reduced by the communicator's own algorithm");
  no_effect(r, "memory_efficient_linear", "torchspeed's linear layers keep no extra copies to save");
  no_effect(r, "pipeline_loading_checkpoint", "checkpoints load from the sharded files as they are");
  no_effect(r, "override_module_apply", "stage 3 gathers layers as the stack runs them, not through module.apply");
  no_effect(r, "log_trace_cache_warnings", "stage 3 keeps no trace cache");
  if (auto o = r.child("offload_optimizer")) read_offload(*o, c.offload_optimizer, true);
  if (auto o = r.child("offload_param")) read_offload(*o, c.offload_param, false);
  // Deprecated spellings that real configs still carry.
  r.deprecated("cpu_offload", "\"offload_optimizer\": {\"device\": \"cpu\"}");
  if (r.get_bool("cpu_offload", false)) c.offload_optimizer.device = "cpu";
  r.deprecated("cpu_offload_param", "\"offload_param\": {\"device\": \"cpu\"}");
  if (r.get_bool("cpu_offload_param", false)) c.offload_param.device = "cpu";
  r.deprecated("cpu_offload_use_pin_memory", "\"pin_memory\" in the offload sections");
  if (r.get_bool("cpu_offload_use_pin_memory", false)) {
    c.offload_optimizer.pin_memory = c.offload_param.pin_memory = true;
  }
  if (c.offload_param.enabled() && c.stage != 3) {  // DeepSpeed reads it at stage 3 only
    r.warn("offload_param", concat("ignored at ZeRO stage ", c.stage, ", as DeepSpeed ignores it: only stage 3 "
                                   "partitions (and offloads) parameters"));
    c.offload_param = OffloadConfig();
  }
  if (r.has("zenflow")) {
    r.error("zenflow", "ZenFlow (stale-gradient offloaded updates) is not available in torchspeed; remove the section");
  }
  if (c.offload_optimizer.enabled() && c.stage == 0) {
    r.error("offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3");
  }
  r.finish();
}

// DeepSpeed's activation_checkpointing section configures how deepspeed.checkpointing keeps
// a checkpointed segment's input. torchspeed keeps it as a plain tensor in CPU memory
// (nn/checkpoint.h; pipeline.activation_checkpoint_interval chooses the segments).
void read_activation_checkpointing(JsonReader& r, ActivationCheckpointingConfig& c) {
  c.partition_activations = r.get_bool("partition_activations", false);
  // Memory-saving variants with the same gradients: warned, not refused (real Megatron
  // configs set them).
  if (c.partition_activations) {
    r.warn("partition_activations", "not available in torchspeed: each tensor-parallel rank keeps whole "
                                    "checkpointed activations (same gradients, more memory)");
  }
  c.contiguous_memory_optimization = r.get_bool("contiguous_memory_optimization", false);
  if (c.contiguous_memory_optimization) {
    r.warn("contiguous_memory_optimization", "not available in torchspeed: checkpointed activations are "
                                             "separate tensors (same gradients)");
  }
  // Checkpoints already live in CPU memory: cpu_checkpointing (which DeepSpeed applies to
  // partitioned activations) holds either way.
  c.cpu_checkpointing = r.get_bool("cpu_checkpointing", false);
  c.number_checkpoints = r.get_opt_int("number_checkpoints", 1);
  if (c.number_checkpoints) {
    r.warn("number_checkpoints", "sizes DeepSpeed's contiguous buffer, which torchspeed does not have; ignored");
  }
  // A device synchronisation in DeepSpeed; CPU execution is synchronous already.
  c.synchronize_checkpoint_boundary = r.get_bool("synchronize_checkpoint_boundary", false);
  c.profile = r.get_bool("profile", false);
  if (c.profile) r.warn("profile", "torchspeed has no per-checkpoint timer; `torchspeed train --profile` times ops");
  r.finish();
}

void read_pipeline(JsonReader& r, PipelineConfig& c) {
  const auto* stages = r.raw("stages");
  if (stages && stages->is_string()) {
    r.error("stages", stages->get<std::string>() == "auto"
                          ? "\"auto\" is not available in torchspeed: give the number of pipeline stages"
                          : "must be an integer");
  } else {
    c.stages = static_cast<int>(r.get_int("stages", 1, 1, 4096));
  }
  const auto* pm = r.raw("partition_method") ? r.raw("partition_method") : r.raw("partition");
  if (pm) {
    std::string m = pm->is_string() ? pm->get<std::string>() : "";
    if (m == "best") m = "parameters";  // DeepSpeed's pipeline-section spelling
    if (m == "uniform" || m == "parameters" || m.rfind("type:", 0) == 0) {
      c.partition_method = m;
    } else {
      r.error(r.has("partition_method") ? "partition_method" : "partition",
              "must be \"uniform\", \"parameters\" or \"type:REGEX\"");
    }
  }
  c.activation_checkpoint_interval =
      static_cast<int>(r.get_int("activation_checkpoint_interval", 0, 0, kMax32));
  c.schedule = r.get_string("schedule", "1f1b", {"1f1b", "gpipe"});
  for (const char* k : {"seed_layers", "pipe_partitioned", "grad_partitioned",
                        "use_reentrant"}) {
    r.accept(k);
  }
  r.finish();
}

void read_monitor(JsonReader& r, MonitorConfig& c) {
  c.enabled = r.get_bool("enabled", false);
  c.output_path = r.get_string("output_path", "");
  c.job_name = r.get_string("job_name", "DeepSpeedJobName");
  r.finish();
}

void resolve_batch(Config& c, std::optional<int64_t> train, std::optional<int64_t> micro,
                   std::optional<int64_t> gas, Diagnostics& diag) {
  // DeepSpeed's batch world: world / sequence_parallel_size ranks (with tp and pp, their product).
  const int64_t dp = c.replicas();
  const std::string dp_str = c.sp > 1 ? concat("data-parallel size ", dp, " (world ", c.world_size, " / (tp ", c.tp,
                                               " x pp ", c.pp, " x sequence_parallel_size ", c.sp, "))")
                                      : concat("data-parallel size ", dp, " (world ", c.world_size, " / (tp ",
                                               c.tp, " x pp ", c.pp, "))");
  auto divide = [&](int64_t total, int64_t by, const char* what, const std::string& by_str)
      -> std::optional<int64_t> {
    if (total % by == 0) return total / by;
    diag.errors.push_back(concat("train_batch_size: ", total, " is not divisible by ", by_str, " = ",
                                 by, ", so ", what, " cannot be derived; change train_batch_size "
                                 "or run on a world size that divides it"));
    return std::nullopt;
  };
  // Every product below fits in int64 once micro x gas x dp does (each factor is >= 1).
  if (micro && static_cast<__int128>(*micro) * gas.value_or(1) * dp > INT64_MAX / 2) {
    diag.errors.push_back(concat("train_micro_batch_size_per_gpu: ", *micro, " x gradient_accumulation_steps ",
                                 gas.value_or(1), " x ", dp_str, " is beyond any batch torchspeed can count"));
    return;
  }
  if (gas && static_cast<__int128>(*gas) * dp > INT64_MAX / 2) {
    diag.errors.push_back(concat("gradient_accumulation_steps: ", *gas, " x ", dp_str,
                                 " is beyond any batch torchspeed can count"));
    return;
  }
  // DeepSpeed's _set_batch_related_parameters, then _batch_assertion.
  if (train && micro && gas) {
    if (*train != *micro * *gas * dp) {
      diag.errors.push_back(concat(
          "train_batch_size: ", *train, " != train_micro_batch_size_per_gpu ", *micro,
          " x gradient_accumulation_steps ", *gas, " x ", dp_str, " = ", *micro * *gas * dp,
          "; fix one of them, or give only two and let the third be derived"));
      return;
    }
  } else if (train && micro) {
    gas = divide(*train, *micro * dp, "gradient_accumulation_steps",
                 concat("train_micro_batch_size_per_gpu ", *micro, " x ", dp_str));
  } else if (train && gas) {
    micro = divide(*train, *gas * dp, "train_micro_batch_size_per_gpu",
                   concat("gradient_accumulation_steps ", *gas, " x ", dp_str));
  } else if (micro) {
    gas = gas.value_or(1);
    train = *micro * *gas * dp;
  } else if (train) {
    gas = 1;
    micro = divide(*train, dp, "train_micro_batch_size_per_gpu", dp_str);
  } else {
    // DeepSpeed's autotuning templates leave batch sizes to the tuner: the config is accepted
    // and the engine asks for them (Config::check_batch_sizes).
    diag.warnings.push_back("train_batch_size: neither train_batch_size nor "
                            "train_micro_batch_size_per_gpu is given; training needs one of them");
    return;
  }
  if (!micro || !gas) return;
  c.train_batch_size = *train;
  c.train_micro_batch_size_per_gpu = *micro;
  c.gradient_accumulation_steps = *gas;
}

// Note ["auto" values]
// Hugging Face configs leave values to the Trainer as "auto", which transformers'
// HfTrainerDeepSpeedConfig fills from TrainingArguments before DeepSpeed sees the config
// (DeepSpeed itself drops "auto" inside its pydantic sections, taking the default, and fails on
// the top-level ones). We do the same, saying for each key what it became (a warning):
//  - batch sizes: an "auto" one is derived from the ones given and the world size; when neither
//    train_batch_size nor the micro-batch is given, the micro-batch is per_device_train_batch_size
//    (and an "auto" accumulation gradient_accumulation_steps);
//  - gradient_clipping, optimizer lr/betas/eps/weight_decay, scheduler warmup_min_lr (0),
//    warmup_max_lr (the learning rate), warmup_num_steps, total_num_steps (max_steps: an error
//    when unknown), fp16/bf16.enabled: from AutoValues;
//  - ZeRO's reduce_bucket_size, stage3_prefetch_bucket_size and
//    stage3_param_persistence_threshold from the hidden size (h*h, 0.9*h*h, 10*h), as the Trainer;
//  - any other "auto" inside a section DeepSpeed validates with pydantic (zero_optimization,
//    fp16, bf16, the monitors, tensor_parallel, compile): DeepSpeed's default;
//  - anywhere else: an error naming the key.
void resolve_auto(nlohmann::json& j, const AutoValues& a, Diagnostics& diag) {
  auto is_auto = [](const nlohmann::json& o, const std::string& k) {
    return o.is_object() && o.contains(k) && o.at(k).is_string() && o.at(k).get<std::string>() == "auto";
  };
  auto fill = [&](nlohmann::json& o, const std::string& path, const std::string& k, const nlohmann::json& v,
                  const std::string& from) {
    if (!is_auto(o, k)) return;
    o[k] = v;
    diag.warnings.push_back(concat(path.empty() ? "" : path + ".", k, ": \"auto\" -> ", v.dump(), " (", from, ")"));
  };
  auto drop = [&](nlohmann::json& o, const std::string& path, const std::string& k, const std::string& why) {
    if (!is_auto(o, k)) return;
    o.erase(k);
    diag.warnings.push_back(concat(path.empty() ? "" : path + ".", k, ": \"auto\" -> ", why));
  };
  const std::string hf = a.source;
  // Batch sizes.
  std::vector<std::string> batch_autos;
  for (const char* k : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    if (is_auto(j, k)) batch_autos.push_back(k);
  }
  if (!batch_autos.empty()) {
    const bool gas_auto = is_auto(j, "gradient_accumulation_steps");
    for (const auto& k : batch_autos) j.erase(k);
    if (!j.contains("train_batch_size") && !j.contains("train_micro_batch_size_per_gpu")) {
      j["train_micro_batch_size_per_gpu"] = "auto";
      fill(j, "", "train_micro_batch_size_per_gpu", a.per_device_train_batch_size, hf + " per_device_train_batch_size");
      if (gas_auto) {
        j["gradient_accumulation_steps"] = "auto";
        fill(j, "", "gradient_accumulation_steps", a.gradient_accumulation_steps, hf + " gradient_accumulation_steps");
      }
    }
    for (const auto& k : batch_autos) {
      if (!j.contains(k)) diag.warnings.push_back(concat(k, ": \"auto\" -> derived from the other batch sizes and the world size"));
    }
  }
  fill(j, "", "gradient_clipping", a.max_grad_norm, hf + " max_grad_norm");
  for (const char* s : {"fp16", "bf16", "bfloat16"}) {
    if (j.contains(s) && j[s].is_object()) {
      fill(j[s], s, "enabled", std::string(s) == "fp16" ? a.fp16 : a.bf16, hf + (std::string(s) == "fp16" ? " fp16" : " bf16"));
    }
  }
  if (j.contains("optimizer") && j["optimizer"].is_object() && j["optimizer"].contains("params") &&
      j["optimizer"]["params"].is_object()) {
    auto& p = j["optimizer"]["params"];
    fill(p, "optimizer.params", "lr", a.learning_rate, hf + " learning_rate");
    fill(p, "optimizer.params", "weight_decay", a.weight_decay, hf + " weight_decay");
    fill(p, "optimizer.params", "betas", nlohmann::json::array({a.adam_beta1, a.adam_beta2}), hf + " adam_beta1, adam_beta2");
    fill(p, "optimizer.params", "eps", a.adam_epsilon, hf + " adam_epsilon");
  }
  if (j.contains("scheduler") && j["scheduler"].is_object() && j["scheduler"].contains("params") &&
      j["scheduler"]["params"].is_object()) {
    auto& p = j["scheduler"]["params"];
    double lr = a.learning_rate;
    if (j.contains("optimizer") && j["optimizer"].is_object() && j["optimizer"].contains("params") &&
        j["optimizer"]["params"].is_object() && j["optimizer"]["params"].contains("lr") &&
        j["optimizer"]["params"]["lr"].is_number()) {
      lr = j["optimizer"]["params"]["lr"].get<double>();
    }
    fill(p, "scheduler.params", "warmup_min_lr", 0.0, "as the Hugging Face Trainer");
    fill(p, "scheduler.params", "warmup_max_lr", lr, "the optimizer's learning rate");
    fill(p, "scheduler.params", "warmup_num_steps", a.warmup_steps, hf + " warmup_steps");
    if (a.max_steps) {
      fill(p, "scheduler.params", "total_num_steps", *a.max_steps, "the number of training steps");
    } else if (is_auto(p, "total_num_steps")) {
      diag.errors.push_back("scheduler.params.total_num_steps: \"auto\" needs the number of training steps, which only "
                            "a trainer knows (torchspeed train takes train.steps); give a number");
      p["total_num_steps"] = 1;  // reported: the parse fails, and the reader adds no second error
    }
  }
  if (j.contains("zero_optimization") && j["zero_optimization"].is_object()) {
    auto& z = j["zero_optimization"];
    const bool stage3 = z.contains("stage") && z["stage"].is_number_integer() && z["stage"].get<int>() == 3;
    if (a.hidden_size) {
      const int64_t h = *a.hidden_size;
      fill(z, "zero_optimization", "reduce_bucket_size", h * h, "hidden size squared, as the Hugging Face Trainer");
      if (stage3) {
        fill(z, "zero_optimization", "stage3_prefetch_bucket_size", static_cast<int64_t>(0.9 * static_cast<double>(h * h)),
             "0.9 x hidden size squared, as the Hugging Face Trainer");
        fill(z, "zero_optimization", "stage3_param_persistence_threshold", 10 * h,
             "10 x hidden size, as the Hugging Face Trainer");
      }
    }
  }
  // What is left: DeepSpeed's default inside its pydantic sections, else an error.
  std::function<void(nlohmann::json&, const std::string&, bool)> rest = [&](nlohmann::json& o, const std::string& path,
                                                                           bool defaults) {
    if (!o.is_object()) return;
    std::vector<std::string> keys;
    for (const auto& item : o.items()) keys.push_back(item.key());
    for (const auto& k : keys) {
      if (is_auto(o, k)) {
        if (defaults) {
          drop(o, path, k, "DeepSpeed's default, as DeepSpeed reads \"auto\" in this section");
        } else {
          diag.errors.push_back(concat(path.empty() ? "" : path + ".", k,
                                       ": \"auto\" cannot be derived here; give a value"));
          o.erase(k);
        }
      } else {
        rest(o[k], path.empty() ? k : path + "." + k, defaults);
      }
    }
  };
  std::vector<std::string> top;
  for (const auto& item : j.items()) top.push_back(item.key());
  static const std::set<std::string> pydantic = {"zero_optimization", "fp16", "bf16", "bfloat16", "tensorboard",
                                                 "csv_monitor", "wandb", "comet", "tensor_parallel", "compile",
                                                 "comms_logger"};
  for (const auto& k : top) {
    if (k == "pipeline" || k == "model" || k == "data" || k == "train" || k == "lora") continue;  // their readers say
    if (j[k].is_object()) {
      rest(j[k], k, pydantic.count(k) > 0);
    } else if (is_auto(j, k)) {
      diag.errors.push_back(concat(k, ": \"auto\" cannot be derived here; give a value"));
      j.erase(k);
    }
  }
}

std::string line_col(const std::string& text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return concat("line ", line, ", column ", col);
}

}  // namespace

ConfigError::ConfigError(std::vector<std::string> errors)
    : Error([&] {
        std::string msg = concat("invalid torchspeed config (", errors.size(), " error",
                              errors.size() == 1 ? "" : "s", "):");
        for (const auto& e : errors) msg += "\n  " + e;
        return msg;
      }()),
      errors_(std::move(errors)) {}

void Config::check_batch_sizes() const {
  TS_CHECK(train_batch_size > 0,
           "the config gives no batch size: set train_batch_size or "
           "train_micro_batch_size_per_gpu (with gradient_accumulation_steps)");
}

double SchedulerConfig::param(const std::string& name) const {
  auto it = params.find(name);
  TS_CHECK(it != params.end(), "scheduler ", type, " has no parameter '", name, "'");
  return it->second;
}

Config Config::parse(const nlohmann::json& source, const WorldShape& world, const AutoValues& autos) {
  Diagnostics diag;
  Config c;
  c.source = source;
  if (!source.is_object()) throw ConfigError({concat("(root): expected a JSON object, found ", json_type_name(source))});
  nlohmann::json j = source;
  resolve_auto(j, autos, diag);
  JsonReader r(j, "", diag);

  // torchspeed's own section first: it decides whether unknown keys are errors.
  // The deadline's default is the communicator's (TORCHSPEED_COMM_TIMEOUT_S, else 600 s): a job
  // whose config leaves it out honours the environment like every other communicator does.
  c.torchspeed.comm_timeout_s = static_cast<double>(comm::default_timeout().count()) / 1000.0;
  if (auto t = r.child("torchspeed")) {
    c.torchspeed.unknown_keys = t->get_string("unknown_keys", "typos", {"typos", "error", "warn"});
    diag.unknown_keys = c.torchspeed.unknown_keys == "error"  ? Diagnostics::UnknownKeys::kError
                        : c.torchspeed.unknown_keys == "warn" ? Diagnostics::UnknownKeys::kWarn
                                                              : Diagnostics::UnknownKeys::kTypos;
    c.torchspeed.intra_op_threads = static_cast<int>(t->get_int("intra_op_threads", 0, 0, 4096));
    c.torchspeed.comm_timeout_s = t->get_double("comm_timeout_s", c.torchspeed.comm_timeout_s, 1e-3);
    c.torchspeed.comm_chunk_bytes = t->get_int("comm_chunk_bytes", 1 << 20, 4096, int64_t{1} << 30);
    c.torchspeed.tiled_mlp = t->get_int("tiled_mlp", 0, 0, int64_t{1} << 24);
    c.torchspeed.tiled_loss = t->get_int("tiled_loss", 0, 0, int64_t{1} << 24);
    t->finish();
  }

  // Bounded so that micro x gas x dp (dp < 2^31) cannot overflow int64 in resolve_batch.
  constexpr int64_t kMaxBatch = int64_t{1} << 31;
  auto train = r.get_opt_int("train_batch_size", 1, kMaxBatch);
  auto micro = r.get_opt_int("train_micro_batch_size_per_gpu", 1, kMaxBatch);
  auto gas = r.get_opt_int("gradient_accumulation_steps", 1, kMaxBatch);
  c.steps_per_print = static_cast<int>(r.get_int("steps_per_print", 10, 1, kMax32));
  c.wall_clock_breakdown = r.get_bool("wall_clock_breakdown", false);
  c.prescale_gradients = r.get_bool("prescale_gradients", false);
  c.gradient_predivide_factor = r.get_double("gradient_predivide_factor", 1.0, 1e-12);
  c.gradient_clipping = r.get_double("gradient_clipping", 0.0, 0.0);
  c.communication_data_type = r.get_string("communication_data_type", "", {"fp32", "fp16", "bf16", "bfp16"});
  if (c.communication_data_type == "bfp16") c.communication_data_type = "bf16";
  c.seed = r.get_int("seed", 1234, 0);
  c.sp = static_cast<int>(r.get_int("sequence_parallel_size", 1, 1, kMax32));
  c.memory_breakdown = r.get_bool("memory_breakdown", false);

  if (auto s = r.child("fp16")) read_fp16(*s, c.fp16);
  for (const char* key : {"bf16", "bfloat16"}) {
    if (auto s = r.child(key)) {
      c.bf16.enabled = s->get_bool("enabled", false);
      only(*s, "bf16_master_weights_and_grads", false, false,
           "torchspeed keeps fp32 master weights and gradient accumulation for bf16 training; bf16 masters are "
           "not available");
      only(*s, "bf16_optimizer_states", false, false,
           "torchspeed keeps the optimizer states in fp32; bf16 optimizer states are not available");
      s->accept("immediate_grad_update");
      s->accept("check_grad_overflow");
      s->finish();
    }
  }
  if (c.fp16.enabled && c.bf16.enabled) {
    r.error("bf16", "fp16.enabled and bf16.enabled are both true; enable one of them");
  }
  if (auto s = r.child("data_types")) {
    c.grad_accum_dtype = s->get_string("grad_accum_dtype", "", {"fp32", "fp16", "bf16"});
    if (c.grad_accum_dtype == "fp16") {
      s->error("grad_accum_dtype", "torchspeed accumulates gradients in fp32 (or bf16 for bf16 training); "
                                   "fp16 training keeps fp32 gradients (see Note [fp16 on CPU])");
    } else if (c.grad_accum_dtype == "bf16" && !c.bf16.enabled) {
      s->error("grad_accum_dtype", "bf16 accumulation needs bf16.enabled (gradients are fp32 otherwise)");
    }
    s->finish();
  }
  if (auto s = r.child("optimizer")) read_optimizer(*s, c.optimizer);
  if (auto s = r.child("scheduler")) read_scheduler(*s, c.scheduler);
  if (auto s = r.child("zero_optimization")) read_zero(*s, c.zero);
  if (c.optimizer.one_bit() && c.zero.stage != 0) {
    r.error("optimizer", concat("type ", c.optimizer.type, " needs zero_optimization.stage 0, got ", c.zero.stage,
                                " (as in DeepSpeed, where the 1-bit optimizers are not compatible with ZeRO)"));
  }
  if (c.optimizer.type == "OneBitLamb" && c.fp16.enabled && !c.fp16.dynamic()) {
    r.error("fp16.loss_scale", concat(c.fp16.loss_scale, ": OneBitLamb needs dynamic loss scaling (loss_scale 0), as in DeepSpeed"));
  }
  if (auto s = r.child("aio")) read_aio(*s, c.aio);
  if (auto s = r.child("autotuning")) read_autotuning(*s, c.autotuning);
  if (auto s = r.child("compression_training")) detail::read_compression_training(*s, c.compression);
  if (auto s = r.child("quantize_training")) detail::read_quantize_training(*s, c.compression);
  if (auto s = r.child("data_efficiency")) detail::read_data_efficiency(*s, c.random_ltd);
  if (const auto* z = r.raw("zero_optimization"); z && z->is_object() && z->contains("stage")) c.autotuning.zero_stage_given = true;
  if (auto s = r.child("activation_checkpointing")) read_activation_checkpointing(*s, c.activation_checkpointing);
  if (auto s = r.child("pipeline")) read_pipeline(*s, c.pipeline);
  if (auto s = r.child("tensor_parallel")) {
    auto a = s->get_opt_int("tp_size", 1, 4096);
    auto b = s->get_opt_int("autotp_size", 1, 4096);
    c.tensor_parallel.tp_size = static_cast<int>(a ? *a : b ? *b : 1);
    s->finish();
  }
  if (auto s = r.child("checkpoint")) {
    c.checkpoint.tag_validation = s->get_string("tag_validation", "Warn", {"Ignore", "Warn", "Fail"});
    c.checkpoint.load_universal = s->get_bool("load_universal", false);
    c.checkpoint.use_node_local_storage = s->get_bool("use_node_local_storage", false);
    if (c.checkpoint.use_node_local_storage) {
      s->error("use_node_local_storage", "torchspeed checkpoints need one folder every rank can read "
                                         "(a shared filesystem); node-local checkpoints are not available");
    }
    c.checkpoint.keep_last = static_cast<int>(s->get_int("keep_last", 0, 0, kMax32));
    s->accept("parallel_write");
    s->finish();
  }
  if (auto s = r.child("csv_monitor")) read_monitor(*s, c.csv_monitor);
  if (auto s = r.child("tensorboard")) read_monitor(*s, c.tensorboard);

  for (const auto& name : kForeignSections) {
    const auto* v = r.raw(name);
    if (!v) continue;
    const nlohmann::json* flag = v->is_object() && v->contains("enabled") ? &(*v)["enabled"] : nullptr;
    if (flag && !flag->is_boolean()) {
      r.error(name, concat("enabled: expected a boolean, found ", json_type_name(*flag)));
      continue;
    }
    // Sections such as compression_training enable their parts one by one: any "enabled": true
    // inside counts.
    std::string inner;
    std::function<void(const nlohmann::json&, const std::string&)> find_enabled = [&](const nlohmann::json& o,
                                                                                     const std::string& path) {
      if (!o.is_object() || !inner.empty()) return;
      for (const auto& [k, sub] : o.items()) {
        if (k == "enabled" && sub.is_boolean() && sub.get<bool>() && !path.empty()) inner = path + ".enabled";
        find_enabled(sub, path.empty() ? k : path + "." + k);
      }
    };
    find_enabled(*v, "");
    const bool enabled = flag && flag->get<bool>();
    if (enabled) {
      r.error(name, "is a DeepSpeed feature torchspeed does not have; remove the section or set "
                    "\"enabled\": false");
    } else if (!inner.empty()) {
      r.error(name, concat(inner, " is true: ", name, " is a DeepSpeed feature torchspeed does not have"));
    } else {
      r.warn(name, "is a DeepSpeed feature torchspeed does not have; ignored (not enabled)");
    }
  }
  if (const auto* v = r.raw("compile")) {  // DeepSpeed's CompileConfig: DeepCompile's switches
    if (v->is_object() && v->value("deepcompile", false) == true) {
      r.error("compile", "deepcompile: DeepCompile (torch.compile graph passes) is not available in torchspeed");
    } else {
      r.warn("compile", "configures DeepCompile, which torchspeed does not have; ignored (deepcompile is off)");
    }
  }
  for (const auto& name : kIgnoredFlags) {
    if (r.raw(name)) r.warn(name, "has no effect in torchspeed; ignored");
  }
  for (const auto& name : kOwnedSections) {
    if (const auto* v = r.raw(name)) c.sections[name] = *v;
  }
  r.finish();

  // World shape: command line over config; tp/pp must agree when both are given.
  c.world_size = world.world_size;
  c.tp = world.tp > 0 ? world.tp : c.tensor_parallel.tp_size;
  c.pp = world.pp > 0 ? world.pp : c.pipeline.stages;
  if (world.tp > 0 && r.has("tensor_parallel") && world.tp != c.tensor_parallel.tp_size) {
    r.error("tensor_parallel", concat("tp_size ", c.tensor_parallel.tp_size, " contradicts --tp ", world.tp));
  }
  if (world.pp > 0 && r.has("pipeline") && world.pp != c.pipeline.stages) {
    r.error("pipeline", concat("stages ", c.pipeline.stages, " contradicts --pp ", world.pp));
  }
  c.tensor_parallel.tp_size = c.tp;
  c.pipeline.stages = c.pp;
  if (c.world_size < 1 || c.world_size % (c.tp * c.pp) != 0) {
    diag.errors.push_back(concat("tensor_parallel.tp_size x pipeline.stages: tp ", c.tp, " x pp ", c.pp,
                              " = ", c.tp * c.pp, " does not divide the world size ", c.world_size));
  } else {
    c.dp = c.world_size / (c.tp * c.pp);
    if (c.sp > 1 && (c.tp > 1 || c.pp > 1)) {
      diag.errors.push_back(concat("sequence_parallel_size: ", c.sp, " with tensor_parallel.tp_size ", c.tp,
                                   " and pipeline.stages ", c.pp, ": sequence parallelism runs with data parallelism and ZeRO ",
                                   "(tp 1, pp 1)"));
    } else if (c.dp % c.sp != 0) {
      diag.errors.push_back(concat("sequence_parallel_size: ", c.sp, " does not divide the data-parallel size ", c.dp,
                                   " (world ", c.world_size, "): each sequence splits over that many ranks"));
    } else {
      resolve_batch(c, train, micro, gas, diag);
    }
  }
  if (c.zero.stage >= 2 && c.pp > 1) {
    diag.errors.push_back(concat("zero_optimization.stage: stage ", c.zero.stage,
                              " cannot be combined with pipeline parallelism (pp ", c.pp,
                              "), as in DeepSpeed; use stage 0 or 1"));
  }
  if (!diag.errors.empty()) throw ConfigError(diag.errors);
  c.warnings = diag.warnings;
  return c;
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "cannot open config file '", path, "': ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    size_t byte = e.byte > 0 ? e.byte - 1 : 0;
    throw ConfigError({concat(path, ": invalid JSON at byte ", byte, " (", line_col(text, byte),
                           "): ", e.what())});
  } catch (const nlohmann::json::exception& e) {  // e.g. a number beyond double's range
    throw ConfigError({concat(path, ": invalid JSON: ", e.what())});
  }
}

Config Config::load(const std::string& path, const WorldShape& world, const AutoValues& autos) {
  nlohmann::json j = read_json_file(path);
  try {
    return parse(j, world, autos);
  } catch (const ConfigError& e) {
    std::vector<std::string> errs;
    for (const auto& m : e.errors()) errs.push_back(concat(path, ": ", m));
    throw ConfigError(errs);
  }
}

nlohmann::json Config::to_json() const {
  using nlohmann::json;
  auto offload = [](const OffloadConfig& o, bool optimizer) {
    json j{{"device", o.device}, {"nvme_path", o.nvme_path}, {"pin_memory", o.pin_memory},
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
  if (!optimizer.type.empty()) {
    json p = {{"lr", optimizer.lr}, {"weight_decay", optimizer.weight_decay}};
    if (optimizer.type == "SGD") {
      p["momentum"] = optimizer.momentum;
      p["dampening"] = optimizer.dampening;
      p["nesterov"] = optimizer.nesterov;
    } else {
      p["betas"] = optimizer.betas;
      p["eps"] = optimizer.eps;
      p["bias_correction"] = optimizer.bias_correction;
      if (optimizer.type == "OneBitAdam") {
        p["freeze_step"] = optimizer.freeze_step;
      } else if (optimizer.type == "ZeroOneAdam") {
        p["var_freeze_step"] = optimizer.var_freeze_step;
        p["var_update_scaler"] = optimizer.var_update_scaler;
        p["local_step_scaler"] = optimizer.local_step_scaler;
        p["local_step_clipper"] = optimizer.local_step_clipper;
      } else if (optimizer.type == "OneBitLamb") {
        p["freeze_step"] = optimizer.freeze_step;
        p["max_coeff"] = optimizer.max_coeff;
        p["min_coeff"] = optimizer.min_coeff;
        p["coeff_beta"] = optimizer.coeff_beta;
        p["factor_max"] = optimizer.factor_max;
        p["factor_min"] = optimizer.factor_min;
        p["factor_threshold"] = optimizer.factor_threshold;
      } else if (optimizer.type == "Lamb") {
        p["max_coeff"] = optimizer.max_coeff;
        p["min_coeff"] = optimizer.min_coeff;
        p["eps_inside_sqrt"] = optimizer.eps_inside_sqrt;
      } else {
        p["adam_w_mode"] = optimizer.adam_w_mode;
      }
    }
    j["optimizer"] = {{"type", optimizer.type}, {"params", p}};
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
