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
  // When not empty, these hosts (filters already applied) instead of the hostfile's: an elastic
  // restart's hosts that still answer.
  std::vector<HostSlots> hosts;
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

// Runs argv (mpirun) in a process group of its own, its standard error passed through this
// process and watched: once mpirun says the job is failing (a rank aborted or died, a daemon is
// lost), it gets grace_s to end, and is killed (with its group) after that. mpirun otherwise
// waits for minutes for a daemon on an unreachable host. Ctrl-C is passed on (SIGINT; a second
// one kills); *interrupted says whether one came. Returns mpirun's exit status.
int run_watched(const std::vector<std::string>& argv, double grace_s, bool* interrupted = nullptr);

// Note [Elastic restart] (launcher.cpp): `torchspeed launch --max-restarts N`.
struct ElasticOptions {
  int max_restarts = 0;
  double probe_timeout_s = 30;  // how long a host may take to start a probe process
  double abort_grace_s = 30;    // how long mpirun may take to end once the job failed
  // Injectable for tests. `run`: runs the job's argv and returns its exit status (default
  // run_watched). `probe`: for each host, "" when it answers, else why not (default probe_hosts).
  std::function<int(const std::vector<std::string>&)> run;
  std::function<std::vector<std::string>(const std::vector<std::string>&)> probe;
};
// Runs the job and, each time it fails, restarts it (at most max_restarts times) on the hosts
// that still answer, one rank per slot; TORCHSPEED_RESTART_COUNT tells the ranks which attempt
// they are. Messages go to stderr. Returns the last attempt's exit status.
int run_elastic(const LaunchOptions& options, const LaunchContext& ctx, const ElasticOptions& elastic);

// Starts `true` on each host through mpirun (the job's own start-up path: the rsh agent, the
// daemon's connection back over the network), all at once. For each host: "" when it ran within
// timeout_s, else the reason (mpirun's last message, or no answer in time).
std::vector<std::string> probe_hosts(const std::vector<std::string>& hosts, const std::string& mpirun, bool is_root,
                                     double timeout_s);

// True when this process was started by an MPI launcher or Slurm (then no launch is needed).
bool under_launcher();

// Note [Relaunching a command]: a CLI command asked for N ranks outside a launcher (`torchspeed
// train -n 2 ...`) runs itself again under mpirun. The ranks get the user's own arguments,
// forwarded unchanged, so no option can be forgotten on the way; only what the relaunch itself
// decides is changed: options dropped by name (a secret that travels in the environment
// instead, a value the relaunch sets itself) and arguments appended after the user's.
struct Relaunch {
  int num_ranks = 1;
  std::string hostfile;
  std::string self_path;          // this executable
  std::vector<std::string> args;  // the arguments the user gave it (argv after the program name)
  // Options not forwarded, with their values ("--api-key" drops "--api-key K" and "--api-key=K").
  std::vector<std::string> drop;
  std::vector<std::string> append;     // arguments after the user's
  std::vector<std::string> extra_env;  // NAME=VALUE on every rank
  enum class How {
    kExec,      // mpirun replaces this process
    kRun,       // mpirun runs as a child; its exit status is returned
    kShielded,  // as kRun, in its own process group: Ctrl-C calls on_interrupt (run_command_shielded)
  } how = How::kRun;
  std::function<void()> on_interrupt;
};
// The program argv the ranks run: self_path, args without `drop`, then `append`, then "--" and
// what followed it in args (a program's own arguments, forwarded untouched).
std::vector<std::string> relaunch_program(const Relaunch& r);
// Launches relaunch_program(r) on r.num_ranks ranks (this machine's LaunchContext) and returns
// mpirun's exit status (never returns with kExec).
int relaunch_under_mpirun(const Relaunch& r);

}  // namespace torchspeed::launcher
