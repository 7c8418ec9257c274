// libFuzzer target: the checkpoint manifest. The bytes are DIR/manifest.json; open_local()
// reads and checks it, then every ZeRO partition layout of its model slices
// (zero.slices[].layout) goes through PartitionLayout::from_json. A layout that is accepted must
// describe itself (to_json) in a form read back unchanged, and its pieces must lie inside their
// parameters and inside the partition. Refusals are torchspeed::Error; anything else is a bug
// (see fuzz_util.h).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "torchspeed/checkpoint/sharded.h"
#include "torchspeed/zero/partition_layout.h"

// sharded.cpp's collective functions are linked but never called here; this stands in for the
// communicator library (comm/) so that the target needs no MPI.
namespace torchspeed::comm {
std::vector<std::string> all_gather_strings(Communicator&, const std::string&) {
  fuzz::bug("fuzz_manifest", "a collective was called");
}
}  // namespace torchspeed::comm

namespace {

namespace ck = torchspeed::checkpoint;
namespace zero = torchspeed::zero;
constexpr const char* kTarget = "fuzz_manifest";

void check_layout(const zero::PartitionLayout& l, const std::string& where) {
  zero::PartitionLayout back;
  if (!fuzz::run_expecting_errors(
          kTarget, [&] { back = zero::PartitionLayout::from_json(l.to_json(), where); }))
    fuzz::bug(kTarget, "an accepted layout is refused when read from its own to_json()");
  if (back.to_json() != l.to_json())
    fuzz::bug(kTarget, "a layout changes through to_json() and from_json()");
  // A parameter's extent: the largest it has in any unit (an expert unit holds one of ep blocks).
  std::map<std::string, int64_t> numel;
  for (const auto& u : l.units)
    for (const auto& p : u.params) numel[p.name] = std::max(numel[p.name], u.expert ? p.numel * l.ep : p.numel);
  // The first ranks and the last: dp may be large.
  std::vector<int> ranks;
  for (int r = 0; r < std::min(l.dp, 4); ++r) ranks.push_back(r);
  if (l.dp > 4) ranks.push_back(l.dp - 1);
  for (int r : ranks) {
    std::vector<zero::Piece> ps;
    fuzz::run_expecting_errors(kTarget, [&] { ps = zero::pieces(l, r); });
    for (const auto& p : ps) {
      if (p.begin < 0 || p.length <= 0 || p.begin > numel[p.name] - p.length || p.part_offset < 0 ||
          p.part_offset > l.part_numel - p.length)
        fuzz::bug(kTarget,
                  torchspeed::concat("rank ", r, "'s piece of '", p.name, "' [", p.begin, ", +",
                                     p.length, ") at partition offset ", p.part_offset,
                                     " lies outside the parameter or the partition (", l.part_numel,
                                     ")"));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = fuzz::scratch_dir() + "/checkpoint";
  static const bool made = (std::filesystem::create_directories(dir), true);
  (void)made;
  fuzz::write_file(dir + "/manifest.json", data, size);
  ck::Opened o;
  if (!fuzz::run_expecting_errors(kTarget, [&] { o = ck::open_local(dir); })) return 0;
  const std::string where = o.path + "/manifest.json";
  const auto& z = o.manifest["zero"];
  if (!z.is_object() || !z.contains("slices") || !z["slices"].is_array()) return 0;
  for (const auto& slice : z["slices"]) {
    if (!slice.is_object() || !slice.contains("layout")) continue;
    zero::PartitionLayout l;
    if (fuzz::run_expecting_errors(
            kTarget, [&] { l = zero::PartitionLayout::from_json(slice["layout"], where); }))
      check_layout(l, where);
  }
  return 0;
}
