// Logging with a rank prefix: "[rank r/w] message". The prefix is set once by init().
#pragma once

#include <string>

#include "torchspeed/base/error.h"

namespace torchspeed::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// Sets the "[rank r/w]" prefix; called by init().
void set_rank(int rank, int world_size);
// Minimum level printed; TORCHSPEED_LOG_LEVEL=debug|info|warn|error overrides the default (info).
void set_level(Level level);
Level level();
void write(Level level, const std::string& message);
// True on world rank 0 (or before init()).
bool is_rank0();

template <typename... Args>
void info(const Args&... args) { if (level() <= Level::kInfo) write(Level::kInfo, concat(args...)); }
template <typename... Args>
void warn(const Args&... args) { if (level() <= Level::kWarn) write(Level::kWarn, concat(args...)); }
template <typename... Args>
void error(const Args&... args) { write(Level::kError, concat(args...)); }
template <typename... Args>
void debug(const Args&... args) { if (level() <= Level::kDebug) write(Level::kDebug, concat(args...)); }
// Only world rank 0 prints.
template <typename... Args>
void info0(const Args&... args) { if (is_rank0()) info(args...); }
template <typename... Args>
void warn0(const Args&... args) { if (is_rank0()) warn(args...); }

}  // namespace torchspeed::log
