// What every ZeRO strategy shares: units, gradient hooks and the bucket order, the optimizer
// step over this rank's partition (its export and import: partition_state.cpp).
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
// Note [ZeRO strategies]
// One class per strategy (DESIGN.md), chosen once by make_zero_optimizer:
//   ReplicatedGradients (stages 0, 1; replicated.cpp): full gradients in the accumulation dtype,
//     all-reduced in the micro-step that ends the accumulation window. Stage 0 updates whole
//     units on every rank; stage 1 updates this rank's shards, then all-gathers them.
//   PartitionedGradients (stage 2; partitioned.cpp): every micro-step reduce-scatters each
//     unit's gradient into this rank's partition, where micro-steps accumulate; the full
//     gradient of a unit lives only from its first gradient until its reduce-scatter completes.
//   PartitionedParameters (stage 3; partitioned.cpp): as stage 2, and a unit's full parameters
//     exist only while its layer runs (forward, and again in backward), through the
//     ParameterGatherer it installs as the engine's LayerHooks.
// The base class runs what they share and asks the strategy at the points where they differ,
// so no code tests a stage number after construction.
//
// Note [Gradients in several calls]
// Autograd calls a parameter's AccumulateGrad once per backward pass that reaches it. One
// engine pass sums every use first, but activation checkpointing replays each segment in a
// backward of its own, so a parameter used in several segments (a tied embedding and LM head)
// gets one call per segment. Every call's gradient is added (on_gradient with first=false),
// and a unit holding such a shared parameter is reduced only once backward returned, when
// all calls are in. A further call for a unit already being reduced is an error, never a lost
// gradient.
//
// Buckets launch in a fixed order (descending unit index) whatever order gradients arrive in,
// so every rank issues the same collectives in the same order (Note [Collective execution
// order] in comm/).
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
#include <torch/autograd.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include <malloc.h>

#include "torchspeed/base/error.h"
#include "torchspeed/zero/detail/units.h"

namespace torchspeed::zero {

using Clock = std::chrono::steady_clock;
using detail::Unit;

namespace {
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
// An op followed by a step on the caller's thread, run once when the op is seen complete (qgZ
// into a bf16 bucket: the fp32 result copied back). Holds what the op reads and writes.
class ThenWork final : public comm::Work {
 public:
  ThenWork(comm::WorkPtr op, std::function<void()> then) : op_(std::move(op)), then_(std::move(then)) {}
  void wait() override {
    op_->wait();
    run_then();
  }
  bool is_completed() override {
    if (!op_->is_completed()) return false;
    run_then();
    return true;
  }
  std::exception_ptr exception() const override { return op_->exception(); }

 private:
  void run_then() {
    if (then_) std::exchange(then_, nullptr)();
  }
  comm::WorkPtr op_;
  std::function<void()> then_;
};
}  // namespace

Stage stage_of(int stage) {
  TS_CHECK(stage >= 0 && stage <= 3, "zero_optimization.stage must be 0-3, got ", stage);
  return static_cast<Stage>(stage);
}

namespace detail {
std::vector<std::vector<NamedParam>> units_by_bucket(std::vector<NamedParam> params, int64_t bucket_numel) {
  std::vector<std::vector<NamedParam>> groups;
  std::vector<NamedParam> current;
  int64_t current_numel = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (!current.empty() && current.back().expert != it->expert) {  // experts reduce over another group
      std::reverse(current.begin(), current.end());
      groups.push_back(std::move(current));
      current.clear();
      current_numel = 0;
    }
    current_numel += it->param.numel();
    current.push_back(std::move(*it));
    if (current_numel >= bucket_numel) {
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
  return groups;
}

std::vector<std::vector<NamedParam>> units_by_layer(std::vector<NamedParam> params, int num_layers) {
  std::vector<std::vector<NamedParam>> groups(2 * static_cast<size_t>(num_layers));  // per layer: others, experts
  for (auto& p : params) {
    TS_CHECK(p.layer >= 0 && p.layer < num_layers, "parameter '", p.name, "' has no layer");
    groups[2 * static_cast<size_t>(p.layer) + (p.expert ? 1 : 0)].push_back(std::move(p));
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& g) { return g.empty(); }), groups.end());
  return groups;
}
}  // namespace detail

ZeroOptimizer::ZeroOptimizer(Stage strategy, comm::CommunicatorPtr dp, ZeroOptions options, OptimizerSpec opt,
                             bool sharded)
    : dp_(std::move(dp)), options_(std::move(options)), strategy_(strategy), sharded_(sharded) {
  TS_CHECK(dp_, "ZeroOptimizer needs a data-parallel communicator");
  optimizer_ = optim::make_partition_optimizer(std::move(opt), dp_);
  const char* opt_name = optim::optimizer_name(optimizer_->type());
  TS_CHECK(!optimizer_->needs_replicated_state() || (strategy == Stage::k0 && !options_.state_store()),
           "optimizer ", opt_name, " needs ZeRO stage 0 without offload (as in DeepSpeed: it compresses the whole "
           "momentum, which every rank holds)");
  dp_size_ = dp_->size();
  dp_rank_ = dp_->rank();
  if (const auto& ep = options_.expert_parallel(); ep && ep->size() > 1) {
    ep_size_ = ep->size();
    const auto& edp = options_.expert_data_parallel();
    TS_CHECK(edp && edp->size() * ep_size_ == dp_size_, "expert parallelism needs the expert-data-parallel group (",
             edp ? edp->size() : 0, " ranks) times the expert-parallel group (", ep_size_, ") to make the data-parallel group (",
             dp_size_, ")");
    TS_CHECK(optimizer_->elementwise(), "optimizer ", opt_name,
             " with expert parallelism (model.moe.ep_size ", ep_size_, ") is not implemented: use Adam, AdamW or SGD");
    TS_CHECK(!options_.quantized_gradients() && !options_.quantized_weights() && options_.hpz_partition_size() == 1,
             "ZeRO++ (zero_quantized_gradients, zero_quantized_weights, zero_hpz_partition_size) with expert parallelism "
             "(model.moe.ep_size ", ep_size_, ") is not implemented");
  }
  TS_CHECK(!options_.quantized_gradients() || ((strategy == Stage::k2 || strategy == Stage::k3) && options_.reduce_scatter()),
           "zero_quantized_gradients (qgZ) needs stage 2 or 3 with reduce_scatter");
  TS_CHECK(options_.hpz_partition_size() == 1 || strategy == Stage::k3,
           "zero_hpz_partition_size (hpZ) partitions parameters: it needs stage 3");
  TS_CHECK(!options_.quantized_weights() || strategy == Stage::k3,
           "zero_quantized_weights (qwZ) quantizes the parameters' all-gather: it needs stage 3");
  if (options_.quantized_gradients() && dp_size_ > 1) qgz_ = std::make_unique<comm::QuantizedReduceScatter>(dp_);  // collective
  accum_dtype_ = options_.grad_accum_dtype();
  const bool bf16 = options_.precision() == precision::Precision::kBF16;
  TS_CHECK(accum_dtype_ == at::kFloat || (bf16 && accum_dtype_ == at::kBFloat16),
           "data_types.grad_accum_dtype: gradients accumulate in fp32", bf16 ? " or bf16" : "",
           " for ", precision::precision_name(options_.precision()), " training, not ", accum_dtype_);
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

void ZeroOptimizer::build(std::vector<std::vector<NamedParam>> groups) {
  const int max_group = static_cast<int>(optimizer_->spec().groups.size());
  for (auto& g : groups) {
    auto u = std::make_unique<Unit>();
    u->expert = !g.empty() && g.front().expert && ep_size_ > 1;
    u->group = u->expert ? options_.expert_data_parallel() : dp_;
    u->grank = u->group->rank();
    u->gsize = u->group->size();
    for (auto& p : g) {
      TS_INTERNAL_ASSERT(p.expert == g.front().expert, "parameter '", p.name, "' in a unit of ",
                         g.front().expert ? "experts" : "non-experts");
      TS_CHECK(p.group >= 0 && p.group <= max_group, "parameter '", p.name, "' is in parameter group ", p.group,
               " but the optimizer has groups 0-", max_group);
      TS_CHECK(p.param.defined() && p.param.is_floating_point(), "parameter '", p.name,
               "' is not a floating-point tensor");
      TS_CHECK(p.param.device().is_cpu(), "parameter '", p.name, "' is on ", p.param.device(),
               "; this engine trains on CPU");
      detail::UnitParam up;
      up.name = p.name;
      up.param = p.param;
      up.shape = p.param.sizes().vec();
      up.numel = p.param.numel();
      up.offset = u->numel;
      up.count_in_norm = p.count_in_norm;
      up.group = p.group;
      up.shared = !p.also_used_by.empty();
      u->deferred = u->deferred || up.shared;
      u->numel += up.numel;
      u->params.push_back(std::move(up));
    }
    u->padded = round_up(std::max<int64_t>(u->numel, 1), 16 * int64_t{u->gsize});
    u->shard = u->padded / u->gsize;
    u->update_begin = sharded_ ? u->grank * u->shard : 0;
    u->part_offset = part_numel_;
    u->part_size = sharded_ ? u->shard : u->padded;
    part_numel_ += u->part_size;
    total_numel_ += u->numel;
    // The update range in runs of one parameter group; padding joins its neighbour.
    const int64_t lo = u->update_begin, hi = lo + u->part_size;
    int64_t pos = lo;
    auto put = [&](int64_t a, int64_t b, int group) {
      if (a >= b) return;
      auto& s = u->segments;
      if (!s.empty() && s.back().group == group) {
        s.back().length += b - a;
      } else {
        s.push_back({a - lo, b - a, group});
      }
    };
    for (const auto& p : u->params) {
      const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
      if (a >= b) continue;
      put(pos, a, u->segments.empty() ? p.group : u->segments.back().group);
      put(a, b, p.group);
      pos = b;
    }
    put(pos, hi, u->segments.empty() ? 0 : u->segments.back().group);
    u->persistent = keeps_whole(*u);
    u->index = units_.size();
    units_.push_back(std::move(u));
  }

  has_master_ = separate_master();
  ::malloc_trim(0);  // the layers' construction temporaries
  open_store();
  register_hooks();
}

void ZeroOptimizer::make_unit_buffers(Unit& u, at::Tensor& exact) {
  const auto prec = options_.precision();
  // The exact fp32 values of the whole unit, then the storage copy the parameters become views of.
  exact = at::zeros({u.padded}, at::kFloat);
  for (auto& p : u.params) exact.narrow(0, p.offset, p.numel).view(p.shape).copy_(p.param.detach());
  at::Tensor stored = exact;
  if (prec == precision::Precision::kFP16) stored = exact.to(at::kHalf).to(at::kFloat);
  u.full = stored.to(storage_dtype()).contiguous();
  if (u.full.data_ptr() == exact.data_ptr()) u.full = u.full.clone();
  {
    c10::NoGradGuard guard;  // the model's own storage is freed here, unit by unit
    for (auto& p : u.params) p.param.set_data(u.full.narrow(0, p.offset, p.numel).view(p.shape));
  }
  // ...and goes back to the system now: glibc keeps freed chunks below its (dynamic) mmap
  // threshold in the heap, and RSS would otherwise hold old and new copies of the model at once.
  ::malloc_trim(0);
  allocate(u);
}

// Note [Step pieces]
// The step visits this rank's partition in pieces: each unit's update range, cut where the
// parameter group changes (segments) and every sub_group_size elements (DeepSpeed's
// sub-groups). The pieces tile the partition in order, and the PartitionStore is handed the same
// list, so an offloading store can read piece i+1 and write piece i-1 while piece i is updated.
// The arithmetic is element by element, so where the pieces are cut never changes a result.
void ZeroOptimizer::open_store() {
  const int64_t sub = options_.sub_group_numel();
  std::vector<PieceRange> ranges;
  size_t first_slot = 0;  // of the unit's first parameter
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    const Unit& u = *units_[ui];
    for (const auto& seg : u.segments)
      for (int64_t off = 0; off < seg.length; off += sub) {
        const int64_t n = std::min(sub, seg.length - off);
        detail::Piece pc{ui, seg.begin + off, n, seg.group, {}};
        const int64_t lo = u.update_begin + pc.begin, hi = lo + n;  // in the unit
        for (size_t k = 0; k < u.params.size(); ++k) {
          const auto& p = u.params[k];
          const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
          if (a < b) pc.tensors.push_back({first_slot + k, a - lo, b - a});
        }
        pieces_.push_back(std::move(pc));
        ranges.push_back({u.part_offset + seg.begin + off, n});
      }
    first_slot += u.params.size();
  }
  kinds_.clear();
  if (has_master_) kinds_.push_back("master");
  for (auto& k : state_kinds()) kinds_.push_back(k);
  store_ = options_.state_store() ? options_.state_store() : std::make_shared<MemoryStore>();
  store_->open(kinds_, part_numel_, std::move(ranges));
  // Initial state: the exact masters, zero moments. Each unit's buffers are made when the
  // visit reaches it, so one unit's exact fp32 copy exists at a time (every unit has pieces).
  size_t current = SIZE_MAX;
  at::Tensor exact;
  store_->visit(
      [&](size_t i, float* const* state) {
        const detail::Piece& pc = pieces_[i];
        if (pc.unit != current) {
          current = pc.unit;
          make_unit_buffers(*units_[current], exact);
        }
        for (size_t k = 0; k < kinds_.size(); ++k) {
          if (k == 0 && has_master_) {
            std::memcpy(state[k], exact.data_ptr<float>() + units_[current]->update_begin + pc.begin,
                        static_cast<size_t>(pc.length) * sizeof(float));
          } else {
            std::memset(state[k], 0, static_cast<size_t>(pc.length) * sizeof(float));
          }
        }
      },
      /*read=*/false, /*write=*/true);
}

at::Tensor ZeroOptimizer::read_kind(size_t kind, bool copy) const {
  if (at::Tensor t = store_->resident(kind); t.defined()) return copy ? t.clone() : t;
  at::Tensor out = at::empty({part_numel_}, at::kFloat);
  float* dst = out.data_ptr<float>();
  store_->visit(
      [&](size_t i, float* const* state) {
        const detail::Piece& pc = pieces_[i];
        std::memcpy(dst + units_[pc.unit]->part_offset + pc.begin, state[kind],
                    static_cast<size_t>(pc.length) * sizeof(float));
      },
      /*read=*/true, /*write=*/false);
  return out;
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

at::ScalarType ZeroOptimizer::comm_dtype(at::ScalarType buffer) const {
  if (options_.communication_dtype() != at::ScalarType::Undefined) return options_.communication_dtype();
  return options_.precision() == precision::Precision::kFP16 ? at::kHalf : buffer;
}

void ZeroOptimizer::register_hooks() {
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    for (size_t pi = 0; pi < units_[ui]->params.size(); ++pi) {
      const at::Tensor& p = units_[ui]->params[pi].param;
      auto acc = torch::autograd::impl::grad_accumulator(p);
      TS_INTERNAL_ASSERT(acc, "no gradient accumulator for ", units_[ui]->params[pi].name);
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, ui, pi](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            on_grad_ready(ui, pi);
            return outputs;
          }));
      grad_accumulators_.push_back(std::move(acc));  // keep the nodes (and hooks) alive
    }
  }
}

void ZeroOptimizer::begin_backward(bool boundary) {
  // Reductions of the previous micro-step may still be in flight (they overlapped the forward
  // just run); their buffers are about to be reused.
  wait_reductions();
  // 1-bit Adam past its warm-up averages the momentum instead of the gradients.
  reduce_now_ = (boundary || reduces_every_micro_step()) && reduces_next_step();
  if (boundary) store_->prefetch();  // the step reads the optimizer state next
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
  if (p.ready) {  // a further call in one backward: see Note [Gradients in several calls]
    TS_CHECK(!u.launched, "parameter '", p.name, "' got another gradient after its bucket was reduced: a "
             "parameter used in several checkpointed segments must be registered as shared (NamedParam::also_used_by)");
    on_gradient(ui, pi, /*first=*/false);
    return;
  }
  p.ready = true;
  on_gradient(ui, pi, /*first=*/true);
  if (++u.ready != static_cast<int>(u.params.size()) || u.deferred) return;
  on_unit_complete(ui);
  if (!reduce_now_ || !options_.reduce_in_backward()) return;
  launch_ready();
  if (!options_.overlap_comm()) wait_reductions();  // no overlap: reduced before backward goes on
}

void ZeroOptimizer::launch_ready() {
  while (next_launch_ >= 0) {
    Unit& u = *units_[static_cast<size_t>(next_launch_)];
    if (u.ready != static_cast<int>(u.params.size()) || u.deferred) return;
    launch(static_cast<size_t>(next_launch_--));
    ++timings_.buckets_launched_in_backward;
  }
}

void ZeroOptimizer::finish_backward() {
  release_idle();  // layers whose parameters got no gradient
  if (!reduce_now_) return;
  // Launch whatever is left (parameters without gradients reduce zeros), in the fixed order.
  while (next_launch_ >= 0) {
    launch(static_cast<size_t>(next_launch_--));
    ++timings_.buckets_launched_after;
  }
  poll_finished();
}

at::Tensor ZeroOptimizer::comm_buffer(Unit& u, comm::ReduceOp& op) {
  at::Tensor buf = u.grad;
  if (comm_dtype(u.grad.scalar_type()) != u.grad.scalar_type()) {
    u.comm_buf = u.grad.to(comm_dtype(u.grad.scalar_type()));
    transient_.add(u.comm_buf.nbytes());
    buf = u.comm_buf;
  }
  // DeepSpeed's averaging: postscale (default) divides after the sum, optionally with a
  // predivide factor; prescale divides before. Always by the data-parallel size: an expert's
  // gradient sums over its expert-data-parallel group what every rank's tokens gave it
  // (Note [Expert units]).
  op = comm::ReduceOp::kAvg;
  const double f = options_.gradient_predivide_factor();
  if (u.expert && !options_.prescale_gradients() && f == 1.0) buf.mul_(1.0 / ep_size_);  // kAvg divides by the rest
  if (options_.prescale_gradients()) {
    buf.mul_(1.0 / dp_size_);
    op = comm::ReduceOp::kSum;
  } else if (f != 1.0) {
    buf.mul_(1.0 / f);
    op = comm::ReduceOp::kSum;
  }
  return buf;
}

at::Tensor ZeroOptimizer::start_reduction(size_t ui, bool scatter) {
  Unit& u = *units_[ui];
  comm::ReduceOp op = comm::ReduceOp::kAvg;
  at::Tensor buf = comm_buffer(u, op);
  if (scatter) {
    u.recv = at::empty({u.shard}, at::TensorOptions().dtype(buf.scalar_type()));
    transient_.add(u.recv.nbytes());
    if (qgz_) {  // ZeRO++ qgZ: fp32 in, 4-bit blocks across hosts, advanced as poll_finished polls it
      const at::Tensor in = buf.scalar_type() == at::kFloat ? buf : buf.to(at::kFloat);
      const at::Tensor out = u.recv.scalar_type() == at::kFloat ? u.recv : at::empty({u.shard}, at::kFloat);
      u.work = qgz_->run_async(in, out, op);
      if (!out.is_same(u.recv)) u.work = std::make_shared<ThenWork>(u.work, [in, out, recv = u.recv] { recv.copy_(out); });
    } else {
      u.work = u.group->reduce_scatter_async(buf, u.recv, op);
    }
  } else {
    u.work = u.group->all_reduce_async(buf, op);
  }
  in_flight_.push_back(ui);
  return buf;
}

void ZeroOptimizer::after_reduce(at::Tensor& buf) const {
  const double f = options_.gradient_predivide_factor();
  if (!options_.prescale_gradients() && f != 1.0) buf.mul_(f / dp_size_);
}

void ZeroOptimizer::poll_finished() {
  size_t done = 0;
  while (done < in_flight_.size() && units_[in_flight_[done]]->work->is_completed()) {
    finalize(in_flight_[done]);
    ++done;
  }
  in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<long>(done));
}

void ZeroOptimizer::wait_reductions() {
  for (size_t ui : in_flight_) finalize(ui);
  in_flight_.clear();
}

at::Tensor ZeroOptimizer::update_dest(Unit& u) {
  return u.persistent ? u.full.narrow(0, u.update_begin, u.part_size) : u.shard_param;
}

// The partition as the optimizer sees it (Note [Strategy x optimizer] in
// optim/partition_optimizer.h): the store's pieces in order, each with the unit's gradient, the
// fp32 values being updated (the separate masters, or the parameters themselves) and, in passes
// that update, where the strategy wants the new parameters (begin_update / end_update).
class ZeroOptimizer::StepView final : public optim::PartitionView {
 public:
  explicit StepView(ZeroOptimizer& z) : z_(z) {}

  void visit(bool with_grad, bool updates, const std::function<void(const optim::PieceView&)>& fn) override {
    ZeroOptimizer& z = z_;
    const size_t km = z.has_master_ ? 1 : 0;  // the optimizer's first kind in kinds_
    const optim::ParamOut out_kind = z.param_out(/*master_is_param=*/!z.has_master_);
    size_t cached = SIZE_MAX;
    at::Tensor grad, dest;
    auto close = [&] {
      if (updates && cached != SIZE_MAX) z.end_update(*z.units_[cached], dest);
    };
    z.store_->visit(
        [&](size_t i, float* const* state) {
          const detail::Piece& pc = z.pieces_[i];
          Unit& u = *z.units_[pc.unit];
          if (cached != pc.unit) {
            close();
            if (with_grad) grad = z.update_grad(u);
            if (updates) {
              dest = z.begin_update(u);  // the whole unit or this rank's shard of it
            } else if (!z.has_master_) {
              dest = z.update_dest(u);
            }
            cached = pc.unit;
          }
          optim::PieceView s;
          s.offset = u.part_offset + pc.begin;
          s.length = pc.length;
          s.group = pc.group;
          if (with_grad) {
            ++z.timings_.optimizer_sub_groups;
            s.grad = static_cast<const char*>(grad.data_ptr()) + pc.begin * static_cast<int64_t>(grad.element_size());
            s.grad_dtype = grad.scalar_type();
          }
          s.param = z.has_master_ ? state[0] : dest.data_ptr<float>() + pc.begin;
          if (updates && z.has_master_) {
            s.out = static_cast<char*>(dest.data_ptr()) + pc.begin * static_cast<int64_t>(dest.element_size());
            s.out_kind = out_kind;
          }
          s.state = state + km;
          s.tensors = &pc.tensors;
          fn(s);
        },
        /*read=*/true, /*write=*/true);
    close();
  }
  int64_t numel() const override { return z_.part_numel_; }
  size_t num_tensors() const override {
    size_t n = 0;
    for (const auto& u : z_.units_) n += u->params.size();
    return n;
  }
  at::Tensor resident_state(size_t kind) override { return z_.store_->resident((z_.has_master_ ? 1 : 0) + kind); }
  void sum_tensor_stats(std::vector<double>& values) override {
    // Sharded strategies cut tensors across the data-parallel group; stage 0 ranks hold them whole.
    if (!z_.sharded_ || z_.dp_size_ == 1 || values.empty()) return;
    at::Tensor t = at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, at::kDouble);
    z_.dp_->all_reduce(t);
  }

 private:
  ZeroOptimizer& z_;
};

std::vector<std::string> ZeroOptimizer::tensor_names() const {
  std::vector<std::string> names;
  for (const auto& u : units_)
    for (const auto& p : u->params) names.push_back(p.name);
  return names;
}

nlohmann::json ZeroOptimizer::export_scalars() const { return optimizer_->export_scalars(tensor_names()); }

void ZeroOptimizer::import_scalars(const nlohmann::json& scalars) {
  optimizer_->import_scalars(scalars, tensor_names(), step_count_);
}

StepResult ZeroOptimizer::step(double loss_scale, double clip_norm, double lr, std::optional<double> beta1) {
  auto t0 = Clock::now();
  wait_reductions();
  timings_.reduce_wait_s += seconds_since(t0);

  auto t1 = Clock::now();
  double local_sq = 0.0;
  for (auto& u : units_) {
    at::Tensor g = owned_grad(*u);  // unit elements [lo, lo + shard)
    // Sum over the owned range, skipping parameters counted on another rank (tied copies on
    // later stages, replicated parameters on tensor-parallel ranks > 0); params are in offset order.
    const int64_t lo = u->grank * u->shard, hi = lo + u->shard;
    int64_t pos = lo;
    auto add = [&](int64_t a, int64_t b) {
      if (a < b) local_sq += optim::sum_squares(g.narrow(0, a - lo, b - a).data_ptr(), g.scalar_type(), b - a);
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
  StepView view(*this);
  optimizer_->step(view, step_count_, grad_scale, lr, beta1);
  timings_.optimizer_s += seconds_since(t1);

  auto t2 = Clock::now();
  gather_updated();
  timings_.allgather_s += seconds_since(t2);
  zero_grad();
  return result;
}

void ZeroOptimizer::gather_updated() {
  for (auto& u : units_) u->secondary_valid = false;  // hpZ: the parameters changed
  if (!sharded_) return;
  std::vector<comm::WorkPtr> works;
  for (auto& up : units_) {
    Unit& u = *up;
    if (!u.persistent) continue;  // stage 3 layers are gathered when they next run
    works.push_back(u.group->all_gather_async(u.full.narrow(0, u.grank * u.shard, u.shard), u.full));
  }
  for (auto& w : works) w->wait();
}

void ZeroOptimizer::zero_grad() {
  wait_reductions();
  reset_grads();
}

MemoryReport ZeroOptimizer::memory() const {
  MemoryReport r;
  for (const auto& u : units_) {
    if (u->persistent) r.params += u->full.nbytes();
    if (u->shard_param.defined()) r.params += u->shard_param.nbytes();
    if (u->secondary.defined()) r.params += u->secondary.nbytes();  // hpZ
  }
  r.gradients = gradient_bytes();
  if (const auto& ps = options_.param_store()) {
    r.params += ps->resident_bytes();  // its buffer pool
    r.offloaded += ps->offloaded_bytes();
  }
  const int64_t resident = store_->resident_bytes();
  if (store_->resident(0).defined()) {  // whole tensors in RAM
    if (has_master_) r.master = part_numel_ * static_cast<int64_t>(sizeof(float));
    r.optimizer_state = resident - r.master;
  } else {
    r.optimizer_state = resident;  // the buffer pool
    r.offloaded += store_->offloaded_bytes();
  }
  r.peak_transient = transient_.peak;
  return r;
}

}  // namespace torchspeed::zero
