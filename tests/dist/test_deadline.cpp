// Deadlines and failure of a communicator, in three modes (argv[1]):
// - "blocking" / "async": a rank that skips a collective must not hang the others. After the
//   deadline (counted from the op's start) they get a CommError naming the op, the group, the
//   rank and the bytes; the op queued behind it fails without running; the communicator is
//   then broken: its progress thread stops (no core spinning on the dead op) and later ops
//   throw a CommError naming the original failure at once. The job then ends with a message,
//   so these modes are registered with a pass regex: the job's exit status is (rightly) a
//   failure, shutdown() aborts the job after a communication failure.
// - "queued": a slow op and a second one queued behind it, each shorter than the deadline but
//   longer together, both complete: the second op's deadline starts when it starts.
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/base/error.h"
#include "torchspeed/comm/runtime.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

// After the failure: nothing of the communicator runs, and every later op is refused at once
// with a CommError that carries the original failure.
bool broken_and_quiet(torchspeed::comm::Communicator& w, int rank, const std::string& original) {
  const double cpu0 = process_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double cpu = process_cpu_seconds() - cpu0;
  if (cpu > 0.3) {
    std::printf("rank %d: %.2f s of CPU in 1 s after the failure: a thread still spins\n", rank,
                cpu);
    return false;
  }
  at::Tensor t = at::ones({1024});
  for (int async = 0; async < 2; ++async) {
    const auto start = Clock::now();
    try {
      if (async) {
        w.all_reduce_async(t)->wait();
      } else {
        w.all_reduce(t);
      }
      std::printf("rank %d: an op on the broken communicator ran\n", rank);
      return false;
    } catch (const torchspeed::CommError& e) {
      const std::string msg = e.what();
      if (!contains(msg, "unusable after an earlier failure") || !contains(msg, original) ||
          seconds_since(start) > 0.5) {
        std::printf("rank %d: later op: unexpected error after %.2f s: %s\n", rank,
                    seconds_since(start), msg.c_str());
        return false;
      }
    }
  }
  return true;
}

int dead_peer(bool async, const torchspeed::Runtime& rt) {
  auto w = torchspeed::comm::Communicator::world(
      torchspeed::comm::CommOptions().timeout(std::chrono::milliseconds(1500)));
  at::Tensor t = at::ones({1024});
  w->all_reduce_async(t)->wait();  // everyone takes part: the communicator and its thread work
  w->all_reduce(t);
  if (rt.rank == w->size() - 1) {
    // The last rank skips the next collective; the job must be ended for it.
    std::this_thread::sleep_for(std::chrono::seconds(50));
    std::printf("rank %d was not ended by the others' timeout\n", rt.rank);
    return 1;
  }
  const auto start = Clock::now();
  torchspeed::comm::WorkPtr behind;
  try {
    if (async) {
      auto work = w->all_reduce_async(t);
      behind = w->all_reduce_async(at::ones({16}));  // queued behind the op that will fail
      work->wait();
    } else {
      w->all_reduce(t);
    }
    std::printf("rank %d: all_reduce returned without the missing rank\n", rt.rank);
    return 1;
  } catch (const torchspeed::CommError& e) {
    const double waited = seconds_since(start);
    const std::string msg = e.what();
    std::printf("rank %d caught after %.2f s: %s\n", rt.rank, waited, msg.c_str());
    const bool names_all = contains(msg, "all_reduce on group 'world'") &&
                           contains(msg, torchspeed::concat("rank ", rt.rank, " of ", w->size())) &&
                           contains(msg, "4096 bytes of Float") &&
                           contains(msg, "did not complete within 1.5 s of starting");
    bool ok = names_all && waited >= 1.4 && waited < 10;
    if (behind) {
      try {
        behind->wait();
        ok = false;
      } catch (const torchspeed::CommError& queued) {
        const std::string q = queued.what();
        ok = ok && behind->exception() != nullptr && contains(q, "did not run") &&
             contains(q, "64 bytes of Float") && contains(q, "did not complete within 1.5 s");
        if (!ok) std::printf("rank %d: queued op: %s\n", rt.rank, q.c_str());
      }
    }
    if (ok && broken_and_quiet(*w, rt.rank, "did not complete within 1.5 s")) {
      std::printf("DEADLINE_TEST_PASSED rank %d %s\n", rt.rank, async ? "async" : "blocking");
    }
  }
  std::fflush(stdout);
  torchspeed::shutdown();  // aborts the job: the skipped rank is ended too
  return 1;
}

int queued(const torchspeed::Runtime& rt) {
  constexpr auto kTimeout = std::chrono::milliseconds(2000);
  constexpr auto kLate = std::chrono::milliseconds(1200);  // < timeout; 2 x kLate > timeout
  auto w = torchspeed::comm::Communicator::world(torchspeed::comm::CommOptions().timeout(kTimeout));
  const int p = w->size();
  at::Tensor a = at::ones({1024}), b = at::full({1024}, 2.0);
  w->all_reduce(a);  // in step
  a.fill_(1.0);
  int rc = 0;
  if (rt.rank == p - 1) {
    // Joins each op kLate after the previous one.
    std::this_thread::sleep_for(kLate);
    w->all_reduce(a);
    std::this_thread::sleep_for(kLate);
    w->all_reduce(b);
  } else {
    const auto start = Clock::now();
    auto wa = w->all_reduce_async(a);
    auto wb = w->all_reduce_async(b);
    try {
      wb->wait();
      wa->wait();
      const double took = seconds_since(start);
      std::printf("rank %d: both ops completed after %.2f s (deadline %.1f s each)\n", rt.rank,
                  took, kTimeout.count() / 1000.0);
      if (took * 1000 < kTimeout.count()) {
        std::printf("rank %d: the ops were not slow enough to test anything\n", rt.rank);
        rc = 1;
      }
    } catch (const torchspeed::CommError& e) {
      std::printf("rank %d: %s\n", rt.rank, e.what());
      rc = 1;
    }
  }
  if (!at::equal(a, at::full({1024}, 1.0 * p)) || !at::equal(b, at::full({1024}, 2.0 * p))) {
    std::printf("rank %d: wrong sums\n", rt.rank);
    rc = 1;
  }
  if (rc == 0) std::printf("DEADLINE_TEST_PASSED rank %d queued\n", rt.rank);
  std::fflush(stdout);
  w.reset();
  torchspeed::shutdown();
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "blocking";
  const auto& rt = torchspeed::init();
  if (mode == "queued") return queued(rt);
  return dead_peer(mode == "async", rt);
}
