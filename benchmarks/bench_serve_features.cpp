// `torchspeed bench serve`'s features part (declared in bench_serve.h): what prefix caching and
// speculative decoding buy on SmolLM2-135M-Instruct, each measured against the same server with
// the feature off, outputs compared; and the 4-bit format's perplexity against fp32.
#include <httplib.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench_serve.h"
#include "bench_serve_load.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/data/text.h"
#include "torchspeed/base/error.h"

namespace torchspeed::bench {
using namespace serve_load;
namespace fs = std::filesystem;
namespace {

struct Reply {
  std::string text;
  int64_t tokens = 0;
  double seconds = 0;
};

// One non-streaming request, timed whole: /v1/completions or /v1/chat/completions.
Reply post(int port, const std::string& path, const nlohmann::json& body) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(600, 0);
  const auto t0 = Clock::now();
  const auto res = cli.Post(path, body.dump(), "application/json");
  Reply r;
  r.seconds = secs(t0, Clock::now());
  TS_CHECK(res && res->status == 200, "bench serve features: ", path, " answered ",
           res ? concat("HTTP ", res->status, ": ", res->body) : std::string("nothing"));
  const auto j = nlohmann::json::parse(res->body);
  const auto& c = j.at("choices").at(0);
  r.text = c.contains("message") ? c["message"].value("content", std::string()) : c.value("text", std::string());
  r.tokens = j.at("usage").at("completion_tokens").get<int64_t>();
  return r;
}

std::vector<std::string> server_argv(const std::string& self, const std::string& gguf, int port, const std::string& weights,
                                     const std::vector<std::string>& extra) {
  std::vector<std::string> a{self, "serve", "--checkpoint", gguf, "--port", std::to_string(port), "--weights", weights,
                             "--served-model-name", "smollm2", "--max-num-seqs", "64", "--kv-cache-mb", "1024",
                             "--max-batched-tokens", "512"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// A shared 512-token system prompt and 16 clients, each with its own 32-token question, sent at
// once to a server that has seen the system prompt before (one earlier request), with and without
// prefix caching: time to first token, and the greedy outputs of the same requests.
void prefix_caching(const BenchArgs& args, const std::string& self, const std::string& gguf, const data::Tokenizer& tok,
                    const fs::path& dir, BenchReport& report) {
  const auto f = fortunes();
  auto tokens_from = [&](size_t first, int64_t n) {
    std::vector<int64_t> ids;
    for (size_t k = first; static_cast<int64_t>(ids.size()) < n; ++k) {
      const auto more = tok.encode(f[k % f.size()]);
      ids.insert(ids.end(), more.begin(), more.end());
    }
    ids.resize(static_cast<size_t>(n));
    return ids;
  };
  const int64_t sys_len = 512, q_len = 32, out = args.quick ? 8 : 32;
  const int n = 16;
  const std::vector<int64_t> sys = tokens_from(7, sys_len);
  std::vector<nlohmann::json> prompts;
  for (int i = 0; i <= n; ++i) {  // the last one: the earlier request that brought the system prompt
    std::vector<int64_t> p = sys;
    const auto q = tokens_from(1000 + static_cast<size_t>(i) * 53, q_len);
    p.insert(p.end(), q.begin(), q.end());
    prompts.push_back(p);
  }
  std::map<bool, nlohmann::json> rows;
  std::map<bool, std::vector<std::string>> texts;
  for (const bool on : {true, false}) {
    const int port = free_port();
    Child c = start_server(server_argv(self, gguf, port, "bf16", on ? std::vector<std::string>{} : std::vector<std::string>{"--no-enable-prefix-caching"}),
                           port, (dir / concat("server-prefix-", on ? "on" : "off", ".log")).string());
    ServerGuard guard{c};
    post(port, "/v1/completions", {{"model", "smollm2"}, {"prompt", prompts[n]}, {"max_tokens", 4}, {"temperature", 0}});
    std::vector<nlohmann::json> burst_prompts(prompts.begin(), prompts.begin() + n);
    const LoadResult b = burst(port, "smollm2", burst_prompts, out, n, true);
    TS_CHECK(b.failed == 0, "bench serve features: ", b.failed, " prefix-caching requests failed");
    rows[on] = b.summary(on ? "prefix_caching_on" : "prefix_caching_off");
    const auto m = metrics(port);
    rows[on]["prefix_cache_hit_tokens"] = m.count("torchspeed_prefix_cache_hits_total") ? m.at("torchspeed_prefix_cache_hits_total") : 0.0;
    for (int i = 0; i < (args.quick ? 2 : 4); ++i) {
      texts[on].push_back(post(port, "/v1/completions", {{"model", "smollm2"}, {"prompt", prompts[static_cast<size_t>(i)]},
                                                         {"max_tokens", out}, {"temperature", 0}})
                              .text);
    }
  }
  const double ratio = rows[false]["ttft_p50_ms"].get<double>() / rows[true]["ttft_p50_ms"].get<double>();
  const bool same = texts[true] == texts[false];
  for (const bool on : {true, false}) {
    rows[on]["outputs_identical"] = same;
    report.add_result(rows[on]);
  }
  std::printf("bench serve: prefix caching, SmolLM2 bf16, %ld-token shared system prompt + %ld-token questions, %d clients at once, "
              "%ld tokens out: TTFT p50 %.0f ms (p99 %.0f) with, %.0f ms (p99 %.0f) without: %.1fx lower; %.0f prompt tokens "
              "found cached; greedy outputs %s\n",
              static_cast<long>(sys_len), static_cast<long>(q_len), n, static_cast<long>(out), rows[true]["ttft_p50_ms"].get<double>(),
              rows[true]["ttft_p99_ms"].get<double>(), rows[false]["ttft_p50_ms"].get<double>(), rows[false]["ttft_p99_ms"].get<double>(),
              ratio, rows[true]["prefix_cache_hit_tokens"].get<double>(), same ? "identical" : "DIFFER");
  std::fflush(stdout);
  report.add_target("prefix caching: TTFT p50 without / with (shared 512-token system prompt, 16 clients)", ratio, 3.0);
  report.add_target("prefix caching: greedy outputs identical with and without (1 = yes)", same ? 1.0 : 0.0, 1.0);
}

// Batch-1 greedy decoding of a code-editing request (the answer repeats most of the prompt's
// code), with and without n-gram speculative decoding: tokens/s, acceptance, outputs.
void speculative(const BenchArgs& args, const std::string& self, const std::string& gguf, const fs::path& dir, BenchReport& report) {
  std::string code;
  {
    std::ifstream in(std::string(TORCHSPEED_SOURCE_DIR) + "/src/torchspeed/inference/sampler.cpp");
    std::string line;
    for (int i = 0; i < 400 && std::getline(in, line) && code.size() < 1600; ++i) {
      if (line.rfind("//", 0) == 0 || line.rfind("#include", 0) == 0) continue;  // the code, not its comments
      code += line + "\n";
    }
  }
  const nlohmann::json body = {{"model", "smollm2"},
                               {"messages", {{{"role", "user"},
                                              {"content", "Here is some C++ code:\n```cpp\n" + code +
                                                              "```\nRewrite this code with every `int64_t` replaced by `long`. Answer with the code only."}}}},
                               {"max_tokens", args.quick ? 32 : 256},
                               {"temperature", 0}};
  const std::string config = R"({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2})";
  std::map<bool, double> tok_s;
  std::map<bool, std::string> text;
  std::map<bool, int64_t> tokens;
  double accepted = 0, drafted = 0;
  for (const bool spec : {false, true}) {
    const int port = free_port();
    Child c = start_server(server_argv(self, gguf, port, "bf16", spec ? std::vector<std::string>{"--speculative-config", config} : std::vector<std::string>{}),
                           port, (dir / concat("server-spec-", spec ? "on" : "off", ".log")).string());
    ServerGuard guard{c};
    nlohmann::json warm = body;
    warm["max_tokens"] = 4;
    post(port, "/v1/chat/completions", warm);  // warm-up; the prompt is then cached for every run alike
    std::vector<double> rates;
    for (int i = 0; i < (args.quick ? 1 : 3); ++i) {
      const Reply r = post(port, "/v1/chat/completions", body);
      rates.push_back(static_cast<double>(r.tokens) / r.seconds);
      text[spec] = r.text;
      tokens[spec] = r.tokens;
    }
    tok_s[spec] = median(rates);
    if (spec) {
      const auto m = metrics(port);
      drafted = m.count("torchspeed_spec_decode_draft_tokens_total") ? m.at("torchspeed_spec_decode_draft_tokens_total") : 0.0;
      accepted = m.count("torchspeed_spec_decode_accepted_tokens_total") ? m.at("torchspeed_spec_decode_accepted_tokens_total") : 0.0;
    }
  }
  const bool same = text[true] == text[false];
  const double ratio = tok_s[true] / tok_s[false];
  std::printf("bench serve: speculative decoding (n-gram prompt lookup, k 5), SmolLM2 bf16, a code-editing chat request, batch 1, "
              "%ld tokens: %.1f tok/s with, %.1f without: %.2fx; %.0f of %.0f draft tokens accepted (%.0f%%); greedy outputs %s\n",
              static_cast<long>(tokens[true]), tok_s[true], tok_s[false], ratio, accepted, drafted,
              drafted > 0 ? 100 * accepted / drafted : 0.0, same ? "identical" : "DIFFER");
  std::fflush(stdout);
  report.add_result({{"case", "speculative_decoding"}, {"tok_s_with", tok_s[true]}, {"tok_s_without", tok_s[false]}, {"speedup", ratio},
                     {"draft_tokens", drafted}, {"accepted_tokens", accepted}, {"completion_tokens", tokens[true]},
                     {"outputs_identical", same}, {"speculative_config", config}});
  report.add_target("speculative decoding: batch-1 tokens/s with / without (code editing)", ratio, 1.5);
  report.add_target("speculative decoding: greedy output identical with and without (1 = yes)", same ? 1.0 : 0.0, 1.0);
}

}  // namespace

void serve_features(const BenchArgs& args, const std::string& self, const fs::path& dir, BenchReport& report) {
  const std::string gguf = smollm2_gguf(dir);
  if (gguf.empty()) {
    std::printf("bench serve: scripts/smollm2 failed (see %s): no prefix caching, speculative decoding or 4-bit quality rows\n",
                (dir / "smollm2.err").c_str());
    return;
  }
  const checkpoint::Model model = checkpoint::load_model(gguf);
  const auto tok = data::tokenizer_of_model(gguf, model);
  prefix_caching(args, self, gguf, *tok, dir, report);
  speculative(args, self, gguf, dir, report);
  // Perplexity on the fortunes validation split in SmolLM2's tokens, each weight format against
  // fp32 (the model as its GGUF holds it, dequantized).
  const int64_t window = 512;
  const int windows = args.quick ? 2 : 12;
  const data::TokenIds val = data::TextCorpus::load(data::kDefaultCorpus, 0.1, window + 1, tok.get()).val;
  const double f32 = std::exp(val_loss(model, inference::WeightFormat::kFP32, val, window, windows));
  std::printf("bench serve: SmolLM2 perplexity on the fortunes validation split (%d windows of %ld tokens): fp32 %.3f", windows,
              static_cast<long>(window), f32);
  for (auto f : {inference::WeightFormat::kBF16, inference::WeightFormat::kInt8, inference::WeightFormat::kQ4_0,
                 inference::WeightFormat::kQ4_1}) {
    const double ppl = std::exp(val_loss(model, f, val, window, windows));
    std::printf(", %s %.3f (%+.2f%%)", inference::weight_format_name(f), ppl, 100 * (ppl / f32 - 1));
    std::fflush(stdout);
    report.add_result({{"case", "smollm2_perplexity"}, {"weights", inference::weight_format_name(f)}, {"perplexity", ppl},
                       {"fp32_perplexity", f32}, {"windows", windows}, {"window", window}});
    // The target on q4_1, the format of SmolLM2's own file (whose values it keeps); q4_0 printed beside it.
    if (f == inference::WeightFormat::kQ4_1) {
      report.add_target("4-bit (q4_1) weights: SmolLM2 perplexity change vs fp32 (fortunes validation)", std::abs(ppl / f32 - 1), 0.03, false);
    }
  }
  // The int8 KV cache against bf16's, both beside bf16 weights.
  const double kv_bf16 = std::exp(val_loss(model, inference::WeightFormat::kBF16, val, window, windows, at::kBFloat16));
  const double kv_int8 = std::exp(val_loss(model, inference::WeightFormat::kBF16, val, window, windows, at::kChar));
  std::printf("; bf16 weights with an int8 KV cache %.3f (%+.2f%% vs a bf16 cache)\n", kv_int8, 100 * (kv_int8 / kv_bf16 - 1));
  std::fflush(stdout);
  report.add_result({{"case", "smollm2_perplexity_kv_int8"}, {"weights", "bf16"}, {"perplexity_kv_int8", kv_int8},
                     {"perplexity_kv_bf16", kv_bf16}, {"fp32_perplexity", f32}});
}

}  // namespace torchspeed::bench
