// Where every parameter's elements sit in each data-parallel rank's optimizer partition: the
// deterministic flat layout that makes checkpoints resharable. A unit is a padded flat buffer of
// whole parameters; at stage >= 1 rank r holds elements [r*shard, (r+1)*shard) of every unit, at
// stage 0 every rank holds all of them. A rank's partition buffers (masters, moments) are its
// units' ranges concatenated in unit order.
//
// With expert parallelism (ep > 1) an expert unit holds a rank's own experts: data-parallel rank
// r is expert-parallel rank r % ep and expert-data-parallel rank r / ep, its unit's parameters
// are block r % ep of each expert parameter's elements (the first dimension splits into ep
// consecutive blocks), and the unit is sharded over the dp / ep ranks holding the same block.
// Parameter names and element ranges are the whole parameter's, so a checkpoint reshards to
// any other ep, dp and stage element range by element range.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace torchspeed::zero {

struct ParamSpan {
  std::string name;
  int64_t offset = 0, numel = 0;  // within the unit's flat buffer
};

struct UnitLayout {
  int64_t padded = 0, shard = 0;            // elements; shard = padded / dp (experts: / (dp / ep))
  int64_t part_offset = 0, part_size = 0;   // the unit's range in a rank's partition buffers
  std::vector<ParamSpan> params;            // experts: one rank's block of each
  bool expert = false;
};

struct PartitionLayout {
  int stage = 0, dp = 1, ep = 1;
  int64_t part_numel = 0;  // elements of each rank's partition buffers
  std::vector<UnitLayout> units;

  // Ranks sharing u's shards, and `rank`'s place among them.
  int group_size(const UnitLayout& u) const { return u.expert ? dp / ep : dp; }
  int group_rank(const UnitLayout& u, int rank) const { return u.expert ? rank / ep : rank; }
  int64_t range_begin(const UnitLayout& u, int rank) const { return stage == 0 ? 0 : group_rank(u, rank) * u.shard; }
  // Whether `rank`'s partition is its own (stage 0: ranks past the first ep hold copies).
  bool holds_own(int rank) const { return stage != 0 || rank < ep; }
  // The rank whose partition equals `rank`'s at stage 0 (itself at other stages).
  int own_rank(int rank) const { return stage == 0 ? rank % ep : rank; }
  nlohmann::json to_json() const;
  // `where` names the source in errors (a file path).
  static PartitionLayout from_json(const nlohmann::json& j, const std::string& where);
};

// Elements [begin, begin + length) of parameter `name` sit at `part_offset` of a rank's partition.
struct Piece {
  std::string name;
  int64_t begin = 0, length = 0, part_offset = 0;
  bool expert = false;  // of an expert unit
};

// Every piece of `rank`'s partition, in partition order; padding belongs to no piece.
std::vector<Piece> pieces(const PartitionLayout& layout, int rank);

}  // namespace torchspeed::zero
