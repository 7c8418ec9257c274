// Note [Optimizer swapping]
// With offload_optimizer.device "nvme" a rank's optimizer partition (the fp32 masters where
// they are a separate copy, and the moments) lives in one preallocated swap file. The step's
// pieces (Note [Step pieces] in zero/) are coalesced into groups of at most sub_group_size
// elements; a group's record is each kind's elements back to back, each padded to the
// direct-I/O alignment, so one group is one contiguous transfer. The step streams the groups
// through buffer_count aligned buffers, each one record: with pipeline_read, group i+1 is read
// while group i is updated; with pipeline_write, group i's write runs behind while the next
// groups are updated, and its buffer returns to the pool when the write completes. The pool is
// the only RAM the optimizer state costs: buffer_count x the largest record.
//
// Nothing is cached between steps, so the state on disk is the state: a checkpoint export reads
// it, an import writes it, and a resumed run reads exactly what the previous one wrote.
#include "torchspeed/offload/optimizer_swapper.h"

#include <algorithm>
#include <deque>

#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/logging.h"

namespace torchspeed::offload {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

OptimizerSwapper::OptimizerSwapper(SwapperOptions options) : options_(std::move(options)) {
  TS_CHECK(options_.buffer_count() >= 2, "zero_optimization.offload_optimizer.buffer_count must be at least 2 "
           "(one buffer being updated, one being read or written), got ", options_.buffer_count());
  TS_CHECK(options_.group_numel() > 0, "zero_optimization.sub_group_size must be positive");
}

OptimizerSwapper::~OptimizerSwapper() = default;

void OptimizerSwapper::open(std::vector<std::string> kinds, int64_t part_numel, std::vector<zero::PieceRange> pieces) {
  kinds_ = std::move(kinds);
  pieces_ = std::move(pieces);
  const size_t dir_end = options_.path().find_last_of('/');
  const DirectIoAlignment align = direct_io_alignment(dir_end == std::string::npos ? "." : options_.path().substr(0, dir_end));
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
    g.padded_bytes = round_up(g.numel * static_cast<int64_t>(sizeof(float)), a);
    g.file_offset = offset;
    const int64_t record = g.padded_bytes * static_cast<int64_t>(kinds_.size());
    offset += record;
    largest = std::max(largest, record);
  }
  file_ = std::make_unique<SwapFile>(options_.path(), std::max(offset, a), options_.aio());
  buffers_.clear();
  const size_t n = std::min<size_t>(static_cast<size_t>(options_.buffer_count()), std::max<size_t>(groups_.size(), 1));
  for (size_t i = 0; i < n; ++i) buffers_.emplace_back(static_cast<size_t>(largest), align.memory);
  log::debug("offload: optimizer state of ", part_numel, " elements x ", kinds_.size(), " in ", groups_.size(),
             " groups, ", describe());
}

void OptimizerSwapper::visit(const Visitor& fn, bool read, bool write) {
  TS_INTERNAL_ASSERT(file_, "OptimizerSwapper::visit before open");
  ++visits_;
  const size_t G = groups_.size();
  std::vector<int> buf_of(G, -1);
  std::vector<SwapFile::Ticket> rt(G, 0), wt(G, 0);
  std::deque<int> free_bufs;
  for (int b = 0; b < static_cast<int>(buffers_.size()); ++b) free_bufs.push_back(b);
  std::deque<size_t> writing;  // groups whose write is in flight, oldest first
  auto retire_oldest_write = [&] {
    const size_t g = writing.front();
    writing.pop_front();
    file_->wait(wt[g]);
    free_bufs.push_back(buf_of[g]);
  };
  auto start = [&](size_t g) {
    if (free_bufs.empty()) retire_oldest_write();
    buf_of[g] = free_bufs.front();
    free_bufs.pop_front();
    if (read) rt[g] = file_->read(groups_[g].file_offset, buffers_[static_cast<size_t>(buf_of[g])].data(),
                                  groups_[g].padded_bytes * static_cast<int64_t>(kinds_.size()));
  };
  std::vector<float*> state(kinds_.size());
  size_t next = 0;  // the next group to start
  try {
    for (size_t g = 0; g < G; ++g) {
      if (next == g) start(next++);
      // Read ahead into buffers that are free now (never waiting for a write to do so).
      if (options_.pipeline_read()) {
        while (next < G && !free_bufs.empty()) start(next++);
      }
      if (read) file_->wait(rt[g]);
      const Group& gr = groups_[g];
      char* base = static_cast<char*>(buffers_[static_cast<size_t>(buf_of[g])].data());
      for (size_t i = gr.first_piece; i < gr.end_piece; ++i) {
        const int64_t at = pieces_[i].begin - gr.begin;
        for (size_t k = 0; k < kinds_.size(); ++k)
          state[k] = reinterpret_cast<float*>(base + static_cast<int64_t>(k) * gr.padded_bytes) + at;
        fn(i, state.data());
      }
      if (write) {
        wt[g] = file_->write(gr.file_offset, base, gr.padded_bytes * static_cast<int64_t>(kinds_.size()));
        writing.push_back(g);
        if (!options_.pipeline_write()) retire_oldest_write();
      } else {
        free_bufs.push_back(buf_of[g]);
      }
    }
    while (!writing.empty()) retire_oldest_write();
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

AioOptions aio_options_of(const config::Config& c) {
  AioOptions o;
  o.block_size(c.aio.block_size)
      .queue_depth(static_cast<int>(c.aio.queue_depth))
      .single_submit(c.aio.single_submit)
      .overlap_events(c.aio.overlap_events);
  return o;
}

zero::PartitionStorePtr make_optimizer_store(const config::Config& c, int global_rank) {
  const auto& o = c.zero.offload_optimizer;
  if (o.device != "nvme") return nullptr;
  SwapperOptions so;
  so.path(concat(o.nvme_path, "/torchspeed-optimizer-rank", global_rank, ".swap"))
      .buffer_count(o.buffer_count)
      .group_numel(c.zero.sub_group_size)
      .pipeline_read(o.pipeline_read)
      .pipeline_write(o.pipeline_write)
      .aio(aio_options_of(c));
  return std::make_shared<OptimizerSwapper>(so);
}

}  // namespace torchspeed::offload
