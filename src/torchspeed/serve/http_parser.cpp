#include "torchspeed/serve/http_parser.h"

#include <vector>

namespace torchspeed::serve::http {

namespace detail {
const char* reason(int s) {
  switch (s) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
  }
}
}  // namespace detail

using detail::kCompactAfter;
using detail::Parser;

const std::string* Request::header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k == name) return &v;
  }
  return nullptr;
}

int parse_request(std::string_view in, const Limits& limits, Request& out, size_t& used) {
  Parser p;
  const int s = p.run(in, limits);
  used = p.pos;
  if (s == 1) out = std::move(p.req);
  return s;
}

int parse_request_in_pieces(const std::vector<std::string_view>& pieces, const Limits& limits, Request& out, size_t& used) {
  Parser p;
  std::string buf;
  size_t dropped = 0;
  int s = 0;
  for (std::string_view piece : pieces) {
    buf.append(piece);
    s = p.run(buf, limits);
    if (s != 0) break;
    // As the loop does: consumed body bytes leave the buffer.
    if (p.phase != Parser::kHead && p.pos > kCompactAfter) {
      buf.erase(0, p.pos);
      dropped += p.pos;
      p.pos = 0;
    }
  }
  used = dropped + p.pos;
  if (s == 1) out = std::move(p.req);
  return s;
}

}  // namespace torchspeed::serve::http
