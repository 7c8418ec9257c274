// OptimizerSwapper: a PartitionStore whose state lives in a swap file (DeepSpeed's
// offload_optimizer.device "nvme"), streamed through a fixed pool of aligned buffers
// (Note [Optimizer swapping] in optimizer_swapper.cpp).
#pragma once

#include <torch/arg.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "torchspeed/offload/aio.h"
#include "torchspeed/zero/partition_store.h"

namespace torchspeed::offload {

struct SwapperOptions {
  TORCH_ARG(std::string, path);              // the swap file
  TORCH_ARG(int64_t, buffer_count) = 4;      // offload_optimizer.buffer_count
  TORCH_ARG(int64_t, group_numel) = 1000000000;  // sub_group_size: elements per swapped group
  TORCH_ARG(bool, pipeline_read) = false;    // read group i+1 while group i is updated
  TORCH_ARG(bool, pipeline_write) = false;   // write group i-1 while group i is updated
  TORCH_ARG(AioOptions, aio);
};

// I/O counters of a swapper, summed over its life.
struct SwapStats {
  int64_t bytes_read = 0, bytes_written = 0;
  double wait_s = 0.0;  // time the step waited for I/O
  int64_t visits = 0;
};

class OptimizerSwapper final : public zero::PartitionStore {
 public:
  explicit OptimizerSwapper(SwapperOptions options);
  ~OptimizerSwapper() override;

  void open(std::vector<std::string> kinds, int64_t part_numel, std::vector<zero::PieceRange> pieces) override;
  void visit(const Visitor& fn, bool read, bool write) override;
  void prefetch() override;
  int64_t resident_bytes() const override;
  int64_t offloaded_bytes() const override;
  std::string describe() const override;

  // Until every write has completed (they otherwise finish behind the next forward).
  void flush();
  SwapStats stats() const;

 private:
  struct Group {
    size_t first_piece = 0, end_piece = 0;
    int64_t begin = 0, numel = 0;  // elements of the partition
    int64_t padded_bytes = 0;      // one kind's bytes, padded to the alignment
    int64_t file_offset = 0;
  };
  enum class GroupState { kIdle, kReading, kWriting };
  void start(size_t group, bool read);
  void retire_oldest_write();
  void reclaim_written();

  SwapperOptions options_;
  std::vector<std::string> kinds_;
  std::vector<zero::PieceRange> pieces_;
  std::vector<Group> groups_;
  std::unique_ptr<SwapFile> file_;
  std::vector<AlignedBuffer> buffers_;
  std::vector<int> free_;            // buffers not in use
  std::deque<size_t> writing_;       // groups whose write is in flight, oldest first
  std::vector<GroupState> state_;    // per group
  std::vector<int> buf_of_;          // per group: its buffer, or -1
  std::vector<SwapFile::Ticket> read_ticket_, write_ticket_;
  int64_t visits_ = 0;
};

}  // namespace torchspeed::offload
