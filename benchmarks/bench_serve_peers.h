// `torchspeed bench serve`'s "peers_serve" part (internal to benchmarks/): torchspeed's server beside
// the serving peers, llama.cpp's llama-server and vLLM's CPU build (set up by scripts/serve-peers),
// driven by the same load generator (bench_serve_load.h) on the same weights and prompts.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "bench_report.h"

namespace torchspeed::bench {

// For a GPT-2-shaped model and SmolLM2-135M-Instruct, each weight format in `formats` (fp32, bf16,
// int8, q4_0, q4_1) served by torchspeed, by llama-server (GGUF from `torchspeed convert`: F32, BF16,
// Q8_0, Q4_0, Q4_1, and llama-quantize's Q4_K_M) and by vLLM (the Hugging Face folder, float32 and bfloat16),
// one server at a time: 1 client and 16 clients, 128-token prompts and 128 tokens out. Rows into
// `report`, a table on stdout, scratch files under `dir`. Skipped, with the reason printed, when
// scripts/serve-peers has not been run (TORCHSPEED_SERVE_PEERS=1: this runs it).
void serve_peers(const BenchArgs& args, const std::string& self, const std::filesystem::path& dir,
                 const std::vector<std::string>& formats, BenchReport& report);

}  // namespace torchspeed::bench
