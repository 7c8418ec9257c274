// `torchspeed bench serve`'s real-model part: SmolLM2-135M-Instruct from its GGUF beside
// transformers reading the same file (declared in bench_serve.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bench_serve.h"
#include "bench_serve_load.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"

namespace torchspeed::bench {
using namespace serve_load;
namespace fs = std::filesystem;

std::string smollm2_gguf(const fs::path& dir) {
  std::string gguf;
  const std::string out = (dir / "smollm2.txt").string();
  if (launcher::run_command({std::string(TORCHSPEED_SOURCE_DIR) + "/scripts/smollm2"}, out, (dir / "smollm2.err").string()) == 0) {
    std::ifstream in(out);
    std::getline(in, gguf);
  }
  return gguf;
}

// SmolLM2-135M-Instruct from its GGUF (scripts/smollm2: Q4_1, dequantized as both sides load
// it) served in each weight format beside transformers' LlamaForCausalLM reading the same file in
// fp32 and bf16: batch-1 decode and 16 prompts at once, the same 16 prompts of 64 token ids
// (fortunes) and 128 new tokens each (ignore_eos here, min_new_tokens there).
void serve_smollm2(const BenchArgs& args, const std::string& self, const std::string& py, const fs::path& dir,
                   const std::vector<std::string>& formats, BenchReport& report) {
  const std::string src = TORCHSPEED_SOURCE_DIR;
  const std::string gguf = smollm2_gguf(dir);
  if (gguf.empty()) {
    std::printf("bench serve: scripts/smollm2 failed (see %s): no SmolLM2 rows\n", (dir / "smollm2.err").c_str());
    return;
  }
  const int64_t prompt_len = 64, new_tokens = args.quick ? 16 : 128, batch = 16;
  // The prompts: consecutive fortunes, encoded with the model's own tokenizer, cut to 64 ids.
  std::vector<nlohmann::json> prompts;
  {
    const checkpoint::Model m = checkpoint::load_model(gguf);
    const auto tok = data::tokenizer_of_model(gguf, m);
    const auto f = fortunes();
    for (int64_t i = 0; i < batch; ++i) {
      std::vector<int64_t> ids;
      for (size_t k = static_cast<size_t>(i) * 131; static_cast<int64_t>(ids.size()) < prompt_len; ++k) {
        const auto more = tok->encode(f[k % f.size()]);
        ids.insert(ids.end(), more.begin(), more.end());
      }
      ids.resize(static_cast<size_t>(prompt_len));
      prompts.push_back(ids);
    }
  }
  const std::string prompts_json = (dir / "smollm2_prompts.json").string();
  std::ofstream(prompts_json) << nlohmann::json{{"prompts", prompts}}.dump();
  std::printf("bench serve: SmolLM2-135M-Instruct (%s), %ld-token prompts + %ld new tokens; batch 1 and %ld at once\n",
              gguf.c_str(), static_cast<long>(prompt_len), static_cast<long>(new_tokens), static_cast<long>(batch));
  std::fflush(stdout);
  std::map<std::string, nlohmann::json> hf;  // by dtype
  if (!py.empty()) {
    for (const std::string dtype : {"fp32", "bf16"}) {
      const std::string out = (dir / ("hf-smollm2-" + dtype + ".json")).string(), log = (dir / ("hf-smollm2-" + dtype + ".log")).string();
      if (launcher::run_command({py, src + "/benchmarks/hf_reference.py", "bench", "--gguf", gguf, "--prompts", prompts_json,
                                 "--threads", std::to_string(at::get_num_threads()), "--new-tokens", std::to_string(new_tokens),
                                 "--batch", std::to_string(batch), "--dtype", dtype, "--reps", args.quick ? "1" : "3", "--json", out},
                                log, log) == 0) {
        std::ifstream(out) >> hf[dtype];
        hf[dtype]["case"] = "smollm2_transformers";
        report.add_result(hf[dtype]);
        std::printf("bench serve: SmolLM2 transformers %s: batch 1 %.1f tok/s, %ld batched %.1f tok/s\n", dtype.c_str(),
                    hf[dtype]["batch1_decode_tok_s"].get<double>(), static_cast<long>(batch), hf[dtype]["batched_tok_s"].get<double>());
      } else {
        std::printf("bench serve: SmolLM2 transformers %s failed, see %s\n", dtype.c_str(), log.c_str());
      }
      std::fflush(stdout);
    }
  }
  std::map<std::string, double> ours1, ours16;
  for (const std::string& fmt : formats) {
    const int port = free_port();
    Child c = start_server({self, "serve", "--checkpoint", gguf, "--port", std::to_string(port), "--weights", fmt,
                            "--served-model-name", "smollm2", "--max-num-seqs", "64", "--kv-cache-mb", "1024",
                            "--max-batched-tokens", "512"},
                           port, (dir / ("server-smollm2-" + fmt + ".log")).string());
    ServerGuard guard{c};
    stream_request(port, "smollm2", prompts[0], 8, true);  // warm-up
    std::vector<double> tpot;
    for (int i = 0; i < (args.quick ? 1 : 3); ++i) {
      Sample s = stream_request(port, "smollm2", prompts[0], new_tokens, true);
      TS_CHECK(s.ok && s.tokens == new_tokens, "bench serve: a SmolLM2 batch-1 request failed (", fmt, ")");
      tpot.push_back(s.tpot);
    }
    ours1[fmt] = 1.0 / median(tpot);
    burst(port, "smollm2", prompts, 8, static_cast<int>(batch), true);  // warm-up of the batched shapes
    const LoadResult b = burst(port, "smollm2", prompts, new_tokens, static_cast<int>(batch), true);
    TS_CHECK(b.failed == 0, "bench serve: ", b.failed, " SmolLM2 requests of 16 failed (", fmt, ")");
    nlohmann::json row = b.summary("smollm2_burst_16");
    ours16[fmt] = row["output_tokens_per_s"].get<double>();
    stop_server(c);
    row["weights"] = fmt;
    row["batch1_decode_tok_s"] = ours1[fmt];
    row["model"] = "SmolLM2-135M-Instruct";
    report.add_result(row);
    std::printf("bench serve: SmolLM2 torchspeed %s: batch 1 %.1f tok/s (TPOT %.2f ms), %ld at once %.1f tok/s (TTFT p50 %.0f ms)\n",
                fmt.c_str(), ours1[fmt], median(tpot) * 1e3, static_cast<long>(batch), ours16[fmt], row["ttft_p50_ms"].get<double>());
    std::fflush(stdout);
  }
  // The table: each of our formats against transformers in fp32 and in bf16.
  std::printf("\nSmolLM2-135M-Instruct, %ld + %ld tokens: tokens/s (torchspeed / transformers)\n", static_cast<long>(prompt_len),
              static_cast<long>(new_tokens));
  std::printf("  %-24s %12s %12s %12s %12s %12s %12s\n", "", "batch 1", "/ hf fp32", "/ hf bf16", "16 at once", "/ hf fp32", "/ hf bf16");
  auto ratio = [&](double v, const std::string& d, const char* key) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2fx", hf.count(d) ? v / hf[d][key].get<double>() : 0.0);
    return hf.count(d) ? std::string(buf) : std::string("-");
  };
  for (const std::string d : {"fp32", "bf16"}) {
    if (!hf.count(d)) continue;
    std::printf("  %-24s %12.1f %12s %12s %12.1f %12s %12s\n", concat("transformers ", d).c_str(), hf[d]["batch1_decode_tok_s"].get<double>(),
                "", "", hf[d]["batched_tok_s"].get<double>(), "", "");
  }
  for (const auto& fmt : formats) {
    std::printf("  %-24s %12.1f %12s %12s %12.1f %12s %12s\n", concat("torchspeed ", fmt).c_str(), ours1[fmt],
                ratio(ours1[fmt], "fp32", "batch1_decode_tok_s").c_str(), ratio(ours1[fmt], "bf16", "batch1_decode_tok_s").c_str(),
                ours16[fmt], ratio(ours16[fmt], "fp32", "batched_tok_s").c_str(), ratio(ours16[fmt], "bf16", "batched_tok_s").c_str());
    nlohmann::json r = {{"case", "smollm2_vs_transformers"}, {"weights", fmt}, {"batch1_tok_s", ours1[fmt]}, {"burst16_tok_s", ours16[fmt]}};
    for (const std::string d : {"fp32", "bf16"}) {
      if (!hf.count(d)) continue;
      r[concat("batch1_over_transformers_", d)] = ours1[fmt] / hf[d]["batch1_decode_tok_s"].get<double>();
      r[concat("burst16_over_transformers_", d)] = ours16[fmt] / hf[d]["batched_tok_s"].get<double>();
    }
    report.add_result(r);
  }
  // The GPT part's targets, on the real model: fp32 at batch 1 >= 1.5x transformers fp32; the
  // compact formats >= 2.5x at batch 1 and >= 3x with 16 requests at once.
  if (hf.count("fp32")) {
    const double hf1 = hf["fp32"]["batch1_decode_tok_s"].get<double>(), hfb = hf["fp32"]["batched_tok_s"].get<double>();
    for (const auto& fmt : formats) {
      report.add_target(concat("SmolLM2 ", fmt, " batch-1 decode vs transformers fp32"), ours1[fmt] / hf1, fmt == "fp32" ? 1.5 : 2.5);
      if (fmt != "fp32") report.add_target(concat("SmolLM2 ", fmt, " 16 at once vs transformers fp32 batched"), ours16[fmt] / hfb, 3.0);
    }
  }
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace torchspeed::bench
