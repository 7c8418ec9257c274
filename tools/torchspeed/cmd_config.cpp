// `torchspeed config FILE [--world N] [--tp T] [--pp P]`: prints the resolved configuration, or
// every error found (exit 1). `torchspeed config --keys`: the key reference of docs/config.md,
// from the key tables (Note [Config keys declared once] in config/keys.h).
#include <cstdio>

#include "commands.h"
#include "torchspeed/config/config.h"

namespace torchspeed::cli {

Runner add_config(CLI::App& app) {
  auto* cmd = app.add_subcommand("config", "Validate a DeepSpeed/torchspeed config and print it resolved");
  struct Opts {
    std::string file;
    config::WorldShape world;
    bool keys = false;
  };
  auto o = std::make_shared<Opts>();
  auto* file = cmd->add_option("file", o->file, "Config file (JSON)");
  cmd->add_flag("--keys", o->keys, "Print every declared key with its default, values and treatment (Markdown)")
      ->excludes(file);
  cmd->add_option("--world,-n", o->world.world_size, "World size (ranks)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--tp", o->world.tp, "Tensor-parallel size (default: the config's)")->check(CLI::Range(1, 4096));
  cmd->add_option("--pp", o->world.pp, "Pipeline stages (default: the config's)")->check(CLI::Range(1, 4096));
  return [o]() {
    if (o->keys) {
      std::printf("%s", config::key_reference().c_str());
      return 0;
    }
    if (o->file.empty()) {
      std::fprintf(stderr, "torchspeed config: give a config FILE, or --keys\n");
      return 2;
    }
    try {
      auto c = config::Config::load(o->file, o->world);
      for (const auto& w : c.warnings) std::fprintf(stderr, "warning: %s: %s\n", o->file.c_str(), w.c_str());
      std::printf("%s\n", c.to_json().dump(2).c_str());
      return 0;
    } catch (const config::ConfigError& e) {
      for (const auto& err : e.errors()) std::fprintf(stderr, "error: %s\n", err.c_str());
      std::fprintf(stderr, "%zu error%s in %s\n", e.errors().size(), e.errors().size() == 1 ? "" : "s",
                   o->file.c_str());
      return 1;
    }
  };
}

}  // namespace torchspeed::cli
