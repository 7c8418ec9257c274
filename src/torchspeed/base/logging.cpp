// Rank-prefixed logging to stderr; one write() call per line so ranks do not interleave.
#include "torchspeed/base/logging.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace torchspeed::log {
namespace {
std::atomic<int> g_rank{0};
std::atomic<int> g_world{1};
std::atomic<bool> g_rank_set{false};

Level level_from_env() {
  const char* v = std::getenv("TORCHSPEED_LOG_LEVEL");
  if (!v) return Level::kInfo;
  if (!std::strcmp(v, "debug")) return Level::kDebug;
  if (!std::strcmp(v, "warn")) return Level::kWarn;
  if (!std::strcmp(v, "error")) return Level::kError;
  return Level::kInfo;
}
std::atomic<int> g_level{static_cast<int>(level_from_env())};
}  // namespace

void set_rank(int rank, int world_size) {
  g_rank = rank;
  g_world = world_size;
  g_rank_set = true;
}
void set_level(Level l) { g_level = static_cast<int>(l); }
Level level() { return static_cast<Level>(g_level.load()); }
bool is_rank0() { return g_rank.load() == 0; }

void write(Level l, const std::string& message) {
  static const char* names[] = {"debug", "info", "warning", "error"};
  std::string line;
  if (g_rank_set) line = concat("[rank ", g_rank.load(), "/", g_world.load(), "] ");
  if (l != Level::kInfo) line += concat(names[static_cast<int>(l)], ": ");
  line += message;
  line += '\n';
  ssize_t ignored = ::write(2, line.data(), line.size());
  (void)ignored;
}

}  // namespace torchspeed::log
