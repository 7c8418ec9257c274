#include "torchspeed/serve/server.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <random>
#include <sstream>
#include <thread>

#include "torchspeed/inference/text_stream.h"
#include "torchspeed/base/error.h"
#include "torchspeed/base/logging.h"
#include "torchspeed/serve/chat_page.h"
#include "torchspeed/serve/http.h"
#include "torchspeed/serve/openai_protocol.h"

namespace torchspeed::serve {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::string prometheus(const inference::EngineStats& s, const std::string& model, double tokens_per_s, uint64_t rejected,
                       const http::ServerStats& h) {
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
  counter("torchspeed_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache when sequences were admitted.", static_cast<double>(s.prefix_cache_queries));
  counter("torchspeed_prefix_cache_hits_total", "Of those, tokens found cached (not computed again).", static_cast<double>(s.prefix_cache_hits));
  gauge("torchspeed_prefix_cache_blocks", "KV blocks published in the prefix cache (shared or kept for reuse).", static_cast<double>(s.prefix_cache_blocks));
  counter("torchspeed_spec_decode_draft_tokens_total", "Draft tokens proposed and verified (speculative decoding).", static_cast<double>(s.spec_draft_tokens));
  counter("torchspeed_spec_decode_accepted_tokens_total", "Of those, tokens the model chose too (accepted).", static_cast<double>(s.spec_accepted_tokens));
  gauge("torchspeed_spec_decode_acceptance_rate", "Accepted over proposed draft tokens since the start (0 before any).",
        s.spec_draft_tokens ? static_cast<double>(s.spec_accepted_tokens) / static_cast<double>(s.spec_draft_tokens) : 0.0);
  counter("torchspeed_engine_steps_total", "Forward passes run.", static_cast<double>(s.steps));
  counter("torchspeed_engine_busy_seconds_total", "Seconds spent in forward passes and sampling.", s.busy_seconds);
  counter("torchspeed_tp_collectives_total", "Collectives rank 0 ran on the tensor-parallel group (plans included).", static_cast<double>(s.tp_collectives));
  counter("torchspeed_tp_bytes_total", "Payload bytes of those collectives.", static_cast<double>(s.tp_bytes));
  gauge("torchspeed_http_connections_open", "Client connections open.", static_cast<double>(h.connections_open));
  gauge("torchspeed_http_requests_in_flight", "Requests not yet completely answered.", static_cast<double>(h.exchanges_open));
  counter("torchspeed_http_requests_total", "HTTP requests parsed.", static_cast<double>(h.requests));
  counter("torchspeed_http_refused_connections_total", "Connections refused past --max-connections (503).", static_cast<double>(h.refused_connections));
  counter("torchspeed_http_timeouts_total", "Requests that did not arrive in time (408) and clients that stopped reading.", static_cast<double>(h.timeouts));
  counter("torchspeed_http_limit_errors_total", "Requests refused by an HTTP limit (400, 413, 414, 415, 431, ...).", static_cast<double>(h.limit_errors));
  counter("torchspeed_http_clients_gone_total", "Clients that went away before their answer was complete.", static_cast<double>(h.clients_gone));
  hist("torchspeed_time_to_first_token_seconds", "Time from arrival to the first generated token.", s.ttft);
  hist("torchspeed_inter_token_latency_seconds", "Time between consecutive tokens of a sequence.", s.itl);
  return o.str();
}

http::Response json_response(int status, const json& j) {
  http::Response r;
  r.status = status;
  r.body = j.dump(-1, ' ', false, json::error_handler_t::replace);
  return r;
}

void send_error(const http::Responder& res, const ApiError& e) {
  http::Response r = json_response(e.status, e.to_json());
  if (e.status == 429 || e.status == 503) r.headers.emplace_back("Retry-After", "1");
  res.respond(std::move(r));
}

std::string sse(const json& j) { return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n"; }

// One request's sequences, as the engine's sinks fill them in and the workers send them.
struct Job {
  std::mutex mu;
  std::vector<ChoiceResult> choices;
  std::deque<std::pair<int64_t, inference::RequestEvent>> events;  // streaming, not yet sent
  std::vector<uint64_t> ids;
  int64_t finished = 0, total = 0;
  bool stream = false, flush_queued = false, ended = false, started = false;
  http::Responder res;
  std::shared_ptr<const CompletionRequest> req;
  ProtocolLimits limits;
  std::string id;
  int64_t created = 0;
  std::vector<bool> first;
  std::vector<int64_t> text_offset;  // per choice: bytes of text sent (logprobs' text_offset)
  std::vector<std::string> tool_text;  // per choice, with tools: the text so far (Note [Tool calls])
  std::vector<size_t> tool_sent;       // ... and how much of it went out as content
  int64_t prompt_tokens = 0, completion_tokens = 0;
};
}  // namespace

struct Server::Impl {
  ServerOptions o;
  std::unique_ptr<http::Server> http;
  std::atomic<inference::ServingEngine*> engine{nullptr};
  data::ChatFormatPtr chat;  // set before the engine is published
  int64_t max_token_bytes = 0;  // of the engine's tokenizer, found once in set_engine
  std::atomic<bool> draining{false};
  std::atomic<uint64_t> next_id{1}, rejected{0};
  int bound_port = 0;
  bool shut = false;
  int64_t created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::mutex rate_mu;
  Clock::time_point last_scrape = Clock::now();
  uint64_t last_tokens = 0;

  ProtocolLimits limits(inference::ServingEngine& e) const {
    ProtocolLimits l;
    l.model_name = o.model_name();
    for (const auto& m : o.lora_modules()) l.adapters.push_back(m.first);
    l.context_length = e.context_length();
    l.vocab = e.model().config().vocab;
    l.tokenizer = e.tokenizer();
    l.max_token_bytes = max_token_bytes;
    l.chat = chat;
    l.max_tokens = o.max_tokens();
    l.tool_parser = o.tool_parser();
    l.hidden_size = e.model().config().d_model;
    // A request's choices enter the queue together: more than it holds could never be served.
    l.max_n = std::max<int64_t>(1, std::min(o.max_n(), e.options().max_queue()));
    const inference::EngineStats s = e.stats();
    l.max_request_tokens = o.max_request_tokens() > 0 ? o.max_request_tokens() : s.blocks_total * s.block_size;
    return l;
  }

  bool authorized(const http::Request& req, const http::Responder& res) {
    if (o.api_key().empty()) return true;
    const std::string* h = req.header("authorization");
    if (h && *h == "Bearer " + o.api_key()) return true;
    send_error(res, ApiError(401, "invalid or missing API key: send the header \"Authorization: Bearer KEY\"", "",
                             "invalid_request_error", "invalid_api_key"));
    return false;
  }

  // 503 with the reason when the engine cannot take work: loading, draining, or failed.
  std::optional<ApiError> unavailable(inference::ServingEngine* e) const {
    if (!e) return ApiError(503, "the model is still loading", "", "server_error", "model_loading");
    if (e->failed()) return ApiError(503, "the inference engine failed and is stopping: " + e->failure(), "", "server_error", "engine_failed");
    if (draining || !e->accepting()) return ApiError(503, "the server is shutting down", "", "server_error", "shutting_down");
    return std::nullopt;
  }

  // Sends what the sinks queued for a streamed request, on a worker. One flush runs per
  // request at a time (flush_queued stays set until it finds nothing more), so events go out
  // in order.
  void flush_stream(const std::shared_ptr<Job>& job) {
    const CompletionRequest& r = *job->req;
    while (true) {
      std::deque<std::pair<int64_t, inference::RequestEvent>> evs;
      bool all_done;
      {
        std::lock_guard<std::mutex> g(job->mu);
        // started: the 200 and its headers are out.
        if (job->ended || !job->started || job->events.empty()) {
          job->flush_queued = false;
          return;
        }
        evs.swap(job->events);
        all_done = job->finished == job->total;
        if (all_done) job->ended = true;
      }
      std::string out;
      bool aborted = false;
      try {
        for (auto& [i, ev] : evs) {
          if (ev.finished && ev.finish_reason == "abort") aborted = true;
          if (ev.finished) job->completion_tokens += ev.completion_tokens;
          if (r.tools.active()) {
            out += tool_stream(*job, i, ev);
            continue;
          }
          const bool is_first = job->first[static_cast<size_t>(i)];
          if (ev.text.empty() && !ev.finished && !is_first && (r.logprobs < 0 || ev.tokens.empty())) continue;
          out += sse(stream_chunk(job->id, job->created, job->limits, r, i, ev.text, ev.tokens, ev.finished ? ev.finish_reason : "", is_first,
                                  &job->text_offset[static_cast<size_t>(i)]));
          job->first[static_cast<size_t>(i)] = false;
        }
      } catch (const std::exception& err) {
        // An event we cannot put into words ends the stream with an error event, not the server.
        out += sse(ApiError(500, std::string("internal error while streaming: ") + err.what(), "", "server_error").to_json());
        cancel(*job);
        all_done = true;
        std::lock_guard<std::mutex> g(job->mu);
        job->ended = true;
      }
      if (aborted) out += sse(ApiError(503, "the request was aborted: the server is stopping", "", "server_error").to_json());
      if (all_done) {
        if (r.include_usage) out += sse(usage_chunk(job->id, job->created, job->limits, r, job->prompt_tokens, job->completion_tokens));
        out += "data: [DONE]\n\n";
      }
      if (!out.empty()) job->res.write(std::move(out));
      if (all_done) {
        job->res.end();
        return;
      }
    }
  }

  // A streamed choice of a request with tools (Note [Tool calls]): content goes out while it
  // surely is content; when the text ends, its calls go out whole as one tool_calls delta (the
  // id, name and all the arguments), then the finish.
  static std::string tool_stream(Job& job, int64_t i, const inference::RequestEvent& ev) {
    const CompletionRequest& r = *job.req;
    const auto k = static_cast<size_t>(i);
    std::string& text = job.tool_text[k];
    text += ev.text;
    std::string out;
    auto content = [&](const std::string& piece, const std::string& reason) {
      out += sse(stream_chunk(job.id, job.created, job.limits, r, i, piece, {}, reason, job.first[k]));
      job.first[k] = false;
    };
    auto chunk = [&](json delta, const json& reason) {
      return sse({{"id", job.id}, {"object", "chat.completion.chunk"}, {"created", job.created}, {"model", r.model.empty() ? job.limits.model_name : r.model},
                  {"choices", json::array({{{"index", i}, {"delta", std::move(delta)}, {"logprobs", nullptr}, {"finish_reason", reason}}})}});
    };
    if (r.tools.choice == ToolChoice::kNamed) {
      // A named function: the whole text is its arguments, streamed as OpenAI streams them (the
      // call's id and name first, then the arguments piece by piece).
      const std::string call_id = "call_" + job.id + "_" + std::to_string(i) + "_0";
      if (job.first[k]) {
        out += chunk({{"role", "assistant"}, {"content", nullptr},
                      {"tool_calls", json::array({{{"index", 0}, {"id", call_id}, {"type", "function"},
                                                   {"function", {{"name", r.tools.named}, {"arguments", ""}}}}})}},
                     nullptr);
        job.first[k] = false;
      }
      const size_t end = ev.finished ? text.size() : inference::complete_utf8_prefix(text, text.size());
      if (end > job.tool_sent[k]) {
        out += chunk({{"tool_calls", json::array({{{"index", 0}, {"function", {{"arguments", inference::sanitize_utf8(text.substr(job.tool_sent[k], end - job.tool_sent[k]))}}}}})}},
                     nullptr);
        job.tool_sent[k] = end;
      }
      if (ev.finished) out += chunk(json::object(), ev.finish_reason);
      return out;
    }
    if (!ev.finished) {
      const size_t safe = tool_content_prefix(r.tools, text);
      if (safe > job.tool_sent[k]) {
        // Whole UTF-8 characters only: the rest waits for the next event.
        const size_t end = inference::complete_utf8_prefix(text, safe);
        if (end > job.tool_sent[k]) content(text.substr(job.tool_sent[k], end - job.tool_sent[k]), "");
        job.tool_sent[k] = std::max(job.tool_sent[k], end);
      }
      return out;
    }
    const ToolOutput t = parse_tool_output(r.tools, text);
    std::string reason = ev.finish_reason;
    if (t.calls.empty()) {
      content(text.substr(std::min(job.tool_sent[k], text.size())), reason);
      return out;
    }
    if (t.content.size() > job.tool_sent[k]) content(t.content.substr(job.tool_sent[k]), "");
    json delta = {{"tool_calls", tool_calls_json(t.calls, "call_" + job.id + "_" + std::to_string(i) + "_", true)}};
    if (job.first[k]) delta["role"] = "assistant", delta["content"] = nullptr;
    job.first[k] = false;
    out += chunk(std::move(delta), nullptr);
    if (reason == "stop") reason = "tool_calls";
    out += chunk(json::object(), reason);
    return out;
  }

  void answer(const std::shared_ptr<Job>& job) {
    for (const auto& c : job->choices) {
      if (c.finish_reason == "abort") {
        inference::ServingEngine* e = engine.load();
        const std::string why = e && e->failed() ? "the inference engine failed: " + e->failure() : "the server is stopping";
        return send_error(job->res, ApiError(503, "the request was aborted: " + why, "", "server_error"));
      }
    }
    try {
      const CompletionRequest& r = *job->req;
      if (r.best_of <= r.n) {
        job->res.respond(json_response(200, completion_response(job->id, job->created, job->limits, r, job->choices)));
        return;
      }
      // best_of: per prompt, the n candidates with the highest mean log-probability per token,
      // best first; usage counts every candidate's tokens.
      std::vector<ChoiceResult> chosen;
      int64_t generated = 0;
      for (size_t p = 0; p < r.prompts.size(); ++p) {
        std::vector<std::pair<double, size_t>> scored;
        for (int64_t k = 0; k < r.best_of; ++k) {
          const size_t i = p * static_cast<size_t>(r.best_of) + static_cast<size_t>(k);
          const ChoiceResult& c = job->choices[i];
          generated += c.completion_tokens;
          double sum = 0;
          for (const auto& t : c.tokens) sum += t.logprobs.logprob;
          scored.emplace_back(c.tokens.empty() ? -INFINITY : sum / static_cast<double>(c.tokens.size()), i);
        }
        std::stable_sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        for (int64_t k = 0; k < r.n; ++k) chosen.push_back(std::move(job->choices[scored[static_cast<size_t>(k)].second]));
      }
      json out = completion_response(job->id, job->created, job->limits, r, chosen);
      json& usage = out["usage"];
      usage["completion_tokens"] = generated;
      usage["total_tokens"] = usage["prompt_tokens"].get<int64_t>() + generated;
      job->res.respond(json_response(200, out));
    } catch (const std::exception& err) {
      send_error(job->res, ApiError(500, std::string("internal error: ") + err.what(), "", "server_error"));
    }
  }

  void cancel(Job& job) {
    inference::ServingEngine* e = engine.load();
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> g(job.mu);
      ids = job.ids;
    }
    if (e) {
      for (uint64_t x : ids) e->cancel(x);
    }
  }

  void generate(http::Request& req, const http::Responder& res, bool chat_route) {
    if (!authorized(req, res)) return;
    inference::ServingEngine* e = engine.load();
    if (auto err = unavailable(e)) return send_error(res, *err);
    try {
      const ProtocolLimits l = limits(*e);
      const json body = parse_body(req.body);
      auto r = std::make_shared<const CompletionRequest>(chat_route ? parse_chat(body, l, &req.body)
                                                                    : parse_completion(body, l, &req.body));
      req.body.clear();
      req.body.shrink_to_fit();
      auto job = std::make_shared<Job>();
      job->stream = r->stream;
      job->total = static_cast<int64_t>(r->prompts.size()) * r->best_of;
      job->choices.resize(static_cast<size_t>(job->total));
      job->first.assign(static_cast<size_t>(job->total), true);
      job->text_offset.assign(static_cast<size_t>(job->total), 0);
      job->tool_text.assign(static_cast<size_t>(job->total), "");
      job->tool_sent.assign(static_cast<size_t>(job->total), 0);
      job->res = res;
      job->req = r;
      job->limits = l;
      job->created = created;
      job->id = (chat_route ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);
      for (const auto& pr : r->prompts) job->prompt_tokens += static_cast<int64_t>(pr.size());
      std::vector<inference::ServingEngine::Submission> group;
      for (int64_t i = 0; i < job->total; ++i) {
        inference::SamplingParams p = r->params;
        if (p.seed) p.seed = *p.seed + static_cast<uint64_t>(i % r->best_of);
        if (r->best_of > r->n) p.logprobs = std::max<int64_t>(p.logprobs, 0);  // the chosen tokens' logprobs rank them
        // On the engine's thread: record, and leave the JSON to a worker.
        auto sink = [this, job, i](const inference::RequestEvent& ev) {
          bool post = false;
          {
            std::lock_guard<std::mutex> g(job->mu);
            if (ev.finished) ++job->finished;
            if (job->stream) {
              job->events.emplace_back(i, ev);
              post = !job->flush_queued;
              job->flush_queued = true;
            } else {
              ChoiceResult& c = job->choices[static_cast<size_t>(i)];
              c.text += ev.text;
              c.tokens.insert(c.tokens.end(), ev.tokens.begin(), ev.tokens.end());
              c.prompt_lps.insert(c.prompt_lps.end(), ev.prompt.begin(), ev.prompt.end());
              if (ev.finished) {
                c.finish_reason = ev.finish_reason;
                c.completion_tokens = ev.completion_tokens;
              }
              post = job->finished == job->total;
            }
          }
          if (!post) return;
          if (job->stream) http->post([this, job] { flush_stream(job); });
          else http->post([this, job] { answer(job); });
        };
        group.push_back({r->prompts[static_cast<size_t>(i / r->best_of)], p, sink, r->adapter});
      }
      if (res.gone()) return;  // the client left while we parsed
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
        if (auto err = unavailable(e)) throw *err;
        ++rejected;
        throw ApiError(429, "the server's queue is full; retry later", "", "rate_limit_error", "queue_full");
      }
      bool post = false;
      if (r->stream) res.begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
      {
        std::lock_guard<std::mutex> g(job->mu);
        job->ids = *ids;
        job->started = true;
        post = r->stream && !job->flush_queued && !job->events.empty();
        if (post) job->flush_queued = true;
      }
      if (post) http->post([this, job] { flush_stream(job); });
      // A client that goes away (streamed or not) frees its sequences on the engine's next step.
      std::weak_ptr<Job> weak = job;
      res.on_gone([this, weak] {
        if (auto j = weak.lock()) cancel(*j);
      });
    } catch (const ApiError& err) {
      error_reply(res, err);
    } catch (const std::exception& err) {
      error_reply(res, ApiError(500, std::string("internal error: ") + err.what(), "", "server_error"));
    }
  }

  // An error answer (a JSON body with its status); where a stream has begun, an error event
  // and the end of the stream.
  static void error_reply(const http::Responder& res, const ApiError& err) {
    http::Response r = json_response(err.status, err.to_json());
    if (err.status == 429 || err.status == 503) r.headers.emplace_back("Retry-After", "1");
    if (res.respond(std::move(r))) return;
    res.write(sse(err.to_json()) + "data: [DONE]\n\n");
    res.end();
  }

  void routes() {
    using Mode = http::Server::Mode;
    // The chat page (no key needed to load it; its requests carry the key it is given).
    for (const char* path : {"/", "/index.html"}) {
      http->route("GET", path, [](http::Request&, const http::Responder& res) {
        http::Response r;
        r.content_type = "text/html; charset=utf-8";
        r.body = chat_page_html();
        r.headers.emplace_back("Cache-Control", "no-cache");
        res.respond(std::move(r));
      }, Mode::kInline);
    }
    http->route("GET", "/health", [this](http::Request&, const http::Responder& res) {
      inference::ServingEngine* e = engine.load();
      if (!e) return res.respond(json_response(503, {{"status", "loading"}})), void();
      if (e->failed()) return res.respond(json_response(503, {{"status", "failed"}})), void();
      if (draining) return res.respond(json_response(503, {{"status", "draining"}})), void();
      res.respond(json_response(200, {{"status", "ok"}}));
    }, Mode::kInline);
    http->route("GET", "/metrics", [this](http::Request&, const http::Responder& res) {
      inference::ServingEngine* e = engine.load();
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
      http::Response r;
      r.content_type = "text/plain; version=0.0.4";
      r.body = prometheus(s, o.model_name(), rate, rejected.load(), http->stats());
      res.respond(std::move(r));
    }, Mode::kInline);
    http->route("GET", "/v1/models", [this](http::Request& req, const http::Responder& res) {
      if (!authorized(req, res)) return;
      inference::ServingEngine* e = engine.load();
      if (!e) return send_error(res, ApiError(503, "the model is still loading", "", "server_error", "model_loading"));
      // The base model, then each LoRA adapter with its folder as root and the base as parent (as
      // vLLM lists them).
      json data = json::array({{{"id", o.model_name()}, {"object", "model"}, {"created", created},
                                {"owned_by", "torchspeed"}, {"root", o.model_name()}, {"parent", nullptr},
                                {"max_model_len", e->context_length()}}});
      for (const auto& [name, path] : o.lora_modules()) {
        data.push_back({{"id", name}, {"object", "model"}, {"created", created}, {"owned_by", "torchspeed"}, {"root", path},
                        {"parent", o.model_name()}, {"max_model_len", e->context_length()}});
      }
      res.respond(json_response(200, {{"object", "list"}, {"data", std::move(data)}}));
    }, Mode::kInline);
    // Embeddings: the engine's thread runs the forward between two steps (ServingEngine::embed).
    http->route("POST", "/v1/embeddings", [this](http::Request& req, const http::Responder& res) {
      if (!authorized(req, res)) return;
      inference::ServingEngine* e = engine.load();
      if (auto err = unavailable(e)) return send_error(res, *err);
      try {
        const ProtocolLimits l = limits(*e);
        const EmbeddingRequest r = parse_embeddings(parse_body(req.body), l);
        std::vector<std::vector<float>> vectors;
        try {
          vectors = e->embed(r.inputs, o.pooling() == "mean" ? inference::ServingEngine::Pooling::kMean : inference::ServingEngine::Pooling::kLast,
                             /*normalize=*/true);
        } catch (const inference::EngineBusy& err) {
          throw ApiError(503, err.what(), "", "server_error", "kv_cache_full");
        } catch (const Error& err) {
          if (auto down = unavailable(e)) throw *down;
          throw ApiError(400, err.what(), "input");
        }
        if (res.gone()) return;
        res.respond(json_response(200, embeddings_response(l, r, vectors)));
      } catch (const ApiError& err) {
        error_reply(res, err);
      } catch (const std::exception& err) {
        error_reply(res, ApiError(500, std::string("internal error: ") + err.what(), "", "server_error"));
      }
    }, Mode::kWorker);
    // vLLM's tokenizer routes (benchmark clients align their prompts with them).
    for (const char* path : {"/tokenize", "/detokenize"}) {
      const bool tok = std::string(path) == "/tokenize";
      http->route("POST", path, [this, tok](http::Request& req, const http::Responder& res) {
        if (!authorized(req, res)) return;
        inference::ServingEngine* e = engine.load();
        if (!e) return send_error(res, ApiError(503, "the model is still loading", "", "server_error", "model_loading"));
        try {
          const ProtocolLimits l = limits(*e);
          const json body = parse_body(req.body);
          res.respond(json_response(200, tok ? tokenize(body, l) : detokenize(body, l)));
        } catch (const ApiError& err) {
          error_reply(res, err);
        } catch (const std::exception& err) {
          error_reply(res, ApiError(500, std::string("internal error: ") + err.what(), "", "server_error"));
        }
      }, Mode::kWorker);
    }
    http->route("POST", "/v1/completions", [this](http::Request& req, const http::Responder& res) { generate(req, res, false); }, Mode::kWorker);
    http->route("POST", "/v1/chat/completions", [this](http::Request& req, const http::Responder& res) { generate(req, res, true); }, Mode::kWorker);
  }
};

Server::Server(const ServerOptions& options) : impl_(std::make_unique<Impl>()) {
  impl_->o = options;
  http::Limits l;
  l.max_body_bytes = static_cast<size_t>(options.max_body_bytes());
  l.max_connections = options.max_connections();
  l.workers = options.http_threads();
  impl_->http = std::make_unique<http::Server>(l);
  impl_->routes();
}

Server::~Server() {
  impl_->http->stop();
  impl_->engine = nullptr;
}

void Server::start() {
  Impl& s = *impl_;
  try {
    s.bound_port = s.http->bind(s.o.host(), s.o.port());
  } catch (const std::exception& e) {
    TS_CHECK(false, e.what(), " (in use, or not an address of this machine)");
  }
  s.http->start();
}

int Server::port() const { return impl_->bound_port; }

void Server::set_engine(inference::ServingEngine* engine) {
  if (engine && engine->tokenizer()) {
    int64_t longest = 1;
    const auto& t = *engine->tokenizer();
    for (int64_t id = 0; id < t.vocab_size(); ++id) {
      try {
        longest = std::max<int64_t>(longest, static_cast<int64_t>(t.token_bytes(id).size()));
      } catch (const std::exception&) {
        // an id that is a gap in the vocabulary has no bytes
      }
    }
    impl_->max_token_bytes = longest;
  }
  impl_->engine = engine;
}

void Server::set_chat_format(data::ChatFormatPtr chat) { impl_->chat = std::move(chat); }

void Server::shutdown() { shutdown(1e9); }

void Server::shutdown(double drain_timeout_s) {
  Impl& s = *impl_;
  if (s.shut) return;
  s.shut = true;
  s.draining = true;
  s.http->stop_accepting();
  if (inference::ServingEngine* e = s.engine.load()) e->stop(/*drain=*/true, drain_timeout_s);
  // The workers write the last events and answers; a client that does not read them gets
  // a few seconds.
  for (int i = 0; i < 100 && s.http->exchanges_open() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  s.http->stop();
  s.engine = nullptr;
}

}  // namespace torchspeed::serve
