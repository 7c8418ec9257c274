// The HTTP front end over inference::ServingEngine: OpenAI's routes (/v1/completions,
// /v1/chat/completions, /v1/models), /health (503 while the model loads) and /metrics
// (Prometheus text), server-sent-event streaming, an optional API key, limits on everything a
// client controls (serve/http.h), on queue, max_tokens and a request's tokens, and a draining
// shutdown with a deadline. A client that goes away, streamed or not, frees its sequences on
// the engine's next step. Nothing here touches tensors.
#pragma once

#include <torch/arg.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/inference/serving_engine.h"

namespace torchspeed::serve {

using LoraModules = std::vector<std::pair<std::string, std::string>>;  // (name, folder)

struct ServerOptions {
  TORCH_ARG(std::string, host) = "127.0.0.1";
  TORCH_ARG(int, port) = 8000;
  TORCH_ARG(std::string, api_key) = "";          // empty: no key asked
  TORCH_ARG(std::string, model_name) = "torchspeed-gpt";
  TORCH_ARG(int64_t, max_body_bytes) = 1 << 20;
  TORCH_ARG(int64_t, max_tokens) = 0;            // per choice; 0: up to the context
  TORCH_ARG(int64_t, max_n) = 16;                // choices per request
  TORCH_ARG(int64_t, max_request_tokens) = 0;    // prompts x n x (prompt + max_tokens); 0: the KV cache
  TORCH_ARG(int, http_threads) = 4;              // workers that parse and tokenize requests
  TORCH_ARG(int, max_connections) = 1024;        // open at once; 503 past it
  TORCH_ARG(std::string, pooling) = "last";      // /v1/embeddings: last or mean (then L2-normalized)
  TORCH_ARG(std::string, tool_parser) = "";      // hermes or llama3_json: tool_choice "auto" (empty: refused)
  // LoRA adapters the engine's model holds, (name, folder) in add_adapter's order: a request's
  // `model` picks one; /v1/models lists them.
  TORCH_ARG(LoraModules, lora_modules) = {};
};

class Server {
 public:
  explicit Server(const ServerOptions& options);
  ~Server();
  // Binds and serves on a thread of its own; /health answers 503 until set_engine.
  void start();
  int port() const;  // the bound port (options.port 0 picks a free one)
  void set_engine(inference::ServingEngine* engine);
  // The model's chat format (its template and end-of-turn tokens); set before set_engine.
  void set_chat_format(data::ChatFormatPtr chat);
  // Stops taking requests (503), lets the engine finish what it has for up to
  // `drain_timeout_s` (then aborts the rest: their clients get 503), gives the answers a few
  // seconds to be written, then closes every connection. The engine's stop is called here.
  void shutdown(double drain_timeout_s);
  void shutdown();  // no deadline

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchspeed::serve
