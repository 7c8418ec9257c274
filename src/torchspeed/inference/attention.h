// Attention of one new token per sequence over its cached keys and values, read in place from
// the paged cache through the sequence's slot list (no gather): what every decode step runs.
#pragma once

#include <cstdint>

namespace torchspeed::inference {

struct DecodeAttentionItem {
  const float* q;        // [heads, head_dim] of this sequence's new token
  const int64_t* slots;  // cache slots of positions 0 .. length-1
  int64_t length;        // positions attended to (the new token's included)
  float* out;            // [heads, head_dim]
};

// How the cache stores a key or value element: fp32, bf16 bits, or int8 with one fp32 scale per
// (slot, KV head) row (the element is q * scale).
enum class KVType { kFP32, kBF16, kInt8 };

// q, out: [heads, head_dim]; keys, values: [slots, kv_heads, head_dim] of `type`; with kInt8,
// key_scales and value_scales [slots, kv_heads]. Query head h reads KV head h / (heads /
// kv_heads) (grouped-query attention; kv_heads == heads for multi-head attention). Arithmetic in
// fp32, softmax with the maximum subtracted (an int8 key's dot product times its scale, an int8
// value times its weight times its scale); each (sequence, head) pair is a task, so results do
// not depend on the batch.
void decode_attention(const DecodeAttentionItem* items, int64_t n_items, const void* keys, const void* values,
                      KVType type, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                      const float* key_scales = nullptr, const float* value_scales = nullptr);

}  // namespace torchspeed::inference
