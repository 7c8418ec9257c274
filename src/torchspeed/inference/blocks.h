// Handing out output-channel blocks to the intra-op threads (internal: included by
// inference/*.cpp only).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace torchspeed::inference {

// Output channels per block: 64 keep a block's weights in L2 while every group of 4 rows passes
// over them; one or two rows read each weight once and take blocks of 16, so that the threads
// (`dynamic_blocks`) finish together.
inline int64_t channel_block(int64_t rows) { return rows <= 2 ? 16 : 64; }

// run(b) for every b in [0, n). Each thread owns a contiguous range of blocks and runs them in
// order (one weight stream, which the prefetchers follow), then takes what is left of the other
// threads' ranges, one block at a time. A decode step's linears are bound by memory bandwidth,
// which the threads share unevenly: with fixed ranges alone, one thread waited for the other at
// the end of every linear, 11% of a batch-1 int8 step (perf, 2 threads); handing out single
// blocks in turn lost more, as each thread's stream then jumps. Which thread computes a block
// does not change its bits.
template <class F>
void dynamic_blocks(int64_t n, const F& run) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(std::max(1, at::get_num_threads()), n);
  if (threads == 1 || at::in_parallel_region()) {
    for (int64_t b = 0; b < n; ++b) run(b);
    return;
  }
  struct alignas(64) Range {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::vector<Range> ranges(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    ranges[static_cast<size_t>(t)].next.store(t * n / threads, std::memory_order_relaxed);
    ranges[static_cast<size_t>(t)].end = (t + 1) * n / threads;
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < threads; ++i) {
        Range& r = ranges[static_cast<size_t>((t + i) % threads)];
        for (int64_t b = r.next.fetch_add(1, std::memory_order_relaxed); b < r.end;
             b = r.next.fetch_add(1, std::memory_order_relaxed)) {
          run(b);
        }
      }
    }
  });
}

}  // namespace torchspeed::inference
