// Consolidated checkpoints: save, load, parameter naming.
#include "torchspeed/checkpoint/consolidated.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <set>

#include "torchspeed/config/config.h"
#include "torchspeed/runtime/error.h"

namespace torchspeed::checkpoint {

void save_consolidated(const std::string& dir, const NamedTensors& params, const nlohmann::json& config,
                       int64_t step) {
  std::filesystem::create_directories(dir);
  save_safetensors(dir + "/model.safetensors", params,
                   {{"format", "pt"}, {"producer", "torchspeed"}, {"step", std::to_string(step)}});
  write_file_atomic(dir + "/config.json", config.dump(2) + "\n");
}

NamedTensors stack_parameters(nn::LayerStack& stack) {
  NamedTensors out;
  std::set<const void*> seen;
  for (size_t i = 0; i < stack->size(); ++i) {
    for (const auto& item : stack->layer_module(i)->named_parameters(/*recurse=*/true)) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
      out.emplace_back(stack->layer_name(i) + "." + item.key(), item.value());
    }
  }
  return out;
}

void load_into(nn::LayerStack& stack, const std::string& dir) {
  const std::string path = dir + "/model.safetensors";
  auto file = load_safetensors(path);
  auto params = stack_parameters(stack);
  std::set<std::string> used;
  at::NoGradGuard guard;
  for (auto& [name, p] : params) {
    const at::Tensor* src = nullptr;
    for (const auto& [n, t] : file.tensors)
      if (n == name) src = &t;
    TS_CHECK(src, path, ": no tensor for parameter '", name, "' (shape ", p.sizes(),
             "); the checkpoint was written for a different model");
    TS_CHECK(src->sizes() == p.sizes(), path, ": parameter '", name, "' has shape ", src->sizes(),
             " in the checkpoint but ", p.sizes(), " in the model");
    p.copy_(*src);
    used.insert(name);
  }
  for (const auto& [n, t] : file.tensors) {
    TS_CHECK(used.count(n), path, ": tensor '", n, "' matches no parameter of the model");
  }
}

nlohmann::json load_config(const std::string& dir) { return config::read_json_file(dir + "/config.json"); }

}  // namespace torchspeed::checkpoint
