// BenchReport: one benchmark's raw measurements, targets and machine description, printed as a
// table and written as JSON: {"bench", "machine", "results": [...], "targets": [...]}. "machine"
// holds the CPU, its features, threads, ranks, versions, the date and the source commit, so
// scripts/bench-tables can turn the JSON into docs/benchmarks.md's tables.
// Ratios are always measured side by side in the same run; raw times stay in the JSON.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace torchspeed::bench {

struct Target {
  std::string name;
  double value = 0.0;
  double target = 0.0;
  bool higher_is_better = true;
  bool met() const { return higher_is_better ? value >= target : value <= target; }
};

struct BenchArgs {
  std::string json_path;  // --json FILE, or ""
  bool quick = false;     // --quick: fewer sizes/repetitions (smoke runs in tests)
  std::string spec;       // --spec JSON: (internal) the parameters of a benchmark's part
};

class BenchReport {
 public:
  explicit BenchReport(std::string name);
  void add_result(nlohmann::json row) { results_.push_back(std::move(row)); }
  void add_target(std::string name, double value, double target, bool higher_is_better = true);
  nlohmann::json& machine() { return machine_; }
  const std::vector<Target>& targets() const { return targets_; }
  bool all_met() const;
  nlohmann::json to_json() const;
  // Prints the targets table to stdout and writes the JSON when a path is given.
  void finish(const BenchArgs& args) const;

 private:
  std::string name_;
  nlohmann::json machine_ = nlohmann::json::object();
  nlohmann::json results_ = nlohmann::json::array();
  std::vector<Target> targets_;
};

// Describes this machine and run: CPU, cores, BLAS core, threads, ranks, versions.
nlohmann::json describe_machine(int world_size);

// Median of a sample.
double median(std::vector<double> v);

// Benchmarks, each run by every rank of the job (results reported by rank 0).
int run_comm(const BenchArgs& args);
int run_adam(const BenchArgs& args);
int run_memory(const BenchArgs& args);
int run_overlap(const BenchArgs& args);
int run_checkpoint(const BenchArgs& args);
int run_pipeline(const BenchArgs& args);
int run_tp(const BenchArgs& args);
// `self`: this executable, to launch the 2-rank engine part (run_train_engine_part) with.
int run_train(const BenchArgs& args, const std::string& self);
int run_train_engine_part(const BenchArgs& args);
// `self`: this executable, run as `bench offload --engine-part` in child processes.
int run_offload(const BenchArgs& args, const std::string& self);
int run_offload_part(const BenchArgs& args);
// `self`: this executable, run as `serve` in child processes.
int run_serve(const BenchArgs& args, const std::string& self);
int run_linear(const BenchArgs& args);

}  // namespace torchspeed::bench
