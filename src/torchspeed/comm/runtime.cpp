// MPI start-up and shutdown, launcher detection and thread settings.
// comm/ owns MPI from init to abort: <mpi.h> appears only in comm/'s .cpp files.
#include "torchspeed/comm/runtime.h"

#include <mpi.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <vector>

#include "torchspeed/base/cpu.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"

namespace torchspeed {
namespace {

std::mutex g_mu;
std::optional<Runtime> g_runtime;
bool g_finalized = false;
std::vector<std::function<void()>> g_hooks;
std::string g_comm_failure;

std::optional<int> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  TS_CHECK(end && *end == '\0', "environment variable ", name, "='", v, "' is not an integer");
  return static_cast<int>(x);
}

Launcher detect_launcher() {
  if (std::getenv("OMPI_COMM_WORLD_RANK")) return Launcher::kOpenMPI;
  if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS")) return Launcher::kSlurm;
  return Launcher::kNone;
}

void check_env_matches(const char* name, int mpi_value) {
  auto v = env_int(name);
  TS_CHECK(!v || *v == mpi_value, "launcher says ", name, "=", *v, " but MPI reports ", mpi_value,
           ": the process was started by a different launcher than MPI was (e.g. srun without "
           "PMIx for an OpenMPI program); start it with mpirun or torchspeed launch");
}

void at_exit_shutdown() { shutdown(); }

}  // namespace

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::kOpenMPI: return "mpirun";
    case Launcher::kSlurm: return "slurm";
    default: return "none";
  }
}

const Runtime& init(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_runtime) return *g_runtime;
  TS_CHECK(!g_finalized, "torchspeed::init() called after shutdown(): MPI cannot be restarted");

  Runtime rt;
  rt.launcher = detect_launcher();
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    std::atexit(at_exit_shutdown);
  } else {
    MPI_Query_thread(&provided);
  }
  TS_CHECK(provided >= MPI_THREAD_MULTIPLE,
           "MPI provides thread level ", provided, " but torchspeed needs MPI_THREAD_MULTIPLE (",
           MPI_THREAD_MULTIPLE, ") for its communication threads; use an MPI built with thread "
           "support (Debian's OpenMPI has it) or initialise MPI with MPI_Init_thread(..., "
           "MPI_THREAD_MULTIPLE, ...) before torchspeed::init()");
  MPI_Comm_rank(MPI_COMM_WORLD, &rt.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &rt.world_size);
  if (rt.launcher == Launcher::kOpenMPI) {
    check_env_matches("OMPI_COMM_WORLD_RANK", rt.rank);
    check_env_matches("OMPI_COMM_WORLD_SIZE", rt.world_size);
  } else if (rt.launcher == Launcher::kSlurm && rt.world_size > 1) {
    check_env_matches("SLURM_PROCID", rt.rank);
    check_env_matches("SLURM_NTASKS", rt.world_size);
  }

  // Local rank/size from shared-memory domains: right under any launcher.
  MPI_Comm node_comm;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rt.rank, MPI_INFO_NULL, &node_comm);
  MPI_Comm_rank(node_comm, &rt.local_rank);
  MPI_Comm_size(node_comm, &rt.local_size);
  MPI_Comm_free(&node_comm);
  int leader = rt.local_rank == 0 ? 1 : 0;
  MPI_Allreduce(&leader, &rt.num_nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  rt.hostname = host;

  log::set_rank(rt.rank, rt.world_size);

  // Threads: see the guide's trap: at::set_num_threads does not bound OpenBLAS's pool.
  auto f = cpu::features();
  int threads = options.intra_op_threads();
  if (threads <= 0) {
    if (auto env = env_int("TORCHSPEED_INTRA_OP_THREADS")) threads = *env;
  }
  if (threads <= 0) {
    threads = f.affinity_cores < f.logical_cores ? f.affinity_cores
                                                 : std::max(1, f.logical_cores / rt.local_size);
  }
  rt.intra_op_threads = threads;
  at::set_num_threads(threads);
  cpu::set_blas_threads(threads);

  if (options.warn_slow_blas() && f.avx512f) {
    std::string core = cpu::blas_core_name();
    if (core == "Prescott" || core == "Core2" || core == "Nehalem" || core == "Sandybridge" ||
        core == "Haswell") {
      log::warn0("OpenBLAS runs its ", core, " kernels on this AVX-512 CPU (about 4.6x slower "
                 "fp32 GEMM); start the program with OPENBLAS_CORETYPE=SkylakeX in its environment "
                 "or through `torchspeed launch`, which sets it");
    }
  }
  g_runtime = rt;
  return *g_runtime;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_runtime.has_value();
}

const Runtime& runtime() {
  std::lock_guard<std::mutex> lock(g_mu);
  TS_CHECK(g_runtime.has_value(), "torchspeed::init() has not been called");
  return *g_runtime;
}

void shutdown() {
  std::vector<std::function<void()>> hooks;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_finalized || !g_runtime) return;
    g_finalized = true;
    hooks.swap(g_hooks);
    failure = g_comm_failure;
  }
  for (auto& h : hooks) h();
  if (!failure.empty()) abort_job(concat(kRankEndsJob, ": ", failure), 3);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void abort_job(const std::string& message, int exit_code) {
  log::error(message);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string v(buf, static_cast<size_t>(len));
  auto nl = v.find_first_of("\n,");
  return nl == std::string::npos ? v : v.substr(0, nl);
}

const char* version() { return TORCHSPEED_VERSION; }

namespace runtime_detail {
void add_shutdown_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_hooks.push_back(std::move(hook));
}
void mark_comm_failed(const std::string& what) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_comm_failure.empty()) g_comm_failure = what;
}
bool comm_failed() {
  std::lock_guard<std::mutex> lock(g_mu);
  return !g_comm_failure.empty();
}
}  // namespace runtime_detail

}  // namespace torchspeed
