// Direct I/O to swap files: aligned buffers, the direct-I/O alignment of a directory (statx),
// and SwapFile, a preallocated O_DIRECT file read and written asynchronously through io_uring in
// block_size requests with at most queue_depth in flight (DeepSpeed's "aio" section). Every
// completion is checked: a failed or short transfer is an error naming the file, the offset and
// errno (Note [Checked completions] in aio.cpp).
#pragma once

#include <torch/arg.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace torchspeed::offload {

// DeepSpeed's "aio" section.
struct AioOptions {
  TORCH_ARG(int64_t, block_size) = 1048576;  // bytes per request
  TORCH_ARG(int, queue_depth) = 8;           // requests in flight
  // Submit each request by itself (else a batch per submission).
  TORCH_ARG(bool, single_submit) = false;
  // Refill the queue as requests complete (else wait for a whole batch before the next).
  TORCH_ARG(bool, overlap_events) = true;
};

// Memory aligned for direct I/O; owns it.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(size_t bytes, size_t alignment);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// What O_DIRECT requires of offsets, lengths and buffers for files in `dir`: statx's
// STATX_DIOALIGN where the kernel and filesystem report it, else the filesystem's block size.
struct DirectIoAlignment {
  size_t memory = 4096, offset = 4096;
  bool direct = true;  // false: the filesystem has no direct I/O (tmpfs before Linux 6.6)
};
DirectIoAlignment direct_io_alignment(const std::string& dir);
// The same for the directory a file will be created in.
DirectIoAlignment direct_io_alignment_for(const std::string& file);
inline int64_t align_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Makes glibc map allocations of 1 MiB and more on their own (mmap), so that freed tensors
// return to the system at once instead of staying in the heap under its dynamic mmap threshold
// (measured: ~50 MB of RSS above the live tensors of a 150M-parameter ZeRO-3 run). Process-wide;
// the engine calls it when a config offloads, where memory is the point.
void return_freed_memory_promptly();

class SwapFile {
 public:
  // Creates `path` (replacing what is there), takes an exclusive lock on it, and preallocates
  // `bytes` (a multiple of the alignment): a full filesystem is an error here, not in a step.
  SwapFile(std::string path, int64_t bytes, AioOptions options);
  ~SwapFile();  // waits for requests in flight, removes the file
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  using Ticket = int64_t;
  // Queue a transfer of `bytes` at `offset` (both aligned; buf aligned). Returns at once.
  Ticket read(int64_t offset, void* buf, int64_t bytes);
  Ticket write(int64_t offset, const void* buf, int64_t bytes);
  // Until the transfer is complete; throws for a failed or short request of it.
  void wait(Ticket t);
  void wait_all();
  bool done(Ticket t) const;

  const std::string& path() const { return path_; }
  int64_t size() const { return bytes_; }
  const DirectIoAlignment& alignment() const { return align_; }
  // "io_uring" or "pread/pwrite" (a kernel that refuses io_uring); "direct" or "buffered".
  std::string describe() const;
  // Bytes moved and seconds the caller waited in wait().
  int64_t bytes_read() const { return bytes_read_; }
  int64_t bytes_written() const { return bytes_written_; }
  double wait_seconds() const { return wait_s_; }

 private:
  struct Request {
    bool write;
    int64_t offset;
    char* buf;
    int64_t bytes;
    Ticket ticket;
  };
  struct Ring;
  Ticket queue(bool write, int64_t offset, char* buf, int64_t bytes);
  void pump(bool block);  // submit what the queue allows; reap completions (block: at least one)
  void complete(const Request& r, int64_t result);
  void check_range(int64_t offset, int64_t bytes, const void* buf, const char* what) const;

  std::string path_;
  int64_t bytes_;
  AioOptions options_;
  DirectIoAlignment align_;
  int fd_ = -1;
  std::unique_ptr<Ring> ring_;  // null: synchronous fallback
  std::deque<Request> pending_;
  std::vector<Request> in_flight_;  // indexed by slot
  std::vector<int> free_slots_;
  int batch_left_ = 0;  // overlap_events=false: requests of the current batch not yet complete
  Ticket next_ticket_ = 1;
  std::vector<std::pair<Ticket, int64_t>> outstanding_;  // ticket -> requests not complete
  // The failure at the lowest offset (requests complete in any order); every later wait throws it.
  std::string error_;
  int64_t error_offset_ = INT64_MAX;
  int64_t bytes_read_ = 0, bytes_written_ = 0;
  double wait_s_ = 0.0;
};

}  // namespace torchspeed::offload
