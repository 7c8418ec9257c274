#include "torchspeed/serve/http.h"

#include "torchspeed/serve/http_parser.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <stdexcept>
#include <thread>
#include <unordered_map>

// Note [Why our own HTTP server]
// cpp-httplib (Debian's 0.11.4, which we used first) runs one thread per connection and applies
// its body limit only to Content-Length bodies: a chunked body, a request line without a
// newline or a gzip body grew memory without bound before any check, a client sending a byte
// every few seconds held a thread forever, and a generation held a thread until its last token,
// so 64 slow clients took /health down. Its newer releases bound more, but keep the thread per
// connection, which is the root of the last two. libmicrohttpd bounds memory per connection but
// has no per-request read deadline and does not watch a suspended connection's socket (a
// non-streamed request whose client went away would generate on). What an OpenAI front end
// needs of HTTP is small (HTTP/1.1 with keep-alive, Content-Length and chunked bodies in,
// fixed and chunked bodies out), so we own it: one epoll loop, every limit explicit, the
// parser fuzzed (fuzz/fuzz_http.cpp).

namespace torchspeed::serve::http {

using detail::kCompactAfter;
using detail::lower;
using detail::reason;
using detail::Parser;
using detail::trim;

namespace {
using Clock = std::chrono::steady_clock;

// A comma-separated header value contains `token` (case-insensitive).
bool has_token(const std::string* v, std::string_view token) {
  if (!v) return false;
  const std::string l = lower(*v);
  size_t i = 0;
  while (i <= l.size()) {
    size_t j = l.find(',', i);
    if (j == std::string::npos) j = l.size();
    if (trim(std::string_view(l).substr(i, j - i)) == token) return true;
    i = j + 1;
  }
  return false;
}

std::string error_body(int status, const std::string& message) {
  // OpenAI's error shape; `message` is ours, never the client's bytes.
  std::string type = status >= 500 ? "server_error" : "invalid_request_error";
  return "{\"error\": {\"message\": \"" + message + "\", \"type\": \"" + type + "\", \"param\": null, \"code\": null}}";
}

std::string head(int status, const std::string& content_type, const std::vector<std::pair<std::string, std::string>>& headers,
                 const std::string& framing, bool keep_alive) {
  std::string h = "HTTP/1.1 " + std::to_string(status) + " " + reason(status) + "\r\nServer: torchspeed\r\n";
  if (!content_type.empty()) h += "Content-Type: " + content_type + "\r\n";
  for (const auto& [k, v] : headers) {
    // Values come from our code; a stray newline would split the response.
    if (k.find_first_of("\r\n") != std::string::npos || v.find_first_of("\r\n") != std::string::npos) continue;
    h += k + ": " + v + "\r\n";
  }
  h += framing;
  h += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  return h;
}

std::string whole(int status, const std::string& content_type, const std::string& body,
                  const std::vector<std::pair<std::string, std::string>>& headers, bool keep_alive) {
  return head(status, content_type, headers, "Content-Length: " + std::to_string(body.size()) + "\r\n", keep_alive) + body;
}

void lower_thread_priority(int nice) {
  // These threads need little CPU; at the engine's priority a woken one would stall a parallel
  // region's barrier (the engine's OpenMP workers wait for a descheduled member).
  setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), nice);
}
}  // namespace

// ---------------------------------------------------------------------------------------------

struct Server::Core {
  Limits limits;
  struct Route {
    Handler handler;
    Mode mode;
  };
  std::map<std::pair<std::string, std::string>, Route> routes;  // (path, method)

  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  std::thread loop_thread;
  std::vector<std::thread> workers;
  std::atomic<bool> stopping{false};

  // Messages from other threads to the loop.
  struct Msg {
    uint64_t conn = 0, seq = 0;
    enum Kind { kBytes, kFinal, kStopAccepting } kind = kBytes;
    std::string bytes;
    bool close_after = false;
  };
  std::mutex inbox_mu;
  std::vector<Msg> inbox;

  // The workers' queue.
  std::mutex work_mu;
  std::condition_variable work_cv;
  std::deque<std::function<void()>> work;
  bool work_stop = false;

  mutable std::mutex stats_mu;
  ServerStats st;
  std::atomic<int64_t> exchanges{0}, open_conns{0};

  void post_msg(Msg m) {
    {
      std::lock_guard<std::mutex> g(inbox_mu);
      inbox.push_back(std::move(m));
    }
    wake();
  }
  void wake() const {
    if (wake_fd < 0) return;
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(wake_fd, &one, sizeof(one));
  }

  bool enqueue(std::function<void()> fn, bool bounded) {
    {
      std::lock_guard<std::mutex> g(work_mu);
      if (work_stop) return false;
      if (bounded && work.size() >= limits.max_pending) return false;
      work.push_back(std::move(fn));
    }
    work_cv.notify_one();
    return true;
  }

  void worker_main() {
    lower_thread_priority(10);
    while (true) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lk(work_mu);
        work_cv.wait(lk, [&] { return work_stop || !work.empty(); });
        if (work.empty()) return;
        fn = std::move(work.front());
        work.pop_front();
      }
      try {
        fn();
      } catch (...) {
        // A task's own errors are its to answer; one that escapes must not end the server.
      }
    }
  }

  // ---- the loop's own state ----
  struct Conn {
    int fd = -1;
    uint64_t id = 0, seq = 0;
    std::string in;
    Parser parser;
    // kLingering: answered and half-closed; what the client still sends is read and dropped
    // for a moment, so that closing does not reset the connection before it reads the answer
    // (a client still sending a refused body would otherwise lose the 413).
    enum State { kReading, kHandling, kLingering, kClosing } state = kReading;
    std::string out;
    size_t out_off = 0;
    Clock::time_point started{}, last_activity{}, last_write_progress{};
    bool in_request = false;       // bytes of a request have arrived
    bool answer_complete = false;  // the exchange's last bytes are queued
    bool close_after = false, reading_paused = false, want_out = false;
    std::shared_ptr<Exchange> ex;
  };
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns;
  uint64_t next_conn = 1;
  std::weak_ptr<Core> self;

  void loop_main();
  void accept_all();
  void on_readable(Conn& c);
  void advance(Conn& c);
  void dispatch(Conn& c);
  void flush(Conn& c);
  void update_interest(Conn& c);
  void close_conn(Conn& c, bool client_gone);
  void fail(Conn& c, int status, const std::string& message);
  void apply(Msg& m);
  void sweep();
};

struct Exchange {
  std::weak_ptr<Server::Core> core;
  uint64_t conn = 0, seq = 0;
  bool keep_alive = true, http10 = false;
  std::mutex mu;
  enum Phase { kFresh, kStreaming, kDone } phase = kFresh;
  bool gone = false;
  std::function<void()> on_gone;

  // Under mu: queue bytes for the connection (false when the answer cannot go out any more).
  bool send(std::string bytes, bool final, bool close_after) {
    auto c = core.lock();
    if (!c || gone) return false;
    Server::Core::Msg m;
    m.conn = conn;
    m.seq = seq;
    m.kind = final ? Server::Core::Msg::kFinal : Server::Core::Msg::kBytes;
    m.bytes = std::move(bytes);
    m.close_after = close_after;
    c->post_msg(std::move(m));
    return true;
  }
  // Called by the loop: the client went away before the answer was complete.
  void mark_gone() {
    std::function<void()> fn;
    {
      std::lock_guard<std::mutex> g(mu);
      if (gone || phase == kDone) return;
      gone = true;
      fn = std::move(on_gone);
      on_gone = nullptr;
    }
    if (fn) fn();
  }
};

bool Responder::respond(Response r) const {
  if (!ex_) return false;
  std::lock_guard<std::mutex> g(ex_->mu);
  if (ex_->gone || ex_->phase != Exchange::kFresh) return false;
  ex_->phase = Exchange::kDone;
  ex_->on_gone = nullptr;
  return ex_->send(whole(r.status, r.content_type, r.body, r.headers, ex_->keep_alive), true, !ex_->keep_alive);
}

bool Responder::begin_stream(int status, const std::string& content_type, std::vector<std::pair<std::string, std::string>> headers) const {
  if (!ex_) return false;
  std::lock_guard<std::mutex> g(ex_->mu);
  if (ex_->gone || ex_->phase != Exchange::kFresh) return false;
  ex_->phase = Exchange::kStreaming;
  // HTTP/1.0 has no chunked encoding: the body ends when the connection does.
  if (ex_->http10) ex_->keep_alive = false;
  return ex_->send(head(status, content_type, headers, ex_->http10 ? "" : "Transfer-Encoding: chunked\r\n", ex_->keep_alive), false, false);
}

bool Responder::write(std::string data) const {
  if (!ex_) return false;
  std::lock_guard<std::mutex> g(ex_->mu);
  if (ex_->gone || ex_->phase != Exchange::kStreaming) return false;
  if (data.empty()) return true;
  if (ex_->http10) return ex_->send(std::move(data), false, false);
  char size[32];
  std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
  return ex_->send(size + data + "\r\n", false, false);
}

bool Responder::end() const {
  if (!ex_) return false;
  std::lock_guard<std::mutex> g(ex_->mu);
  if (ex_->gone || ex_->phase != Exchange::kStreaming) return false;
  ex_->phase = Exchange::kDone;
  ex_->on_gone = nullptr;
  return ex_->send(ex_->http10 ? std::string() : std::string("0\r\n\r\n"), true, !ex_->keep_alive);
}

bool Responder::gone() const {
  if (!ex_) return true;
  std::lock_guard<std::mutex> g(ex_->mu);
  return ex_->gone;
}

void Responder::on_gone(std::function<void()> fn) const {
  if (!ex_) return;
  {
    std::lock_guard<std::mutex> g(ex_->mu);
    if (ex_->phase == Exchange::kDone && !ex_->gone) return;
    if (!ex_->gone) {
      ex_->on_gone = std::move(fn);
      return;
    }
  }
  fn();
}

// ---------------------------------------------------------------------------------------------

void Server::Core::update_interest(Conn& c) {
  epoll_event ev{};
  ev.events = EPOLLRDHUP;
  if (!c.reading_paused) ev.events |= EPOLLIN;
  if (c.out.size() > c.out_off) ev.events |= EPOLLOUT;
  ev.data.u64 = c.id;
  epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev);
}

void Server::Core::close_conn(Conn& c, bool client_gone) {
  if (c.state == Conn::kClosing) return;
  c.state = Conn::kClosing;
  epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
  ::close(c.fd);
  --open_conns;
  if (c.ex) {
    const bool complete = c.answer_complete && c.out.size() == c.out_off;
    if (!complete) {
      if (client_gone) {
        std::lock_guard<std::mutex> g(stats_mu);
        ++st.clients_gone;
      }
      c.ex->mark_gone();
    }
    c.ex.reset();
    --exchanges;
  }
}

void Server::Core::fail(Conn& c, int status, const std::string& message) {
  {
    std::lock_guard<std::mutex> g(stats_mu);
    if (status == 408) ++st.timeouts;
    else ++st.limit_errors;
  }
  // The connection's framing is lost: answer and close.
  c.out += whole(status, "application/json", error_body(status, message), {}, false);
  c.close_after = true;
  c.answer_complete = true;
  c.reading_paused = true;
  c.state = Conn::kHandling;
  flush(c);
}

void Server::Core::flush(Conn& c) {
  if (c.state == Conn::kClosing) return;
  while (c.out.size() > c.out_off) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
    if (n > 0) {
      c.out_off += static_cast<size_t>(n);
      c.last_write_progress = Clock::now();
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0 && errno == EINTR) continue;
    close_conn(c, true);
    return;
  }
  if (c.out_off == c.out.size()) {
    c.out.clear();
    c.out_off = 0;
  } else if (c.out_off > (1 << 20)) {
    c.out.erase(0, c.out_off);
    c.out_off = 0;
  }
  if (c.out.size() - c.out_off > limits.max_output_bytes) {
    close_conn(c, true);  // a client that does not read its stream
    return;
  }
  if (c.out.empty() && c.answer_complete) {
    if (c.close_after) {
      ::shutdown(c.fd, SHUT_WR);
      if (c.ex) {
        c.ex.reset();
        --exchanges;
      }
      c.state = Conn::kLingering;
      c.reading_paused = false;
      c.last_activity = Clock::now();
      update_interest(c);
      return;
    }
    // Ready for the next request on this connection (pipelined bytes may be waiting).
    if (c.ex) {
      c.ex.reset();
      --exchanges;
    }
    c.state = Conn::kReading;
    c.answer_complete = false;
    c.in_request = false;
    c.reading_paused = false;
    c.last_activity = Clock::now();
    c.in.erase(0, c.parser.pos);
    c.parser.reset();
    if (!c.in.empty()) {
      advance(c);
      if (c.state == Conn::kClosing) return;
    }
  }
  update_interest(c);
}

void Server::Core::advance(Conn& c) {
  if (c.state != Conn::kReading) return;
  if (!c.in.empty() && !c.in_request) {
    c.in_request = true;
    c.started = Clock::now();
  }
  const bool had_head = c.parser.phase != Parser::kHead;
  const int s = c.parser.run(c.in, limits);
  if (s == 0) {
    if (!had_head && c.parser.phase != Parser::kHead && c.parser.expect_continue && c.parser.phase != Parser::kDone) {
      c.out += "HTTP/1.1 100 Continue\r\n\r\n";
      flush(c);
    }
    // Consumed bytes of a long body need not stay in the buffer.
    if (c.parser.phase != Parser::kHead && c.parser.pos > kCompactAfter) {
      c.in.erase(0, c.parser.pos);
      c.parser.pos = 0;
    }
    return;
  }
  if (s != 1) {
    const char* what = s == 413 ? "the request body is too large" : s == 414 ? "the request line is too long"
                       : s == 431 ? "the request's header fields are too large or too many"
                       : s == 415 ? "compressed request bodies are not accepted (Content-Encoding); send the body uncompressed"
                       : s == 417 ? "only Expect: 100-continue is understood"
                       : s == 501 ? "only chunked Transfer-Encoding is understood"
                       : s == 505 ? "only HTTP/1.0 and HTTP/1.1 are served"
                                  : "malformed HTTP request";
    fail(c, s, what);
    return;
  }
  dispatch(c);
}

void Server::Core::dispatch(Conn& c) {
  c.state = Conn::kHandling;
  {
    std::lock_guard<std::mutex> g(stats_mu);
    ++st.requests;
  }
  auto ex = std::make_shared<Exchange>();
  ex->core = self;
  ex->conn = c.id;
  ex->seq = ++c.seq;
  Request req = std::move(c.parser.req);
  ex->http10 = req.version == "HTTP/1.0";
  const std::string* conn_h = req.header("connection");
  ex->keep_alive = ex->http10 ? has_token(conn_h, "keep-alive") : !has_token(conn_h, "close");
  c.ex = ex;
  ++exchanges;
  // Pipelined bytes wait; a client may not queue requests without bound.
  c.reading_paused = c.in.size() - c.parser.pos > limits.max_header_bytes;
  update_interest(c);
  Responder r(ex);
  auto it = routes.find({req.path, req.method});
  if (it == routes.end()) {
    std::string allow;
    for (const auto& [key, route] : routes) {
      if (key.first == req.path) allow += (allow.empty() ? "" : ", ") + key.second;
    }
    Response resp;
    if (allow.empty()) {
      resp.status = 404;
      resp.body = error_body(404, "no such route");
    } else {
      resp.status = 405;
      resp.body = error_body(405, "method not allowed; this path takes " + allow);
      resp.headers.emplace_back("Allow", allow);
    }
    r.respond(std::move(resp));
    return;
  }
  const Route& route = it->second;
  if (route.mode == Mode::kInline) {
    try {
      route.handler(req, r);
    } catch (const std::exception& e) {
      r.respond({500, "application/json", error_body(500, "internal error"), {}});
    }
    return;
  }
  Handler h = route.handler;
  auto task = [h, r, req = std::move(req)]() mutable {
    if (r.gone()) return;
    try {
      h(req, r);
    } catch (...) {
      r.respond({500, "application/json", error_body(500, "internal error"), {}});
    }
  };
  if (!enqueue(std::move(task), /*bounded=*/true)) {
    r.respond({503, "application/json", error_body(503, "the server is busy; retry later"), {{"Retry-After", "1"}}});
  }
}

void Server::Core::apply(Msg& m) {
  if (m.kind == Msg::kStopAccepting) {
    if (listen_fd >= 0) {
      epoll_ctl(epoll_fd, EPOLL_CTL_DEL, listen_fd, nullptr);
      ::close(listen_fd);
      listen_fd = -1;
    }
    std::vector<Conn*> idle;
    for (auto& [id, c] : conns) {
      if (c->state == Conn::kReading) idle.push_back(c.get());
    }
    for (Conn* c : idle) close_conn(*c, false);
    return;
  }
  auto it = conns.find(m.conn);
  if (it == conns.end()) return;
  Conn& c = *it->second;
  if (c.state == Conn::kClosing || !c.ex || c.ex->seq != m.seq) return;
  c.out += m.bytes;
  if (m.kind == Msg::kFinal) {
    c.answer_complete = true;
    c.close_after = c.close_after || m.close_after;
  }
  flush(c);
}

void Server::Core::sweep() {
  const auto now = Clock::now();
  auto secs = [&](Clock::time_point t) { return std::chrono::duration<double>(now - t).count(); };
  std::vector<std::pair<Conn*, int>> act;  // 0 close idle, 408, 1 write stalled
  for (auto& [id, cp] : conns) {
    Conn& c = *cp;
    if (c.state == Conn::kReading) {
      if (c.in_request && secs(c.started) > limits.request_timeout_s) act.emplace_back(&c, 408);
      else if (!c.in_request && secs(c.last_activity) > limits.idle_timeout_s) act.emplace_back(&c, 0);
    } else if (c.state == Conn::kLingering && secs(c.last_activity) > 2.0) {
      act.emplace_back(&c, 0);
    } else if (c.state == Conn::kHandling && c.out.size() > c.out_off && secs(c.last_write_progress) > limits.write_timeout_s) {
      act.emplace_back(&c, 1);
    }
  }
  for (auto& [c, what] : act) {
    if (what == 408) {
      fail(*c, 408, "the request did not arrive in time");
    } else {
      if (what == 1) {
        std::lock_guard<std::mutex> g(stats_mu);
        ++st.timeouts;
      }
      close_conn(*c, what == 1);
    }
  }
}

void Server::Core::accept_all() {
  while (listen_fd >= 0) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;  // EAGAIN, or out of descriptors (EMFILE): the backlog waits
    }
    if (static_cast<int>(conns.size()) >= limits.max_connections) {
      const std::string r = whole(503, "application/json", error_body(503, "too many connections; retry later"), {{"Retry-After", "1"}}, false);
      [[maybe_unused]] ssize_t n = ::send(fd, r.data(), r.size(), MSG_NOSIGNAL);
      ::close(fd);
      std::lock_guard<std::mutex> g(stats_mu);
      ++st.refused_connections;
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->id = next_conn++;
    c->last_activity = c->last_write_progress = Clock::now();
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = c->id;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      ::close(fd);
      continue;
    }
    conns.emplace(c->id, std::move(c));
    ++open_conns;
  }
}

void Server::Core::on_readable(Conn& c) {
  char buf[64 << 10];
  if (c.state == Conn::kLingering) {
    for (int i = 0; i < 16; ++i) {
      const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      close_conn(c, false);
      return;
    }
    return;
  }
  while (c.state != Conn::kClosing && !c.reading_paused) {
    const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      c.in.append(buf, static_cast<size_t>(n));
      c.last_activity = Clock::now();
      if (c.state == Conn::kReading) {
        advance(c);
      } else if (c.in.size() - c.parser.pos > limits.max_header_bytes) {
        c.reading_paused = true;  // pipelined bytes wait until this answer is out
      }
      if (c.state != Conn::kReading) break;
      continue;
    }
    if (n == 0) {
      close_conn(c, c.state == Conn::kHandling || c.in_request);
      return;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) close_conn(c, true);
    break;
  }
  if (c.state != Conn::kClosing) update_interest(c);
}

void Server::Core::loop_main() {
  lower_thread_priority(5);
  std::vector<epoll_event> events(256);
  auto last_sweep = Clock::now();
  while (!stopping) {
    const int n = epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), 100);
    for (int i = 0; i < n; ++i) {
      // epoll_event is packed on x86-64: copy its fields rather than bind references to them.
      const uint64_t key = events[static_cast<size_t>(i)].data.u64;
      const uint32_t flags = events[static_cast<size_t>(i)].events;
      if (key == 0) {  // the listening socket
        accept_all();
        continue;
      }
      if (key == UINT64_MAX) {  // wake_fd
        uint64_t v;
        [[maybe_unused]] ssize_t r = ::read(wake_fd, &v, sizeof(v));
        continue;
      }
      auto it = conns.find(key);
      if (it == conns.end()) continue;
      Conn& c = *it->second;
      if (c.state == Conn::kClosing) continue;
      if ((flags & EPOLLIN) && (!c.reading_paused || c.state == Conn::kLingering)) on_readable(c);
      if (c.state == Conn::kClosing) continue;
      if (c.state == Conn::kLingering) {
        if (flags & (EPOLLHUP | EPOLLERR | EPOLLRDHUP)) close_conn(c, false);
        continue;
      }
      if (flags & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        // The peer closed or half-closed (what it sent before was read above). A request in
        // flight has nobody to answer to: its owner hears of it (on_gone) and stops the work.
        const bool pending = c.state == Conn::kHandling || c.in_request;
        close_conn(c, pending);
        continue;
      }
      if (flags & EPOLLOUT) flush(c);
    }
    std::vector<Msg> msgs;
    {
      std::lock_guard<std::mutex> g(inbox_mu);
      msgs.swap(inbox);
    }
    for (Msg& m : msgs) apply(m);
    if (std::chrono::duration<double>(Clock::now() - last_sweep).count() > 0.1) {
      sweep();
      last_sweep = Clock::now();
    }
    for (auto it = conns.begin(); it != conns.end();) {
      if (it->second->state == Conn::kClosing) it = conns.erase(it);
      else ++it;
    }
  }
  for (auto& [id, c] : conns) close_conn(*c, false);
  conns.clear();
}

// ---------------------------------------------------------------------------------------------

Server::Server(const Limits& limits) : core_(std::make_shared<Core>()) {
  core_->limits = limits;
  core_->self = core_;
}

Server::~Server() { stop(); }

void Server::route(const std::string& method, const std::string& path, Handler handler, Mode mode) {
  core_->routes[{path, method}] = Core::Route{std::move(handler), mode};
}

int Server::bind(const std::string& host, int port) {
  Core& c = *core_;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) throw std::runtime_error("cannot resolve " + host + ": " + gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      c.listen_fd = fd;
      break;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  if (c.listen_fd < 0) throw std::runtime_error("cannot listen on " + host + ":" + service + ": " + why);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(c.listen_fd, reinterpret_cast<sockaddr*>(&ss), &len);
  return ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

void Server::start() {
  Core& c = *core_;
  if (c.listen_fd < 0) throw std::runtime_error("http::Server::start before bind");
  c.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  c.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (c.epoll_fd < 0 || c.wake_fd < 0) throw std::runtime_error(std::string("epoll/eventfd: ") + std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;
  epoll_ctl(c.epoll_fd, EPOLL_CTL_ADD, c.listen_fd, &ev);
  ev.data.u64 = UINT64_MAX;
  epoll_ctl(c.epoll_fd, EPOLL_CTL_ADD, c.wake_fd, &ev);
  for (int i = 0; i < std::max(1, c.limits.workers); ++i) c.workers.emplace_back([&c] { c.worker_main(); });
  c.loop_thread = std::thread([&c] { c.loop_main(); });
}

void Server::post(std::function<void()> fn) { core_->enqueue(std::move(fn), /*bounded=*/false); }

void Server::stop_accepting() {
  Core::Msg m;
  m.kind = Core::Msg::kStopAccepting;
  core_->post_msg(std::move(m));
}

int64_t Server::exchanges_open() const { return core_->exchanges.load(); }

void Server::stop() {
  Core& c = *core_;
  if (c.loop_thread.joinable()) {
    c.stopping = true;
    c.wake();
    c.loop_thread.join();
  }
  {
    std::lock_guard<std::mutex> g(c.work_mu);
    c.work_stop = true;
    c.work.clear();
  }
  c.work_cv.notify_all();
  for (auto& t : c.workers) {
    if (t.joinable()) t.join();
  }
  c.workers.clear();
  for (int* fd : {&c.listen_fd, &c.epoll_fd, &c.wake_fd}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

ServerStats Server::stats() const {
  std::lock_guard<std::mutex> g(core_->stats_mu);
  ServerStats s = core_->st;
  s.exchanges_open = core_->exchanges.load();
  s.connections_open = core_->open_conns.load();
  return s;
}

}  // namespace torchspeed::serve::http
