// ParamSwapper: a ShardStore whose shards live in a swap file (DeepSpeed's offload_param.device
// "nvme", ZeRO-Infinity), read ahead through a pool of aligned buffers (Note [Parameter
// swapping] in param_swapper.cpp).
#pragma once

#include <torch/arg.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "torchspeed/offload/aio.h"
#include "torchspeed/zero/partition_store.h"

namespace torchspeed::offload {

struct ParamSwapperOptions {
  TORCH_ARG(std::string, path);
  TORCH_ARG(int64_t, buffer_count) = 5;            // offload_param.buffer_count
  TORCH_ARG(int64_t, buffer_bytes) = 200000000;    // offload_param.buffer_size x element size
  TORCH_ARG(int64_t, max_in_cpu_bytes) = 0;        // offload_param.max_in_cpu x element size
  TORCH_ARG(AioOptions, aio);
};

class ParamSwapper final : public zero::ShardStore {
 public:
  explicit ParamSwapper(ParamSwapperOptions options);
  ~ParamSwapper() override;

  void open(std::vector<int64_t> shard_bytes) override;
  bool holds(size_t unit) const override { return unit < units_.size() && units_[unit].held; }
  bool prefetch(size_t unit) override;
  void read(size_t unit, void* dst) override;
  void write(size_t unit, const void* src) override;
  void flush() override;
  int64_t resident_bytes() const override;
  int64_t offloaded_bytes() const override { return file_ ? file_->size() : 0; }
  std::string describe() const override;

  int64_t prefetch_hits() const { return hits_; }
  int64_t prefetch_misses() const { return misses_; }

 private:
  struct UnitRecord {
    bool held = false;
    int64_t bytes = 0, padded = 0, offset = 0;
    int buffer = -1;  // prefetched into this buffer
    SwapFile::Ticket read = 0;
  };
  struct PendingWrite {
    size_t unit;
    SwapFile::Ticket ticket;
    int buffer;
  };
  int acquire();                   // a free buffer, waiting for the oldest write if need be
  void reclaim(bool all);          // frees the buffers of completed (all: every) writes
  void wait_writes_of(size_t unit);
  void drop_prefetch(size_t unit);

  ParamSwapperOptions options_;
  std::vector<UnitRecord> units_;
  std::unique_ptr<SwapFile> file_;
  std::vector<AlignedBuffer> buffers_;
  std::vector<int> free_;
  std::deque<PendingWrite> writes_;
  int64_t buffer_bytes_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace torchspeed::offload
