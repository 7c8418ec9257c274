// Building a StackSpec, whole or a range of it.
#include "torchspeed/nn/layer_spec.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "torchspeed/base/error.h"

namespace torchspeed::nn {
namespace {

// Seeds the default generator for one layer and restores its state when done.
class SeedScope {
 public:
  SeedScope() {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved_ = gen.get_state();
  }
  ~SeedScope() {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved_);
  }
  void seed(uint64_t s) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(s);
  }

 private:
  at::Tensor saved_;
};

}  // namespace

int64_t StackSpec::layer_params(size_t i) const {
  const LayerSpec& l = layers.at(i);
  if (l.num_params >= 0) return l.num_params;
  SeedScope scope;
  scope.seed(seed + i);
  int64_t n = 0;
  for (const auto& p : l.build({}).ptr()->parameters()) n += p.numel();
  return n;
}

LayerStack build(const StackSpec& spec, size_t begin, size_t end) {
  end = std::min(end, spec.size());
  TS_CHECK(begin <= end, "build: layer range [", begin, ", ", end, ") is empty or reversed");
  LayerStack stack;
  TiedTensors tied;
  SeedScope scope;
  for (size_t i = begin; i < end; ++i) {
    const LayerSpec& l = spec.layers[i];
    scope.seed(spec.seed + i);
    torch::nn::AnyModule m = l.build(tied);
    for (const auto& [param, key] : l.ties) {
      const auto params = m.ptr()->named_parameters(/*recurse=*/true);
      const at::Tensor* t = params.find(param);
      TS_CHECK(t, "layer '", l.name, "' ties parameter '", param, "', which it does not have");
      tied.emplace(key, *t);  // the first holder's tensor
    }
    stack->add_any(l.name, std::move(m));
  }
  if (spec.loss) stack->set_loss(spec.loss);
  if (spec.fused_loss && end == spec.size() && end > begin) stack->set_fused_loss(spec.fused_loss);
  return stack;
}

}  // namespace torchspeed::nn
