// serve/http.h: the request parser's limits, and a live server driven over raw sockets by
// hostile clients (bodies without a length, compressed bodies, endless header lines, a byte
// every while, clients that leave or never read). Needs nothing but the HTTP layer; CI runs it
// again under AddressSanitizer and UndefinedBehaviorSanitizer (fuzz/CMakeLists.txt).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "torchspeed/serve/http.h"

namespace http = torchspeed::serve::http;
using Clock = std::chrono::steady_clock;

namespace {

int parse(const std::string& in, http::Request* out = nullptr, size_t* used_out = nullptr, http::Limits l = {}) {
  http::Request r;
  size_t used = 0;
  const int s = http::parse_request(in, l, r, used);
  if (out) *out = r;
  if (used_out) *used_out = used;
  return s;
}

TEST(HttpParser, WellFormedRequests) {
  http::Request r;
  size_t used = 0;
  const std::string a = "POST /v1/completions?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nX-A:  b \r\n\r\nhelloGET";
  ASSERT_EQ(parse(a, &r, &used), 1);
  EXPECT_EQ(r.method, "POST");
  EXPECT_EQ(r.path, "/v1/completions");
  EXPECT_EQ(r.query, "x=1");
  EXPECT_EQ(r.body, "hello");
  ASSERT_NE(r.header("x-a"), nullptr);
  EXPECT_EQ(*r.header("x-a"), "b");
  EXPECT_EQ(used, a.size() - 3);  // the next request's bytes are left
  // Chunked, with extensions and a trailer; bare LF line ends.
  ASSERT_EQ(parse("POST / HTTP/1.1\nTransfer-Encoding: chunked\n\n3;ext=1\nabc\n2\r\nde\r\n0\nT: v\n\n", &r), 1);
  EXPECT_EQ(r.body, "abcde");
  // Incomplete: more bytes needed, never an error.
  EXPECT_EQ(parse("GET / HTTP/1.1\r\nHost"), 0);
  EXPECT_EQ(parse("POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc"), 0);
  EXPECT_EQ(parse("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"), 0);
  EXPECT_EQ(parse("\r\nGET / HTTP/1.0\r\n\r\n", &r), 1);
  EXPECT_EQ(r.version, "HTTP/1.0");
}

TEST(HttpParser, RefusesWhatIsMalformedOrTooLarge) {
  http::Limits l;
  l.max_body_bytes = 100;
  l.max_request_line = 64;
  l.max_header_bytes = 256;
  l.max_headers = 4;
  auto p = [&](const std::string& s) { return parse(s, nullptr, nullptr, l); };
  EXPECT_EQ(p("POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n"), 413);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n"), 413);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"), 400);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n"), 400);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n"), 400);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n"), 501);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nContent-Encoding: gzip\r\n\r\n"), 415);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nExpect: something\r\n\r\n"), 417);
  // The decoded size of a chunked body counts, however it is cut.
  std::string chunked = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 20; ++i) chunked += "a\r\n0123456789\r\n";
  EXPECT_EQ(p(chunked), 413);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n"), 400);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"), 400);
  EXPECT_EQ(p("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(2000, '1')), 400);
  // A line without its newline is refused once past its limit, not buffered without end.
  EXPECT_EQ(p("GET /" + std::string(100, 'a')), 414);
  EXPECT_EQ(p("GET / HTTP/1.1\r\nX: " + std::string(300, 'a')), 431);
  EXPECT_EQ(p("GET / HTTP/1.1\r\nA: 1\r\nB: 1\r\nC: 1\r\nD: 1\r\nE: 1\r\n\r\n"), 431);
  EXPECT_EQ(p("GET / HTTP/2.0\r\n\r\n"), 505);
  EXPECT_EQ(p("GET / FTP/1.0\r\n\r\n"), 400);
  EXPECT_EQ(p("GET x HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(p("G(T / HTTP/1.1\r\n\r\n"), 400);
  EXPECT_EQ(p("GET / HTTP/1.1\r\n folded\r\n\r\n"), 400);
  EXPECT_EQ(p("GET / HTTP/1.1\r\nNo colon\r\n\r\n"), 400);
  EXPECT_EQ(p("GET / HTTP/1.1\r\nBad name: v\r\n\r\n"), 400);
  EXPECT_EQ(p("\r\n\r\n\r\n\r\n\r\nGET / HTTP/1.1\r\n\r\n"), 400);
}

// ---------------------------------------------------------------------------------------------

struct Conn {
  int fd = -1;
  explicit Conn(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ~Conn() {
    if (fd >= 0) ::close(fd);
  }
  bool send(const std::string& s) const {
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  // Bytes until `done(bytes)`, the peer closes, or the timeout. closed: the peer closed.
  std::string read_until(double timeout_s, const std::function<bool(const std::string&)>& done, bool* closed = nullptr) const {
    std::string out;
    const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    if (closed) *closed = false;
    while (!done(out)) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
      if (left <= 0) break;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) break;
      char buf[65536];
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) {
        if (closed) *closed = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  // One whole response (Content-Length or chunked body).
  std::string response(double timeout_s = 5, bool* closed = nullptr) const {
    return read_until(timeout_s, [](const std::string& s) { return complete_response(s) > 0; }, closed);
  }
  static size_t complete_response(const std::string& s) {
    const size_t h = s.find("\r\n\r\n");
    if (h == std::string::npos) return 0;
    const std::string head = s.substr(0, h);
    const size_t cl = head.find("Content-Length: ");
    if (cl != std::string::npos) {
      const size_t n = std::stoul(head.substr(cl + 16));
      return s.size() >= h + 4 + n ? h + 4 + n : 0;
    }
    if (head.find("Transfer-Encoding: chunked") != std::string::npos) {
      const size_t e = s.find("\r\n0\r\n\r\n", h);
      return e == std::string::npos ? 0 : e + 7;
    }
    return 0;
  }
};

long rss_kib() {
  FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  long kib = 0;
  while (f && std::fgets(line, sizeof(line), f)) {
    if (std::strncmp(line, "VmRSS:", 6) == 0) kib = std::atol(line + 6);
  }
  if (f) std::fclose(f);
  return kib;
}

int status_of(const std::string& resp) { return resp.size() >= 12 && resp.rfind("HTTP/1.1 ", 0) == 0 ? std::stoi(resp.substr(9, 3)) : -1; }

std::string body_of(const std::string& resp) {
  const size_t h = resp.find("\r\n\r\n");
  return h == std::string::npos ? "" : resp.substr(h + 4);
}

struct Fixture : ::testing::Test {
  http::Limits limits;
  std::unique_ptr<http::Server> server;
  int port = 0;
  std::atomic<int> gone{0};
  std::mutex held_mu;
  std::vector<http::Responder> held;
  std::vector<std::thread> threads;

  void start() {
    server = std::make_unique<http::Server>(limits);
    server->route("GET", "/health", [](http::Request&, const http::Responder& r) {
      r.respond({200, "application/json", "{\"status\": \"ok\"}", {}});
    }, http::Server::Mode::kInline);
    server->route("POST", "/echo", [](http::Request& q, const http::Responder& r) {
      r.respond({200, "text/plain", q.body, {}});
    }, http::Server::Mode::kWorker);
    server->route("POST", "/hold", [this](http::Request&, const http::Responder& r) {
      r.on_gone([this] { ++gone; });
      std::lock_guard<std::mutex> g(held_mu);
      held.push_back(r);
    }, http::Server::Mode::kWorker);
    // Streams `chunks` pieces of 64 KiB from a thread of its own (as the engine's sinks do).
    server->route("POST", "/stream", [this](http::Request& q, const http::Responder& r) {
      const int chunks = std::stoi(q.body);
      r.on_gone([this] { ++gone; });
      r.begin_stream(200, "text/event-stream");
      std::lock_guard<std::mutex> g(held_mu);
      threads.emplace_back([r, chunks] {
        for (int i = 0; i < chunks; ++i) {
          if (!r.write(std::string(65536, static_cast<char>('a' + i % 26)))) return;
          if (chunks > 64) std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        r.end();
      });
    }, http::Server::Mode::kWorker);
    port = server->bind("127.0.0.1", 0);
    server->start();
  }
  void TearDown() override {
    if (server) server->stop();
    for (auto& t : threads) t.join();
  }
  bool wait_for(const std::function<bool()>& pred, double s = 5) {
    const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    while (Clock::now() < end) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return pred();
  }
};

TEST_F(Fixture, KeepAlivePipeliningAndRoutes) {
  start();
  Conn c(port);
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcPOST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nde"));
  std::string r1 = c.response();
  const size_t n1 = Conn::complete_response(r1);
  ASSERT_GT(n1, 0u);
  std::string rest = r1.substr(n1);
  if (Conn::complete_response(rest) == 0) rest += c.response();
  EXPECT_EQ(status_of(r1), 200);
  EXPECT_EQ(body_of(r1.substr(0, n1)), "abc");
  EXPECT_EQ(body_of(rest), "de");
  EXPECT_NE(r1.find("Connection: keep-alive"), std::string::npos);
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n1\r\n!\r\n0\r\n\r\n"));
  EXPECT_EQ(body_of(c.response()), "hi!");
  ASSERT_TRUE(c.send("GET /nothing HTTP/1.1\r\n\r\n"));
  EXPECT_EQ(status_of(c.response()), 404);
  ASSERT_TRUE(c.send("GET /echo HTTP/1.1\r\n\r\n"));
  const std::string r405 = c.response();
  EXPECT_EQ(status_of(r405), 405);
  EXPECT_NE(r405.find("Allow: POST"), std::string::npos);
  // Expect: 100-continue gets its interim answer before the body is sent.
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"));
  EXPECT_EQ(c.read_until(5, [](const std::string& s) { return s.find("\r\n\r\n") != std::string::npos; }), "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(c.send("ok"));
  EXPECT_EQ(body_of(c.response()), "ok");
  // HTTP/1.0 without keep-alive: the server closes after answering.
  Conn old(port);
  ASSERT_TRUE(old.send("GET /health HTTP/1.0\r\n\r\n"));
  bool closed = false;
  const std::string r10 = old.read_until(5, [](const std::string&) { return false; }, &closed);
  EXPECT_TRUE(closed);
  EXPECT_NE(r10.find("Connection: close"), std::string::npos);
}

TEST_F(Fixture, BodiesPastTheLimitAreRefusedWhileArriving) {
  limits.max_body_bytes = 4096;
  start();
  // A chunked body without end: 413 after the limit, and what follows is read and dropped
  // (briefly, so the client can read its answer), never kept: this process's RSS (the server
  // runs in it) does not grow by the 64 MiB sent.
  const long rss0 = rss_kib();
  Conn c(port);
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"));
  const std::string chunk = "1000\r\n" + std::string(4096, 'x') + "\r\n";
  size_t sent = 0;
  for (int i = 0; i < 16384 && c.send(chunk); ++i) sent += chunk.size();
  EXPECT_LT(rss_kib() - rss0, 16 << 10) << sent << " bytes sent";
  bool closed = false;
  const std::string r = c.read_until(5, [](const std::string& s) { return Conn::complete_response(s) > 0; }, &closed);
  EXPECT_EQ(status_of(r), 413) << r.substr(0, 200);
  // Content-Length past the limit: answered from the headers alone.
  Conn d(port);
  ASSERT_TRUE(d.send("POST /echo HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n"));
  EXPECT_EQ(status_of(d.response()), 413);
  Conn z(port);
  ASSERT_TRUE(z.send("POST /echo HTTP/1.1\r\nContent-Length: 3\r\nContent-Encoding: gzip\r\n\r\nabc"));
  const std::string rz = z.response();
  EXPECT_EQ(status_of(rz), 415);
  EXPECT_NE(body_of(rz).find("\"error\""), std::string::npos);
  EXPECT_EQ(server->stats().limit_errors, 3);
}

TEST_F(Fixture, EndlessLinesAreCut) {
  start();
  Conn c(port);
  ASSERT_TRUE(c.send("GET /" + std::string(10000, 'a')));
  EXPECT_EQ(status_of(c.response()), 414);
  Conn d(port);
  std::string h = "GET /health HTTP/1.1\r\nX-Long: ";
  ASSERT_TRUE(d.send(h));
  bool ok = true;
  for (int i = 0; i < 64 && ok; ++i) ok = d.send(std::string(4096, 'b'));
  EXPECT_EQ(status_of(d.response()), 431);
}

TEST_F(Fixture, SlowRequestsTimeOutAndIdleConnectionsClose) {
  limits.request_timeout_s = 1.0;
  limits.idle_timeout_s = 0.5;
  start();
  // A byte every 200 ms keeps a connection active but never completes its request: 408 at
  // the request deadline.
  Conn slow(port);
  const auto t0 = Clock::now();
  const std::string req = "GET /health HTTP/1.1\r\nX-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
  std::string got;
  for (size_t i = 0; i < req.size() && got.empty(); ++i) {
    if (!slow.send(std::string(1, req[i]))) break;
    got = slow.read_until(0.2, [](const std::string& s) { return !s.empty(); });
  }
  got += slow.response(2);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(status_of(got), 408) << got;
  EXPECT_LT(took, 2.5);
  EXPECT_GE(took, 0.9);
  // A keep-alive connection with nothing to say is closed after the idle timeout.
  Conn idle(port);
  ASSERT_TRUE(idle.send("GET /health HTTP/1.1\r\n\r\n"));
  EXPECT_EQ(status_of(idle.response()), 200);
  bool closed = false;
  idle.read_until(3, [](const std::string&) { return false; }, &closed);
  EXPECT_TRUE(closed);
}

TEST_F(Fixture, HealthAnswersWhileManyClientsTrickle) {
  start();
  std::vector<std::unique_ptr<Conn>> slow;
  for (int i = 0; i < 200; ++i) {
    slow.push_back(std::make_unique<Conn>(port));
    ASSERT_TRUE(slow.back()->send("POST /echo HTTP/1.1\r\nContent-Length: 100\r\n\r\nab"));
  }
  for (int i = 0; i < 8; ++i) {  // held requests: a handler that never answers holds no thread
    auto c = std::make_unique<Conn>(port);
    ASSERT_TRUE(c->send("POST /hold HTTP/1.1\r\nContent-Length: 0\r\n\r\n"));
    slow.push_back(std::move(c));
  }
  std::vector<double> ms;
  for (int i = 0; i < 50; ++i) {
    const auto t0 = Clock::now();
    Conn c(port);
    ASSERT_TRUE(c.send("GET /health HTTP/1.1\r\n\r\n"));
    ASSERT_EQ(status_of(c.response()), 200);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  EXPECT_LT(ms[ms.size() * 99 / 100], 100.0);
  EXPECT_GE(server->stats().connections_open, 208);
}

TEST_F(Fixture, ConnectionsPastTheLimitGet503) {
  limits.max_connections = 4;
  start();
  std::vector<std::unique_ptr<Conn>> open;
  for (int i = 0; i < 4; ++i) {
    open.push_back(std::make_unique<Conn>(port));
    ASSERT_TRUE(open.back()->send("GET /health HTTP/1.1\r\n\r\n"));
    ASSERT_EQ(status_of(open.back()->response()), 200);
  }
  Conn extra(port);
  const std::string r = extra.response();
  EXPECT_EQ(status_of(r), 503);
  EXPECT_NE(r.find("Retry-After"), std::string::npos);
  EXPECT_TRUE(wait_for([&] { return server->stats().refused_connections == 1; }));
  open.clear();
  ASSERT_TRUE(wait_for([&] { return server->stats().connections_open == 0; }));
  Conn again(port);
  ASSERT_TRUE(again.send("GET /health HTTP/1.1\r\n\r\n"));
  EXPECT_EQ(status_of(again.response()), 200);
}

TEST_F(Fixture, AClientThatLeavesIsNoticedAtOnce) {
  start();
  {
    Conn c(port);
    ASSERT_TRUE(c.send("POST /hold HTTP/1.1\r\nContent-Length: 0\r\n\r\n"));
    ASSERT_TRUE(wait_for([&] { std::lock_guard<std::mutex> g(held_mu); return held.size() == 1; }));
    EXPECT_EQ(server->exchanges_open(), 1);
  }
  ASSERT_TRUE(wait_for([&] { return gone.load() == 1; }, 1.0));
  EXPECT_EQ(server->exchanges_open(), 0);
  EXPECT_EQ(server->stats().clients_gone, 1);
  std::lock_guard<std::mutex> g(held_mu);
  EXPECT_TRUE(held[0].gone());
  EXPECT_FALSE(held[0].respond({200, "text/plain", "late", {}}));
  bool called = false;
  held[0].on_gone([&] { called = true; });  // already gone: runs here
  EXPECT_TRUE(called);
}

TEST_F(Fixture, StreamsAreChunkedAndAReaderThatStopsIsDropped) {
  limits.max_output_bytes = 1 << 20;
  limits.write_timeout_s = 2;
  start();
  Conn c(port);
  ASSERT_TRUE(c.send("POST /stream HTTP/1.1\r\nContent-Length: 2\r\n\r\n10"));
  const std::string r = c.response(10);
  ASSERT_EQ(status_of(r), 200);
  // Decode the chunked body.
  std::string body, rest = body_of(r);
  while (true) {
    const size_t nl = rest.find("\r\n");
    ASSERT_NE(nl, std::string::npos);
    const size_t n = std::stoul(rest.substr(0, nl), nullptr, 16);
    if (n == 0) break;
    body += rest.substr(nl + 2, n);
    rest = rest.substr(nl + 2 + n + 2);
  }
  ASSERT_EQ(body.size(), 10u * 65536);
  EXPECT_EQ(body[0], 'a');
  EXPECT_EQ(body[9 * 65536], 'j');
  EXPECT_EQ(gone.load(), 0);
  // 4 GiB to a client that reads nothing: dropped once the socket's buffers and 1 MiB of
  // ours are full (or the writes stall for 2 s), and the stream's owner hears of it.
  Conn stuck(port);
  const int rcv = 4096;
  setsockopt(stuck.fd, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof(rcv));
  ASSERT_TRUE(stuck.send("POST /stream HTTP/1.1\r\nContent-Length: 5\r\n\r\n65536"));
  EXPECT_TRUE(wait_for([&] { return gone.load() == 1; }, 10));
  EXPECT_EQ(server->exchanges_open(), 0);
}

TEST_F(Fixture, StopEndsWhatIsInFlight) {
  start();
  Conn c(port);
  ASSERT_TRUE(c.send("POST /hold HTTP/1.1\r\nContent-Length: 0\r\n\r\n"));
  ASSERT_TRUE(wait_for([&] { std::lock_guard<std::mutex> g(held_mu); return held.size() == 1; }));
  server->stop();
  EXPECT_EQ(gone.load(), 1);
  std::lock_guard<std::mutex> g(held_mu);
  EXPECT_FALSE(held[0].respond({200, "text/plain", "after stop", {}}));
}

}  // namespace
