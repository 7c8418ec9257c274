// Errors of torchspeed: one exception hierarchy and the two check macros.
// TS_CHECK is for what users control (config, data, arguments): the message says what was
// expected, what was found and how to fix it. TS_INTERNAL_ASSERT guards our own invariants.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace torchspeed {

// A user-facing error: bad config, bad data, bad arguments.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A broken invariant inside torchspeed: a bug to report.
class InternalError : public Error {
 public:
  using Error::Error;
};

// A failed or timed-out communication. The message names the op, group, rank and bytes.
class CommError : public Error {
 public:
  using Error::Error;
};

namespace detail {
inline void str_append(std::ostringstream&) {}
template <typename T, typename... Rest>
void str_append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  str_append(os, rest...);
}
}  // namespace detail

// Concatenates any streamable values into a string.
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  detail::str_append(os, args...);
  return os.str();
}

[[noreturn]] void throw_internal(const char* file, int line, const char* cond, const std::string& msg);

}  // namespace torchspeed

#define TS_CHECK(cond, ...)                                  \
  do {                                                       \
    if (!(cond)) {                                           \
      throw ::torchspeed::Error(::torchspeed::concat(__VA_ARGS__)); \
    }                                                        \
  } while (0)

#define TS_INTERNAL_ASSERT(cond, ...)                                                  \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      ::torchspeed::throw_internal(__FILE__, __LINE__, #cond, ::torchspeed::concat(__VA_ARGS__)); \
    }                                                                                  \
  } while (0)
