// Launcher: DeepSpeed hostfiles and filters, and the mpirun command built from them.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <thread>
#include <unistd.h>
#include <filesystem>
#include <fstream>

#include "torchspeed/base/error.h"
#include "test_util.h"
#include "torchspeed/comm/runtime.h"
#include "torchspeed/launch/launcher.h"

using namespace torchspeed::launcher;
using ts_test::expect_error;

namespace {
std::string write_temp(const std::string& name, const std::string& text) {
  auto p = std::filesystem::temp_directory_path() / name;
  std::ofstream(p) << text;
  return p.string();
}
bool contains(const std::vector<std::string>& v, const std::vector<std::string>& seq) {
  return std::search(v.begin(), v.end(), seq.begin(), seq.end()) != v.end();
}
LaunchContext ctx(bool root, int cores, std::string coretype = "") {
  LaunchContext c;
  c.is_root = root;
  c.local_cores = cores;
  c.openblas_coretype = std::move(coretype);
  return c;
}
}  // namespace

TEST(Hostfile, ParsesDeepSpeedFormat) {
  auto hosts = parse_hostfile_text("# cluster\nworker-0 slots=4\n\n  worker-1 slots=2   # half\n", "hf");
  ASSERT_EQ(hosts.size(), 2u);
  EXPECT_EQ(hosts[0].host, "worker-0");
  EXPECT_EQ(hosts[0].slots.size(), 4u);
  EXPECT_EQ(hosts[1].host, "worker-1");
  EXPECT_EQ(hosts[1].slots.size(), 2u);
}

TEST(Hostfile, ErrorsNameFileAndLine) {
  expect_error([] { parse_hostfile_text("a slots=2\nb slots=x\n", "hosts.txt"); }, "hosts.txt:2: slots must be a positive integer");
  expect_error([] { parse_hostfile_text("a slots=2\na slots=1\n", "hosts.txt"); }, "hosts.txt:2: host 'a' is listed twice");
  expect_error([] { parse_hostfile_text("a 2\n", "hosts.txt"); }, "hosts.txt:1: expected 'HOST slots=N'");
  expect_error([] { parse_hostfile_text("$(reboot) slots=1\n", "hosts.txt"); }, "hosts.txt:1: invalid host name");
  expect_error([] { parse_hostfile_text("# nothing\n", "hosts.txt"); }, "hosts.txt: no hosts found");
  expect_error([] { parse_hostfile("/nonexistent/hostfile"); }, "cannot open hostfile '/nonexistent/hostfile'");
}

TEST(Hostfile, IncludeAndExcludeSelectHostsAndSlots) {
  auto hosts = parse_hostfile_text("w0 slots=4\nw1 slots=4\nw2 slots=2\n", "hf");
  auto inc = filter_hosts(hosts, "w0@w1:0,2", "");
  ASSERT_EQ(inc.size(), 2u);
  EXPECT_EQ(inc[0].slots.size(), 4u);
  EXPECT_EQ(inc[1].slots, (std::vector<int>{0, 2}));
  auto exc = filter_hosts(hosts, "", "w1@w2:1");
  ASSERT_EQ(exc.size(), 2u);
  EXPECT_EQ(exc[0].host, "w0");
  EXPECT_EQ(exc[1].host, "w2");
  EXPECT_EQ(exc[1].slots, (std::vector<int>{0}));
  expect_error([&] { filter_hosts(hosts, "w9", ""); }, "host 'w9' is not in the hostfile");
  expect_error([&] { filter_hosts(hosts, "w2:5", ""); }, "host 'w2' has no slot 5");
  expect_error([&] { filter_hosts(hosts, "w0", "w1"); }, "mutually exclusive");
}

TEST(LaunchCommand, LocalJobBindsCoresAndExportsFastBlas) {
  LaunchOptions o;
  o.num_ranks = 2;
  o.program = {"./train", "--config", "a b.json", "; rm -rf /"};
  auto argv = build_command(o, ctx(true, 2, "SkylakeX"));
  EXPECT_EQ(argv[0], "mpirun");
  EXPECT_TRUE(contains(argv, {"-np", "2"}));
  EXPECT_TRUE(contains(argv, {"--allow-run-as-root"}));
  EXPECT_TRUE(contains(argv, {"--map-by", "slot:PE=1", "--bind-to", "core"}));
  EXPECT_TRUE(contains(argv, {"-x", "OPENBLAS_CORETYPE=SkylakeX"}));
  EXPECT_FALSE(contains(argv, {"--oversubscribe"}));
  // The program's arguments stay separate argv entries: nothing is interpreted by a shell.
  EXPECT_TRUE(contains(argv, {"./train", "--config", "a b.json", "; rm -rf /"}));
  EXPECT_EQ(render_command({"mpirun", "a b", "it's"}), "mpirun 'a b' 'it'\\''s'");
}

TEST(LaunchCommand, MoreRanksThanCoresOversubscribe) {
  LaunchOptions o;
  o.num_ranks = 8;
  o.program = {"prog"};
  auto argv = build_command(o, ctx(false, 2));
  EXPECT_TRUE(contains(argv, {"--oversubscribe"}));
  EXPECT_TRUE(contains(argv, {"--bind-to", "none"}));
  EXPECT_FALSE(contains(argv, {"--allow-run-as-root"}));
  EXPECT_FALSE(std::any_of(argv.begin(), argv.end(), [](const std::string& a) { return a.find("OPENBLAS") != std::string::npos; }));
}

TEST(LaunchCommand, OneRankGetsEveryCore) {
  LaunchOptions o;
  o.program = {"prog"};
  auto argv = build_command(o, ctx(false, 4));
  EXPECT_TRUE(contains(argv, {"-np", "1"}));
  EXPECT_TRUE(contains(argv, {"--map-by", "slot:PE=4"}));
}

TEST(LaunchCommand, HostfileBecomesHostList) {
  LaunchOptions o;
  o.hostfile = write_temp("ts_hostfile", "w0 slots=2\nw1 slots=2\n");
  o.include = "w0@w1:1";
  o.program = {"prog"};
  o.extra_env = {"FOO=1"};
  LaunchContext c = ctx(false, 2);
  c.env_names = {"TORCHSPEED_COMM_TIMEOUT_S"};
  auto argv = build_command(o, c);
  EXPECT_TRUE(contains(argv, {"--host", "w0:2,w1:1"}));
  EXPECT_TRUE(contains(argv, {"-np", "3"}));  // every selected slot by default
  EXPECT_TRUE(contains(argv, {"-x", "TORCHSPEED_COMM_TIMEOUT_S"}));
  EXPECT_TRUE(contains(argv, {"-x", "FOO=1"}));
  EXPECT_TRUE(contains(argv, {"-x", "PATH", "-x", "LD_LIBRARY_PATH"}));
  o.extra_env = {"NOEQUALS"};
  expect_error([&] { build_command(o, c); }, "must be NAME=VALUE");
  LaunchOptions none;
  expect_error([&] { build_command(none, c); }, "no program given");
}

// Note [Elastic restart]: a failed job is probed host by host and restarted on the hosts that
// answer, one rank per slot, with TORCHSPEED_RESTART_COUNT; the restarts stop at the limit.
TEST(ElasticLaunch, RestartsOnTheHostsThatAnswer) {
  LaunchOptions o;
  o.hostfile = write_temp("ts_hostfile_elastic", "w0 slots=2\nw1 slots=2\nw2 slots=1\n");
  o.program = {"prog", "--resume"};
  std::vector<std::vector<std::string>> runs;
  std::vector<std::vector<std::string>> probed;
  ElasticOptions e;
  e.max_restarts = 3;
  std::vector<int> statuses{9, 1, 0};
  e.run = [&](const std::vector<std::string>& argv) {
    runs.push_back(argv);
    return statuses.at(runs.size() - 1);
  };
  e.probe = [&](const std::vector<std::string>& hosts) {
    probed.push_back(hosts);
    std::vector<std::string> why(hosts.size());
    for (size_t i = 0; i < hosts.size(); ++i) {
      if (hosts[i] == "w1" || (probed.size() == 2 && hosts[i] == "w2")) why[i] = "no answer within 30 s";
    }
    return why;
  };
  testing::internal::CaptureStderr();
  EXPECT_EQ(run_elastic(o, ctx(true, 2), e), 0);
  const std::string log = testing::internal::GetCapturedStderr();
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_TRUE(contains(runs[0], {"--host", "w0:2,w1:2,w2:1"}));
  EXPECT_TRUE(contains(runs[0], {"-np", "5"}));
  EXPECT_TRUE(contains(runs[0], {"-x", "TORCHSPEED_RESTART_COUNT=0"}));
  EXPECT_TRUE(contains(runs[1], {"--host", "w0:2,w2:1"}));
  EXPECT_TRUE(contains(runs[1], {"-np", "3"}));
  EXPECT_TRUE(contains(runs[1], {"-x", "TORCHSPEED_RESTART_COUNT=1"}));
  EXPECT_TRUE(contains(runs[2], {"--host", "w0:2"}));
  EXPECT_TRUE(contains(runs[2], {"-np", "2"}));
  EXPECT_TRUE(contains(runs[2], {"prog", "--resume"}));
  ASSERT_EQ(probed.size(), 2u);
  EXPECT_EQ(probed[1], (std::vector<std::string>{"w0", "w2"}));
  EXPECT_NE(log.find("host w1 (ranks 2-3 of 5) does not answer: no answer within 30 s"), std::string::npos) << log;
  EXPECT_NE(log.find("host w2 (rank 2 of 3) does not answer"), std::string::npos) << log;
  EXPECT_NE(log.find("3 ranks instead of 5 (restart 1 of 3)"), std::string::npos) << log;
}

TEST(ElasticLaunch, StopsAtTheLimitAndWhenNoHostAnswers) {
  LaunchOptions o;
  o.hostfile = write_temp("ts_hostfile_elastic2", "w0 slots=2\nw1 slots=2\n");
  o.program = {"prog"};
  int runs = 0;
  ElasticOptions e;
  e.max_restarts = 2;
  e.run = [&](const std::vector<std::string>&) { return ++runs, 7; };
  e.probe = [](const std::vector<std::string>& hosts) { return std::vector<std::string>(hosts.size()); };  // all answer
  testing::internal::CaptureStderr();
  EXPECT_EQ(run_elastic(o, ctx(false, 2), e), 7);
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(runs, 3);  // the first run and 2 restarts
  EXPECT_NE(log.find("every host answers; restarting on all 2 hosts"), std::string::npos) << log;
  EXPECT_NE(log.find("all 2 restarts are used"), std::string::npos) << log;

  runs = 0;
  e.probe = [](const std::vector<std::string>& hosts) { return std::vector<std::string>(hosts.size(), "gone"); };
  testing::internal::CaptureStderr();
  EXPECT_EQ(run_elastic(o, ctx(false, 2), e), 7);
  log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(runs, 1);
  EXPECT_NE(log.find("no host of the job answers"), std::string::npos) << log;

  // An interrupted job is not restarted; -n is refused (the slots of the hosts alive decide).
  runs = 0;
  e.run = [&](const std::vector<std::string>&) { return ++runs, 130; };
  EXPECT_EQ(run_elastic(o, ctx(false, 2), e), 130);
  EXPECT_EQ(runs, 1);
  o.num_ranks = 3;
  expect_error([&] { run_elastic(o, ctx(false, 2), e); }, "leave out -n (3)");
}

// The probe runs mpirun for real: a missing mpirun is a reason, not a crash.
TEST(ElasticLaunch, ProbeNamesWhyAHostDoesNotAnswer) {
  const auto why = probe_hosts({"w0"}, "/nonexistent/mpirun", false, 5);
  ASSERT_EQ(why.size(), 1u);
  EXPECT_NE(why[0].find("/nonexistent/mpirun"), std::string::npos) << why[0];
  // A probe that hangs is cut at the timeout ("sleep" stands in for mpirun and ignores its arguments' meaning).
  const std::string script = write_temp("ts_fake_mpirun", "#!/bin/sh\nexec sleep 30\n");
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);
  const auto t0 = std::chrono::steady_clock::now();
  const auto hung = probe_hosts({"w0", "w1"}, script, false, 0.5);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  EXPECT_EQ(hung, (std::vector<std::string>{"no answer within 0.5 s", "no answer within 0.5 s"}));
  const std::string failing = write_temp("ts_fake_mpirun2", "#!/bin/sh\nprintf -- '-----\\nORTE was unable to\\nreach host\\n\\n* a detail\\n-----\\n' >&2\nexit 3\n");
  std::filesystem::permissions(failing, std::filesystem::perms::owner_all);
  const auto failed = probe_hosts({"w0"}, failing, false, 5);
  EXPECT_EQ(failed[0], "mpirun could not start a process there (exit status 3: ORTE was unable to reach host)");
}

// mpirun that hangs after a rank aborted (it cannot reach a dead host's daemon) is stopped after
// the grace period; one that ends by itself keeps its exit status and its messages pass through.
TEST(ElasticLaunch, MpirunHangingAfterAnAbortIsStopped) {
  const std::string hang = write_temp("ts_fake_mpirun3",
                                      "#!/bin/sh\necho 'MPI_ABORT was invoked on rank 1' >&2\nexec sleep 60\n");
  std::filesystem::permissions(hang, std::filesystem::perms::owner_all);
  testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  bool interrupted = true;
  const int rc = run_watched({hang}, 0.5, &interrupted);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 128 + 9);
  EXPECT_FALSE(interrupted);
  EXPECT_LT(took, 10.0);
  EXPECT_NE(log.find("MPI_ABORT was invoked on rank 1"), std::string::npos) << log;
  EXPECT_NE(log.find("mpirun has not ended 0.5 s after the job failed"), std::string::npos) << log;

  // A rank's own "ending the job" line counts too (mpirun hung before its abort message once, in
  // multihost_elastic_link with the link down).
  const std::string rank_ends = write_temp("ts_fake_mpirun5",
                                           std::string("#!/bin/sh\necho '[rank 0/4] error: ") + torchspeed::kRankEndsJob + ": all_gather ...' >&2\nexec sleep 60\n");
  std::filesystem::permissions(rank_ends, std::filesystem::perms::owner_all);
  testing::internal::CaptureStderr();
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_EQ(run_watched({rank_ends}, 0.5), 128 + 9);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 10.0);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("mpirun has not ended 0.5 s after the job failed"), std::string::npos);

  const std::string ends = write_temp("ts_fake_mpirun4", "#!/bin/sh\necho 'a rank failed' >&2\nsleep 1\nexit 3\n");
  std::filesystem::permissions(ends, std::filesystem::perms::owner_all);
  testing::internal::CaptureStderr();
  EXPECT_EQ(run_watched({ends}, 0.1), 3);  // no failure marker: no grace applies
  EXPECT_NE(testing::internal::GetCapturedStderr().find("a rank failed"), std::string::npos);
}

// Ctrl-C while the job runs is passed to mpirun's process group (SIGINT), and says so.
TEST(ElasticLaunch, CtrlCIsPassedOnToMpirun) {
  const std::string traps = write_temp("ts_fake_mpirun5", "#!/bin/sh\ntrap 'exit 42' INT\nsleep 30 &\nwait\n");
  std::filesystem::permissions(traps, std::filesystem::perms::owner_all);
  std::thread ctrl_c([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(::getpid(), SIGINT);
  });
  bool interrupted = false;
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = run_watched({traps}, 30, &interrupted);
  ctrl_c.join();
  EXPECT_EQ(rc, 42);  // the script's own SIGINT trap ran
  EXPECT_TRUE(interrupted);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

// Note [Relaunching a command]: the ranks get the user's arguments as given, less the dropped
// options (with their values, in both spellings), plus what the relaunch appends; what follows
// "--" belongs to the program: never dropped, and it stays last.
TEST(Relaunch, ForwardsTheUsersArgumentsLessDroppedOptions) {
  torchspeed::launcher::Relaunch r;
  r.self_path = "/bin/torchspeed";
  r.args = {"serve", "--checkpoint", "m", "--api-key", "secret", "--tp", "2", "--stop-file=/x", "--weights", "bf16",
            "--", "--api-key", "kept"};
  r.drop = {"--api-key", "--stop-file"};
  r.append = {"--stop-file", "/tmp/s"};
  const std::vector<std::string> want{"/bin/torchspeed", "serve", "--checkpoint", "m", "--tp", "2", "--weights", "bf16",
                                      "--stop-file", "/tmp/s", "--", "--api-key", "kept"};
  EXPECT_EQ(torchspeed::launcher::relaunch_program(r), want);
  r.args = {"train", "-c", "cfg.json", "-n", "2", "--out", "runs/a", "--set", "train.steps=3"};
  r.drop = {"--out"};
  r.append = {"--out", "runs/a"};
  EXPECT_EQ(torchspeed::launcher::relaunch_program(r),
            (std::vector<std::string>{"/bin/torchspeed", "train", "-c", "cfg.json", "-n", "2", "--set", "train.steps=3",
                                      "--out", "runs/a"}));
}
