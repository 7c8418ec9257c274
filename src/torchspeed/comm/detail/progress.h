// The FIFO progress engine of a communicator: ops (Tasks) execute one at a time in submission
// order, each under a deadline counted from the moment it starts; the first failure breaks the
// communicator, fails every queued op and stops the progress thread. Backend-neutral (no MPI):
// a backend supplies Tasks. Internal: not installed. See Note [Collective execution order] and
// Note [Deadlines and failure] in progress.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "torchspeed/comm/communicator.h"

namespace torchspeed::comm::detail {

using Clock = std::chrono::steady_clock;

// How many polls without progress a waiter spins before it yields its core after each poll.
// See Note [Polite polling].
struct PollPolicy {
  // A blocking op on the caller's thread (counted from its last completed step), a
  // point-to-point wait().
  int inline_spins = 4096;
  int thread_spins = 64;  // the progress thread: it shares a core with the compute it overlaps
  // For a node with more ranks than cores: every waiter yields early.
  static PollPolicy for_ranks_per_node(int ranks_per_node);
};

// Counts one poll; past `limit`, yields the core.
inline void relax(int& spins, int limit);

// What an op is, kept as plain fields and formatted only when an error needs it (formatting
// every op cost ~1 us, a third of a small all_reduce).
struct OpDesc {
  const char* op = "";                       // "all_reduce" (a literal)
  std::shared_ptr<const std::string> group;  // " on group 'world' (rank 0 of 2, world rank 0)"
  int64_t bytes = -1;                        // payload bytes, or -1 (barrier)
  at::ScalarType dtype = at::kFloat;
  int rop = -1;   // ReduceOp, or -1
  int peer = -1;  // send/recv
  int tag = -1;
  std::string str() const;
};

// One op, executed by the engine: start() issues it, poll() advances it (true when complete).
// A task owns references to every tensor it reads or writes, so a temporary passed to an async
// op lives until the op has completed (or, after a failure, for as long as MPI may touch it).
class Task {
 public:
  Task(OpDesc what, std::vector<at::Tensor> tensors)
      : what_(std::move(what)), tensors_(std::move(tensors)) {}
  virtual ~Task() = default;
  virtual void start() = 0;
  virtual bool poll() = 0;
  const OpDesc& what() const { return what_; }
  // Counts completed steps (a chunk's phase): a waiter spins while it changes.
  uint64_t progress() const { return progress_; }

 protected:
  void made_progress() { ++progress_; }
  OpDesc what_;

 private:
  std::vector<at::Tensor> tensors_;
  uint64_t progress_ = 0;
};

// Failure state shared by a communicator, its engine and its Work objects: the first failure's
// message, and a hook that wakes the engine so that it stops.
class FailureState {
 public:
  explicit FailureState(std::string group_info) : group_info_(std::move(group_info)) {}
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // Records the first failure (later ones keep the first reason) and wakes the engine.
  void mark_broken(const std::string& reason);
  std::string reason() const;
  // Throws CommError naming `op` and the original failure when broken.
  void check_usable(const std::string& op) const;
  std::string timeout_message(const OpDesc& what, std::chrono::milliseconds timeout) const;
  void set_waker(std::function<void()> waker);
  // When the engine last started an op: the engine's pulse, from which TaskWork::wait() bounds
  // its wait (Note [Deadlines and failure]).
  void note_start() { last_start_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed); }
  Clock::time_point last_start() const {
    return Clock::time_point(Clock::duration(last_start_.load(std::memory_order_relaxed)));
  }

 private:
  const std::string group_info_;  // "members of 'dp' (world ranks): [0, 1]"
  std::atomic<Clock::rep> last_start_{0};
  std::atomic<bool> broken_{false};
  mutable std::mutex mu_;
  std::string reason_;
  std::function<void()> waker_;
};

// Keeps `what` alive for the rest of the process: the tensors and buffers of an op whose MPI
// requests may still be in flight after a failure (see Note [Deadlines and failure]).
void keep_forever(std::shared_ptr<const void> what);

// The Work of an op executed by the engine. Holds the op's output tensors (result()).
class TaskWork final : public Work {
 public:
  TaskWork(OpDesc what, std::vector<at::Tensor> outputs, std::shared_ptr<FailureState> state,
           std::chrono::milliseconds timeout)
      : Work(std::move(outputs)), what_(std::move(what)), state_(std::move(state)), timeout_(timeout) {}
  void complete(std::exception_ptr error);
  // Bounded: throws a CommError naming the op and rank, and breaks the communicator, when the
  // engine neither completed nor failed the op by the deadline (Note [Deadlines and failure]).
  void wait() override;
  bool is_completed() override;
  std::exception_ptr exception() const override;
  const OpDesc& what() const { return what_; }

 private:
  OpDesc what_;
  std::shared_ptr<FailureState> state_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class ProgressEngine {
 public:
  ProgressEngine(std::shared_ptr<FailureState> state, std::chrono::milliseconds timeout,
                 PollPolicy policy);
  ~ProgressEngine();
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  // Queues `task` behind the ops already submitted; with `blocking` and an idle engine, runs it
  // here on the caller's thread instead (no hand-off on the latency path). Throws CommError
  // when the communicator has failed (also when the inline run fails).
  std::shared_ptr<TaskWork> submit(std::unique_ptr<Task> task, std::vector<at::Tensor> outputs,
                                   bool blocking);
  // Runs `fn` on the caller's thread once every queued op has executed.
  void run_exclusive(const std::function<void()>& fn);
  // Waits for every submitted op (each ends by its deadline at the latest), then stops the
  // thread. With `abandon` (the job is ending after a failure), the running op is given up
  // and queued ones fail at once. Idempotent.
  void shutdown(bool abandon);

 private:
  using Entry = std::pair<std::unique_ptr<Task>, std::shared_ptr<TaskWork>>;
  void loop();
  // start() + poll() until complete; throws CommError at the deadline. False when abandoned.
  // `on_caller`: a blocking op on the caller's thread (see PollPolicy).
  bool execute(Task& task, bool on_caller);
  // execute(), then completes `work` with the outcome; a task that did not finish (failed or
  // abandoned) is kept forever and breaks the communicator.
  void run_to_end(std::unique_ptr<Task> task, TaskWork& work, bool on_caller);
  static void fail_all(std::deque<Entry>& entries, const std::string& reason);
  void on_failure();  // the FailureState's waker

  std::shared_ptr<FailureState> state_;
  const std::chrono::milliseconds timeout_;
  const PollPolicy policy_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> queue_;
  bool busy_ = false;  // an op is executing (inline or on the thread)
  bool stop_ = false;
  std::atomic<bool> abandon_{false};
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------

inline void relax(int& spins, int limit) {
  if (++spins > limit) std::this_thread::yield();
}

}  // namespace torchspeed::comm::detail
