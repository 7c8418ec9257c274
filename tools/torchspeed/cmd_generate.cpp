// `torchspeed generate --checkpoint DIR --prompt TEXT [--max-new-tokens N --temperature T
// --top-k K --seed S]`: loads a trained GPT and prints generated text.
#include <torch/torch.h>

#include <cstdio>

#include "commands.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/text.h"
#include "torchspeed/models/gpt.h"

namespace torchspeed::cli {

Runner add_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate text with a trained GPT checkpoint");
  struct Opts {
    std::string checkpoint, prompt = "\n";
    models::SampleOptions sample;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--checkpoint", o->checkpoint,
                  "A run folder, a training checkpoint, a model folder (model.safetensors + config.json) "
                  "or a .safetensors file from `torchspeed convert`")->required();
  cmd->add_option("--prompt", o->prompt, "Text to continue");
  cmd->add_option("--max-new-tokens", o->sample.max_new_tokens, "Tokens (bytes) to generate")->check(CLI::Range(1, 1000000));
  cmd->add_option("--temperature", o->sample.temperature, "Sampling temperature (0: greedy)")->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", o->sample.top_k, "Sample from the k most likely tokens (0: all)")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--seed", o->sample.seed, "Random seed");
  return [o]() {
    const auto loaded = checkpoint::load_model(o->checkpoint);
    auto gpt = models::GPTConfig::from_json(loaded.config.value("model", nlohmann::json::object()));
    auto model = models::make_gpt(gpt);
    checkpoint::load_into(model, loaded);
    data::ByteTokenizer tok;
    auto out = models::sample(model, gpt, tok.encode(o->prompt), o->sample);
    std::printf("%s%s\n", o->prompt.c_str(), tok.decode(out).c_str());
    return 0;
  };
}

}  // namespace torchspeed::cli
