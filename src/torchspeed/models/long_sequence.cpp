// Long sequences: DeepSpeed-Ulysses over a sequence-parallel group and ALST's tiling, as
// transforms of a GPT StackSpec (models/gpt.h): the layers' weights stay those gpt_spec builds,
// only how they run changes.
#include "torchspeed/models/gpt.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <functional>

#include "torchspeed/nn/tiled.h"
#include "torchspeed/parallel/sequence.h"
#include "torchspeed/base/error.h"

namespace torchspeed::models {

namespace {
// Wraps every layer's build with `adjust(layer name, built module)`.
void adjust_layers(nn::StackSpec& spec,
                   const std::function<void(const std::string&, const std::shared_ptr<torch::nn::Module>&)>& adjust) {
  for (auto& l : spec.layers) {
    l.build = [inner = l.build, adjust, name = l.name](const nn::TiedTensors& tied) {
      torch::nn::AnyModule m = inner(tied);
      adjust(name, m.ptr());
      return m;
    };
  }
}
}  // namespace

nn::StackSpec sequence_parallel(nn::StackSpec spec, const GPTConfig& c, comm::CommunicatorPtr sp) {
  if (!sp || sp->size() == 1) return spec;
  TS_CHECK(!c.moe.enabled(), "sequence_parallel_size ", sp->size(), " with model.moe: Mixture-of-Experts blocks are not ",
           "sequence-parallel (each rank's expert capacity and load-balancing loss would differ from the whole sequence's); "
           "use expert parallelism (model.moe.ep_size) or sequence_parallel_size 1");
  parallel::sequence_parallel_kv_heads(c.n_head, c.kv_heads(), sp->size());  // refuses heads that do not split
  adjust_layers(spec, [sp](const std::string& name, const std::shared_ptr<torch::nn::Module>& m) {
    if (auto e = std::dynamic_pointer_cast<GPTEmbeddingImpl>(m)) {
      e->sp = sp;
    } else if (auto b = std::dynamic_pointer_cast<GPTBlockImpl>(m)) {
      b->sp = sp;
    } else {
      TS_CHECK(std::dynamic_pointer_cast<GPTHeadImpl>(m), "sequence parallelism: layer '", name,
               "' is not a dense GPT layer (tensor parallelism does not combine with sequence_parallel_size)");
    }
  });
  return spec;
}

nn::StackSpec tiled(nn::StackSpec spec, const GPTConfig& c, int64_t mlp_tiles, int64_t loss_tiles) {
  if (mlp_tiles > 1) {
    TS_CHECK(!c.moe.enabled(), "torchspeed.tiled_mlp: the blocks are Mixture-of-Experts blocks, whose experts run on "
             "their routed tokens only; set tiled_mlp 0");
    adjust_layers(spec, [mlp_tiles](const std::string&, const std::shared_ptr<torch::nn::Module>& m) {
      if (auto b = std::dynamic_pointer_cast<GPTBlockImpl>(m)) {
        TS_CHECK(!b->lora, "torchspeed.tiled_mlp with a LoRA adapter is not implemented; set tiled_mlp 0");
        b->mlp_tiles = mlp_tiles;
      }
    });
  }
  if (loss_tiles > 1) {
    const int64_t vocab = c.vocab;
    // Cross-entropy summed per slice (each slice's logits made, used and freed inside its
    // checkpoint, and made again in its backward), divided by the token count: the mean.
    spec.fused_loss = [vocab, loss_tiles](const std::shared_ptr<torch::nn::Module>& last, const at::Tensor& x,
                                          const at::Tensor& target) {
      auto head = std::dynamic_pointer_cast<GPTHeadImpl>(last);
      TS_CHECK(head, "torchspeed.tiled_loss: the last layer is not the dense GPT head (tensor parallelism has a ",
               "vocabulary-parallel loss of its own; set tiled_loss 0)");
      TS_CHECK(x.dim() == 3 && target.dim() == 2 && target.size(0) == x.size(0) && target.size(1) == x.size(1),
               "tiled loss: hidden states ", x.sizes(), " and targets ", target.sizes(), " differ in batch or length");
      const int64_t B = x.size(0), T = x.size(1);
      const nn::TileFn piece = [head, target, vocab](const at::Tensor& h, int64_t start, int64_t length) {
        return torch::nn::functional::cross_entropy(
            head->forward(h).reshape({-1, vocab}).to(at::kFloat), target.narrow(1, start, length).reshape({-1}),
            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      };
      const at::Tensor total = nn::tiled(piece, x, head->parameters(), loss_tiles, nn::TileCombine::kSum);
      return total / static_cast<double>(B * T);
    };
  }
  return spec;
}

}  // namespace torchspeed::models
