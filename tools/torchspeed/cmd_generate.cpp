// `torchspeed generate --checkpoint DIR --prompt TEXT [--max-new-tokens N --temperature T
// --top-k K --seed S]`: loads a trained GPT and prints generated text. Within the model's
// context it runs the serving engine (KV cache: each new token costs one token's forward);
// past the context it slides a window over the last seq_len tokens, recomputed per token.
#include <torch/torch.h>

#include <cstdio>

#include "commands.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/text.h"
#include "torchspeed/inference/serving_engine.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"

namespace torchspeed::cli {

Runner add_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate text with a trained GPT checkpoint");
  struct Opts {
    std::string checkpoint, tokenizer, prompt = "\n";
    models::SampleOptions sample;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--checkpoint", o->checkpoint,
                  "A run folder, a training checkpoint, a model folder (model.safetensors + config.json) "
                  "or a .safetensors file from `torchspeed convert`")->required();
  cmd->add_option("--prompt", o->prompt, "Text to continue");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "\"bytes\", or a BPE tokenizer's tokenizer.json or folder (default: the one beside the model, else the training config's data.tokenizer, else bytes)");
  cmd->add_option("--max-new-tokens", o->sample.max_new_tokens, "Tokens to generate")->check(CLI::Range(1, 1000000));
  cmd->add_option("--temperature", o->sample.temperature, "Sampling temperature (0: greedy)")->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", o->sample.top_k, "Sample from the k most likely tokens (0: all)")->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--seed", o->sample.seed, "Random seed");
  return [o]() {
    const auto loaded = checkpoint::load_model(o->checkpoint);
    auto gpt = models::GPTConfig::from_json(loaded.config.value("model", nlohmann::json::object()));
    const auto tok = data::tokenizer_of_model(o->checkpoint, loaded, o->tokenizer);
    const auto prompt = tok->encode_prompt(o->prompt);
    TS_CHECK(!prompt.empty(), "generate: the prompt is empty");
    std::vector<int64_t> out;
    if (static_cast<int64_t>(prompt.size()) + o->sample.max_new_tokens <= gpt.seq_len) {
      auto model = std::make_shared<inference::InferenceModel>(loaded, inference::WeightFormat::kFP32);
      const double kv_mb = static_cast<double>(inference::KVCache::bytes_per_block(gpt.n_layer, gpt.kv_heads(), gpt.hd(),
                                                                                 inference::KVCacheOptions())) *
                           static_cast<double>(inference::blocks_for(gpt.seq_len, 16)) / 1048576.0 * 1.01;
      inference::ServingEngine engine(model, inference::EngineOptions().kv(inference::KVCacheOptions().budget_mb(kv_mb)).tokenizer(tok));
      inference::SamplingParams p;
      p.temperature = o->sample.temperature;
      p.top_k = o->sample.top_k;
      p.seed = o->sample.seed;
      p.max_tokens = o->sample.max_new_tokens;
      engine.submit(prompt, p, [&out](const inference::RequestEvent& ev) {
        for (const auto& t : ev.tokens) out.push_back(t.id);
      });
      engine.run_until_idle();
    } else {
      auto model = models::make_gpt(gpt);
      checkpoint::load_into(model, loaded);
      out = models::sample(model, gpt, prompt, o->sample);
    }
    // The text ends at the end-of-text token (the engine stops there; the windowed sampler does not).
    std::string text;
    for (int64_t id : out) {
      if (id == tok->eos_id()) break;
      if (id < tok->vocab_size()) text += tok->token_bytes(id);
    }
    std::printf("%s%s\n", o->prompt.c_str(), text.c_str());
    return 0;
  };
}

}  // namespace torchspeed::cli
