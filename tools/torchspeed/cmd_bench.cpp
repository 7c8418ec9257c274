// `torchspeed bench NAME [-n RANKS] [--json FILE] [--quick]`: runs a benchmark on its ranks,
// launching them itself when not already under mpirun.
#include <cstdio>
#include <map>

#include "bench_report.h"
#include "commands.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"
#include "torchspeed/comm/runtime.h"

namespace torchspeed::cli {

Runner add_bench(CLI::App& app, const Invocation& inv) {
  auto* cmd = app.add_subcommand("bench", "Run a benchmark: comm, adam, memory, overlap, train, checkpoint, pipeline, tp, serve, offload, linear");
  struct Opts {
    std::string name;
    int ranks = 0;  // 0: the benchmark's own rank count
    bench::BenchArgs args;
    bool engine_part = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("name", o->name, "Benchmark")->required()->check(CLI::IsMember({"comm", "adam", "memory", "overlap", "train", "checkpoint", "pipeline", "tp", "serve", "offload", "linear"}));
  cmd->add_option("-n,--num-ranks", o->ranks, "Ranks to launch when not under mpirun")->check(CLI::Range(1, 1024));
  cmd->add_option("--json", o->args.json_path, "Write the results as JSON to FILE");
  cmd->add_flag("--quick", o->args.quick, "Fewer sizes and repetitions (smoke run)");
  cmd->add_flag("--engine-part", o->engine_part, "(internal) bench train's ranks");
  cmd->add_option("--spec", o->args.spec,
                  "(internal) what bench train's ranks run, as JSON; for bench serve, the parts to run (see bench_serve.cpp)");
  return [o, &inv]() {
    TS_CHECK((!o->engine_part && o->args.spec.empty()) || o->name == "train" || o->name == "offload" ||
                 (o->name == "serve" && !o->engine_part),
             "--engine-part and --spec belong to bench train's, bench offload's and bench serve's own runs, not to bench ", o->name);
    TS_CHECK(!o->engine_part || !o->args.spec.empty(), "bench ", o->name, " --engine-part needs --spec");
    if (o->name == "offload" && !o->engine_part) return bench::run_offload(o->args, inv.self_path);  // runs its parts
    if (o->name == "train" && !o->engine_part) return bench::run_train(o->args, inv.self_path);  // launches its ranks
    if (o->name == "serve") return bench::run_serve(o->args, inv.self_path);  // starts its servers
    if (o->ranks == 0) o->ranks = o->name == "memory" || o->name == "tp" ? 4 : o->name == "adam" || o->name == "offload" || o->name == "linear" ? 1 : 2;
    if (!launcher::under_launcher() && o->ranks > 1) {  // Note [Relaunching a command]
      launcher::Relaunch r;
      r.num_ranks = o->ranks, r.self_path = inv.self_path, r.args = inv.args;
      r.how = launcher::Relaunch::How::kExec;
      launcher::relaunch_under_mpirun(r);
    }
    init();
    int rc = 0;
    if (o->name == "comm") rc = bench::run_comm(o->args);
    if (o->name == "adam") rc = bench::run_adam(o->args);
    if (o->name == "memory") rc = bench::run_memory(o->args);
    if (o->name == "overlap") rc = bench::run_overlap(o->args);
    if (o->name == "checkpoint") rc = bench::run_checkpoint(o->args);
    if (o->name == "pipeline") rc = bench::run_pipeline(o->args);
    if (o->name == "tp") rc = bench::run_tp(o->args);
    if (o->name == "linear") rc = bench::run_linear(o->args);
    if (o->name == "train") rc = bench::run_train_engine_part(o->args);
    if (o->name == "offload") rc = bench::run_offload_part(o->args);
    shutdown();
    return rc;
  };
}

}  // namespace torchspeed::cli
