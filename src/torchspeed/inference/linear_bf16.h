// bf16 x bf16 dot products with fp32 accumulation (AVX512-BF16), for bf16 and int8 serving
// weights on CPUs that have the instruction. See Note [bf16 dot products].
#pragma once

#include <cstdint>

namespace torchspeed::inference {

// Whether this CPU has AVX512-BF16 (VDPBF16PS).
bool have_bf16_dot();

// y[r, o] = sum_k bf16(x[r, k]) * w[o, k] in fp32, x [rows, K] fp32, w [N, K] bf16 bits, y
// [rows, N] fp32. Requires have_bf16_dot().
void bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const uint16_t* w, float* y);
// The same with int8 weights (exact in bf16) and one fp32 scale per output channel:
// y[r, o] = scale[o] * sum_k bf16(x[r, k]) * w[o, k].
void int8_bf16_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const int8_t* w, const float* scale, float* y);

}  // namespace torchspeed::inference
