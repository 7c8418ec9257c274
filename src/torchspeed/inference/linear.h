// Linear layers for serving, with weights in fp32, bf16, int8 (weight-only, one fp32 scale per
// output channel, as ZeroQuant / LLM.int8-style serving stores them) or 4-bit (ggml's Q4_0 and
// Q4_1: groups of 32 with an fp16 scale, and for Q4_1 an fp16 minimum; Note [4-bit weights]). Computation is fp32
// whatever the storage: the kernels read the compact weights and widen them in registers, so
// decode, which is bound by the bytes of weights read per token, gets faster with the smaller
// formats even on CPUs without bf16 arithmetic. See Note [Serving linear kernels].
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "torchspeed/inference/linear_amx.h"
#include "torchspeed/inference/linear_bf16.h"

namespace torchspeed::inference {

enum class WeightFormat { kFP32, kBF16, kInt8, kQ4_0, kQ4_1 };
WeightFormat parse_weight_format(const std::string& s);  // "fp32" | "bf16" | "int8" | "q4_0" | "q4_1"
const char* weight_format_name(WeightFormat f);

// ggml's 4-bit quantization of w [N, K], per group of 32 along k: Q4_0 (quantize_row_q4_0_ref:
// d = the value of largest magnitude / -8 rounded to fp16, q = min(15, trunc(x / d + 8.5)), the
// value d (q - 8)) or, `with_min`, Q4_1 (quantize_row_q4_1_ref: d = (max - min) / 15 and m = min
// rounded to fp16, q = min(15, trunc((x - min) / d + 0.5)), the value d q + m), by the GGUF
// writer's encoder (checkpoint/gguf_writer.h), so the numbers are those of a GGUF file. Packed for
// q4_bf16_dot_rows: K padded with zeros to Kp (a multiple of kQ4Align), qs uint8 [N, Kp / 2]
// (byte j of each 64 k: k = j low nibble, k = 32 + j high), d and m int16 [N, Kp / 32] (fp16
// bits; m undefined for Q4_0).
struct Q4Weights {
  at::Tensor qs, d, m;
};
Q4Weights quantize_q4(const at::Tensor& w, bool with_min);
// The values the kernels multiply, fp32 [N, K]: bf16(d (q - 8)) or bf16(d q + m) (Note [4-bit
// weights]).
at::Tensor dequantize_q4(const Q4Weights& q, int64_t K);

class ServingLinear {
 public:
  ServingLinear() = default;
  // weight [out, in] (any floating dtype), bias [out] or undefined. `bf16_dot`: with bf16 or
  // int8 weights on a CPU with AVX512-BF16, round each input row to bf16 and multiply with bf16
  // dot products (int8 values are exact in bf16; fp32 accumulation and output; Note [bf16 dot
  // products]); elsewhere, or false, widen the weights to fp32 (4-bit formats then keep their values as bf16:
  // the same numbers, without the 4-bit kernel). `amx`: with bf16 dot products on a
  // CPU with AMX-BF16, store the weights in tile order and multiply on AMX tiles (Note [AMX
  // tiles]; the same rounding, other bits); false keeps the dot products.
  ServingLinear(const at::Tensor& weight, const at::Tensor& bias, WeightFormat format, bool bf16_dot = false,
                bool amx = true);

  // x [rows, in] fp32 contiguous -> [rows, out] fp32, bias added unless `add_bias` is false, then
  // `act` (inside the kernel, block by block, while the block is in cache). Rows [0,
  // row_kernel_rows) always go through the row kernel, so each of them gets the same bits
  // whatever else is in the batch; the rest use a GEMM when there are many of them.
  at::Tensor forward(const at::Tensor& x, int64_t row_kernel_rows, bool add_bias = true,
                     Activation act = Activation::kNone) const;
  // residual [rows, out] fp32 contiguous += forward(x, row_kernel_rows), bias included, added
  // block by block inside the kernel: the bits of forward followed by residual.add_().
  void forward_add(const at::Tensor& x, int64_t row_kernel_rows, at::Tensor& residual) const;
  void add_bias(at::Tensor& y) const;

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  int64_t weight_bytes() const;  // bytes read per pass over the weights (with scales)
  WeightFormat format() const { return format_; }
  bool bf16_dot() const { return bf16_dot_; }
  bool amx() const { return amx_; }
  // The weight as fp32 (dequantized), [out, in].
  at::Tensor dense_weight() const;

 private:
  at::Tensor run(const at::Tensor& x, int64_t row_kernel_rows, bool with_bias, float* residual, Activation act) const;
  void rows_kernel(const float* x, int64_t rows, float* y, const OutputStage& stage) const;
  WeightFormat format_ = WeightFormat::kFP32;
  bool bf16_dot_ = false;
  bool amx_ = false;
  int64_t in_ = 0, out_ = 0;
  at::Tensor w_;      // [out, in] in the storage dtype (int8 for kInt8); amx_pack's order with amx_
  at::Tensor scale_;  // [out] fp32, kInt8 only
  at::Tensor sums_;   // int32 channel sums of the packed int8 weights (amx_channel_sums), kInt8 with amx_
  at::Tensor q4_d_;   // 4-bit with bf16_dot_: fp16 group scales (w_ holds the nibbles, Q4Weights)
  at::Tensor q4_m_;   // kQ4_1 with bf16_dot_: fp16 group minimums
  at::Tensor bias_;   // [out] fp32 or undefined
};

// out [rows, d] = layer norm of each row of x [rows, d] (fp32, contiguous; biased variance, as
// at::layer_norm, rounded in its own order), times w plus b. Each row is computed alone, the
// same way in any batch.
void layer_norm_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, at::Tensor& out);

// out [rows, d] = RMS norm of each row of x [rows, d] (fp32, contiguous): x / sqrt(mean(x^2) +
// eps) times w, as Hugging Face's RMSNorm computes it in fp32. Each row alone, as above.
void rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out);

// Rows up to this count go through the row kernel; more use dequantize + GEMM (prefill).
constexpr int64_t kRowKernelMaxRows = 32;

}  // namespace torchspeed::inference
