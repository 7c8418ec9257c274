// Note [Checked completions]
// A swap file holds the only copy of optimizer state between steps, so no transfer may fail
// unnoticed. Every request's completion is checked against the bytes asked for: a negative
// result is an error with errno's text, a short one (a file truncated under us, a full device)
// an error with both counts; each names the file and the offset. The first failure is kept and
// every later wait() throws it, so a step never goes on with a piece that was not read. Files are
// preallocated (fallocate) when created and only overwritten in place, so a full filesystem is
// found before training starts, not in the middle of a step.
#include "torchspeed/offload/aio.h"

#include <fcntl.h>
#include <malloc.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#ifdef TORCHSPEED_HAVE_LIBURING
#include <liburing.h>
#endif

#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

namespace torchspeed::offload {

namespace {
std::string errno_text(int e) { return concat(std::strerror(e), " (errno ", e, ")"); }
}  // namespace

// --- buffers -------------------------------------------------------------------------------------

AlignedBuffer::AlignedBuffer(size_t bytes, size_t alignment) : size_(bytes) {
  alignment = std::max<size_t>(alignment, 64);
  const size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  TS_CHECK(posix_memalign(&data_, alignment, std::max<size_t>(rounded, alignment)) == 0,
           "offload: cannot allocate a ", bytes, "-byte aligned I/O buffer");
}
AlignedBuffer::~AlignedBuffer() { std::free(data_); }
AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}
AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
  return *this;
}

// --- alignment -----------------------------------------------------------------------------------

DirectIoAlignment direct_io_alignment(const std::string& dir) {
  struct stat st {};
  TS_CHECK(::stat(dir.c_str(), &st) == 0, "offload: nvme_path '", dir, "' does not exist: ", errno_text(errno));
  TS_CHECK(S_ISDIR(st.st_mode), "offload: nvme_path '", dir, "' is not a directory");
  // Alignment is a property of files: ask about a probe file in the directory.
  const std::string probe = dir + "/.torchspeed-dio-probe-" + std::to_string(::getpid());
  int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600);
  DirectIoAlignment a;
  if (fd < 0 && errno == EINVAL) {  // no O_DIRECT on this filesystem
    a.direct = false;
    fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  TS_CHECK(fd >= 0, "offload: cannot create files in nvme_path '", dir, "': ", errno_text(errno),
           " (it must be a writable directory)");
  a.memory = a.offset = static_cast<size_t>(std::max<blksize_t>(st.st_blksize, 512));
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align > 0) {
    a.memory = sx.stx_dio_mem_align;
    a.offset = sx.stx_dio_offset_align;
  }
#endif
  a.memory = std::max<size_t>(a.memory, 64);
  a.offset = std::max<size_t>(a.offset, 512);
  ::close(fd);
  ::unlink(probe.c_str());
  return a;
}

DirectIoAlignment direct_io_alignment_for(const std::string& file) {
  const size_t end = file.find_last_of('/');
  return direct_io_alignment(end == std::string::npos ? "." : end == 0 ? "/" : file.substr(0, end));
}

void return_freed_memory_promptly() { ::mallopt(M_MMAP_THRESHOLD, 1 << 20); }

// --- the file ------------------------------------------------------------------------------------

struct SwapFile::Ring {
#ifdef TORCHSPEED_HAVE_LIBURING
  io_uring ring{};
#endif
  ~Ring() {
#ifdef TORCHSPEED_HAVE_LIBURING
    io_uring_queue_exit(&ring);
#endif
  }
};

SwapFile::SwapFile(std::string path, int64_t bytes, AioOptions options)
    : path_(std::move(path)), bytes_(bytes), options_(options) {
  TS_CHECK(options_.block_size() > 0 && options_.queue_depth() > 0, "aio.block_size and aio.queue_depth must be positive");
  const size_t end = path_.find_last_of('/');
  const std::string dir = end == std::string::npos ? "." : end == 0 ? "/" : path_.substr(0, end);
  align_ = direct_io_alignment(dir);
  TS_CHECK(bytes_ % static_cast<int64_t>(align_.offset) == 0, "swap file size ", bytes_, " is not a multiple of ",
           align_.offset);
  TS_CHECK(options_.block_size() % static_cast<int64_t>(align_.offset) == 0, "aio.block_size ", options_.block_size(),
           " is not a multiple of the direct-I/O alignment ", align_.offset, " of '", dir, "'");
  // Not O_TRUNC: a live job's file must not be cut before we know it is not locked.
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | (align_.direct ? O_DIRECT : 0), 0600);
  TS_CHECK(fd_ >= 0, "offload: cannot create swap file '", path_, "': ", errno_text(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    TS_CHECK(false, "offload: swap file '", path_, "' is in use by another process (", errno_text(e),
             "); give each job its own nvme_path");
  }
  // A file left by a run that died is replaced whole: its content never mixes with ours.
  auto fail = [&](const std::string& what, int e) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(path_.c_str());
    TS_CHECK(false, what, errno_text(e));
  };
  if (::ftruncate(fd_, 0) != 0) fail(concat("offload: cannot truncate swap file '", path_, "': "), errno);
  if (int e = ::posix_fallocate(fd_, 0, bytes_); e != 0) {
    struct statvfs vfs {};
    const int64_t free_bytes = ::statvfs(dir.c_str(), &vfs) == 0 ? static_cast<int64_t>(vfs.f_bavail) * vfs.f_frsize : -1;
    fail(concat("offload: cannot reserve ", bytes_, " bytes for swap file '", path_, "' (", free_bytes,
                " bytes free there): "), e);
  }
#ifdef TORCHSPEED_HAVE_LIBURING
  ring_ = std::make_unique<Ring>();
  if (int e = io_uring_queue_init(static_cast<unsigned>(options_.queue_depth()), &ring_->ring, 0); e < 0) {
    ring_.release();  // never initialised: nothing to exit
    log::warn("offload: io_uring is not available (", errno_text(-e), "); swap I/O falls back to pread/pwrite");
  }
#endif
  if (!align_.direct) {
    log::warn("offload: the filesystem of '", path_, "' has no direct I/O; swap data passes through the page cache");
  }
  in_flight_.resize(static_cast<size_t>(options_.queue_depth()));
  for (int i = options_.queue_depth() - 1; i >= 0; --i) free_slots_.push_back(i);
}

SwapFile::~SwapFile() {
  try {
    while (!pending_.empty() || free_slots_.size() < in_flight_.size()) pump(true);
  } catch (...) {
  }
  ring_.reset();
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
}

std::string SwapFile::describe() const {
  return concat(ring_ ? "io_uring" : "pread/pwrite", ", ", align_.direct ? "O_DIRECT" : "buffered", ", block ",
                options_.block_size(), " B, queue depth ", options_.queue_depth(), ", alignment ", align_.offset);
}

void SwapFile::check_range(int64_t offset, int64_t bytes, const void* buf, const char* what) const {
  const auto a = static_cast<int64_t>(align_.offset);
  TS_CHECK(offset >= 0 && bytes >= 0 && offset + bytes <= bytes_, "offload: ", what, " of ", bytes, " bytes at offset ",
           offset, " is outside swap file '", path_, "' (", bytes_, " bytes)");
  TS_INTERNAL_ASSERT(offset % a == 0 && bytes % a == 0 &&
                         reinterpret_cast<uintptr_t>(buf) % align_.memory == 0,
                     "unaligned swap ", what, " at offset ", offset, " of ", bytes, " bytes");
}

SwapFile::Ticket SwapFile::read(int64_t offset, void* buf, int64_t bytes) {
  check_range(offset, bytes, buf, "read");
  return queue(false, offset, static_cast<char*>(buf), bytes);
}

SwapFile::Ticket SwapFile::write(int64_t offset, const void* buf, int64_t bytes) {
  check_range(offset, bytes, buf, "write");
  return queue(true, offset, static_cast<char*>(const_cast<void*>(buf)), bytes);
}

SwapFile::Ticket SwapFile::queue(bool write, int64_t offset, char* buf, int64_t bytes) {
  if (!error_.empty()) throw Error(error_);
  const Ticket t = next_ticket_++;
  int64_t n = 0;
  for (int64_t done = 0; done < bytes; done += options_.block_size(), ++n) {
    pending_.push_back({write, offset + done, buf + done, std::min(options_.block_size(), bytes - done), t});
  }
  if (n > 0) outstanding_.emplace_back(t, n);
  pump(false);
  return t;
}

void SwapFile::complete(const Request& r, int64_t result) {
  const char* op = r.write ? "write" : "read";
  const bool record = (result < 0 || result != r.bytes) && r.offset < error_offset_;
  if (record) error_offset_ = r.offset;
  if (result < 0 && record) {
    error_ = concat("offload: ", op, " of ", r.bytes, " bytes at offset ", r.offset, " of swap file '", path_,
                    "' failed: ", errno_text(static_cast<int>(-result)));
  } else if (result >= 0 && result != r.bytes && record) {
    error_ = concat("offload: short ", op, " at offset ", r.offset, " of swap file '", path_, "': ", result, " of ",
                    r.bytes, " bytes", r.write ? " (the device is full?)" : " (the file was truncated or replaced)");
  }
  if (result == r.bytes) (r.write ? bytes_written_ : bytes_read_) += r.bytes;
  for (auto it = outstanding_.begin(); it != outstanding_.end(); ++it) {
    if (it->first == r.ticket) {
      if (--it->second == 0) outstanding_.erase(it);
      break;
    }
  }
}

void SwapFile::pump(bool block) {
  if (!ring_) {  // synchronous fallback: every queued request now
    while (!pending_.empty()) {
      Request r = pending_.front();
      pending_.pop_front();
      const ssize_t n = r.write ? ::pwrite(fd_, r.buf, static_cast<size_t>(r.bytes), r.offset)
                                : ::pread(fd_, r.buf, static_cast<size_t>(r.bytes), r.offset);
      complete(r, n < 0 ? -errno : n);
    }
    return;
  }
#ifdef TORCHSPEED_HAVE_LIBURING
  io_uring* ring = &ring_->ring;
  int prepared = 0;
  const bool may_start = options_.overlap_events() || batch_left_ == 0;
  while (may_start && !pending_.empty() && !free_slots_.empty()) {
    io_uring_sqe* sqe = io_uring_get_sqe(ring);
    if (!sqe) break;
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    Request& r = in_flight_[static_cast<size_t>(slot)] = pending_.front();
    pending_.pop_front();
    if (r.write) {
      io_uring_prep_write(sqe, fd_, r.buf, static_cast<unsigned>(r.bytes), static_cast<uint64_t>(r.offset));
    } else {
      io_uring_prep_read(sqe, fd_, r.buf, static_cast<unsigned>(r.bytes), static_cast<uint64_t>(r.offset));
    }
    io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
    ++prepared;
    if (!options_.overlap_events()) ++batch_left_;
    if (options_.single_submit()) {
      int e = io_uring_submit(ring);
      TS_CHECK(e >= 0, "offload: io_uring submit for '", path_, "' failed: ", errno_text(-e));
    }
  }
  if (prepared > 0 && !options_.single_submit()) {
    int e = io_uring_submit(ring);
    TS_CHECK(e >= 0, "offload: io_uring submit for '", path_, "' failed: ", errno_text(-e));
  }
  if (free_slots_.size() == in_flight_.size()) return;  // nothing in flight
  io_uring_cqe* cqe = nullptr;
  if (block) {
    int e;
    do e = io_uring_wait_cqe(ring, &cqe); while (e == -EINTR);
    TS_CHECK(e == 0, "offload: waiting for I/O on '", path_, "' failed: ", errno_text(-e));
  }
  while (io_uring_peek_cqe(ring, &cqe) == 0 && cqe) {
    const auto slot = static_cast<int>(io_uring_cqe_get_data64(cqe));
    const int64_t res = cqe->res;
    io_uring_cqe_seen(ring, cqe);
    free_slots_.push_back(slot);
    if (batch_left_ > 0) --batch_left_;
    complete(in_flight_[static_cast<size_t>(slot)], res);
  }
#else
  (void)block;
#endif
}

bool SwapFile::done(Ticket t) const {
  return std::none_of(outstanding_.begin(), outstanding_.end(), [t](const auto& o) { return o.first == t; });
}

void SwapFile::wait(Ticket t) {
  const auto start = std::chrono::steady_clock::now();
  while (!done(t)) pump(true);
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!error_.empty()) throw Error(error_);
}

void SwapFile::wait_all() {
  while (!outstanding_.empty()) pump(true);
  if (!error_.empty()) throw Error(error_);
}

}  // namespace torchspeed::offload
