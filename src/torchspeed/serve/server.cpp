#include "torchspeed/serve/server.h"

#include <httplib.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <deque>
#include <random>
#include <sstream>
#include <thread>

#include "torchspeed/runtime/error.h"
#include "torchspeed/runtime/logging.h"
#include "torchspeed/serve/openai_protocol.h"

namespace torchspeed::serve {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {
// What the engine's sinks hand to the HTTP thread that answers the request.
struct Job {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<ChoiceResult> choices;
  std::deque<std::pair<int64_t, inference::RequestEvent>> events;  // streaming
  std::vector<uint64_t> ids;
  int64_t finished = 0;
  bool stream = false;
};

std::string prometheus(const inference::EngineStats& s, const std::string& model, double tokens_per_s, uint64_t rejected) {
  std::ostringstream o;
  auto gauge = [&](const char* name, const char* help, double v) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n" << name << "{model=\"" << model << "\"} " << v << "\n";
  };
  auto counter = [&](const char* name, const char* help, double v) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " counter\n" << name << "{model=\"" << model << "\"} " << v << "\n";
  };
  auto hist = [&](const char* name, const char* help, const inference::Histogram& h) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
    uint64_t cum = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cum += h.counts[i];
      o << name << "_bucket{model=\"" << model << "\",le=\"" << h.bounds[i] << "\"} " << cum << "\n";
    }
    o << name << "_bucket{model=\"" << model << "\",le=\"+Inf\"} " << h.count << "\n";
    o << name << "_sum{model=\"" << model << "\"} " << h.sum << "\n" << name << "_count{model=\"" << model << "\"} " << h.count << "\n";
  };
  gauge("torchspeed_requests_running", "Sequences being generated.", static_cast<double>(s.running));
  gauge("torchspeed_requests_waiting", "Sequences queued for admission (preempted ones included).", static_cast<double>(s.waiting));
  gauge("torchspeed_kv_blocks_used", "KV cache blocks held by sequences.", static_cast<double>(s.blocks_used));
  gauge("torchspeed_kv_blocks_free", "KV cache blocks free.", static_cast<double>(s.blocks_free));
  gauge("torchspeed_kv_blocks_total", "KV cache blocks in the pool.", static_cast<double>(s.blocks_total));
  gauge("torchspeed_kv_block_size_tokens", "Token slots per KV block.", static_cast<double>(s.block_size));
  gauge("torchspeed_generation_tokens_per_second", "Generated tokens per second since the previous scrape.", tokens_per_s);
  counter("torchspeed_requests_total", "Sequences finished (any reason).", static_cast<double>(s.requests_finished));
  counter("torchspeed_requests_rejected_total", "Requests answered 429 (queue full).", static_cast<double>(rejected));
  counter("torchspeed_prompt_tokens_total", "Prompt tokens prefilled.", static_cast<double>(s.prompt_tokens));
  counter("torchspeed_generated_tokens_total", "Tokens generated.", static_cast<double>(s.generated_tokens));
  counter("torchspeed_preemptions_total", "Sequences preempted for lack of KV blocks.", static_cast<double>(s.preemptions));
  counter("torchspeed_engine_steps_total", "Forward passes run.", static_cast<double>(s.steps));
  counter("torchspeed_engine_busy_seconds_total", "Seconds spent in forward passes and sampling.", s.busy_seconds);
  counter("torchspeed_tp_collectives_total", "Collectives rank 0 ran on the tensor-parallel group (plans included).", static_cast<double>(s.tp_collectives));
  counter("torchspeed_tp_bytes_total", "Payload bytes of those collectives.", static_cast<double>(s.tp_bytes));
  hist("torchspeed_time_to_first_token_seconds", "Time from arrival to the first generated token.", s.ttft);
  hist("torchspeed_inter_token_latency_seconds", "Time between consecutive tokens of a sequence.", s.itl);
  return o.str();
}

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status, e.to_json());
}

// HTTP threads run at a lower priority than the engine: on a machine whose cores all run the
// forward pass, a woken HTTP thread would otherwise stall a parallel region's barrier (the
// engine's OpenMP workers wait for the descheduled one). They need little CPU.
void lower_thread_priority() {
  thread_local bool done = false;
  if (done) return;
  done = true;
  setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
}

std::string sse(const json& j) { return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n"; }
}  // namespace

struct Server::Impl {
  ServerOptions o;
  httplib::Server http;
  std::thread thread;
  std::atomic<inference::Engine*> engine{nullptr};
  data::ChatFormatPtr chat;  // set before the engine is published
  std::atomic<bool> draining{false};
  std::atomic<int> inflight{0};
  std::atomic<uint64_t> next_id{1}, rejected{0};
  int bound_port = 0;
  int64_t created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::mutex rate_mu;
  Clock::time_point last_scrape = Clock::now();
  uint64_t last_tokens = 0;

  ProtocolLimits limits(inference::Engine& e) const {
    ProtocolLimits l;
    l.model_name = o.model_name();
    l.context_length = e.context_length();
    l.vocab = e.model().config().vocab;
    l.tokenizer = e.tokenizer();
    l.chat = chat;
    l.max_tokens = o.max_tokens();
    // A request's choices enter the queue together: more than it holds could never be served.
    l.max_n = std::max<int64_t>(1, std::min(o.max_n(), e.options().max_queue()));
    return l;
  }

  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (o.api_key().empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + o.api_key()) return true;
    send_error(res, ApiError(401, "invalid or missing API key: send the header \"Authorization: Bearer KEY\"", "",
                             "invalid_request_error", "invalid_api_key"));
    return false;
  }

  inference::Engine* ready(httplib::Response& res) {
    inference::Engine* e = engine.load();
    if (!e) {
      send_error(res, ApiError(503, "the model is still loading", "", "server_error", "model_loading"));
      return nullptr;
    }
    if (draining) {
      send_error(res, ApiError(503, "the server is shutting down", "", "server_error", "shutting_down"));
      return nullptr;
    }
    return e;
  }

  void generate(const httplib::Request& req, httplib::Response& res, bool chat) {
    lower_thread_priority();
    if (!authorized(req, res)) return;
    inference::Engine* e = ready(res);
    if (!e) return;
    try {
      const ProtocolLimits l = limits(*e);
      const json body = parse_body(req.body);
      auto r = std::make_shared<CompletionRequest>(chat ? parse_chat(body, l) : parse_completion(body, l));
      auto job = std::make_shared<Job>();
      job->stream = r->stream;
      const int64_t total = static_cast<int64_t>(r->prompts.size()) * r->n;
      job->choices.resize(static_cast<size_t>(total));
      std::vector<inference::Engine::Submission> group;
      for (int64_t i = 0; i < total; ++i) {
        inference::SamplingParams p = r->params;
        if (p.seed) p.seed = *p.seed + static_cast<uint64_t>(i % r->n);
        auto sink = [job, i](const inference::RequestEvent& ev) {
          std::lock_guard<std::mutex> g(job->mu);
          if (job->stream) {
            job->events.emplace_back(i, ev);
          } else {
            ChoiceResult& c = job->choices[static_cast<size_t>(i)];
            c.text += ev.text;
            c.tokens.insert(c.tokens.end(), ev.tokens.begin(), ev.tokens.end());
            c.prompt_lps.insert(c.prompt_lps.end(), ev.prompt.begin(), ev.prompt.end());
          }
          if (ev.finished) {
            ChoiceResult& c = job->choices[static_cast<size_t>(i)];
            c.finish_reason = ev.finish_reason;
            c.completion_tokens = ev.completion_tokens;
            ++job->finished;
          }
          job->cv.notify_all();
        };
        group.push_back({r->prompts[static_cast<size_t>(i / r->n)], p, sink});
      }
      // A request's choices are queued together or not at all. (One by one, whether the last
      // of n choices found room depended on how many the engine had admitted meanwhile: the
      // same request could be served or refused on an idle server.)
      std::optional<std::vector<uint64_t>> ids;
      try {
        ids = e->submit_all(std::move(group));
      } catch (const Error& err) {
        throw ApiError(400, err.what(), "prompt");
      }
      if (!ids) {
        ++rejected;
        res.set_header("Retry-After", "1");
        send_error(res, ApiError(429, "the server's queue is full; retry later", "", "rate_limit_error", "queue_full"));
        return;
      }
      {
        std::lock_guard<std::mutex> g(job->mu);
        job->ids = *ids;
      }
      const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);
      if (!r->stream) {
        std::unique_lock<std::mutex> lk(job->mu);
        job->cv.wait(lk, [&] { return job->finished == total; });
        for (const auto& c : job->choices) {
          if (c.finish_reason == "abort") {
            send_error(res, ApiError(503, "the request was aborted: the server is stopping", "", "server_error"));
            return;
          }
        }
        send_json(res, 200, completion_response(id, created, l, *r, job->choices));
        return;
      }
      ++inflight;
      auto first = std::make_shared<std::vector<bool>>(static_cast<size_t>(total), true);
      auto usage = std::make_shared<std::pair<int64_t, int64_t>>(0, 0);
      for (const auto& pr : r->prompts) usage->first += static_cast<int64_t>(pr.size());
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [this, job, r, l, id, total, first, usage, e](size_t, httplib::DataSink& sink) {
            std::deque<std::pair<int64_t, inference::RequestEvent>> evs;
            bool all_done;
            {
              std::unique_lock<std::mutex> lk(job->mu);
              job->cv.wait_for(lk, std::chrono::seconds(1), [&] { return !job->events.empty(); });
              evs.swap(job->events);
              all_done = job->finished == total;
            }
            std::string out;
            bool aborted = false;
            for (auto& [i, ev] : evs) {
              if (ev.finished && ev.finish_reason == "abort") aborted = true;
              if (ev.finished) usage->second += ev.completion_tokens;
              const bool is_first = (*first)[static_cast<size_t>(i)];
              if (ev.text.empty() && !ev.finished && !is_first && (r->logprobs < 0 || ev.tokens.empty())) continue;
              out += sse(stream_chunk(id, created, l, *r, i, ev.text, ev.tokens, ev.finished ? ev.finish_reason : "", is_first));
              (*first)[static_cast<size_t>(i)] = false;
            }
            if (aborted) {
              out += sse(ApiError(503, "the request was aborted: the server is stopping", "", "server_error").to_json());
            }
            if (all_done) {
              if (r->include_usage) out += sse(usage_chunk(id, created, l, *r, usage->first, usage->second));
              out += "data: [DONE]\n\n";
            }
            // A comment line every second keeps the connection honest: writing is how a client
            // that went away is noticed.
            if (out.empty()) out = ": keep-alive\n\n";
            if (!sink.write(out.data(), out.size())) {
              for (uint64_t x : job->ids) e->cancel(x);
              return false;
            }
            if (all_done) sink.done();
            return true;
          },
          [this, job, e](bool success) {
            if (!success) {
              for (uint64_t x : job->ids) e->cancel(x);
            }
            --inflight;
          });
    } catch (const ApiError& err) {
      send_error(res, err);
    } catch (const std::exception& err) {
      send_error(res, ApiError(500, std::string("internal error: ") + err.what(), "", "server_error"));
    }
  }

  void routes() {
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      if (!engine.load()) return send_json(res, 503, {{"status", "loading"}});
      if (draining) return send_json(res, 503, {{"status", "draining"}});
      send_json(res, 200, {{"status", "ok"}});
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      inference::Engine* e = engine.load();
      if (!e) return send_error(res, ApiError(503, "the model is still loading", "", "server_error", "model_loading"));
      const inference::EngineStats s = e->stats();
      double rate = 0;
      {
        std::lock_guard<std::mutex> g(rate_mu);
        const auto now = Clock::now();
        const double dt = std::chrono::duration<double>(now - last_scrape).count();
        if (dt > 0) rate = static_cast<double>(s.generated_tokens - last_tokens) / dt;
        last_scrape = now;
        last_tokens = s.generated_tokens;
      }
      res.set_content(prometheus(s, o.model_name(), rate, rejected.load()), "text/plain; version=0.0.4");
    });
    http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      inference::Engine* e = engine.load();
      if (!e) return send_error(res, ApiError(503, "the model is still loading", "", "server_error", "model_loading"));
      send_json(res, 200,
                {{"object", "list"},
                 {"data", json::array({{{"id", o.model_name()}, {"object", "model"}, {"created", created},
                                        {"owned_by", "torchspeed"}, {"max_model_len", e->context_length()}}})}});
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, false); });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, true); });
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string msg = res.status == 404 ? "no route " + req.method + " " + req.path
                        : res.status == 413 ? std::string("the request body is too large")
                                            : "HTTP " + std::to_string(res.status);
      send_json(res, res.status, ApiError(res.status, msg).to_json());
    });
  }
};

Server::Server(const ServerOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->o = options;
  const int threads = options.http_threads();
  impl_->http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  impl_->http.set_payload_max_length(static_cast<size_t>(options.max_body_bytes()));
  impl_->http.set_keep_alive_timeout(5);
  impl_->routes();
}

Server::~Server() {
  if (impl_->thread.joinable()) {
    impl_->http.stop();
    impl_->thread.join();
  }
}

void Server::start() {
  Impl& s = *impl_;
  if (s.o.port() == 0) {
    s.bound_port = s.http.bind_to_any_port(s.o.host());
    TS_CHECK(s.bound_port > 0, "cannot bind an HTTP port on ", s.o.host());
  } else {
    TS_CHECK(s.http.bind_to_port(s.o.host(), s.o.port()), "cannot listen on ", s.o.host(), ":", s.o.port(),
             " (in use, or not an address of this machine)");
    s.bound_port = s.o.port();
  }
  s.thread = std::thread([&s] { s.http.listen_after_bind(); });
}

int Server::port() const { return impl_->bound_port; }

void Server::set_engine(inference::Engine* engine) { impl_->engine = engine; }

void Server::set_chat_format(data::ChatFormatPtr chat) { impl_->chat = std::move(chat); }

void Server::shutdown() {
  Impl& s = *impl_;
  s.draining = true;
  if (inference::Engine* e = s.engine.load()) e->stop(/*drain=*/true);
  // Streams write their last events once the engine has finished them.
  for (int i = 0; i < 300 && s.inflight.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  s.http.stop();
  if (s.thread.joinable()) s.thread.join();
}

}  // namespace torchspeed::serve
