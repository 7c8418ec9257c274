// The independent reference of the `torchspeed train` tests: what `torchspeed train -n DP`
// computes, written as a plain single-process LibTorch loop (tests/dist/reference.h: autograd,
// clip_grad_norm_, torch::optim::AdamW with biases and norm weights in a group without weight
// decay). It reads the same config with the same --set overrides, builds the GPT from the same
// seed, and feeds each step the DP ranks' micro-batches of the same loaders concatenated; it
// writes OUT/metrics.csv in the CLI's format (step, loss, val_loss, grad_norm) for
// compare_losses.py.
//
// With --init-from MODEL, the weights start from that model (its config's model section must be
// the config's); with a "lora" section, they are frozen and each block gets an adapter, as
// `torchspeed train --init-from` does.
//
// Usage: cli_reference_train CONFIG DP OUT [--init-from MODEL] [--set KEY=VALUE ...]
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "reference.h"
#include "torchspeed/data/text.h"
#include "torchspeed/engine/engine.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/models/lora.h"
#include "torchspeed/monitor/metrics.h"
#include "torchspeed/base/error.h"

namespace ts = torchspeed;

namespace {

// --set a.b.c=VALUE as `torchspeed train` reads it: VALUE as JSON when it parses, else a string.
void apply_override(nlohmann::json& j, const std::string& kv) {
  const auto eq = kv.find('=');
  TS_CHECK(eq != std::string::npos && eq > 0, "--set '", kv, "': expected KEY=VALUE");
  nlohmann::json value;
  try {
    value = nlohmann::json::parse(kv.substr(eq + 1));
  } catch (const std::exception&) {
    value = kv.substr(eq + 1);
  }
  nlohmann::json* node = &j;
  std::string key = kv.substr(0, eq);
  for (auto dot = key.find('.'); dot != std::string::npos; dot = key.find('.')) {
    node = &(*node)[key.substr(0, dot)];
    key = key.substr(dot + 1);
  }
  (*node)[key] = value;
}

int64_t get_int(const nlohmann::json& sections, const char* section, const char* key,
                int64_t fallback) {
  return sections.value(section, nlohmann::json::object()).value(key, fallback);
}

// The global micro-batch: each data-parallel rank's next micro-batch, in rank order.
ts_test::MicroBatch next_global(std::vector<std::unique_ptr<ts::data::TextLoader>>& loaders) {
  std::vector<at::Tensor> xs, ys;
  for (auto& l : loaders) {
    auto b = l->next();
    xs.push_back(b.inputs);
    ys.push_back(b.targets);
  }
  return {at::cat(xs), at::cat(ys)};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    TS_CHECK(argc >= 4, "usage: cli_reference_train CONFIG DP OUT [--set KEY=VALUE ...]");
    nlohmann::json j = ts::config::read_json_file(argv[1]);
    const int dp = std::stoi(argv[2]);
    const std::string out = argv[3];
    std::string init_from;
    for (int i = 4; i < argc; ++i) {
      if (std::string(argv[i]) == "--init-from" && i + 1 < argc) {
        init_from = argv[++i];
        continue;
      }
      TS_CHECK(std::string(argv[i]) == "--set" && i + 1 < argc, "unexpected argument '", argv[i],
               "'");
      apply_override(j, argv[++i]);
    }
    ts::config::WorldShape shape;
    shape.world_size = dp;
    const auto cfg = ts::config::Config::parse(j, shape);
    TS_CHECK(cfg.pp == 1 && cfg.tp == 1 && dp >= 1,
             "the reference replays data parallelism only (dp = world)");
    const auto gpt =
        ts::models::GPTConfig::from_json(cfg.sections.value("model", nlohmann::json::object()));
    const auto data = cfg.sections.value("data", nlohmann::json::object());
    const int64_t steps = get_int(cfg.sections, "train", "steps", 100);
    const int64_t eval_interval = get_int(cfg.sections, "train", "eval_interval", 50);
    const int64_t eval_batches = get_int(cfg.sections, "train", "eval_batches", 4);
    const int64_t log_interval = get_int(cfg.sections, "train", "log_interval", 10);
    const bool no_decay_embeddings =
        cfg.sections.value("train", nlohmann::json::object()).value("no_decay_embeddings", false);

    auto corpus =
        ts::data::TextCorpus::load(data.value("path", std::string(ts::data::kDefaultCorpus)),
                                   data.value("val_fraction", 0.1), gpt.seq_len + 1);
    const auto seed = static_cast<uint64_t>(cfg.seed);
    const int64_t micro = cfg.train_micro_batch_size_per_gpu;
    const int gas = static_cast<int>(cfg.gradient_accumulation_steps);
    auto loaders_of = [&](const ts::data::TokenIds& split, uint64_t s) {
      std::vector<std::unique_ptr<ts::data::TextLoader>> ls;
      for (int d = 0; d < dp; ++d)
        ls.push_back(std::make_unique<ts::data::TextLoader>(split, gpt.seq_len, micro, d, dp, s));
      return ls;
    };
    auto train = loaders_of(corpus.train, seed);
    // The engine's parameter groups: only their predicate, which names the parameters without
    // decay.
    ts::models::InitTensors init;
    if (!init_from.empty()) {
      const ts::checkpoint::Model m = ts::checkpoint::load_model(init_from);
      TS_CHECK(ts::models::GPTConfig::from_json(m.config.value("model", nlohmann::json::object())).to_json() == gpt.to_json(),
               init_from, ": the model differs from the config's model section");
      auto t = std::make_shared<std::map<std::string, at::Tensor>>();
      for (const auto& [name, tensor] : m.params) (*t)[name] = tensor;
      init = t;
    }
    std::shared_ptr<const ts::models::LoraOptions> lora;
    if (cfg.sections.contains("lora")) {
      lora = std::make_shared<const ts::models::LoraOptions>(ts::models::LoraOptions::from_json(cfg.sections.at("lora"), gpt));
    }
    ts_test::ReferenceTrainer ref(ts::nn::build(ts::models::gpt_spec(gpt, seed, nullptr, init, lora)), cfg,
                                  ts::no_weight_decay_group(no_decay_embeddings).match);
    if (gpt.moe.enabled()) ref.set_pieces(dp);  // expert capacity and the balancing loss are per rank

    std::filesystem::create_directories(out);
    ts::monitor::MetricsCsv csv(out + "/metrics.csv");
    for (int64_t step = 1; step <= steps; ++step) {
      std::vector<ts_test::MicroBatch> window;
      for (int m = 0; m < gas; ++m) window.push_back(next_global(train));
      ts::monitor::StepMetrics row;
      row.step = step;
      row.samples = step * cfg.train_batch_size;
      row.loss = ref.step(window);
      row.grad_norm = ref.last_grad_norm();
      if (step % eval_interval == 0 || step == steps) {
        auto val = loaders_of(corpus.val, 12345);  // the CLI's validation loaders
        double sum = 0.0;
        for (int64_t b = 0; b < eval_batches; ++b) {
          std::vector<ts_test::MicroBatch> batch;
          for (int m = 0; m < gas; ++m) batch.push_back(next_global(val));
          sum += ref.eval(batch);
        }
        row.val_loss = sum / static_cast<double>(eval_batches);
      }
      if (step % log_interval == 0 || row.val_loss || step == steps) csv.write(row);
    }
    std::printf(
        "reference: %ld steps of plain LibTorch, dp %d x micro %ld x accumulation %d, written to "
        "%s/metrics.csv\n",
        static_cast<long>(steps), dp, static_cast<long>(micro), gas, out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cli_reference_train: %s\n", e.what());
    return 1;
  }
}
