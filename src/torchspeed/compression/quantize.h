// Quantization-aware training's pieces below the models: DeepSpeed's quantizers as
// quantize-dequantize ("fake quantization") with a straight-through gradient, the state of one
// compressible layer (a linear layer or an embedding), and the interface a model layer offers so
// that compression/schedule.h can find its compressible layers by name.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torchspeed::compression {

// DeepSpeed's quantizers on `x` cut into `groups` equal contiguous groups (x.reshape(groups,
// -1)), each with its own scale, returned dequantized in x's dtype (the math in fp32):
//   bits >= 3, symmetric:  scale = 2 max|x| / 2^bits, round(x / scale) clamped to
//                          [-2^(bits-1), 2^(bits-1) - 1], times scale (SymQuantizer);
//   bits >= 3, asymmetric: scale = (max - min) / 2^bits, zero point round(min / scale) scale,
//                          clamped to [0, 2^bits - 1] (AsymQuantizer);
//   bits 2: ternary, +-alpha where |x| > 0.7 mean|x| (TernaryQuantizer);
//   bits 1: binary, sign(x) mean|x| (BinaryQuantizer).
// `noise` (stochastic rounding, MoQ's "rounding": "stochastic"): uniform in [-0.5, 0.5), shaped
// like x, added before rounding; undefined for round-to-nearest. No gradient flows through it.
at::Tensor quantize(const at::Tensor& x, int bits, int64_t groups, bool symmetric, const at::Tensor& noise = {});

// What a forward pass sees of x when it is quantized to q: q's values, x's gradient (DeepSpeed's
// quantizers' backward returns the incoming gradient unchanged: a straight-through estimator).
at::Tensor straight_through(const at::Tensor& x, const at::Tensor& q);

// How one compressible layer is quantized in the next forward passes (set by the schedule).
struct SiteState {
  // Weights: 0 = not quantized.
  int weight_bits = 0;
  int64_t weight_groups = 1;
  bool weight_symmetric = true;
  bool weight_stochastic = false;
  // MoQ's fp16_mixed_quantize: the forward weight is ratio * w + (1 - ratio) * q(w).
  bool weight_mixed = false;
  double weight_keep_ratio = 0.0;
  // Activations (the layer's input), each token with its own range; 0 = not quantized.
  int input_bits = 0;
  bool input_symmetric = true;
  std::string name;          // the layer's full name, for errors
  std::string groups_key;    // the config key of weight_groups, for errors

  bool active() const { return weight_bits > 0 || input_bits > 0; }
};

// The weight a forward pass uses: `w` quantized as `s` says (straight through), or `w`.
at::Tensor weight_of(const SiteState& s, const at::Tensor& w);
// The input a linear layer uses: `x` quantized per token as `s` says (straight through), or `x`.
at::Tensor input_of(const SiteState& s, const at::Tensor& x);

// A compressible layer inside a model layer, as a model describes it.
struct Site {
  enum class Kind { kLinear, kEmbedding };
  std::string name;                  // within the model layer ("qkv", "tok")
  std::vector<std::string> aliases;  // full names the same layer has elsewhere (GPT-2's "transformer.h.0.attn.c_attn")
  Kind kind = Kind::kLinear;
  int64_t rows = 0;                  // the weight's rows (an embedding's tokens)
  SiteState* state = nullptr;        // owned by the model layer
  // Hugging Face's separate layers fused into this one, by full name (Llama's
  // "model.layers.0.self_attn.q_proj", k_proj, v_proj for our qkv): a config group that names
  // all of them quantizes the fused layer; one that names only some is refused.
  std::vector<std::string> parts;
};

// Implemented by model layers (GPT's embedding, blocks and untied head) that can be compressed.
class Compressible {
 public:
  virtual ~Compressible() = default;
  virtual std::vector<Site> compression_sites() = 0;
};

}  // namespace torchspeed::compression
