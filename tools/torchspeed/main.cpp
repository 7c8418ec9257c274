// torchspeed: the command-line tool (env, config, launch, bench).
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstring>
#include <map>

#include "commands.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"
#include "torchspeed/comm/runtime.h"

int main(int argc, char** argv) {
  // Fast OpenBLAS kernels for this process and whatever it launches.
  torchspeed::launcher::reexec_with_fast_blas(argc, argv);

  torchspeed::cli::Invocation inv;
  char self[PATH_MAX] = {0};
  ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  inv.self_path = len > 0 ? std::string(self, static_cast<size_t>(len)) : argv[0];
  inv.args.assign(argv + 1, argv + argc);
  int cli_argc = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) {
      cli_argc = i;
      inv.program_args.assign(argv + i + 1, argv + argc);
      break;
    }
  }

  CLI::App app{"torchspeed: DeepSpeed's capabilities, natively in C++, for LibTorch"};
  app.set_version_flag("--version", std::string(torchspeed::version()));
  app.require_subcommand(1);
  std::map<CLI::App*, torchspeed::cli::Runner> runners;
  auto add = [&](torchspeed::cli::Runner r) { runners[app.get_subcommands({}).back()] = std::move(r); };
  add(torchspeed::cli::add_env(app));
  add(torchspeed::cli::add_config(app));
  add(torchspeed::cli::add_launch(app, inv));
  add(torchspeed::cli::add_bench(app, inv));
  add(torchspeed::cli::add_train(app, inv));
  add(torchspeed::cli::add_generate(app));
  add(torchspeed::cli::add_convert(app));
  add(torchspeed::cli::add_serve(app, inv));
  add(torchspeed::cli::add_autotune(app, inv));
  add(torchspeed::cli::add_plan(app, inv));
  try {
    app.parse(cli_argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : runners) {
      if (sub->parsed()) return run();
    }
  } catch (const torchspeed::Error& e) {
    std::fprintf(stderr, "torchspeed: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchspeed: unexpected error: %s\n", e.what());
    return 1;
  }
  return 1;
}
