// Training checkpoints' contents: see training_state.h.
#include "torchspeed/checkpoint/training_state.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "torchspeed/checkpoint/reshard.h"
#include "torchspeed/base/error.h"

namespace torchspeed::checkpoint {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

std::string shard_file(int world_rank) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank%05d.safetensors", world_rank);
  return buf;
}

std::string cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor s;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    s = gen.get_state();
  }
  return to_hex(s.data_ptr(), static_cast<size_t>(s.numel()));
}

void set_cpu_rng_state(const std::string& hex, const std::string& what) {
  const std::string bytes = from_hex(hex, what);
  at::Tensor s = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(s.data_ptr(), bytes.data(), bytes.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

std::vector<SliceParam> slice_params_of(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                                        const torch::nn::Module& model, const pipeline::StagePlan& plan) {
  std::vector<SliceParam> out;
  const auto named = model.named_parameters(/*recurse=*/true);
  for (const auto& [name, shape] : shapes) {
    const at::Tensor* p = named.find(name);
    out.push_back({name, shape, plan.is_copy(name), p ? tensor_parallel::split_of(*p) : std::nullopt});
  }
  return out;
}

nlohmann::json slice_entry(int pp, int tp, const zero::PartitionLayout& layout,
                           const std::vector<int>& dp_world_ranks, const std::vector<SliceParam>& params) {
  nlohmann::json files = nlohmann::json::array();
  for (size_t r = 0; r < dp_world_ranks.size(); ++r)
    files.push_back(layout.holds_own(static_cast<int>(r)) ? shard_file(dp_world_ranks[r]) : "");
  nlohmann::json ps = nlohmann::json::array();
  for (const auto& p : params) {
    nlohmann::json j = {{"name", p.name}, {"shape", p.shape}};
    if (p.copy) j["copy"] = true;
    if (p.split) {
      j["tp_split"] = {p.split->dim, p.split->chunks};
      if (!p.split->sections.empty()) j["tp_split"].push_back(p.split->sections);
    }
    ps.push_back(std::move(j));
  }
  return {{"pp", pp}, {"tp", tp}, {"layout", layout.to_json()}, {"files", files}, {"params", ps}};
}

void add_slices(nlohmann::json& manifest, const std::vector<std::string>& entries) {
  nlohmann::json slices = nlohmann::json::array(), params = nlohmann::json::array();
  for (const auto& text : entries) {
    if (text.empty()) continue;
    slices.push_back(nlohmann::json::parse(text));
    for (const auto& p : slices.back()["params"]) params.push_back(p);
  }
  manifest["params"] = std::move(params);
  manifest["zero"] = {{"slices", std::move(slices)}};
}

void check_compatible(const Opened& checkpoint, const LoadTarget& job) {
  const std::string where = checkpoint.path + "/manifest.json";
  const nlohmann::json& m = checkpoint.manifest;
  const auto& g = m.at("grid");
  TS_CHECK(g.value("tp", 1) == job.tp_size && g.value("pp", 1) == job.pp_size, where, ": saved with tp ",
           g.value("tp", 1), " x pp ", g.value("pp", 1), "; this job runs tp ", job.tp_size, " x pp ", job.pp_size,
           ". Only the data-parallel size and ZeRO stage may change between save and load");
  const std::string opt = m.value("optimizer", "");
  TS_CHECK(opt == job.optimizer, where, ": saved with optimizer ", opt, ", this job uses ", job.optimizer,
           "; their states differ");
  std::map<std::string, std::vector<int64_t>> saved;
  for (auto& [name, shape] : slice_params(checkpoint, job.pp, job.tp)) saved[name] = std::move(shape);
  for (const auto& [name, shape] : job.params) {
    const auto it = saved.find(name);
    TS_CHECK(it != saved.end(), where, ": the model's parameter '", name, "' (shape ", shape_str(shape),
             ") is not in the checkpoint; it was written for a different model");
    TS_CHECK(it->second == shape, where, ": parameter '", name, "' has shape ", shape_str(it->second),
             " in the checkpoint but ", shape_str(shape), " in the model");
    saved.erase(it);
  }
  TS_CHECK(saved.empty(), where, ": the checkpoint's parameter '", saved.empty() ? "" : saved.begin()->first,
           "' is not in the model; it was written for a different model");
}

}  // namespace torchspeed::checkpoint
