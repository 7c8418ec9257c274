// Logits of a model folder as torchspeed computes them, for hf/gpt2_parity.py to compare with
// transformers' GPT2LMHeadModel: the text file is encoded with the model's tokenizer (the one
// beside it, as generate and serve choose), cut to the model's context, and run through both of
// our forward paths: the training LayerStack (models::gpt_spec, what `train` optimizes) and the
// serving model (inference::InferenceModel over the paged KV cache: the prompt in two chunks,
// so the second reads the first's keys and values from the cache). A TEXT_FILE ending in .json
// gives the token ids instead (a JSON list).
// Writes OUT (safetensors): "ids" [T] int64, "train" and "serve" [T, vocab] fp32.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/inference/model.h"
#include "torchspeed/models/gpt.h"

namespace ts = torchspeed;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: gpt2_logits MODEL_DIR TEXT_FILE OUT.safetensors\n");
    return 2;
  }
  try {
    const auto model = ts::checkpoint::load_model(argv[1]);
    const auto gpt = ts::models::GPTConfig::from_json(model.config.at("model"));
    const auto tok = ts::data::tokenizer_of_model(argv[1], model);  // as generate and serve choose
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    // TEXT_FILE ending in .json: token ids given as a JSON list (another implementation's tokens).
    const std::string text_path = argv[2];
    std::vector<int64_t> ids = text_path.size() > 5 && text_path.compare(text_path.size() - 5, 5, ".json") == 0
                                   ? nlohmann::json::parse(ss.str()).get<std::vector<int64_t>>()
                                   : tok->encode(ss.str());
    if (static_cast<int64_t>(ids.size()) > gpt.seq_len) ids.resize(static_cast<size_t>(gpt.seq_len));
    const int64_t T = static_cast<int64_t>(ids.size());

    c10::NoGradGuard no_grad;
    auto stack = ts::models::make_gpt(gpt);
    ts::checkpoint::load_into(stack, model);
    stack->eval();
    at::Tensor x = at::tensor(ids, at::kLong).unsqueeze(0);
    at::Tensor train = stack->forward(x).squeeze(0).to(at::kFloat).contiguous();

    ts::inference::InferenceModel serving(model, ts::inference::WeightFormat::kFP32);
    ts::inference::KVCache cache(gpt.n_layer, gpt.kv_heads(), gpt.hd(),
                                 ts::inference::KVCacheOptions().block_size(16).budget_mb(64).dtype(at::kFloat));
    std::vector<int32_t> blocks;
    for (int64_t b = 0; b < ts::inference::blocks_for(T, 16); ++b) blocks.push_back(static_cast<int32_t>(b));
    const int64_t half = T / 2;
    std::vector<at::Tensor> parts;
    for (const auto& [start, end] : {std::pair<int64_t, int64_t>{0, half}, {half, T}}) {
      if (end == start) continue;
      ts::inference::StepPlan plan;
      ts::inference::SeqChunk c;
      c.start = start;
      c.tokens.assign(ids.begin() + start, ids.begin() + end);
      c.blocks = blocks;
      c.all_logits = true;
      plan.seqs.push_back(c);
      parts.push_back(serving.forward(plan, cache));
    }
    at::Tensor serve = at::cat(parts, 0).contiguous();
    ts::checkpoint::save_safetensors(argv[3], {{"ids", at::tensor(ids, at::kLong)}, {"train", train}, {"serve", serve}});
    std::printf("gpt2_logits: %ld tokens (tokenizer %s), vocab %ld, activation %s\n", static_cast<long>(T),
                tok->source().c_str(), static_cast<long>(gpt.vocab), gpt.activation.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt2_logits: %s\n", e.what());
    return 1;
  }
}
