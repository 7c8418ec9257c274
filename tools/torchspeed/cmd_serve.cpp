// `torchspeed serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [-n N --tp N] ...`: an
// OpenAI-compatible server for a trained GPT. With --tp N the weights are split over N ranks
// (launched here under mpirun): rank 0 runs HTTP and the scheduler, every rank runs the
// forward. SIGTERM or Ctrl-C drains: running requests finish (for --drain-timeout seconds, then
// they are aborted), new ones get 503, exit 0; a second signal exits at once.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "commands.h"
#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/checkpoint/gguf.h"
#include "torchspeed/checkpoint/peft.h"
#include "torchspeed/comm/communicator.h"
#include "torchspeed/inference/serving_engine.h"
#include "torchspeed/base/error.h"
#include "torchspeed/launch/launcher.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/comm/runtime.h"
#include "torchspeed/serve/server.h"

namespace torchspeed::cli {
namespace {

struct ServeOpts {
  std::string speculative_config;
  std::string checkpoint, tokenizer, host = "127.0.0.1", api_key, model_name, weights = "auto", kv_dtype = "auto", stop_file;
  bool bf16_dot = true, prefix_caching = true;
  int port = 8000, ranks = 1, tp = 1, http_threads = 4, max_connections = 1024;
  double drain_timeout = 30;
  int64_t max_request_tokens = 0;
  double kv_mb = 0;
  int64_t block_size = 16, max_num_seqs = 16, max_batched_tokens = 256, max_queue = 64, max_tokens = 0, max_n = 16;
  std::string tool_parser, pooling = "last";
  bool auto_tool_choice = false, enable_lora = false;
  std::vector<std::string> lora_modules;  // NAME=DIR
  int64_t max_body = 1 << 20;
};

// SIGTERM / SIGINT, or the stop file the launching CLI writes when it gets one: the first
// drains, a second signal ends the process at once (exit status 130, as a shell reports Ctrl-C).
std::atomic<bool> g_stop{false};
void watch_signals(const std::string& stop_file) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set, stop_file] {
    while (true) {
      timespec ts{0, 200 * 1000 * 1000};
      if (sigtimedwait(&set, nullptr, &ts) > 0) {
        if (g_stop.exchange(true)) {
          static const char msg[] = "torchspeed serve: second stop signal: exiting now\n";
          [[maybe_unused]] ssize_t n = ::write(2, msg, sizeof(msg) - 1);
          std::_Exit(130);
        }
      }
      if (!g_stop && !stop_file.empty() && std::filesystem::exists(stop_file)) g_stop = true;
    }
  }).detach();
}

// --weights auto: a GGUF file whose layers' matrices are all Q8_0 (llama.cpp's 8-bit format) is
// served as our int8 (its values requantized with one scale per output channel, as --weights
// int8 quantizes any model); all Q4_0 or all Q4_1 as our q4_0 / q4_1 (ggml's quantization again:
// the same numbers, since a Q4_0 group's largest value is -8 d and a Q4_1 group spans q 0 to 15);
// anything else in fp32 (other 4-bit formats too).
std::string auto_weights(const std::string& path) {
  if (!std::filesystem::is_regular_file(path) || !checkpoint::gguf::is_gguf(path)) return "fp32";
  checkpoint::gguf::File f(path);
  uint32_t type = 0;
  bool any = false;
  for (const auto& t : f.header().tensors) {
    if (t.shape.size() != 2 || t.name.rfind("blk.", 0) != 0) continue;
    if (any && t.type != type) return "fp32";
    type = t.type;
    any = true;
  }
  if (any && type == static_cast<uint32_t>(checkpoint::gguf::Type::kQ8_0)) return "int8";
  if (any && type == static_cast<uint32_t>(checkpoint::gguf::Type::kQ4_0)) return "q4_0";
  if (any && type == static_cast<uint32_t>(checkpoint::gguf::Type::kQ4_1)) return "q4_1";
  return "fp32";
}

// --lora-modules NAME=DIR ...: (name, folder) pairs, names distinct and not the base model's.
serve::LoraModules parse_lora_modules(const std::vector<std::string>& specs, const std::string& base) {
  serve::LoraModules out;
  for (const std::string& s : specs) {
    const size_t eq = s.find('=');
    TS_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < s.size(), "serve: --lora-modules \"", s,
             "\": expected NAME=DIR (the adapter's model id, and PEFT's folder with adapter_config.json)");
    const std::string name = s.substr(0, eq), dir = s.substr(eq + 1);
    TS_CHECK(name != base, "serve: --lora-modules: the adapter name \"", name, "\" is the base model's (--served-model-name)");
    for (const auto& m : out) TS_CHECK(m.first != name, "serve: --lora-modules names \"", name, "\" twice");
    out.emplace_back(name, dir);
  }
  return out;
}

// Every rank loads the same adapters in the same order (their ids are their positions).
void load_adapters(inference::InferenceModel& model, const serve::LoraModules& mods) {
  for (const auto& [name, dir] : mods) {
    try {
      model.add_adapter(checkpoint::peft::load(dir, model.config()));
    } catch (const Error& e) {
      TS_CHECK(false, "serve: LoRA adapter \"", name, "\": ", e.what());
    }
  }
}

std::string default_name(const std::string& path) {
  std::filesystem::path p(path);
  if (p.filename().empty()) p = p.parent_path();
  std::string n = p.stem().string();
  return n.empty() ? "torchspeed-gpt" : n;
}

}  // namespace

Runner add_serve(CLI::App& app, const Invocation& inv) {
  auto* cmd = app.add_subcommand("serve", "Serve a trained GPT over an OpenAI-compatible HTTP API");
  auto o = std::make_shared<ServeOpts>();
  cmd->add_option("--checkpoint", o->checkpoint, "What `generate` loads: a run folder, training checkpoint, model folder or .safetensors")->required();
  cmd->add_option("--tokenizer", o->tokenizer,
                  "\"bytes\", or a BPE tokenizer's tokenizer.json or folder (default: the one beside the model, else the training config's data.tokenizer, else bytes)");
  cmd->add_option("--host", o->host, "Address to bind (default 127.0.0.1: this machine only)");
  cmd->add_option("--port", o->port, "TCP port (0: any free port, printed)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o->api_key, "Require \"Authorization: Bearer KEY\" on /v1/* (default: TORCHSPEED_API_KEY, else none)");
  cmd->add_option("--served-model-name", o->model_name, "The model id clients send (default: the checkpoint's folder name)");
  cmd->add_option("--weights", o->weights, "Weight format: fp32, bf16, int8 (weight-only, per-channel scales) q4_0 / q4_1 (4-bit groups of 32, ggml's Q4_0 / Q4_1; LM head in int8); auto: int8 for a GGUF file whose layers are Q8_0, q4_0 / q4_1 for Q4_0 / Q4_1, else fp32")->check(CLI::IsMember({"auto", "fp32", "bf16", "int8", "q4_0", "q4_1"}));
  cmd->add_flag("!--no-bf16-dot", o->bf16_dot,
                "With bf16 or int8 weights, widen them to fp32 instead of multiplying with the CPU's bf16 dot products (AVX512-BF16) or AMX tiles (each linear's input rounded to bf16, or with int8 weights on AMX to 16-bit fixed point)");
  cmd->add_option("--kv-cache-mb", o->kv_mb, "Memory for the paged KV cache, per rank (0: 256 MB, or two sequences of the model's whole context where that is more)")->check(CLI::Range(0.0, 1e7));
  cmd->add_option("--kv-cache-dtype", o->kv_dtype,
                  "KV cache dtype: auto (fp32 with fp32 weights, else bf16), fp32, bf16 or int8 (one scale per token and KV head, as llama.cpp's q8_0 cache)")
      ->check(CLI::IsMember({"auto", "fp32", "bf16", "int8"}));
  cmd->add_option("--block-size", o->block_size, "Tokens per KV block")->check(CLI::Range(1, 4096));
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o->prefix_caching,
                "Share the KV blocks of a common prompt start between requests (on by default, as vLLM's v1 engine)");
  cmd->add_option("--speculative-config", o->speculative_config,
                  "Speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (n-gram prompt lookup; greedy requests)");
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "Sequences batched in one forward pass")->check(CLI::Range(1, 4096));
  cmd->add_option("--max-batched-tokens", o->max_batched_tokens, "Token budget of one forward pass (decodes + prompt chunks)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-queue", o->max_queue, "Waiting sequences before requests get 429 (at least 1)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-tokens", o->max_tokens, "Largest max_tokens a request may ask (0: the context)")->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--max-n", o->max_n, "Most choices (prompts x n) in one request")->check(CLI::Range(1, 1024));
  cmd->add_option("--tool-call-parser", o->tool_parser,
                  "How tool calls are read from the model's text for tool_choice \"auto\": hermes (<tool_call> blocks: Qwen, "
                  "Hermes) or llama3_json (Llama 3.1's JSON); without it \"auto\" is refused")
      ->check(CLI::IsMember({"hermes", "llama3_json"}));
  cmd->add_flag("--enable-auto-tool-choice", o->auto_tool_choice, "vLLM's flag, accepted: needs --tool-call-parser");
  cmd->add_option("--lora-modules,--lora", o->lora_modules,
                  "LoRA adapters served beside the base model, NAME=DIR each (PEFT's folder: adapter_config.json and "
                  "adapter_model.safetensors); a request's \"model\" picks one, and requests of different adapters are batched together");
  cmd->add_flag("--enable-lora", o->enable_lora, "vLLM's flag, accepted: the adapters --lora-modules names are served");
  cmd->add_option("--pooling", o->pooling, "How /v1/embeddings pools the final hidden states (then L2-normalized): last token or mean")
      ->check(CLI::IsMember({"last", "mean"}));
  cmd->add_option("--max-body-bytes", o->max_body, "Largest request body (413 beyond)")->check(CLI::Range(1024, 1 << 30));
  cmd->add_option("--http-threads", o->http_threads, "Threads that parse and tokenize requests (connections and generations hold none)")->check(CLI::Range(1, 256));
  cmd->add_option("--max-connections", o->max_connections, "Client connections open at once (503 past it)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-request-tokens", o->max_request_tokens, "Largest prompts x n x (prompt + max_tokens) of one request (0: the KV cache's tokens)")->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  cmd->add_option("--drain-timeout", o->drain_timeout, "Seconds a stop signal lets running requests finish before aborting them (a second signal exits at once)")->check(CLI::Range(0.0, 1e6));
  CLI::Option* ranks =
      cmd->add_option("-n,--num-ranks", o->ranks, "Ranks to launch when not under mpirun (equal to --tp; default: --tp)")
          ->check(CLI::Range(1, 1024));
  cmd->add_option("--tp", o->tp, "Tensor-parallel ranks the weights are split over (a Mixture-of-Experts model's experts too)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--stop-file", o->stop_file, "Drain and exit when this file appears")->group("");
  return [o, &inv, ranks]() -> int {
    // --tp alone launches its ranks, as vLLM's --tensor-parallel-size does.
    if (ranks->count() == 0 && !launcher::under_launcher()) o->ranks = o->tp;
    TS_CHECK(o->ranks == o->tp || (launcher::under_launcher() && o->ranks == 1),
             "serve: -n ", o->ranks, " and --tp ", o->tp, " differ; every rank serves one tensor-parallel slice, give both the same value");
    TS_CHECK(!o->auto_tool_choice || !o->tool_parser.empty(),
             "serve: --enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json): the format the model writes its calls in");
    if (o->api_key.empty()) {
      if (const char* k = std::getenv("TORCHSPEED_API_KEY")) o->api_key = k;
    }
    if (o->model_name.empty()) o->model_name = default_name(o->checkpoint);
    const serve::LoraModules lora = parse_lora_modules(o->lora_modules, o->model_name);
    if (o->weights == "auto") o->weights = auto_weights(o->checkpoint);
    const inference::WeightFormat fmt = inference::parse_weight_format(o->weights);
    inference::EngineOptions eo = inference::EngineOptions()
                                      .max_num_seqs(o->max_num_seqs)
                                      .max_num_batched_tokens(o->max_batched_tokens)
                                      .max_queue(o->max_queue)
                                      .prefix_caching(o->prefix_caching)
                                      .speculative(o->speculative_config.empty()
                                                       ? inference::SpeculativeOptions()
                                                       : inference::SpeculativeOptions::from_json(o->speculative_config))
                                      .kv(inference::KVCacheOptions().block_size(o->block_size).budget_mb(o->kv_mb).dtype(
                                          o->kv_dtype == "auto"   ? inference::default_kv_dtype(fmt)
                                          : o->kv_dtype == "bf16" ? at::kBFloat16
                                          : o->kv_dtype == "int8" ? at::kChar
                                                                  : at::kFloat));
    if (!launcher::under_launcher() && o->ranks > 1) {
      const std::string stop = (std::filesystem::temp_directory_path() / ("torchspeed-serve-" + std::to_string(::getpid()) + ".stop")).string();
      std::filesystem::remove(stop);
      // Note [Relaunching a command]: the user's arguments go to the ranks as given; the relaunch
      // adds the stop file it drains them with, and the API key travels in the environment, not
      // on a command line others can read.
      launcher::Relaunch r;
      r.num_ranks = o->ranks, r.self_path = inv.self_path, r.args = inv.args;
      r.drop = {"--api-key", "--stop-file"};
      r.append = {"--stop-file", stop};
      if (!o->api_key.empty()) r.extra_env.push_back("TORCHSPEED_API_KEY=" + o->api_key);
      r.how = launcher::Relaunch::How::kShielded;
      r.on_interrupt = [stop] { std::ofstream(stop) << "stop\n"; };
      const int rc = launcher::relaunch_under_mpirun(r);
      std::filesystem::remove(stop);
      return rc;
    }
    ::signal(SIGPIPE, SIG_IGN);
    watch_signals(o->stop_file);  // before any thread exists
    const Runtime& rt = init();
    TS_CHECK(rt.world_size == o->tp, "serve: ", rt.world_size, " ranks were launched for --tp ", o->tp);
    comm::CommunicatorPtr tp = rt.world_size > 1 ? comm::Communicator::world() : nullptr;
    if (!rt.is_rank0()) {
      auto model = std::make_shared<inference::InferenceModel>(checkpoint::load_model(o->checkpoint), fmt, tp, o->bf16_dot);
      load_adapters(*model, lora);
      inference::ServingEngine::follow(*model, eo, tp);
      return 0;
    }
    serve::Server server(serve::ServerOptions()
                             .host(o->host)
                             .port(o->port)
                             .api_key(o->api_key)
                             .model_name(o->model_name)
                             .max_body_bytes(o->max_body)
                             .max_tokens(o->max_tokens)
                             .max_n(o->max_n)
                             .tool_parser(o->tool_parser)
                             .lora_modules(lora)
                             .pooling(o->pooling)
                             .http_threads(o->http_threads)
                             .max_connections(o->max_connections)
                             .max_request_tokens(o->max_request_tokens));
    server.start();
    std::printf("torchspeed serve: listening on http://%s:%d (loading %s)\n", o->host.c_str(), server.port(), o->checkpoint.c_str());
    std::fflush(stdout);
    const auto t0 = std::chrono::steady_clock::now();
    const checkpoint::Model loaded = checkpoint::load_model(o->checkpoint);
    eo.tokenizer(data::tokenizer_of_model(o->checkpoint, loaded, o->tokenizer));
    const data::ChatFormatPtr chat = data::chat_format_of_model(o->checkpoint, loaded, *eo.tokenizer());
    auto model = std::make_shared<inference::InferenceModel>(loaded, fmt, tp, o->bf16_dot);
    load_adapters(*model, lora);
    inference::ServingEngine engine(model, eo, tp);
    server.set_chat_format(chat);
    server.set_engine(&engine);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("torchspeed serve: ready in %.1f s: model \"%s\" (%.1fM parameters, %s weights%s, tp %d, tokenizer %s, chat template %s), context %lld, KV cache %.0f MB %s (%lld blocks of %lld tokens)\n",
                load_s, o->model_name.c_str(), static_cast<double>(model->num_params()) / 1e6, o->weights.c_str(), model->amx() ? " on AMX tiles" : model->bf16_dot() ? " with bf16 dot products" : "", o->tp, eo.tokenizer()->source().c_str(),
                chat->tmpl ? chat->source.c_str() : "torchspeed's (the model has none)",
                static_cast<long long>(engine.context_length()), static_cast<double>(engine.kv_cache_bytes()) / 1048576.0, eo.kv().dtype() == at::kBFloat16 ? "bf16" : eo.kv().dtype() == at::kChar ? "int8" : "fp32",
                static_cast<long long>(engine.stats().blocks_total), static_cast<long long>(o->block_size));
    std::fflush(stdout);
    // The engine runs on this thread (the one that loaded the model: see ServingEngine::run); a
    // helper thread waits for the stop request and drains.
    std::thread stopper([&] {
      while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::printf("torchspeed serve: stopping: finishing %lld running and %lld waiting requests\n",
                  static_cast<long long>(engine.stats().running), static_cast<long long>(engine.stats().waiting));
      std::fflush(stdout);
      server.shutdown(o->drain_timeout);
    });
    engine.run();
    g_stop = true;  // the loop also ends on a fatal error: stop serving then too
    stopper.join();
    if (engine.failed()) {
      // A supervisor (systemd, Kubernetes) restarts a server that exits non-zero.
      std::fprintf(stderr, "torchspeed serve: the inference engine failed: %s\n", engine.failure().c_str());
      return 1;
    }
    std::printf("torchspeed serve: stopped\n");
    return 0;
  };
}

}  // namespace torchspeed::cli
