// HTTP's wire format for serve/http.h, internal: status phrases, and the incremental request
// Parser the server's loop
// feeds as bytes arrive (http.cpp) and parse_request / parse_request_in_pieces (http_parser.cpp)
// run. Limits are checked as bytes arrive, so a line without its newline or a body past its
// limit is refused once it passes the limit, never buffered without end.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>
#include <string_view>

#include "torchspeed/serve/http.h"

namespace torchspeed::serve::http::detail {

inline bool tchar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// "OK", "Not Found", ...: the reason phrase of a status line.
const char* reason(int status);

inline constexpr size_t kCompactAfter = 64 << 10;

struct Parser {
  enum Phase { kHead, kLength, kChunkSize, kChunkData, kChunkEnd, kTrailers, kDone };
  Phase phase = kHead;
  size_t pos = 0, head_bytes = 0, remaining = 0;
  bool seen_request_line = false, expect_continue = false;
  Request req;

  void reset() { *this = Parser(); }

  // 0: more bytes needed; 1: done; else the HTTP status of the error.
  int run(std::string_view buf, const Limits& l) {
    while (true) {
      switch (phase) {
        case kHead:
        case kTrailers: {
          const size_t nl = buf.find('\n', pos);
          if (nl == std::string_view::npos) {
            const size_t pending = buf.size() - pos;
            // (+1: the line's CR may be pending too; the line itself is measured without it)
            if (phase == kHead && !seen_request_line && pending > l.max_request_line + 1) return 414;
            if (head_bytes + pending > l.max_header_bytes) return 431;
            return 0;
          }
          std::string_view line = buf.substr(pos, nl - pos);
          head_bytes += nl + 1 - pos;
          pos = nl + 1;
          if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
          if (phase == kHead && !seen_request_line && line.size() > l.max_request_line) return 414;
          if (head_bytes > l.max_header_bytes) return 431;
          if (line.empty()) {
            if (phase == kTrailers) {
              phase = kDone;
              return 1;
            }
            if (!seen_request_line) {
              if (head_bytes > 8) return 400;  // a few stray CRLFs before a request are allowed
              continue;
            }
            const int s = end_of_head(l);
            if (s != 0) return s;
            continue;
          }
          if (phase == kTrailers) {
            if (line.find(':') == std::string_view::npos) return 400;
            continue;  // trailers are read and dropped
          }
          const int s = seen_request_line ? header_line(line, l) : request_line(line);
          if (s != 0) return s;
          break;
        }
        case kLength: {
          const size_t take = std::min(remaining, buf.size() - pos);
          req.body.append(buf.data() + pos, take);
          pos += take;
          remaining -= take;
          if (remaining > 0) return 0;
          phase = kDone;
          return 1;
        }
        case kChunkSize: {
          const size_t nl = buf.find('\n', pos);
          if (nl == std::string_view::npos) return buf.size() - pos > 1024 + 1 ? 400 : 0;  // + its CR
          std::string_view line = buf.substr(pos, nl - pos);
          pos = nl + 1;
          if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
          if (line.size() > 1024) return 400;
          const size_t semi = line.find(';');
          std::string_view hex = trim(line.substr(0, semi));
          if (hex.empty() || hex.size() > 15) return 400;
          size_t n = 0;
          for (char c : hex) {
            if (!std::isxdigit(static_cast<unsigned char>(c))) return 400;
            n = n * 16 + static_cast<size_t>(std::isdigit(static_cast<unsigned char>(c)) ? c - '0' : (std::tolower(c) - 'a' + 10));
          }
          if (n == 0) {
            phase = kTrailers;
            continue;
          }
          if (n > l.max_body_bytes || req.body.size() + n > l.max_body_bytes) return 413;
          remaining = n;
          phase = kChunkData;
          break;
        }
        case kChunkData: {
          const size_t take = std::min(remaining, buf.size() - pos);
          req.body.append(buf.data() + pos, take);
          pos += take;
          remaining -= take;
          if (remaining > 0) return 0;
          phase = kChunkEnd;
          break;
        }
        case kChunkEnd: {
          if (buf.size() - pos < 1) return 0;
          if (buf[pos] == '\n') {
            pos += 1;
          } else {
            if (buf.size() - pos < 2) return 0;
            if (buf[pos] != '\r' || buf[pos + 1] != '\n') return 400;
            pos += 2;
          }
          phase = kChunkSize;
          break;
        }
        case kDone:
          return 1;
      }
    }
  }

  int request_line(std::string_view line) {
    const size_t a = line.find(' ');
    if (a == std::string_view::npos || a == 0) return 400;
    const size_t b = line.find(' ', a + 1);
    if (b == std::string_view::npos || b == a + 1) return 400;
    std::string_view method = line.substr(0, a), target = line.substr(a + 1, b - a - 1), version = line.substr(b + 1);
    for (char c : method) {
      if (!tchar(c)) return 400;
    }
    for (char c : target) {
      if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) return 400;
    }
    if (target.front() != '/') return 400;
    if (version != "HTTP/1.1" && version != "HTTP/1.0") return version.substr(0, 5) == "HTTP/" ? 505 : 400;
    req.method = std::string(method);
    req.target = std::string(target);
    req.version = std::string(version);
    const size_t q = target.find('?');
    req.path = std::string(target.substr(0, q));
    if (q != std::string_view::npos) req.query = std::string(target.substr(q + 1));
    seen_request_line = true;
    return 0;
  }

  int header_line(std::string_view line, const Limits& l) {
    if (line.front() == ' ' || line.front() == '\t') return 400;  // obsolete line folding
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) return 400;
    for (char c : line.substr(0, colon)) {
      if (!tchar(c)) return 400;
    }
    std::string_view value = trim(line.substr(colon + 1));
    for (char c : value) {
      if (c == '\0' || c == '\r' || c == '\n') return 400;
    }
    if (req.headers.size() >= l.max_headers) return 431;
    req.headers.emplace_back(lower(line.substr(0, colon)), std::string(value));
    return 0;
  }

  int end_of_head(const Limits& l) {
    const std::string* te = req.header("transfer-encoding");
    const std::string* ce = req.header("content-encoding");
    if (ce && lower(trim(*ce)) != "identity") return 415;
    const std::string* expect = req.header("expect");
    if (expect) {
      if (lower(trim(*expect)) != "100-continue") return 417;
      expect_continue = req.version == "HTTP/1.1";
    }
    int cl_count = 0;
    for (const auto& [k, v] : req.headers) cl_count += k == "content-length";
    if (te) {
      // Both framings at once is how requests are smuggled past proxies: refused (RFC 9112 6.3).
      if (cl_count > 0) return 400;
      if (lower(trim(*te)) != "chunked") return 501;
      phase = kChunkSize;
      return 0;
    }
    if (cl_count > 1) return 400;
    if (const std::string* cl = req.header("content-length")) {
      if (cl->empty() || cl->size() > 15) return cl->size() > 15 && cl->find_first_not_of("0123456789") == std::string::npos ? 413 : 400;
      size_t n = 0;
      for (char c : *cl) {
        if (c < '0' || c > '9') return 400;
        n = n * 10 + static_cast<size_t>(c - '0');
      }
      if (n > l.max_body_bytes) return 413;
      remaining = n;
      req.body.reserve(n);
      phase = kLength;
      return 0;
    }
    remaining = 0;
    phase = kLength;
    return 0;
  }
};

}  // namespace torchspeed::serve::http::detail
