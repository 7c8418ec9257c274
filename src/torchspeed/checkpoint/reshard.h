// Reading ZeRO partitions that a checkpoint wrote under one layout (data-parallel size, stage,
// bucket sizes) and rearranging them for another: a rank's partition under a new layout
// (resharding on load), or every parameter whole (consolidation). Works element range by
// element range from the layouts (see zero/partition_layout.h); nothing is gathered over MPI.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/zero/partition_layout.h"

namespace torchspeed::checkpoint {

class ShardSource {
 public:
  // `files[r]`: the shard file (relative to `dir`) holding data-parallel rank r's partition, or
  // "" for a rank that wrote none (stage 0 ranks > 0 hold copies of rank 0's). Files are read
  // on first use and verified against `digests` (size and CRC-32C, by file name).
  ShardSource(std::string dir, zero::PartitionLayout layout, std::vector<std::string> files,
              std::map<std::string, FileDigest> digests);

  // `rank`'s partition under `target`: for each kind ("master", "exp_avg", ...) an fp32
  // [target.part_numel] tensor, padding zero.
  NamedTensors partition(const zero::PartitionLayout& target, int rank, const std::vector<std::string>& kinds);

  // The same partition read in ranges, never whole (offloaded state larger than memory):
  // read(kind, begin, n, dst) fills dst with elements [begin, begin + n), padding zero. Every
  // file it needs is opened and verified (size and CRC-32C) before this returns. The reader
  // uses this source: keep it alive while reading.
  using RangeReader = std::function<void(const std::string& kind, int64_t begin, int64_t n, float* dst)>;
  RangeReader reader(const zero::PartitionLayout& target, int rank);

  // Every parameter of `kind` whole, with the given shapes, in the given order.
  NamedTensors full(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params, const std::string& kind);

  // The files opened so far (for tests and reports).
  size_t files_read() const { return cache_.size(); }

 private:
  struct Segment {  // parameter elements [begin, begin + length) at part_offset of `rank`'s shard
    int64_t begin, length, part_offset;
    int rank;
  };
  const SafetensorsReader& file(int rank);
  // Checks that `kind` in `rank`'s shard is an fp32 [part_numel] tensor.
  void check_kind(int rank, const std::string& kind);
  // Copies parameter `name`'s elements [begin, begin + length) of `kind` to dest.
  void copy(const std::string& name, int64_t begin, int64_t length, const std::string& kind, float* dest);

  std::string dir_;
  zero::PartitionLayout layout_;
  std::vector<std::string> files_;
  std::map<std::string, FileDigest> digests_;
  std::map<std::string, std::vector<Segment>> segments_;  // by parameter name
  std::map<int, std::unique_ptr<SafetensorsReader>> cache_;  // files opened (and verified) so far
};

struct Opened;
// A checkpoint holds one slice of the model per (pipeline stage, tensor-parallel rank), each
// with its own ZeRO layout over its data-parallel group. The ShardSource of one slice:
ShardSource shard_source(const Opened& checkpoint, int pp, int tp);
// That slice's parameters with their shapes, in model order (tied copies included).
std::vector<std::pair<std::string, std::vector<int64_t>>> slice_params(const Opened& checkpoint, int pp, int tp);
// Every parameter of the model whole, `kind` ("master", "exp_avg", ...), in model order, each
// tied weight once (under its first stage's name).
NamedTensors full_state(const Opened& checkpoint, const std::string& kind);

}  // namespace torchspeed::checkpoint
