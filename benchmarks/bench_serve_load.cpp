// The load side of `torchspeed bench serve`: see bench_serve_load.h.
#include "bench_serve_load.h"

#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "bench_report.h"
#include "torchspeed/data/text.h"
#include "torchspeed/base/error.h"

extern char** environ;

namespace torchspeed::bench::serve_load {
namespace fs = std::filesystem;

double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(idx)), hi = static_cast<size_t>(std::ceil(idx));
  return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
}

// Memory bandwidth as a decode sees it: summing a 512 MB fp32 tensor with this process's threads.
double measure_bandwidth() {
  at::Tensor x = at::ones({1LL << 27});
  std::vector<double> t;
  for (int i = 0; i < 7; ++i) {
    const auto a = Clock::now();
    volatile float s = x.sum().item<float>();
    (void)s;
    t.push_back(secs(a, Clock::now()));
  }
  return static_cast<double>(x.nbytes()) / median(t);
}

// Fortunes, one per entry ('%' lines separate them).
std::vector<std::string> fortunes() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(data::kDefaultCorpus)) {
    if (!e.is_regular_file() || e.path().extension() == ".dat" || e.is_symlink()) continue;
    std::ifstream in(e.path());
    std::string line, cur;
    while (std::getline(in, line)) {
      if (line == "%") {
        if (!cur.empty()) out.push_back(cur);
        cur.clear();
      } else {
        cur += line + "\n";
      }
    }
  }
  std::sort(out.begin(), out.end());
  TS_CHECK(!out.empty(), "bench serve: no fortunes under ", data::kDefaultCorpus, " (apt-get install fortunes)");
  return out;
}

// Prompts are whole fortunes (up to 256 bytes); output lengths are other fortunes' lengths,
// clipped to [16, 256].
std::vector<Work> draw(const std::vector<std::string>& f, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Work> w;
  for (int i = 0; i < n; ++i) {
    std::string p = f[rng() % f.size()].substr(0, 256);
    const int64_t len = std::clamp<int64_t>(static_cast<int64_t>(f[rng() % f.size()].size()), 16, 256);
    w.push_back({p, len});
  }
  return w;
}

// One streaming completion; times each SSE event that carries text.
// prompt: text or token ids; ignore_eos (vLLM's): exactly max_tokens, whatever the model says.
Sample stream_request(int port, const std::string& model, const nlohmann::json& prompt, int64_t max_tokens,
                      bool ignore_eos) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(600, 0);
  nlohmann::json body = {{"model", model}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0.0},
                         {"stream", true}, {"stream_options", {{"include_usage", true}}}};
  if (ignore_eos) body["ignore_eos"] = true;
  Sample s;
  std::vector<Clock::time_point> at;
  std::string buf;
  const auto t0 = Clock::now();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    buf.append(d, n);
    size_t pos;
    while ((pos = buf.find("\n\n")) != std::string::npos) {
      const std::string ev = buf.substr(0, pos);
      buf.erase(0, pos + 2);
      if (ev.rfind("data: ", 0) != 0 || ev == "data: [DONE]") continue;
      const auto j = nlohmann::json::parse(ev.substr(6), nullptr, false);
      if (j.is_discarded()) continue;
      // The usage may ride on the last event with text (llama-server's finish chunk) or on one of its own (ours, vLLM).
      if (j.contains("usage") && j["usage"].is_object()) s.tokens = j["usage"]["completion_tokens"].get<int64_t>();
      if (!j["choices"].empty()) at.push_back(Clock::now());
    }
    return true;
  };
  auto res = cli.send(req);
  const auto t1 = Clock::now();
  s.ok = res && res->status == 200 && !at.empty();
  if (!s.ok) return s;
  s.ttft = secs(t0, at.front());
  s.total = secs(t0, t1);
  for (size_t i = 1; i < at.size(); ++i) s.itl.push_back(secs(at[i - 1], at[i]));
  if (s.tokens > 1) s.tpot = secs(at.front(), at.back()) / static_cast<double>(s.tokens - 1);
  return s;
}

// A finished request's sample, from any client thread.
void record(LoadResult& r, std::mutex& mu, Sample s) {
  std::lock_guard<std::mutex> g(mu);
  if (s.ok) r.samples.push_back(std::move(s));
  else ++r.failed;
}

// `clients` threads, each sending its share of `work` one request after another. Each client's
// first request is a warm-up, not counted: all clients start at the same instant, and that
// synchronised first wave (16 prompts prefilled at once) is not the steady state a closed loop
// measures. The warm-ups ask for 8 to 136 tokens, spread over the clients, so that the measured
// requests start at staggered times, as in a loop that has been running. The wall time counts
// from the first measured request's start.
LoadResult closed_loop(int port, const std::string& model, const std::vector<Work>& work, int clients) {
  LoadResult r;
  std::mutex mu;
  std::vector<std::thread> th;
  Clock::time_point first = Clock::time_point::max();
  for (int c = 0; c < clients; ++c) {
    th.emplace_back([&, c] {
      stream_request(port, model, work[static_cast<size_t>(c) % work.size()].prompt, 8 + 128 * c / clients);  // warm-up
      {
        std::lock_guard<std::mutex> g(mu);
        first = std::min(first, Clock::now());
      }
      for (size_t i = static_cast<size_t>(c); i < work.size(); i += static_cast<size_t>(clients)) {
        Sample s = stream_request(port, model, work[i].prompt, work[i].max_tokens);
        s.work = i;
        record(r, mu, std::move(s));
      }
    });
  }
  for (auto& t : th) t.join();
  r.wall = secs(first, Clock::now());
  return r;
}

// `n` requests sent at the same instant, each with the same prompt and length: the workload of
// transformers' batched generate() (16 prompts of 64 tokens, 128 new tokens each).
// prompts: one per request (or one for all); ignore_eos as in stream_request.
LoadResult burst(int port, const std::string& model, const std::vector<nlohmann::json>& prompts, int64_t tokens, int n,
                 bool ignore_eos) {
  LoadResult r;
  std::mutex mu;
  std::vector<std::thread> th;
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    th.emplace_back([&, i] {
      Sample s = stream_request(port, model, prompts[static_cast<size_t>(i) % prompts.size()], tokens, ignore_eos);
      record(r, mu, std::move(s));
    });
  }
  for (auto& t : th) t.join();
  r.wall = secs(t0, Clock::now());
  return r;
}

// Requests arriving as a Poisson process of `rate` per second, each on its own thread.
LoadResult poisson(int port, const std::string& model, const std::vector<Work>& work, double rate, uint64_t seed) {
  LoadResult r;
  std::mutex mu;
  std::vector<std::thread> th;
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate);
  const auto t0 = Clock::now();
  double t = 0;
  for (const Work& w : work) {
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t)));
    th.emplace_back([&, w] {
      Sample s = stream_request(port, model, w.prompt, w.max_tokens);
      record(r, mu, std::move(s));
    });
    t += gap(rng);
  }
  for (auto& x : th) x.join();
  r.wall = secs(t0, Clock::now());
  return r;
}

// A port nobody listens on (the socket is closed again; httplib's own servers set
// SO_REUSEPORT, so a probe left listening would take a share of the connections).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  TS_CHECK(fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
               ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0,
           "bench serve: cannot find a free port on 127.0.0.1");
  ::close(fd);
  return ntohs(a.sin_port);
}

Child start_server(const std::vector<std::string>& argv, int port, const std::string& log, int health_timeout_s) {
  std::vector<char*> a;
  for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  Child c;
  c.port = port;
  TS_CHECK(posix_spawn(&c.pid, a[0], &fa, nullptr, a.data(), environ) == 0, "bench serve: cannot start ", argv[0]);
  posix_spawn_file_actions_destroy(&fa);
  httplib::Client cli("127.0.0.1", port);
  for (int i = 0; i < 10 * health_timeout_s; ++i) {
    auto res = cli.Get("/health");
    if (res && res->status == 200) return c;
    int st;
    TS_CHECK(waitpid(c.pid, &st, WNOHANG) == 0, "bench serve: the server exited at startup; see ", log);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  stop_server(c);  // no guard holds it yet: a server that never got healthy must not outlive the check
  TS_CHECK(false, "bench serve: the server did not become healthy in ", health_timeout_s, " s; see ", log);
  return c;
}

void stop_server(Child& c) {
  if (c.pid <= 0) return;
  ::kill(c.pid, SIGTERM);
  int st;
  waitpid(c.pid, &st, 0);
  c.pid = -1;
}

std::map<std::string, double> metrics(int port) {
  httplib::Client cli("127.0.0.1", port);
  std::map<std::string, double> m;
  auto res = cli.Get("/metrics");
  if (!res) return m;
  std::istringstream in(res->body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    std::string name = line.substr(0, line.find('{') == std::string::npos ? sp : line.find('{'));
    m[name] += std::stod(line.substr(sp + 1));
  }
  return m;
}

}  // namespace torchspeed::bench::serve_load
