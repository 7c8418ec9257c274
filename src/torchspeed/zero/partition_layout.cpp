// PartitionLayout: JSON form and the pieces of a rank's partition.
#include "torchspeed/zero/partition_layout.h"

#include <algorithm>

#include "torchspeed/runtime/error.h"

namespace torchspeed::zero {

nlohmann::json PartitionLayout::to_json() const {
  nlohmann::json us = nlohmann::json::array();
  for (const auto& u : units) {
    nlohmann::json ps = nlohmann::json::array();
    for (const auto& p : u.params) ps.push_back({p.name, p.offset, p.numel});
    us.push_back({{"padded", u.padded}, {"shard", u.shard}, {"part_offset", u.part_offset},
                  {"part_size", u.part_size}, {"params", ps}});
  }
  return {{"stage", stage}, {"dp", dp}, {"part_numel", part_numel}, {"units", us}};
}

PartitionLayout PartitionLayout::from_json(const nlohmann::json& j, const std::string& where) {
  PartitionLayout l;
  try {
    l.stage = j.at("stage").get<int>();
    l.dp = j.at("dp").get<int>();
    l.part_numel = j.at("part_numel").get<int64_t>();
    for (const auto& uj : j.at("units")) {
      UnitLayout u;
      u.padded = uj.at("padded").get<int64_t>();
      u.shard = uj.at("shard").get<int64_t>();
      u.part_offset = uj.at("part_offset").get<int64_t>();
      u.part_size = uj.at("part_size").get<int64_t>();
      for (const auto& pj : uj.at("params"))
        u.params.push_back({pj.at(0).get<std::string>(), pj.at(1).get<int64_t>(), pj.at(2).get<int64_t>()});
      l.units.push_back(std::move(u));
    }
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, where, ": malformed ZeRO partition layout: ", e.what());
  }
  TS_CHECK(l.dp >= 1 && l.stage >= 0 && l.stage <= 3, where, ": layout has dp ", l.dp, " and stage ", l.stage);
  for (const auto& u : l.units) {
    TS_CHECK(u.shard * l.dp == u.padded && u.part_size == (l.stage == 0 ? u.padded : u.shard) &&
                 u.part_offset >= 0 && u.part_offset + u.part_size <= l.part_numel,
             where, ": inconsistent unit in the partition layout (padded ", u.padded, ", shard ", u.shard, ")");
    for (const auto& p : u.params)
      TS_CHECK(p.offset >= 0 && p.numel >= 0 && p.offset + p.numel <= u.padded, where, ": parameter '", p.name,
               "' lies outside its unit in the partition layout");
  }
  return l;
}

std::vector<Piece> pieces(const PartitionLayout& layout, int rank) {
  TS_INTERNAL_ASSERT(rank >= 0 && rank < layout.dp, "rank ", rank, " of ", layout.dp);
  std::vector<Piece> out;
  for (const auto& u : layout.units) {
    const int64_t lo = layout.range_begin(u, rank), hi = lo + u.part_size;
    for (const auto& p : u.params) {
      const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
      if (a < b) out.push_back({p.name, a - p.offset, b - a, u.part_offset + (a - lo)});
    }
  }
  return out;
}

}  // namespace torchspeed::zero
