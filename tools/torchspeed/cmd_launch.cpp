// `torchspeed launch -n N [--hostfile F] [--include/--exclude S] [--max-restarts N] [--dry-run]
// -- PROGRAM ARGS`.
#include <cstdio>

#include "commands.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"

namespace torchspeed::cli {

Runner add_launch(CLI::App& app, const Invocation& inv) {
  auto* cmd = app.add_subcommand("launch", "Start PROGRAM on N ranks through mpirun (after --)");
  auto o = std::make_shared<launcher::LaunchOptions>();
  auto dry = std::make_shared<bool>(false);
  auto elastic = std::make_shared<launcher::ElasticOptions>();
  cmd->add_option("-n,--num-ranks", o->num_ranks, "Ranks (default: all hostfile slots, or 1)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--hostfile", o->hostfile, "DeepSpeed hostfile: lines 'HOST slots=N'");
  cmd->add_option("--include", o->include, "Only these hosts/slots, e.g. host1@host2:0,2");
  cmd->add_option("--exclude", o->exclude, "All but these hosts/slots");
  cmd->add_option("--env,-x", o->extra_env, "NAME=VALUE to set on every rank (repeatable)");
  cmd->add_option("--mpirun", o->mpirun, "mpirun executable");
  auto* restarts = cmd->add_option("--max-restarts", elastic->max_restarts,
                  "When the job fails, restart it up to N times on the hosts that still answer (Note [Elastic restart]); "
                  "PROGRAM must resume, e.g. `torchspeed train --resume`")
      ->check(CLI::Range(0, 1000));
  cmd->add_option("--probe-timeout", elastic->probe_timeout_s,
                  "Seconds a host may take to answer the probe after a failure (default 30)")
      ->check(CLI::PositiveNumber)
      ->needs(restarts);
  cmd->add_option("--abort-grace", elastic->abort_grace_s,
                  "Seconds mpirun may take to end once the job failed before it is stopped (default 30)")
      ->check(CLI::PositiveNumber)
      ->needs(restarts);
  cmd->add_flag("--dry-run", *dry, "Print the mpirun command instead of running it");
  return [o, dry, elastic, &inv]() {
    o->program = inv.program_args;
    auto argv = launcher::build_command(*o, launcher::LaunchContext::current());
    if (*dry) {
      std::printf("%s\n", launcher::render_command(argv).c_str());
      if (elastic->max_restarts > 0) {
        std::printf("# --max-restarts %d: on failure, restarted on the hosts that answer a probe (TORCHSPEED_RESTART_COUNT=1, 2, ...)\n",
                    elastic->max_restarts);
      }
      return 0;
    }
    std::fflush(stdout);
    if (elastic->max_restarts > 0) return launcher::run_elastic(*o, launcher::LaunchContext::current(), *elastic);
    launcher::exec_command(argv);
  };
}

}  // namespace torchspeed::cli
