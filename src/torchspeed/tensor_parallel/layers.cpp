// Tensor-parallel layers and the autograd functions at their region boundaries.
#include "torchspeed/tensor_parallel/layers.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>

#include <map>
#include <mutex>
#include <unordered_map>

#include "torchspeed/comm/autograd_state.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/tensor_registry.h"

namespace torchspeed::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The communicator is owned by the autograd node that needs it in backward (comm/autograd_state.h).
void save_comm(AutogradContext* ctx, const comm::CommunicatorPtr& tp) { comm::save_comm(ctx, "tp", tp); }
comm::CommunicatorPtr comm_of(AutogradContext* ctx) { return comm::saved_comm(ctx, "tp"); }

at::Tensor all_reduced(const at::Tensor& x, comm::Communicator& c) {
  at::Tensor y = x.contiguous().clone();
  c.all_reduce(y);
  return y;
}

// Every rank's x, concatenated on the last dimension in rank order.
at::Tensor gather_last_dim(const at::Tensor& x, comm::Communicator& c) {
  const int n = c.size();
  at::Tensor all = at::empty({n * x.numel()}, x.options());
  c.all_gather(x.contiguous().view({-1}), all);
  std::vector<int64_t> shape{n};
  for (int64_t s : x.sizes()) shape.push_back(s);
  return at::cat(all.view(shape).unbind(0), -1);  // [n, ...x] -> concatenated on the last dimension
}

struct CopyToRegion : public torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const comm::CommunicatorPtr& tp) {
    save_comm(ctx, tp);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduced(g[0], *comm_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x,
                            const comm::CommunicatorPtr& tp) {
    return all_reduced(x, *tp);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromRegion : public torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const comm::CommunicatorPtr& tp) {
    save_comm(ctx, tp);
    return gather_last_dim(x, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto tp = comm_of(ctx);
    auto& c = *tp;
    return {g[0].chunk(c.size(), -1)[static_cast<size_t>(c.rank())].contiguous(), at::Tensor()};
  }
};

struct GatherSumFromRegion : public torch::autograd::Function<GatherSumFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::CommunicatorPtr& group) {
    save_comm(ctx, group);
    return gather_last_dim(x, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto group = comm_of(ctx);
    const int n = group->size();
    // [..., n * part] -> [n, ..., part]: rank r's part of every rank's gradient, summed.
    at::Tensor parts = at::stack(g[0].chunk(n, -1), 0).contiguous();
    std::vector<int64_t> shape(parts.sizes().begin() + 1, parts.sizes().end());
    at::Tensor out = at::empty(shape, parts.options());
    group->reduce_scatter(parts.view({-1}), out.view({-1}));
    return {out, at::Tensor()};
  }
};

struct VocabParallelCE : public torch::autograd::Function<VocabParallelCE> {
  // logits [N, V/tp], targets [N] int64.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, const comm::CommunicatorPtr& tp) {
    auto& c = *tp;
    const int64_t part = logits.size(1), begin = c.rank() * part;
    at::Tensor lf = logits.to(at::kFloat);
    at::Tensor m = std::get<0>(lf.max(1)).contiguous();
    c.all_reduce(m, comm::ReduceOp::kMax);
    at::Tensor shifted = lf - m.unsqueeze(1);
    at::Tensor e = shifted.exp();
    at::Tensor sum = e.sum(1).contiguous();
    c.all_reduce(sum);
    at::Tensor outside = (targets < begin).logical_or(targets >= begin + part);
    at::Tensor local = (targets - begin).clamp(0, part - 1);
    at::Tensor target_logit = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0).contiguous();
    c.all_reduce(target_logit);
    at::Tensor loss = (sum.log() - target_logit).mean();
    ctx->save_for_backward({e / sum.unsqueeze(1), local, outside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax
    const at::Tensor& local = saved[1];
    at::Tensor inside = saved[2].logical_not().to(at::kFloat);
    grad.scatter_add_(1, local.unsqueeze(1), -inside.unsqueeze(1));
    grad.mul_(g[0] / static_cast<double>(grad.size(0)));
    return {grad.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt())), at::Tensor(), at::Tensor()};
  }
};

// Split parameters, by identity.
TensorRegistry<Split>& registry() {
  static auto* r = new TensorRegistry<Split>();
  return *r;
}

void check_divisible(int64_t n, int size, const char* what) {
  TS_CHECK(n % size == 0, what, " of ", n, " does not divide by the tensor-parallel size ", size);
}

}  // namespace

void share_rng_state(comm::Communicator& tp) {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state().contiguous();
  }
  tp.broadcast(state, 0);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

at::Tensor copy_to_region(const at::Tensor& x, const comm::CommunicatorPtr& tp) {
  return tp->size() == 1 ? x : CopyToRegion::apply(x, tp);
}
at::Tensor reduce_from_region(const at::Tensor& x, const comm::CommunicatorPtr& tp) {
  return tp->size() == 1 ? x : ReduceFromRegion::apply(x, tp);
}
at::Tensor gather_from_region(const at::Tensor& x, const comm::CommunicatorPtr& tp) {
  return tp->size() == 1 ? x : GatherFromRegion::apply(x, tp);
}

at::Tensor gather_sum_from_region(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return group->size() == 1 ? x : GatherSumFromRegion::apply(x, group);
}

comm::CommunicatorPtr replica_group(const comm::CommunicatorPtr& tp, int replicas) {
  TS_CHECK(replicas >= 1 && tp->size() % replicas == 0, "replica_group: ", replicas, " does not divide the group of ", tp->size());
  struct Cached {
    std::weak_ptr<comm::Communicator> tp;
    comm::CommunicatorPtr group;
  };
  static std::mutex mu;
  static std::map<std::pair<const comm::Communicator*, int>, Cached> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = cache.begin(); it != cache.end();) it = it->second.tp.expired() ? cache.erase(it) : std::next(it);
  auto& c = cache[{tp.get(), replicas}];
  if (c.tp.expired() || c.tp.lock() != tp) {
    c.tp = tp;
    c.group = tp->split(tp->rank() / replicas, tp->rank(), "tp-replicas");
  }
  return c.group;
}

void mark_split(const at::Tensor& param, Split split) { registry().set(param, std::move(split)); }

std::optional<Split> split_of(const at::Tensor& param) { return registry().get(param); }

namespace {
// The blocks of a tensor split as `split` says (equal chunks, or sections in proportion).
std::vector<at::Tensor> blocks(const at::Tensor& t, const Split& split) {
  if (split.sections.empty()) return t.chunk(split.chunks, split.dim);
  int64_t total = 0;
  for (int64_t s : split.sections) total += s;
  TS_CHECK(total > 0 && t.size(split.dim) % total == 0, "a split dimension of ", t.size(split.dim),
           " is not a whole number of sections ", at::IntArrayRef(split.sections));
  std::vector<int64_t> sizes;
  for (int64_t s : split.sections) sizes.push_back(s * (t.size(split.dim) / total));
  return t.split_with_sizes(sizes, split.dim);
}
}  // namespace

at::Tensor slice(const at::Tensor& full, Split split, int rank, int size) {
  std::vector<at::Tensor> parts;
  for (const auto& chunk : blocks(full, split)) {
    check_divisible(chunk.size(split.dim), size, "a split dimension");
    parts.push_back(chunk.chunk(size, split.dim)[static_cast<size_t>(rank)]);
  }
  return at::cat(parts, split.dim).contiguous();
}

at::Tensor merge(const std::vector<at::Tensor>& parts, Split split) {
  std::vector<at::Tensor> chunks;
  const size_t n = split.sections.empty() ? static_cast<size_t>(split.chunks) : split.sections.size();
  for (size_t c = 0; c < n; ++c) {
    for (const auto& p : parts) chunks.push_back(blocks(p, split)[c]);
  }
  return at::cat(chunks, split.dim).contiguous();
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const at::Tensor& w, const at::Tensor& b, comm::CommunicatorPtr tp,
                                                   bool gather_output, int chunks, std::vector<int64_t> sections)
    : tp_(std::move(tp)), gather_(gather_output) {
  if (sections.empty()) check_divisible(w.size(0) / chunks, tp_->size(), "ColumnParallelLinear: output features");
  const Split split{0, chunks, std::move(sections)};
  weight = register_parameter("weight", slice(w.detach(), split, tp_->rank(), tp_->size()));
  mark_split(weight, split);
  if (b.defined()) {
    bias = register_parameter("bias", slice(b.detach(), split, tp_->rank(), tp_->size()));
    mark_split(bias, split);
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::linear(copy_to_region(x, tp_), weight, bias);
  return gather_ ? gather_from_region(y, tp_) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(const at::Tensor& w, const at::Tensor& b, comm::CommunicatorPtr tp)
    : tp_(std::move(tp)) {
  check_divisible(w.size(1), tp_->size(), "RowParallelLinear: input features");
  weight = register_parameter("weight", slice(w.detach(), {1, 1}, tp_->rank(), tp_->size()));
  mark_split(weight, {1, 1});
  if (b.defined()) bias = register_parameter("bias", b.detach().clone());
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = reduce_from_region(at::linear(x, weight), tp_);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const at::Tensor& w, comm::CommunicatorPtr tp)
    : tp_(std::move(tp)) {
  check_divisible(w.size(0), tp_->size(), "VocabParallelEmbedding: vocabulary");
  weight = register_parameter("weight", slice(w.detach(), {0, 1}, tp_->rank(), tp_->size()));
  mark_split(weight, {0, 1});
  begin_ = tp_->rank() * weight.size(0);
  end_ = begin_ + weight.size(0);
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& tokens) {
  if (tp_->size() == 1) return at::embedding(weight, tokens);
  at::Tensor outside = (tokens < begin_).logical_or(tokens >= end_);
  at::Tensor out = at::embedding(weight, (tokens - begin_).masked_fill(outside, 0));
  out = out.masked_fill(outside.unsqueeze(-1), 0.0);
  return reduce_from_region(out, tp_);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        const comm::CommunicatorPtr& tp) {
  return VocabParallelCE::apply(logits, targets, tp);
}

}  // namespace torchspeed::tensor_parallel
