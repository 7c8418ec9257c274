// Ulysses' exchanges: see sequence.h.
#include "torchspeed/parallel/sequence.h"

#include <ATen/ATen.h>

#include "torchspeed/parallel/expert.h"
#include "torchspeed/base/error.h"

namespace torchspeed::parallel {

void add_sequence_groups(ParallelGroups& g, int size) {
  TS_CHECK(size >= 1 && g.dp && g.dp->size() % size == 0, "sequence_parallel_size ", size,
           " must divide the data-parallel size ", g.dp ? g.dp->size() : 0,
           " (each sequence splits over that many data-parallel ranks)");
  TS_CHECK(!g.sp, "the sequence-parallel groups exist already");
  if (size == 1) return;
  const int d = g.dp->rank();
  g.sp = g.dp->split(d / size, d % size, "sp");
}

int64_t sequence_parallel_kv_heads(int64_t heads, int64_t kv, int64_t ranks) {
  TS_CHECK(heads % ranks == 0, "sequence_parallel_size ", ranks, " must divide the attention heads (n_head ", heads,
           "): each rank attends with n_head / sequence_parallel_size heads");
  if (kv % ranks == 0) return kv / ranks;
  TS_CHECK(ranks % kv == 0, "sequence_parallel_size ", ranks, " and the KV heads (n_kv_head ", kv,
           ") must divide one another: KV heads split over the ranks, or each is replicated on ranks / n_kv_head ranks");
  return 1;
}

namespace {
// All-to-all of equal parts: x [P, ...] sends x[j] to rank j; returns [P, ...] with row i from
// rank i.
at::Tensor exchange_equal(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  const std::vector<int64_t> ones(static_cast<size_t>(group->size()), 1);
  return all_to_all(x, group, ones, ones);
}
}  // namespace

at::Tensor sequence_to_heads(const at::Tensor& qkv, int64_t H, int64_t KV, int64_t hd, const comm::CommunicatorPtr& group) {
  const int64_t P = group->size();
  TS_CHECK(qkv.dim() == 3 && qkv.size(2) == (H + 2 * KV) * hd, "sequence_to_heads: qkv of shape ", qkv.sizes(),
           " is not [batch, tokens, (", H, " + 2 x ", KV, ") x ", hd, "]");
  const int64_t B = qkv.size(0), Tl = qkv.size(1), kvl = sequence_parallel_kv_heads(H, KV, P);
  // Per destination rank j: its query heads, then its KV heads (a KV head replicated on the
  // ranks whose query heads read it when there are fewer KV heads than ranks).
  at::Tensor q = qkv.narrow(2, 0, H * hd).view({B, Tl, P, (H / P) * hd});
  at::Tensor k = qkv.narrow(2, H * hd, KV * hd), v = qkv.narrow(2, (H + KV) * hd, KV * hd);
  if (KV < P) {
    k = k.view({B, Tl, KV, hd}).repeat_interleave(P / KV, 2);
    v = v.view({B, Tl, KV, hd}).repeat_interleave(P / KV, 2);
  }
  k = k.reshape({B, Tl, P, kvl * hd});
  v = v.reshape({B, Tl, P, kvl * hd});
  at::Tensor out = at::cat({q, k, v}, 3).permute({2, 0, 1, 3}).contiguous();  // [P, B, Tl, W]
  at::Tensor in = exchange_equal(out, group);                                 // [P (source), B, Tl, W]
  return in.permute({1, 0, 2, 3}).reshape({B, P * Tl, in.size(3)});
}

at::Tensor heads_to_sequence(const at::Tensor& a, const comm::CommunicatorPtr& group) {
  const int64_t P = group->size();
  TS_CHECK(a.dim() == 3 && a.size(1) % P == 0, "heads_to_sequence: attention output of shape ", a.sizes(),
           " does not split into ", P, " sequence shards");
  const int64_t B = a.size(0), Tl = a.size(1) / P, W = a.size(2);
  at::Tensor out = a.view({B, P, Tl, W}).permute({1, 0, 2, 3}).contiguous();  // [P (destination), B, Tl, W]
  at::Tensor in = exchange_equal(out, group);                                // [P (head group), B, Tl, W]
  return in.permute({1, 2, 0, 3}).reshape({B, Tl, P * W});
}

at::Tensor sequence_shard(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  if (!group || group->size() == 1) return x;
  const int64_t P = group->size();
  TS_CHECK(x.dim() == 2 && x.size(1) % P == 0, "sequence parallelism: a batch of shape ", x.sizes(),
           " does not split into ", P, " equal sequence shards (data.seq_len must be a multiple of sequence_parallel_size)");
  const int64_t Tl = x.size(1) / P;
  return x.narrow(1, group->rank() * Tl, Tl).contiguous();
}

}  // namespace torchspeed::parallel
