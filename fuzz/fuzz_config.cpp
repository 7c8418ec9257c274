// libFuzzer target: the DeepSpeed config loader. Bytes are read as a config file
// (Config::load: read_json_file, then parse) for one world shape and parsed again for others;
// a config with batch sizes that loads must describe itself (to_json) in a form that loads to
// the same config. Refusals are torchspeed::Error (ConfigError); anything else is a bug (see
// fuzz_util.h). The bugs it found (a number beyond double's range escaping read_json_file, a
// foreign section's non-boolean "enabled", batch products overflowing int64) are fixed in
// config.cpp, with regression tests in unit_config.
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <utility>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_util.h"
#include "torchspeed/config/config.h"

// The communication timeout's default (comm/communicator.cpp, which needs LibTorch's tensors
// and MPI's headers): the config reader only asks for its value.
namespace torchspeed::comm {
std::chrono::milliseconds default_timeout() { return std::chrono::minutes(10); }
}  // namespace torchspeed::comm

namespace {

using torchspeed::config::Config;
using torchspeed::config::WorldShape;
constexpr const char* kTarget = "fuzz_config";

// Runs fn: a torchspeed::Error is a refusal, anything else a bug (fuzz_util.h).
template <typename Fn>
bool run(const nlohmann::json*, Fn&& fn) {
  return fuzz::run_expecting_errors(kTarget, std::forward<Fn>(fn));
}

// to_json() -> the config as a user would write it: "world" is the resolved shape, not a key.
nlohmann::json rewritable(const Config& c) {
  nlohmann::json j = c.to_json();
  j.erase("world");
  return j;
}

void check_round_trip(const Config& c, const WorldShape& shape) {
  if (c.train_batch_size == 0) return;  // a template: to_json() writes 0 for "none given"
  const nlohmann::json first = rewritable(c);
  Config again;
  if (!run(&first, [&] { again = Config::parse(first, shape); }))
    fuzz::bug(kTarget, "to_json() of a loaded config does not load again:\n" + first.dump(1));
  const nlohmann::json second = rewritable(again);
  if (first != second)
    fuzz::bug(kTarget, "to_json() changes when loaded again:\n" + first.dump(1) + "\nthen\n" +
                           second.dump(1));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = fuzz::scratch_dir() + "/ds_config.json";
  fuzz::write_file(path, data, size);
  // The JSON as the loader will see it, when it is JSON (parsed again for other shapes).
  nlohmann::json j;
  bool is_json = true;
  try {
    j = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    is_json = false;
  }
  // Shapes: a single process, a data-parallel world, tp/pp from the command line, and one that
  // tp x pp rarely divides.
  const WorldShape shapes[] = {{1, 0, 0}, {8, 0, 0}, {8, 2, 2}, {6, 4, 0}};
  run(is_json ? &j : nullptr, [&] {
    const Config c = Config::load(path, shapes[0]);
    check_round_trip(c, shapes[0]);
  });
  if (!is_json) return 0;
  for (size_t i = 1; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
    run(&j, [&] {
      const Config c = Config::parse(j, shapes[i]);
      check_round_trip(c, shapes[i]);
    });
  }
  return 0;
}
