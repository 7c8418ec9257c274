// `torchspeed convert CHECKPOINT --to model.safetensors [--dtype fp32|bf16|fp16]`: the full model
// of a sharded training checkpoint in one safetensors file (DeepSpeed's zero_to_fp32), with the
// model's parameter names and the training config in its metadata (so `torchspeed generate`
// can load the file alone).
#include <ATen/ATen.h>

#include <cstdio>

#include "commands.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/runtime/error.h"

namespace torchspeed::cli {

Runner add_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand("convert", "Consolidate a training checkpoint into one model.safetensors");
  struct Opts {
    std::string checkpoint, to, dtype = "fp32";
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("checkpoint", o->checkpoint, "Checkpoint folder: a tag folder, or one with `latest`")->required();
  cmd->add_option("--to", o->to, "Output .safetensors file")->required();
  cmd->add_option("--dtype", o->dtype, "Output dtype")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  return [o]() {
    auto model = checkpoint::consolidate(o->checkpoint);
    const at::ScalarType dt = o->dtype == "bf16" ? at::kBFloat16 : o->dtype == "fp16" ? at::kHalf : at::kFloat;
    int64_t numel = 0;
    for (auto& [name, t] : model.params) {
      t = t.to(dt);
      numel += t.numel();
    }
    const auto d = checkpoint::save_safetensors(
        o->to, model.params,
        {{"format", "pt"}, {"producer", "torchspeed"}, {"step", std::to_string(model.step)},
         {"config", model.config.dump()}});
    std::printf("%s: %zu tensors, %.2fM parameters (%s), step %ld, %.1f MB\n", o->to.c_str(), model.params.size(),
                numel / 1e6, o->dtype.c_str(), static_cast<long>(model.step), d.bytes / 1e6);
    return 0;
  };
}

}  // namespace torchspeed::cli
