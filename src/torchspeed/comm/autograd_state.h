// A communicator kept in an autograd node's saved data, for ops whose backward communicates (the
// tensor-parallel regions, expert parallelism's all-to-all). The node owns its reference, so the
// group outlives the forward that made the node (Note [Owned state in autograd nodes] in
// nn/checkpoint.cpp).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>

#include "torchspeed/comm/communicator.h"

namespace torchspeed::comm {

namespace detail {
struct CommHolder : torch::CustomClassHolder {
  explicit CommHolder(CommunicatorPtr c) : comm(std::move(c)) {}
  CommunicatorPtr comm;
};
}  // namespace detail

inline void save_comm(torch::autograd::AutogradContext* ctx, const std::string& key, const CommunicatorPtr& comm) {
  ctx->saved_data[key] = c10::IValue::make_capsule(c10::make_intrusive<detail::CommHolder>(comm));
}

inline CommunicatorPtr saved_comm(torch::autograd::AutogradContext* ctx, const std::string& key) {
  return static_cast<const detail::CommHolder&>(*ctx->saved_data[key].toCapsule()).comm;
}

}  // namespace torchspeed::comm
