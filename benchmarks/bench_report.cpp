// Report formatting shared by every benchmark.
#include "bench_report.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>

#include "torchspeed/base/cpu.h"
#include "torchspeed/base/error.h"
#include "torchspeed/comm/runtime.h"

namespace torchspeed::bench {

BenchReport::BenchReport(std::string name) : name_(std::move(name)) {}

void BenchReport::add_target(std::string name, double value, double target, bool higher) {
  targets_.push_back(Target{std::move(name), value, target, higher});
}

bool BenchReport::all_met() const {
  return std::all_of(targets_.begin(), targets_.end(), [](const Target& t) { return t.met(); });
}

nlohmann::json BenchReport::to_json() const {
  nlohmann::json t = nlohmann::json::array();
  for (const auto& x : targets_) {
    t.push_back({{"name", x.name}, {"value", x.value}, {"target", x.target},
                 {"higher_is_better", x.higher_is_better}, {"met", x.met()}});
  }
  return {{"bench", name_}, {"machine", machine_}, {"results", results_}, {"targets", t}};
}

void BenchReport::finish(const BenchArgs& args) const {
  std::printf("\n%-62s %10s %10s  %s\n", "target", "value", "goal", "met");
  for (const auto& t : targets_) {
    std::printf("%-62s %10.3f %s%9.3f  %s\n", t.name.c_str(), t.value, t.higher_is_better ? ">=" : "<=",
                t.target, t.met() ? "yes" : "NO");
  }
  std::printf("%s: %zu of %zu targets met\n", name_.c_str(),
              static_cast<size_t>(std::count_if(targets_.begin(), targets_.end(),
                                                [](const Target& t) { return t.met(); })),
              targets_.size());
  if (!args.json_path.empty()) {
    std::ofstream out(args.json_path);
    TS_CHECK(out.good(), "cannot write benchmark JSON to '", args.json_path, "'");
    out << to_json().dump(2) << "\n";
    std::printf("wrote %s\n", args.json_path.c_str());
  }
  std::fflush(stdout);
}

namespace {
// The first line a command prints, or "" (popen: benchmarks only, never the library).
std::string first_line_of(const std::string& command) {
  std::string line;
  if (FILE* p = ::popen(command.c_str(), "r")) {
    char buf[256];
    if (std::fgets(buf, sizeof(buf), p)) line = buf;
    ::pclose(p);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  return line;
}

// The source tree's commit, "+dirty" when tracked files differ from it; "unknown" outside git.
std::string source_commit() {
  const std::string git = std::string("git -C '") + TORCHSPEED_SOURCE_DIR + "' ";
  const std::string commit = first_line_of(git + "rev-parse --short=12 HEAD 2>/dev/null");
  if (commit.empty()) return "unknown";
  const bool dirty = !first_line_of(git + "status --porcelain --untracked-files=no 2>/dev/null").empty();
  return dirty ? commit + "+dirty" : commit;
}
}  // namespace

nlohmann::json describe_machine(int world_size) {
  auto f = cpu::features();
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return {{"cpu", f.model_name},
          {"logical_cores", f.logical_cores},
          {"features", cpu::feature_names(f)},
          {"blas_core", cpu::blas_core_name()},
          {"intra_op_threads", at::get_num_threads()},
          {"ranks", world_size},
          {"torchspeed", version()},
          {"mpi", mpi_library_version()},
          {"host", host},
          {"date", date},
          {"commit", source_commit()}};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace torchspeed::bench
