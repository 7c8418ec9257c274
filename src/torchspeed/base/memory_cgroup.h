// MemoryCgroup: a memory cgroup with a limit, for enforcing a memory budget on a process (the
// offload tests and `bench offload`). cgroup v2 (memory.max) where the unified hierarchy has the
// memory controller, else v1 (memory.limit_in_bytes). Memory is charged to the cgroup a process
// is in when it is allocated, so joining one limits what the process allocates from then on;
// going over the limit is an OOM kill. Removed (after its members left) when destroyed.
#pragma once

#include <cstdint>
#include <string>
#include <sys/types.h>

namespace torchspeed {

class MemoryCgroup {
 public:
  // An empty one (dir() == "") where the machine does not let us make one.
  explicit MemoryCgroup(int64_t limit_bytes);
  ~MemoryCgroup();
  MemoryCgroup(const MemoryCgroup&) = delete;
  MemoryCgroup& operator=(const MemoryCgroup&) = delete;

  const std::string& dir() const { return dir_; }
  bool available() const { return !dir_.empty(); }
  // The file a process id is written to for it to join.
  std::string procs_file() const { return dir_ + "/cgroup.procs"; }
  // Moves a process in, or back to the parent cgroup. False when it did not take.
  bool join(pid_t pid);
  bool leave(pid_t pid);

 private:
  std::string dir_, parent_;
};

}  // namespace torchspeed
