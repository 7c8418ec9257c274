// A rank that skips a collective must not hang the others: after the deadline they get a
// CommError naming the op, the group, the rank and the bytes, and the job ends with a message.
// argv[1] = "blocking" (the op runs inline on the caller) or "async" (queued on the progress
// thread, then wait()). Registered with a pass regex because the job's exit status is (rightly)
// a failure: shutdown() aborts the job after a communication failure.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/runtime.h"

int main(int argc, char** argv) {
  const bool async = argc > 1 && std::strcmp(argv[1], "async") == 0;
  const auto& rt = torchspeed::init();
  auto w = torchspeed::comm::Communicator::world(
      torchspeed::comm::CommOptions().timeout(std::chrono::milliseconds(1500)));
  at::Tensor t = at::ones({1024});
  w->all_reduce(t);  // everyone takes part once: the communicator works
  if (rt.rank == w->size() - 1) {
    // The last rank skips the next collective; the job must be ended for it.
    std::this_thread::sleep_for(std::chrono::seconds(50));
    std::printf("rank %d was not ended by the others' timeout\n", rt.rank);
    return 1;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    if (async) {
      auto work = w->all_reduce_async(t);
      work->wait();
    } else {
      w->all_reduce(t);
    }
    std::printf("rank %d: all_reduce returned without the missing rank\n", rt.rank);
    return 1;
  } catch (const torchspeed::CommError& e) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string msg = e.what();
    std::printf("rank %d caught after %.2f s: %s\n", rt.rank, waited, msg.c_str());
    const bool names_all =
        msg.find("all_reduce on group 'world'") != std::string::npos &&
        msg.find(torchspeed::concat("rank ", rt.rank, " of ", w->size())) != std::string::npos &&
        msg.find("4096 bytes of Float") != std::string::npos &&
        msg.find("did not complete within 1.5 s") != std::string::npos;
    if (names_all && waited >= 1.4 && waited < 10) {
      // Later use of the broken communicator is refused at once, not hung.
      try {
        w->all_reduce(t);
      } catch (const torchspeed::Error& again) {
        if (std::string(again.what()).find("unusable after an earlier failure") != std::string::npos) {
          std::printf("DEADLINE_TEST_PASSED rank %d %s\n", rt.rank, async ? "async" : "blocking");
        }
      }
    }
  }
  std::fflush(stdout);
  torchspeed::shutdown();  // aborts the job: the skipped rank is ended too
  return 1;
}
