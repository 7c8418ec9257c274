// The optimizer's parameters: see named_params.h.
#include "torchspeed/zero/named_params.h"

#include <unordered_map>

#include "torchspeed/parallel/expert.h"
#include "torchspeed/base/error.h"

namespace torchspeed::zero {

ParamGroup no_weight_decay_group(bool embeddings) {
  ParamGroup g;
  g.options.weight_decay = 0.0;
  g.match = [embeddings](const std::string& name, const at::Tensor& p) {
    if (p.dim() <= 1) return true;  // biases, LayerNorm weights
    if (!embeddings) return false;
    auto ends_with = [&](const std::string& suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    return ends_with("tok.weight") || ends_with("pos.weight") || name.find("embed") != std::string::npos;
  };
  return g;
}

std::vector<NamedParam> collect_params(const torch::nn::Module& root, const nn::LayerStack& stack,
                                       const NormPolicy& counted, const std::vector<ParamGroup>& groups) {
  std::vector<NamedParam> out;
  std::unordered_map<const void*, size_t> seen;  // tied parameters appear once, where first used
  auto add = [&](const std::string& name, const at::Tensor& p, int layer) {
    if (!p.requires_grad()) return;
    auto [it, fresh] = seen.emplace(p.unsafeGetTensorImpl(), out.size());
    if (!fresh) {
      auto& first = out[it->second];
      if (layer >= 0 && layer != first.layer) first.also_used_by.push_back(layer);
      return;
    }
    int group = 0;  // the first group that claims it, else the optimizer's own
    for (size_t g = 0; g < groups.size() && group == 0; ++g)
      if (groups[g].match && groups[g].match(name, p)) group = static_cast<int>(g) + 1;
    out.push_back({name, p, layer, {}, !counted || counted(name, p), group, parallel::expert_parallel_size(p).has_value()});
  };
  if (stack) {
    for (size_t i = 0; i < stack->size(); ++i) {
      for (const auto& item : stack->layer_module(i)->named_parameters(/*recurse=*/true)) {
        add(stack->layer_name(i) + "." + item.key(), item.value(), static_cast<int>(i));
      }
    }
  } else {
    for (const auto& item : root.named_parameters(/*recurse=*/true)) add(item.key(), item.value(), -1);
  }
  TS_CHECK(!out.empty(), "the model has no trainable parameters");
  return out;
}

}  // namespace torchspeed::zero
