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
          {"date", date}};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace torchspeed::bench
