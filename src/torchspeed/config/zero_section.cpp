// The zero_optimization section with its offload subsections, and the aio section (DeepSpeed's
// zero/config.py, offload_config.py, aio config).
#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/json_reader.h"

namespace torchspeed::config::detail {

OffloadConfig offload_defaults(bool optimizer) {
  OffloadConfig c;
  if (optimizer) c.buffer_count = 4;  // DeepSpeed's offload_optimizer default (offload_param: 5)
  return c;
}

const KeyTable<OffloadConfig>& offload_keys(bool optimizer) {
  using C = OffloadConfig;
  auto common = [] {
    return KeyTable<C>{
        Key<C>("device", {}, "none; cpu: the state already lives in host memory (warned); nvme: swap files under nvme_path")
            .read_by_section(),
        Key<C>("nvme_path", &C::nvme_path, "the folder of the swap files (required with nvme)"),
        Key<C>("pin_memory", &C::pin_memory, "").warned("has no effect without a device: there are no transfers to pin for"),
        Key<C>("buffer_count", &C::buffer_count, "aligned buffers the swapper streams through (at least 2 with nvme)").range(1),
    };
  };
  static const KeyTable<C> opt = [&] {
    KeyTable<C> k = common();
    k.push_back(Key<C>("ratio", &C::ratio, "")
                    .range(0.0, 1.0)
                    .refused("a partial offload (a share of the step on the device) needs a device; torchspeed offloads "
                             "all of the optimizer state (ratio 1.0)"));
    k.push_back(Key<C>("pipeline_read", &C::pipeline_read, "read the next sub-groups while one is updated"));
    k.push_back(Key<C>("pipeline_write", &C::pipeline_write, "write the last sub-groups while one is updated"));
    k.push_back(Key<C>("fast_init", &C::fast_init, "")
                    .warned("has no effect: swap files are always initialised by streaming the initial state through the "
                            "buffer pool"));
    return k;
  }();
  static const KeyTable<C> param = [&] {
    KeyTable<C> k = common();
    k.push_back(Key<C>("buffer_size", &C::buffer_size, "elements per buffer (a larger shard is read in pieces)").range(1));
    k.push_back(Key<C>("max_in_cpu", &C::max_in_cpu, "units up to this many elements stay in memory").range(0));
    return k;
  }();
  return optimizer ? opt : param;
}

static void read_offload(JsonReader& r, OffloadConfig& c, bool optimizer) {
  const std::string device = r.get_string("device", "none", {"none", "cpu", "nvme"});
  c.device = device == "nvme" ? OffloadDevice::kNvme : device == "cpu" ? OffloadDevice::kCpu : OffloadDevice::kNone;
  if (c.device == OffloadDevice::kCpu) {
    r.warn("device", "\"cpu\": on this CPU-only machine the state already lives in host memory, where it stays "
                     "(nothing is offloaded); \"nvme\" moves it to files under nvme_path");
  }
  if (optimizer) c.buffer_count = offload_defaults(true).buffer_count;
  read_keys(r, c, offload_keys(optimizer));
  if (optimizer) {
    r.deprecated("pipeline", "\"pipeline_read\" and \"pipeline_write\"");
    if (r.get_bool("pipeline", false)) c.pipeline_read = c.pipeline_write = true;
    if (c.device == OffloadDevice::kNvme && c.buffer_count < 2) {
      r.error("buffer_count", "must be at least 2 with \"nvme\" (one buffer updated while another is read or written)");
    }
  } else if (c.device == OffloadDevice::kNvme && c.buffer_count < 2) {
    r.error("buffer_count", "must be at least 2 with \"nvme\" (one buffer reading ahead, one for the rest)");
  }
  if (c.device == OffloadDevice::kNvme && c.nvme_path.empty()) r.error("nvme_path", "is required when device is \"nvme\"");
  r.finish();
}

const KeyTable<AioConfig>& aio_keys() {
  using C = AioConfig;
  static const KeyTable<C> keys = {
      Key<C>("block_size", &C::block_size, "bytes per direct-I/O request (a multiple of 512)").range(512),
      Key<C>("queue_depth", &C::queue_depth, "requests in flight per thread DeepSpeed would run").range(1, 4096),
      // DeepSpeed's aio handle runs intra_op_parallelism threads, each with queue_depth requests
      // in flight; one io_uring ring keeps the same number in flight from one thread (offload/aio.h).
      Key<C>("intra_op_parallelism", &C::intra_op_parallelism,
             "the one io_uring ring keeps queue_depth x this many requests in flight (DeepSpeed's threads)")
          .alias("thread_count")
          .range(1, 1024),
      Key<C>("single_submit", &C::single_submit, "requests submitted one by one instead of batched"),
      Key<C>("overlap_events", &C::overlap_events, "the queue refilled as requests complete instead of batch by batch"),
      Key<C>("use_gds", {}, "").only(false, "GPUDirect Storage needs a GPU"),
  };
  return keys;
}

void read_aio(JsonReader& r, AioConfig& c) {
  read_keys(r, c, aio_keys());
  if (c.block_size % 512 != 0) r.error("block_size", "must be a multiple of 512 bytes (direct I/O)");
  if (c.queue_depth * c.intra_op_parallelism > 4096) {
    r.error(r.has("intra_op_parallelism") ? "intra_op_parallelism" : "thread_count",
            concat("queue_depth ", c.queue_depth, " x ", c.intra_op_parallelism, " requests in flight is over 4096"));
  }
  r.finish();
}

const KeyTable<ZeroConfig>& zero_keys() {
  using C = ZeroConfig;
  // DeepSpeed accepts the stage-3 keys with and without the "stage3_" prefix.
  static const KeyTable<C> keys = {
      Key<C>("stage", &C::stage, "one strategy each: replicated gradients (0-1), partitioned gradients (2), partitioned "
                                 "parameters (3)")
          .range(0, 3)
          .read_by_section(),
      Key<C>("contiguous_gradients", &C::contiguous_gradients, "")
          .warned("torchspeed always copies gradients into contiguous buffers (its flat units); false has no effect"),
      Key<C>("reduce_scatter", &C::reduce_scatter,
             "stages 1-3 average gradients with reduce-scatter (a rank needs only its shard); false all-reduces"),
      Key<C>("reduce_bucket_size", &C::reduce_bucket_size, "elements per gradient bucket (unit)").range(1),
      Key<C>("allgather_partitions", &C::allgather_partitions, "")
          .warned("torchspeed always all-gathers updated partitions (no broadcast variant); false has no effect"),
      Key<C>("allgather_bucket_size", &C::allgather_bucket_size, "")
          .range(1)
          .no_effect("updated parameters are all-gathered unit by unit (reduce_bucket_size)"),
      Key<C>("overlap_comm", &C::overlap_comm, "bucket reductions run while backward goes on (default: true at stage 3)"),
      Key<C>("load_from_fp32_weights", &C::load_from_fp32_weights, "")
          .refused("torchspeed always restores parameters from the checkpoint's fp32 masters"),
      Key<C>("elastic_checkpoint", &C::elastic_checkpoint, "read and kept; loading needs no switch: checkpoints load at another data-parallel size either way"),
      Key<C>("sub_group_size", &C::sub_group_size, "the optimizer step runs in pieces of at most this many elements")
          .range(1),
      Key<C>("stage3_prefetch_bucket_size", &C::prefetch_bucket_size, "stage 3: elements gathered ahead of the layer that runs")
          .alias("prefetch_bucket_size")
          .range(0),
      Key<C>("stage3_param_persistence_threshold", &C::param_persistence_threshold,
             "stage 3: units with fewer elements stay whole on every rank")
          .alias("param_persistence_threshold")
          .range(0),
      Key<C>("stage3_model_persistence_threshold", &C::model_persistence_threshold, "")
          .alias("model_persistence_threshold")
          .range(0)
          .no_effect("every unit below stage3_param_persistence_threshold stays whole"),
      Key<C>("stage3_max_live_parameters", &C::max_live_parameters, "stage 3: most elements gathered at once")
          .alias("max_live_parameters")
          .range(0),
      Key<C>("stage3_max_reuse_distance", &C::max_reuse_distance, "")
          .alias("max_reuse_distance")
          .range(0)
          .no_effect("stage 3 releases a layer as soon as its forward or backward ends"),
      Key<C>("stage3_gather_16bit_weights_on_model_save", &C::gather_16bit_weights_on_model_save,
             "Engine::save_16bit_model writes the whole model at stage 3 only with it (also "
             "gather_16bit_weights_on_model_save, stage3_gather_fp16_weights_on_model_save)")
          .read_by_section(),
      Key<C>("round_robin_gradients", &C::round_robin_gradients, "")
          .no_effect("it spreads gradient copies to a device's host offload; gradients here are already in host memory"),
      Key<C>("ignore_unused_parameters", &C::ignore_unused_parameters, "")
          .refused("torchspeed reduces zeros for parameters without gradients; false (an error for them) is not available"),
      Key<C>("zero_hpz_partition_size", &C::hpz_partition_size,
             "ZeRO++ hpZ (stage 3): later gathers within groups of this many consecutive ranks")
          .range(1, 1 << 20),
      Key<C>("zero_quantized_weights", &C::quantized_weights, "ZeRO++ qwZ (stage 3): int8 parameter all-gathers"),
      Key<C>("zero_quantized_gradients", &C::quantized_gradients,
             "ZeRO++ qgZ (stages 2-3): 4-bit blocks in the gradients' reduce-scatter across hosts"),
      Key<C>("zero_quantized_nontrainable_weights", {}, "")
          .only(false, "ZeRO++ quantized non-trainable weights are not available in torchspeed yet"),
      Key<C>("mics_hierarchical_params_gather", {}, "").only(false, "MiCS is not available in torchspeed"),
      // Implementation choices of DeepSpeed's with no counterpart here (same results either way).
      Key<C>("legacy_stage1", {}, "").no_effect("torchspeed has one stage-1 implementation"),
      Key<C>("use_multi_rank_bucket_allreduce", {}, "").no_effect("buckets are reduced by the communicator's own algorithm"),
      Key<C>("memory_efficient_linear", {}, "").no_effect("torchspeed's linear layers keep no extra copies to save"),
      Key<C>("pipeline_loading_checkpoint", {}, "").no_effect("checkpoints load from the sharded files as they are"),
      Key<C>("override_module_apply", {}, "")
          .no_effect("stage 3 gathers layers as the stack runs them, not through module.apply"),
      Key<C>("log_trace_cache_warnings", {}, "").no_effect("stage 3 keeps no trace cache"),
  };
  return keys;
}

void read_zero(JsonReader& r, ZeroConfig& c) {
  c.stage = static_cast<int>(r.get_int("stage", c.stage, 0, 3));
  c.overlap_comm = c.stage == 3;  // DeepSpeed's default: on at stage 3
  read_keys(r, c, zero_keys());
  c.gather_16bit_weights_on_model_save =
      r.get_bool("stage3_gather_16bit_weights_on_model_save", false) ||
      r.get_bool("gather_16bit_weights_on_model_save", false) ||
      r.get_bool("stage3_gather_fp16_weights_on_model_save", false);
  // ZeRO++ hpZ and qwZ act on stage 3's parameter gathers (DeepSpeed ignores them below stage 3;
  // here they are refused, never accepted and ignored). Whether hpZ's size divides the
  // data-parallel size is checked when the engine knows that size.
  if (c.hpz_partition_size > 1 && c.stage != 3) {
    r.error("zero_hpz_partition_size", concat("ZeRO++ hierarchical partitioning (hpZ) keeps a secondary copy of stage 3's "
                                              "parameter shards: it needs stage 3, and stage is ", c.stage));
  }
  if (c.quantized_weights && c.stage != 3) {
    r.error("zero_quantized_weights", concat("ZeRO++ quantized weights (qwZ) quantize stage 3's parameter all-gather: they "
                                             "need stage 3, and stage is ", c.stage));
  }
  // qgZ: DeepSpeed applies it at stage 3; the same reduce-scatter serves stage 2 here.
  if (c.quantized_gradients && c.stage < 2) {
    r.error("zero_quantized_gradients", concat("ZeRO++ quantized gradients (qgZ) quantize the gradients' reduce-scatter: they need "
                                               "stage 2 or 3, and stage is ", c.stage));
  }
  if (c.quantized_gradients && !c.reduce_scatter) {
    r.error("zero_quantized_gradients", "ZeRO++ quantized gradients (qgZ) replace the reduce-scatter, and reduce_scatter is false");
  }
  if (r.get_int("mics_shard_size", -1) > 0) {
    r.error("mics_shard_size", "MiCS (sharding within sub-groups) is not available in torchspeed");
  }
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
