// Counting LibTorch's CPU allocations: bytes live now and the peak since a reset, measured in
// the allocator itself (not estimated). For memory benchmarks and tests.
#pragma once

#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <atomic>
#include <cstdint>

namespace torchspeed {

class CountingAllocator final : public at::Allocator {
 public:
  explicit CountingAllocator(at::Allocator* base) : base_(base) {}
#if TORCH_VERSION_MAJOR >= 2
  at::DataPtr allocate(size_t n) override { return wrap(n); }
#else
  at::DataPtr allocate(size_t n) const override { return wrap(n); }
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif
  at::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  at::DataPtr wrap(size_t n) const;
  static void release(void* data);
  at::Allocator* base_;
  mutable std::atomic<int64_t> live_{0}, peak_{0};
};

// Wraps LibTorch's CPU allocator (once per process; later calls return the same counter; a
// process has at most one CountingAllocator).
// Counts only allocations made after the first call.
CountingAllocator& count_cpu_allocations();

}  // namespace torchspeed
