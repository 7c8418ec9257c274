// Builds the mpirun command for a local or multi-node job: DeepSpeed's hostfile ("host
// slots=N") and --include/--exclude filters translated for OpenMPI, root and oversubscription
// flags, core binding, and the environment every rank needs (OPENBLAS_CORETYPE, see
// Note [OpenBLAS core type]). Processes are started with an argv array, never a shell.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace torchspeed::launcher {

struct HostSlots {
  std::string host;
  std::vector<int> slots;  // slot indices on that host (0..n-1)
};

// Parses a DeepSpeed hostfile: one "HOST slots=N" per line; '#' comments and blank lines are
// skipped. Errors name the file and line.
std::vector<HostSlots> parse_hostfile(const std::string& path);
std::vector<HostSlots> parse_hostfile_text(const std::string& text, const std::string& name);

// DeepSpeed's filters: "host1@host2:0,2" keeps all of host1 and slots 0 and 2 of host2
// (--include) or removes them (--exclude). At most one of the two may be given.
std::vector<HostSlots> filter_hosts(const std::vector<HostSlots>& hosts,
                                    const std::string& include, const std::string& exclude);

struct LaunchOptions {
  int num_ranks = 0;             // 0: every slot of the hostfile, or 1 without one
  std::string hostfile;
  std::string include;
  std::string exclude;
  std::vector<std::string> program;  // program and its arguments
  std::vector<std::string> extra_env;  // NAME=VALUE pairs to set on every rank
  std::string mpirun = "mpirun";
};

// Facts about the machine the launcher runs on (injectable for tests).
struct LaunchContext {
  bool is_root = false;
  int local_cores = 1;
  std::string openblas_coretype;     // value to export when not already set, or ""
  std::vector<std::string> env_names;  // names of TORCHSPEED_*/OPENBLAS_*/OMP_* vars to pass on
  static LaunchContext current();
};

// The full mpirun argv (argv[0] = mpirun).
std::vector<std::string> build_command(const LaunchOptions& options, const LaunchContext& ctx);

// Shell-quoted rendering for --dry-run and logs (display only; never executed by a shell).
std::string render_command(const std::vector<std::string>& argv);

// Replaces this process with argv (execvp); returns only by throwing on failure.
[[noreturn]] void exec_command(const std::vector<std::string>& argv);
// Runs argv as a child (posix_spawnp), waits, and returns its exit status. Its standard output
// and error go to the given files when the paths are not empty (truncated first).
int run_command(const std::vector<std::string>& argv, const std::string& stdout_path = "",
                const std::string& stderr_path = "");

// Runs argv (mpirun) in a process group of its own, so a terminal's Ctrl-C reaches only this
// process: the first Ctrl-C calls `on_interrupt` (e.g. asks the ranks to stop cleanly), a second
// one terminates the child's group. Returns the child's exit status.
int run_command_shielded(const std::vector<std::string>& argv, const std::function<void()>& on_interrupt);

// See Note [OpenBLAS core type]: when the CPU has AVX-512 and OPENBLAS_CORETYPE is unset, sets
// it and re-executes this program (same pid, same arguments) so OpenBLAS loads its fast
// kernels. Returns normally when nothing needs doing. For programs that own main(), called
// before anything else (the torchspeed CLI does).
void reexec_with_fast_blas(int argc, char** argv);

// True when this process was started by an MPI launcher or Slurm (then no launch is needed).
bool under_launcher();

}  // namespace torchspeed::launcher
