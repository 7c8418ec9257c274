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
#include "torchspeed/config/keys.h"

namespace torchspeed::config {
using detail::no_effect;
using detail::only;
namespace {

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

const char* offload_device_name(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "none";
}

void Config::check_batch_sizes() const {
  TS_CHECK(train_batch_size > 0,
           "the config gives no batch size: set train_batch_size or "
           "train_micro_batch_size_per_gpu (with gradient_accumulation_steps)");
}

Config Config::parse(const nlohmann::json& source, const WorldShape& world, const AutoValues& autos) {
  Diagnostics diag;
  Config c;
  c.source = source;
  if (!source.is_object()) throw ConfigError({concat("(root): expected a JSON object, found ", json_type_name(source))});
  nlohmann::json j = source;
  detail::resolve_auto(j, autos, diag);
  JsonReader r(j, "", diag);

  // torchspeed's own section first: it decides whether unknown keys are errors.
  // The deadline's default is the communicator's (TORCHSPEED_COMM_TIMEOUT_S, else 600 s): a job
  // whose config leaves it out honours the environment like every other communicator does.
  c.torchspeed.comm_timeout_s = static_cast<double>(comm::default_timeout().count()) / 1000.0;
  if (auto t = r.child("torchspeed")) detail::read_torchspeed(*t, c.torchspeed, diag);

  // Bounded so that micro x gas x dp (dp < 2^31) cannot overflow int64 in resolve_batch.
  constexpr int64_t kMaxBatch = int64_t{1} << 31;
  auto train = r.get_opt_int("train_batch_size", 1, kMaxBatch);
  auto micro = r.get_opt_int("train_micro_batch_size_per_gpu", 1, kMaxBatch);
  auto gas = r.get_opt_int("gradient_accumulation_steps", 1, kMaxBatch);
  read_keys(r, c, detail::root_keys());
  if (c.communication_data_type == "bfp16") c.communication_data_type = "bf16";

  if (auto s = r.child("fp16")) detail::read_fp16(*s, c.fp16);
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
  if (auto s = r.child("optimizer")) detail::read_optimizer(*s, c.optimizer);
  if (auto s = r.child("scheduler")) detail::read_scheduler(*s, c.scheduler);
  if (auto s = r.child("zero_optimization")) detail::read_zero(*s, c.zero);
  if (c.optimizer.one_bit() && c.zero.stage != 0) {
    r.error("optimizer", concat("type ", c.optimizer.name(), " needs zero_optimization.stage 0, got ", c.zero.stage,
                                " (as in DeepSpeed, where the 1-bit optimizers are not compatible with ZeRO)"));
  }
  if (c.optimizer.type == optim::OptimizerType::kOneBitLamb && c.fp16.enabled && !c.fp16.dynamic()) {
    r.error("fp16.loss_scale", concat(c.fp16.loss_scale, ": OneBitLamb needs dynamic loss scaling (loss_scale 0), as in DeepSpeed"));
  }
  if (auto s = r.child("aio")) detail::read_aio(*s, c.aio);
  if (auto s = r.child("autotuning")) read_autotuning(*s, c.autotuning);
  if (auto s = r.child("compression_training")) detail::read_compression_training(*s, c.compression);
  if (auto s = r.child("quantize_training")) detail::read_quantize_training(*s, c.compression);
  if (auto s = r.child("data_efficiency")) detail::read_data_efficiency(*s, c.random_ltd);
  if (const auto* z = r.raw("zero_optimization"); z && z->is_object() && z->contains("stage")) c.autotuning.zero_stage_given = true;
  if (auto s = r.child("activation_checkpointing")) detail::read_activation_checkpointing(*s, c.activation_checkpointing);
  if (auto s = r.child("pipeline")) detail::read_pipeline(*s, c.pipeline);
  if (auto s = r.child("tensor_parallel")) {
    auto a = s->get_opt_int("tp_size", 1, 4096);
    auto b = s->get_opt_int("autotp_size", 1, 4096);
    c.tensor_parallel.tp_size = static_cast<int>(a ? *a : b ? *b : 1);
    s->finish();
  }
  if (auto s = r.child("checkpoint")) detail::read_checkpoint(*s, c.checkpoint);
  if (auto s = r.child("csv_monitor")) detail::read_monitor(*s, c.csv_monitor);
  if (auto s = r.child("tensorboard")) detail::read_monitor(*s, c.tensorboard);

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

}  // namespace torchspeed::config
