// Note [Optimizer swapping]
// With offload_optimizer.device "nvme" a rank's optimizer partition (the fp32 masters where
// they are a separate copy, and the moments) lives in one preallocated swap file. The step's
// pieces (Note [Step pieces] in zero/) are coalesced into groups of at most sub_group_size
// elements; a group's record is each kind's elements back to back, each padded to the
// direct-I/O alignment, so one group is one contiguous transfer. The step streams the groups
// through buffer_count aligned buffers, each one record: with pipeline_read, group i+1 is read
// while group i is updated, and the first groups are already read during the backward that ends
// the accumulation window (prefetch()); with pipeline_write, group i's write runs behind while
// the next groups are updated, the last ones behind the next forward, and a buffer returns to
// the pool when its write completes. A group is read only after its last write completed. The
// pool is the only RAM the optimizer state costs: buffer_count x the largest record.
//
// Nothing is cached between steps, so the state on disk is the state: a checkpoint export reads
// it, an import writes it, and a resumed run reads exactly what the previous one wrote.
#include "torchspeed/offload/optimizer_swapper.h"

#include <algorithm>
#include <deque>

#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

namespace torchspeed::offload {

OptimizerSwapper::OptimizerSwapper(SwapperOptions options) : options_(std::move(options)) {
  TS_CHECK(options_.buffer_count() >= 2, "zero_optimization.offload_optimizer.buffer_count must be at least 2 "
           "(one buffer being updated, one being read or written), got ", options_.buffer_count());
  TS_CHECK(options_.group_numel() > 0, "zero_optimization.sub_group_size must be positive");
}

OptimizerSwapper::~OptimizerSwapper() {
  try {
    if (file_) file_->wait_all();  // the buffers go before the file
  } catch (...) {
  }
}

void OptimizerSwapper::open(std::vector<std::string> kinds, int64_t part_numel, std::vector<zero::PieceRange> pieces) {
  kinds_ = std::move(kinds);
  pieces_ = std::move(pieces);
  const DirectIoAlignment align = direct_io_alignment_for(options_.path());
  const auto a = static_cast<int64_t>(align.offset);
  groups_.clear();
  int64_t expect = 0, offset = 0, largest = 0;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& p = pieces_[i];
    TS_INTERNAL_ASSERT(p.begin == expect, "partition pieces must tile the partition in order");
    expect += p.length;
    if (groups_.empty() || groups_.back().numel + p.length > options_.group_numel()) {
      groups_.push_back({i, i, p.begin, 0, 0, 0});
    }
    groups_.back().end_piece = i + 1;
    groups_.back().numel += p.length;
  }
  TS_INTERNAL_ASSERT(expect == part_numel, "partition pieces cover ", expect, " of ", part_numel, " elements");
  for (auto& g : groups_) {
    g.padded_bytes = align_up(g.numel * static_cast<int64_t>(sizeof(float)), a);
    g.file_offset = offset;
    const int64_t record = g.padded_bytes * static_cast<int64_t>(kinds_.size());
    offset += record;
    largest = std::max(largest, record);
  }
  file_ = std::make_unique<SwapFile>(options_.path(), std::max(offset, a), options_.aio());
  buffers_.clear();
  free_.clear();
  writing_.clear();
  const size_t n = std::min<size_t>(static_cast<size_t>(options_.buffer_count()), std::max<size_t>(groups_.size(), 1));
  for (size_t i = 0; i < n; ++i) {
    buffers_.emplace_back(static_cast<size_t>(largest), align.memory);
    free_.push_back(static_cast<int>(i));
  }
  state_.assign(groups_.size(), GroupState::kIdle);
  buf_of_.assign(groups_.size(), -1);
  read_ticket_.assign(groups_.size(), 0);
  write_ticket_.assign(groups_.size(), 0);
  log::debug("offload: optimizer state of ", part_numel, " elements x ", kinds_.size(), " in ", groups_.size(),
             " groups, ", describe());
}

void OptimizerSwapper::retire_oldest_write() {
  const size_t g = writing_.front();
  writing_.pop_front();
  file_->wait(write_ticket_[g]);
  free_.push_back(buf_of_[g]);
  buf_of_[g] = -1;
  state_[g] = GroupState::kIdle;
}

void OptimizerSwapper::reclaim_written() {
  while (!writing_.empty() && file_->done(write_ticket_[writing_.front()])) retire_oldest_write();
}

void OptimizerSwapper::start(size_t g, bool read) {
  if (free_.empty()) {
    TS_INTERNAL_ASSERT(!writing_.empty(), "optimizer swap pool exhausted");
    retire_oldest_write();
  }
  buf_of_[g] = free_.back();
  free_.pop_back();
  state_[g] = GroupState::kReading;
  read_ticket_[g] = read ? file_->read(groups_[g].file_offset, buffers_[static_cast<size_t>(buf_of_[g])].data(),
                                       groups_[g].padded_bytes * static_cast<int64_t>(kinds_.size()))
                         : 0;
}

void OptimizerSwapper::flush() {
  while (!writing_.empty()) retire_oldest_write();
}

void OptimizerSwapper::prefetch() {
  if (!file_ || !options_.pipeline_read()) return;
  reclaim_written();
  for (size_t g = 0; g < groups_.size() && !free_.empty(); ++g) {
    if (state_[g] == GroupState::kWriting) break;  // read in order, after its write
    if (state_[g] == GroupState::kIdle) start(g, true);
  }
}

void OptimizerSwapper::visit(const Visitor& fn, bool read, bool write) {
  TS_INTERNAL_ASSERT(file_, "OptimizerSwapper::visit before open");
  ++visits_;
  const size_t G = groups_.size();
  std::vector<float*> state(kinds_.size());
  size_t ahead = 0;  // read-ahead never looks behind this
  try {
    reclaim_written();
    for (size_t g = 0; g < G; ++g) {
      while (state_[g] == GroupState::kWriting) retire_oldest_write();  // last step's write of it
      if (state_[g] == GroupState::kIdle) start(g, read);
      // Read ahead into buffers that are free now (never waiting for a write to do so).
      if (options_.pipeline_read()) {
        for (ahead = std::max(ahead, g + 1); ahead < G && !free_.empty(); ++ahead) {
          if (state_[ahead] == GroupState::kWriting) break;
          if (state_[ahead] == GroupState::kIdle) start(ahead, read);
        }
      }
      if (read_ticket_[g]) {  // also a prefetch this visit does not need: the buffer is about to change
        file_->wait(read_ticket_[g]);
        read_ticket_[g] = 0;
      }
      const Group& gr = groups_[g];
      char* base = static_cast<char*>(buffers_[static_cast<size_t>(buf_of_[g])].data());
      for (size_t i = gr.first_piece; i < gr.end_piece; ++i) {
        const int64_t at = pieces_[i].begin - gr.begin;
        for (size_t k = 0; k < kinds_.size(); ++k)
          state[k] = reinterpret_cast<float*>(base + static_cast<int64_t>(k) * gr.padded_bytes) + at;
        fn(i, state.data());
      }
      if (write) {
        write_ticket_[g] = file_->write(gr.file_offset, base, gr.padded_bytes * static_cast<int64_t>(kinds_.size()));
        state_[g] = GroupState::kWriting;
        writing_.push_back(g);
        if (!options_.pipeline_write()) {
          while (state_[g] == GroupState::kWriting) retire_oldest_write();
        }
      } else {
        free_.push_back(buf_of_[g]);
        buf_of_[g] = -1;
        state_[g] = GroupState::kIdle;
      }
    }
    // With pipeline_write the last groups' writes complete behind the next forward and
    // backward; the next visit (or a read of the group) waits for them.
  } catch (...) {
    try {
      file_->wait_all();  // no transfer may still target our buffers
    } catch (...) {
    }
    throw;
  }
}

int64_t OptimizerSwapper::resident_bytes() const {
  int64_t n = 0;
  for (const auto& b : buffers_) n += static_cast<int64_t>(b.size());
  return n;
}

int64_t OptimizerSwapper::offloaded_bytes() const { return file_ ? file_->size() : 0; }

std::string OptimizerSwapper::describe() const {
  return concat("nvme:", options_.path(), " (", file_ ? file_->describe() : std::string("not open"), "; ",
                buffers_.size(), " buffers of ", buffers_.empty() ? 0 : buffers_[0].size(), " B",
                options_.pipeline_read() ? ", read ahead" : "", options_.pipeline_write() ? ", write behind" : "", ")");
}

SwapStats OptimizerSwapper::stats() const {
  SwapStats s;
  if (file_) {
    s.bytes_read = file_->bytes_read();
    s.bytes_written = file_->bytes_written();
    s.wait_s = file_->wait_seconds();
  }
  s.visits = visits_;
  return s;
}

}  // namespace torchspeed::offload
