// The progress engine of a communicator on its own (no MPI; one process), with tasks whose
// polls the tests script: an op submitted while the communicator fails is never queued for a
// progress thread that has already gone, and Work::wait() ends by the deadline even when the
// engine cannot end an op, naming the op and rank. See Note [Deadlines and failure].
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "torchspeed/comm/detail/progress.h"
#include "torchspeed/base/error.h"

namespace d = torchspeed::comm::detail;
using torchspeed::CommError;
using namespace std::chrono_literals;

namespace {

const char* kGroup = " on group 'test' (rank 1 of 2, world rank 3)";

d::OpDesc desc() {
  d::OpDesc o;
  o.op = "all_reduce";
  o.group = std::make_shared<const std::string>(kGroup);
  o.bytes = 4;
  return o;
}

// An op whose poll() the test supplies.
class ScriptedTask final : public d::Task {
 public:
  explicit ScriptedTask(std::function<bool()> poll) : Task(desc(), {}), poll_(std::move(poll)) {}
  void start() override {}
  bool poll() override { return poll_(); }

 private:
  std::function<bool()> poll_;
};

std::unique_ptr<d::Task> task(std::function<bool()> poll) { return std::make_unique<ScriptedTask>(std::move(poll)); }

std::shared_ptr<d::FailureState> failure_state() {
  return std::make_shared<d::FailureState>("members of 'test' (world ranks): [2, 3]");
}

// Whether `w` completed (or failed) within `limit`; never waits longer, whatever the engine does.
bool ends_within(d::TaskWork& w, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (w.exception()) return true;
    try {
      if (w.is_completed()) return true;
    } catch (const std::exception&) {
      return true;
    }
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

bool contains(const std::string& s, const std::string& needle) { return s.find(needle) != std::string::npos; }

}  // namespace

// Submitters race the failure of an op on the progress thread. Every submission either throws
// the original failure at once or returns a Work that ends: none is queued after the thread
// failed the queue and returned (before the fix the failure was checked outside the engine's
// lock, and a submission that lost the race waited forever).
TEST(ProgressEngine, AnOpSubmittedAsTheCommunicatorFailsNeverWaitsForever) {
  int stuck = 0, refused = 0, failed_in_queue = 0;
  for (int iter = 0; iter < 50 && stuck == 0; ++iter) {
    auto state = failure_state();
    d::ProgressEngine engine(state, 10s, d::PollPolicy{});
    std::atomic<bool> fail{false};
    engine.submit(task([&]() -> bool {
                    if (fail.load()) throw CommError("injected failure");
                    return false;
                  }),
                  {}, /*blocking=*/false);
    std::vector<std::vector<std::shared_ptr<d::TaskWork>>> works(4);
    std::vector<std::string> errors(works.size());
    std::vector<std::thread> submitters;
    for (size_t s = 0; s < works.size(); ++s) {
      submitters.emplace_back([&, s] {
        for (;;) {
          try {
            works[s].push_back(engine.submit(task([] { return true; }), {}, /*blocking=*/false));
          } catch (const CommError& e) {
            errors[s] = e.what();
            return;
          }
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100 * (iter % 10)));
    fail = true;
    for (auto& t : submitters) t.join();
    for (size_t s = 0; s < works.size(); ++s) {
      EXPECT_TRUE(contains(errors[s], "unusable after an earlier failure: injected failure")) << errors[s];
      ++refused;
      for (auto& w : works[s]) {
        if (!ends_within(*w, 2s)) {
          ++stuck;
        } else if (w->exception()) {
          ++failed_in_queue;
        }
      }
    }
  }
  EXPECT_EQ(stuck, 0) << "ops queued after the progress thread had failed the queue and returned";
  EXPECT_GT(refused, 0);
  std::printf("refused %d submissions at once, %d queued ops failed with the queue\n", refused, failed_in_queue);
}

// An op whose poll never returns (a call into the backend that hangs): the engine cannot enforce
// its deadline, so wait() must. It gives up after the deadline and a grace, naming the op and
// rank, and breaks the communicator: the op queued behind fails, later ops are refused.
TEST(ProgressEngine, WaitEndsByTheDeadlineWhenTheEngineCannotEndAnOp) {
  auto state = failure_state();
  d::ProgressEngine engine(state, 300ms, d::PollPolicy{});
  std::atomic<bool> release{false};
  auto hung = engine.submit(task([&] {
                              while (!release.load()) std::this_thread::sleep_for(1ms);
                              return true;
                            }),
                            {}, /*blocking=*/false);
  auto queued = engine.submit(task([] { return true; }), {}, /*blocking=*/false);
  const auto start = std::chrono::steady_clock::now();
  auto waited = std::async(std::launch::async, [&]() -> std::string {
    try {
      hung->wait();
      return "wait() returned";
    } catch (const CommError& e) {
      return e.what();
    }
  });
  const bool ended = waited.wait_for(15s) == std::future_status::ready;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  release = true;  // the engine goes on either way, so that the test ends
  const std::string msg = waited.get();
  ASSERT_TRUE(ended) << "wait() had not returned after 15 s, with a deadline of 0.3 s";
  EXPECT_TRUE(contains(msg, std::string("all_reduce") + kGroup + ", 4 bytes of Float: wait() gave up")) << msg;
  EXPECT_TRUE(contains(msg, "deadline of 0.3 s")) << msg;
  EXPECT_GE(seconds, 0.3);
  EXPECT_LT(seconds, 5.0);
  ASSERT_TRUE(ends_within(*queued, 5s));
  EXPECT_THROW(queued->wait(), CommError);
  try {
    engine.submit(task([] { return true; }), {}, /*blocking=*/true);
    ADD_FAILURE() << "an op ran on the broken communicator";
  } catch (const CommError& e) {
    EXPECT_TRUE(contains(e.what(), "unusable after an earlier failure")) << e.what();
    EXPECT_TRUE(contains(e.what(), "wait() gave up")) << e.what();
  }
}

// The bound counts from the latest op's start, not from the wait: ops queued behind each other,
// each within the deadline but far beyond it together, all complete without an error.
TEST(ProgressEngine, WaitOnAnOpQueuedBehindSlowOnesDoesNotGiveUp) {
  auto state = failure_state();
  d::ProgressEngine engine(state, 300ms, d::PollPolicy{});
  std::vector<std::shared_ptr<d::TaskWork>> works;
  for (int i = 0; i < 8; ++i) {
    works.push_back(engine.submit(task([started = std::chrono::steady_clock::time_point{}]() mutable {
                                    const auto now = std::chrono::steady_clock::now();
                                    if (started == std::chrono::steady_clock::time_point{}) started = now;
                                    return now - started >= 200ms;
                                  }),
                                  {}, /*blocking=*/false));
  }
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(works.back()->wait());  // 1.6 s of ops ahead; deadline 0.3 s + grace 1.03 s
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms);
  EXPECT_FALSE(state->broken());
}
