// `torchspeed launch -n N [--hostfile F] [--include/--exclude S] [--dry-run] -- PROGRAM ARGS`.
#include <cstdio>

#include "commands.h"
#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/launcher.h"

namespace torchspeed::cli {

Runner add_launch(CLI::App& app, const Invocation& inv) {
  auto* cmd = app.add_subcommand("launch", "Start PROGRAM on N ranks through mpirun (after --)");
  auto o = std::make_shared<launcher::LaunchOptions>();
  auto dry = std::make_shared<bool>(false);
  cmd->add_option("-n,--num-ranks", o->num_ranks, "Ranks (default: all hostfile slots, or 1)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--hostfile", o->hostfile, "DeepSpeed hostfile: lines 'HOST slots=N'");
  cmd->add_option("--include", o->include, "Only these hosts/slots, e.g. host1@host2:0,2");
  cmd->add_option("--exclude", o->exclude, "All but these hosts/slots");
  cmd->add_option("--env,-x", o->extra_env, "NAME=VALUE to set on every rank (repeatable)");
  cmd->add_option("--mpirun", o->mpirun, "mpirun executable");
  cmd->add_flag("--dry-run", *dry, "Print the mpirun command instead of running it");
  return [o, dry, &inv]() {
    o->program = inv.program_args;
    auto argv = launcher::build_command(*o, launcher::LaunchContext::current());
    if (*dry) {
      std::printf("%s\n", launcher::render_command(argv).c_str());
      return 0;
    }
    std::fflush(stdout);
    launcher::exec_command(argv);
  };
}

}  // namespace torchspeed::cli
