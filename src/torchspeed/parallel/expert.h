// Expert parallelism's parameters (Note [Expert parallelism] in models/moe.cpp): a tensor whose
// first dimension holds this rank's experts, 1/ep_size of the model's, the expert-parallel
// group's ranks holding consecutive parts in rank order. ZeRO reduces and partitions such a
// parameter over the expert-data-parallel group (ParallelGroups::edp) instead of the
// data-parallel group; checkpoints and gathered models show it whole ([num_experts, ...]).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "torchspeed/comm/communicator.h"

namespace torchspeed::parallel {

void mark_expert(const at::Tensor& param, int ep_size);
// The expert-parallel size a parameter was marked with, or nullopt for any other parameter.
std::optional<int> expert_parallel_size(const at::Tensor& param);

// Rank `rank`'s part of the experts of `full` ([num_experts, ...], num_experts divisible by
// `size`): a view of its consecutive block of experts.
at::Tensor local_experts(const at::Tensor& full, int rank, int size);

// Communicator::all_to_all as a differentiable op: rows of x go out by send_counts and come
// in by recv_counts; the gradient goes back the same way with the counts swapped.
at::Tensor all_to_all(const at::Tensor& x, const comm::CommunicatorPtr& group, const std::vector<int64_t>& send_counts,
                      const std::vector<int64_t>& recv_counts);

}  // namespace torchspeed::parallel
