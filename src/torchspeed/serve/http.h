// An HTTP/1.1 server with a hard limit on everything a client controls, for the OpenAI front
// end (serve/server.h). One thread runs an epoll loop over non-blocking sockets; a request that
// needs work (parse a prompt, tokenize) goes to a small pool of workers, and its answer may come
// later from any thread (the engine's sinks) through a Responder. No thread is held by a
// connection or by a generation, so /health answers while every slot generates and a thousand
// clients trickle bytes. See Note [Why our own HTTP server].
//
// Limits (Limits below): the request line and the header block (bytes and count), the body
// however it is sent (Content-Length or chunked; compressed bodies are refused: there is no
// decompressed size to trust), a deadline from a request's first byte to its last, an idle
// keep-alive timeout, a write timeout and a cap on bytes queued for a client that does not
// read, and the number of open connections (503 past it). A client that goes away is noticed
// by the loop at once (EPOLLRDHUP), and the request's Responder tells its owner (on_gone).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torchspeed::serve::http {

struct Limits {
  size_t max_request_line = 8 << 10;     // 414 past it
  size_t max_header_bytes = 32 << 10;    // request line + headers (+ chunked trailers): 431
  size_t max_headers = 100;              // 431
  size_t max_body_bytes = 1 << 20;       // however sent: 413
  double request_timeout_s = 30;         // first byte to last byte of one request: 408
  double idle_timeout_s = 5;             // a keep-alive connection waiting for its next request
  double write_timeout_s = 30;           // queued output that makes no progress: closed
  size_t max_output_bytes = 16 << 20;    // queued for a client that does not read: closed
  int max_connections = 1024;            // open at once; past it 503 and close
  int workers = 4;                       // threads that run worker routes
  size_t max_pending = 256;              // requests waiting for a worker: 503 past it
};

struct Request {
  std::string method, target, path, query, version;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, in order
  std::string body;
  // The value of the first header so named (lower-case), or null.
  const std::string* header(std::string_view name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra ones
};

struct Exchange;  // one request's answer in flight (http.cpp)

// The way to answer one request, from any thread, once: respond(), or begin_stream() then
// write()s and end(). Copies share the exchange. Every call after the client went away is a
// no-op that returns false.
class Responder {
 public:
  Responder() = default;
  explicit Responder(std::shared_ptr<Exchange> ex) : ex_(std::move(ex)) {}
  bool respond(Response r) const;
  bool begin_stream(int status, const std::string& content_type, std::vector<std::pair<std::string, std::string>> headers = {}) const;
  bool write(std::string data) const;
  bool end() const;
  // The client closed the connection, it timed out, or it stopped reading, before the answer
  // was complete.
  bool gone() const;
  // Called once (on the server's loop thread, or here when already gone) when the client goes
  // away before the answer is complete; never after it is complete.
  void on_gone(std::function<void()> fn) const;

 private:
  std::shared_ptr<Exchange> ex_;
};

using Handler = std::function<void(Request&, const Responder&)>;

struct ServerStats {
  int64_t connections_open = 0, requests = 0, refused_connections = 0, timeouts = 0, limit_errors = 0,
          clients_gone = 0, exchanges_open = 0;
};

class Server {
 public:
  explicit Server(const Limits& limits);
  ~Server();  // stop()
  // kInline runs on the loop thread: for answers that take microseconds (/health, /metrics).
  // kWorker runs on a worker; past max_pending waiting it answers 503 without running it.
  enum class Mode { kInline, kWorker };
  void route(const std::string& method, const std::string& path, Handler handler, Mode mode);
  // Binds host:port (port 0: a free one) and returns the port. Throws with the reason.
  int bind(const std::string& host, int port);
  void start();
  // Runs fn on a worker thread (a response built away from the engine's thread).
  void post(std::function<void()> fn);
  // Closes the listening socket and idle keep-alive connections; requests in flight go on.
  void stop_accepting();
  int64_t exchanges_open() const;  // requests not yet completely answered
  // Closes every connection (gone() for what was in flight) and joins the threads.
  void stop();
  ServerStats stats() const;

 private:
  friend struct Exchange;
  struct Core;
  std::shared_ptr<Core> core_;
};

// Parses one request from `in` (the incremental parser the loop uses, for tests and fuzzing):
// returns 0 while more bytes are needed, the HTTP status of an error (400, 413, 414, 415, 431,
// 501, 505), or 1 with `out` complete and `used` the bytes it took.
int parse_request(std::string_view in, const Limits& limits, Request& out, size_t& used);
// The same bytes arriving in pieces, fed as the loop feeds them (fuzz_http checks both agree).
int parse_request_in_pieces(const std::vector<std::string_view>& pieces, const Limits& limits, Request& out, size_t& used);

}  // namespace torchspeed::serve::http
