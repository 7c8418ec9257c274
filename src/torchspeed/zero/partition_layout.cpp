// PartitionLayout: JSON form and the pieces of a rank's partition.
#include "torchspeed/zero/partition_layout.h"

#include <algorithm>
#include <cstdint>

#include "torchspeed/base/error.h"

namespace torchspeed::zero {

nlohmann::json PartitionLayout::to_json() const {
  nlohmann::json us = nlohmann::json::array();
  for (const auto& u : units) {
    nlohmann::json ps = nlohmann::json::array();
    for (const auto& p : u.params) ps.push_back({p.name, p.offset, p.numel});
    nlohmann::json uj = {{"padded", u.padded}, {"shard", u.shard}, {"part_offset", u.part_offset},
                         {"part_size", u.part_size}, {"params", ps}};
    if (u.expert) uj["expert"] = true;
    us.push_back(std::move(uj));
  }
  nlohmann::json j = {{"stage", stage}, {"dp", dp}, {"part_numel", part_numel}, {"units", us}};
  if (ep > 1) j["ep"] = ep;  // absent: 1 (checkpoints from before expert parallelism)
  return j;
}

namespace {
// An integer of the layout in [lo, hi]; json's own get<int>() would truncate silently, and
// from a float out of range its conversion is undefined.
int64_t layout_int(const nlohmann::json& v, const std::string& where, const char* what, int64_t lo,
                   int64_t hi) {
  const bool integer =
      v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX});
  const int64_t x = integer ? v.get<int64_t>() : 0;
  TS_CHECK(integer && x >= lo && x <= hi, where, ": malformed ZeRO partition layout: ", what,
           " must be an integer in [", lo, ", ", hi, "], found ", v.dump());
  return x;
}
}  // namespace

PartitionLayout PartitionLayout::from_json(const nlohmann::json& j, const std::string& where) {
  constexpr int64_t kMax = INT64_MAX;
  PartitionLayout l;
  try {
    l.stage = static_cast<int>(layout_int(j.at("stage"), where, "stage", 0, 3));
    l.dp = static_cast<int>(layout_int(j.at("dp"), where, "dp", 1, INT32_MAX));
    l.ep = j.contains("ep") ? static_cast<int>(layout_int(j.at("ep"), where, "ep", 1, l.dp)) : 1;
    TS_CHECK(l.dp % l.ep == 0, where, ": malformed ZeRO partition layout: ep ", l.ep, " does not divide dp ", l.dp);
    l.part_numel = layout_int(j.at("part_numel"), where, "part_numel", 0, kMax);
    for (const auto& uj : j.at("units")) {
      UnitLayout u;
      u.padded = layout_int(uj.at("padded"), where, "padded", 0, kMax);
      u.shard = layout_int(uj.at("shard"), where, "shard", 0, kMax);
      u.part_offset = layout_int(uj.at("part_offset"), where, "part_offset", 0, kMax);
      u.part_size = layout_int(uj.at("part_size"), where, "part_size", 0, kMax);
      if (uj.contains("expert")) {
        TS_CHECK(uj.at("expert").is_boolean(), where, ": malformed ZeRO partition layout: a unit's expert must be a boolean");
        u.expert = uj.at("expert").get<bool>();
      }
      for (const auto& pj : uj.at("params"))
        u.params.push_back({pj.at(0).get<std::string>(),
                            layout_int(pj.at(1), where, "a parameter's offset", 0, kMax),
                            layout_int(pj.at(2), where, "a parameter's numel", 0, kMax)});
      l.units.push_back(std::move(u));
    }
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, where, ": malformed ZeRO partition layout: ", e.what());
  }
  // Every value is >= 0, so the checks below are written not to overflow: shard * dp == padded
  // as a division, a + b <= c as a <= c - b.
  for (const auto& u : l.units) {
    const int g = l.group_size(u);
    TS_CHECK(u.padded % g == 0 && u.shard == u.padded / g &&
                 u.part_size == (l.stage == 0 ? u.padded : u.shard) &&
                 u.part_size <= l.part_numel && u.part_offset <= l.part_numel - u.part_size,
             where, ": inconsistent unit in the partition layout (padded ", u.padded, ", shard ",
             u.shard, ")");
    for (const auto& p : u.params) {
      TS_CHECK(p.numel <= u.padded && p.offset <= u.padded - p.numel, where, ": parameter '",
               p.name, "' lies outside its unit in the partition layout");
      TS_CHECK(!u.expert || p.numel <= INT64_MAX / l.ep, where, ": expert parameter '", p.name,
               "' is too large for ", l.ep, " blocks in the partition layout");
    }
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
      // An expert parameter's block of this rank's experts starts at block (rank % ep).
      const int64_t block = u.expert ? (rank % layout.ep) * p.numel : 0;
      if (a < b) out.push_back({p.name, block + a - p.offset, b - a, u.part_offset + (a - lo), u.expert});
    }
  }
  return out;
}

}  // namespace torchspeed::zero
