// bf16 x bf16 dot products with fp32 accumulation (AVX512-BF16), for bf16 and int8 serving
// weights on CPUs that have the instruction. See Note [bf16 dot products].
#pragma once

#include <cstdint>

namespace torchspeed::inference {

// An activation a serving linear applies to its output, after the bias: GELU with erf, or with
// tanh (`approximate="tanh"`), as torch's gelu.
enum class Activation { kNone, kGelu, kGeluTanh };
Activation activation_for_gelu(const char* approximate);  // "none" | "tanh"

// y[r, o] = act(y[r, o]) for rows [0, rows) x channels [o0, o1) of y [rows, N]: erf (or tanh)
// from exp, as torch's vectorized gelu computes it, to within 3e-7 of the exact function times
// max(1, |y|). Elementwise, the same bits for an element wherever it sits.
void activate(float* y, int64_t rows, int64_t N, int64_t o0, int64_t o1, Activation act);

// What a serving linear does to a block of its output [rows, N] x channels [o0, o1) while the
// block is in cache: y[r, o] += bias[o], then y = act(y), then residual[r, o] += y[r, o]. The
// bits of the adds are those of y.add_(bias) followed by residual.add_(y), one rounding each, for
// every row alike.
struct OutputStage {
  // Read without bounds: [N] and [rows, N] as given (ServingLinear checks its bias's length
  // against the weight, InferenceModel every tensor against the config).
  const float* bias = nullptr;  // [N], or none
  float* residual = nullptr;    // [rows, N], or none
  Activation act = Activation::kNone;
  void apply(float* y, int64_t rows, int64_t N, int64_t o0, int64_t o1) const {
    if (bias) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = o0; o < o1; ++o) y[r * N + o] += bias[o];
      }
    }
    if (act != Activation::kNone) activate(y, rows, N, o0, o1, act);
    if (residual) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = o0; o < o1; ++o) residual[r * N + o] += y[r * N + o];
      }
    }
  }
};

// Whether this CPU has AVX512-BF16 (VDPBF16PS).
bool have_bf16_dot();

// Each row of x [rows, K] fp32 rounded to bf16 (to nearest even, as PyTorch's cast) into out
// [rows, Kp], zero from K to Kp. Requires have_bf16_dot().
void round_rows_bf16(const float* x, int64_t rows, int64_t K, int64_t Kp, uint16_t* out);

// y[r, o] = sum_k bf16(x[r, k]) * w[o, k] in fp32, x [rows, K] fp32, w [N, K] bf16 bits, y
// [rows, N] fp32, then `stage`. Requires have_bf16_dot().
void bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const uint16_t* w, float* y,
                   const OutputStage& stage = {});
// The same with int8 weights (exact in bf16) and one fp32 scale per output channel:
// y[r, o] = scale[o] * sum_k bf16(x[r, k]) * w[o, k].
void int8_bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const int8_t* w, const float* scale, float* y,
                        const OutputStage& stage = {});

// 4-bit weights as quantize_q4 (linear.h) packs them, [N] channels of Kp = K rounded up to
// kQ4Align: qs [N, Kp / 2] nibbles, d [N, Kp / 32] fp16 scale bits, m the same of the minimums
// (Q4_1) or null (Q4_0) (Note [4-bit weights]): y[r, o] = sum_k bf16(x[r, k]) * w[o, k] in fp32,
// w = bf16(d (q - 8)) or bf16(d q + m), then `stage`. Requires have_bf16_dot().
constexpr int64_t kQ4Align = 64;
void q4_bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const uint8_t* qs, const uint16_t* d,
                      const uint16_t* m, float* y, const OutputStage& stage = {});

}  // namespace torchspeed::inference
