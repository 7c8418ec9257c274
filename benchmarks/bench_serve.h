// Parts of `torchspeed bench serve` (internal to benchmarks/).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "bench_report.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/text.h"
#include "torchspeed/inference/linear.h"

namespace torchspeed::bench {

// The path of SmolLM2-135M-Instruct's GGUF (scripts/smollm2 fetches it once), or "" when that
// fails (its output under `dir`: smollm2.txt, smollm2.err).
std::string smollm2_gguf(const std::filesystem::path& dir);

// SmolLM2-135M-Instruct from its GGUF (scripts/smollm2) served in each of `formats` beside
// transformers (`py`: the peers' python, "" for none) on the same file; rows and targets into
// `report`, scratch files under `dir`.
void serve_smollm2(const BenchArgs& args, const std::string& self, const std::string& py, const std::filesystem::path& dir,
                   const std::vector<std::string>& formats, BenchReport& report);

// Prefix caching (a shared 512-token system prompt, 16 clients: time to first token with and
// without), speculative decoding (n-gram prompt lookup on a code-editing request, batch 1: tokens/s
// with and without, acceptance rate) and the 4-bit format's perplexity against fp32, on
// SmolLM2-135M-Instruct; outputs compared between the servers. Rows and targets into `report`.
void serve_features(const BenchArgs& args, const std::string& self, const std::filesystem::path& dir, BenchReport& report);

// Mean next-token cross-entropy of the model in weight format `f` over `windows` windows of
// `window` tokens (at most the model's context) spread over `val`, the KV cache in `kv_dtype`
// (Undefined: serve's auto for `f`).
double val_loss(const checkpoint::Model& m, inference::WeightFormat f, const data::TokenIds& val, int64_t window, int windows,
                at::ScalarType kv_dtype = at::ScalarType::Undefined);

}  // namespace torchspeed::bench
