// Gathering the whole model: see model_gather.h.
#include "torchspeed/checkpoint/model_gather.h"

#include <nlohmann/json.hpp>

#include <filesystem>

#include "torchspeed/tensor_parallel/layers.h"

namespace torchspeed::checkpoint {

NamedTensors gather_model(NamedTensors local, const parallel::ParallelGroups& groups,
                          const torch::nn::Module& model, const pipeline::StagePlan& plan) {
  comm::Communicator& tp = *groups.tp;
  if (tp.size() > 1) {  // whole tensors from the tensor-parallel slices
    const auto named = model.named_parameters(/*recurse=*/true);
    for (auto& [name, t] : local) {
      const at::Tensor* p = named.find(name);
      const auto split = p ? tensor_parallel::split_of(*p) : std::nullopt;
      if (!split) continue;
      at::Tensor all = at::empty({tp.size() * t.numel()}, at::kFloat);
      tp.all_gather(t.contiguous().view({-1}), all);
      std::vector<at::Tensor> parts;  // rank order
      for (const auto& c : all.chunk(tp.size())) parts.push_back(c.view(t.sizes()));
      t = tensor_parallel::merge(parts, *split);
    }
  }
  if (plan.stages == 1) return local;
  NamedTensors mine;
  for (auto& [name, t] : local)
    if (!plan.is_copy(name)) mine.emplace_back(name, t);
  // Each stage shares its parameters with the others of its pipeline: names and shapes first.
  comm::Communicator& pp = *groups.pp;
  NamedTensors all;
  for (int s = 0; s < plan.stages; ++s) {
    std::string header;
    if (s == plan.stage) {
      nlohmann::json h = nlohmann::json::array();
      for (const auto& [name, t] : mine) h.push_back({name, t.sizes().vec()});
      header = h.dump();
    }
    const auto headers = comm::all_gather_strings(pp, header);
    size_t next = 0;
    for (const auto& item : nlohmann::json::parse(headers[static_cast<size_t>(s)])) {
      at::Tensor t = s == plan.stage ? mine[next++].second.contiguous()
                                     : at::empty(item.at(1).get<std::vector<int64_t>>(), at::kFloat);
      pp.broadcast(t, s);
      all.emplace_back(item.at(0).get<std::string>(), t);
    }
  }
  return all;
}

void save_model_file(const std::string& path, const NamedTensors& params, at::ScalarType dtype) {
  NamedTensors out;
  for (const auto& [name, t] : params) out.emplace_back(name, t.to(dtype).contiguous());
  const auto folder = std::filesystem::path(path).parent_path();
  if (!folder.empty()) std::filesystem::create_directories(folder);
  save_safetensors(path, out, {{"format", "pt"}});
}

}  // namespace torchspeed::checkpoint
