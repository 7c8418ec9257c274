// CountingAllocator: a DataPtr context that remembers the size and the owner.
#include "torchspeed/base/memory_counter.h"

#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <mutex>
#include <unordered_map>

#include "torchspeed/base/error.h"

namespace torchspeed {
namespace {
// The base allocator's DataPtr and size of every live block, by address. The DataPtr we return
// has the address as its context too, which LibTorch's raw_allocate() requires.
struct Block {
  at::DataPtr inner;
  size_t n;
};
std::mutex g_mu;
std::unordered_map<void*, Block>* g_blocks = new std::unordered_map<void*, Block>();  // never freed
std::atomic<int64_t>* g_live = nullptr;
}  // namespace

at::DataPtr CountingAllocator::wrap(size_t n) const {
  at::DataPtr inner = base_->allocate(n);
  void* data = inner.get();
  at::Device device = inner.device();
  if (data == nullptr) return inner;  // zero bytes
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_live = &live_;
    g_blocks->emplace(data, Block{std::move(inner), n});
  }
  const int64_t now = live_ += static_cast<int64_t>(n);
  int64_t p = peak_.load();
  while (now > p && !peak_.compare_exchange_weak(p, now)) {
  }
  return at::DataPtr(data, data, &CountingAllocator::release, device);
}

void CountingAllocator::release(void* data) {
  Block b;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_blocks->find(data);
    if (it == g_blocks->end()) return;
    b = std::move(it->second);
    g_blocks->erase(it);
    *g_live -= static_cast<int64_t>(b.n);
  }
}  // b.inner frees the block outside the lock

CountingAllocator& count_cpu_allocations() {
  static CountingAllocator* counter = [] {
    // Wraps whatever allocator serves the CPU now (LibTorch's default unless someone installed
    // another); lives as long as the process.
    auto* c = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(c, /*priority=*/100);
    TS_CHECK(c10::GetCPUAllocator() == c, "could not install the counting CPU allocator: another allocator "
             "was installed with a higher priority (c10::SetCPUAllocator)");
    return c;
  }();
  return *counter;
}

}  // namespace torchspeed
