// The process's place in the job: init() starts MPI (MPI_THREAD_MULTIPLE), learns world and
// local rank from the launcher (OpenMPI's mpirun, Slurm's srun, or none), sets intra-op threads
// for LibTorch and OpenBLAS, and sets the log prefix. shutdown() finalises MPI once.
#pragma once

#include <torch/arg.h>

#include <functional>
#include <string>

namespace torchspeed {

// What a rank prints when it ends the whole job after a failed collective (runtime.cpp). The
// launcher (launch/launcher.h) treats it as the job failing, as it treats mpirun's own abort
// messages: mpirun that cannot reach a silent host's daemon may hang before printing any of those.
inline constexpr char kRankEndsJob[] = "ending the job after a communication failure";

enum class Launcher { kNone, kOpenMPI, kSlurm };
const char* launcher_name(Launcher l);

struct InitOptions {
  // Intra-op threads per rank; 0 = the cores this rank may use (its affinity mask when the
  // launcher bound it, else cores per node / ranks per node).
  TORCH_ARG(int, intra_op_threads) = 0;
  // Warn when OpenBLAS runs slow generic kernels on an AVX-512 CPU.
  TORCH_ARG(bool, warn_slow_blas) = true;
};

struct Runtime {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;   // rank among the processes of this node
  int local_size = 1;   // processes on this node
  int num_nodes = 1;
  int intra_op_threads = 1;
  Launcher launcher = Launcher::kNone;
  std::string hostname;

  bool is_rank0() const { return rank == 0; }
};

// Initialises once; later calls return the same Runtime. Throws torchspeed::Error when MPI
// lacks MPI_THREAD_MULTIPLE or the launcher's environment contradicts MPI.
const Runtime& init(const InitOptions& options = InitOptions());
bool is_initialized();
// The Runtime of init(); throws when init() has not run.
const Runtime& runtime();

// Finalises MPI (once; also run at exit). After a communication failure it aborts the whole job
// instead, since MPI cannot finalise with a collective stuck in flight.
void shutdown();
// Ends every rank of the job now with `message` logged on this rank.
[[noreturn]] void abort_job(const std::string& message, int exit_code = 1);

// "Open MPI v4.1.4, ..." (first line of MPI_Get_library_version); works before init().
std::string mpi_library_version();
// torchspeed's version string.
const char* version();

namespace runtime_detail {
// Hooks run by shutdown() before MPI_Finalize (communicators stop their threads here).
void add_shutdown_hook(std::function<void()> hook);
// Records that communication failed (e.g. a timeout); shutdown() then aborts the job.
void mark_comm_failed(const std::string& what);
bool comm_failed();
}  // namespace runtime_detail

}  // namespace torchspeed
