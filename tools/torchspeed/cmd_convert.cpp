// `torchspeed convert CHECKPOINT --to model.safetensors [--dtype fp32|bf16|fp16]`: the full model
// of a sharded training checkpoint in one safetensors file (DeepSpeed's zero_to_fp32), with the
// model's parameter names and the training config in its metadata (so `torchspeed generate`
// can load the file alone).
// `torchspeed convert CHECKPOINT --format hf --to DIR`: a Hugging Face folder of the model's
// family (config.json, model.safetensors with transformers' names and layouts, the tokenizer's
// files) that transformers' AutoModelForCausalLM.from_pretrained(DIR) loads: GPT-2, or Llama /
// Mistral / Qwen2 / Qwen3 for a model with rotary positions.
#include <ATen/ATen.h>

#include <cstdio>

#include "commands.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/hf_gpt2.h"
#include "torchspeed/data/tokenizer.h"
#include "torchspeed/runtime/error.h"

namespace torchspeed::cli {

Runner add_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand("convert", "Consolidate a training checkpoint into one model.safetensors, or a Hugging Face folder");
  struct Opts {
    std::string checkpoint, to, dtype = "fp32", format = "safetensors", tokenizer;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("checkpoint", o->checkpoint,
                  "A training checkpoint (a tag folder, or one with `latest`), a run folder or a model folder")->required();
  cmd->add_option("--to", o->to, "Output: a .safetensors file, or with --format hf a folder")->required();
  cmd->add_option("--format", o->format, "safetensors (torchspeed's names, config in the metadata) or hf (the model's Hugging Face family)")
      ->check(CLI::IsMember({"safetensors", "hf"}));
  cmd->add_option("--tokenizer", o->tokenizer, "With --format hf: the tokenizer to copy beside the model (default: the model's own)");
  cmd->add_option("--dtype", o->dtype, "Output dtype")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  return [o]() {
    auto model = checkpoint::load_model(o->checkpoint);
    const at::ScalarType dt = o->dtype == "bf16" ? at::kBFloat16 : o->dtype == "fp16" ? at::kHalf : at::kFloat;
    int64_t numel = 0;
    for (auto& [name, t] : model.params) {
      t = t.to(dt);
      numel += t.numel();
    }
    if (o->format == "hf") {
      const auto tok = data::tokenizer_of_model(o->checkpoint, model, o->tokenizer);
      const bool bytes = tok->source() == "bytes";
      const auto section = model.config.value("model", nlohmann::json::object());
      const bool decoder = section.value("positions", std::string("learned")) == "rope";
      const std::string tok_files = bytes ? "" : tok->source();
      const int64_t b =
          decoder ? checkpoint::hf::save_decoder(o->to, model.params, section,
                                                 model.config.value("hf_config", nlohmann::json::object()), dt, tok_files,
                                                 tok->eos_id())
                  : checkpoint::hf::save_gpt2(o->to, model.params, section, dt, tok_files, tok->eos_id());
      const std::string family =
          decoder ? checkpoint::hf::decoder_config(section, model.config.value("hf_config", nlohmann::json::object()), -1)
                        .at("model_type")
                        .get<std::string>()
                  : "gpt2";
      std::printf("%s: %s folder for transformers, %.2fM parameters (%s), step %ld, %.1f MB, tokenizer %s\n", o->to.c_str(),
                  family.c_str(), numel / 1e6, o->dtype.c_str(), static_cast<long>(model.step), b / 1e6,
                  bytes ? "bytes (no files: token id = byte)" : tok->source().c_str());
      return 0;
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
