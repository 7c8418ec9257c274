// Training operators of the Llama-family blocks, each one autograd node with a hand-written
// forward and backward (Note [Fused block operators] in fused_ops.cpp): the same values as the
// composite ATen forms transformers spells out, in fewer passes over memory and without the
// zero-filled, added-up gradients that narrow/cat/repeat leave in backward. Inputs fp32, bf16 or
// fp16 (computed in fp32 inside), on the CPU; gradients flow to every input that requires them.
#pragma once

#include <ATen/ATen.h>

#include <array>

namespace torchspeed::nn {

// transformers' LlamaRMSNorm over the last dimension: weight * (x / sqrt(mean(x^2) + eps)), the
// normalised value rounded to x's dtype before the weight multiplies it. weight: [D], x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// SwiGLU over f's last dimension [gate | up] (2F wide): silu(gate) * up, [..., F].
at::Tensor swiglu(const at::Tensor& f);

// Attention's inputs from a fused projection qkv [B, T, (H + 2 KV) hd] (rows [q heads | k heads |
// v heads]): q, k, v as contiguous [B, H, T, hd], q and k rotated by positions 0..T-1 with the
// rotate-half tables cos/sin [>= T, hd / 2] (fp32; undefined: no rotation), each KV head repeated
// for its H / KV query heads (transformers' repeat_kv). Backward writes one [B, T, W] gradient.
std::array<at::Tensor, 3> split_qkv_rope(const at::Tensor& qkv, int64_t H, int64_t KV, int64_t hd, const at::Tensor& cos,
                                         const at::Tensor& sin);

}  // namespace torchspeed::nn
