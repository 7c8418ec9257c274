// main() for multi-rank GoogleTest executables: starts the runtime, prints results on rank 0
// only, and makes every rank exit non-zero when any rank failed.
#include <gtest/gtest.h>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/comm/runtime.h"
#include "dist_util.h"

namespace ts_test {
torchspeed::comm::CommunicatorPtr& world() {
  static torchspeed::comm::CommunicatorPtr w;
  return w;
}
}  // namespace ts_test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const auto& rt = torchspeed::init();
  ts_test::world() = torchspeed::comm::Communicator::world();
  if (rt.rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  auto flag = at::full({1}, failed, at::kInt);
  ts_test::world()->all_reduce(flag, torchspeed::comm::ReduceOp::kMax);
  if (rt.rank == 0 && flag.item<int>() != 0 && !failed) {
    fprintf(stderr, "a test failed on another rank\n");
  }
  ts_test::world().reset();
  torchspeed::shutdown();
  return flag.item<int>() != 0 ? 1 : 0;
}
