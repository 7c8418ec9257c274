// Communicator: collectives and point-to-point transfers on CPU tensors among a group of ranks.
// Every op has an async form returning a Work. An op runs under a deadline counted from its
// start, so a dead or desynchronised peer ends in a CommError naming the op, group, rank and
// bytes, never a hang; the failure breaks the communicator (later ops throw at once).
// Backends (MPI now) implement the do_* hooks; validation of arguments lives here, once.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace torchspeed::comm {

enum class ReduceOp { kSum, kAvg, kMax, kMin };
const char* reduce_op_name(ReduceOp op);

// Deadline default: TORCHSPEED_COMM_TIMEOUT_S, else 10 minutes.
std::chrono::milliseconds default_timeout();
// Chunk default: TORCHSPEED_COMM_CHUNK_BYTES, else 1 MiB. See Note [Direct algorithms].
int64_t default_chunk_bytes();
// Segment default: TORCHSPEED_COMM_SEGMENT_BYTES, else 1 MiB. See Note [Pipelined stages].
int64_t default_segment_bytes();
// One-phase all_reduce threshold: TORCHSPEED_COMM_ONE_PHASE_BYTES, else 64 KiB.
int64_t default_one_phase_bytes();

struct CommOptions {
  // How long an op may run, counted from the moment it starts (ops of a communicator run one
  // at a time, in submission order), before it fails with a CommError and breaks the
  // communicator.
  TORCH_ARG(std::chrono::milliseconds, timeout) = default_timeout();
  // Collectives are split into pipelined chunks of about this size.
  TORCH_ARG(int64_t, chunk_bytes) = default_chunk_bytes();
  // Chunks of one collective in flight at once.
  TORCH_ARG(int, chunks_in_flight) = 4;
  // A staged (hierarchical) reduce_scatter or all_gather moves segments of about this many bytes
  // per rank through its stages, one stage working on a segment while the next works on the
  // one before (Note [Pipelined stages] in mpi_communicator.cpp).
  TORCH_ARG(int64_t, segment_bytes) = default_segment_bytes();
  // all_reduce moving at most this many bytes per rank ((size-1) x tensor bytes) exchanges
  // whole tensors in one round instead of reduce-scatter + all-gather (lower latency).
  TORCH_ARG(int64_t, one_phase_bytes) = default_one_phase_bytes();
};

// An op in flight. It owns references to the tensors the op reads and writes (so a temporary
// passed to an async op stays alive until the op completed) and reports how the op ended.
class Work {
 public:
  explicit Work(std::vector<at::Tensor> result = {}) : result_(std::move(result)) {}
  virtual ~Work() = default;
  // Blocks until the op completed; throws its CommError when it failed (its deadline passed, a
  // peer failed, or the communicator had failed before the op could start). Never blocks for
  // ever: an op that neither completes nor fails by its deadline ends the wait with a CommError.
  virtual void wait() = 0;
  // Non-blocking check; also throws when the op failed.
  virtual bool is_completed() = 0;
  // The op's failure, or null while it runs and after it succeeded. Never throws.
  virtual std::exception_ptr exception() const = 0;
  // The tensors the op writes, valid once it completed: all_reduce, broadcast, recv: the
  // tensor; reduce_scatter, all_gather: the output; send, barrier: none.
  const std::vector<at::Tensor>& result() const { return result_; }

 private:
  std::vector<at::Tensor> result_;
};
using WorkPtr = std::shared_ptr<Work>;

// Counts of what this rank asked the communicator to move (payload bytes of the tensors), and
// the bytes it sent to peers doing so: all_reduce 2 (p-1)/p of the tensor (whole to each peer
// when small), reduce_scatter (p-1)/p of its input, all_gather its input to each peer, send the
// tensor; broadcast counts the root's one copy (MPI's own tree).
struct OpStats {
  int64_t ops = 0;
  int64_t bytes = 0;
  int64_t sent = 0;
};
using CommStats = std::map<std::string, OpStats>;  // by op name ("all_reduce", ...)

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator() = default;

  // The world group over every rank of the job (needs torchspeed::init()).
  static std::shared_ptr<Communicator> world(const CommOptions& options = CommOptions());

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;
  // World ranks of this group's members, in group-rank order.
  virtual const std::vector<int>& world_ranks() const = 0;
  virtual const CommOptions& options() const = 0;
  virtual CommStats stats() const = 0;
  // The hosts this group's large all_reduce / reduce_scatter / all_gather run across in stages
  // (within each host, then across: Note [Hierarchical collectives] in mpi_communicator.cpp),
  // or 0 when they run flat.
  virtual int hierarchy_hosts() const { return 0; }

  // Ranks with the same color form a new group, ordered by key (then by rank), with this
  // group's options or the given ones. Collective.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) {
    return split(color, key, name, options());
  }
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name,
                                              const CommOptions& options) = 0;

  // In place on `tensor`. bf16/fp16 sums accumulate in fp32 and round once; kAvg divides by
  // size() (floating dtypes only).
  WorkPtr all_reduce_async(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // `input` holds size() equal chunks; rank r receives the reduction of chunk r in `output`.
  WorkPtr reduce_scatter_async(const at::Tensor& input, const at::Tensor& output,
                               ReduceOp op = ReduceOp::kSum);
  // `output` (size() x input.numel()) receives every rank's `input`, in rank order.
  WorkPtr all_gather_async(const at::Tensor& input, const at::Tensor& output);
  WorkPtr broadcast_async(const at::Tensor& tensor, int root);
  WorkPtr send_async(const at::Tensor& tensor, int dst, int tag = 0);
  WorkPtr recv_async(const at::Tensor& tensor, int src, int tag = 0);
  WorkPtr barrier_async();

  void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  void reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                      ReduceOp op = ReduceOp::kSum);
  void all_gather(const at::Tensor& input, const at::Tensor& output);
  void broadcast(const at::Tensor& tensor, int root);
  void send(const at::Tensor& tensor, int dst, int tag = 0);
  void recv(const at::Tensor& tensor, int src, int tag = 0);
  void barrier();

  // All-to-all with variable counts along dim 0 (MPI_Alltoallv's exchange; expert parallelism's
  // token dispatch): `input` is size() consecutive blocks, send_counts[j] rows for rank j;
  // `output` receives recv_counts[j] rows from rank j, in rank order. A row is everything past
  // dim 0 and must match; counts may be 0. Point-to-point transfers on a tag of its own, each
  // under the deadline; this rank's own block is copied. Collective: every rank calls it, and
  // rank i's send_counts[j] must equal rank j's recv_counts[i] (a mismatch fails the transfer).
  void all_to_all(const at::Tensor& input, const std::vector<int64_t>& send_counts, const at::Tensor& output,
                  const std::vector<int64_t>& recv_counts);
  // The tag all_to_all's transfers use; other point-to-point traffic on the group avoids it.
  static constexpr int kAllToAllTag = (1 << 20) - 1;

  // "all_reduce on group 'dp' (rank 1 of 2, world rank 3)": the prefix of every error.
  std::string describe(const char* op) const;

 protected:
  // Blocking calls may run inline on the caller's thread when the communicator is idle.
  enum class Mode { kAsync, kBlocking };
  virtual WorkPtr do_all_reduce(const at::Tensor& t, ReduceOp op, Mode mode) = 0;
  virtual WorkPtr do_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op,
                                    Mode mode) = 0;
  virtual WorkPtr do_all_gather(const at::Tensor& in, const at::Tensor& out, Mode mode) = 0;
  virtual WorkPtr do_broadcast(const at::Tensor& t, int root, Mode mode) = 0;
  virtual WorkPtr do_send(const at::Tensor& t, int dst, int tag) = 0;
  virtual WorkPtr do_recv(const at::Tensor& t, int src, int tag) = 0;
  virtual WorkPtr do_barrier(Mode mode) = 0;

 private:
  void validate_all_reduce(const at::Tensor& t, ReduceOp op) const;
  void validate_reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op) const;
  void validate_all_gather(const at::Tensor& in, const at::Tensor& out) const;
  void validate_broadcast(const at::Tensor& t, int root) const;
  void validate_p2p(const char* op, const at::Tensor& t, int peer, int tag) const;
  void check_tensor(const char* op, const at::Tensor& t, const char* what) const;
  void check_reduce(const char* op, const at::Tensor& t, ReduceOp rop) const;
  void check_peer(const char* op, int peer, const char* what) const;
};

using CommunicatorPtr = std::shared_ptr<Communicator>;

// Every rank's string, in rank order (two all_gathers: lengths, then padded bytes). For small
// control messages: agreeing on errors, file names, checksums. Collective.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

}  // namespace torchspeed::comm
