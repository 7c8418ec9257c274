// `torchspeed autotune -c CONFIG [-n N] [--set KEY=VALUE ...] [--data PATH] [--run]`: DeepSpeed's
// autotuner (`deepspeed --autotuning tune|run`) for `torchspeed train`. Each experiment is a
// short training run of the config with one ZeRO stage and micro-batch size, with
// autotuning.enabled, so the engine times steps (start_profile_step, end_profile_step] and writes
// the metrics (Engine::autotuning_profile). The search, as DeepSpeed's "fast" mode:
//  - ZeRO stages: the config's zero_optimization.stage when it gives one, else 0, 1, 2 and 3;
//  - micro-batch sizes: powers of two from min_train_micro_batch_size_per_gpu up to
//    max_train_micro_batch_size_per_gpu (and max_train_batch_size / (gas x dp)), at most
//    num_tuning_micro_batch_sizes of them spread over that range, the largest always included
//    (on a GPU DeepSpeed first finds the largest that fits in memory; a CPU's memory rarely
//    binds, and an experiment that fails is recorded as failed);
//  - gridsearch in that order, or random (seeded); at most tuner_num_trials experiments, and
//    stop after tuner_early_stopping experiments without a better metric.
// Writes results_dir/<exp>/ (metrics.json, the run's log), exps_dir/<exp>.json (each config),
// results_dir/summary.json, results_dir/ds_config_optimal.json (the best config, autotuning
// off) and results_dir/cmd_optimal.txt; with --run it then trains with the best config.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "commands.h"
#include "torchspeed/checkpoint/io_names.h"
#include "torchspeed/config/config.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"

namespace torchspeed::cli {
namespace fs = std::filesystem;

namespace {
struct Experiment {
  std::string name;
  int stage = 0;
  int64_t micro = 1;
  nlohmann::json metrics;  // null: failed
  std::string error;
};

// Up to `count` of the powers of two in [lo, hi] (and hi itself), spread evenly by index, the
// largest always included.
std::vector<int64_t> micro_batch_candidates(int64_t lo, int64_t hi, int64_t count) {
  std::vector<int64_t> all;
  for (int64_t m = lo; m <= hi; m *= 2) all.push_back(m);
  if (all.empty() || all.back() != hi) all.push_back(hi);
  if (static_cast<int64_t>(all.size()) <= count) return all;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < count; ++i) {
    const size_t at = count == 1 ? all.size() - 1
                                 : static_cast<size_t>(std::llround(static_cast<double>(i) * static_cast<double>(all.size() - 1) /
                                                                    static_cast<double>(count - 1)));
    if (out.empty() || out.back() != all[at]) out.push_back(all[at]);
  }
  return out;
}
}  // namespace

Runner add_autotune(CLI::App& app, const Invocation& inv) {
  auto* cmd = app.add_subcommand("autotune", "Find the fastest ZeRO stage and micro-batch size for a config (DeepSpeed's autotuner)");
  struct Opts {
    std::string config, data;
    int ranks = 1;
    bool run = false;
    std::vector<std::string> sets;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--config,-c", o->config, "DeepSpeed config with an autotuning section, plus model/data/train")->required();
  cmd->add_option("-n,--num-ranks", o->ranks, "Ranks of every experiment")->check(CLI::Range(1, 1024));
  cmd->add_option("--set", o->sets, "Override a config key by its dotted path");
  cmd->add_option("--data", o->data, "Text file or folder for the experiments (as train --data)");
  cmd->add_flag("--run", o->run, "Then train with the best config (deepspeed --autotuning run)");
  return [o, &inv]() -> int {
    nlohmann::json j = config::read_json_file(o->config);
    for (const auto& s : o->sets) apply_override(j, s);
    config::WorldShape shape;
    shape.world_size = o->ranks;
    config::AutoValues autos;
    autos.hidden_size = models::GPTConfig::from_json(j.value("model", nlohmann::json::object())).d_model;
    autos.max_steps = 1000;
    autos.source = "torchspeed autotune";
    // The micro-batch size is what we tune: an "auto" one (Hugging Face configs) is ours to set.
    nlohmann::json probe = j;
    probe["train_micro_batch_size_per_gpu"] = 1;
    probe.erase("train_batch_size");
    if (!probe.contains("gradient_accumulation_steps") || !probe["gradient_accumulation_steps"].is_number_integer()) {
      probe["gradient_accumulation_steps"] = 1;
    }
    const config::Config cfg = config::Config::parse(probe, shape, autos);
    const auto& a = cfg.autotuning;
    const int64_t gas = cfg.gradient_accumulation_steps, dp = cfg.dp;
    int64_t hi = a.max_train_micro_batch_size_per_gpu;
    if (a.max_train_batch_size) hi = std::min(hi, *a.max_train_batch_size / (gas * dp));
    const int64_t lo = std::max(a.min_train_micro_batch_size_per_gpu, (a.min_train_batch_size + gas * dp - 1) / (gas * dp));
    TS_CHECK(hi >= lo, o->config, ": no micro-batch size to try: autotuning allows ", lo, " to ", hi, " per rank (",
             gas, " accumulation steps x ", dp, " data-parallel ranks)");
    std::vector<int> stages = a.zero_stage_given ? std::vector<int>{cfg.zero.stage} : std::vector<int>{0, 1, 2, 3};
    std::vector<Experiment> exps;
    for (int st : stages) {
      for (int64_t m : micro_batch_candidates(lo, hi, a.num_tuning_micro_batch_sizes)) {
        exps.push_back({concat("z", st, "_mbs", m, "_gas", gas), st, m, nullptr, ""});
      }
    }
    if (a.tuner_type == "random") std::shuffle(exps.begin(), exps.end(), std::mt19937(static_cast<unsigned>(cfg.seed)));
    if (static_cast<int64_t>(exps.size()) > a.tuner_num_trials) exps.resize(static_cast<size_t>(a.tuner_num_trials));
    fs::create_directories(a.results_dir);
    fs::create_directories(a.exps_dir);
    std::printf("torchspeed autotune: %zu experiments (ZeRO stages %s, micro-batch sizes %ld-%ld, %ld accumulation steps, "
                "%d ranks), metric %s, steps %ld-%ld timed\n",
                exps.size(), a.zero_stage_given ? std::to_string(cfg.zero.stage).c_str() : "0-3", static_cast<long>(lo),
                static_cast<long>(hi), static_cast<long>(gas), o->ranks, a.metric.c_str(),
                static_cast<long>(a.start_profile_step + 1), static_cast<long>(a.end_profile_step));
    std::fflush(stdout);
    const bool lower_is_better = a.metric == "latency";
    auto value = [&](const nlohmann::json& m) {
      return m.at(a.metric == "flops" ? "FLOPS_per_gpu" : a.metric).get<double>();
    };
    const Experiment* best = nullptr;
    int64_t since_best = 0;
    size_t ran = 0;
    for (Experiment& e : exps) {
      const fs::path dir = fs::path(a.results_dir) / e.name;
      const fs::path metrics = dir / "metrics.json";
      nlohmann::json x = j;
      x["zero_optimization"]["stage"] = e.stage;
      x["train_micro_batch_size_per_gpu"] = e.micro;
      x["gradient_accumulation_steps"] = gas;
      x.erase("train_batch_size");
      x["autotuning"]["enabled"] = true;
      x["autotuning"]["metric_path"] = fs::absolute(metrics).string();
      x["train"]["steps"] = a.end_profile_step + 1;  // the run stops after end_profile_step
      x["train"]["eval_interval"] = 1 << 30;
      x["train"]["log_interval"] = 1;
      const std::string exp_path = (fs::path(a.exps_dir) / (e.name + ".json")).string();
      checkpoint::write_file_atomic(exp_path, x.dump(2) + "\n");
      if (!a.overwrite && fs::exists(metrics)) {
        e.metrics = config::read_json_file(metrics.string());
      } else {
        fs::remove(metrics);
        fs::create_directories(dir);
        std::vector<std::string> argv = {inv.self_path, "train", "-c", exp_path, "-n", std::to_string(o->ranks), "--out",
                                         (dir / "run").string()};
        if (!o->data.empty()) argv.insert(argv.end(), {"--data", o->data});
        const int rc = launcher::run_command(argv, (dir / "stdout.log").string(), (dir / "stderr.log").string());
        if (rc == 0 && fs::exists(metrics)) {
          e.metrics = config::read_json_file(metrics.string());
        } else {
          e.error = concat("exit status ", rc, "; see ", (dir / "stderr.log").string());
        }
      }
      ++ran;
      if (e.metrics.is_null()) {
        std::printf("  %-22s failed: %s\n", e.name.c_str(), e.error.c_str());
      } else {
        std::printf("  %-22s %9.1f ms/step %10.1f samples/s %8.2f GFLOP/s per rank\n", e.name.c_str(),
                    e.metrics.at("latency").get<double>(), e.metrics.at("throughput").get<double>(),
                    e.metrics.at("FLOPS_per_gpu").get<double>() / 1e9);
        const bool better = !best || (lower_is_better ? value(e.metrics) < value(best->metrics) : value(e.metrics) > value(best->metrics));
        if (better) {
          best = &e;
          since_best = 0;
        } else {
          ++since_best;
        }
      }
      std::fflush(stdout);
      if (best && since_best >= a.tuner_early_stopping) {
        std::printf("  stopping early: %ld experiments without a better %s\n", static_cast<long>(since_best), a.metric.c_str());
        break;
      }
    }
    nlohmann::json summary = {{"metric", a.metric}, {"experiments", nlohmann::json::array()}};
    for (size_t i = 0; i < ran; ++i) {
      const Experiment& e = exps[i];
      summary["experiments"].push_back({{"name", e.name}, {"zero_stage", e.stage}, {"train_micro_batch_size_per_gpu", e.micro},
                                        {"gradient_accumulation_steps", gas}, {"metrics", e.metrics}, {"error", e.error}});
    }
    TS_CHECK(best, "autotune: every experiment failed; see ", a.results_dir, "/*/stderr.log");
    nlohmann::json optimal = j;
    optimal["zero_optimization"]["stage"] = best->stage;
    optimal["train_micro_batch_size_per_gpu"] = best->micro;
    optimal["gradient_accumulation_steps"] = gas;
    optimal.erase("train_batch_size");
    optimal["autotuning"]["enabled"] = false;
    const std::string optimal_path = (fs::path(a.results_dir) / "ds_config_optimal.json").string();
    checkpoint::write_file_atomic(optimal_path, optimal.dump(2) + "\n");
    summary["best"] = best->name;
    summary["optimal_config"] = optimal_path;
    checkpoint::write_file_atomic((fs::path(a.results_dir) / "summary.json").string(), summary.dump(2) + "\n");
    std::vector<std::string> train_argv = {inv.self_path, "train", "-c", optimal_path, "-n", std::to_string(o->ranks)};
    if (!o->data.empty()) train_argv.insert(train_argv.end(), {"--data", o->data});
    checkpoint::write_file_atomic((fs::path(a.results_dir) / "cmd_optimal.txt").string(),
                                  launcher::render_command(train_argv) + "\n");
    std::printf("best: %s (%s %.1f); config: %s\n", best->name.c_str(), a.metric.c_str(), value(best->metrics),
                optimal_path.c_str());
    std::fflush(stdout);
    if (o->run) return launcher::run_command(train_argv);
    return 0;
  };
}

}  // namespace torchspeed::cli
