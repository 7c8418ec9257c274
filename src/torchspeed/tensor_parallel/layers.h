// Megatron-style tensor parallelism: one layer's matrices split across the ranks of the
// tensor-parallel group. ColumnParallelLinear splits output features (Y_r = X A_r), and
// RowParallelLinear input features (Y = sum_r X_r A_r, one all-reduce), so a column layer
// followed by a row layer (an MLP, attention) communicates once in forward and once in
// backward. VocabParallelEmbedding splits the vocabulary; vocab_parallel_cross_entropy never
// materialises the full logits on one rank. Each rank takes its slice of the same full weight
// the dense layer would have, so a TP model equals the dense one built from the same seed.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <vector>

#include "torchspeed/comm/communicator.h"

namespace torchspeed::tensor_parallel {

// The region boundaries (autograd functions): identity forward / all-reduce backward, and the
// reverse; gathering the last dimension forward / taking this rank's part backward.
at::Tensor copy_to_region(const at::Tensor& x, const comm::CommunicatorPtr& tp);
at::Tensor reduce_from_region(const at::Tensor& x, const comm::CommunicatorPtr& tp);
at::Tensor gather_from_region(const at::Tensor& x, const comm::CommunicatorPtr& tp);
// Gathering the last dimension forward, and in backward each rank's part of the sum of every
// rank's gradient (reduce-scatter): for a tensor the ranks then use differently, as the ranks
// that share a key/value head each attend with their own query heads.
at::Tensor gather_sum_from_region(const at::Tensor& x, const comm::CommunicatorPtr& group);

// The ranks of `tp` in consecutive runs of `replicas` (tp ranks r / replicas alike), created on
// first use and kept with `tp` (collective on first use).
comm::CommunicatorPtr replica_group(const comm::CommunicatorPtr& tp, int replicas);

// Tensor-parallel ranks hold the same replicated activations, so their dropout masks must
// agree: every rank of `tp` takes tp rank 0's CPU RNG state (collective). Reseed them alike
// afterwards (e.g. by data-parallel rank) to keep them so.
void share_rng_state(comm::Communicator& tp);

// How a parameter is split across the tensor-parallel group, for checkpoints and the norm: along
// `dim`, which is made of `chunks` equal blocks each split separately (a fused QKV weight: 3),
// or, with `sections`, of blocks of those relative sizes (grouped-query attention's fused QKV:
// {n_head, n_kv_head, n_kv_head}).
struct Split {
  Split(int dim_ = 0, int chunks_ = 1, std::vector<int64_t> sections_ = {})
      : dim(dim_), chunks(chunks_), sections(std::move(sections_)) {}
  int dim = 0, chunks = 1;
  std::vector<int64_t> sections;
};
void mark_split(const at::Tensor& param, Split split);
// nullopt for a replicated parameter.
std::optional<Split> split_of(const at::Tensor& param);
// This rank's slice of a full tensor split as `split` says, and the inverse: the full tensor
// from every rank's slice, in rank order.
at::Tensor slice(const at::Tensor& full, Split split, int rank, int size);
at::Tensor merge(const std::vector<at::Tensor>& parts, Split split);

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  // `full_weight` [out, in] and `full_bias` [out] (may be undefined): the dense layer's values.
  ColumnParallelLinearImpl(const at::Tensor& full_weight, const at::Tensor& full_bias, comm::CommunicatorPtr tp,
                           bool gather_output = false, int chunks = 1, std::vector<int64_t> sections = {});
  at::Tensor forward(const at::Tensor& x);  // [..., in] -> [..., out/tp] (or [..., out] gathered)
  at::Tensor weight;  // [out/tp, in], split on dim 0
  at::Tensor bias;    // [out/tp]
 private:
  comm::CommunicatorPtr tp_;
  bool gather_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  // `full_weight` [out, in]; the input arrives split on its last dimension (in/tp).
  RowParallelLinearImpl(const at::Tensor& full_weight, const at::Tensor& full_bias, comm::CommunicatorPtr tp);
  at::Tensor forward(const at::Tensor& x);  // [..., in/tp] -> [..., out], all-reduced
  at::Tensor weight;  // [out, in/tp], split on dim 1
  at::Tensor bias;    // [out], replicated, added after the reduction
 private:
  comm::CommunicatorPtr tp_;
};
TORCH_MODULE(RowParallelLinear);

class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(const at::Tensor& full_weight, comm::CommunicatorPtr tp);  // [vocab, d]
  at::Tensor forward(const at::Tensor& tokens);  // [...] int64 -> [..., d]
  at::Tensor weight;  // [vocab/tp, d], rows [rank * vocab/tp, (rank+1) * vocab/tp)
 private:
  comm::CommunicatorPtr tp_;
  int64_t begin_, end_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Mean cross-entropy of logits split on the last dimension (this rank: vocabulary rows
// [rank * V/tp, (rank+1) * V/tp)), against full-vocabulary targets. Three all-reduces of
// [tokens] values (max, sum of exponentials, target logit); the logits never leave their rank.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        const comm::CommunicatorPtr& tp);

}  // namespace torchspeed::tensor_parallel
