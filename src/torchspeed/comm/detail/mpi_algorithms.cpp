// The algorithms behind each collective of the MPI backend, as Tasks for the progress engine.
//
// Note [Direct algorithms]
// all_reduce, reduce_scatter and all_gather do not call MPI's collectives. Measured here
// (2 ranks, OpenMPI 4.1, shared memory with CMA): MPI_Iallreduce (libnbc) takes 2x the time of
// blocking MPI_Allreduce at 1-64 MiB, and blocking MPI_Allreduce falls from ~4.8 GB/s at 16 MiB
// to ~1.9 GB/s at 64 MiB once its passes leave the caches; a blocking MPI call also cannot be
// polled, so it could not honour a deadline. The direct algorithm splits the tensor into chunks
// of chunk_bytes with several in flight; within chunk k rank r receives every rank's piece of
// segment r, reduces them in rank order (fp32 accumulation for bf16/fp16, rounded once: see
// reduce_kernels.cpp), and sends the result to every rank. Each rank moves 2(p-1)/p of the
// tensor, as a ring does, in p-1 concurrent messages per phase, 16-bit dtypes at half the
// bytes; every rank gets the same bits.
// Measured with torchspeed bench comm (all_reduce fp32 / raw MPI_Allreduce, 2 ranks on a
// 2-core Zen 4 VM, 2-7 runs each; at 1 / 4 / 16 / 64 MiB):
// - Chunk size. 512 KiB: 0.97 / 0.91 at 1 / 4 MiB; 1 MiB: 0.99 / 0.97 / 1.3 / 2.3; 2 MiB:
//   0.99 / 1.01 / 1.0 / 2.1. With CMA the receiving core copies every byte itself, so
//   pipelining hides only latency (a chunk's copies and its reduction run on the same core):
//   smaller chunks add message rounds, and with 2 MiB chunks a rank's 1 MiB segment fills the
//   1 MiB L2, so received data leaves the cache before it is reduced. Hence 1 MiB chunks at
//   every size (the default).
// - all_gather over TCP between hosts (2 hosts x 2 ranks, the link shaped to 1 Gbit/s with tc
//   tbf, 340 MB gathered in 1-5 collectives): each piece as one message took 1.3-1.9x the
//   link's time, varying from call to call (2.8-5.1 s flat, 1.6-2.9 s staged); in 4 MiB chunks,
//   4 in flight, 1.08x flat (2.94-2.97 s) and 1.35x staged, steady. A whole piece is pushed
//   as fast as the sockets take it and overflows the shaped queue. Hence whole pieces within a
//   host and 4 MiB chunks in a group spanning hosts (AlgoContext::gather_chunk_bytes).
// - Alignment. Receive pieces in page-aligned scratch and segments starting on 64-byte
//   boundaries keep the reduction's vector loads within cache lines (on malloc's 16-byte
//   alignment the kernel took up to 1.5x as long): medians 0.95 -> 1.00 at 1 MiB, 0.94 -> 1.11
//   at 4 MiB.
#include "torchspeed/comm/detail/mpi_algorithms.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>

#include "torchspeed/comm/detail/reduce_kernels.h"
#include "torchspeed/base/error.h"

namespace torchspeed::comm::detail {

MPI_Datatype mpi_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;  // moved as bits; reduced by our kernels
    default: TS_INTERNAL_ASSERT(false, "no MPI datatype for ", t);
  }
}

void check_mpi(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw CommError(concat(what, ": MPI error: ", std::string(msg, len)));
}

void ScratchPool::Free::operator()(char* p) const { std::free(p); }

char* ScratchPool::get(size_t slot, size_t bytes) {
  if (slot >= bufs_.size()) bufs_.resize(slot + 1);
  auto& b = bufs_[slot];
  if (b.size < bytes) {
    constexpr size_t kAlign = 4096;
    const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
    b.data.reset(static_cast<char*>(std::aligned_alloc(kAlign, size)));
    TS_CHECK(b.data, "communication scratch: cannot allocate ", size, " bytes");
    b.size = size;
  }
  return b.data.get();
}

namespace {

char* ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// A task over MPI requests.
class MpiTask : public Task {
 public:
  using Task::Task;

 protected:
  // Tests a set of requests; true when all completed.
  bool test_all(std::vector<MPI_Request>& reqs) {
    if (reqs.empty()) return true;
    int done = 0;
    check_mpi(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE),
              what_);
    return done != 0;
  }
  bool test_one(MPI_Request& req) {
    int done = 0;
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what_);
    return done != 0;
  }
};

// Work without communication (empty tensors, groups of one), run when the op's turn comes.
class LocalTask : public Task {
 public:
  LocalTask(OpDesc what, std::vector<at::Tensor> tensors, std::function<void()> fn)
      : Task(std::move(what), std::move(tensors)), fn_(std::move(fn)) {}
  void start() override {
    if (fn_) fn_();
  }
  bool poll() override { return true; }

 private:
  std::function<void()> fn_;
};

// Splits [0, n) into chunks of at most `chunk` elements.
struct Chunks {
  int64_t n, chunk;
  int64_t count() const { return n == 0 ? 0 : (n + chunk - 1) / chunk; }
  int64_t begin(int64_t k) const { return k * chunk; }
  int64_t size(int64_t k) const { return std::min(chunk, n - k * chunk); }
};

int64_t chunk_elems(int64_t chunk_bytes, int64_t elem_size, int64_t divisor = 1) {
  int64_t bytes = std::clamp<int64_t>(chunk_bytes, 4096, int64_t{1} << 30);
  return std::max<int64_t>(1, bytes / elem_size / divisor);
}

// A sequence of independent single-request MPI ops over chunks, at most `inflight` at once,
// issued in chunk order (broadcast, barrier).
class ChunkedTask : public MpiTask {
 public:
  using Issue = std::function<int(int64_t k, MPI_Request* req)>;
  ChunkedTask(OpDesc what, std::vector<at::Tensor> tensors, int64_t chunks, int inflight,
              Issue issue)
      : MpiTask(std::move(what), std::move(tensors)), chunks_(chunks),
        inflight_(std::max(1, inflight)), issue_(std::move(issue)) {}

  void start() override { fill(); }
  bool poll() override {
    while (!active_.empty() && test_one(active_.front())) {
      active_.pop_front();
      made_progress();
      fill();
    }
    return active_.empty() && next_ == chunks_;
  }

 private:
  void fill() {
    while (next_ < chunks_ && static_cast<int>(active_.size()) < inflight_) {
      MPI_Request req;
      check_mpi(issue_(next_++, &req), what_);
      active_.push_back(req);
    }
  }
  int64_t chunks_;
  int inflight_;
  Issue issue_;
  int64_t next_ = 0;
  std::deque<MPI_Request> active_;
};

// Where each rank's piece of chunk k lies, for DirectReduceTask. Element offsets into `src`.
struct ReduceLayout {
  enum class Kind {
    kWhole,     // every rank reduces the whole chunk (one-phase all_reduce)
    kSegments,  // chunk k is split into p near-equal segments; rank j reduces segment j
    kBlocks,    // src holds p blocks of n elements; rank j reduces chunk k of block j
  };
  Kind kind;
  Chunks ch;  // over the tensor (kWhole, kSegments) or over one block (kBlocks)
  int p;
  int64_t align = 1;  // elements per 64 bytes
  int64_t block_stride = 0;  // kBlocks: elements from block j to block j + 1 (0: ch.n)

  int64_t seg_begin(int64_t k, int j) const {
    switch (kind) {
      case Kind::kWhole: return ch.begin(k);
      case Kind::kSegments: return ch.begin(k) + std::min(j * seg_stride(k), ch.size(k));
      case Kind::kBlocks: return j * (block_stride > 0 ? block_stride : ch.n) + ch.begin(k);
    }
    return 0;
  }
  int64_t seg_size(int64_t k, int j) const {
    if (kind != Kind::kSegments) return ch.size(k);
    const int64_t m = ch.size(k), b = std::min(j * seg_stride(k), m);
    return std::min(seg_stride(k), m - b);
  }
  // kSegments: segments of ceil(m / p) elements rounded up to 64 bytes (`align` elements), so
  // that each starts where the chunk's alignment allows vector loads within cache lines; the
  // last one takes what is left.
  int64_t seg_stride(int64_t k) const {
    const int64_t q = (ch.size(k) + p - 1) / p;
    return (q + align - 1) / align * align;
  }
  // Where rank `me`'s result for chunk k goes: an offset into dst.
  int64_t dst_offset(int64_t k, int me) const {
    return kind == Kind::kSegments ? seg_begin(k, me) : ch.begin(k);
  }
};

// The direct reduce-scatter (+ optional all-gather) of Note [Direct algorithms], over chunks,
// point-to-point on the communicator's private duplicate. Rank me reduces its segment of chunk
// k into dst + dst_offset(k). With `gather`, the reduced segment is then sent to every rank and
// stored at the same place in `src` (all-reduce, in place: then dst == src).
class DirectReduceTask : public MpiTask {
 public:
  DirectReduceTask(OpDesc what, std::vector<at::Tensor> tensors, const AlgoContext& c,
                   at::ScalarType dtype, ReduceOp op, char* src, char* dst, ReduceLayout layout,
                   bool gather)
      : MpiTask(std::move(what), std::move(tensors)), scratch_(c.scratch), comm_(c.p2p),
        me_(c.rank), p_(c.size), dtype_(dtype), dt_(mpi_dtype(dtype)), op_(op),
        esize_(static_cast<int64_t>(c10::elementSize(dtype))), src_(src), dst_(dst),
        chunks_(layout.ch.count()), inflight_(std::max(1, c.chunks_in_flight)), layout_(layout),
        gather_(gather) {}

  void start() override { fill(); }

  bool poll() override {
    // Scatter phases complete in chunk order (we test the oldest); gathers are tested as a set.
    while (!scatter_.empty() && test_all(scatter_.front().reqs)) {
      Slot s = std::move(scatter_.front());
      scatter_.pop_front();
      made_progress();
      reduce(s);
      fill();
    }
    for (auto it = gathers_.begin(); it != gathers_.end();) {
      if (test_all(*it)) {
        it = gathers_.erase(it);
        made_progress();
      } else {
        ++it;
      }
    }
    return scatter_.empty() && gathers_.empty() && next_ == chunks_;
  }

 private:
  struct Slot {
    int64_t k;
    std::vector<MPI_Request> reqs;
    char* temp;  // p pieces of this rank's segment (own piece unused)
  };

  int tag(int64_t k, int phase) const { return static_cast<int>((2 * k + phase) & 0x3FFFFFFF); }
  // Bytes between the pieces of a slot: 64-byte aligned, see ScratchPool.
  int64_t piece_stride(int64_t elems) const { return (elems * esize_ + 63) / 64 * 64; }

  void fill() {
    while (next_ < chunks_ && static_cast<int>(scatter_.size()) < inflight_) {
      Slot s;
      s.k = next_++;
      const int64_t mine = layout_.seg_size(s.k, me_);
      // Chunk k uses slot k % inflight: at most `inflight` chunks are in their scatter phase.
      s.temp = scratch_->get(static_cast<size_t>(s.k % inflight_),
                             static_cast<size_t>(p_ * piece_stride(mine)));
      s.reqs.reserve(static_cast<size_t>(2 * (p_ - 1)));
      for (int j = 0; j < p_; ++j) {
        if (j == me_) continue;
        MPI_Request r;
        if (mine > 0) {
          check_mpi(MPI_Irecv(s.temp + j * piece_stride(mine), static_cast<int>(mine), dt_, j,
                              tag(s.k, 0), comm_, &r), what_);
          s.reqs.push_back(r);
        }
        const int64_t theirs = layout_.seg_size(s.k, j);
        if (theirs > 0) {
          check_mpi(MPI_Isend(src_ + layout_.seg_begin(s.k, j) * esize_, static_cast<int>(theirs),
                              dt_, j, tag(s.k, 0), comm_, &r), what_);
          s.reqs.push_back(r);
        }
      }
      scatter_.push_back(std::move(s));
    }
  }

  void reduce(Slot& s) {
    const int64_t mine = layout_.seg_size(s.k, me_);
    char* own = src_ + layout_.seg_begin(s.k, me_) * esize_;
    char* out = dst_ + layout_.dst_offset(s.k, me_) * esize_;
    if (mine > 0) {
      pieces_.resize(static_cast<size_t>(p_));
      for (int j = 0; j < p_; ++j) pieces_[j] = j == me_ ? own : s.temp + j * piece_stride(mine);
      detail::reduce_pieces(dtype_, op_, pieces_.data(), p_, mine, out);
    }
    if (!gather_) return;
    std::vector<MPI_Request> reqs;
    reqs.reserve(static_cast<size_t>(2 * (p_ - 1)));
    for (int j = 0; j < p_; ++j) {
      if (j == me_) continue;
      MPI_Request r;
      if (mine > 0) {
        check_mpi(MPI_Isend(out, static_cast<int>(mine), dt_, j, tag(s.k, 1), comm_, &r), what_);
        reqs.push_back(r);
      }
      const int64_t theirs = layout_.seg_size(s.k, j);
      if (theirs > 0) {
        check_mpi(MPI_Irecv(src_ + layout_.seg_begin(s.k, j) * esize_, static_cast<int>(theirs),
                            dt_, j, tag(s.k, 1), comm_, &r), what_);
        reqs.push_back(r);
      }
    }
    if (!reqs.empty()) gathers_.push_back(std::move(reqs));
  }

  std::shared_ptr<ScratchPool> scratch_;
  MPI_Comm comm_;
  int me_, p_;
  at::ScalarType dtype_;
  MPI_Datatype dt_;
  ReduceOp op_;
  int64_t esize_;
  char* src_;  // points into an owned tensor
  char* dst_;
  int64_t chunks_;
  int inflight_;
  ReduceLayout layout_;
  bool gather_;
  int64_t next_ = 0;
  std::deque<Slot> scatter_;
  std::vector<std::vector<MPI_Request>> gathers_;
  std::vector<const void*> pieces_;
};

// Point-to-point gather of chunks: each rank sends its piece's chunk k to every rank and
// receives theirs at out + j * n + k * c.
class DirectGatherTask : public MpiTask {
 public:
  DirectGatherTask(OpDesc what, std::vector<at::Tensor> tensors, const AlgoContext& c,
                   MPI_Datatype dt, int64_t esize, const char* in, char* out, int64_t n,
                   int64_t stride, int64_t chunk)
      : MpiTask(std::move(what), std::move(tensors)), comm_(c.p2p), me_(c.rank), p_(c.size),
        dt_(dt), esize_(esize), in_(in), out_(out), stride_(stride), chunks_{n, chunk},
        inflight_(std::max(1, c.chunks_in_flight)) {}
  void start() override {
    fill();
    // The local copy overlaps the transfers just issued.
    if (out_ + me_ * stride_ * esize_ != in_) {
      std::memcpy(out_ + me_ * stride_ * esize_, in_, static_cast<size_t>(chunks_.n * esize_));
    }
  }
  bool poll() override {
    while (!active_.empty() && test_all(active_.front())) {
      active_.pop_front();
      made_progress();
      fill();
    }
    return active_.empty() && next_ == chunks_.count();
  }

 private:
  void fill() {
    while (next_ < chunks_.count() && static_cast<int>(active_.size()) < inflight_) {
      const int64_t k = next_++;
      const int64_t b = chunks_.begin(k), m = chunks_.size(k);
      const int t = static_cast<int>(k & 0x3FFFFFFF);
      std::vector<MPI_Request> reqs;
      reqs.reserve(static_cast<size_t>(2 * (p_ - 1)));
      for (int j = 0; j < p_; ++j) {
        if (j == me_) continue;
        MPI_Request r;
        check_mpi(MPI_Irecv(out_ + (j * stride_ + b) * esize_, static_cast<int>(m), dt_, j, t,
                            comm_, &r), what_);
        reqs.push_back(r);
        check_mpi(MPI_Isend(in_ + b * esize_, static_cast<int>(m), dt_, j, t, comm_, &r), what_);
        reqs.push_back(r);
      }
      active_.push_back(std::move(reqs));
    }
  }
  MPI_Comm comm_;
  int me_, p_;
  MPI_Datatype dt_;
  int64_t esize_;
  const char* in_;  // points into an owned tensor
  char* out_;
  int64_t stride_;  // elements from rank j's block of out_ to rank j + 1's
  Chunks chunks_;
  int inflight_;
  int64_t next_ = 0;
  std::deque<std::vector<MPI_Request>> active_;
};

}  // namespace

std::unique_ptr<Task> make_all_reduce(const AlgoContext& c, OpDesc what, const at::Tensor& t,
                                      ReduceOp op) {
  const int64_t n = t.numel();
  const at::ScalarType st = t.scalar_type();
  if (n == 0 || c.size == 1) {
    std::function<void()> fn;
    if (op == ReduceOp::kAvg && c.size > 1) {
      fn = [t, st, n, p = c.size] { detail::divide_inplace(st, t.data_ptr(), n, p); };
    }
    return std::make_unique<LocalTask>(std::move(what), std::vector<at::Tensor>{t}, std::move(fn));
  }
  const int64_t es = t.element_size();
  // See Note [Direct algorithms] for the chunk size.
  const Chunks ch{n, chunk_elems(c.chunk_bytes, es)};
  char* base = ptr(t);
  // Small: every rank sends its whole tensor to every peer and reduces all p copies in rank
  // order (one message round instead of two; the same bits on every rank).
  const bool one_phase = n * es * (c.size - 1) <= c.one_phase_bytes;
  const ReduceLayout layout{one_phase ? ReduceLayout::Kind::kWhole : ReduceLayout::Kind::kSegments,
                            ch, c.size, std::max<int64_t>(1, 64 / es)};
  return std::make_unique<DirectReduceTask>(std::move(what), std::vector<at::Tensor>{t}, c, st, op,
                                            base, base, layout, /*gather=*/!one_phase);
}

std::unique_ptr<Task> make_reduce_scatter(const AlgoContext& c, OpDesc what, const at::Tensor& in,
                                          const at::Tensor& out, ReduceOp op) {
  const int64_t n = out.numel();  // elements per rank
  return make_reduce_scatter_blocks(c, std::move(what), {in, out}, in.scalar_type(), ptr(in), ptr(out), n, n, op);
}

std::unique_ptr<Task> make_reduce_scatter_blocks(const AlgoContext& c, OpDesc what, std::vector<at::Tensor> keep,
                                                 at::ScalarType dtype, char* in, char* out, int64_t n,
                                                 int64_t stride, ReduceOp op) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  if (n == 0 || c.size == 1) {
    std::function<void()> fn;
    if (n > 0) {
      fn = [in, out, n, es] {
        if (in != out) std::memmove(out, in, static_cast<size_t>(n * es));
      };
    }
    return std::make_unique<LocalTask>(std::move(what), std::move(keep), std::move(fn));
  }
  ReduceLayout layout{ReduceLayout::Kind::kBlocks, Chunks{n, chunk_elems(c.chunk_bytes, es, c.size)}, c.size};
  layout.block_stride = stride;
  return std::make_unique<DirectReduceTask>(std::move(what), std::move(keep), c, dtype, op, in, out, layout,
                                            /*gather=*/false);
}

std::unique_ptr<Task> make_all_gather(const AlgoContext& c, OpDesc what, const at::Tensor& in,
                                      const at::Tensor& out) {
  const int64_t n = in.numel();
  return make_all_gather_blocks(c, std::move(what), {in, out}, in.scalar_type(), ptr(in), ptr(out), n, n);
}

std::unique_ptr<Task> make_all_gather_blocks(const AlgoContext& c, OpDesc what, std::vector<at::Tensor> keep,
                                             at::ScalarType dtype, const char* in, char* out, int64_t n,
                                             int64_t stride) {
  if (n == 0) return std::make_unique<LocalTask>(std::move(what), std::move(keep), nullptr);
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  // Within a host nothing overlaps a transfer: one message per peer (as MPI's own algorithm for
  // shared memory) beat 1 MiB chunks by ~1.3x; pieces over 2^30 elements are still split.
  // Across hosts, chunks (see Note [Direct algorithms]).
  const int64_t chunk = std::clamp<int64_t>(std::min<int64_t>(c.gather_chunk_bytes / es, int64_t{1} << 30), 1, n);
  return std::make_unique<DirectGatherTask>(std::move(what), std::move(keep), c, mpi_dtype(dtype), es, in, out, n,
                                            stride, chunk);
}

std::unique_ptr<Task> make_broadcast(const AlgoContext& c, OpDesc what, const at::Tensor& t,
                                     int root) {
  const int64_t es = t.element_size();
  const Chunks ch{t.numel(), chunk_elems(c.chunk_bytes, es)};
  char* base = ptr(t);
  const MPI_Datatype dt = mpi_dtype(t.scalar_type());
  const MPI_Comm comm = c.coll;
  auto issue = [=](int64_t k, MPI_Request* r) {
    return MPI_Ibcast(base + ch.begin(k) * es, static_cast<int>(ch.size(k)), dt, root, comm, r);
  };
  return std::make_unique<ChunkedTask>(std::move(what), std::vector<at::Tensor>{t}, ch.count(),
                                       c.chunks_in_flight, issue);
}

std::unique_ptr<Task> make_barrier(const AlgoContext& c, OpDesc what) {
  const MPI_Comm comm = c.coll;
  auto issue = [comm](int64_t, MPI_Request* r) { return MPI_Ibarrier(comm, r); };
  return std::make_unique<ChunkedTask>(std::move(what), std::vector<at::Tensor>{}, 1, 1, issue);
}

}  // namespace torchspeed::comm::detail
