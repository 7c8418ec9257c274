// Matrix products on Intel AMX tiles for bf16 (TDPBF16PS) and int8 (TDPBSSD/TDPBUSD) serving
// weights, on CPUs that have AMX-BF16 and AMX-INT8. See Note [AMX tiles].
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "torchspeed/inference/linear_bf16.h"

namespace torchspeed::inference {

// Whether this CPU has AMX-BF16 and AMX-INT8 and the kernel lets this process use the tile
// registers (asked for once, with arch_prctl(ARCH_REQ_XCOMP_PERM)).
bool have_amx();

// w [N, K] bf16 or int8 -> the same values in AMX's B-tile order: 16 output channels by 32 (bf16)
// or 64 (int8) k per 1 KB tile (16 rows of k pairs or quads x 16 channels), [strip, k tile, row,
// channel, pair or quad], tiles of a 16-channel strip one after the other along k; N and K padded
// with zeros to multiples of 16 and of 32 or 64.
at::Tensor amx_pack(const at::Tensor& w);
// The inverse: packed -> [N, K] in the packed dtype.
at::Tensor amx_unpack(const at::Tensor& packed, int64_t N, int64_t K);

// int8 weights packed by amx_pack -> each output channel's sum of weights, int32 [N padded to
// 16]: the VNNI path for a few rows needs them (Note [AMX tiles]).
at::Tensor amx_channel_sums(const at::Tensor& packed);

// Whether this CPU has AVX512-VNNI (VPDPBUSD).
bool have_avx512_vnni();

// Up to this many rows, int8 weights are multiplied with VPDPBUSD rather than on tiles (where
// the CPU has AVX512-VNNI): the same exact integer sums, a fraction of the time.
constexpr int64_t kVnniRows = 4;

// y [rows, N] fp32 = x [rows, K] fp32 times w packed by amx_pack, then `stage`. bf16 weights:
// sum_k bf16(x[r, k]) * w[o, k] in fp32. int8 weights: the row as 16-bit fixed point times w,
// summed exactly, times the row's step and scale[o] (Note [AMX tiles]); `sums` from
// amx_channel_sums (int8 only). Requires have_amx().
void amx_dot_rows(const float* x, int64_t rows, int64_t K, int64_t N, const at::Tensor& packed, const float* scale,
                  const int32_t* sums, float* y, const OutputStage& stage = {});

}  // namespace torchspeed::inference
