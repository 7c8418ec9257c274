// Engine::save_checkpoint / load_checkpoint: what a checkpoint holds (the manifest's fields and
// each rank's shard) and how it maps onto this engine, resharding when the data-parallel size or
// ZeRO stage changed. The protocol itself is checkpoint/sharded.cpp's.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "torchspeed/checkpoint/reshard.h"
#include "torchspeed/checkpoint/sharded.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/logging.h"
#include "torchspeed/tensor_parallel/layers.h"

#ifndef TORCHSPEED_VERSION
#define TORCHSPEED_VERSION "unknown"
#endif

namespace torchspeed {
namespace {

std::string shard_file(int world_rank) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank%05d.safetensors", world_rank);
  return buf;
}

std::string rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor s;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    s = gen.get_state();
  }
  return checkpoint::to_hex(s.data_ptr(), static_cast<size_t>(s.numel()));
}

void set_rng_state(const std::string& hex, const std::string& what) {
  const std::string bytes = checkpoint::from_hex(hex, what);
  at::Tensor s = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(s.data_ptr(), bytes.data(), bytes.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

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
  // Views of the live buffers where possible: the save completes before anything changes them.
  spec.tensors = zero_->export_partition(/*copy=*/false);
  const nlohmann::json state = export_counters();
  const zero::PartitionLayout layout = zero_->layout();
  // Stage 0 ranks hold identical copies of the whole state: data-parallel rank 0's is enough.
  if (layout.stage == 0 && groups_.dp->rank() != 0) spec.tensors.clear();
  const int world_rank = groups_.world->rank();
  spec.file = shard_file(world_rank);
  spec.rank_state = {{"rank", world_rank}, {"dp_rank", groups_.dp->rank()}, {"rng_cpu", rng_state()},
                     {"client_state", client_state}};
  // This rank's model slice (its pipeline stage and tensor-parallel part): layout, shard files,
  // parameters. Rank 0 collects every slice into the manifest.
  nlohmann::json slice;
  if (groups_.dp->rank() == 0) {
    nlohmann::json files = nlohmann::json::array();
    const auto& members = groups_.dp->world_ranks();
    for (size_t r = 0; r < members.size(); ++r) files.push_back(layout.stage == 0 && r > 0 ? "" : shard_file(members[r]));
    nlohmann::json params = nlohmann::json::array();
    const auto named = root_->named_parameters(/*recurse=*/true);
    for (const auto& [name, shape] : zero_->param_shapes()) {
      nlohmann::json p = {{"name", name}, {"shape", shape}};
      for (const auto& t : plan_.ties)
        if (t.param == name && !t.owner) p["copy"] = true;  // a tied weight's later copy
      // How tensor-parallel slices join into the whole parameter.
      if (const at::Tensor* param = named.find(name)) {
        if (const auto split = tensor_parallel::split_of(*param)) p["tp_split"] = {split->dim, split->chunks};
      }
      params.push_back(p);
    }
    slice = {{"pp", groups_.coord.pp}, {"tp", groups_.coord.tp}, {"layout", layout.to_json()}, {"files", files},
             {"params", params}};
  }
  const auto slices = comm::all_gather_strings(*checkpoint_comm_, slice.is_null() ? "" : slice.dump());
  if (checkpoint_comm_->rank() == 0) {
    nlohmann::json all = nlohmann::json::array(), params = nlohmann::json::array();
    for (const auto& text : slices) {
      if (text.empty()) continue;
      all.push_back(nlohmann::json::parse(text));
      for (const auto& p : all.back()["params"]) params.push_back(p);
    }
    spec.manifest = {{"torchspeed_version", TORCHSPEED_VERSION},
                     {"config", config_.to_json()},
                     {"sections", config_.sections},
                     {"grid", {{"world", groups_.world->size()}, {"dp", groups_.dp->size()}, {"tp", config_.tp}, {"pp", config_.pp}}},
                     {"precision", precision::precision_name(precision_)},
                     {"optimizer", config_.optimizer.type},
                     {"global_step", global_steps_},
                     {"engine", state},
                     {"params", params},
                     {"zero", {{"slices", all}}}};
  }
  return checkpoint::save(*checkpoint_comm_, spec);
}

std::optional<Engine::LoadedCheckpoint> Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  auto opened = checkpoint::open(*checkpoint_comm_, dir, tag);
  if (!opened) return std::nullopt;
  const nlohmann::json& m = opened->manifest;
  const std::string where = opened->path + "/manifest.json";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  // Everything is read and checked before anything changes; ranks agree before importing.
  std::string err = checkpoint::error_of([&] {
    const auto& g = m.at("grid");
    TS_CHECK(g.value("tp", 1) == config_.tp && g.value("pp", 1) == config_.pp, where, ": saved with tp ",
             g.value("tp", 1), " x pp ", g.value("pp", 1), "; this job runs tp ", config_.tp, " x pp ", config_.pp,
             ". Only the data-parallel size and ZeRO stage may change between save and load");
    const std::string opt = m.value("optimizer", "");
    TS_CHECK(opt == config_.optimizer.type, where, ": saved with optimizer ", opt, ", this job uses ",
             config_.optimizer.type, "; their states differ");
    const int pp = groups_.coord.pp, tp = groups_.coord.tp;
    std::map<std::string, std::vector<int64_t>> saved;
    for (auto& [name, shape] : checkpoint::slice_params(*opened, pp, tp)) saved[name] = std::move(shape);
    const auto mine = zero_->param_shapes();
    for (const auto& [name, shape] : mine) {
      const auto it = saved.find(name);
      TS_CHECK(it != saved.end(), where, ": the model's parameter '", name, "' (shape ", shape_str(shape),
               ") is not in the checkpoint; it was written for a different model");
      TS_CHECK(it->second == shape, where, ": parameter '", name, "' has shape ", shape_str(it->second),
               " in the checkpoint but ", shape_str(shape), " in the model");
      saved.erase(it);
    }
    TS_CHECK(saved.empty(), where, ": the checkpoint's parameter '", saved.empty() ? "" : saved.begin()->first,
             "' is not in the model; it was written for a different model");
    auto source = checkpoint::shard_source(*opened, pp, tp);
    std::vector<std::string> kinds{"master"};
    for (const auto& k : zero_->state_kinds()) kinds.push_back(k);
    tensors = source.partition(zero_->layout(), groups_.dp->rank(), kinds);
  });
  checkpoint::agree(*checkpoint_comm_, concat("load_checkpoint('", opened->path, "')"), err);
  import_state(m.at("engine"), std::move(tensors));
  // The RNG streams continue where they were; a job of another size takes rank r's when it exists.
  const auto& ranks = m.at("ranks");
  const size_t r = static_cast<size_t>(groups_.world->rank());
  if (r < ranks.size() && ranks[r].contains("rng_cpu"))
    set_rng_state(ranks[r]["rng_cpu"].get<std::string>(), where + " rng_cpu");
  const auto& cs = r < ranks.size() ? ranks[r] : ranks.at(0);
  return LoadedCheckpoint{opened->path, cs.value("client_state", nlohmann::json::object())};
}

bool Engine::save_16bit_model(const std::string& dir, const std::string& filename) {
  if (config_.zero.stage == 3 && !config_.zero.gather_16bit_weights_on_model_save) {
    log::warn0("save_16bit_model: nothing saved: at ZeRO stage 3 the weights are partitioned; set "
               "zero_optimization.stage3_gather_16bit_weights_on_model_save to gather them");
    return false;
  }
  auto params = master_params();  // collective: every rank takes part
  if (groups_.rank != 0) return true;
  const at::ScalarType dtype = precision_ == precision::Precision::kBF16   ? at::kBFloat16
                               : precision_ == precision::Precision::kFP16 ? at::kHalf
                                                                           : at::kFloat;
  checkpoint::NamedTensors out;
  for (auto& [name, t] : params) out.emplace_back(name, t.to(dtype).contiguous());
  std::filesystem::create_directories(dir);
  checkpoint::save_safetensors(dir + "/" + filename, out, {{"format", "pt"}});
  return true;
}

}  // namespace torchspeed
