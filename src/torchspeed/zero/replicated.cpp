// ReplicatedGradients: ZeRO stages 0 and 1 (Note [ZeRO strategies]). Every rank holds the full
// gradient of every unit in the accumulation dtype; the micro-step that ends an accumulation
// window all-reduces them bucket by bucket.
//
// Note [Gradient accumulation dtype]
// When the accumulation dtype is the parameters' own (fp32 training, or bf16 with
// grad_accum_dtype bf16) each parameter's .grad is a view into its unit's buffer and LibTorch's
// AccumulateGrad adds micro-steps in place. Otherwise (bf16 parameters, fp32 accumulation, the
// default as in DeepSpeed's bf16 optimizer) autograd leaves each micro-step's bf16 gradient in
// .grad, the hook adds it into the fp32 buffer and drops it: the sum over micro-steps is exact
// in fp32 instead of rounded to 8 bits of mantissa after every micro-step.
#include <ATen/ATen.h>

#include "torchspeed/zero/detail/strategies.h"
#include "torchspeed/zero/detail/units.h"

namespace torchspeed::zero::detail {

ReplicatedGradients::ReplicatedGradients(Stage stage, std::vector<NamedParam> params, comm::CommunicatorPtr dp,
                                         ZeroOptions options, OptimizerSpec optimizer)
    : ZeroOptimizer(stage, std::move(dp), std::move(options), std::move(optimizer), /*sharded=*/stage == Stage::k1) {
  in_place_ = accum_dtype_ == storage_dtype();
  reduce_scatter_ = sharded_ && options_.reduce_scatter();
  build(units_by_bucket(std::move(params), options_.reduce_bucket_numel()));
}

void ReplicatedGradients::allocate(Unit& u) {
  u.grad = at::zeros({u.padded}, at::TensorOptions().dtype(accum_dtype_));
  if (!in_place_) return;
  for (auto& p : u.params) p.param.mutable_grad() = u.grad.narrow(0, p.offset, p.numel).view(p.shape);
}

void ReplicatedGradients::on_gradient(size_t ui, size_t pi, bool) {
  if (in_place_) return;
  Unit& u = *units_[ui];
  auto& p = u.params[pi];
  at::Tensor& g = p.param.mutable_grad();
  if (!g.defined()) return;
  u.grad.narrow(0, p.offset, p.numel).view(p.shape).add_(g);
  g.reset();
}

void ReplicatedGradients::launch(size_t ui) {
  Unit& u = *units_[ui];
  if (u.launched) return;
  u.launched = true;
  start_reduction(ui, reduce_scatter_);  // stage 1 updates only this rank's shard of the sum
}

void ReplicatedGradients::finalize(size_t ui) {
  Unit& u = *units_[ui];
  u.work->wait();
  u.work.reset();
  if (reduce_scatter_) {
    after_reduce(u.recv);
    u.grad.narrow(0, u.grank * u.shard, u.shard).copy_(u.recv);
    transient_.add(-u.recv.nbytes() - (u.comm_buf.defined() ? u.comm_buf.nbytes() : 0));
    u.recv = at::Tensor();
    u.comm_buf = at::Tensor();
    return;
  }
  at::Tensor& buf = u.comm_buf.defined() ? u.comm_buf : u.grad;
  after_reduce(buf);
  if (u.comm_buf.defined()) {
    u.grad.copy_(u.comm_buf);
    transient_.add(-u.comm_buf.nbytes());
    u.comm_buf = at::Tensor();
  }
}

at::Tensor ReplicatedGradients::owned_grad(Unit& u) { return u.grad.narrow(0, u.grank * u.shard, u.shard); }

at::Tensor ReplicatedGradients::update_grad(Unit& u) { return u.grad.narrow(0, u.update_begin, u.part_size); }

void ReplicatedGradients::reset_grads() {
  for (auto& u : units_) u->grad.zero_();
}

int64_t ReplicatedGradients::gradient_bytes() const {
  int64_t n = 0;
  for (const auto& u : units_) n += u->grad.nbytes();
  return n;
}

}  // namespace torchspeed::zero::detail

namespace torchspeed::zero {

std::unique_ptr<ZeroOptimizer> make_zero_optimizer(std::vector<NamedParam> params, int num_layers,
                                                   comm::CommunicatorPtr dp, ZeroOptions options,
                                                   OptimizerSpec optimizer) {
  switch (options.stage()) {
    case Stage::k0:
    case Stage::k1:
      return std::make_unique<detail::ReplicatedGradients>(options.stage(), std::move(params), std::move(dp),
                                                           std::move(options), std::move(optimizer));
    case Stage::k2:
      return std::make_unique<detail::PartitionedGradients>(std::move(params), std::move(dp), std::move(options),
                                                            std::move(optimizer));
    case Stage::k3:
      TS_CHECK(num_layers > 0,
               "ZeRO stage 3 needs a LayerStack model (it gathers parameters layer by layer); "
               "build the model as a torchspeed::nn::LayerStack or use stage 0-2");
      return std::make_unique<detail::PartitionedParameters>(std::move(params), num_layers, std::move(dp),
                                                             std::move(options), std::move(optimizer));
  }
  TS_INTERNAL_ASSERT(false, "unknown ZeRO stage");
}

}  // namespace torchspeed::zero
