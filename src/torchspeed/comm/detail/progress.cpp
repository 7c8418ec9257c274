// The FIFO progress engine: one queue and one progress thread per communicator, deadlines from
// each op's start, and the failure path (break, fail the queue, stop the thread).
//
// Note [Collective execution order]
// MPI requires every rank to issue the collectives of a communicator in the same order. Each
// communicator therefore executes its collectives one at a time, in submission order: async ops
// queue up for one progress thread; a blocking op whose communicator is idle runs inline on the
// caller's thread (no thread hand-off on the latency path). Our algorithms exchange
// point-to-point messages on a private duplicate of the communicator, matched by (source, tag)
// and MPI's non-overtaking rule, so their completion order may differ between ranks freely.
//
// Note [Deadlines and failure]
// An op's deadline counts from the moment it starts executing, not from its submission: ops
// queue behind each other, so a submission-time deadline would fail a short op queued behind a
// long one although neither is late. The engine (not the waiter) enforces it while it polls, so
// a timeout is detected even when nobody waits. The first failure (a timeout, an MPI error, a
// failed point-to-point transfer) breaks the communicator: the running op's Work gets the
// error, every queued op fails without running, the progress thread returns (no spinning on a
// dead op), and later submissions throw a CommError naming the original failure. The failed
// op's requests may still be in flight inside MPI, so the task (its tensors and scratch
// buffers) is never freed: see keep_forever(). After a failure runtime::shutdown() aborts the
// job, so that memory is not lost for long. Whether the communicator has failed is checked under
// the engine's lock, the one the progress thread holds when it fails the queue and returns, so
// an op is either queued before that (and failed with the rest) or refused at submission, never
// queued for a thread that is gone.
// A waiter does not rely on the engine alone: Work::wait() gives up when no op of the engine has
// started for the deadline plus a grace (an op started within the deadline ends by then, failed
// or not; one queued waits for the ops ahead, each of which starts the clock again), so an
// engine that cannot end an op (a call into the backend that never returns) is reported, naming
// the op and rank, instead of hanging the waiter. The grace lets the engine's own timeout, which
// names the likelier cause, arrive first.
//
// Note [Polite polling]
// A rank waiting in MPI spins its core. The progress thread polls MPI_Test and yields the core
// after a short spin (64 polls), so a compute thread sharing the core (the overlap that
// bucketed gradient reduction relies on) runs while communication is in flight. A blocking op
// that runs inline has nothing to overlap with on its thread: it yields only after 4096 polls
// (about half a millisecond) without a completed step, as MPI's own blocking calls keep their
// core while data flows, and still yields while a late peer is awaited. Yielding after 64
// polls there cost a task switch per poll whenever another process wanted the core (on a
// loaded machine 12% of a 1 MiB all_reduce's profile was sched_yield's switch). On a node with
// more ranks than cores a spinning rank holds the core its peer needs, so there every waiter
// yields early.
#include "torchspeed/comm/detail/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "torchspeed/base/error.h"
#include "torchspeed/comm/runtime.h"

namespace torchspeed::comm::detail {
namespace {

// What MPI may still write into (after a failure or abandonment): reachable from a global for
// the life of the process, so that it is neither freed nor reported as a leak.
std::mutex g_graveyard_mu;
std::vector<std::shared_ptr<const void>>& graveyard() {
  static auto* g = new std::vector<std::shared_ptr<const void>>();
  return *g;
}

}  // namespace

void keep_forever(std::shared_ptr<const void> what) {
  std::lock_guard<std::mutex> lock(g_graveyard_mu);
  graveyard().push_back(std::move(what));
}

std::string OpDesc::str() const {
  std::string s = concat(op, group ? *group : std::string());
  if (bytes >= 0) s += concat(", ", bytes, " bytes of ", dtype);
  if (rop >= 0) s += concat(", op ", reduce_op_name(static_cast<ReduceOp>(rop)));
  if (peer >= 0) {
    s += concat(std::strcmp(op, "send") == 0 ? " to rank " : " from rank ", peer, " tag ", tag);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------

void FailureState::mark_broken(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reason_.empty()) reason_ = reason;
    broken_.store(true, std::memory_order_release);
    // Called under mu_ so that set_waker(nullptr) waits for a call in progress.
    if (waker_) waker_();
  }
  runtime_detail::mark_comm_failed(reason);
}

std::string FailureState::reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

void FailureState::check_usable(const std::string& op) const {
  if (!broken()) return;
  throw CommError(concat(op, " is refused: the communicator is unusable after an earlier failure: ",
                         reason()));
}

std::string FailureState::timeout_message(const OpDesc& what,
                                          std::chrono::milliseconds timeout) const {
  return concat(what.str(), " did not complete within ", timeout.count() / 1000.0,
                " s of starting: a peer rank is dead, stuck, or called a different collective "
                "(desynchronised); ",
                group_info_,
                ". If the peers are only slow, raise the deadline (TORCHSPEED_COMM_TIMEOUT_S or "
                "CommOptions::timeout)");
}

void FailureState::set_waker(std::function<void()> waker) {
  std::lock_guard<std::mutex> lock(mu_);
  waker_ = std::move(waker);
}

// ---------------------------------------------------------------------------------------------

void TaskWork::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

void TaskWork::wait() {
  // See Note [Deadlines and failure].
  const auto grace = std::chrono::milliseconds(1000) + timeout_ / 10;
  const auto since = Clock::now();
  auto give_up_at = [&] { return std::max(since, state_->last_start()) + timeout_ + grace; };
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_until(lock, give_up_at(), [&] { return done_; })) {
    if (Clock::now() < give_up_at()) continue;  // another op started meanwhile
    lock.unlock();
    const std::string msg = concat(
        what_.str(), ": wait() gave up after ", std::chrono::duration<double>(Clock::now() - since).count(),
        " s: the op neither completed nor failed although no op of this communicator started for its deadline of ",
        timeout_.count() / 1000.0, " s (and a grace of ", grace.count() / 1000.0,
        " s): the engine that runs it is stuck (a call into the communication library that does not return?)");
    state_->mark_broken(msg);
    throw CommError(msg);
  }
  if (error_) std::rethrow_exception(error_);
}

bool TaskWork::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
  return done_;
}

std::exception_ptr TaskWork::exception() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

// ---------------------------------------------------------------------------------------------

PollPolicy PollPolicy::for_ranks_per_node(int ranks_per_node) {
  PollPolicy p;
  // Online CPUs of the node, not this process's affinity (a rank bound to one core of two is
  // not oversubscribed; std::thread::hardware_concurrency() counts the affinity mask).
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (ranks_per_node > std::max(1L, cores)) p.inline_spins = p.thread_spins;
  return p;
}

ProgressEngine::ProgressEngine(std::shared_ptr<FailureState> state,
                               std::chrono::milliseconds timeout, PollPolicy policy)
    : state_(std::move(state)), timeout_(timeout), policy_(policy) {
  state_->set_waker([this] { on_failure(); });
}

ProgressEngine::~ProgressEngine() {
  shutdown(false);
  state_->set_waker(nullptr);
}

void ProgressEngine::on_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  cv_.notify_all();
}

std::shared_ptr<TaskWork> ProgressEngine::submit(std::unique_ptr<Task> task,
                                                 std::vector<at::Tensor> outputs, bool blocking) {
  auto work = std::make_shared<TaskWork>(task->what(), std::move(outputs), state_, timeout_);
  std::unique_lock<std::mutex> lock(mu_);
  // Under mu_: loop() fails the queue and returns holding it (Note [Deadlines and failure]).
  if (state_->broken()) {
    lock.unlock();
    state_->check_usable(task->what().str());
  }
  if (stop_) {
    throw CommError(concat(task->what().str(), " is refused: the communicator was shut down"));
  }
  if (blocking && queue_.empty() && !busy_ && !state_->broken()) {
    busy_ = true;
    lock.unlock();
    run_to_end(std::move(task), *work, /*on_caller=*/true);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
    return work;  // the caller's wait() throws the error, if any
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  queue_.emplace_back(std::move(task), work);
  cv_.notify_all();
  return work;
}

void ProgressEngine::run_exclusive(const std::function<void()>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return (queue_.empty() && !busy_) || state_->broken() || stop_; });
  if (state_->broken() || stop_) {
    lock.unlock();
    state_->check_usable("a blocking call");
    throw CommError("a blocking call is refused: the communicator was shut down");
  }
  busy_ = true;
  lock.unlock();
  try {
    fn();
  } catch (...) {
    lock.lock();
    busy_ = false;
    cv_.notify_all();
    throw;
  }
  lock.lock();
  busy_ = false;
  cv_.notify_all();
}

bool ProgressEngine::execute(Task& task, bool on_caller) {
  const int spin_limit = on_caller ? policy_.inline_spins : policy_.thread_spins;
  const auto deadline = Clock::now() + timeout_;  // See Note [Deadlines and failure].
  state_->note_start();
  task.start();
  int spins = 0;
  uint64_t polls = 0, seen = task.progress();
  while (!task.poll()) {
    if (on_caller && task.progress() != seen) {  // data flows: keep the core
      seen = task.progress();
      spins = 0;
    }
    relax(spins, spin_limit);
    if ((++polls & 255) == 0) {
      if (abandon_.load(std::memory_order_relaxed) || state_->broken()) return false;
      if (Clock::now() > deadline) {
        throw CommError(state_->timeout_message(task.what(), timeout_));
      }
    }
  }
  return true;
}

void ProgressEngine::run_to_end(std::unique_ptr<Task> task, TaskWork& work, bool on_caller) {
  std::exception_ptr error;
  bool finished = false;
  try {
    finished = execute(*task, on_caller);
  } catch (const std::exception& e) {
    state_->mark_broken(e.what());
    error = std::current_exception();
  } catch (...) {
    state_->mark_broken(concat(task->what().str(), " failed with an unknown exception"));
    error = std::current_exception();
  }
  if (finished) {
    task.reset();  // drop its tensor references before the waiter wakes
  } else {
    if (!error) {
      error = std::make_exception_ptr(CommError(
          concat(task->what().str(), " was abandoned: ",
                 state_->broken() ? state_->reason() : std::string("the job is ending"))));
    }
    keep_forever(std::shared_ptr<Task>(std::move(task)));
  }
  work.complete(error);
}

void ProgressEngine::fail_all(std::deque<Entry>& entries, const std::string& reason) {
  for (auto& [task, work] : entries) {
    task.reset();  // never started: MPI holds nothing of it
    work->complete(std::make_exception_ptr(CommError(concat(
        work->what().str(), " did not run: the communicator failed before it started: ", reason))));
  }
  entries.clear();
}

void ProgressEngine::loop() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      return state_->broken() || abandon_.load() || (!busy_ && (!queue_.empty() || stop_));
    });
    if (state_->broken() || abandon_.load()) {
      std::deque<Entry> dead;
      dead.swap(queue_);
      lock.unlock();
      fail_all(dead, state_->broken() ? state_->reason()
                                      : std::string("the job is ending after a failure"));
      return;  // a failed communicator has no progress thread
    }
    if (queue_.empty()) return;  // stopped, every op done
    Entry entry = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    run_to_end(std::move(entry.first), *entry.second, /*on_caller=*/false);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

void ProgressEngine::shutdown(bool abandon) {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (abandon) abandon_ = true;
    thread = std::move(thread_);
    cv_.notify_all();
  }
  if (thread.joinable()) thread.join();
}

}  // namespace torchspeed::comm::detail
