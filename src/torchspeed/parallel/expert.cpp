// Expert parameters: see expert.h.
#include "torchspeed/parallel/expert.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <numeric>

#include "torchspeed/comm/autograd_state.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/tensor_registry.h"

namespace torchspeed::parallel {
namespace {
TensorRegistry<int>& registry() {
  static auto* r = new TensorRegistry<int>();
  return *r;
}
}  // namespace

void mark_expert(const at::Tensor& param, int ep_size) { registry().set(param, ep_size); }

std::optional<int> expert_parallel_size(const at::Tensor& param) { return registry().get(param); }

at::Tensor local_experts(const at::Tensor& full, int rank, int size) {
  TS_CHECK(size >= 1 && full.dim() >= 1 && full.size(0) % size == 0, "model.moe.num_experts ",
           full.dim() >= 1 ? full.size(0) : 0, " does not divide by the expert-parallel size ", size);
  const int64_t n = full.size(0) / size;
  return full.narrow(0, rank * n, n);
}

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor exchange(const at::Tensor& x, comm::Communicator& group, const std::vector<int64_t>& send,
                    const std::vector<int64_t>& recv) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = std::accumulate(recv.begin(), recv.end(), int64_t{0});
  at::Tensor out = at::empty(shape, x.options());
  group.all_to_all(x.contiguous(), send, out, recv);
  return out;
}

struct AllToAll : public torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::CommunicatorPtr& group,
                            const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    comm::save_comm(ctx, "group", group);
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    at::Tensor out = exchange(x, *group, send, recv);
    ctx->saved_data["shape"] = out.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(out.scalar_type());
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const comm::CommunicatorPtr group = comm::saved_comm(ctx, "group");
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    // The exchange is collective: it runs even where no gradient reached this rank's rows.
    const at::Tensor grad = g[0].defined() ? g[0] : at::zeros(ctx->saved_data["shape"].toIntVector(),
                                                                 static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt()));
    return {exchange(grad, *group, recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor all_to_all(const at::Tensor& x, const comm::CommunicatorPtr& group, const std::vector<int64_t>& send_counts,
                      const std::vector<int64_t>& recv_counts) {
  return AllToAll::apply(x, group, send_counts, recv_counts);
}

}  // namespace torchspeed::parallel
