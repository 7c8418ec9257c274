// Launcher: DeepSpeed hostfiles and filters, and the mpirun command built from them.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "torchspeed/runtime/error.h"
#include "test_util.h"
#include "torchspeed/runtime/launcher.h"

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
