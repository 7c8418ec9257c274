// The optimizer's state as checkpoints and models see it: every parameter's master value
// gathered whole (experts across the expert-parallel group too), this rank's partition exported
// and imported (whole, or streamed for offloaded state), its layout, names, shapes and groups.
#include <ATen/ATen.h>

#include <algorithm>

#include "torchspeed/base/error.h"
#include "torchspeed/zero/detail/units.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero {

using detail::Unit;

std::vector<std::pair<std::string, at::Tensor>> ZeroOptimizer::gather_master() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const at::Tensor master = has_master_ ? read_kind(0, /*copy=*/false) : at::Tensor();
  for (auto& up : units_) {
    Unit& u = *up;
    at::Tensor local = has_master_ ? master.narrow(0, u.part_offset, u.part_size) : update_dest(u);
    at::Tensor whole = local.to(at::kFloat).contiguous();
    if (sharded_) {
      whole = at::empty({u.padded}, at::kFloat);
      u.group->all_gather(local.to(at::kFloat).contiguous(), whole);
    }
    if (!u.expert) {
      for (auto& p : u.params) out.emplace_back(p.name, whole.narrow(0, p.offset, p.numel).view(p.shape).clone());
      continue;
    }
    // Every expert: the expert-parallel ranks' units, each parameter's blocks in rank order.
    at::Tensor all = at::empty({ep_size_ * u.padded}, at::kFloat);
    options_.expert_parallel()->all_gather(whole, all);
    for (auto& p : u.params) {
      std::vector<at::Tensor> blocks;
      for (int r = 0; r < ep_size_; ++r) blocks.push_back(all.narrow(0, r * u.padded + p.offset, p.numel).view(p.shape));
      out.emplace_back(p.name, at::cat(blocks));
    }
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ZeroOptimizer::export_partition(bool copy) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!has_master_) {  // fp32: the masters are the parameters (or stage 3 shards) themselves
    at::Tensor master = at::empty({part_numel_}, at::kFloat);
    for (const auto& up : units_) {
      const Unit& u = *up;
      at::Tensor src = u.persistent ? u.full.narrow(0, u.update_begin, u.part_size) : u.shard_param;
      master.narrow(0, u.part_offset, u.part_size).copy_(src);
    }
    out.emplace_back("master", master);
  }
  for (size_t k = 0; k < kinds_.size(); ++k) out.emplace_back(kinds_[k], read_kind(k, copy));
  return out;
}

// Note [Streamed partitions]
// An offloaded partition is larger than the memory the process may use, so a checkpoint never
// holds one of its kinds whole. Saving: the kinds stream out of the store's visit piece by piece
// (each kind's elements in partition order, so the writer appends each at its own offset), and
// fp32 masters that are the parameters themselves stream from the units. Loading: one visit
// fills each piece of every kind from the reader (checkpoint files read in ranges) and writes
// the parameters from the piece's masters as it goes, as the step does. A resident store still
// gets whole tensors, read once and adopted.
ZeroOptimizer::PartitionExport ZeroOptimizer::export_partition_streamed() const {
  PartitionExport out;
  if (store_->resident(0).defined()) {
    out.resident = export_partition(/*copy=*/false);
    return out;
  }
  if (!has_master_) out.streamed.push_back("master");
  for (const auto& k : kinds_) out.streamed.push_back(k);
  out.stream = [this](const ElementSink& fn) {
    const size_t first = has_master_ ? 0 : 1;  // streamed index of kinds_[0]
    if (!has_master_) {  // fp32: the masters are the parameters (or stage 3 shards) themselves
      for (const auto& up : units_) {
        const Unit& u = *up;
        const at::Tensor src = u.persistent ? u.full.narrow(0, u.update_begin, u.part_size) : u.shard_param;
        fn(0, src.data_ptr<float>(), u.part_size);
      }
    }
    store_->visit(
        [&](size_t i, float* const* state) {
          for (size_t k = 0; k < kinds_.size(); ++k) fn(first + k, state[k], pieces_[i].length);
        },
        /*read=*/true, /*write=*/false);
  };
  return out;
}

void ZeroOptimizer::import_partition(std::vector<std::pair<std::string, at::Tensor>> tensors, int64_t steps) {
  auto find = [&](const std::string& name) -> at::Tensor& {
    for (auto& [n, t] : tensors)
      if (n == name) {
        TS_CHECK(t.numel() == part_numel_ && t.scalar_type() == at::kFloat, "optimizer state '", name, "' has ",
                 t.numel(), " ", t.scalar_type(), " elements; this rank's partition needs ", part_numel_,
                 " float32 (a different model, data-parallel size or ZeRO stage)");
        return t;
      }
    TS_CHECK(false, "optimizer state has no '", name, "' tensor");
  };
  // Every tensor is checked before any buffer changes.
  std::map<std::string, at::Tensor> by_kind;
  by_kind["master"] = find("master").contiguous();
  for (const auto& kind : kinds_) by_kind[kind] = find(kind).contiguous();
  tensors.clear();  // ours are the only references left
  // A tensor only this call holds becomes the live buffer of a resident store (a checkpoint
  // load); otherwise it is copied.
  std::vector<bool> have(kinds_.size(), false);
  for (size_t k = 0; k < kinds_.size(); ++k) {
    at::Tensor& t = by_kind[kinds_[k]];
    const bool sole = t.storage_offset() == 0 && t.use_count() == 1 && t.storage().use_count() == 1;
    if (store_->resident(k).defined() && sole && store_->adopt(k, t)) have[k] = true;
  }
  import_from(
      [&](const std::string& kind, int64_t begin, int64_t n, float* dst) {
        std::memcpy(dst, by_kind.at(kind).data_ptr<float>() + begin, static_cast<size_t>(n) * sizeof(float));
      },
      have, steps);
}

void ZeroOptimizer::import_partition(const PartitionReader& read, int64_t steps) {
  import_from(read, std::vector<bool>(kinds_.size(), false), steps);
}

// See Note [Streamed partitions].
void ZeroOptimizer::import_from(const PartitionReader& read, const std::vector<bool>& have, int64_t steps) {
  const bool resident = store_->resident(0).defined();
  if (resident) {
    for (size_t k = 0; k < kinds_.size(); ++k) {
      if (have[k]) continue;
      at::Tensor t = at::empty({part_numel_}, at::kFloat);
      read(kinds_[k], 0, part_numel_, t.data_ptr<float>());
      if (!store_->adopt(k, t)) store_->resident(k).copy_(t);
    }
  }
  step_count_ = steps;
  optimizer_->restart();  // what checkpoints do not keep (compression errors, schedules)
  before_import();
  if (!has_master_) {  // fp32: each unit's masters are read straight into its parameters
    for (auto& up : units_) {
      Unit& u = *up;
      at::Tensor dest = begin_update(u);
      read("master", u.part_offset, u.part_size, dest.data_ptr<float>());
      end_update(u, dest);
    }
  }
  if (has_master_ || !resident) {
    // Piece by piece: fill an offloaded store, write the parameters from the masters.
    const optim::ParamOut out_kind = param_out(/*master_is_param=*/false);
    size_t cached = SIZE_MAX;
    at::Tensor dest;
    store_->visit(
        [&](size_t i, float* const* state) {
          const detail::Piece& pc = pieces_[i];
          if (!resident) {
            const int64_t at = units_[pc.unit]->part_offset + pc.begin;
            for (size_t k = 0; k < kinds_.size(); ++k) read(kinds_[k], at, pc.length, state[k]);
          }
          if (!has_master_) return;
          if (cached != pc.unit) {
            if (cached != SIZE_MAX) end_update(*units_[cached], dest);
            dest = begin_update(*units_[pc.unit]);
            cached = pc.unit;
          }
          optim::write_params(state[0], pc.length,
                              static_cast<char*>(dest.data_ptr()) + pc.begin * static_cast<int64_t>(dest.element_size()),
                              out_kind);
        },
        /*read=*/false, /*write=*/!resident);
    if (cached != SIZE_MAX) end_update(*units_[cached], dest);
  }
  gather_updated();
  zero_grad();
}

PartitionLayout ZeroOptimizer::layout() const {
  PartitionLayout l;
  l.stage = stage_number(strategy_);
  l.dp = dp_size_;
  l.ep = ep_size_;
  l.part_numel = part_numel_;
  for (const auto& up : units_) {
    UnitLayout u{up->padded, up->shard, up->part_offset, up->part_size, {}, up->expert};
    for (const auto& p : up->params) u.params.push_back({p.name, p.offset, p.numel});
    l.units.push_back(std::move(u));
  }
  return l;
}

std::vector<std::string> ZeroOptimizer::state_kinds() const { return optimizer_->state_kinds(); }

std::vector<std::pair<std::string, std::vector<int64_t>>> ZeroOptimizer::param_shapes() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& u : units_) {
    for (const auto& p : u->params) {
      std::vector<int64_t> shape = p.shape;  // an expert parameter's whole shape: every rank's experts
      if (u->expert) shape.at(0) *= ep_size_;
      out.emplace_back(p.name, shape);
    }
  }
  return out;
}

std::vector<std::pair<std::string, int>> ZeroOptimizer::param_groups() const {
  std::vector<std::pair<std::string, int>> out;
  for (const auto& u : units_)
    for (const auto& p : u->params) out.emplace_back(p.name, p.group);
  return out;
}

}  // namespace torchspeed::zero
