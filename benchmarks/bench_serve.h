// Parts of `torchspeed bench serve` (internal to benchmarks/).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "bench_report.h"

namespace torchspeed::bench {

// SmolLM2-135M-Instruct from its GGUF (scripts/smollm2) served in each of `formats` beside
// transformers (`py`: the peers' python, "" for none) on the same file; rows and targets into
// `report`, scratch files under `dir`.
void serve_smollm2(const BenchArgs& args, const std::string& self, const std::string& py, const std::filesystem::path& dir,
                   const std::vector<std::string>& formats, BenchReport& report);

}  // namespace torchspeed::bench
