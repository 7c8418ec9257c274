// The zero_optimization section with its offload subsections, and the aio section (DeepSpeed's
// zero/config.py, offload_config.py, aio config).
#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/json_reader.h"

namespace torchspeed::config::detail {

static void read_offload(JsonReader& r, OffloadConfig& c, bool optimizer) {
  const std::string device = r.get_string("device", "none", {"none", "cpu", "nvme"});
  c.device = device == "nvme" ? OffloadDevice::kNvme : device == "cpu" ? OffloadDevice::kCpu : OffloadDevice::kNone;
  c.nvme_path = r.get_string("nvme_path", "");
  c.pin_memory = r.get_bool("pin_memory", false);
  c.buffer_count = r.get_int("buffer_count", optimizer ? 4 : 5, 1);
  if (c.pin_memory) r.warn("pin_memory", "has no effect without a device: there are no transfers to pin for");
  if (c.device == OffloadDevice::kCpu) {
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
    if (c.device == OffloadDevice::kNvme && c.buffer_count < 2) {
      r.error("buffer_count", "must be at least 2 with \"nvme\" (one buffer updated while another is read or written)");
    }
  } else {
    c.buffer_size = r.get_int("buffer_size", 100000000, 1);
    c.max_in_cpu = r.get_int("max_in_cpu", 1000000000, 0);
    if (c.device == OffloadDevice::kNvme && c.buffer_count < 2) {
      r.error("buffer_count", "must be at least 2 with \"nvme\" (one buffer reading ahead, one for the rest)");
    }
  }
  if (c.device == OffloadDevice::kNvme && c.nvme_path.empty()) r.error("nvme_path", "is required when device is \"nvme\"");
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
static int64_t get_stage3_int(JsonReader& r, const std::string& name, int64_t def) {
  auto a = r.get_opt_int("stage3_" + name, 0);
  auto b = r.get_opt_int(name, 0);
  return a ? *a : b ? *b : def;
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
  if (r.get_bool("cpu_offload", false)) c.offload_optimizer.device = OffloadDevice::kCpu;
  r.deprecated("cpu_offload_param", "\"offload_param\": {\"device\": \"cpu\"}");
  if (r.get_bool("cpu_offload_param", false)) c.offload_param.device = OffloadDevice::kCpu;
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

}  // namespace torchspeed::config::detail
