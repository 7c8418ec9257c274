// The key tables (Note [Config keys declared once] in config/keys.h) drive the reader and
// to_json: every declared key, set alone to a value other than its default, reaches the resolved
// config when it is honoured, and is refused or warned about by its path otherwise.
#include <gtest/gtest.h>

#include <string>

#include "torchspeed/config/config.h"
#include "torchspeed/config/detail/sections.h"
#include "torchspeed/config/keys.h"

using nlohmann::json;
using namespace torchspeed::config;

namespace {

json base() {
  return {{"train_micro_batch_size_per_gpu", 1}, {"zero_optimization", {{"stage", 3}}}};
}

WorldShape world4() {
  WorldShape w;
  w.world_size = 4;
  return w;
}

// A valid value other than the default, within the key's range and values.
template <typename S>
json other_value(const Key<S>& k, const json& def) {
  if (def.is_boolean()) return !def.get<bool>();
  if (def.is_string()) {
    for (const auto& a : k.allowed)
      if (a != def.get<std::string>()) return a;
    return "other";
  }
  if (def.is_number_integer()) {
    const int64_t d = def.get<int64_t>();
    if (d >= 0 && d <= k.imax / 2 && d * 2 != d) return d * 2;  // keeps multiples (aio.block_size)
    if (d < k.imax) return d + 1;
    if (d > k.imin) return d - 1;
  } else {
    const double d = def.get<double>();
    for (double v : {d * 2, d + 0.5, d / 2})
      if (v != d && v >= k.dmin && v <= k.dmax) return v;
  }
  ADD_FAILURE() << k.name << ": no other value in range";
  return def;
}

// Sets `path` (dotted; "" for the top level) . key = value in a copy of base().
json with(const std::string& path, const std::string& key, const json& value) {
  json j = base();
  json* at = &j;
  size_t from = 0;
  while (!path.empty() && from <= path.size()) {
    const size_t dot = path.find('.', from);
    const std::string part = path.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
    at = &(*at)[part];
    if (dot == std::string::npos) break;
    from = dot + 1;
  }
  (*at)[key] = value;
  return j;
}

const json& at_path(const json& j, const std::string& path) {
  const json* at = &j;
  size_t from = 0;
  while (!path.empty()) {
    const size_t dot = path.find('.', from);
    at = &at->at(path.substr(from, dot == std::string::npos ? std::string::npos : dot - from));
    if (dot == std::string::npos) break;
    from = dot + 1;
  }
  return *at;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

template <typename S>
void check_table(const std::string& path, const KeyTable<S>& keys, const S& defaults = S{}) {
  const json defs = keys_to_json(defaults, keys);
  for (const auto& k : keys) {
    if (k.by_section) continue;
    SCOPED_TRACE(path + "." + k.name);
    const std::string where = path.empty() ? k.name : path + "." + k.name;
    if (k.member.index() == 0) {  // member-less: its treatment only
      if (k.treatment == Treatment::kHonoured) continue;
      const json value = k.treatment == Treatment::kRefused ? json(!k.refused_bool) : json(12345);
      try {
        const Config c = Config::parse(with(path, k.name, value), world4());
        ASSERT_NE(k.treatment, Treatment::kRefused) << "accepted";
        EXPECT_NE(joined(c.warnings).find(where), std::string::npos) << joined(c.warnings);
      } catch (const ConfigError& e) {
        ASSERT_EQ(k.treatment, Treatment::kRefused) << e.what();
        EXPECT_NE(std::string(e.what()).find(where), std::string::npos) << e.what();
      }
      continue;
    }
    const json value = other_value(k, defs.at(k.name));
    const json given = with(path, k.name, value);
    if (k.treatment == Treatment::kRefused) {
      try {
        Config::parse(given, world4());
        ADD_FAILURE() << "a value other than the default was accepted: " << value;
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(where), std::string::npos) << e.what();
      }
      continue;
    }
    const Config c = Config::parse(given, world4());
    EXPECT_EQ(at_path(c.to_json(), path).at(k.name), value) << "read and written back";
    if (k.treatment != Treatment::kHonoured) {
      EXPECT_NE(joined(c.warnings).find(where), std::string::npos) << joined(c.warnings);
    }
    for (const auto& alias : k.aliases) {  // another spelling fills the same member
      const Config a = Config::parse(with(path, alias, value), world4());
      EXPECT_EQ(at_path(a.to_json(), path).at(k.name), value) << "through " << alias;
    }
  }
}

}  // namespace

TEST(ConfigKeys, EveryDeclaredKeyIsReadWrittenBackOrTreatedAsDeclared) {
  check_table("", detail::root_keys());
  check_table("fp16", detail::fp16_keys());
  check_table("zero_optimization", detail::zero_keys());
  check_table("zero_optimization.offload_optimizer", detail::offload_keys(true), detail::offload_defaults(true));
  check_table("zero_optimization.offload_param", detail::offload_keys(false), detail::offload_defaults(false));
  check_table("aio", detail::aio_keys());
  check_table("activation_checkpointing", detail::activation_checkpointing_keys());
  check_table("pipeline", detail::pipeline_keys());
  check_table("checkpoint", detail::checkpoint_keys());
  check_table("csv_monitor", detail::monitor_keys());
  check_table("tensorboard", detail::monitor_keys());
  check_table("torchspeed", detail::torchspeed_keys());
}

// A key's default lives in one place, the member's initializer: an absent section resolves to
// the table's defaults.
TEST(ConfigKeys, AbsentKeysTakeTheMembersDefaults) {
  const Config c = Config::parse({{"train_micro_batch_size_per_gpu", 1}});
  EXPECT_EQ(c.to_json()["fp16"], keys_to_json(FP16Config{}, detail::fp16_keys()));
  EXPECT_EQ(c.to_json()["aio"], keys_to_json(AioConfig{}, detail::aio_keys()));
  EXPECT_EQ(c.to_json()["checkpoint"], keys_to_json(CheckpointConfig{}, detail::checkpoint_keys()));
  // offload_optimizer's buffer_count default is DeepSpeed's 4, not the struct's 5.
  const Config z = Config::parse({{"train_micro_batch_size_per_gpu", 1},
                                  {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "none"}}}}}});
  EXPECT_EQ(z.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(z.zero.offload_param.buffer_count, 5);
}

// The reference lists every declared key of every table once, with its treatment.
TEST(ConfigKeys, TheReferenceListsEveryKey) {
  const std::string ref = key_reference();
  for (const auto& k : detail::zero_keys()) EXPECT_NE(ref.find("| `" + k.name + "`"), std::string::npos) << k.name;
  for (const auto& k : detail::fp16_keys()) EXPECT_NE(ref.find("| `" + k.name + "`"), std::string::npos) << k.name;
  EXPECT_NE(ref.find("| `stage3_prefetch_bucket_size` (`prefetch_bucket_size`) | `50000000` | >= 0 | honoured |"),
            std::string::npos)
      << ref;
  EXPECT_NE(ref.find("| `use_gds` |  | only false | refused |"), std::string::npos) << ref;
}
