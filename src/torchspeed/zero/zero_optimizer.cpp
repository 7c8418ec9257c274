// ZeRO stages 0-3 over units of parameters.
//
// Note [Units]
// Parameters are grouped into units, each with one flat buffer [padded] in the storage dtype;
// the model's parameters become views into it (Tensor::set_data), so LibTorch modules run
// unchanged. padded is a multiple of 16 x dp: rank r owns the shard [r*shard, (r+1)*shard) of
// every unit, and a rank's partition (master weights, moments, stage 2/3 gradients) is its
// shards laid end to end. Stages 0-2 form units from the parameters in reverse model order, up
// to reduce_bucket_size elements, because gradients become ready roughly in that order; stage 3
// makes one unit per LayerStack layer, so a layer's parameters are gathered with one
// all_gather. Partitioning by unit (instead of one global range) lets every reduce-scatter and
// all-gather use equal chunks; it costs at most 16 x dp - 1 padding elements per unit.
//
//   stage 0: full gradients, all-reduced; every rank updates whole units.
//   stage 1: full gradients, all-reduced; rank r updates its shards, then all-gathers.
//   stage 2: gradients reduce-scattered per unit into the partition; the full gradient of a unit
//            lives only from its first gradient until its reduce-scatter completes.
//   stage 3: as stage 2, and a unit's full parameters exist only while its layer runs
//            (forward, and again in backward); storage is released by resizing it to 0 bytes,
//            which keeps autograd's saved references valid (DESIGN.md).
//
// Buckets launch in a fixed order (descending unit index) whatever order gradients arrive in,
// so every rank issues the same collectives in the same order (Note [Collective execution
// order] in comm/). Stage 0/1 gradients accumulate in place across micro-steps (the .grad of
// each parameter is a view into its unit's gradient buffer) and are reduced only in the
// micro-step that ends the accumulation window.
//
// Note [fp16 on CPU]
// LibTorch 1.13 has no fp16 matmul on CPU. LibTorch 2.15 has one, but on CPUs without
// AVX512-FP16 or AMX-FP16 it runs a scalar kernel: 1-3 GFLOP/s against 105 for fp32 on the
// AVX-512 EPYC of our machines (`torchspeed env` measures it), so real fp16 compute would be
// 40-100x slower. On both bases fp16 training therefore stores parameters as fp32 tensors
// holding fp16-rounded values (every update rounds through c10::Half), runs the model's math in
// fp32 on those values, and reduces gradients in fp16 (DeepSpeed's default communication dtype
// for fp16): gradients scaled past the fp16 range overflow to inf exactly where fp16 gradients
// would, which is what the loss scaler reacts to. (On a CPU whose fp16 GEMM beats fp32, storing
// fp16 like the bf16 path does would be the faster choice; none of our machines has one.)
#include "torchspeed/zero/zero_optimizer.h"

#include <c10/core/GradMode.h>
#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/logging.h"

namespace torchspeed::zero {

using Clock = std::chrono::steady_clock;

namespace {
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void resize_storage(const at::Tensor& t, int64_t bytes) {
  c10::NoGradGuard guard;
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), static_cast<size_t>(bytes));
}

// Identity in forward; in backward, gathers the layer's parameters before the layer's own
// backward runs (stage 3).
struct GatherBeforeBackward : public torch::autograd::Function<GatherBeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, int64_t owner,
                            int64_t layer) {
    ctx->saved_data["owner"] = owner;
    ctx->saved_data["layer"] = layer;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* self = reinterpret_cast<ZeroOptimizer*>(ctx->saved_data["owner"].toInt());
    self->gather_for_backward(static_cast<int>(ctx->saved_data["layer"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};
}  // namespace

struct ZeroOptimizer::Unit {
  struct Param {
    std::string name;
    at::Tensor param;
    std::vector<int64_t> shape;
    int64_t offset = 0, numel = 0;
    bool ready = false;
    bool count_in_norm = true;
  };
  std::vector<Param> params;
  int64_t numel = 0, padded = 0, shard = 0;
  int64_t part_offset = 0, part_size = 0;  // this unit's range in the partition buffers
  at::Tensor full;         // [padded] storage dtype; params are views (stage 3: released when idle)
  at::Tensor shard_param;  // stage 3 non-persistent: [shard] storage dtype, this rank's shard
  bool persistent = true;  // stage 3: false when gathered per use
  bool gathered = true;
  comm::WorkPtr gather_work;
  at::Tensor grad;      // [padded]: persistent (stage 0/1) or transient (stage 2/3)
  at::Tensor comm_buf;  // gradient in the communication dtype when it differs
  at::Tensor recv;      // stage 2/3: reduce-scatter output [shard]
  comm::WorkPtr work;
  int ready = 0;
  bool launched = false;
  bool part_fresh = true;  // stage 2/3: the next reduction overwrites the partition (no add)

  int64_t range_begin(int rank, int stage) const { return stage == 0 ? 0 : rank * shard; }
};

ZeroOptimizer::ZeroOptimizer(std::vector<NamedParam> params, int num_layers,
                             comm::CommunicatorPtr dp, ZeroOptions options, OptimizerSpec opt)
    : dp_(std::move(dp)), options_(options), opt_(std::move(opt)) {
  TS_CHECK(dp_, "ZeroOptimizer needs a data-parallel communicator");
  TS_CHECK(options_.stage() >= 0 && options_.stage() <= 3, "zero_optimization.stage must be 0-3");
  TS_CHECK(options_.stage() < 3 || num_layers > 0,
           "ZeRO stage 3 needs a LayerStack model (it gathers parameters layer by layer); "
           "build the model as a torchspeed::nn::LayerStack or use stage 0-2");
  TS_CHECK(opt_.type == "Adam" || opt_.type == "AdamW" || opt_.type == "SGD",
           "optimizer.type: torchspeed has Adam, AdamW and SGD, got '", opt_.type, "'");
  dp_size_ = dp_->size();
  dp_rank_ = dp_->rank();
  std::vector<at::Tensor> originals;
  for (const auto& p : params) {
    TS_CHECK(p.param.defined() && p.param.is_floating_point(), "parameter '", p.name,
             "' is not a floating-point tensor");
    TS_CHECK(p.param.device().is_cpu(), "parameter '", p.name, "' is on ", p.param.device(),
             "; this engine trains on CPU");
    originals.push_back(p.param.detach().to(at::kFloat).contiguous().clone());
  }
  build_units(std::move(params), num_layers);
  allocate(std::move(originals));
  register_hooks();
}

ZeroOptimizer::~ZeroOptimizer() {
  // Reductions still in flight reference our buffers: wait for them.
  for (size_t u : in_flight_) {
    try {
      if (units_[u]->work) units_[u]->work->wait();
    } catch (...) {
    }
  }
}

at::ScalarType ZeroOptimizer::storage_dtype() const {
  return options_.precision() == precision::Precision::kBF16 ? at::kBFloat16 : at::kFloat;
}

optim::ParamOut ZeroOptimizer::param_out(bool master_is_param) const {
  switch (options_.precision()) {
    case precision::Precision::kBF16: return optim::ParamOut::kBF16;
    case precision::Precision::kFP16: return optim::ParamOut::kFP16Values;
    default: return master_is_param ? optim::ParamOut::kNone : optim::ParamOut::kFP32;
  }
}

at::ScalarType ZeroOptimizer::comm_dtype() const {
  if (options_.communication_dtype() != at::ScalarType::Undefined) return options_.communication_dtype();
  return options_.precision() == precision::Precision::kFP16 ? at::kHalf : storage_dtype();
}

void ZeroOptimizer::build_units(std::vector<NamedParam> params, int num_layers) {
  const int64_t align = 16 * dp_size_;
  std::vector<std::vector<NamedParam>> groups;
  if (options_.stage() == 3) {
    groups.resize(static_cast<size_t>(num_layers));
    for (auto& p : params) {
      TS_CHECK(p.layer >= 0 && p.layer < num_layers, "parameter '", p.name, "' has no layer");
      groups[static_cast<size_t>(p.layer)].push_back(std::move(p));
    }
  } else {
    // Reverse model order, cut at the bucket size, then back to model order.
    std::vector<NamedParam> current;
    int64_t current_numel = 0;
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      current_numel += it->param.numel();
      current.push_back(std::move(*it));
      if (current_numel >= options_.reduce_bucket_numel()) {
        std::reverse(current.begin(), current.end());
        groups.push_back(std::move(current));
        current.clear();
        current_numel = 0;
      }
    }
    if (!current.empty()) {
      std::reverse(current.begin(), current.end());
      groups.push_back(std::move(current));
    }
    std::reverse(groups.begin(), groups.end());
  }
  layer_units_.assign(static_cast<size_t>(std::max(num_layers, 0)), {});
  for (auto& g : groups) {
    if (g.empty()) continue;
    auto u = std::make_unique<Unit>();
    for (auto& p : g) {
      Unit::Param up;
      up.name = p.name;
      up.param = p.param;
      up.shape = p.param.sizes().vec();
      up.numel = p.param.numel();
      up.offset = u->numel;
      up.count_in_norm = p.count_in_norm;
      u->numel += up.numel;
      if (p.layer >= 0 && options_.stage() == 3) {
        std::vector<int> users = p.also_used_by;
        users.push_back(p.layer);
        for (int l : users) {  // a layer needs every unit holding a parameter it uses
          auto& lu = layer_units_.at(static_cast<size_t>(l));
          if (std::find(lu.begin(), lu.end(), units_.size()) == lu.end()) lu.push_back(units_.size());
        }
      }
      u->params.push_back(std::move(up));
    }
    u->padded = round_up(std::max<int64_t>(u->numel, 1), align);
    u->shard = u->padded / dp_size_;
    u->part_offset = part_numel_;
    u->part_size = options_.stage() == 0 ? u->padded : u->shard;
    part_numel_ += u->part_size;
    total_numel_ += u->numel;
    u->persistent = options_.stage() < 3 || u->numel < options_.param_persistence_threshold();
    units_.push_back(std::move(u));
  }
}

void ZeroOptimizer::allocate(std::vector<at::Tensor> originals) {
  const auto st = storage_dtype();
  const auto prec = options_.precision();
  const bool separate_master = prec != precision::Precision::kFP32;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (separate_master) master_ = at::zeros({part_numel_}, f32);
  exp_avg_ = at::zeros({part_numel_}, f32);
  if (opt_.type != "SGD") exp_avg_sq_ = at::zeros({part_numel_}, f32);
  if (transient_grads()) grad_part_ = at::zeros({part_numel_}, at::TensorOptions().dtype(st));

  size_t orig = 0;
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    Unit& u = *units_[ui];
    // The exact fp32 values of the whole unit, then the storage copy and the master shard.
    at::Tensor exact = at::zeros({u.padded}, f32);
    for (auto& p : u.params) exact.narrow(0, p.offset, p.numel).copy_(originals[orig++].view({-1}));
    at::Tensor stored = exact;
    if (prec == precision::Precision::kFP16) stored = exact.to(at::kHalf).to(at::kFloat);
    u.full = stored.to(st).contiguous();
    if (u.full.data_ptr() == exact.data_ptr()) u.full = u.full.clone();
    const int64_t begin = u.range_begin(dp_rank_, options_.stage());
    if (separate_master) master_.narrow(0, u.part_offset, u.part_size).copy_(exact.narrow(0, begin, u.part_size));
    {
      c10::NoGradGuard guard;
      for (auto& p : u.params) p.param.set_data(u.full.narrow(0, p.offset, p.numel).view(p.shape));
    }
    if (!u.persistent) {
      u.shard_param = u.full.narrow(0, dp_rank_ * u.shard, u.shard).clone();
      track(u.full.nbytes());
      release(ui);
    }
    if (!transient_grads()) {
      u.grad = at::zeros({u.padded}, at::TensorOptions().dtype(st));
      for (auto& p : u.params) p.param.mutable_grad() = u.grad.narrow(0, p.offset, p.numel).view(p.shape);
    }
  }
}

void ZeroOptimizer::register_hooks() {
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    for (size_t pi = 0; pi < units_[ui]->params.size(); ++pi) {
      const at::Tensor& p = units_[ui]->params[pi].param;
      auto acc = torch::autograd::impl::grad_accumulator(p);
      TS_INTERNAL_ASSERT(acc, "no gradient accumulator for ", units_[ui]->params[pi].name);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, ui, pi](const torch::autograd::variable_list& outputs,
                         const torch::autograd::variable_list&) {
            on_grad_ready(ui, pi);
            return outputs;
          }));
      grad_accumulators_.push_back(std::move(acc));  // keep the nodes (and hooks) alive
    }
  }
}

void ZeroOptimizer::track(int64_t delta) {
  transient_bytes_ += delta;
  peak_transient_ = std::max(peak_transient_, transient_bytes_);
}

void ZeroOptimizer::begin_backward(bool boundary) {
  // Stage 2/3 reductions of the previous micro-step may still be in flight (they overlapped
  // the forward just run); their buffers are about to be reused.
  for (size_t ui : in_flight_) finalize(ui);
  in_flight_.clear();
  reduce_now_ = boundary || transient_grads();
  next_launch_ = static_cast<int>(units_.size()) - 1;
  for (auto& u : units_) {
    u->ready = 0;
    u->launched = false;
    for (auto& p : u->params) p.ready = false;
  }
}

void ZeroOptimizer::on_grad_ready(size_t ui, size_t pi) {
  Unit& u = *units_[ui];
  auto& p = u.params[pi];
  if (p.ready) return;  // a second call in one backward (e.g. reentrant autograd) counts once
  p.ready = true;
  if (transient_grads()) {
    at::Tensor& g = p.param.mutable_grad();
    if (g.defined()) {
      if (!u.grad.defined()) {
        u.grad = at::zeros({u.padded}, at::TensorOptions().dtype(storage_dtype()));
        track(u.grad.nbytes());
      }
      u.grad.narrow(0, p.offset, p.numel).view(p.shape).copy_(g);
      g.reset();  // the full gradient lives only in the unit's buffer until it is reduced
    }
  }
  const bool complete = ++u.ready == static_cast<int>(u.params.size());
  // The layer's backward has produced every gradient of this unit: its parameters are done.
  if (complete && !u.persistent && u.gathered) release(ui);
  if (complete && reduce_now_ && options_.overlap_comm()) launch_ready();
  if (transient_grads()) poll_finished();
}

void ZeroOptimizer::launch_ready() {
  while (next_launch_ >= 0) {
    Unit& u = *units_[static_cast<size_t>(next_launch_)];
    if (u.ready != static_cast<int>(u.params.size())) return;
    launch(static_cast<size_t>(next_launch_--));
    ++timings_.buckets_launched_in_backward;
  }
}

void ZeroOptimizer::finish_backward() {
  for (size_t ui = 0; ui < units_.size(); ++ui) {  // layers whose parameters got no gradient
    if (!units_[ui]->persistent && (units_[ui]->gathered || units_[ui]->gather_work)) release(ui);
  }
  if (!reduce_now_) return;
  // Launch whatever is left (parameters without gradients reduce zeros), in the fixed order.
  while (next_launch_ >= 0) {
    launch(static_cast<size_t>(next_launch_--));
    ++timings_.buckets_launched_after;
  }
  if (transient_grads()) poll_finished();
}

void ZeroOptimizer::launch(size_t ui) {
  Unit& u = *units_[ui];
  if (u.launched) return;
  u.launched = true;
  if (!u.grad.defined()) {  // stage 2/3: no parameter of the unit got a gradient
    u.grad = at::zeros({u.padded}, at::TensorOptions().dtype(storage_dtype()));
    track(u.grad.nbytes());
  }
  at::Tensor buf = u.grad;
  if (comm_dtype() != u.grad.scalar_type()) {
    u.comm_buf = u.grad.to(comm_dtype());
    track(u.comm_buf.nbytes());
    buf = u.comm_buf;
  }
  // DeepSpeed's averaging: postscale (default) divides after the sum, optionally with a
  // predivide factor; prescale divides before.
  comm::ReduceOp op = comm::ReduceOp::kAvg;
  const double f = options_.gradient_predivide_factor();
  if (options_.prescale_gradients()) {
    buf.mul_(1.0 / dp_size_);
    op = comm::ReduceOp::kSum;
  } else if (f != 1.0) {
    buf.mul_(1.0 / f);
    op = comm::ReduceOp::kSum;
  }
  if (transient_grads()) {
    u.recv = at::empty({u.shard}, at::TensorOptions().dtype(buf.scalar_type()));
    track(u.recv.nbytes());
    u.work = dp_->reduce_scatter_async(buf, u.recv, op);
  } else {
    u.work = dp_->all_reduce_async(buf, op);
  }
  in_flight_.push_back(ui);
}

void ZeroOptimizer::finalize(size_t ui) {
  Unit& u = *units_[ui];
  u.work->wait();
  u.work.reset();
  const double f = options_.gradient_predivide_factor();
  const bool post_mul = !options_.prescale_gradients() && f != 1.0;
  if (!transient_grads()) {
    at::Tensor& buf = u.comm_buf.defined() ? u.comm_buf : u.grad;
    if (post_mul) buf.mul_(f / dp_size_);
    if (u.comm_buf.defined()) {
      u.grad.copy_(u.comm_buf);
      track(-u.comm_buf.nbytes());
      u.comm_buf = at::Tensor();
    }
    return;
  }
  if (post_mul) u.recv.mul_(f / dp_size_);
  at::Tensor part = grad_part_.narrow(0, u.part_offset, u.part_size);
  if (u.part_fresh) part.copy_(u.recv); else part.add_(u.recv.to(part.scalar_type()));
  u.part_fresh = false;
  track(-u.grad.nbytes() - u.recv.nbytes() - (u.comm_buf.defined() ? u.comm_buf.nbytes() : 0));
  u.grad = at::Tensor();
  u.recv = at::Tensor();
  u.comm_buf = at::Tensor();
  // No release here: when a reduction completes is timing, and whether a layer is gathered
  // decides which all-gathers the next forward issues, which must be the same on every rank.
  // Stage 3 releases at deterministic points instead (on_grad_ready, finish_backward).
}

void ZeroOptimizer::poll_finished() {
  size_t done = 0;
  while (done < in_flight_.size() && units_[in_flight_[done]]->work->is_completed()) {
    finalize(in_flight_[done]);
    ++done;
  }
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<long>(done));
}

StepResult ZeroOptimizer::step(double loss_scale, double clip_norm, double lr,
                               std::optional<double> beta1) {
  auto t0 = Clock::now();
  for (size_t ui : in_flight_) finalize(ui);
  in_flight_.clear();
  timings_.reduce_wait_s += seconds_since(t0);

  auto t1 = Clock::now();
  const auto st = storage_dtype();
  // This rank's gradients for each unit: its owned shard (the norm's share) and its update
  // range (stage 0 updates whole units).
  auto owned_grad = [&](Unit& u) -> at::Tensor {
    if (transient_grads()) return grad_part_.narrow(0, u.part_offset, u.part_size);
    return u.grad.narrow(0, dp_rank_ * u.shard, u.shard);
  };
  double local_sq = 0.0;
  for (auto& u : units_) {
    at::Tensor g = owned_grad(*u);  // unit elements [lo, lo + shard)
    // Sum over the owned range, skipping parameters counted on another rank (tied copies on
    // later stages, replicated parameters on tensor-parallel ranks > 0); params are in offset order.
    const int64_t lo = dp_rank_ * u->shard, hi = lo + u->shard;
    int64_t pos = lo;
    auto add = [&](int64_t a, int64_t b) {
      if (a < b) local_sq += optim::sum_squares(g.narrow(0, a - lo, b - a).data_ptr(), st, b - a);
    };
    for (const auto& p : u->params) {
      if (p.count_in_norm) continue;
      const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
      if (a >= b) continue;
      add(pos, a);
      pos = b;
    }
    add(pos, hi);
  }
  // One all-reduce gives the global norm and, through inf/NaN, the overflow agreement.
  at::Tensor sq = at::full({1}, local_sq, at::kDouble);
  dp_->all_reduce(sq);
  if (options_.norm_group() && options_.norm_group()->size() > 1) options_.norm_group()->all_reduce(sq);
  const double total_sq = sq.item<double>();
  StepResult result;
  result.overflow = !std::isfinite(total_sq);
  result.grad_norm = std::sqrt(total_sq) / loss_scale;
  if (result.overflow) {
    zero_grad();
    timings_.optimizer_s += seconds_since(t1);
    return result;
  }
  double clip_coef = 1.0;
  if (clip_norm > 0.0) {
    const double c = clip_norm / (result.grad_norm + 1e-6);
    if (c < 1.0) clip_coef = c;
  }
  const float grad_scale = static_cast<float>(clip_coef / loss_scale);
  ++step_count_;
  const optim::ParamOut out_kind = param_out(/*master_is_param=*/true);
  for (auto& up : units_) {
    Unit& u = *up;
    const int64_t begin = u.range_begin(dp_rank_, options_.stage());
    at::Tensor grad = transient_grads() ? grad_part_.narrow(0, u.part_offset, u.part_size)
                                        : u.grad.narrow(0, begin, u.part_size);
    // Where the updated parameters go: the whole unit or this rank's shard of it.
    at::Tensor dest = u.persistent ? u.full.narrow(0, begin, u.part_size) : u.shard_param;
    at::Tensor master = master_.defined() ? master_.narrow(0, u.part_offset, u.part_size) : dest;
    float* m = exp_avg_.data_ptr<float>() + u.part_offset;
    void* out = master_.defined() ? dest.data_ptr() : nullptr;
    if (opt_.type == "SGD") {
      optim::SgdHyper h = opt_.sgd;
      h.lr = lr;
      h.first_step = step_count_ == 1;
      optim::sgd_step(master.data_ptr<float>(), grad.data_ptr(), st, grad_scale,
                      h.momentum != 0.0 ? m : nullptr, u.part_size, h, out, out_kind);
    } else {
      optim::AdamHyper h = opt_.adam;
      h.lr = lr;
      if (beta1) h.beta1 = *beta1;
      h.step = step_count_;
      optim::adam_step(master.data_ptr<float>(), grad.data_ptr(), st, grad_scale, m,
                       exp_avg_sq_.data_ptr<float>() + u.part_offset, u.part_size, h, out, out_kind);
    }
  }
  timings_.optimizer_s += seconds_since(t1);

  auto t2 = Clock::now();
  if (options_.stage() >= 1) {
    std::vector<comm::WorkPtr> works;
    for (auto& up : units_) {
      Unit& u = *up;
      if (!u.persistent) continue;  // stage 3 layers are gathered when they next run
      at::Tensor mine = u.full.narrow(0, dp_rank_ * u.shard, u.shard);
      works.push_back(dp_->all_gather_async(mine, u.full));
    }
    for (auto& w : works) w->wait();
  }
  timings_.allgather_s += seconds_since(t2);
  zero_grad();
  return result;
}

void ZeroOptimizer::zero_grad() {
  for (size_t ui : in_flight_) finalize(ui);
  in_flight_.clear();
  if (transient_grads()) {
    for (auto& u : units_) u->part_fresh = true;  // next reductions overwrite: no memset needed
  } else {
    for (auto& u : units_) u->grad.zero_();
  }
}

// --- stage 3 ---------------------------------------------------------------------------------

void ZeroOptimizer::gather(size_t ui, bool async) {
  Unit& u = *units_[ui];
  if (u.gathered || u.gather_work) return;
  resize_storage(u.full, u.padded * static_cast<int64_t>(u.full.element_size()));
  track(u.full.nbytes());
  u.gather_work = dp_->all_gather_async(u.shard_param, u.full);
  if (!async) ensure_gathered(ui);
}

void ZeroOptimizer::ensure_gathered(size_t ui) {
  Unit& u = *units_[ui];
  if (u.gathered) return;
  if (!u.gather_work) gather(ui, /*async=*/true);
  auto t = Clock::now();
  u.gather_work->wait();
  timings_.allgather_s += seconds_since(t);
  u.gather_work.reset();
  u.gathered = true;
}

void ZeroOptimizer::release(size_t ui) {
  Unit& u = *units_[ui];
  if (u.persistent) return;
  if (u.gather_work) ensure_gathered(ui);
  if (u.gathered && u.full.storage().nbytes() > 0) {
    track(-u.full.nbytes());
    resize_storage(u.full, 0);
  }
  u.gathered = false;
}

void ZeroOptimizer::prefetch_after(int layer, int direction) {
  int64_t budget = options_.prefetch_bucket_numel();
  int64_t live = 0;
  for (auto& u : units_) {
    if (u->gathered || u->gather_work) live += u->padded;
  }
  for (int l = layer + direction; l >= 0 && l < static_cast<int>(layer_units_.size()); l += direction) {
    for (size_t ui : layer_units_[static_cast<size_t>(l)]) {
      Unit& u = *units_[ui];
      if (u.gathered || u.gather_work) continue;
      if (u.padded > budget || live + u.padded > options_.max_live_parameters()) return;
      gather(ui, /*async=*/true);
      budget -= u.padded;
      live += u.padded;
    }
    if (budget <= 0) return;
  }
}

void ZeroOptimizer::pre_layer_forward(int layer) {
  if (options_.stage() < 3) return;
  for (size_t ui : layer_units_.at(static_cast<size_t>(layer))) ensure_gathered(ui);
  prefetch_after(layer, +1);
}

at::Tensor ZeroOptimizer::post_layer_forward(int layer, const at::Tensor& output, bool grad_enabled) {
  if (options_.stage() < 3) return output;
  at::Tensor out = output;
  if (grad_enabled && output.requires_grad()) {
    out = GatherBeforeBackward::apply(output, reinterpret_cast<int64_t>(this), static_cast<int64_t>(layer));
  }
  for (size_t ui : layer_units_.at(static_cast<size_t>(layer))) release(ui);
  return out;
}

void ZeroOptimizer::gather_for_backward(int layer) {
  for (size_t ui : layer_units_.at(static_cast<size_t>(layer))) ensure_gathered(ui);
  prefetch_after(layer, -1);
}

MemoryReport ZeroOptimizer::memory() const {
  MemoryReport r;
  for (const auto& u : units_) {
    if (u->persistent) r.params += u->full.nbytes();
    if (u->shard_param.defined()) r.params += u->shard_param.nbytes();
    if (!transient_grads()) r.gradients += u->grad.nbytes();
  }
  if (grad_part_.defined()) r.gradients += grad_part_.nbytes();
  if (master_.defined()) r.master = master_.nbytes();
  r.optimizer_state = exp_avg_.nbytes() + (exp_avg_sq_.defined() ? exp_avg_sq_.nbytes() : 0);
  r.peak_transient = peak_transient_;
  return r;
}

std::vector<std::pair<std::string, at::Tensor>> ZeroOptimizer::gather_master() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& up : units_) {
    Unit& u = *up;
    const int64_t begin = u.range_begin(dp_rank_, options_.stage());
    at::Tensor local = master_.defined() ? master_.narrow(0, u.part_offset, u.part_size)
                       : u.persistent    ? u.full.narrow(0, begin, u.part_size)
                                         : u.shard_param;
    at::Tensor whole = local.to(at::kFloat).contiguous();
    if (options_.stage() >= 1) {
      whole = at::empty({u.padded}, at::kFloat);
      dp_->all_gather(local.to(at::kFloat).contiguous(), whole);
    }
    for (auto& p : u.params) out.emplace_back(p.name, whole.narrow(0, p.offset, p.numel).view(p.shape).clone());
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ZeroOptimizer::export_partition(bool copy) const {
  auto out_tensor = [copy](const at::Tensor& t) { return copy ? t.clone() : t; };
  at::Tensor master = master_.defined() ? out_tensor(master_) : at::empty({part_numel_}, at::kFloat);
  if (!master_.defined()) {  // fp32: the masters are the parameters (or stage 3 shards) themselves
    for (const auto& up : units_) {
      const Unit& u = *up;
      at::Tensor src = u.persistent ? u.full.narrow(0, u.range_begin(dp_rank_, options_.stage()), u.part_size)
                                    : u.shard_param;
      master.narrow(0, u.part_offset, u.part_size).copy_(src);
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out{{"master", master}};
  if (opt_.type == "SGD") {
    out.emplace_back("momentum", out_tensor(exp_avg_));
  } else {
    out.emplace_back("exp_avg", out_tensor(exp_avg_));
    out.emplace_back("exp_avg_sq", out_tensor(exp_avg_sq_));
  }
  return out;
}

void ZeroOptimizer::import_partition(std::vector<std::pair<std::string, at::Tensor>> tensors, int64_t steps) {
  auto find = [&](const std::string& name) -> at::Tensor& {
    for (auto& [n, t] : tensors)
      if (n == name) {
        TS_CHECK(t.numel() == part_numel_ && t.scalar_type() == at::kFloat, "optimizer state '", name,
                 "' has ", t.numel(), " ", t.scalar_type(), " elements; this rank's partition needs ",
                 part_numel_, " float32 (a different model, data-parallel size or ZeRO stage)");
        return t;
      }
    TS_CHECK(false, "optimizer state has no '", name, "' tensor");
  };
  // Every tensor is checked before any buffer changes.
  at::Tensor& master = find("master");
  for (const auto& kind : state_kinds()) find(kind);
  // A tensor only this call holds becomes the live buffer (a checkpoint load); others are copied.
  auto adopt = [](at::Tensor& live, at::Tensor& t) {
    if (t.is_contiguous() && t.storage_offset() == 0 && t.use_count() == 1 && t.storage().use_count() == 1) {
      live = std::move(t);
    } else {
      live.copy_(t);
    }
  };
  if (opt_.type == "SGD") {
    adopt(exp_avg_, find("momentum"));
  } else {
    adopt(exp_avg_, find("exp_avg"));
    adopt(exp_avg_sq_, find("exp_avg_sq"));
  }
  step_count_ = steps;
  const optim::ParamOut out_kind = param_out(/*master_is_param=*/false);
  if (master_.defined()) {
    adopt(master_, master);
    master = master_;
  }
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    Unit& u = *units_[ui];
    if (!u.persistent && u.gathered) release(ui);
    at::Tensor dest = u.persistent ? u.full.narrow(0, u.range_begin(dp_rank_, options_.stage()), u.part_size)
                                   : u.shard_param;
    at::Tensor src = master.narrow(0, u.part_offset, u.part_size).contiguous();
    optim::write_params(src.data_ptr<float>(), u.part_size, dest.data_ptr(), out_kind);
  }
  if (options_.stage() >= 1) {
    for (auto& up : units_) {
      if (!up->persistent) continue;
      dp_->all_gather(up->full.narrow(0, dp_rank_ * up->shard, up->shard), up->full);
    }
  }
  zero_grad();
}

PartitionLayout ZeroOptimizer::layout() const {
  PartitionLayout l;
  l.stage = options_.stage();
  l.dp = dp_size_;
  l.part_numel = part_numel_;
  for (const auto& up : units_) {
    UnitLayout u{up->padded, up->shard, up->part_offset, up->part_size, {}};
    for (const auto& p : up->params) u.params.push_back({p.name, p.offset, p.numel});
    l.units.push_back(std::move(u));
  }
  return l;
}

std::vector<std::string> ZeroOptimizer::state_kinds() const {
  if (opt_.type == "SGD") return {"momentum"};
  return {"exp_avg", "exp_avg_sq"};
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ZeroOptimizer::param_shapes() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& u : units_)
    for (const auto& p : u->params) out.emplace_back(p.name, p.shape);
  return out;
}

}  // namespace torchspeed::zero
