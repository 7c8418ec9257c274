#include "torchspeed/nn/token_drop.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "torchspeed/base/error.h"

namespace torchspeed::nn {

at::Tensor run_on_kept_tokens(const at::Tensor& x, int64_t keep, const std::function<at::Tensor(const at::Tensor&)>& layer) {
  const int64_t B = x.size(0), T = x.size(1);
  if (keep <= 0 || keep >= T) return layer(x);
  const at::Tensor index = std::get<0>(at::multinomial(at::ones({B, T}), keep, /*replacement=*/false).sort(-1));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[1] = keep;
  auto expand = [&](const at::Tensor& i) {
    at::Tensor e = i;
    for (int64_t d = 2; d < x.dim(); ++d) e = e.unsqueeze(-1);
    return e.expand(shape);
  };
  const at::Tensor full_index = expand(index);
  const at::Tensor out = layer(x.gather(1, full_index));
  TS_CHECK(out.sizes() == at::IntArrayRef(shape), "random_ltd: the layer changed the kept tokens' shape ", shape, " to ",
           out.sizes());
  return x.scatter(1, full_index, out);
}

RandomLtd::RandomLtd(const config::RandomLtdConfig& config, LayerStack& stack, bool whole_model) : config_(config) {
  int64_t count = -1;
  for (size_t i = 0; i < stack->size(); ++i) {
    auto* d = dynamic_cast<TokenDroppable*>(stack->layer_module(i).get());
    if (!d) continue;
    count = d->droppable_count();
    if (std::find(config_.layer_ids.begin(), config_.layer_ids.end(), d->droppable_index()) != config_.layer_ids.end()) {
      layers_.push_back(d);
    }
  }
  if (count < 0 && !whole_model) return;
  TS_CHECK(count >= 0, "data_efficiency.data_routing.random_ltd: the model has no layers that can drop tokens "
                       "(GPT's blocks can, without tensor parallelism)");
  TS_CHECK(config_.total_layer_num == count, "data_efficiency.data_routing.random_ltd.total_layer_num: ",
           config_.total_layer_num, ", but the model has ", count, " layers");
  for (int64_t id : config_.layer_ids) {
    TS_CHECK(id < count, "data_efficiency.data_routing.random_ltd.random_ltd_layer_id: layer ", id,
             " is beyond the model's ", count, " layers (0 to ", count - 1, ")");
  }
  update(0);
}

void RandomLtd::update(int64_t global_steps) {
  kept_ = config_.kept(global_steps);
  for (auto* l : layers_) l->kept_tokens = kept_;
}

}  // namespace torchspeed::nn
