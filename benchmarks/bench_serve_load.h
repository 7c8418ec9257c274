// The load side of `torchspeed bench serve` (internal to benchmarks/): the fortunes corpus,
// streaming OpenAI requests timed per token (TTFT, TPOT, ITL), closed loops, bursts and Poisson
// arrivals over client threads, and the server as a child process (started, health-checked,
// stopped; its Prometheus metrics).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace torchspeed::bench::serve_load {

using Clock = std::chrono::steady_clock;

double secs(Clock::time_point a, Clock::time_point b);

double pct(std::vector<double> v, double p);

// Memory bandwidth as a decode sees it: summing a 512 MB fp32 tensor with this process's threads.
double measure_bandwidth();

// Fortunes, one per entry ('%' lines separate them).
std::vector<std::string> fortunes();

struct Work {
  std::string prompt;
  int64_t max_tokens;
};

// Prompts are whole fortunes (up to 256 bytes); output lengths are other fortunes' lengths,
// clipped to [16, 256].
std::vector<Work> draw(const std::vector<std::string>& f, int n, uint64_t seed);

struct Sample {
  double ttft = 0, tpot = 0, total = 0;
  std::vector<double> itl;
  int64_t tokens = 0;
  bool ok = false;
  size_t work = 0;  // index of the request in its work list
};

// One streaming completion; times each SSE event that carries text.
// prompt: text or token ids; ignore_eos (vLLM's): exactly max_tokens, whatever the model says.
Sample stream_request(int port, const std::string& model, const nlohmann::json& prompt, int64_t max_tokens,
                      bool ignore_eos = false);

struct LoadResult {
  std::vector<Sample> samples;
  double wall = 0;
  int failed = 0;
  nlohmann::json summary(const std::string& name) const {
    std::vector<double> ttft, tpot, itl;
    int64_t toks = 0;
    for (const auto& s : samples) {
      ttft.push_back(s.ttft);
      if (s.tpot > 0) tpot.push_back(s.tpot);
      itl.insert(itl.end(), s.itl.begin(), s.itl.end());
      toks += s.tokens;
    }
    return {{"case", name}, {"requests", samples.size()}, {"failed", failed}, {"wall_s", wall},
            {"requests_per_s", static_cast<double>(samples.size()) / wall},
            {"output_tokens_per_s", static_cast<double>(toks) / wall},
            {"ttft_p50_ms", pct(ttft, 50) * 1e3}, {"ttft_p99_ms", pct(ttft, 99) * 1e3},
            {"tpot_p50_ms", pct(tpot, 50) * 1e3}, {"tpot_p99_ms", pct(tpot, 99) * 1e3},
            {"itl_p50_ms", pct(itl, 50) * 1e3}, {"itl_p99_ms", pct(itl, 99) * 1e3}};
  }
};

// A finished request's sample, from any client thread.
void record(LoadResult& r, std::mutex& mu, Sample s);

// `clients` threads, each sending its share of `work` one request after another. Each client's
// first request is a warm-up, not counted: all clients start at the same instant, and that
// synchronised first wave (16 prompts prefilled at once) is not the steady state a closed loop
// measures. The warm-ups ask for 8 to 136 tokens, spread over the clients, so that the measured
// requests start at staggered times, as in a loop that has been running. The wall time counts
// from the first measured request's start.
LoadResult closed_loop(int port, const std::string& model, const std::vector<Work>& work, int clients);

// `n` requests sent at the same instant, each with the same prompt and length: the workload of
// transformers' batched generate() (16 prompts of 64 tokens, 128 new tokens each).
// prompts: one per request (or one for all); ignore_eos as in stream_request.
LoadResult burst(int port, const std::string& model, const std::vector<nlohmann::json>& prompts, int64_t tokens, int n,
                 bool ignore_eos = false);

// Requests arriving as a Poisson process of `rate` per second, each on its own thread.
LoadResult poisson(int port, const std::string& model, const std::vector<Work>& work, double rate, uint64_t seed);

// A port nobody listens on (the socket is closed again; httplib's own servers set
// SO_REUSEPORT, so a probe left listening would take a share of the connections).
int free_port();

struct Child {
  pid_t pid = -1;
  int port = 0;
};

// Started and polled on GET /health until it answers 200 (stopped again and an error after
// health_timeout_s: vLLM's start compiles its model for a minute).
Child start_server(const std::vector<std::string>& argv, int port, const std::string& log, int health_timeout_s = 120);

void stop_server(Child& c);

// Stops the server when it goes out of scope: a failed check does not leave it running.
struct ServerGuard {
  Child& c;
  ~ServerGuard() { stop_server(c); }
};

std::map<std::string, double> metrics(int port);

}  // namespace torchspeed::bench::serve_load
