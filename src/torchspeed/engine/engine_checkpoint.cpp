// Engine::save_checkpoint / load_checkpoint / master_params / save_16bit_model: the engine's
// state mapped onto a checkpoint's manifest and shards (checkpoint/training_state.h), resharding
// when the data-parallel size or ZeRO stage changed. The protocol is checkpoint/sharded.cpp's.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

#include "torchspeed/checkpoint/model_gather.h"
#include "torchspeed/checkpoint/reshard.h"
#include "torchspeed/checkpoint/training_state.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

#ifndef TORCHSPEED_VERSION
#define TORCHSPEED_VERSION "unknown"
#endif

namespace torchspeed {

// The world again, apart from training's collectives (a save on some ranks can never match
// another rank's gradient reduction), with half the deadline: ranks reach a save together after
// the step's collectives, so one missing after half the deadline never called it, and the save's
// error (naming the cause) comes before any training collective's. Made with the engine: a split
// inside a save that some ranks never call would block in MPI without a deadline.
// See Note [Checkpoint protocol].
void Engine::make_checkpoint_comm() {
  comm::CommOptions o = groups_.world->options();
  o.timeout(std::max(o.timeout() / 2, std::chrono::milliseconds(1)));
  checkpoint_comm_ = groups_.world->split(0, groups_.world->rank(), "checkpoint", o);
}

std::string Engine::save_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& client_state) {
  const int64_t gas = config_.gradient_accumulation_steps;
  TS_CHECK(micro_steps_ % gas == 0, "save_checkpoint at micro-step ", micro_steps_ % gas, " of an accumulation window of ",
           gas, ": the gradients accumulated so far are not saved; save after the step() that ends the window");
  checkpoint::SaveSpec spec;
  spec.dir = dir;
  spec.tag = tag.empty() ? concat("global_step", global_steps_) : tag;
  checkpoint::join_save(*checkpoint_comm_, spec.dir, spec.tag);
  spec.joined = true;
  spec.keep_last = config_.checkpoint.keep_last;
  const zero::PartitionLayout layout = zero_->layout();
  // Stage 0 ranks hold identical copies of the whole state: data-parallel rank 0's is enough
  // (with expert parallelism, the first ep ranks': each holds other experts).
  // Views of the live buffers where possible (the save completes before anything changes
  // them); offloaded state streams from its store (Note [Streamed partitions]).
  if (layout.holds_own(groups_.dp->rank())) {
    auto part = zero_->export_partition_streamed();
    spec.tensors = std::move(part.resident);
    for (const auto& kind : part.streamed) spec.streamed.tensors.push_back({kind, at::kFloat, {layout.part_numel}});
    if (part.stream) {
      spec.streamed.produce = [stream = std::move(part.stream)](const checkpoint::StreamSink& sink) {
        stream([&](size_t k, const float* data, int64_t n) { sink(k, data, static_cast<size_t>(n) * sizeof(float)); });
      };
    }
  }
  const int world_rank = groups_.world->rank();
  spec.file = checkpoint::shard_file(world_rank);
  spec.rank_state = {{"rank", world_rank}, {"dp_rank", groups_.dp->rank()}, {"rng_cpu", checkpoint::cpu_rng_state()},
                     {"client_state", client_state}};
  // This rank's model slice (its pipeline stage and tensor-parallel part); rank 0 collects
  // every slice into the manifest.
  std::string slice;
  if (groups_.dp->rank() == 0) {
    const auto params = checkpoint::slice_params_of(zero_->param_shapes(), *root_, plan_);
    // Shard files are named by rank in the engine's world, which may be a part of MPI's: the
    // data-parallel ranks' MPI ranks are translated into it.
    const std::vector<int> mpi_world = groups_.world->world_ranks();
    std::vector<int> dp_ranks;
    for (int r : groups_.dp->world_ranks()) {
      const auto it = std::find(mpi_world.begin(), mpi_world.end(), r);
      TS_INTERNAL_ASSERT(it != mpi_world.end(), "data-parallel rank ", r, " is outside the engine's world");
      dp_ranks.push_back(static_cast<int>(it - mpi_world.begin()));
    }
    slice = checkpoint::slice_entry(groups_.coord.pp, groups_.coord.tp, layout, dp_ranks, params).dump();
  }
  const auto slices = comm::all_gather_strings(*checkpoint_comm_, slice);
  if (checkpoint_comm_->rank() == 0) {
    spec.manifest = {{"torchspeed_version", TORCHSPEED_VERSION},
                     {"config", config_.to_json()},
                     {"sections", config_.sections},
                     {"grid", {{"world", groups_.world->size()}, {"dp", groups_.dp->size()}, {"tp", config_.tp}, {"pp", config_.pp}}},
                     {"precision", precision::precision_name(precision_)},
                     {"optimizer", config_.optimizer.name()},
                     {"global_step", global_steps_},
                     {"engine", export_counters()}};
    checkpoint::add_slices(spec.manifest, slices);
  }
  return checkpoint::save(*checkpoint_comm_, spec);
}

std::optional<Engine::LoadedCheckpoint> Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  auto opened = checkpoint::open(*checkpoint_comm_, dir, tag);
  if (!opened) return std::nullopt;
  const nlohmann::json& m = opened->manifest;
  const std::string where = opened->path + "/manifest.json";
  std::optional<checkpoint::ShardSource> source;
  checkpoint::ShardSource::RangeReader read;
  // Every file this rank reads is verified (size, CRC-32C) and the manifest checked before
  // anything changes; ranks agree before importing. The partition is then read in ranges
  // straight into its buffers or store, never whole where it is offloaded (Note [Streamed
  // partitions]).
  std::string err = checkpoint::error_of([&] {
    const int pp = groups_.coord.pp, tp = groups_.coord.tp;
    checkpoint::check_compatible(*opened, {config_.tp, config_.pp, pp, tp, config_.optimizer.name(), zero_->param_shapes()});
    check_state(m.at("engine"));
    source.emplace(checkpoint::shard_source(*opened, pp, tp));
    read = source->reader(zero_->layout(), groups_.dp->rank());
  });
  checkpoint::agree(*checkpoint_comm_, concat("load_checkpoint('", opened->path, "')"), err);
  zero_->import_partition(read, m.at("engine").at("optimizer_steps").get<int64_t>());
  import_counters(m.at("engine"));
  // The RNG streams continue where they were; a job of another size takes rank r's when it exists.
  const auto& ranks = m.at("ranks");
  const size_t r = static_cast<size_t>(groups_.world->rank());
  if (r < ranks.size() && ranks[r].contains("rng_cpu"))
    checkpoint::set_cpu_rng_state(ranks[r]["rng_cpu"].get<std::string>(), where + " rng_cpu");
  const auto& cs = r < ranks.size() ? ranks[r] : ranks.at(0);
  return LoadedCheckpoint{opened->path, cs.value("client_state", nlohmann::json::object())};
}

std::vector<std::pair<std::string, at::Tensor>> Engine::master_params() {
  // gather_master is collective over the data-parallel group, gather_model over tp and pp.
  return checkpoint::gather_model(zero_->gather_master(), groups_, *root_, plan_);
}

bool Engine::save_16bit_model(const std::string& dir, const std::string& filename) {
  if (config_.zero.stage == 3 && !config_.zero.gather_16bit_weights_on_model_save) {
    log::warn0("save_16bit_model: nothing saved: at ZeRO stage 3 the weights are partitioned; set "
               "zero_optimization.stage3_gather_16bit_weights_on_model_save to gather them");
    return false;
  }
  auto params = master_params();  // collective: every rank takes part
  if (groups_.rank != 0) return true;
  const at::ScalarType dtype = precision_ == precision::Precision::kFP16 ? at::kHalf : compute_dtype();  // the training dtype
  checkpoint::save_model_file(dir + "/" + filename, params, dtype);
  return true;
}

}  // namespace torchspeed
