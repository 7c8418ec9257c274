// `torchspeed bench serve`'s peers part: torchspeed's server beside llama.cpp's llama-server and
// vLLM's CPU build (bench_serve_peers.h). What makes the comparison a fair one:
// - one server at a time on this machine's cores, each started, health-checked and stopped by the
//   same helpers, given the same number of threads;
// - the same load generator and the same requests: streaming /v1/completions, prompts sent as
//   token ids (no tokenizer difference), ignore_eos (exactly max_tokens each), temperature 0;
// - every prompt is sent once per server: llama-server and vLLM cache prompt prefixes, and a
//   repeated prompt would skip its prefill there;
// - the same weights: llama.cpp reads GGUF files and vLLM a Hugging Face folder that `torchspeed
//   convert` writes from the very model torchspeed serves, so the three compute one function (the
//   GPT-2-shaped model here uses GELU's tanh approximation, the one llama.cpp's gpt2 computes).
#include "bench_serve_peers.h"

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "bench_serve.h"
#include "bench_serve_load.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/bpe_internal.h"
#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/models/gpt.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"

namespace torchspeed::bench {
using namespace serve_load;
namespace fs = std::filesystem;
namespace {

// The byte vocabulary as a byte-level BPE without merges: token b is byte b spelled as GPT-2's
// byte-to-unicode character. llama.cpp (a "gpt2" GGUF vocabulary) and transformers/vLLM (this
// tokenizer.json) then read and print text as the byte tokenizer does, ids equal to bytes; our
// GGUF reader and llama.cpp have no byte vocabulary of their own to write instead.
nlohmann::json byte_tokenizer_json() {
  std::string to_unicode[256];
  std::unordered_map<std::string, uint8_t> to_byte;
  data::bpe::make_byte_map(to_unicode, to_byte);  // the BPE tokenizer's own bytes_to_unicode
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[to_unicode[b]] = b;
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"added_tokens", nlohmann::json::array()},
          {"normalizer", nullptr}, {"pre_tokenizer", byte_level}, {"post_processor", nullptr}, {"decoder", byte_level},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                     {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                     {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
}

std::string first_line(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

// The peers scripts/serve-peers set up: executables, or why one is missing.
struct Peers {
  std::string llama_server, llama_quantize, vllm, llama_why, vllm_why, llama_build;
};

// Empty `skip` and the peers found, or the reason the whole part is skipped.
Peers find_peers(const fs::path& root, const fs::path& dir, std::string& skip) {
  const fs::path p = root / ".peers";
  const char* env = std::getenv("TORCHSPEED_SERVE_PEERS");
  if (env != nullptr && std::string(env) == "1") {
    const std::string log = (dir / "serve-peers.log").string();
    std::printf("bench serve: TORCHSPEED_SERVE_PEERS=1: running scripts/serve-peers (the first time: llama.cpp's build, "
                "several minutes, and vLLM, a 3.4 GB install; log %s)\n", log.c_str());
    std::fflush(stdout);
    if (launcher::run_command({(root / "scripts" / "serve-peers").string()}, log, log) != 0) {
      std::printf("bench serve: scripts/serve-peers could set up no peer (see %s)\n", log.c_str());
    }
  } else if (!fs::exists(p / "llama.cpp" / "STAMP") && !fs::exists(root / ".venv-vllm" / "bin" / "vllm-peer") &&
             !fs::exists(p / "llama.cpp.unavailable") && !fs::exists(p / "vllm.unavailable")) {
    skip = "scripts/serve-peers has not been run (it builds llama.cpp and installs vLLM's CPU build; "
           "TORCHSPEED_SERVE_PEERS=1 makes the bench run it)";
    return {};
  }
  Peers peers;
  if (fs::exists(p / "llama.cpp" / "llama-server") && fs::exists(p / "llama.cpp" / "llama-quantize")) {
    peers.llama_server = (p / "llama.cpp" / "llama-server").string();
    peers.llama_quantize = (p / "llama.cpp" / "llama-quantize").string();
    peers.llama_build = first_line(p / "llama.cpp" / "STAMP");
  } else {
    peers.llama_why = fs::exists(p / "llama.cpp.unavailable") ? first_line(p / "llama.cpp.unavailable")
                                                               : "not built (scripts/serve-peers llamacpp)";
  }
  if (fs::exists(root / ".venv-vllm" / "bin" / "vllm-peer") && !fs::exists(p / "vllm.unavailable")) {
    peers.vllm = (root / ".venv-vllm" / "bin" / "vllm-peer").string();
  } else {
    peers.vllm_why = fs::exists(p / "vllm.unavailable") ? first_line(p / "vllm.unavailable") : "not installed (scripts/serve-peers vllm)";
  }
  return peers;
}

// Stops the server like ServerGuard and then, for a server started as its own process group
// (vLLM: an API server, an engine core and its workers), whatever of the group is left: a check
// that fails midway leaves no child behind on a 2-core machine that runs the next server.
struct GroupGuard {
  Child& c;
  pid_t group;
  ~GroupGuard() {
    stop_server(c);
    if (group <= 0) return;
    for (int i = 0; i < 100 && ::kill(-group, 0) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (::kill(-group, 0) == 0) ::kill(-group, SIGKILL);
  }
};

// One server in one weight format.
struct Run {
  std::string server;  // torchspeed, llama.cpp, vLLM
  std::string row;     // the table's row: fp32, bf16, int8 (Q8_0), 4-bit (Q4_0), 4-bit (Q4_K_M)
  std::string weights; // the format as this server names it
  std::function<std::vector<std::string>(int port)> argv;
  int health_timeout_s = 120;
  bool own_group = false;  // argv starts with setsid: the guard also ends the group
  std::string error;       // set when the run cannot happen (its weights could not be written)
};

struct Load {
  int one;         // requests of the 1-client case, one after another
  int64_t tokens;  // tokens out per request
  int bursts;      // bursts of 16 requests sent at once, the 16-client case
};

struct Outcome {
  nlohmann::json one, sixteen;
  std::string error;
};

LoadResult sequential(int port, const std::string& name, const std::function<nlohmann::json()>& prompt, int n, int64_t tokens) {
  LoadResult r;
  std::mutex mu;
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) record(r, mu, stream_request(port, name, prompt(), tokens, true));
  r.wall = secs(t0, Clock::now());
  return r;
}

nlohmann::json summary(const LoadResult& r, const std::string& name, int64_t tokens) {
  nlohmann::json j = r.summary(name);
  int64_t short_ = 0;  // requests that stopped before max_tokens: a server that did not honour ignore_eos
  for (const auto& s : r.samples) short_ += s.tokens != tokens;
  j["short_requests"] = short_;
  return j;
}

Outcome measure(const Run& run, const std::string& name, const std::vector<nlohmann::json>& prompts, const Load& load,
                const std::string& log) {
  Outcome o;
  try {
    size_t next = 0;
    auto prompt = [&]() {
      TS_CHECK(next < prompts.size(), "bench serve peers: ", prompts.size(), " prompts are too few");
      return prompts[next++];
    };
    const int port = free_port();
    Child c = start_server(run.argv(port), port, log, run.health_timeout_s);
    GroupGuard guard{c, run.own_group ? c.pid : -1};
    // Warm-up, not measured: one request, then 16 at once (the batched shapes: vLLM compiles per shape).
    stream_request(port, name, prompt(), 8, true);
    std::vector<nlohmann::json> warm;
    for (int i = 0; i < 16; ++i) warm.push_back(prompt());
    burst(port, name, warm, 8, 16, true);
    o.one = summary(sequential(port, name, prompt, load.one, load.tokens), "peers_1_client", load.tokens);
    LoadResult all;
    for (int k = 0; k < load.bursts; ++k) {
      std::vector<nlohmann::json> ps;
      for (int i = 0; i < 16; ++i) ps.push_back(prompt());
      LoadResult b = burst(port, name, ps, load.tokens, 16, true);
      all.samples.insert(all.samples.end(), b.samples.begin(), b.samples.end());
      all.failed += b.failed;
      all.wall += b.wall;
    }
    o.sixteen = summary(all, "peers_16_clients", load.tokens);
  } catch (const std::exception& e) {
    o.error = e.what();
  }
  return o;
}

// The model the other parts of bench serve measure, in GPT-2's shape (85.6M parameters: d 768, 12
// layers, byte vocabulary, context 1024; --quick: small), GPT-2 initialisation, with GPT-2's own
// GELU (tanh approximation); the byte tokenizer as tokenizer.json beside it.
std::string write_gpt(const fs::path& dir, bool quick, int64_t& seq_len) {
  models::GPTConfig g;
  g.vocab = 256;
  g.seq_len = quick ? 512 : 1024;
  g.d_model = quick ? 256 : 768;
  g.n_layer = quick ? 4 : 12;
  g.n_head = quick ? 4 : 12;
  g.activation = "gelu_tanh";
  seq_len = g.seq_len;
  const std::string model_dir = (dir / "gpt").string();
  torch::manual_seed(1234);
  auto stack = models::make_gpt(g);
  checkpoint::save_consolidated(model_dir, checkpoint::stack_parameters(stack), {{"model", g.to_json()}}, 0);
  std::ofstream((dir / "gpt" / "tokenizer.json").string()) << byte_tokenizer_json().dump();
  return model_dir;
}

// `n` distinct prompts of `len` token ids: consecutive fortunes from a different one each time,
// encoded by `encode` and cut.
std::vector<nlohmann::json> make_prompts(const std::function<std::vector<int64_t>(const std::string&)>& encode, size_t n, int64_t len) {
  const auto f = fortunes();
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < n; ++i) {
    std::vector<int64_t> ids;
    for (size_t k = i * 131; static_cast<int64_t>(ids.size()) < len; ++k) {
      const auto more = encode(f[k % f.size()]);
      ids.insert(ids.end(), more.begin(), more.end());
    }
    ids.resize(static_cast<size_t>(len));
    out.push_back(ids);
  }
  return out;
}

std::string cell(const std::map<std::string, Outcome>& by_server, const std::string& server, bool sixteen, double* value) {
  const auto it = by_server.find(server);
  if (it == by_server.end()) return "-";
  if (!it->second.error.empty()) return "failed";
  const auto& j = sixteen ? it->second.sixteen : it->second.one;
  const double v = j.value("output_tokens_per_s", 0.0);
  if (value) *value = v;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string ratio(double a, double b) {
  if (a <= 0 || b <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", a / b);
  return buf;
}

}  // namespace

void serve_peers(const BenchArgs& args, const std::string& self, const fs::path& dir, const std::vector<std::string>& formats,
                 BenchReport& report) {
  const auto started = Clock::now();
  const fs::path root = TORCHSPEED_SOURCE_DIR;
  std::string skip;
  const Peers peers = find_peers(root, dir, skip);
  if (!skip.empty()) {
    std::printf("bench serve: peers_serve skipped: %s\n", skip.c_str());
    report.add_result({{"case", "peers_serve"}, {"skipped", skip}});
    return;
  }
  const fs::path pd = dir / "peers";
  fs::create_directories(pd);
  const int threads = at::get_num_threads();
  const std::string t = std::to_string(threads);
  const Load load = args.quick ? Load{2, 32, 1} : Load{8, 128, 2};
  const int64_t prompt_len = args.quick ? 32 : 128;
  const size_t n_prompts = 1 + 16 + static_cast<size_t>(load.one) + 16 * static_cast<size_t>(load.bursts);
  const std::string tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";
  const std::string llama_args = concat("-t ", t, " -tb ", t, " -c 16384 -np 16 (continuous batching on, the default)");
  const std::string vllm_env = concat("VLLM_CPU_OMP_THREADS_BIND=0-", threads - 1, " VLLM_CPU_KVCACHE_SPACE=2",
                                      fs::exists(tcmalloc) ? " LD_PRELOAD=libtcmalloc_minimal.so.4" : "");
  std::printf("bench serve: peers on %s, %d threads each: torchspeed serve; llama.cpp llama-server %s [%s]; vLLM %s\n",
              cpu_name().c_str(), threads, llama_args.c_str(),
              peers.llama_server.empty() ? concat("unavailable: ", peers.llama_why).c_str() : peers.llama_build.c_str(),
              peers.vllm.empty() ? concat("unavailable: ", peers.vllm_why).c_str() : concat("vllm-cpu 0.32.0, ", vllm_env).c_str());
  std::printf("bench serve: peers: 1 client = %d requests one after another, 16 clients = %d burst(s) of 16 at once; "
              "%ld-token prompts (token ids, each sent once), %ld tokens out (ignore_eos)\n",
              load.one, load.bursts, static_cast<long>(prompt_len), static_cast<long>(load.tokens));
  std::fflush(stdout);
  report.add_result({{"case", "peers_serve_setup"}, {"cpu", cpu_name()}, {"threads", threads}, {"llama_server_args", llama_args},
                     {"llama_cpp_build", peers.llama_build}, {"llama_cpp_unavailable", peers.llama_why},
                     {"vllm", peers.vllm.empty() ? "" : "vllm-cpu 0.32.0"}, {"vllm_env", vllm_env},
                     {"vllm_unavailable", peers.vllm_why}, {"requests_1_client", load.one}, {"bursts_16", load.bursts},
                     {"prompt_tokens", prompt_len}, {"output_tokens", load.tokens}});

  struct Model {
    std::string label, source, name;
    std::vector<std::string> tokenizer_args;  // for serve and convert
    std::vector<nlohmann::json> prompts;
    int64_t seq_len = 1024;
  };
  std::vector<Model> models;
  {
    Model m;
    m.label = args.quick ? "GPT-2-shaped (small, --quick)" : "GPT-2-shaped 85.6M (d 768, 12 layers, byte vocabulary)";
    m.source = write_gpt(pd, args.quick, m.seq_len);
    m.name = "gpt";
    m.tokenizer_args = {"--tokenizer", (pd / "gpt" / "tokenizer.json").string()};
    m.prompts = make_prompts(
        [](const std::string& s) {
          std::vector<int64_t> ids;
          for (const char ch : s) ids.push_back(static_cast<unsigned char>(ch));  // the byte vocabulary: id = byte
          return ids;
        },
        n_prompts, prompt_len);
    models.push_back(std::move(m));
  }
  if (!args.quick) {  // the real model (--quick: the small GPT alone)
    const std::string gguf = smollm2_gguf(pd);
    if (gguf.empty()) {
      std::printf("bench serve: peers: scripts/smollm2 failed (see %s): no SmolLM2 rows\n", (pd / "smollm2.err").c_str());
    } else {
      Model m;
      m.label = "SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized)";
      m.source = gguf;
      m.name = "smollm2";
      const checkpoint::Model loaded = checkpoint::load_model(gguf);
      const auto tok = data::tokenizer_of_model(gguf, loaded);
      m.prompts = make_prompts([&](const std::string& s) { return tok->encode(s); }, n_prompts, prompt_len);
      models.push_back(std::move(m));
    }
  }

  auto has = [&](const char* f) { return std::find(formats.begin(), formats.end(), f) != formats.end(); };
  for (const Model& m : models) {
    const fs::path md = pd / m.name;
    fs::create_directories(md);
    auto run_logged = [&](const std::vector<std::string>& argv, const std::string& what) {
      const std::string log = (md / (what + ".log")).string();
      if (launcher::run_command(argv, log, log) == 0) return std::string();
      return concat(what, " failed: ", first_line(log), " (", log, ")");
    };
    std::vector<Run> runs;
    const std::vector<std::pair<std::string, std::string>> ours{
        {"fp32", "fp32"}, {"bf16", "bf16"}, {"int8", "int8 (Q8_0)"}, {"q4_0", "4-bit (Q4_0)"}, {"q4_1", "4-bit (Q4_1)"}};
    for (const auto& [fmt, row] : ours) {
      if (!has(fmt.c_str())) continue;
      Run r{"torchspeed", row, fmt, nullptr, 120, false, ""};
      r.argv = [&, fmt = fmt](int port) {
        std::vector<std::string> a{self, "serve", "--checkpoint", m.source, "--port", std::to_string(port), "--weights", fmt,
                                   "--served-model-name", m.name, "--max-num-seqs", "64", "--kv-cache-mb", "1024",
                                   "--max-batched-tokens", "512"};
        a.insert(a.end(), m.tokenizer_args.begin(), m.tokenizer_args.end());
        return a;
      };
      runs.push_back(std::move(r));
    }
    if (!peers.llama_server.empty()) {
      // GGUF from our own converter (Q4_0 / Q4_1: the very numbers our q4_0 / q4_1 serve, the
      // embedding and head in Q8_0); Q4_K_M from its F32 one by llama-quantize (a format we do not serve: its
      // number stands beside our q4_0).
      std::vector<std::tuple<std::string, std::string, std::string>> ggufs;  // row, llama.cpp's name, file
      const std::vector<std::tuple<const char*, const char*, const char*>> from_ours{
          {"fp32", "fp32", "F32"}, {"bf16", "bf16", "BF16"}, {"int8", "q8_0", "Q8_0"}, {"q4_0", "q4_0", "Q4_0"}, {"q4_1", "q4_1", "Q4_1"}};
      std::map<std::string, std::string> errors;
      for (const auto& [fmt, dtype, name] : from_ours) {
        const bool for_4bit = std::string(name) == "F32" && !args.quick;
        if (!has(fmt) && !for_4bit) continue;
        const std::string file = (md / (std::string(name) + ".gguf")).string();
        std::vector<std::string> argv{self, "convert", m.source, "--format", "gguf", "--to", file, "--dtype", dtype};
        argv.insert(argv.end(), m.tokenizer_args.begin(), m.tokenizer_args.end());
        errors[name] = run_logged(argv, concat("convert-gguf-", name));
        const std::string f = fmt;
        if (has(fmt)) ggufs.emplace_back(f == "int8" ? "int8 (Q8_0)" : f == "q4_0" ? "4-bit (Q4_0)" : f == "q4_1" ? "4-bit (Q4_1)" : f, name, file);
      }
      if (!args.quick) {
        for (const char* q : {"Q4_K_M"}) {
          const std::string file = (md / (std::string(q) + ".gguf")).string();
          errors[q] = !errors["F32"].empty() ? errors["F32"]
                                             : run_logged({peers.llama_quantize, (md / "F32.gguf").string(), file, q, t},
                                                          concat("llama-quantize-", q));
          ggufs.emplace_back(concat("4-bit (", q, ")"), q, file);
        }
      }
      for (const auto& [row, name, file] : ggufs) {
        Run r{"llama.cpp", row, name, nullptr, 120, false, ""};
        r.error = errors[name];
        r.argv = [&, file = file](int port) {
          return std::vector<std::string>{peers.llama_server, "-m", file, "--host", "127.0.0.1", "--port", std::to_string(port),
                                          "-t", t, "-tb", t, "-c", "16384", "-np", "16", "-a", m.name};
        };
        runs.push_back(std::move(r));
      }
    }
    if (!peers.vllm.empty() && (has("fp32") || has("bf16"))) {
      const std::string hf = (md / "hf").string();
      std::vector<std::string> argv{self, "convert", m.source, "--format", "hf", "--to", hf};
      argv.insert(argv.end(), m.tokenizer_args.begin(), m.tokenizer_args.end());
      const std::string err = run_logged(argv, "convert-hf");
      for (const auto& [fmt, dtype] : std::vector<std::pair<std::string, std::string>>{{"fp32", "float32"}, {"bf16", "bfloat16"}}) {
        if (!has(fmt.c_str())) continue;
        Run r{"vLLM", fmt, dtype, nullptr, 120, false, ""};
        r.error = err;
        r.health_timeout_s = 300;  // its start compiles the model (torch.compile), a minute or more
        r.own_group = true;
        r.argv = [&, hf, dtype = dtype](int port) {
          std::vector<std::string> a{"/usr/bin/setsid", "/usr/bin/env", "VLLM_TARGET_DEVICE=cpu", "VLLM_CPU_KVCACHE_SPACE=2",
                                     concat("VLLM_CPU_OMP_THREADS_BIND=0-", threads - 1), "HF_HUB_OFFLINE=1",
                                     "VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1"};
          if (fs::exists(tcmalloc)) a.push_back("LD_PRELOAD=" + tcmalloc);
          a.insert(a.end(), {peers.vllm, "serve", hf, "--host", "127.0.0.1", "--port", std::to_string(port), "--dtype", dtype,
                             "--max-model-len", std::to_string(std::min<int64_t>(m.seq_len, 1024)), "--served-model-name",
                             m.name, "--disable-uvicorn-access-log"});
          return a;
        };
        runs.push_back(std::move(r));
      }
    }

    std::printf("bench serve: peers: %s: %zu servers to run\n", m.label.c_str(), runs.size());
    std::fflush(stdout);
    std::map<std::string, std::map<std::string, Outcome>> table;  // row -> server -> outcome
    for (const Run& r : runs) {
      Outcome o;
      if (!r.error.empty()) {
        o.error = r.error;
      } else {
        const std::string log = (md / concat("server-", r.server, "-", r.weights, ".log")).string();
        const auto t0 = Clock::now();
        o = measure(r, m.name, m.prompts, load, log);
        if (!o.error.empty()) o.error += concat(" (server log ", log, ")");
        std::printf("bench serve: peers: %s %-10s %-7s", m.name.c_str(), r.server.c_str(), r.weights.c_str());
        if (o.error.empty()) {
          std::printf(" 1 client %6.1f tok/s (TTFT p50 %.0f ms, TPOT p50 %.1f ms), 16 clients %6.1f tok/s (TTFT p50 %.0f p99 %.0f ms, "
                      "TPOT p50 %.1f ms), %d failed, %.0f s\n",
                      o.one.value("output_tokens_per_s", 0.0), o.one.value("ttft_p50_ms", 0.0), o.one.value("tpot_p50_ms", 0.0),
                      o.sixteen.value("output_tokens_per_s", 0.0), o.sixteen.value("ttft_p50_ms", 0.0),
                      o.sixteen.value("ttft_p99_ms", 0.0), o.sixteen.value("tpot_p50_ms", 0.0),
                      o.one.value("failed", 0) + o.sixteen.value("failed", 0), secs(t0, Clock::now()));
        } else {
          std::printf(" FAILED: %s\n", o.error.c_str());
        }
        std::fflush(stdout);
      }
      for (auto* j : {&o.one, &o.sixteen}) {
        if (j->is_null()) continue;
        (*j)["model"] = m.name;
        (*j)["server"] = r.server;
        (*j)["weights"] = r.weights;
        (*j)["row"] = r.row;
        (*j)["clients"] = j == &o.one ? 1 : 16;
        report.add_result(*j);
      }
      if (!o.error.empty()) {
        report.add_result({{"case", "peers_serve_error"}, {"model", m.name}, {"server", r.server}, {"weights", r.weights}, {"error", o.error}});
      }
      table[r.row][r.server] = std::move(o);
    }

    // The table: output tokens/s per row and server, and torchspeed's ratios.
    std::printf("\n%s, %ld-token prompts, %ld tokens out, %s, %d threads\n", m.label.c_str(), static_cast<long>(prompt_len),
                static_cast<long>(load.tokens), cpu_name().c_str(), threads);
    std::printf("| output tokens/s        | torchspeed | llama.cpp |   vLLM | torchspeed/llama.cpp | torchspeed/best peer |\n");
    std::printf("|------------------------|-----------:|----------:|-------:|---------------------:|---------------------:|\n");
    for (const char* row : {"fp32", "bf16", "int8 (Q8_0)", "4-bit (Q4_0)", "4-bit (Q4_1)", "4-bit (Q4_K_M)"}) {
      if (!table.count(row)) continue;
      for (const bool sixteen : {false, true}) {
        double ts = 0, lc = 0, vl = 0;
        const std::string a = cell(table[row], "torchspeed", sixteen, &ts), b = cell(table[row], "llama.cpp", sixteen, &lc),
                          c = cell(table[row], "vLLM", sixteen, &vl);
        const std::string label = concat(row, sixteen ? ", 16 clients" : ", 1 client");
        std::printf("| %-22s | %10s | %9s | %6s | %20s | %20s |\n", label.c_str(), a.c_str(), b.c_str(), c.c_str(),
                    ratio(ts, lc).c_str(), ratio(ts, std::max(lc, vl)).c_str());
        // The targets: 1 client >= 1.2x llama.cpp on the same weights; 16 clients >= 1.2x
        // the better peer, with p99 TTFT no worse than that peer's.
        if (ts > 0 && !sixteen && lc > 0) {
          report.add_target(concat(m.name, " ", row, ", 1 client: torchspeed / llama.cpp output tok/s"), ts / lc, 1.2);
        }
        if (ts > 0 && sixteen && std::max(lc, vl) > 0) {
          const std::string best = lc >= vl ? "llama.cpp" : "vLLM";
          report.add_target(concat(m.name, " ", row, ", 16 clients: torchspeed / ", best, " output tok/s"), ts / std::max(lc, vl), 1.2);
          const double ours_p99 = table[row]["torchspeed"].sixteen.value("ttft_p99_ms", 0.0);
          const double theirs_p99 = table[row][best].sixteen.value("ttft_p99_ms", 0.0);
          if (ours_p99 > 0 && theirs_p99 > 0) {
            report.add_target(concat(m.name, " ", row, ", 16 clients: torchspeed / ", best, " p99 TTFT"), ours_p99 / theirs_p99, 1.0, false);
          }
        }
        report.add_result({{"case", "peers_serve_ratio"}, {"model", m.name}, {"row", row}, {"clients", sixteen ? 16 : 1},
                           {"torchspeed_tok_s", ts}, {"llama_cpp_tok_s", lc}, {"vllm_tok_s", vl},
                           {"torchspeed_over_llama_cpp", lc > 0 && ts > 0 ? ts / lc : 0.0},
                           {"torchspeed_over_best_peer", std::max(lc, vl) > 0 && ts > 0 ? ts / std::max(lc, vl) : 0.0}});
      }
    }
    std::printf("\n| server     | weights | clients | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | failed | short |\n");
    std::printf("|------------|---------|--------:|-------------:|------------:|------------:|------------:|-------:|------:|\n");
    for (const Run& r : runs) {
      const Outcome& o = table[r.row][r.server];
      if (!o.error.empty()) {
        std::printf("| %-10s | %-7s | failed: %s\n", r.server.c_str(), r.weights.c_str(), o.error.c_str());
        continue;
      }
      for (const auto* j : {&o.one, &o.sixteen}) {
        std::printf("| %-10s | %-7s | %7d | %12.1f | %11.0f | %11.0f | %11.1f | %6d | %5ld |\n", r.server.c_str(), r.weights.c_str(),
                    j == &o.one ? 1 : 16, j->value("output_tokens_per_s", 0.0), j->value("ttft_p50_ms", 0.0),
                    j->value("ttft_p99_ms", 0.0), j->value("tpot_p50_ms", 0.0), j->value("failed", 0),
                    static_cast<long>(j->value("short_requests", int64_t{0})));
      }
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  std::printf("bench serve: peers part took %.0f s\n", secs(started, Clock::now()));
  std::fflush(stdout);
}

}  // namespace torchspeed::bench
