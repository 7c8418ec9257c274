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
#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/data/bpe_tokenizer.h"
#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/data/tokenizer.h"
#include "torchspeed/runtime/file.h"

#include <filesystem>
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
      // A GGUF's tokenizer is written as a tokenizer.json (with the chat template and end-of-turn
      // ids beside it), not copied.
      const bool gguf_tok = !bytes && checkpoint::gguf::is_gguf(tok->source());
      const std::string tok_files = bytes || gguf_tok ? "" : tok->source();
      const int64_t b =
          decoder ? checkpoint::hf::save_decoder(o->to, model.params, section,
                                                 model.config.value("hf_config", nlohmann::json::object()), dt, tok_files,
                                                 tok->eos_id())
                  : checkpoint::hf::save_gpt2(o->to, model.params, section, dt, tok_files, tok->eos_id());
      if (gguf_tok) {
        const auto* bpe = dynamic_cast<const data::BpeTokenizer*>(tok.get());
        TS_CHECK(bpe, tok->source(), ": not a byte-level BPE tokenizer");
        namespace fs = std::filesystem;
        checkpoint::write_file_atomic((fs::path(o->to) / "tokenizer.json").string(), bpe->to_tokenizer_json().dump(1) + "\n");
        const auto chat = data::chat_format_of_model(o->checkpoint, model, *tok);
        nlohmann::json tc = {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"clean_up_tokenization_spaces", false},
                             {"model_max_length", section.value("seq_len", int64_t{2048})}};
        for (const auto& [k, v] : chat->context.items()) tc[k] = v;
        if (chat->tmpl) tc["chat_template"] = chat->text;
        checkpoint::write_file_atomic((fs::path(o->to) / "tokenizer_config.json").string(), tc.dump(2) + "\n");
        checkpoint::write_file_atomic((fs::path(o->to) / "generation_config.json").string(),
                          nlohmann::json({{"eos_token_id", chat->stop_ids}}).dump(2) + "\n");
      }
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
