// The MPI tasks behind each collective, for the progress engine: the chunked, pipelined
// point-to-point algorithms of Note [Direct algorithms] (all_reduce, reduce_scatter,
// all_gather) and chunked MPI collectives (broadcast, barrier). Each factory validates nothing
// (Communicator did) and returns a Task that owns references to its tensors.
// Internal: includes <mpi.h>, never installed.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "torchspeed/comm/communicator.h"
#include "torchspeed/comm/detail/progress.h"

namespace torchspeed::comm::detail {

MPI_Datatype mpi_dtype(at::ScalarType t);
// Throws CommError("<what>: MPI error: <MPI's message>") unless rc is MPI_SUCCESS.
void check_mpi(int rc, const std::string& what);
inline void check_mpi(int rc, const OpDesc& what) {
  if (rc != MPI_SUCCESS) check_mpi(rc, what.str());
}

// Reusable receive buffers of a communicator (its ops run one at a time, so one pool serves
// all). Not zero-filled: a fresh zeroed buffer per call costs page faults and a memset per
// chunk, which at 1-4 MiB took more time than the transfer. Page-aligned (see Note [Direct
// algorithms]). Shared with the tasks that use it, so that a failed task (kept forever, see
// Note [Deadlines and failure]) keeps it alive.
class ScratchPool {
 public:
  char* get(size_t slot, size_t bytes);

 private:
  struct Free {
    void operator()(char* p) const;
  };
  struct Buf {
    std::unique_ptr<char, Free> data;
    size_t size = 0;
  };
  std::vector<Buf> bufs_;
};

// What the algorithms of one communicator run on.
struct AlgoContext {
  MPI_Comm p2p = MPI_COMM_NULL;   // private duplicate for our point-to-point algorithms
  MPI_Comm coll = MPI_COMM_NULL;  // the communicator itself, for MPI's collectives
  int rank = 0, size = 1;
  int64_t chunk_bytes = 1 << 20;
  int64_t segment_bytes = 1 << 20;  // staged collectives: see Note [Pipelined stages]
  int chunks_in_flight = 4;
  int64_t one_phase_bytes = 64 << 10;
  // Largest piece of an all_gather sent as one message (Note [Direct algorithms]): whole pieces
  // within a host, chunks of this many bytes (several in flight) when the group spans hosts.
  int64_t gather_chunk_bytes = int64_t{1} << 62;
  std::shared_ptr<ScratchPool> scratch;
};

std::unique_ptr<Task> make_all_reduce(const AlgoContext& c, OpDesc what, const at::Tensor& t,
                                      ReduceOp op);
std::unique_ptr<Task> make_reduce_scatter(const AlgoContext& c, OpDesc what,
                                          const at::Tensor& in, const at::Tensor& out,
                                          ReduceOp op);
std::unique_ptr<Task> make_all_gather(const AlgoContext& c, OpDesc what, const at::Tensor& in,
                                      const at::Tensor& out);
// The same over raw blocks inside the tensors of `keep` (which the task holds): rank j's block
// of n elements starts j * stride elements after `in` (reduce_scatter) or `out` (all_gather).
// The pipelined hierarchical collectives run them over a column range of a [ranks, c] layout.
std::unique_ptr<Task> make_reduce_scatter_blocks(const AlgoContext& c, OpDesc what, std::vector<at::Tensor> keep,
                                                 at::ScalarType dtype, char* in, char* out, int64_t n,
                                                 int64_t stride, ReduceOp op);
std::unique_ptr<Task> make_all_gather_blocks(const AlgoContext& c, OpDesc what, std::vector<at::Tensor> keep,
                                             at::ScalarType dtype, const char* in, char* out, int64_t n,
                                             int64_t stride);
std::unique_ptr<Task> make_broadcast(const AlgoContext& c, OpDesc what, const at::Tensor& t,
                                     int root);
std::unique_ptr<Task> make_barrier(const AlgoContext& c, OpDesc what);

}  // namespace torchspeed::comm::detail
