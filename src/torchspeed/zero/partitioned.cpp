// PartitionedGradients (stage 2) and PartitionedParameters (stage 3) with its
// ParameterGatherer (Note [ZeRO strategies]).
//
// Stage 3 releases a unit's storage by resizing it to 0 bytes, which keeps autograd's saved
// references valid (DESIGN.md), and gathers it again before the layer's forward and backward.
// Whether a layer is gathered decides which all-gathers the next forward issues, which must be
// the same on every rank: units are released at deterministic points (after the layer's forward,
// when its last gradient arrived, at the end of backward), never when a reduction completes.
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <ATen/native/Resize.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>

#include <algorithm>

#include "torchspeed/comm/compressed.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/zero/detail/strategies.h"
#include "torchspeed/zero/detail/units.h"

namespace torchspeed::zero::detail {

using Clock = std::chrono::steady_clock;

namespace {
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void resize_storage(const at::Tensor& t, int64_t bytes) {
  c10::NoGradGuard guard;
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), static_cast<size_t>(bytes));
}
}  // namespace

// --- stage 2 -----------------------------------------------------------------------------------

PartitionedGradients::PartitionedGradients(std::vector<NamedParam> params, comm::CommunicatorPtr dp,
                                           ZeroOptions options, OptimizerSpec optimizer)
    : PartitionedGradients(Stage::k2, std::move(dp), std::move(options), std::move(optimizer)) {
  build(units_by_bucket(std::move(params), options_.reduce_bucket_numel()));
}

PartitionedGradients::PartitionedGradients(Stage stage, comm::CommunicatorPtr dp, ZeroOptions options,
                                           OptimizerSpec optimizer)
    : ZeroOptimizer(stage, std::move(dp), std::move(options), std::move(optimizer), /*sharded=*/true),
      reduce_scatter_(options_.reduce_scatter()) {}

void PartitionedGradients::allocate(Unit&) {}

// Allocated at its first use, not with the units: at construction the model's own parameters
// still exist, and the init peak would otherwise hold them and the partition at once.
at::Tensor& PartitionedGradients::grad_part() {
  if (!grad_part_.defined()) grad_part_ = at::zeros({part_numel_}, at::TensorOptions().dtype(accum_dtype_));
  return grad_part_;
}

void PartitionedGradients::on_gradient(size_t ui, size_t pi, bool first) {
  Unit& u = *units_[ui];
  auto& p = u.params[pi];
  at::Tensor& g = p.param.mutable_grad();
  if (g.defined()) {
    if (!u.grad.defined()) {
      // Uninitialised: each parameter's first gradient is copied in, and only what no gradient
      // wrote (padding, parameters without one) is zeroed at launch: a full memset of every
      // bucket was 0.1 s of a 4 s step (SmolLM2-135M's shape, bench train).
      u.grad = at::empty({u.padded}, at::TensorOptions().dtype(storage_dtype()));
      u.grad_written.assign(u.params.size(), 0);
      transient_.add(u.grad.nbytes());
    }
    at::Tensor slice = u.grad.narrow(0, p.offset, p.numel).view(p.shape);
    if (first || !u.grad_written[pi]) slice.copy_(g); else slice.add_(g);
    u.grad_written[pi] = 1;
    g.reset();  // the full gradient lives only in the unit's buffer until it is reduced
  }
  poll_finished();
}

void PartitionedGradients::launch(size_t ui) {
  Unit& u = *units_[ui];
  if (u.launched) return;
  u.launched = true;
  if (!u.grad.defined()) {  // no parameter of the unit got a gradient
    u.grad = at::zeros({u.padded}, at::TensorOptions().dtype(storage_dtype()));
    transient_.add(u.grad.nbytes());
  } else {
    // Zero every range no gradient was written to.
    std::vector<std::pair<int64_t, int64_t>> written;
    for (size_t i = 0; i < u.params.size(); ++i)
      if (u.grad_written[i]) written.push_back({u.params[i].offset, u.params[i].numel});
    std::sort(written.begin(), written.end());
    int64_t at_ = 0;
    for (const auto& [offset, numel] : written) {
      if (offset > at_) u.grad.narrow(0, at_, offset - at_).zero_();
      at_ = std::max(at_, offset + numel);
    }
    if (at_ < u.padded) u.grad.narrow(0, at_, u.padded - at_).zero_();
  }
  at::Tensor buf = start_reduction(ui, reduce_scatter_);
  if (!reduce_scatter_) u.recv = buf.narrow(0, u.grank * u.shard, u.shard);  // in place: this rank's shard
}

void PartitionedGradients::finalize(size_t ui) {
  Unit& u = *units_[ui];
  u.work->wait();
  u.work.reset();
  after_reduce(u.recv);
  at::Tensor part = grad_part().narrow(0, u.part_offset, u.part_size);
  if (u.part_fresh) part.copy_(u.recv); else part.add_(u.recv.to(part.scalar_type()));
  u.part_fresh = false;
  transient_.add(-u.grad.nbytes() - (reduce_scatter_ ? u.recv.nbytes() : 0) -
                 (u.comm_buf.defined() ? u.comm_buf.nbytes() : 0));
  u.grad = at::Tensor();
  u.recv = at::Tensor();
  u.comm_buf = at::Tensor();
}

at::Tensor PartitionedGradients::owned_grad(Unit& u) { return grad_part().narrow(0, u.part_offset, u.part_size); }

at::Tensor PartitionedGradients::update_grad(Unit& u) { return grad_part().narrow(0, u.part_offset, u.part_size); }

void PartitionedGradients::reset_grads() {
  for (auto& u : units_) u->part_fresh = true;  // next reductions overwrite: no memset needed
}

int64_t PartitionedGradients::gradient_bytes() const {
  return part_numel_ * static_cast<int64_t>(c10::elementSize(accum_dtype_));  // allocated or to be
}

// --- stage 3: the gatherer ---------------------------------------------------------------------

// Note [Hierarchical partitioning] (ZeRO++ hpZ, `zero_hpz_partition_size` = h)
// A unit's first gather after a step is the full all-gather of its primary shards across the
// data-parallel group, which crosses hosts. Its result is then cut into h slices and each rank
// of every group of h consecutive data-parallel ranks keeps its own slice, the secondary shard
// (padded / h elements, a multiple of 16: h divides the group's size). Every later gather of
// the unit until the next step (backward, and the next micro-steps' forward and backward) is an
// all-gather of the secondary shards within the group, which a host holds when h is the ranks
// per host. The step changes the parameters: gather_updated marks every secondary stale, on
// every rank at the same point, so all ranks agree which group each gather runs in. Per step
// the slow link carries one all-gather of the parameters instead of 1 + 2 x (micro-steps - 1)
// + 1; each rank keeps padded / h more elements per gathered unit. The values are those the
// forward gather produced (with qwZ: the dequantized ones), so hpZ alone changes no number.

class ParameterGatherer final : public LayerHooks, public std::enable_shared_from_this<ParameterGatherer> {
 public:
  ParameterGatherer(std::vector<std::unique_ptr<Unit>>& units, std::vector<std::vector<size_t>> layer_units,
                    comm::CommunicatorPtr dp, const ZeroOptions& options, TransientBytes& transient, Timings& timings)
      : units_(units), layer_units_(std::move(layer_units)), dp_(std::move(dp)), shards_(options.param_store()),
        prefetch_numel_(options.prefetch_bucket_numel()), max_live_(options.max_live_parameters()),
        quantized_(options.quantized_weights() && dp_->size() > 1), transient_(transient), timings_(timings) {
    const int h = options.hpz_partition_size(), p = dp_->size();
    TS_CHECK(h >= 1 && p % h == 0, "zero_optimization.zero_hpz_partition_size: ", h,
             " does not divide the data-parallel size ", p, " (it is the ranks of a group that share a host)");
    if (h > 1 && h < p) {  // h == p: the secondary group would be the whole group
      hpz_ = dp_->split(dp_->rank() / h, dp_->rank(), dp_->name() + ".hpz");  // collective
      const int hosts = dp_->hierarchy_hosts();
      if (hosts > 1 && (p / hosts) % h != 0) {
        log::warn0("zero_optimization.zero_hpz_partition_size: ", h, " consecutive data-parallel ranks span hosts (",
                  p / hosts, " of the group's ranks share each host): hpZ's gathers still cross the link");
      }
    }
  }

  ~ParameterGatherer() override {
    // Prefetches in flight write into our units' storage: wait for them.
    for (auto& u : units_) {
      try {
        if (u->gather_work) u->gather_work->wait();
      } catch (...) {
      }
    }
  }

  void before_forward(int layer) override {
    for (size_t ui : layer_units_.at(static_cast<size_t>(layer))) ensure_gathered(*units_[ui]);
    prefetch_after(layer, +1);
    read_ahead(layer, +1);
  }

  at::Tensor after_forward(int layer, const at::Tensor& output, bool grad_enabled) override;

  void gather_for_backward(int layer) {
    for (size_t ui : layer_units_.at(static_cast<size_t>(layer))) ensure_gathered(*units_[ui]);
    prefetch_after(layer, -1);
    read_ahead(layer, -1);
  }

  void release(Unit& u) {
    if (u.persistent) return;
    if (u.gather_work) ensure_gathered(u);
    if (u.gathered && u.full.storage().nbytes() > 0) {
      transient_.add(-u.full.nbytes());
      resize_storage(u.full, 0);
    }
    u.gathered = false;
  }

 private:
  void gather(Unit& u) {
    if (u.gathered || u.gather_work) return;
    resize_storage(u.full, u.padded * static_cast<int64_t>(u.full.element_size()));
    transient_.add(u.full.nbytes());
    if (hpz_ && u.secondary_valid) {  // within the host (Note [Hierarchical partitioning])
      u.gather_work = hpz_->all_gather_async(u.secondary, u.full);
      return;
    }
    at::Tensor mine = u.shard_param;
    if (!mine.defined()) {  // offloaded: the shard comes from its file into its slot
      mine = u.full.narrow(0, u.grank * u.shard, u.shard);
      shards_->read(u.index, mine.data_ptr());
    }
    if (quantized_) {  // qwZ: every rank's shard as int8 blocks, decoded in finish_gather
      const int64_t wb = comm::Int8Blocks::wire_bytes(u.shard);
      u.qw_wire = at::empty({dp_->size() * wb}, at::kByte);
      transient_.add(u.qw_wire.nbytes());
      at::Tensor row = u.qw_wire.narrow(0, dp_->rank() * wb, wb);
      comm::Int8Blocks::encode(mine, row.data_ptr<uint8_t>());
      u.gather_work = dp_->all_gather_async(row, u.qw_wire);
      return;
    }
    u.gather_work = u.group->all_gather_async(mine, u.full);  // the data-parallel group, or for experts theirs
  }

  // The gather has completed: decode qwZ's rows, keep hpZ's secondary shard.
  void finish_gather(Unit& u) {
    if (u.qw_wire.defined()) {
      const int64_t wb = comm::Int8Blocks::wire_bytes(u.shard);
      const uint8_t* wire = u.qw_wire.data_ptr<uint8_t>();
      for (int r = 0; r < dp_->size(); ++r) comm::Int8Blocks::decode(wire + r * wb, u.full.narrow(0, r * u.shard, u.shard));
      transient_.add(-u.qw_wire.nbytes());
      u.qw_wire = at::Tensor();
    }
    if (hpz_ && !u.secondary_valid) {
      const int64_t n = u.padded / hpz_->size();
      if (!u.secondary.defined()) u.secondary = at::empty({n}, u.full.options());
      u.secondary.copy_(u.full.narrow(0, hpz_->rank() * n, n));
      u.secondary_valid = true;
    }
  }

  // Offloaded shards of the next layers in stack order (the order they run: no trace needed)
  // are read from disk while this one computes, as far as the store's buffer pool allows.
  void read_ahead(int layer, int direction) {
    if (!shards_) return;
    for (int l = layer + direction; l >= 0 && l < static_cast<int>(layer_units_.size()); l += direction) {
      for (size_t ui : layer_units_[static_cast<size_t>(l)]) {
        const Unit& u = *units_[ui];
        if (u.persistent || u.gathered || u.gather_work || u.shard_param.defined()) continue;
        if (!shards_->prefetch(ui)) return;
      }
    }
  }

  void ensure_gathered(Unit& u) {
    if (u.gathered) return;
    if (!u.gather_work) gather(u);
    auto t = Clock::now();
    u.gather_work->wait();
    timings_.allgather_s += seconds_since(t);
    u.gather_work.reset();
    finish_gather(u);
    u.gathered = true;
  }

  void prefetch_after(int layer, int direction) {
    int64_t budget = prefetch_numel_;
    int64_t live = 0;
    for (auto& u : units_)
      if (u->gathered || u->gather_work) live += u->padded;
    for (int l = layer + direction; l >= 0 && l < static_cast<int>(layer_units_.size()); l += direction) {
      for (size_t ui : layer_units_[static_cast<size_t>(l)]) {
        Unit& u = *units_[ui];
        if (u.gathered || u.gather_work) continue;
        if (u.padded > budget || live + u.padded > max_live_) return;
        gather(u);
        budget -= u.padded;
        live += u.padded;
      }
      if (budget <= 0) return;
    }
  }

  std::vector<std::unique_ptr<Unit>>& units_;
  std::vector<std::vector<size_t>> layer_units_;  // units each layer needs
  comm::CommunicatorPtr dp_;
  comm::CommunicatorPtr hpz_;  // hpZ's group of consecutive data-parallel ranks; null: off
  ShardStorePtr shards_;
  int64_t prefetch_numel_, max_live_;
  bool quantized_;  // qwZ
  TransientBytes& transient_;
  Timings& timings_;
};

namespace {
// The gatherer a layer's backward needs, owned by the autograd graph as a capsule: a weak
// reference, so a graph that outlives its optimizer fails with a message instead of touching
// freed memory.
struct GathererRef : torch::CustomClassHolder {
  explicit GathererRef(std::weak_ptr<ParameterGatherer> g) : gatherer(std::move(g)) {}
  std::weak_ptr<ParameterGatherer> gatherer;
};

// Identity in forward; in backward, gathers the layer's parameters before the layer's own
// backward runs.
struct GatherBeforeBackward : public torch::autograd::Function<GatherBeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, c10::IValue ref, int64_t layer) {
    ctx->saved_data["gatherer"] = std::move(ref);
    ctx->saved_data["layer"] = layer;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto ref = c10::static_intrusive_pointer_cast<GathererRef>(ctx->saved_data["gatherer"].toCapsule());
    auto g = ref->gatherer.lock();
    TS_CHECK(g, "backward through a ZeRO stage 3 layer whose optimizer (engine) no longer exists");
    g->gather_for_backward(static_cast<int>(ctx->saved_data["layer"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor ParameterGatherer::after_forward(int layer, const at::Tensor& output, bool grad_enabled) {
  at::Tensor out = output;
  if (grad_enabled && output.requires_grad()) {
    auto ref = c10::IValue::make_capsule(c10::make_intrusive<GathererRef>(weak_from_this()));
    out = GatherBeforeBackward::apply(output, std::move(ref), static_cast<int64_t>(layer));
  }
  for (size_t ui : layer_units_.at(static_cast<size_t>(layer))) release(*units_[ui]);
  return out;
}

// --- stage 3: the strategy ---------------------------------------------------------------------

PartitionedParameters::PartitionedParameters(std::vector<NamedParam> params, int num_layers,
                                             comm::CommunicatorPtr dp, ZeroOptions options, OptimizerSpec optimizer)
    : PartitionedGradients(Stage::k3, std::move(dp), std::move(options), std::move(optimizer)),
      shards_(options_.param_store()) {
  auto units = units_by_layer(std::move(params), num_layers);
  // A layer needs every unit holding a parameter it uses (tied weights: a later layer too).
  std::vector<std::vector<size_t>> layer_units(static_cast<size_t>(num_layers));
  for (size_t ui = 0; ui < units.size(); ++ui) {
    for (const auto& p : units[ui]) {
      std::vector<int> users = p.also_used_by;
      users.push_back(p.layer);
      for (int l : users) {
        auto& lu = layer_units.at(static_cast<size_t>(l));
        if (std::find(lu.begin(), lu.end(), ui) == lu.end()) lu.push_back(ui);
      }
    }
  }
  gatherer_ = std::make_shared<ParameterGatherer>(units_, std::move(layer_units), dp_, options_, transient_, timings_);
  build(std::move(units));
}

PartitionedParameters::~PartitionedParameters() = default;

LayerHooks* PartitionedParameters::layer_hooks() { return gatherer_.get(); }

bool PartitionedParameters::keeps_whole(const Unit& u) const {
  return u.numel < options_.param_persistence_threshold();
}

void PartitionedParameters::allocate(Unit& u) {
  PartitionedGradients::allocate(u);
  if (u.persistent) return;
  if (shards_ && !shards_open_) {  // every unit's size is known by the first allocate
    std::vector<int64_t> bytes;
    const auto es = static_cast<int64_t>(c10::elementSize(storage_dtype()));
    for (const auto& x : units_) bytes.push_back(x->persistent ? 0 : x->shard * es);
    shards_->open(std::move(bytes));
    shards_open_ = true;
  }
  at::Tensor mine = u.full.narrow(0, u.grank * u.shard, u.shard);
  if (offloaded(u)) {
    shards_->write(u.index, mine.data_ptr());
  } else {
    u.shard_param = mine.clone();
  }
  transient_.add(u.full.nbytes());
  gatherer_->release(u);
}

bool PartitionedParameters::offloaded(const Unit& u) const {
  return shards_ && !u.persistent && shards_->holds(u.index);
}

at::Tensor PartitionedParameters::begin_update(Unit& u) {
  // An offloaded shard is written whole by the step (the masters are separate): a staging
  // buffer for one unit at a time, stored in end_update.
  if (offloaded(u)) return at::empty({u.shard}, at::TensorOptions().dtype(u.full.scalar_type()));
  return update_dest(u);
}

void PartitionedParameters::end_update(Unit& u, const at::Tensor& dest) {
  if (offloaded(u)) shards_->write(u.index, dest.data_ptr());
}

void PartitionedParameters::on_unit_complete(size_t ui) {
  // The layer's backward has produced every gradient of this unit: its parameters are done.
  Unit& u = *units_[ui];
  if (!u.persistent && u.gathered) gatherer_->release(u);
}

void PartitionedParameters::release_idle() {
  for (auto& u : units_)
    if (!u->persistent && (u->gathered || u->gather_work)) gatherer_->release(*u);
}

void PartitionedParameters::before_import() {
  for (auto& u : units_)
    if (!u->persistent && u->gathered) gatherer_->release(*u);
}

}  // namespace torchspeed::zero::detail
