// DeepSpeed-Ulysses sequence parallelism (Jacobs et al., 2023; DeepSpeed's
// sequence_parallel_size): each sequence is split into sequence_parallel_size consecutive shards,
// one per rank of a sequence-parallel group. Everything outside attention works on the rank's own
// tokens. Around attention, one all-to-all turns the rank's tokens x all heads into all tokens x
// its heads (sequence_to_heads), attention runs over the whole sequence for those heads, and
// the reverse all-to-all brings the rank's tokens x all heads back (heads_to_sequence).
//
// The sequence-parallel groups are consecutive ranks of the data-parallel group, which stays
// the group ZeRO reduces and partitions over (DeepSpeed's sequence-data-parallel group): every
// rank's gradient comes from its own tokens, and their mean over the data-parallel group is the
// gradient of the mean loss over every token of the global batch when each rank's loss is the
// mean over its own tokens (equal shards).
#pragma once

#include <ATen/core/Tensor.h>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/parallel/process_grid.h"

namespace torchspeed::parallel {

// Collective over the data-parallel group: makes groups.sp, `size` consecutive data-parallel
// ranks (size must divide the data-parallel size; 1 makes none).
void add_sequence_groups(ParallelGroups& groups, int size);

// KV heads each rank holds after the exchange: kv / P when P divides kv; 1 when kv divides P
// (a KV head replicated on the P / kv ranks whose query heads read it, as DeepSpeed's ALST
// does); otherwise an error naming both.
int64_t sequence_parallel_kv_heads(int64_t heads, int64_t kv_heads, int64_t ranks);

// qkv [B, T/P, (H + 2 KV) hd] (the fused projection of the rank's tokens, rows [q | k | v])
// -> [B, T, (H/P + 2 KV') hd], the same layout for the rank's H/P query heads and their KV'
// heads (sequence_parallel_kv_heads) over the whole sequence, in sequence order. Differentiable.
at::Tensor sequence_to_heads(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             const comm::CommunicatorPtr& group);

// a [B, T, H/P hd] (attention's output for the rank's heads) -> [B, T/P, H hd] (the rank's
// tokens, every head in order). Differentiable.
at::Tensor heads_to_sequence(const at::Tensor& a, const comm::CommunicatorPtr& group);

// The rank's shard of a [B, T] batch (tokens or targets): columns [r T/P, (r + 1) T/P).
at::Tensor sequence_shard(const at::Tensor& x, const comm::CommunicatorPtr& group);

}  // namespace torchspeed::parallel
