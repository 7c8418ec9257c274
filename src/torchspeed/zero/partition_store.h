// PartitionStore: where a rank's optimizer partition lives (fp32 master weights where they are a
// separate copy, and the moments). The step, the checkpoint export and the import reach it only
// through visit(), piece by piece in partition order, so the store decides what is resident:
// MemoryStore keeps whole tensors in RAM; offload/ streams the pieces from files through a small
// buffer pool (Note [Optimizer swapping] in offload/optimizer_swapper.cpp). A further tier (a
// device's memory) is one more implementation, not a change here.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torchspeed::zero {

// A range of the partition [begin, begin + length) in elements.
struct PieceRange {
  int64_t begin = 0, length = 0;
};

class PartitionStore {
 public:
  virtual ~PartitionStore() = default;

  // Called once by the optimizer: the fp32 tensors it keeps ("master", "exp_avg", ...), each of
  // `part_numel` elements, and the pieces its step visits, in order, tiling [0, part_numel).
  virtual void open(std::vector<std::string> kinds, int64_t part_numel, std::vector<PieceRange> pieces) = 0;

  // Calls fn(piece, state) for every piece in order; state[k] points at the piece's elements of
  // kinds[k]. `read`: the pointers hold the stored values (else anything: fn writes all of
  // them). `write`: what fn leaves there is stored.
  using Visitor = std::function<void(size_t piece, float* const* state)>;
  virtual void visit(const Visitor& fn, bool read, bool write) = 0;
  // A hint that the next visit reads: a store may start reading its first pieces now (called
  // as the backward that ends an accumulation window begins).
  virtual void prefetch() {}

  // The whole tensor of a kind when it is resident (MemoryStore), else undefined.
  virtual at::Tensor resident(size_t kind) { return at::Tensor(); }
  // Replaces a resident kind's tensor (a checkpoint load adopting its buffers). False when the
  // store is not resident: the caller writes through visit().
  virtual bool adopt(size_t kind, at::Tensor t) { return false; }

  // RAM the store holds (whole tensors, or the buffer pool) and bytes in the slower tier.
  virtual int64_t resident_bytes() const = 0;
  virtual int64_t offloaded_bytes() const { return 0; }
  // Where the state lives, for logs and `torchspeed config`: "memory", "nvme:/path (...)".
  virtual std::string describe() const = 0;
};

using PartitionStorePtr = std::shared_ptr<PartitionStore>;

// Where ZeRO stage 3 keeps this rank's parameter shards while their layers are not in use
// (DeepSpeed's offload_param): the shard of unit i is read back before the unit is gathered and
// written after the step updates it. Units are numbered in stack order, which is also the order
// the forward reads them (and backward, reversed), so prefetch() can read ahead without a trace.
class ShardStore {
 public:
  virtual ~ShardStore() = default;
  // Called once with every stage-3 unit's shard size in bytes (0: the unit stays in RAM).
  virtual void open(std::vector<int64_t> shard_bytes) = 0;
  virtual bool holds(size_t unit) const = 0;
  // Starts reading a unit's shard ahead of its use where the buffer pool has room; false when
  // it has none (the read then happens in read()).
  virtual bool prefetch(size_t unit) = 0;
  // The unit's shard into dst (its bytes), from a prefetch or read now in buffer-sized pieces.
  virtual void read(size_t unit, void* dst) = 0;
  // Stores the unit's shard from src; src may be reused when this returns.
  virtual void write(size_t unit, const void* src) = 0;
  // Until every write has reached the file.
  virtual void flush() = 0;
  virtual int64_t resident_bytes() const = 0;
  virtual int64_t offloaded_bytes() const = 0;
  virtual std::string describe() const = 0;
};

using ShardStorePtr = std::shared_ptr<ShardStore>;

// Everything in RAM: one fp32 tensor per kind.
class MemoryStore final : public PartitionStore {
 public:
  void open(std::vector<std::string> kinds, int64_t part_numel, std::vector<PieceRange> pieces) override;
  void visit(const Visitor& fn, bool read, bool write) override;
  at::Tensor resident(size_t kind) override { return tensors_.at(kind); }
  bool adopt(size_t kind, at::Tensor t) override;
  int64_t resident_bytes() const override;
  std::string describe() const override { return "memory"; }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<PieceRange> pieces_;
};

}  // namespace torchspeed::zero
