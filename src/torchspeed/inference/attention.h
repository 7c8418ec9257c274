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

// q, out: [heads, head_dim]; keys, values: [slots, kv_heads, head_dim], fp32 or (`bf16`) bf16
// bits; query head h reads KV head h / (heads / kv_heads) (grouped-query attention; kv_heads ==
// heads for multi-head attention). Arithmetic in fp32, softmax with the maximum subtracted; each
// (sequence, head) pair is a task, so results do not depend on the batch.
void decode_attention(const DecodeAttentionItem* items, int64_t n_items, const void* keys, const void* values,
                      bool bf16, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale);

}  // namespace torchspeed::inference
