// `torchspeed convert CHECKPOINT --to model.safetensors [--dtype fp32|bf16|fp16]`: the full model
// of a sharded training checkpoint in one safetensors file (DeepSpeed's zero_to_fp32), with the
// model's parameter names and the training config in its metadata (so `torchspeed generate`
// can load the file alone).
// `torchspeed convert CHECKPOINT --format hf --to DIR`: a Hugging Face folder of the model's
// family (config.json, model.safetensors with transformers' names and layouts, the tokenizer's
// files) that transformers' AutoModelForCausalLM.from_pretrained(DIR) loads: GPT-2, or Llama /
// Mistral / Qwen2 / Qwen3 for a model with rotary positions.
// `torchspeed convert CHECKPOINT --format gguf --to F.gguf [--dtype fp32|fp16|bf16|q8_0|q4_0|q4_1]`: a GGUF
// file llama.cpp runs (checkpoint/gguf_writer.h), with the tokenizer and chat template inside.
#include <ATen/ATen.h>

#include <cstdio>

#include "commands.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/hf_gpt2.h"
#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/checkpoint/gguf_writer.h"
#include "torchspeed/data/bpe_tokenizer.h"
#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/data/tokenizer.h"
#include "torchspeed/base/file.h"

#include <filesystem>
#include "torchspeed/base/error.h"

namespace torchspeed::cli {
namespace {

struct GgufOpts {
  std::string checkpoint, to, dtype, tokenizer;
};

int write_gguf(const GgufOpts& o, checkpoint::Model& model) {
  namespace gg = checkpoint::gguf;
  const auto section = model.config.value("model", nlohmann::json::object());
  const gg::Type type = o.dtype == "q8_0" ? gg::Type::kQ8_0 : o.dtype == "q4_0" ? gg::Type::kQ4_0 : o.dtype == "q4_1" ? gg::Type::kQ4_1 : o.dtype == "bf16" ? gg::Type::kBF16
                        : o.dtype == "fp16" ? gg::Type::kF16 : gg::Type::kF32;
  gg::architecture_of(section);  // refuses a model llama.cpp does not compute, before any work
  const auto tok = data::tokenizer_of_model(o.checkpoint, model, o.tokenizer);
  const auto* bpe = dynamic_cast<const data::BpeTokenizer*>(tok.get());
  TS_CHECK(bpe, "convert --format gguf: the model's tokenizer is ", tok->source(),
           "; a GGUF file carries a BPE tokenizer (give one with --tokenizer)");
  const int64_t n_vocab = section.at("vocab").get<int64_t>();
  const auto v = bpe->gguf_vocab(n_vocab);
  gg::Metadata md;
  md.emplace_back("tokenizer.ggml.model", v.model);
  if (!v.pre.empty()) md.emplace_back("tokenizer.ggml.pre", v.pre);
  md.emplace_back("tokenizer.ggml.tokens", v.tokens);
  if (!v.scores.empty()) md.emplace_back("tokenizer.ggml.scores", v.scores);
  md.emplace_back("tokenizer.ggml.token_type", v.types);
  // llama.cpp requires the merges key of a byte-level BPE vocabulary even when it is empty (a
  // vocabulary of the 256 bytes alone: a byte-vocabulary GPT written with a byte-level tokenizer).
  if (v.model == "gpt2") md.emplace_back("tokenizer.ggml.merges", v.merges);
  const auto chat = data::chat_format_of_model(o.checkpoint, model, *tok);
  auto id_of = [&](const char* key) -> int64_t {
    if (!chat->context.contains(key) || !chat->context[key].is_string()) return -1;
    const std::string t = chat->context[key].get<std::string>();
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      if (v.tokens[i] == t) return static_cast<int64_t>(i);
    }
    return -1;
  };
  const int64_t bos = tok->bos_to_add() >= 0 ? tok->bos_to_add() : id_of("bos_token");
  const int64_t eos = tok->eos_id() >= 0 ? tok->eos_id() : id_of("eos_token");
  if (bos >= 0) md.emplace_back("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(bos));
  if (eos >= 0) md.emplace_back("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(eos));
  if (v.unk >= 0) md.emplace_back("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(v.unk));
  // Whether prompts start with BOS: as the tokenizer adds it (its post-processor, or the source
  // GGUF's add_bos_token).
  const bool add_bos = tok->bos_to_add() >= 0;
  md.emplace_back("tokenizer.ggml.add_bos_token", add_bos);
  md.emplace_back("tokenizer.ggml.add_eos_token", false);
  if (v.model == "llama") md.emplace_back("tokenizer.ggml.add_space_prefix", v.add_space_prefix);
  if (chat->tmpl) md.emplace_back("tokenizer.chat_template", chat->text);
  int64_t numel = 0;
  for (const auto& [n, t] : model.params) numel += t.numel();
  const auto info = model.config.value("gguf", nlohmann::json::object());
  const std::string name = info.contains("general.name") && info["general.name"].is_string()
                               ? info["general.name"].get<std::string>()
                               : std::filesystem::path(o.checkpoint).filename().string();
  const int64_t bytes = gg::save_gguf(o.to, model.params, section, type, name, md);
  std::printf("%s: GGUF for llama.cpp, architecture %s, %.2fM parameters (%s), step %ld, %.1f MB, tokenizer %s (%s, %zu tokens)\n",
              o.to.c_str(), gg::architecture_of(section).c_str(), numel / 1e6, o.dtype.c_str(), static_cast<long>(model.step),
              bytes / 1e6, tok->source().c_str(), v.model.c_str(), v.tokens.size());
  return 0;
}

}  // namespace

Runner add_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand("convert", "Consolidate a training checkpoint into one model.safetensors, a Hugging Face folder or a GGUF file");
  struct Opts {
    std::string checkpoint, to, dtype = "fp32", format = "safetensors", tokenizer;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("checkpoint", o->checkpoint,
                  "A training checkpoint (a tag folder, or one with `latest`), a run folder or a model folder")->required();
  cmd->add_option("--to", o->to, "Output: a .safetensors file; with --format hf a folder; with --format gguf a .gguf file")->required();
  cmd->add_option("--format", o->format,
                  "safetensors (torchspeed's names, config in the metadata), hf (the model's Hugging Face family) or gguf (llama.cpp)")
      ->check(CLI::IsMember({"safetensors", "hf", "gguf"}));
  cmd->add_option("--tokenizer", o->tokenizer, "With --format hf or gguf: the tokenizer to write with the model (default: the model's own)");
  cmd->add_option("--dtype", o->dtype, "Output dtype (q8_0, q4_0, q4_1: with --format gguf)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "q8_0", "q4_0", "q4_1"}));
  return [o]() {
    auto model = checkpoint::load_model(o->checkpoint);
    if (o->format == "gguf") return write_gguf({o->checkpoint, o->to, o->dtype, o->tokenizer}, model);
    TS_CHECK(o->dtype != "q8_0" && o->dtype != "q4_0" && o->dtype != "q4_1", "convert: --dtype ", o->dtype, " is written with --format gguf only");
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
