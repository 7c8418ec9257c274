// libFuzzer target: the HTTP request parser of serve/http.h, which reads bytes from any client
// before authentication. The bytes are a request (or many); they are parsed whole and again cut
// into pieces at points the input chooses (as they arrive from a socket), with small limits so
// that every limit is reached. Properties: both parses agree (status, bytes used, the request),
// nothing is read past the input, and an accepted request keeps every limit.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "torchspeed/serve/http.h"

namespace http = torchspeed::serve::http;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  http::Limits l;
  l.max_request_line = 64 + data[0] % 64;
  l.max_header_bytes = 256 + data[1] * 4;
  l.max_headers = 8;
  l.max_body_bytes = 300;
  const std::string_view in(reinterpret_cast<const char*>(data) + 2, size - 2);
  http::Request whole, cut;
  size_t used_whole = 0, used_cut = 0;
  const int s = http::parse_request(in, l, whole, used_whole);
  // Cut points from the input's own bytes: every 7th byte's value is the next piece's length.
  std::vector<std::string_view> pieces;
  size_t at = 0, i = 0;
  while (at < in.size()) {
    const size_t n = std::min<size_t>(in.size() - at, 1 + static_cast<unsigned char>(in[i % in.size()]) % 17);
    pieces.push_back(in.substr(at, n));
    at += n;
    i += 7;
  }
  const int s2 = http::parse_request_in_pieces(pieces, l, cut, used_cut);
  if (s != s2) fuzz::bug("fuzz_http", "whole: " + std::to_string(s) + ", in pieces: " + std::to_string(s2));
  if (used_whole > in.size()) fuzz::bug("fuzz_http", "used more bytes than given");
  if (s == 1) {
    if (used_whole != used_cut) fuzz::bug("fuzz_http", "whole and in pieces used different byte counts");
    if (whole.method != cut.method || whole.target != cut.target || whole.body != cut.body || whole.headers != cut.headers)
      fuzz::bug("fuzz_http", "whole and in pieces parsed different requests");
    if (whole.body.size() > l.max_body_bytes) fuzz::bug("fuzz_http", "a body past the limit was accepted");
    if (whole.headers.size() > l.max_headers) fuzz::bug("fuzz_http", "more headers than the limit were accepted");
    if (whole.path.empty() || whole.path[0] != '/') fuzz::bug("fuzz_http", "a path not starting with / was accepted");
  } else if (s != 0 && s != 400 && s != 413 && s != 414 && s != 415 && s != 417 && s != 431 && s != 501 && s != 505) {
    fuzz::bug("fuzz_http", "unexpected status " + std::to_string(s));
  }
  return 0;
}
