// The MPI backend of Communicator: owns the MPI communicators (its own and a private duplicate
// for the point-to-point algorithms), wires each collective to its algorithm
// (detail/mpi_algorithms.h) on the FIFO progress engine (detail/progress.h), and runs
// point-to-point transfers, whose Work polls its own request. See Note [Collective execution
// order] and Note [Deadlines and failure] in detail/progress.cpp.
#include <mpi.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/comm/detail/mpi_algorithms.h"
#include "torchspeed/comm/detail/mpi_handles.h"
#include "torchspeed/comm/detail/progress.h"
#include "torchspeed/base/error.h"
#include "torchspeed/comm/runtime.h"

namespace torchspeed::comm {
namespace {

using detail::check_mpi;
using detail::Clock;
using detail::FailureState;
using detail::OpDesc;

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Note [Hierarchical collectives]
// When a group spans several hosts with the same number L > 1 of its ranks on each, consecutive
// in group-rank order (host-major, as a hostfile places them), its all_reduce, reduce_scatter
// and all_gather run in stages so that the link between hosts carries the least: over H hosts,
// - reduce_scatter of P = H x L chunks c, chunk (h, l) for group rank h L + l: for each h, a
//   reduce_scatter within the host of block h (chunks (h, 0..L-1), contiguous) gives local rank
//   l the host's sum of chunk (h, l); then a reduce_scatter among the ranks of local index l
//   (one per host) of those H sums gives chunk (h, l) summed over every host. No copies. Each rank
//   sends (H-1) c across hosts, against L (H-1) c flat (every off-host peer gets its chunk):
//   the host's link carries (H-1)/H of the input instead of L (H-1)/H.
// - all_gather: the mirror, across hosts first (among local index l), then for each h within the
//   host, straight into block h of the output.
// - all_reduce: reduce_scatter within the host, all_reduce of the 1/L part across hosts, then
//   all_gather within the host: 2 (H-1)/H of the tensor per host link, against 2 L (H-1)/H.
// The stages run as one task of the communicator's FIFO engine (one deadline, the op's), on
// private MPI communicators of the host and of the local index; reduce_scatter's and
// all_gather's two stages are pipelined (Note [Pipelined stages]). Sums add in another order
// than flat (hosts' partial sums first), so fp32 results may differ in the last bits; every
// rank still gets the same bits. bf16/fp16 reductions keep the flat algorithm (its one rounding;
// all_gather, which adds nothing, is staged for every dtype), as do ops small enough for the
// one-phase all_reduce (latency, not bytes, is their cost).
// TORCHSPEED_COMM_HIERARCHICAL=0 turns the stages off (to compare); TORCHSPEED_COMM_HOST_SIZE=N
// treats each N consecutive world ranks as one host (tests on one machine).

// Runs sub-tasks (and local steps between them) one after the other, as one task.
class StagedTask final : public detail::Task {
 public:
  struct Stage {
    std::function<std::unique_ptr<detail::Task>()> task;  // or null: a local step only
    std::function<void()> after;                          // or null
  };
  StagedTask(OpDesc what, std::vector<at::Tensor> tensors, std::vector<Stage> stages)
      : Task(std::move(what), std::move(tensors)), stages_(std::move(stages)) {}
  void start() override { next(); }
  bool poll() override {
    while (cur_) {
      const uint64_t before = cur_->progress();
      const bool done = cur_->poll();
      if (cur_->progress() != before) made_progress();
      if (!done) return false;
      if (stages_[i_].after) stages_[i_].after();
      cur_.reset();
      ++i_;
      made_progress();
      next();
    }
    return i_ >= stages_.size();
  }

 private:
  void next() {
    while (i_ < stages_.size() && !cur_) {
      if (stages_[i_].task) {
        cur_ = stages_[i_].task();
        cur_->start();
      } else {
        if (stages_[i_].after) stages_[i_].after();
        ++i_;
      }
    }
  }
  std::vector<Stage> stages_;
  size_t i_ = 0;
  std::unique_ptr<detail::Task> cur_;
};

// Note [Pipelined stages]
// A staged reduce_scatter or all_gather (Note [Hierarchical collectives]) has one stage within
// the host and one across hosts, on different communicators. Run one after the other, the link
// idles while the host's stage runs. So the columns [0, c) of the per-rank chunk are cut into
// segments of segment_bytes (CommOptions), each segment goes through the stages in order, and a
// stage works on segment s while the next works on segment s - 1. A stage's ops run one after
// the other on its communicator, in the same order on every rank, so messages match as in the
// FIFO engine; the two stages never share a communicator. Segment [a, a + m) of block j starts
// at j c + a, so the stages run the direct algorithms over strided blocks (make_*_blocks).
// Measured (agbench-style: 85M fp32 elements in 5 collectives, 2 hosts x 2 ranks, link shaped to
// 1 Gbit/s, so 1.36 s on the link alone; 3 runs each):
//   stages in sequence                 reduce_scatter 1.81-1.93 s, all_gather 1.80-1.92 s
//   pipelined, 1 MiB segments          1.67-1.74 s, 1.61-1.77 s
//   4 MiB / 16 MiB segments            1.64-1.71 s, 1.93-2.15 s / 1.82-1.88 s, 1.83-1.85 s
//   one rank per host (no host stage)  1.66-1.84 s, 1.88-2.16 s
// With 1 MiB segments the host's stage costs nothing measurable: what is left above 1.36 s is
// TCP through the shaped queue, as for a single flow per host.
class PipelinedTask final : public detail::Task {
 public:
  struct Stage {
    // The stage's ops on columns [begin, begin + len), op `item` of `items`, run in order.
    std::function<std::unique_ptr<detail::Task>(int64_t begin, int64_t len, int64_t item)> make;
    int64_t items = 1;
  };
  PipelinedTask(OpDesc what, std::vector<at::Tensor> tensors, std::vector<Stage> stages, int64_t columns,
                int64_t segment, std::function<void()> after)
      : Task(std::move(what), std::move(tensors)), stages_(std::move(stages)), lanes_(stages_.size()),
        columns_(columns), segment_(std::max<int64_t>(1, segment)), after_(std::move(after)) {}
  void start() override { advance(); }
  bool poll() override { return advance(); }

 private:
  struct Lane {
    int64_t seg = 0, item = 0;  // the segment being worked on (segments() when done) and its op
    std::unique_ptr<detail::Task> cur;
  };
  int64_t segments() const { return (columns_ + segment_ - 1) / segment_; }
  bool advance() {
    const int64_t n = segments();
    for (size_t i = 0; i < lanes_.size(); ++i) {
      Lane& l = lanes_[i];
      while (l.seg < n) {
        if (!l.cur) {
          if (i > 0 && lanes_[i - 1].seg <= l.seg) break;  // the previous stage has not done it yet
          const int64_t b = l.seg * segment_;
          l.cur = stages_[i].make(b, std::min(segment_, columns_ - b), l.item);
          l.cur->start();
        }
        const uint64_t before = l.cur->progress();
        const bool done = l.cur->poll();
        if (l.cur->progress() != before) made_progress();
        if (!done) break;
        l.cur.reset();
        made_progress();
        if (++l.item == stages_[i].items) {
          l.item = 0;
          ++l.seg;
        }
      }
    }
    if (lanes_.back().seg < n) return false;
    if (after_) std::exchange(after_, nullptr)();
    return true;
  }
  std::vector<Stage> stages_;
  std::vector<Lane> lanes_;
  const int64_t columns_, segment_;
  std::function<void()> after_;
};

// Columns per segment of Note [Pipelined stages]: segment_bytes, a multiple of 64 bytes.
int64_t pipeline_segment(const detail::AlgoContext& c, int64_t elem_size) {
  return std::max<int64_t>(64, c.segment_bytes) / 64 * 64 / elem_size;
}

// See Note [Direct algorithms].
constexpr int64_t kCrossHostGatherBytes = int64_t{4} << 20;

bool hierarchical_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kInt || t == at::kLong;
}

// Point-to-point requests whose Work was dropped before they completed. MPI may still read or
// write their tensors, so they are kept here until MPI is done with them: tested on every new
// transfer, and waited for (each until its deadline) before the communicator is freed.
class PendingRequests {
 public:
  struct Pending {
    OpDesc what;
    MPI_Request req;
    at::Tensor tensor;
    Clock::time_point deadline;
  };
  void adopt(Pending p) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(p));
  }
  void poll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      int done = 0;
      const int rc = MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
      it = (rc != MPI_SUCCESS || done) ? pending_.erase(it) : std::next(it);
    }
  }
  // Waits for each until its deadline (or gives them up with `abandon`); what does not
  // complete breaks the communicator and is kept forever.
  void drain(FailureState& state, std::chrono::milliseconds timeout, bool abandon) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : pending_) {
      int done = 0, spins = 0;
      while (!abandon && !state.broken() &&
             MPI_Test(&p.req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done &&
             Clock::now() < p.deadline) {
        detail::relax(spins, detail::PollPolicy().thread_spins);
      }
      if (!done) {
        if (!abandon && !state.broken()) state.mark_broken(state.timeout_message(p.what, timeout));
        detail::keep_forever(std::make_shared<at::Tensor>(std::move(p.tensor)));
      }
    }
    pending_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<Pending> pending_;
};

// Point-to-point work: the waiter itself polls its request. A transfer starts at submission (it
// does not queue behind collectives), so its deadline counts from there.
class RequestWork final : public Work {
 public:
  RequestWork(OpDesc what, at::Tensor tensor, bool is_recv, MPI_Request req,
              std::chrono::milliseconds timeout, int spin_limit,
              std::shared_ptr<FailureState> state, std::shared_ptr<PendingRequests> pending)
      : Work(is_recv ? std::vector<at::Tensor>{tensor} : std::vector<at::Tensor>{}),
        what_(std::move(what)), tensor_(std::move(tensor)), req_(req),
        deadline_(Clock::now() + timeout), timeout_(timeout), spin_limit_(spin_limit),
        state_(std::move(state)),
        pending_(std::move(pending)) {}
  ~RequestWork() override {
    if (done_) return;
    if (error_) {  // timed out or failed: MPI may still touch the tensor
      detail::keep_forever(std::make_shared<at::Tensor>(std::move(tensor_)));
      return;
    }
    pending_->adopt({std::move(what_), req_, std::move(tensor_), deadline_});
  }
  void wait() override {
    int spins = 0;
    while (!is_completed()) {
      detail::relax(spins, spin_limit_);
      if ((spins & 255) == 0 && Clock::now() > deadline_) {
        std::string msg = state_->timeout_message(what_, timeout_);
        state_->mark_broken(msg);
        std::lock_guard<std::mutex> lock(mu_);
        error_ = std::make_exception_ptr(CommError(msg));
        std::rethrow_exception(error_);
      }
    }
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    int flag = 0;
    const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      try {
        check_mpi(rc, what_);
      } catch (const CommError& e) {
        state_->mark_broken(e.what());
        error_ = std::current_exception();
        throw;
      }
    }
    done_ = flag != 0;
    return done_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  OpDesc what_;
  at::Tensor tensor_;
  MPI_Request req_;
  Clock::time_point deadline_;
  std::chrono::milliseconds timeout_;
  int spin_limit_;
  std::shared_ptr<FailureState> state_;
  std::shared_ptr<PendingRequests> pending_;
  mutable std::mutex mu_;
  bool done_ = false;
  std::exception_ptr error_;
};

// ---------------------------------------------------------------------------------------------

enum OpKind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kSend, kRecv, kBarrier, kOps };
constexpr std::array<const char*, kOps> kOpNames = {
    "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", "barrier"};

class MpiCommunicator;
std::mutex g_registry_mu;
std::set<MpiCommunicator*> g_registry;
bool g_hook_registered = false;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, CommOptions options)
      : comm_(comm), name_(std::move(name)), options_(std::move(options)),
        pending_(std::make_shared<PendingRequests>()) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Group group, world_group;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> ranks(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) ranks[i] = i;
    world_ranks_.resize(static_cast<size_t>(size_));
    MPI_Group_translate_ranks(group, size_, ranks.data(), world_group, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    std::string list;
    for (int i = 0; i < size_; ++i) list += concat(i ? ", " : "", world_ranks_[i]);
    state_ = std::make_shared<FailureState>(
        concat("members of '", name_, "' (world ranks): [", list, "]"));
    poll_ = detail::PollPolicy::for_ranks_per_node(runtime().local_size);
    engine_ = std::make_unique<detail::ProgressEngine>(state_, options_.timeout(), poll_);
    group_suffix_ = std::make_shared<const std::string>(describe(""));
    check_mpi(MPI_Comm_dup(comm_, &algo_comm_), describe("create"));
    MPI_Comm_set_errhandler(algo_comm_, MPI_ERRORS_RETURN);
    algo_.p2p = algo_comm_;
    algo_.coll = comm_;
    algo_.rank = rank_;
    algo_.size = size_;
    algo_.chunk_bytes = options_.chunk_bytes();
    algo_.segment_bytes = options_.segment_bytes();
    algo_.chunks_in_flight = options_.chunks_in_flight();
    algo_.one_phase_bytes = options_.one_phase_bytes();
    algo_.scratch = std::make_shared<detail::ScratchPool>();
    setup_hierarchy();
    std::lock_guard<std::mutex> lock(g_registry_mu);
    g_registry.insert(this);
    if (!g_hook_registered) {
      g_hook_registered = true;
      runtime_detail::add_shutdown_hook(&MpiCommunicator::shutdown_all);
    }
  }

  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(g_registry_mu);
      g_registry.erase(this);
    }
    release();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  const CommOptions& options() const override { return options_; }
  int hierarchy_hosts() const override { return hier_ ? hier_->hosts : 0; }
  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(stats_mu_);
    CommStats out;
    for (int k = 0; k < kOps; ++k) {
      if (stats_[k].ops > 0) out[kOpNames[k]] = stats_[k];
    }
    return out;
  }

  using Communicator::split;
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name,
                                      const CommOptions& options) override {
    TS_CHECK(color >= 0, describe("split"), ": color must be >= 0, got ", color);
    state_->check_usable(describe("split"));
    MPI_Comm out = MPI_COMM_NULL;
    engine_->run_exclusive(
        [&] { check_mpi(MPI_Comm_split(comm_, color, key, &out), describe("split")); });
    return std::make_shared<MpiCommunicator>(out, name, options);
  }

  static void shutdown_all() {
    std::vector<MpiCommunicator*> all;
    {
      std::lock_guard<std::mutex> lock(g_registry_mu);
      all.assign(g_registry.begin(), g_registry.end());
    }
    for (auto* c : all) c->release();
  }

 protected:
  WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op, Mode mode) override {
    const int64_t b = bytes_of(t), peers = size() - 1;  // one phase: whole tensor to each peer
    if (hier_ && b * peers > algo_.one_phase_bytes && hierarchical_dtype(t.scalar_type())) {
      return hierarchical_all_reduce(t, op, mode);
    }
    count(kAllReduce, b, b * peers <= algo_.one_phase_bytes ? b * peers : 2 * b * peers / size());
    return submit(detail::make_all_reduce(algo_, describe_op(kAllReduce, t, op), t, op), {t},
                  mode);
  }

  WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op,
                            Mode mode) override {
    if (hier_ && bytes_of(in) > algo_.one_phase_bytes && hierarchical_dtype(in.scalar_type())) {
      return hierarchical_reduce_scatter(in, out, op, mode);
    }
    count(kReduceScatter, bytes_of(in), bytes_of(in) * (size() - 1) / size());
    return submit(
        detail::make_reduce_scatter(algo_, describe_op(kReduceScatter, in, op), in, out, op),
        {out}, mode);
  }

  WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out, Mode mode) override {
    if (hier_ && bytes_of(out) > algo_.one_phase_bytes) {  // no arithmetic: any dtype (bf16, qwZ's bytes)
      return hierarchical_all_gather(in, out, mode);
    }
    count(kAllGather, bytes_of(out), bytes_of(in) * (size() - 1));
    return submit(
        detail::make_all_gather(algo_, describe_op(kAllGather, in, std::nullopt), in, out),
        {out}, mode);
  }

  WorkPtr do_broadcast(const at::Tensor& t, int root, Mode mode) override {
    count(kBroadcast, bytes_of(t), rank() == root ? bytes_of(t) : 0);  // MPI's tree: at least the root's copy
    return submit(
        detail::make_broadcast(algo_, describe_op(kBroadcast, t, std::nullopt), t, root), {t},
        mode);
  }

  WorkPtr do_barrier(Mode mode) override {
    count(kBarrier, 0, 0);
    OpDesc d;
    d.op = kOpNames[kBarrier];
    d.group = group_suffix_;
    return submit(detail::make_barrier(algo_, std::move(d)), {}, mode);
  }

  WorkPtr do_send(const at::Tensor& t, int dst, int tag) override {
    count(kSend, bytes_of(t), bytes_of(t));
    return p2p(describe_op(kSend, t, std::nullopt), t, dst, tag, /*is_send=*/true);
  }

  WorkPtr do_recv(const at::Tensor& t, int src, int tag) override {
    count(kRecv, bytes_of(t), 0);
    return p2p(describe_op(kRecv, t, std::nullopt), t, src, tag, /*is_send=*/false);
  }

 private:
  // Note [Hierarchical collectives]: the ranks of this group on this host (intra) and those of
  // the same local index on every host (inter), when the layout allows.
  struct Level {
    MPI_Comm comm = MPI_COMM_NULL, p2p = MPI_COMM_NULL;
    detail::AlgoContext algo;
  };
  struct Hierarchy {
    int hosts = 1, local = 1;  // H, L
    Level intra, inter;
  };

  void setup_hierarchy() {
    const char* mode = std::getenv("TORCHSPEED_COMM_HIERARCHICAL");
    TS_CHECK(!mode || !*mode || std::string(mode) == "0" || std::string(mode) == "1",
             "environment variable TORCHSPEED_COMM_HIERARCHICAL='", mode, "' must be 0 (flat) or 1 (staged where the layout allows)");
    if (size_ < 2) return;
    const char* hs = std::getenv("TORCHSPEED_COMM_HOST_SIZE");
    int host_size = 0;
    if (hs && *hs) {
      char* end = nullptr;
      const long v = std::strtol(hs, &end, 10);
      TS_CHECK(end && *end == '\0' && v > 0 && v < (1L << 30), "environment variable TORCHSPEED_COMM_HOST_SIZE='", hs,
               "' must be a positive rank count");
      host_size = static_cast<int>(v);
    }
    // Each rank's host, as the group rank of the host's first member.
    MPI_Comm host = MPI_COMM_NULL;
    if (host_size > 0) {
      check_mpi(MPI_Comm_split(comm_, world_ranks_[static_cast<size_t>(rank_)] / host_size, rank_, &host), describe("create"));
    } else {
      check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &host), describe("create"));
    }
    int leader = rank_, local = 1;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, host), describe("create"));
    MPI_Comm_size(host, &local);
    MPI_Comm_free(&host);
    std::vector<int> info(2 * static_cast<size_t>(size_)), mine{leader, local};
    check_mpi(MPI_Allgather(mine.data(), 2, MPI_INT, info.data(), 2, MPI_INT, comm_), describe("create"));
    // A group across hosts sends its all_gather pieces in chunks (Note [Direct algorithms]);
    // local == size_ on one rank iff on every rank.
    if (local < size_) algo_.gather_chunk_bytes = kCrossHostGatherBytes;
    if (size_ < 4 || (mode && std::string(mode) == "0")) return;  // (every rank reads the same env)
    const int L = info[1];
    bool ok = L > 1 && size_ % L == 0 && size_ / L > 1;
    for (int r = 0; ok && r < size_; ++r) {
      ok = info[2 * static_cast<size_t>(r) + 1] == L && info[2 * static_cast<size_t>(r)] == r - r % L;
    }
    if (!ok) return;  // the same decision on every rank: it rests on the gathered layout alone
    auto level = std::make_unique<Hierarchy>();
    level->hosts = size_ / L;
    level->local = L;
    auto make = [&](Level& lv, int color) {
      check_mpi(MPI_Comm_split(comm_, color, rank_, &lv.comm), describe("create"));
      check_mpi(MPI_Comm_dup(lv.comm, &lv.p2p), describe("create"));
      MPI_Comm_set_errhandler(lv.comm, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(lv.p2p, MPI_ERRORS_RETURN);
      lv.algo = algo_;
      lv.algo.coll = lv.comm;
      lv.algo.p2p = lv.p2p;
      MPI_Comm_rank(lv.comm, &lv.algo.rank);
      MPI_Comm_size(lv.comm, &lv.algo.size);
      lv.algo.scratch = std::make_shared<detail::ScratchPool>();
    };
    make(level->intra, rank_ / L);
    level->intra.algo.gather_chunk_bytes = detail::AlgoContext().gather_chunk_bytes;  // one host
    make(level->inter, rank_ % L);
    hier_ = std::move(level);
  }

  WorkPtr hierarchical_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op, Mode mode) {
    const int64_t H = hier_->hosts, L = hier_->local, c = out.numel();
    const int64_t e = static_cast<int64_t>(in.element_size());
    count(kReduceScatter, bytes_of(in), (L - 1) * H * c * e + (H - 1) * c * e);
    const ReduceOp sub = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    OpDesc what = describe_op(kReduceScatter, in, op);
    const at::ScalarType dt = in.scalar_type();
    // in: [H, L, c], block h (chunks (h, 0..L-1)) reduced within the host into row h of mid, this
    // host's sum of chunk (h, l); mid's rows reduced across hosts into out.
    at::Tensor mid = at::empty({H, c}, in.options());
    char* const pin = static_cast<char*>(in.data_ptr());
    char* const pmid = static_cast<char*>(mid.data_ptr());
    char* const pout = static_cast<char*>(out.data_ptr());
    std::vector<PipelinedTask::Stage> stages;
    stages.push_back({[=, this](int64_t a, int64_t m, int64_t h) {
                        return detail::make_reduce_scatter_blocks(hier_->intra.algo, what, {in, mid}, dt, pin + (h * L * c + a) * e,
                                                                  pmid + (h * c + a) * e, m, c, sub);
                      },
                      H});
    stages.push_back({[=, this](int64_t a, int64_t m, int64_t) {
                        return detail::make_reduce_scatter_blocks(hier_->inter.algo, what, {mid, out}, dt, pmid + a * e,
                                                                  pout + a * e, m, c, sub);
                      },
                      1});
    std::function<void()> after;
    if (op == ReduceOp::kAvg) after = [out, d = static_cast<double>(H * L)]() mutable { out.div_(d); };
    return submit(std::make_unique<PipelinedTask>(what, std::vector<at::Tensor>{in, out, mid}, std::move(stages), c,
                                                  pipeline_segment(algo_, e), std::move(after)),
                  {out}, mode);
  }

  WorkPtr hierarchical_all_gather(const at::Tensor& in, const at::Tensor& out, Mode mode) {
    const int64_t H = hier_->hosts, L = hier_->local, c = in.numel();
    const int64_t e = static_cast<int64_t>(in.element_size());
    count(kAllGather, bytes_of(out), (H - 1) * c * e + (L - 1) * H * c * e);
    OpDesc what = describe_op(kAllGather, in, std::nullopt);
    const at::ScalarType dt = in.scalar_type();
    // Across hosts first, among local index l: row h of mid is chunk (h, l); then within the host,
    // row h into block h of out ([H, L, c]).
    at::Tensor mid = at::empty({H, c}, in.options());
    const char* const pin = static_cast<const char*>(in.data_ptr());
    char* const pmid = static_cast<char*>(mid.data_ptr());
    char* const pout = static_cast<char*>(out.data_ptr());
    std::vector<PipelinedTask::Stage> stages;
    stages.push_back({[=, this](int64_t a, int64_t m, int64_t) {
                        return detail::make_all_gather_blocks(hier_->inter.algo, what, {in, mid}, dt, pin + a * e, pmid + a * e, m, c);
                      },
                      1});
    stages.push_back({[=, this](int64_t a, int64_t m, int64_t h) {
                        return detail::make_all_gather_blocks(hier_->intra.algo, what, {mid, out}, dt, pmid + (h * c + a) * e,
                                                              pout + (h * L * c + a) * e, m, c);
                      },
                      H});
    return submit(std::make_unique<PipelinedTask>(what, std::vector<at::Tensor>{in, out, mid}, std::move(stages), c,
                                                  pipeline_segment(algo_, e), nullptr),
                  {out}, mode);
  }

  WorkPtr hierarchical_all_reduce(const at::Tensor& t, ReduceOp op, Mode mode) {
    const int64_t H = hier_->hosts, L = hier_->local, n = t.numel(), c = (n + L - 1) / L;
    const int64_t e = static_cast<int64_t>(t.element_size());
    count(kAllReduce, bytes_of(t), 2 * (L - 1) * c * e + 2 * (H - 1) * ((c + H - 1) / H) * e);
    const ReduceOp sub = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    OpDesc what = describe_op(kAllReduce, t, op);
    const at::Tensor flat = t.view({-1});
    const bool padded = L * c != n;
    at::Tensor buf = padded ? at::zeros({L * c}, t.options()) : flat, part = at::empty({c}, t.options());
    std::vector<StagedTask::Stage> stages;
    if (padded) stages.push_back({nullptr, [=]() mutable { buf.narrow(0, 0, n).copy_(flat); }});
    stages.push_back({[=, this] { return detail::make_reduce_scatter(hier_->intra.algo, what, buf, part, sub); }, nullptr});
    stages.push_back({[=, this] { return detail::make_all_reduce(hier_->inter.algo, what, part, sub); }, nullptr});
    stages.push_back({[=, this] { return detail::make_all_gather(hier_->intra.algo, what, part, buf); },
                      [=]() mutable {
                        if (padded) flat.copy_(buf.narrow(0, 0, n));
                        if (op == ReduceOp::kAvg) flat.div_(static_cast<double>(H * L));
                      }});
    return submit(std::make_unique<StagedTask>(what, std::vector<at::Tensor>{t, buf, part}, std::move(stages)), {t},
                  mode);
  }

  OpDesc describe_op(OpKind op, const at::Tensor& t, std::optional<ReduceOp> rop) const {
    OpDesc d;
    d.op = kOpNames[op];
    d.group = group_suffix_;
    d.bytes = bytes_of(t);
    d.dtype = t.scalar_type();
    d.rop = rop ? static_cast<int>(*rop) : -1;
    return d;
  }

  void count(OpKind op, int64_t bytes, int64_t sent) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_[op].ops += 1;
    stats_[op].bytes += bytes;
    stats_[op].sent += sent;
  }

  WorkPtr submit(std::unique_ptr<detail::Task> task, std::vector<at::Tensor> outputs, Mode mode) {
    return engine_->submit(std::move(task), std::move(outputs), mode == Mode::kBlocking);
  }

  WorkPtr p2p(OpDesc what, const at::Tensor& t, int peer, int tag, bool is_send) {
    what.peer = peer;
    what.tag = tag;
    state_->check_usable(what.str());
    pending_->poll();
    MPI_Request req;
    // Transfers larger than 2^31 elements are moved as elements of a contiguous type.
    MPI_Datatype dt = detail::mpi_dtype(t.scalar_type());
    int64_t count = t.numel();
    detail::MpiType big;
    if (count > INT32_MAX) {
      int64_t block = 1;
      while (count / block > INT32_MAX || count % block) block *= 2;
      TS_CHECK(count / block <= INT32_MAX, what.str(), ": tensor too large for one MPI message");
      big.reset(block, dt);
      dt = big.get();
      count /= block;
    }
    const int n = static_cast<int>(count);
    check_mpi(is_send ? MPI_Isend(t.data_ptr(), n, dt, peer, tag, comm_, &req)
                      : MPI_Irecv(t.data_ptr(), n, dt, peer, tag, comm_, &req),
              what);
    return std::make_shared<RequestWork>(std::move(what), t, !is_send, req, options_.timeout(),
                                         poll_.inline_spins, state_, pending_);
  }

  // Waits for every in-flight op (or, once any communicator of the job has failed and the job
  // is ending, gives them up), stops the progress thread, then frees the MPI communicators
  // (idempotent). A broken communicator's are not freed: MPI may still use them.
  void release() {
    {
      std::lock_guard<std::mutex> lock(release_mu_);
      if (released_) return;
      released_ = true;
    }
    const bool abandon = runtime_detail::comm_failed();
    engine_->shutdown(abandon);
    pending_->drain(*state_, options_.timeout(), abandon);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !state_->broken() && !abandon) {
      if (hier_) {
        for (Level* lv : {&hier_->intra, &hier_->inter}) {
          MPI_Comm_free(&lv->p2p);
          MPI_Comm_free(&lv->comm);
        }
      }
      MPI_Comm_free(&algo_comm_);
      MPI_Comm_free(&comm_);
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm algo_comm_ = MPI_COMM_NULL;  // private duplicate for our p2p-based algorithms
  int rank_ = 0, size_ = 1;
  std::string name_;
  std::shared_ptr<const std::string> group_suffix_;  // describe(""), shared by every OpDesc
  std::vector<int> world_ranks_;
  CommOptions options_;
  std::shared_ptr<FailureState> state_;
  detail::PollPolicy poll_;
  std::unique_ptr<detail::ProgressEngine> engine_;
  std::shared_ptr<PendingRequests> pending_;
  detail::AlgoContext algo_;
  std::unique_ptr<Hierarchy> hier_;  // null: flat collectives only
  std::mutex release_mu_;
  bool released_ = false;

  mutable std::mutex stats_mu_;
  std::array<OpStats, kOps> stats_{};
};

}  // namespace

std::shared_ptr<Communicator> Communicator::world(const CommOptions& options) {
  TS_CHECK(is_initialized(), "Communicator::world() needs torchspeed::init() first");
  MPI_Comm dup;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "creating the world communicator");
  return std::make_shared<MpiCommunicator>(dup, "world", options);
}

}  // namespace torchspeed::comm
