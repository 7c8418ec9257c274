// The sections made of plain keys, each declared once in a key table (Note [Config keys declared
// once] in keys.h) with the few checks a table cannot say: the top-level scalars, fp16,
// activation_checkpointing, pipeline, checkpoint, the monitors and torchspeed's own section.
#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/json_reader.h"
#include "torchspeed/config/keys.h"

namespace torchspeed::config::detail {

namespace {
constexpr double kMax32 = INT32_MAX;
}  // namespace

const KeyTable<Config>& root_keys() {
  using C = Config;
  static const KeyTable<C> keys = {
      Key<C>("steps_per_print", &C::steps_per_print,
             "every that many optimizer steps world rank 0 logs DeepSpeed's progress line and the breakdowns")
          .range(1, kMax32),
      Key<C>("wall_clock_breakdown", &C::wall_clock_breakdown,
             "each report gives the milliseconds in forward, backward, reduce wait, optimizer and all-gather"),
      Key<C>("prescale_gradients", &C::prescale_gradients, "gradients are divided by the data-parallel size before the sum"),
      Key<C>("gradient_predivide_factor", &C::gradient_predivide_factor,
             "gradients are divided by it before the sum and by dp / it after").range(1e-12),
      Key<C>("gradient_clipping", &C::gradient_clipping, "the global gradient norm is clipped to it (0: off)").range(0.0),
      Key<C>("communication_data_type", &C::communication_data_type,
             "dtype of gradient reductions (\"\": the compute dtype; bfp16 is bf16)")
          .one_of({"fp32", "fp16", "bf16", "bfp16"}),
      Key<C>("seed", &C::seed, "the seed of every rank's generator (data order, dropout, initialisation)").range(0),
      Key<C>("sequence_parallel_size", &C::sp,
             "DeepSpeed-Ulysses: consecutive data-parallel ranks that split each sequence").range(1, kMax32),
      Key<C>("memory_breakdown", &C::memory_breakdown,
             "each report gives this rank's bytes of parameters, gradients, masters, optimizer state and RSS"),
  };
  return keys;
}

const KeyTable<FP16Config>& fp16_keys() {
  using C = FP16Config;
  static const KeyTable<C> keys = {
      Key<C>("enabled", &C::enabled, "fp16 training with fp32 masters"),
      Key<C>("auto_cast", &C::auto_cast, "floating inputs are rounded to fp16 before the model sees them"),
      Key<C>("loss_scale", &C::loss_scale, "a static loss scale; 0: dynamic loss scaling").range(0.0),
      Key<C>("initial_scale_power", &C::initial_scale_power, "the dynamic scale starts at 2^this").range(0, 64),
      Key<C>("loss_scale_window", &C::loss_scale_window, "steps without overflow before the scale doubles").range(1, kMax32),
      Key<C>("hysteresis", &C::hysteresis, "overflows tolerated before the scale halves").range(1, kMax32),
      Key<C>("consecutive_hysteresis", &C::consecutive_hysteresis, "the hysteresis refills after each good step"),
      Key<C>("min_loss_scale", &C::min_loss_scale, "the scale never halves below it").range(0.0),
      Key<C>("fp16_master_weights_and_grads", {}, "")
          .only(false, "torchspeed keeps fp32 master weights; this DeepSpeed option is not supported"),
  };
  return keys;
}

void read_fp16(JsonReader& r, FP16Config& c) {
  read_keys(r, c, fp16_keys());
  r.finish();
}

const KeyTable<ActivationCheckpointingConfig>& activation_checkpointing_keys() {
  using C = ActivationCheckpointingConfig;
  // deepspeed.checkpointing's settings for how a checkpointed segment's input is kept; torchspeed
  // keeps it as a plain tensor in CPU memory (nn/checkpoint.h).
  static const KeyTable<C> keys = {
      Key<C>("partition_activations", &C::partition_activations, "")
          .warned("not available in torchspeed: each tensor-parallel rank keeps whole checkpointed activations (same "
                  "gradients, more memory)"),
      Key<C>("contiguous_memory_optimization", &C::contiguous_memory_optimization, "")
          .warned("not available in torchspeed: checkpointed activations are separate tensors (same gradients)"),
      Key<C>("cpu_checkpointing", &C::cpu_checkpointing, "checkpoints already live in CPU memory: holds either way"),
      Key<C>("synchronize_checkpoint_boundary", &C::synchronize_checkpoint_boundary,
             "a device synchronisation in DeepSpeed; CPU execution is synchronous already"),
      Key<C>("profile", &C::profile, "").warned("torchspeed has no per-checkpoint timer; `torchspeed train --profile` times ops"),
  };
  return keys;
}

void read_activation_checkpointing(JsonReader& r, ActivationCheckpointingConfig& c) {
  read_keys(r, c, activation_checkpointing_keys());
  c.number_checkpoints = r.get_opt_int("number_checkpoints", 1);
  if (c.number_checkpoints) {
    r.warn("number_checkpoints", "sizes DeepSpeed's contiguous buffer, which torchspeed does not have; ignored");
  }
  r.finish();
}

const KeyTable<PipelineConfig>& pipeline_keys() {
  using C = PipelineConfig;
  static const KeyTable<C> keys = {
      Key<C>("stages", &C::stages, "pipeline stages (\"auto\" is refused)").range(1, 4096).read_by_section(),
      Key<C>("partition_method", &C::partition_method,
             "how layers are split over stages: uniform, parameters (DeepSpeed's `best`), type:REGEX (also `partition`)")
          .read_by_section(),
      Key<C>("activation_checkpoint_interval", &C::activation_checkpoint_interval,
             "layers per checkpointed segment (0: none)").range(0, kMax32),
      Key<C>("schedule", &C::schedule, "the pipeline schedule").one_of({"1f1b", "gpipe"}),
  };
  return keys;
}

void read_pipeline(JsonReader& r, PipelineConfig& c) {
  const auto* stages = r.raw("stages");
  if (stages && stages->is_string()) {
    r.error("stages", stages->get<std::string>() == "auto"
                          ? "\"auto\" is not available in torchspeed: give the number of pipeline stages"
                          : "must be an integer");
  } else {
    c.stages = static_cast<int>(r.get_int("stages", c.stages, 1, 4096));
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
  read_keys(r, c, pipeline_keys());
  for (const char* k : {"seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant"}) r.accept(k);
  r.finish();
}

const KeyTable<CheckpointConfig>& checkpoint_keys() {
  using C = CheckpointConfig;
  static const KeyTable<C> keys = {
      Key<C>("tag_validation", &C::tag_validation, "whether ranks must agree on a checkpoint's tag")
          .one_of({"Ignore", "Warn", "Fail"}),
      Key<C>("load_universal", &C::load_universal, "read and kept; loading needs no switch: every checkpoint loads at another parallel layout (resharded)"),
      Key<C>("use_node_local_storage", &C::use_node_local_storage, "")
          .refused("torchspeed checkpoints need one folder every rank can read (a shared filesystem); node-local "
                   "checkpoints are not available"),
      Key<C>("keep_last", &C::keep_last, "checkpoints kept; older ones are removed (0: all)").range(0, kMax32),
  };
  return keys;
}

void read_checkpoint(JsonReader& r, CheckpointConfig& c) {
  read_keys(r, c, checkpoint_keys());
  r.accept("parallel_write");
  r.finish();
}

const KeyTable<MonitorConfig>& monitor_keys() {
  using C = MonitorConfig;
  static const KeyTable<C> keys = {
      Key<C>("enabled", &C::enabled, "write the training metrics"),
      Key<C>("output_path", &C::output_path, "the folder they go to"),
      Key<C>("job_name", &C::job_name, "a subfolder naming the run"),
  };
  return keys;
}

void read_monitor(JsonReader& r, MonitorConfig& c) {
  read_keys(r, c, monitor_keys());
  r.finish();
}

const KeyTable<TorchspeedConfig>& torchspeed_keys() {
  using C = TorchspeedConfig;
  static const KeyTable<C> keys = {
      Key<C>("unknown_keys", &C::unknown_keys,
             "keys nobody reads: typos refuses those near a known key and warns about the rest; error refuses all; warn none")
          .one_of({"typos", "error", "warn"}),
      Key<C>("intra_op_threads", &C::intra_op_threads, "LibTorch threads per rank (0: the cores per rank)").range(0, 4096),
      Key<C>("comm_timeout_s", &C::comm_timeout_s,
             "a collective waiting longer ends the job naming the op and the ranks missing (default: "
             "TORCHSPEED_COMM_TIMEOUT_S, else 600)")
          .range(1e-3),
      Key<C>("comm_chunk_bytes", &C::comm_chunk_bytes, "large collectives run in chunks of this many bytes")
          .range(4096, double(int64_t{1} << 30)),
      Key<C>("tiled_mlp", &C::tiled_mlp, "ALST: the dense MLP over this many slices of each sequence (0: whole)")
          .range(0, double(int64_t{1} << 24)),
      Key<C>("tiled_loss", &C::tiled_loss, "ALST: the LM head and loss over this many slices (0: whole)")
          .range(0, double(int64_t{1} << 24)),
  };
  return keys;
}

void read_torchspeed(JsonReader& r, TorchspeedConfig& c, Diagnostics& diag) {
  read_keys(r, c, torchspeed_keys());
  diag.unknown_keys = c.unknown_keys == "error"  ? Diagnostics::UnknownKeys::kError
                      : c.unknown_keys == "warn" ? Diagnostics::UnknownKeys::kWarn
                                                 : Diagnostics::UnknownKeys::kTypos;
  r.finish();
}

}  // namespace torchspeed::config::detail
