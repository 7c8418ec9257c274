// Consolidated models: save, consolidate from shards, find and load.
#include "torchspeed/checkpoint/consolidated.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>

#include <filesystem>
#include <set>

#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/checkpoint/hf_gpt2.h"
#include "torchspeed/checkpoint/reshard.h"
#include "torchspeed/checkpoint/sharded.h"
#include "torchspeed/config/config.h"
#include "torchspeed/base/error.h"

namespace torchspeed::checkpoint {
namespace fs = std::filesystem;

void save_consolidated(const std::string& dir, const NamedTensors& params, const nlohmann::json& config,
                       int64_t step) {
  fs::create_directories(dir);
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

Model consolidate(const std::string& path) {
  const Opened o = open_local(path);
  const auto& m = o.manifest;
  Model out;
  out.params = full_state(o, "master");
  out.config = m.value("config", nlohmann::json::object());
  const nlohmann::json sections = m.value("sections", nlohmann::json::object());  // a named copy: items() refers to it
  for (const auto& [k, v] : sections.items()) out.config[k] = v;
  out.step = m.value("global_step", int64_t{0});
  out.source = o.path;
  return out;
}

Model load_model(const std::string& path) {
  const fs::path p(path);
  if (fs::is_regular_file(p) && gguf::is_gguf(path)) return gguf::load_gguf(path);
  if (fs::is_regular_file(p)) {
    auto f = load_safetensors(path);
    const auto it = f.metadata.find("config");
    TS_CHECK(it != f.metadata.end(), path, ": no \"config\" in the safetensors metadata; convert the checkpoint with ",
             "`torchspeed convert`, or pass the folder holding model.safetensors and config.json");
    Model m{std::move(f.tensors), nlohmann::json::parse(it->second), 0, path};
    if (f.metadata.count("step")) m.step = std::stoll(f.metadata["step"]);
    return m;
  }
  if (hf::is_hf_folder(path)) return hf::load_hf(path);
  if (fs::exists(p / "model.safetensors") && fs::exists(p / "config.json")) {
    const std::string file = (p / "model.safetensors").string();
    auto f = load_safetensors(file);
    Model m{std::move(f.tensors), config::read_json_file((p / "config.json").string()), 0, file};
    if (f.metadata.count("step")) m.step = std::stoll(f.metadata["step"]);
    return m;
  }
  if (fs::exists(p / "manifest.json") || fs::exists(p / "latest")) return consolidate(path);
  for (const char* sub : {"model", "checkpoints"}) {  // a run folder of `torchspeed train`
    if (fs::exists(p / sub)) return load_model((p / sub).string());
  }
  TS_CHECK(false, "'", path, "' holds no model: expected a .safetensors file, a folder with model.safetensors and ",
           "config.json, a training checkpoint (manifest.json or latest) or a run folder",
           fs::exists(p) ? "" : " (it does not exist)");
}

void load_into(nn::LayerStack& stack, const Model& model) {
  auto params = stack_parameters(stack);
  std::set<std::string> used;
  c10::NoGradGuard guard;
  for (auto& [name, p] : params) {
    const at::Tensor* src = nullptr;
    for (const auto& [n, t] : model.params)
      if (n == name) src = &t;
    TS_CHECK(src, model.source, ": no tensor for parameter '", name, "' (shape ", p.sizes(),
             "); the checkpoint was written for a different model");
    TS_CHECK(src->sizes() == p.sizes(), model.source, ": parameter '", name, "' has shape ", src->sizes(),
             " in the checkpoint but ", p.sizes(), " in the model");
    p.copy_(*src);
    used.insert(name);
  }
  for (const auto& [n, t] : model.params) {
    TS_CHECK(used.count(n), model.source, ": tensor '", n, "' matches no parameter of the model");
  }
}

}  // namespace torchspeed::checkpoint
