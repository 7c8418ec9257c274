#include "torchspeed/inference/text_stream.h"

#include <algorithm>
#include <cstdio>

namespace torchspeed::inference {
namespace {
// Length of the well-formed sequence starting at s[i] (RFC 3629 ranges), 0 if none, or -k when
// s ends after k bytes of a sequence that is well formed so far.
int sequence_at(const std::string& s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k < len; ++k) {
    if (i + static_cast<size_t>(k) >= n) return -k;
    const unsigned char x = b(i + static_cast<size_t>(k));
    if (x < (k == 1 ? lo : 0x80) || x > (k == 1 ? hi : 0xBF)) return 0;
  }
  return len;
}
}  // namespace

std::string sanitize_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const int len = sequence_at(s, i, s.size());
    if (len > 0) {
      out.append(s, i, static_cast<size_t>(len));
      i += static_cast<size_t>(len);
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

size_t complete_utf8_prefix(const std::string& s, size_t n) {
  for (size_t i = 0; i < n;) {
    const int len = sequence_at(s, i, n);
    if (len < 0) return i;
    i += len > 0 ? static_cast<size_t>(len) : 1;
  }
  return n;
}

std::string token_text(const std::string& b) {
  if (!b.empty() && complete_utf8_prefix(b, b.size()) == b.size() && sanitize_utf8(b) == b) return b;
  std::string out = "bytes:";
  for (unsigned char c : b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
    out += buf;
  }
  return out;
}

bool TextStream::append(const std::string& bytes, bool stops) {
  if (stopped_) return true;
  const size_t before = gen_.size();
  gen_ += bytes;
  if (!stops) return false;
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) {
    if (s.empty()) continue;
    const size_t from = before >= s.size() ? before - s.size() + 1 : 0;
    const size_t at = gen_.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    gen_.resize(cut);
    stopped_ = true;
  }
  return stopped_;
}

std::string TextStream::take(bool final) {
  size_t end = gen_.size();
  if (!final) {
    // Hold back the longest tail that is a proper prefix of a stop string.
    size_t hold = 0;
    for (const std::string& s : stops_) {
      for (size_t k = std::min(s.size() - (s.empty() ? 0 : 1), gen_.size()); k > hold; --k) {
        if (gen_.compare(gen_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
      }
    }
    end = complete_utf8_prefix(gen_, gen_.size() - hold);
  }
  if (end <= sent_) return {};
  std::string out = sanitize_utf8(gen_.substr(sent_, end - sent_));
  sent_ = end;
  return out;
}

}  // namespace torchspeed::inference
