// CountingAllocator (runtime/memory_counter.h): the bytes live in LibTorch's CPU allocator and
// their peak, checked against tensors of known sizes, the temporaries of an expression, storage
// resizes (how ZeRO-3 frees and regathers parameters) and allocations from several threads.
#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "torchspeed/base/memory_counter.h"

namespace {

// Allocated while static objects are constructed, before any test installs the counter.
at::Tensor& allocated_before_counting() {
  static at::Tensor t = at::empty({4096}, at::kFloat);
  return t;
}
const bool kAllocatedEarly = allocated_before_counting().defined();

TEST(MemoryCounter, CountsLiveBytesAndThePeakOfKnownTensors) {
  auto& counter = torchspeed::count_cpu_allocations();
  const int64_t base = counter.live();
  counter.reset_peak();
  EXPECT_EQ(counter.peak(), base);
  at::Tensor a = at::empty({1000}, at::kFloat);  // 4000 bytes
  at::Tensor b = at::empty({500}, at::kDouble);  // 4000 bytes
  at::Tensor view = a.narrow(0, 10, 100);        // a view: no allocation
  EXPECT_EQ(counter.live() - base, 8000);
  EXPECT_EQ(counter.peak() - base, 8000);
  a.reset();
  EXPECT_EQ(counter.live() - base, 8000) << "the view keeps a's storage alive";
  view.reset();
  EXPECT_EQ(counter.live() - base, 4000);
  EXPECT_EQ(counter.peak() - base, 8000) << "the peak stays until reset";
  counter.reset_peak();
  EXPECT_EQ(counter.peak() - base, 4000);
  at::Tensor c = at::empty({250}, at::kBFloat16);  // 500 bytes
  EXPECT_EQ(counter.peak() - base, 4500);
  at::Tensor none = at::empty({0}, at::kFloat);
  EXPECT_EQ(counter.live() - base, 4500) << "an empty tensor allocates nothing";
  b.reset();
  c.reset();
  EXPECT_EQ(counter.live(), base);
}

TEST(MemoryCounter, PeakIncludesTheTemporariesOfAnExpression) {
  auto& counter = torchspeed::count_cpu_allocations();
  const int64_t n = 1 << 16, bytes = n * 4;
  at::Tensor x = at::ones({n}, at::kFloat);
  const int64_t base = counter.live();
  counter.reset_peak();
  // x * 2 (a temporary of n floats) lives while + 1 writes its own result: two at once.
  const double sum = (x * 2 + 1).sum().item<double>();
  EXPECT_EQ(sum, 3.0 * n);
  EXPECT_EQ(counter.live(), base);
  EXPECT_GE(counter.peak() - base, 2 * bytes);
  EXPECT_LE(counter.peak() - base, 2 * bytes + 1024) << "0-dim scalars and the sum are a few bytes";
}

TEST(MemoryCounter, StorageResizesAreCounted) {
  // ZeRO-3 releases a layer by resizing its storage to 0 bytes and regathers into the same storage.
  auto& counter = torchspeed::count_cpu_allocations();
  at::Tensor t = at::zeros({1024}, at::kFloat);
  const int64_t base = counter.live();
  c10::NoGradGuard guard;
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
  EXPECT_EQ(base - counter.live(), 4096);
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 4096);
  EXPECT_EQ(counter.live(), base);
}

TEST(MemoryCounter, AllocationsFromManyThreadsBalance) {
  auto& counter = torchspeed::count_cpu_allocations();
  const int64_t base = counter.live();
  counter.reset_peak();
  constexpr int kThreads = 4, kRounds = 2000;
  constexpr int64_t kMaxNumel = 4096;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kRounds; ++i) {
        at::Tensor x = at::empty({1 + (i * 37 + t * 11) % kMaxNumel}, at::kFloat);
        x.fill_(1.0f);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(counter.live(), base);
  // Each thread holds one tensor at a time.
  EXPECT_GT(counter.peak() - base, 0);
  EXPECT_LE(counter.peak() - base, kThreads * kMaxNumel * 4);
}

TEST(MemoryCounter, FreeingAnEarlierAllocationChangesNothing) {
  ASSERT_TRUE(kAllocatedEarly);
  auto& counter = torchspeed::count_cpu_allocations();
  const int64_t base = counter.live();
  allocated_before_counting().reset();  // never counted, so never subtracted
  EXPECT_EQ(counter.live(), base);
  EXPECT_GE(counter.live(), 0);
}

}  // namespace
