// The unit: a padded flat buffer of whole parameters, the granularity of every ZeRO
// reduction, gather and partition (Note [Units] in zero_optimizer.cpp). Internal to zero/.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/zero/zero_optimizer.h"

namespace torchspeed::zero::detail {

struct UnitParam {
  std::string name;
  at::Tensor param;
  std::vector<int64_t> shape;
  int64_t offset = 0, numel = 0;
  bool ready = false;
  bool count_in_norm = true;
  int group = 0;
  bool shared = false;  // used by several layers (tied): may get one gradient per checkpointed segment
};

// A run of the update range whose parameters share a parameter group.
struct Segment {
  int64_t begin = 0, length = 0;  // relative to the update range
  int group = 0;
};

// A piece of the step: a run of one unit's update range in one parameter group, at most
// sub_group_size elements (Note [Step pieces] in zero_optimizer.cpp).
struct Piece {
  size_t unit;
  int64_t begin, length;  // relative to the unit's update range
  int group;
  std::vector<optim::TensorRange> tensors;  // the parameters it covers (per-tensor optimizers)
};

struct Unit {
  size_t index = 0;  // in the optimizer's units (stack order)
  std::vector<UnitParam> params;
  // The group the unit reduces, partitions and gathers over: the data-parallel group, or for
  // experts the expert-data-parallel group (Note [Expert units]); this rank's place in it.
  bool expert = false;
  comm::CommunicatorPtr group;
  int grank = 0, gsize = 1;
  int64_t numel = 0, padded = 0, shard = 0;
  int64_t part_offset = 0, part_size = 0;  // this unit's range in the partition buffers
  int64_t update_begin = 0;  // where this rank's update range starts in the unit
  std::vector<Segment> segments;
  at::Tensor full;         // [padded] storage dtype; params are views (stage 3: released when idle)
  // Stage 3, a unit gathered per use: this rank's shard [shard] and the gathering state.
  at::Tensor shard_param;
  bool persistent = true;
  bool gathered = true;
  comm::WorkPtr gather_work;
  // ZeRO++ hpZ: this rank's slice [padded / hpz] of the gathered unit, valid from the unit's
  // first full gather until the step changes the parameters.
  at::Tensor secondary;
  bool secondary_valid = false;
  // ZeRO++ qwZ: a gather in flight of int8 blocks ([ranks, wire bytes]), decoded into `full`
  // when it completes.
  at::Tensor qw_wire;
  // Gradients: [padded] in the accumulation dtype (replicated) or a transient bucket in the
  // storage dtype (partitioned), its copy in the communication dtype, and the reduce-scatter
  // output [shard].
  at::Tensor grad, comm_buf, recv;
  // Partitioned: which parameters' slices of `grad` this backward wrote (the rest of the
  // uninitialised bucket is zeroed when it is launched).
  std::vector<char> grad_written;
  comm::WorkPtr work;
  int ready = 0;
  bool launched = false;
  // Holds a shared parameter: reduced only once backward returned (Note [Gradients in
  // several calls] in zero_optimizer.cpp).
  bool deferred = false;
  bool part_fresh = true;  // partitioned: the next reduction overwrites the partition (no add)
};

// Parameters grouped into units: reverse model order cut at `bucket_numel` elements, returned in
// model order (gradients become ready roughly in reverse order). Expert parameters never share a
// unit with others.
std::vector<std::vector<NamedParam>> units_by_bucket(std::vector<NamedParam> params, int64_t bucket_numel);
// One unit per LayerStack layer (two where it has experts: the others', then the experts').
std::vector<std::vector<NamedParam>> units_by_layer(std::vector<NamedParam> params, int num_layers);

}  // namespace torchspeed::zero::detail
