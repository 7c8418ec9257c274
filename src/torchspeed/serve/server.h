// The HTTP front end over inference::Engine: OpenAI's routes (/v1/completions,
// /v1/chat/completions, /v1/models), /health (503 while the model loads) and /metrics
// (Prometheus text), server-sent-event streaming, an optional API key, limits on body size,
// queue and max_tokens, and a draining shutdown. Built on cpp-httplib (Debian's
// libcpp-httplib-dev): a maintained, dependency-light HTTP/1.1 server with a thread pool and
// chunked responses, which is all an OpenAI-style API needs. Nothing here touches tensors.
#pragma once

#include <torch/arg.h>

#include <atomic>
#include <memory>
#include <string>

#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/inference/engine.h"

namespace torchspeed::serve {

struct ServerOptions {
  TORCH_ARG(std::string, host) = "127.0.0.1";
  TORCH_ARG(int, port) = 8000;
  TORCH_ARG(std::string, api_key) = "";          // empty: no key asked
  TORCH_ARG(std::string, model_name) = "torchspeed-gpt";
  TORCH_ARG(int64_t, max_body_bytes) = 1 << 20;
  TORCH_ARG(int64_t, max_tokens) = 0;            // per choice; 0: up to the context
  TORCH_ARG(int64_t, max_n) = 16;                // choices per request
  TORCH_ARG(int, http_threads) = 64;             // connections served at once
};

class Server {
 public:
  explicit Server(const ServerOptions& options);
  ~Server();
  // Binds and serves on a thread of its own; /health answers 503 until set_engine.
  void start();
  int port() const;  // the bound port (options.port 0 picks a free one)
  void set_engine(inference::Engine* engine);
  // The model's chat format (its template and end-of-turn tokens); set before set_engine.
  void set_chat_format(data::ChatFormatPtr chat);
  // Stops taking requests (503), lets the engine finish what it has, waits for responses to
  // be written, then stops listening. The engine's stop(true) is called here.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchspeed::serve
