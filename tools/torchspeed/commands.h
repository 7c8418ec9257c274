// The subcommands of the torchspeed CLI; each registers itself on the CLI11 app and runs when
// chosen. `program_args` holds what followed "--" on the command line.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace torchspeed::cli {

struct Invocation {
  std::vector<std::string> program_args;  // after "--"
  std::string self_path;                  // absolute path of this executable
  std::vector<std::string> args;          // every argument after the program name, as given
                                          // (what a relaunch under mpirun forwards)
};

using Runner = std::function<int()>;

// Each adds its subcommand and returns the function that runs it.
Runner add_env(CLI::App& app);
Runner add_config(CLI::App& app);
Runner add_launch(CLI::App& app, const Invocation& inv);
Runner add_bench(CLI::App& app, const Invocation& inv);
Runner add_train(CLI::App& app, const Invocation& inv);
Runner add_generate(CLI::App& app);
Runner add_convert(CLI::App& app);
Runner add_serve(CLI::App& app, const Invocation& inv);
Runner add_autotune(CLI::App& app, const Invocation& inv);
Runner add_plan(CLI::App& app, const Invocation& inv);

}  // namespace torchspeed::cli

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/model_tokenizer.h"

namespace torchspeed::cli {

// --set a.b.c=VALUE on a config: VALUE as JSON when it parses (numbers, true, {...}), else a string.
void apply_override(nlohmann::json& config, const std::string& key_value);

}  // namespace torchspeed::cli
