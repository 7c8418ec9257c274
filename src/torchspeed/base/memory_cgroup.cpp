#include "torchspeed/base/memory_cgroup.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace torchspeed {

namespace fs = std::filesystem;

namespace {
bool write_file(const std::string& path, const std::string& value) {
  std::ofstream f(path);
  f << value;
  f.flush();
  return static_cast<bool>(f);
}
std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}
}  // namespace

MemoryCgroup::MemoryCgroup(int64_t limit) {
  const std::string name = "torchspeed-" + std::to_string(::getpid()) + "-" + std::to_string(limit);
  struct Kind {
    std::string root, limit_file;
    bool usable;
  };
  const Kind kinds[] = {
      // v2: the unified hierarchy must offer the memory controller to its children.
      {"/sys/fs/cgroup", "memory.max", read_file("/sys/fs/cgroup/cgroup.subtree_control").find("memory") != std::string::npos},
      {"/sys/fs/cgroup/memory", "memory.limit_in_bytes", fs::exists("/sys/fs/cgroup/memory/memory.limit_in_bytes")},
  };
  for (const auto& k : kinds) {
    if (!k.usable) continue;
    const std::string d = k.root + "/" + name;
    std::error_code ec;
    if (!fs::create_directory(d, ec)) continue;
    if (!fs::exists(d + "/" + k.limit_file) || !write_file(d + "/" + k.limit_file, std::to_string(limit))) {
      fs::remove(d, ec);
      continue;
    }
    dir_ = d;
    parent_ = k.root;
    return;
  }
}

bool MemoryCgroup::join(pid_t pid) {
  if (dir_.empty() || !write_file(procs_file(), std::to_string(pid))) return false;
  return read_file(procs_file()).find(std::to_string(pid)) != std::string::npos;
}

bool MemoryCgroup::leave(pid_t pid) {
  return !dir_.empty() && write_file(parent_ + "/cgroup.procs", std::to_string(pid));
}

MemoryCgroup::~MemoryCgroup() {
  if (dir_.empty()) return;
  std::error_code ec;
  fs::remove(dir_, ec);  // fails (and stays) while a member is left
}

}  // namespace torchspeed
