// mpirun command construction and process start-up (execvp / posix_spawnp, no shell).
#include "torchspeed/launch/launcher.h"

#include <signal.h>
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "torchspeed/base/cpu.h"
#include "torchspeed/comm/runtime.h"
#include "torchspeed/base/error.h"

extern char** environ;

namespace torchspeed::launcher {
namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) out.push_back(cur);
  return out;
}

bool valid_host(const std::string& h) {
  return !h.empty() && h[0] != '-' &&
         std::all_of(h.begin(), h.end(), [](unsigned char c) {
           return std::isalnum(c) || c == '.' || c == '-' || c == '_' || c == ':';
         });
}

// "host1@host2:0,2" -> host -> slots (empty = all).
std::map<std::string, std::set<int>> parse_filter(const std::string& spec, const char* flag) {
  std::map<std::string, std::set<int>> out;
  for (const auto& part : split(spec, '@')) {
    std::string p = trim(part);
    TS_CHECK(!p.empty(), flag, " '", spec, "': empty host entry");
    auto colon = p.find(':');
    std::string host = p.substr(0, colon);
    TS_CHECK(valid_host(host), flag, " '", spec, "': invalid host name '", host, "'");
    auto& slots = out[host];
    if (colon == std::string::npos) continue;
    for (const auto& s : split(p.substr(colon + 1), ',')) {
      char* end = nullptr;
      long v = std::strtol(s.c_str(), &end, 10);
      TS_CHECK(!s.empty() && end && *end == '\0' && v >= 0, flag, " '", spec,
               "': slot '", s, "' of host ", host, " is not a non-negative integer");
      slots.insert(static_cast<int>(v));
    }
  }
  return out;
}

}  // namespace

std::vector<HostSlots> parse_hostfile_text(const std::string& text, const std::string& name) {
  std::vector<HostSlots> hosts;
  std::set<std::string> seen;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    line = trim(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::string host, slots_field, extra;
    fields >> host >> slots_field >> extra;
    TS_CHECK(valid_host(host), name, ":", lineno, ": invalid host name '", host, "'");
    TS_CHECK(slots_field.rfind("slots=", 0) == 0 && extra.empty(), name, ":", lineno,
             ": expected 'HOST slots=N', found '", line, "'");
    char* end = nullptr;
    long n = std::strtol(slots_field.c_str() + 6, &end, 10);
    TS_CHECK(end && *end == '\0' && n > 0 && n < 1000000, name, ":", lineno,
             ": slots must be a positive integer, found '", slots_field.substr(6), "'");
    TS_CHECK(seen.insert(host).second, name, ":", lineno, ": host '", host,
             "' is listed twice");
    HostSlots h{host, {}};
    for (int i = 0; i < n; ++i) h.slots.push_back(i);
    hosts.push_back(std::move(h));
  }
  TS_CHECK(!hosts.empty(), name, ": no hosts found (expected lines 'HOST slots=N')");
  return hosts;
}

std::vector<HostSlots> parse_hostfile(const std::string& path) {
  std::ifstream in(path);
  TS_CHECK(in.good(), "cannot open hostfile '", path, "': ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hostfile_text(ss.str(), path);
}

std::vector<HostSlots> filter_hosts(const std::vector<HostSlots>& hosts,
                                    const std::string& include, const std::string& exclude) {
  TS_CHECK(include.empty() || exclude.empty(), "--include and --exclude are mutually exclusive");
  if (include.empty() && exclude.empty()) return hosts;
  const bool inc = !include.empty();
  auto filter = parse_filter(inc ? include : exclude, inc ? "--include" : "--exclude");
  for (const auto& [host, slots] : filter) {
    auto it = std::find_if(hosts.begin(), hosts.end(), [&](const HostSlots& h) { return h.host == host; });
    TS_CHECK(it != hosts.end(), inc ? "--include" : "--exclude", ": host '", host,
             "' is not in the hostfile");
    for (int s : slots) {
      TS_CHECK(std::find(it->slots.begin(), it->slots.end(), s) != it->slots.end(),
               inc ? "--include" : "--exclude", ": host '", host, "' has no slot ", s, " (slots 0..",
               it->slots.size() - 1, ")");
    }
  }
  std::vector<HostSlots> out;
  for (const auto& h : hosts) {
    auto f = filter.find(h.host);
    HostSlots kept{h.host, {}};
    for (int s : h.slots) {
      bool listed = f != filter.end() && (f->second.empty() || f->second.count(s));
      if (listed == inc) kept.slots.push_back(s);
    }
    if (!kept.slots.empty()) out.push_back(std::move(kept));
  }
  TS_CHECK(!out.empty(), "--include/--exclude left no slots to run on");
  return out;
}

LaunchContext LaunchContext::current() {
  LaunchContext ctx;
  ctx.is_root = geteuid() == 0;
  ctx.local_cores = cpu::features().logical_cores;
  ctx.openblas_coretype = cpu::recommended_openblas_coretype();
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    std::string name = kv.substr(0, kv.find('='));
    if (name.rfind("TORCHSPEED_", 0) == 0 || name.rfind("OPENBLAS_", 0) == 0 ||
        name.rfind("OMP_", 0) == 0) {
      ctx.env_names.push_back(name);
    }
  }
  std::sort(ctx.env_names.begin(), ctx.env_names.end());
  return ctx;
}

std::vector<std::string> build_command(const LaunchOptions& o, const LaunchContext& ctx) {
  TS_CHECK(!o.program.empty(), "launch: no program given (usage: torchspeed launch -n N -- PROGRAM ARGS...)");
  TS_CHECK(o.num_ranks >= 0, "launch: -n must be >= 1, got ", o.num_ranks);
  std::vector<std::string> argv{o.mpirun};
  int ranks = o.num_ranks;
  bool oversubscribe = false;
  bool multi_node = false;
  if (!o.hostfile.empty() || !o.hosts.empty()) {
    auto hosts = !o.hosts.empty() ? o.hosts : filter_hosts(parse_hostfile(o.hostfile), o.include, o.exclude);
    int slots = 0;
    std::string list;
    for (const auto& h : hosts) {
      slots += static_cast<int>(h.slots.size());
      list += concat(list.empty() ? "" : ",", h.host, ":", h.slots.size());
    }
    if (ranks == 0) ranks = slots;
    oversubscribe = ranks > slots;
    multi_node = hosts.size() > 1;
    argv.insert(argv.end(), {"--host", list});
  } else {
    TS_CHECK(o.include.empty() && o.exclude.empty(), "launch: --include/--exclude need --hostfile");
    if (ranks == 0) ranks = 1;
    oversubscribe = ranks > ctx.local_cores;
  }
  argv.insert(argv.end(), {"-np", std::to_string(ranks)});
  if (ctx.is_root) argv.push_back("--allow-run-as-root");
  if (oversubscribe) argv.push_back("--oversubscribe");
  // Each rank gets cores/ranks cores to itself when they divide evenly on one node; otherwise
  // no binding (mpirun's default binds every rank to a single core).
  if (!multi_node && !oversubscribe && ctx.local_cores % ranks == 0) {
    argv.insert(argv.end(), {"--map-by", concat("slot:PE=", ctx.local_cores / ranks), "--bind-to", "core"});
  } else {
    argv.insert(argv.end(), {"--bind-to", "none"});
  }
  // Environment: what the ranks need, exported by name (mpirun -x NAME=VALUE / -x NAME).
  if (!ctx.openblas_coretype.empty()) argv.insert(argv.end(), {"-x", "OPENBLAS_CORETYPE=" + ctx.openblas_coretype});
  for (const auto& name : ctx.env_names) {
    if (name == "OPENBLAS_CORETYPE" && !ctx.openblas_coretype.empty()) continue;
    argv.insert(argv.end(), {"-x", name});
  }
  for (const auto& kv : o.extra_env) {
    TS_CHECK(kv.find('=') != std::string::npos && kv[0] != '=', "launch: environment entry '", kv,
             "' must be NAME=VALUE");
    argv.insert(argv.end(), {"-x", kv});
  }
  if (multi_node) argv.insert(argv.end(), {"-x", "PATH", "-x", "LD_LIBRARY_PATH"});
  argv.insert(argv.end(), o.program.begin(), o.program.end());
  return argv;
}

std::string render_command(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    bool plain = !a.empty() && std::all_of(a.begin(), a.end(), [](unsigned char c) {
      return std::isalnum(c) || std::strchr("-_./=:,@%+", c);
    });
    std::string q = a;
    if (!plain) {
      q = "'";
      for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
      q += "'";
    }
    out += (out.empty() ? "" : " ") + q;
  }
  return out;
}

void exec_command(const std::vector<std::string>& argv) {
  TS_CHECK(!argv.empty(), "exec_command: empty command");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execvp(args[0], args.data());
  throw Error(concat("cannot start '", argv[0], "': ", std::strerror(errno),
                  argv[0] == "mpirun" ? " (install OpenMPI: apt-get install openmpi-bin)" : ""));
}

int run_command(const std::vector<std::string>& argv, const std::string& stdout_path,
                const std::string& stderr_path) {
  TS_CHECK(!argv.empty(), "run_command: empty command");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  if (!stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  pid_t pid;
  int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  TS_CHECK(rc == 0, "cannot start '", argv[0], "': ", std::strerror(rc));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    TS_CHECK(errno == EINTR, "waiting for '", argv[0], "': ", std::strerror(errno));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

void reexec_with_fast_blas(int argc, char** argv) {
  const std::string core = cpu::recommended_openblas_coretype();
  if (core.empty() || std::getenv("TORCHSPEED_BLAS_REEXEC")) return;
  setenv("OPENBLAS_CORETYPE", core.c_str(), 0);
  setenv("TORCHSPEED_BLAS_REEXEC", "1", 1);  // at most once, even if exec'ing changes nothing
  std::vector<char*> args(argv, argv + argc);
  args.push_back(nullptr);
  execv("/proc/self/exe", args.data());
  // exec failed: carry on with the slow kernels rather than fail.
}

namespace {
volatile sig_atomic_t g_interrupts = 0;
void count_interrupt(int) { g_interrupts = g_interrupts + 1; }

// Counts SIGINT/SIGTERM (instead of dying of them) while it lives; restores what was there.
class InterruptGuard {
 public:
  InterruptGuard() : start_(g_interrupts) {
    struct sigaction sa {};
    sa.sa_handler = count_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~InterruptGuard() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;
  int count() const { return g_interrupts - start_; }

 private:
  int start_;
  struct sigaction old_int_ {}, old_term_ {};
};
}  // namespace

int run_command_shielded(const std::vector<std::string>& argv, const std::function<void()>& on_interrupt) {
  TS_CHECK(!argv.empty(), "run_command_shielded: empty command");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const InterruptGuard guard;  // before the child exists, so no Ctrl-C falls between
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);  // a new group led by the child
  pid_t pid;
  int rc = posix_spawnp(&pid, args[0], nullptr, &attr, args.data(), environ);
  posix_spawnattr_destroy(&attr);
  TS_CHECK(rc == 0, "cannot start '", argv[0], "': ", std::strerror(rc));
  int handled = 0, status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    TS_CHECK(errno == EINTR, "waiting for '", argv[0], "': ", std::strerror(errno));
    if (guard.count() > handled) {
      if (handled == 0 && on_interrupt) on_interrupt();
      if (guard.count() >= 2) ::kill(-pid, SIGTERM);  // a second Ctrl-C: stop now
      handled = guard.count();
    }
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

int run_watched(const std::vector<std::string>& argv, double grace_s, bool* interrupted) {
  TS_CHECK(!argv.empty(), "run_watched: empty command");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const InterruptGuard guard;  // before the child exists: a Ctrl-C from here on is passed on
  int fds[2];
  TS_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "launch: cannot create a pipe: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) ::close(fds[0]);
  TS_CHECK(rc == 0, "cannot start '", argv[0], "': ", std::strerror(rc));
  int handled = 0;
  // What mpirun prints once the job is ending because of a failure, and what our ranks print when
  // they end it (mpirun has been seen to hang in its own error reporting, ORTE's show_help, when a
  // host's link is down, before printing any of its messages).
  static const char* const kEnding[] = {"MPI_ABORT was invoked", "noticed that process rank", "lost communication with a remote daemon",
                                        "ORTE was unable to reliably start", "exited with non-zero status", "non-zero exit code",
                                        kRankEndsJob};
  std::string window;
  bool ending = false, killed = false, open = true;
  auto ending_at = std::chrono::steady_clock::now();
  int status = 0;
  auto drain = [&](int timeout_ms) {
    if (!open) return;
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return;
    char buf[4096];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) {
      if (n == 0 || errno != EINTR) open = false;
      return;
    }
    ssize_t off = 0;
    while (off < n) {
      const ssize_t w = ::write(STDERR_FILENO, buf + off, static_cast<size_t>(n - off));
      if (w <= 0 && errno != EINTR) break;
      if (w > 0) off += w;
    }
    window.append(buf, static_cast<size_t>(n));
    for (const char* marker : kEnding) {
      if (!ending && window.find(marker) != std::string::npos) {
        ending = true;
        ending_at = std::chrono::steady_clock::now();
      }
    }
    if (window.size() > 256) window.erase(0, window.size() - 256);
  };
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) {  // cannot happen for our own child; do not leave it behind
      const int err = errno;
      ::kill(-pid, SIGKILL);
      ::close(fds[0]);
      TS_CHECK(false, "waiting for '", argv[0], "': ", std::strerror(err));
    }
    if (guard.count() > handled) {  // Ctrl-C: mpirun stops its ranks; a second one kills it
      ::kill(-pid, guard.count() >= 2 ? SIGKILL : SIGINT);
      handled = guard.count();
    }
    if (ending && !killed &&
        std::chrono::steady_clock::now() - ending_at > std::chrono::duration<double>(grace_s)) {
      std::fprintf(stderr,
                   "\nlaunch: mpirun has not ended %g s after the job failed (a host it has to tell is likely unreachable); "
                   "stopping it\n", grace_s);
      ::kill(-pid, SIGKILL);
      killed = true;
    }
    if (open) {
      drain(200);
    } else {
      ::usleep(200000);
    }
  }
  while (open) {  // what is left in the pipe; ranks that outlive mpirun may hold it open
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) break;
    drain(0);
  }
  ::close(fds[0]);
  if (interrupted) *interrupted = guard.count() > 0;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

// Note [Elastic restart]
// `torchspeed launch --max-restarts N --hostfile F -- PROGRAM` runs the job; when it fails (a
// rank exits with an error, or mpirun loses a host's daemon, e.g. because the host died),
// every host of the job is probed the way the job itself starts there: mpirun runs `true` on
// it through the same rsh agent, and the host's daemon has to connect back over the network.
// Hosts that do not answer within the probe timeout are named with the ranks they held and
// dropped; the job restarts on the rest, one rank per slot, with TORCHSPEED_RESTART_COUNT set.
// Restarting resumes only if PROGRAM does: `torchspeed train --resume` continues from
// OUT/checkpoints/latest, resharded to the new data-parallel size, and keeps the global batch
// (train_batch_size) by raising gradient accumulation when it divides (the config's batch rule
// refuses it, by key, when it does not). A dead host ends the job as fast as its failure is
// seen: mpirun aborts when a daemon's connection closes (the host's processes were killed), and
// a rank blocked on a host that is silent (its link is down) fails at its collective's deadline
// (TORCHSPEED_COMM_TIMEOUT_S or torchspeed.comm_timeout_s), naming the op and group. mpirun then
// waits for minutes to tell the silent host's daemon to stop; run_watched() gives it
// --abort-grace seconds after it reports the failure and then stops it. Without a hostfile the
// job restarts on this machine as it was. Ctrl-C is passed to the job and ends the launcher
// without a restart.

namespace {
std::string first_paragraph(const std::string& path) {  // of mpirun's message: its summary
  std::ifstream in(path);
  std::string line, out;
  while (std::getline(in, line)) {
    const std::string t = trim(line);
    const bool rule = !t.empty() && t.find_first_not_of('-') == std::string::npos;
    if (t.empty() || rule) {
      if (!out.empty()) break;
      continue;
    }
    out += (out.empty() ? "" : " ") + t;
    if (out.size() > 200) return out.substr(0, 200) + "...";
  }
  return out;
}
}  // namespace

std::vector<std::string> probe_hosts(const std::vector<std::string>& hosts, const std::string& mpirun, bool is_root,
                                     double timeout_s) {
  struct Probe {
    pid_t pid = -1;
    std::string log;
    std::string why;
    bool done = false;
  };
  std::vector<Probe> probes(hosts.size());
  char dir_template[] = "/tmp/ts-probe.XXXXXX";
  const char* dir = mkdtemp(dir_template);
  TS_CHECK(dir, "launch: cannot create a temporary folder for host probes: ", std::strerror(errno));
  for (size_t i = 0; i < hosts.size(); ++i) {
    std::vector<std::string> argv{mpirun, "--host", hosts[i] + ":1", "-np", "1", "--bind-to", "none"};
    if (is_root) argv.push_back("--allow-run-as-root");
    argv.push_back("true");
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    probes[i].log = concat(dir, "/", i, ".log");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, probes[i].log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);  // its own group: a probe that hangs is killed whole
    const int rc = posix_spawnp(&probes[i].pid, args[0], &actions, &attr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
      probes[i].why = concat("cannot start '", mpirun, "': ", std::strerror(rc));
      probes[i].done = true;
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const int interrupts_before = g_interrupts;  // counted where the caller guards (run_elastic)
  for (;;) {
    bool pending = false;
    for (auto& p : probes) {
      if (p.done) continue;
      int status = 0;
      const pid_t r = waitpid(p.pid, &status, WNOHANG);
      if (r == 0) {
        pending = true;
        continue;
      }
      p.done = true;
      const int code = r < 0 ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0) {
        const std::string said = first_paragraph(p.log);
        p.why = concat("mpirun could not start a process there (exit status ", code, said.empty() ? "" : ": ", said, ")");
      }
    }
    if (!pending) break;
    const bool interrupted = g_interrupts != interrupts_before;
    if (interrupted || std::chrono::steady_clock::now() >= deadline) {
      for (auto& p : probes) {
        if (p.done) continue;
        ::kill(-p.pid, SIGKILL);
        while (waitpid(p.pid, nullptr, 0) < 0 && errno == EINTR) {
        }
        p.done = true;
        p.why = interrupted ? std::string("interrupted") : concat("no answer within ", timeout_s, " s");
      }
      break;
    }
    ::usleep(20000);
  }
  std::vector<std::string> out;
  for (auto& p : probes) {
    out.push_back(p.why);
    if (!p.log.empty()) std::remove(p.log.c_str());
  }
  ::rmdir(dir);
  return out;
}

int run_elastic(const LaunchOptions& o, const LaunchContext& ctx, const ElasticOptions& e) {
  TS_CHECK(e.max_restarts >= 0, "launch: --max-restarts must be >= 0, got ", e.max_restarts);
  TS_CHECK(e.probe_timeout_s > 0, "launch: --probe-timeout must be > 0 seconds, got ", e.probe_timeout_s);
  const InterruptGuard guard;  // a Ctrl-C between attempts (while probing) ends the launcher cleanly
  bool interrupted = false;
  const auto run = e.run ? e.run : [&](const std::vector<std::string>& argv) { return run_watched(argv, e.abort_grace_s, &interrupted); };
  const auto probe = e.probe ? e.probe : [&](const std::vector<std::string>& hosts) {
    return probe_hosts(hosts, o.mpirun, ctx.is_root, e.probe_timeout_s);
  };
  LaunchOptions cur = o;
  const bool with_hosts = !o.hostfile.empty() || !o.hosts.empty();
  if (with_hosts) {
    if (cur.hosts.empty()) cur.hosts = filter_hosts(parse_hostfile(o.hostfile), o.include, o.exclude);
    TS_CHECK(o.num_ranks == 0 || e.max_restarts == 0, "launch: with --max-restarts the job runs one rank per slot of the hosts ",
             "that answer; leave out -n (", o.num_ranks, ")");
  }
  for (int attempt = 0;; ++attempt) {
    LaunchOptions job = cur;
    job.extra_env.push_back(concat("TORCHSPEED_RESTART_COUNT=", attempt));
    std::fflush(stdout);
    const int rc = run(build_command(job, ctx));
    if (rc == 0) return 0;
    if (interrupted || guard.count() > 0 || rc == 128 + SIGINT) {  // not a failure to recover from
      std::fprintf(stderr, "launch: interrupted; not restarting\n");
      return rc;
    }
    if (attempt >= e.max_restarts) {
      if (e.max_restarts > 0) {
        std::fprintf(stderr, "launch: the job failed (exit status %d) and all %d restarts are used; giving up\n", rc,
                     e.max_restarts);
      }
      return rc;
    }
    if (!with_hosts) {
      std::fprintf(stderr, "launch: the job failed (exit status %d); restarting it (restart %d of %d)\n", rc, attempt + 1,
                   e.max_restarts);
      continue;
    }
    std::vector<std::string> names;
    int world = 0;
    for (const auto& h : cur.hosts) {
      names.push_back(h.host);
      world += static_cast<int>(h.slots.size());
    }
    std::fprintf(stderr, "launch: the job failed (exit status %d); checking which of its %zu hosts answer\n", rc, names.size());
    const std::vector<std::string> why = probe(names);
    if (guard.count() > 0) {
      std::fprintf(stderr, "launch: interrupted while probing the hosts; not restarting\n");
      return rc;
    }
    TS_INTERNAL_ASSERT(why.size() == names.size(), "probe answered for ", why.size(), " of ", names.size(), " hosts");
    std::vector<HostSlots> alive;
    int first = 0, ranks = 0;
    for (size_t i = 0; i < cur.hosts.size(); ++i) {
      const int n = static_cast<int>(cur.hosts[i].slots.size());
      if (why[i].empty()) {
        alive.push_back(cur.hosts[i]);
        ranks += n;
      } else {
        std::fprintf(stderr, "launch: host %s (rank%s %d%s of %d) does not answer: %s\n", names[i].c_str(), n > 1 ? "s" : "", first,
                     n > 1 ? concat("-", first + n - 1).c_str() : "", world, why[i].c_str());
      }
      first += n;
    }
    if (alive.empty()) {
      std::fprintf(stderr, "launch: no host of the job answers; giving up\n");
      return rc;
    }
    if (alive.size() == cur.hosts.size()) {
      std::fprintf(stderr, "launch: every host answers; restarting on all %zu hosts, %d ranks (restart %d of %d)\n", alive.size(),
                   ranks, attempt + 1, e.max_restarts);
    } else {
      std::fprintf(stderr, "launch: restarting on the %zu host%s, %d ranks instead of %d (restart %d of %d)\n",
                   alive.size(), alive.size() > 1 ? "s that answer" : " that answers", ranks, world, attempt + 1, e.max_restarts);
    }
    cur.hosts = std::move(alive);
  }
}

bool under_launcher() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") ||
         std::getenv("PMIX_RANK") || (std::getenv("SLURM_PROCID") && std::getenv("SLURM_NTASKS") &&
                                      std::getenv("SLURM_STEP_ID"));
}

std::vector<std::string> relaunch_program(const Relaunch& r) {
  std::vector<std::string> argv{r.self_path}, program;  // program: "--" and what follows it
  auto dropped = [&](const std::string& a) -> int {  // 0: keep; 1: drop a; 2: drop a and its value
    for (const std::string& d : r.drop) {
      if (a == d) return 2;
      if (a.size() > d.size() && a.compare(0, d.size(), d) == 0 && a[d.size()] == '=') return 1;
    }
    return 0;
  };
  for (size_t i = 0; i < r.args.size(); ++i) {
    if (r.args[i] == "--") {  // everything after belongs to a program, never an option of ours
      program.assign(r.args.begin() + static_cast<std::ptrdiff_t>(i), r.args.end());
      break;
    }
    const int d = dropped(r.args[i]);
    if (d == 2) ++i;
    if (d == 0) argv.push_back(r.args[i]);
  }
  argv.insert(argv.end(), r.append.begin(), r.append.end());
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

int relaunch_under_mpirun(const Relaunch& r) {
  LaunchOptions lo;
  lo.num_ranks = r.num_ranks;
  lo.hostfile = r.hostfile;
  lo.program = relaunch_program(r);
  lo.extra_env = r.extra_env;
  const std::vector<std::string> argv = build_command(lo, LaunchContext::current());
  std::fflush(stdout);
  switch (r.how) {
    case Relaunch::How::kExec: exec_command(argv);
    case Relaunch::How::kRun: return run_command(argv);
    case Relaunch::How::kShielded: return run_command_shielded(argv, r.on_interrupt ? r.on_interrupt : [] {});
  }
  return 1;
}

}  // namespace torchspeed::launcher
