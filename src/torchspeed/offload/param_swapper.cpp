// Note [Parameter swapping]
// With offload_param.device "nvme" the stage-3 shards of units beyond max_in_cpu elements live
// in one preallocated swap file, each at an aligned offset. A unit's shard is read back when the
// unit is gathered, written when the step has updated it. The layers run in stack order, so the
// gatherer asks for the next units' shards ahead (prefetch): each takes a buffer of the pool
// (buffer_count buffers of buffer_size elements) and its read runs while the current layer
// computes. One buffer is always left for the rest: a shard larger than a buffer, a read that
// was not prefetched, and writes, which go through the pool in buffer-sized pieces and complete
// behind the step. A read of a unit first waits for that unit's writes, and a write drops any
// prefetch of the unit, so a read never returns anything but the last value written.
#include "torchspeed/offload/param_swapper.h"

#include "torchspeed/offload/optimizer_swapper.h"  // aio_options_of

#include <algorithm>
#include <cstring>

#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

namespace torchspeed::offload {

ParamSwapper::ParamSwapper(ParamSwapperOptions options) : options_(std::move(options)) {
  TS_CHECK(options_.buffer_count() >= 2, "zero_optimization.offload_param.buffer_count must be at least 2 (one "
           "buffer reading ahead, one for everything else), got ", options_.buffer_count());
  TS_CHECK(options_.buffer_bytes() > 0, "zero_optimization.offload_param.buffer_size must be positive");
}

ParamSwapper::~ParamSwapper() {
  try {
    if (file_) file_->wait_all();
  } catch (...) {
  }
}

void ParamSwapper::open(std::vector<int64_t> shard_bytes) {
  const DirectIoAlignment align = direct_io_alignment_for(options_.path());
  const auto a = static_cast<int64_t>(align.offset);
  units_.assign(shard_bytes.size(), UnitRecord{});
  int64_t offset = 0, in_cpu = 0, largest = 0;
  for (size_t i = 0; i < shard_bytes.size(); ++i) {
    UnitRecord& u = units_[i];
    u.bytes = shard_bytes[i];
    if (u.bytes == 0) continue;
    if (in_cpu + u.bytes <= options_.max_in_cpu_bytes()) {  // the first units stay in RAM
      in_cpu += u.bytes;
      continue;
    }
    u.held = true;
    u.padded = align_up(u.bytes, a);
    u.offset = offset;
    offset += u.padded;
    largest = std::max(largest, u.padded);
  }
  file_ = std::make_unique<SwapFile>(options_.path(), std::max(offset, a), options_.aio());
  buffer_bytes_ = std::min(align_up(options_.buffer_bytes(), a), std::max(largest, a));
  buffers_.clear();
  free_.clear();
  for (int64_t i = 0; i < options_.buffer_count(); ++i) {
    buffers_.emplace_back(static_cast<size_t>(buffer_bytes_), align.memory);
    free_.push_back(static_cast<int>(i));
  }
  log::debug("offload: parameter shards ", describe());
}

void ParamSwapper::reclaim(bool all) {
  while (!writes_.empty() && (all || file_->done(writes_.front().ticket))) {
    file_->wait(writes_.front().ticket);
    free_.push_back(writes_.front().buffer);
    writes_.pop_front();
  }
}

int ParamSwapper::acquire() {
  reclaim(false);
  if (free_.empty()) {
    TS_INTERNAL_ASSERT(!writes_.empty(), "parameter swap pool exhausted by prefetches");
    file_->wait(writes_.front().ticket);
    free_.push_back(writes_.front().buffer);
    writes_.pop_front();
  }
  const int b = free_.back();
  free_.pop_back();
  return b;
}

void ParamSwapper::wait_writes_of(size_t unit) {
  for (auto it = writes_.begin(); it != writes_.end();) {
    if (it->unit == unit) {
      file_->wait(it->ticket);
      free_.push_back(it->buffer);
      it = writes_.erase(it);
    } else {
      ++it;
    }
  }
}

void ParamSwapper::drop_prefetch(size_t unit) {
  UnitRecord& u = units_[unit];
  if (u.buffer < 0) return;
  file_->wait(u.read);
  free_.push_back(u.buffer);
  u.buffer = -1;
}

bool ParamSwapper::prefetch(size_t unit) {
  UnitRecord& u = units_.at(unit);
  if (!u.held || u.buffer >= 0) return true;
  if (u.padded > buffer_bytes_) return true;  // read in pieces when needed; does not use the pool ahead
  reclaim(false);
  if (free_.size() <= 1) return false;  // keep one buffer for everything else
  wait_writes_of(unit);
  u.buffer = free_.back();
  free_.pop_back();
  u.read = file_->read(u.offset, buffers_[static_cast<size_t>(u.buffer)].data(), u.padded);
  return true;
}

void ParamSwapper::read(size_t unit, void* dst) {
  UnitRecord& u = units_.at(unit);
  TS_INTERNAL_ASSERT(u.held, "reading a parameter shard that is not offloaded");
  if (u.buffer >= 0) {
    ++hits_;
    file_->wait(u.read);
    std::memcpy(dst, buffers_[static_cast<size_t>(u.buffer)].data(), static_cast<size_t>(u.bytes));
    free_.push_back(u.buffer);
    u.buffer = -1;
    return;
  }
  ++misses_;
  wait_writes_of(unit);
  char* out = static_cast<char*>(dst);
  for (int64_t off = 0; off < u.padded; off += buffer_bytes_) {  // a shard larger than a buffer: in pieces
    const int64_t n = std::min(buffer_bytes_, u.padded - off);
    const int b = acquire();
    try {
      file_->wait(file_->read(u.offset + off, buffers_[static_cast<size_t>(b)].data(), n));
    } catch (...) {
      free_.push_back(b);
      throw;
    }
    std::memcpy(out + off, buffers_[static_cast<size_t>(b)].data(), static_cast<size_t>(std::min(n, u.bytes - off)));
    free_.push_back(b);
  }
}

void ParamSwapper::write(size_t unit, const void* src) {
  UnitRecord& u = units_.at(unit);
  TS_INTERNAL_ASSERT(u.held, "writing a parameter shard that is not offloaded");
  drop_prefetch(unit);  // its content is about to be stale
  const char* in = static_cast<const char*>(src);
  for (int64_t off = 0; off < u.padded; off += buffer_bytes_) {
    const int64_t n = std::min(buffer_bytes_, u.padded - off);
    const int64_t real = std::min(n, u.bytes - off);
    const int b = acquire();
    char* buf = static_cast<char*>(buffers_[static_cast<size_t>(b)].data());
    std::memcpy(buf, in + off, static_cast<size_t>(real));
    if (real < n) std::memset(buf + real, 0, static_cast<size_t>(n - real));
    writes_.push_back({unit, file_->write(u.offset + off, buf, n), b});
  }
}

void ParamSwapper::flush() { reclaim(true); }

int64_t ParamSwapper::resident_bytes() const {
  int64_t n = 0;
  for (const auto& b : buffers_) n += static_cast<int64_t>(b.size());
  return n;
}

std::string ParamSwapper::describe() const {
  int64_t held = 0;
  for (const auto& u : units_) held += u.held ? 1 : 0;
  return concat("nvme:", options_.path(), " (", held, " of ", units_.size(), " units on disk; ",
                file_ ? file_->describe() : std::string("not open"), "; ", buffers_.size(), " buffers of ", buffer_bytes_,
                " B)");
}

}  // namespace torchspeed::offload
