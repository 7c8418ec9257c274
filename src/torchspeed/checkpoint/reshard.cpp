// ShardSource: element-range copies between partition layouts.
#include "torchspeed/checkpoint/reshard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "torchspeed/checkpoint/sharded.h"
#include "torchspeed/base/error.h"
#include "torchspeed/tensor_parallel/layers.h"

namespace torchspeed::checkpoint {

ShardSource::ShardSource(std::string dir, zero::PartitionLayout layout, std::vector<std::string> files,
                         std::map<std::string, FileDigest> digests)
    : dir_(std::move(dir)), layout_(std::move(layout)), files_(std::move(files)), digests_(std::move(digests)) {
  TS_CHECK(static_cast<int>(files_.size()) == layout_.dp, dir_, ": the manifest lists ", files_.size(),
           " shard files for data-parallel size ", layout_.dp);
  for (int r = 0; r < layout_.dp; ++r) {
    if (files_[static_cast<size_t>(r)].empty()) continue;  // this rank saved no shard
    check_plain_name(files_[static_cast<size_t>(r)], dir_ + "/manifest.json", "shard file");
    for (const auto& p : zero::pieces(layout_, r)) {
      // At stage 0 with expert parallelism the first ep ranks saved: their other units are copies.
      if (layout_.stage == 0 && r > 0 && !p.expert) continue;
      segments_[p.name].push_back({p.begin, p.length, p.part_offset, r});
    }
  }
}

const SafetensorsReader& ShardSource::file(int rank) {
  auto it = cache_.find(rank);
  if (it != cache_.end()) return *it->second;
  const std::string& name = files_[static_cast<size_t>(rank)];
  const auto d = digests_.find(name);
  TS_CHECK(d != digests_.end(), dir_, "/manifest.json: no checksum for shard file '", name, "'");
  return *cache_.emplace(rank, std::make_unique<SafetensorsReader>(dir_ + "/" + name, &d->second)).first->second;
}

void ShardSource::check_kind(int rank, const std::string& kind) {
  const SafetensorsReader& f = file(rank);
  TS_CHECK(f.contains(kind), dir_, "/", files_[static_cast<size_t>(rank)], ": no '", kind, "' tensor");
  const auto& e = f.entry(kind);
  TS_CHECK(e.dtype == at::kFloat && e.bytes == layout_.part_numel * static_cast<int64_t>(sizeof(float)), dir_, "/",
           files_[static_cast<size_t>(rank)], ": '", kind, "' has ", e.bytes, " bytes of ", e.dtype,
           "; the layout says ", layout_.part_numel, " float32");
}

void ShardSource::copy(const std::string& name, int64_t begin, int64_t length, const std::string& kind,
                       float* dest) {
  const auto it = segments_.find(name);
  TS_CHECK(it != segments_.end(), dir_, ": the checkpoint holds no values of parameter '", name, "'");
  int64_t covered = 0;
  for (const Segment& s : it->second) {
    const int64_t a = std::max(begin, s.begin), b = std::min(begin + length, s.begin + s.length);
    if (a >= b) continue;
    check_kind(s.rank, kind);
    constexpr int64_t kF = sizeof(float);
    file(s.rank).read(kind, (s.part_offset + (a - s.begin)) * kF, (b - a) * kF, dest + (a - begin));
    covered += b - a;
  }
  TS_CHECK(covered == length, dir_, ": the shards hold ", covered, " of ", length, " requested elements of parameter '",
           name, "' (a damaged manifest)");
}

ShardSource::RangeReader ShardSource::reader(const zero::PartitionLayout& target, int rank) {
  // The same layout: the shard file holds exactly this partition (at stage 0, the copy of rank
  // 0, or of rank % ep with expert parallelism).
  if (target.to_json() == layout_.to_json()) {
    const int src = layout_.own_rank(rank);
    if (!files_[static_cast<size_t>(src)].empty()) {
      file(src);  // opened and verified now
      return [this, src](const std::string& kind, int64_t begin, int64_t n, float* dst) {
        check_kind(src, kind);
        constexpr int64_t kF = sizeof(float);
        file(src).read(kind, begin * kF, n * kF, dst);
      };
    }
  }
  // Another layout: each range assembled from the parameters' pieces, wherever they were saved.
  auto want = std::make_shared<std::vector<zero::Piece>>(zero::pieces(target, rank));
  for (const auto& p : *want) {  // every file this partition needs, opened and verified now
    const auto it = segments_.find(p.name);
    if (it == segments_.end()) continue;  // copy() names the missing parameter
    for (const Segment& s : it->second)
      if (std::max(p.begin, s.begin) < std::min(p.begin + p.length, s.begin + s.length)) file(s.rank);
  }
  return [this, want](const std::string& kind, int64_t begin, int64_t n, float* dst) {
    std::fill(dst, dst + n, 0.0f);
    // The pieces are in partition order: start at the last one that begins at or before `begin`.
    auto it = std::upper_bound(want->begin(), want->end(), begin,
                               [](int64_t v, const zero::Piece& p) { return v < p.part_offset; });
    if (it != want->begin()) --it;
    for (; it != want->end() && it->part_offset < begin + n; ++it) {
      const int64_t a = std::max(begin, it->part_offset), b = std::min(begin + n, it->part_offset + it->length);
      if (a < b) copy(it->name, it->begin + (a - it->part_offset), b - a, kind, dst + (a - begin));
    }
  };
}

NamedTensors ShardSource::partition(const zero::PartitionLayout& target, int rank,
                                    const std::vector<std::string>& kinds) {
  const RangeReader read = reader(target, rank);
  NamedTensors out;
  for (const auto& kind : kinds) {
    at::Tensor t = at::empty({target.part_numel}, at::kFloat);
    read(kind, 0, target.part_numel, t.data_ptr<float>());
    out.emplace_back(kind, t);
  }
  return out;
}

NamedTensors ShardSource::full(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params,
                               const std::string& kind) {
  NamedTensors out;
  for (const auto& [name, shape] : params) {
    at::Tensor t = at::empty(shape, at::kFloat);
    copy(name, 0, t.numel(), kind, t.data_ptr<float>());
    out.emplace_back(name, t);
  }
  return out;
}

namespace {
const nlohmann::json& find_slice(const Opened& o, int pp, int tp) {
  const std::string where = o.path + "/manifest.json";
  try {
    for (const auto& s : o.manifest.at("zero").at("slices"))
      if (s.at("pp").get<int>() == pp && s.at("tp").get<int>() == tp) return s;
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, where, ": malformed zero section: ", e.what());
  }
  TS_CHECK(false, where, ": no model slice for pipeline stage ", pp, " and tensor-parallel rank ", tp,
           ": the checkpoint's grid cannot map onto this job's");
}

ShardSource source_of(const Opened& o, const nlohmann::json& slice) {
  const std::string where = o.path + "/manifest.json";
  try {
    std::map<std::string, FileDigest> digests;
    for (const auto& [name, f] : o.manifest.at("files").items())
      digests[name] = {f.at("bytes").get<int64_t>(), f.at("crc32c").get<uint32_t>()};
    return ShardSource(o.path, zero::PartitionLayout::from_json(slice.at("layout"), where),
                       slice.at("files").get<std::vector<std::string>>(), std::move(digests));
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, where, ": malformed files or zero sections: ", e.what());
  }
}

std::vector<std::pair<std::string, std::vector<int64_t>>> params_of(const Opened& o, const nlohmann::json& slice,
                                                                    bool copies) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  try {
    for (const auto& p : slice.at("params"))
      if (copies || !p.value("copy", false))
        out.emplace_back(p.at("name").get<std::string>(), p.at("shape").get<std::vector<int64_t>>());
  } catch (const nlohmann::json::exception& e) {
    TS_CHECK(false, o.path, "/manifest.json: malformed params: ", e.what());
  }
  return out;
}
}  // namespace

ShardSource shard_source(const Opened& o, int pp, int tp) { return source_of(o, find_slice(o, pp, tp)); }

std::vector<std::pair<std::string, std::vector<int64_t>>> slice_params(const Opened& o, int pp, int tp) {
  return params_of(o, find_slice(o, pp, tp), /*copies=*/true);
}

NamedTensors full_state(const Opened& o, const std::string& kind) {
  // Slices by pipeline stage, then tensor-parallel rank.
  std::map<int, std::map<int, const nlohmann::json*>> grid;
  for (const auto& slice : o.manifest.at("zero").at("slices")) grid[slice.at("pp").get<int>()][slice.at("tp").get<int>()] = &slice;
  NamedTensors out;
  for (const auto& [pp, by_tp] : grid) {
    std::vector<NamedTensors> parts;  // per tp rank, the slice's parameters
    for (const auto& [tp, slice] : by_tp) parts.push_back(source_of(o, *slice).full(params_of(o, *slice, false), kind));
    const auto& first = *by_tp.begin()->second;
    size_t i = 0;
    for (const auto& p : first.at("params")) {
      if (p.value("copy", false)) continue;
      const std::string name = p.at("name").get<std::string>();
      if (p.contains("tp_split") && parts.size() > 1) {
        std::vector<at::Tensor> pieces;
        for (auto& part : parts) {
          TS_CHECK(i < part.size() && part[i].first == name, o.path, "/manifest.json: tensor-parallel slices of stage ", pp,
                   " list different parameters");
          pieces.push_back(part[i].second);
        }
        tensor_parallel::Split split{p.at("tp_split").at(0).get<int>(), p.at("tp_split").at(1).get<int>()};
        if (p.at("tp_split").size() > 2) split.sections = p.at("tp_split").at(2).get<std::vector<int64_t>>();
        out.emplace_back(name, tensor_parallel::merge(pieces, split));
      } else {
        out.emplace_back(name, parts[0][i].second);  // replicated: every tp rank holds the same
      }
      ++i;
    }
  }
  return out;
}

}  // namespace torchspeed::checkpoint
