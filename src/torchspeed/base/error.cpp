// Out-of-line part of the error helpers.
#include "torchspeed/base/error.h"

namespace torchspeed {

void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(concat("torchspeed internal error at ", file, ":", line, ": ", cond,
                          msg.empty() ? "" : " - ", msg,
                          " (this is a bug in torchspeed; please report it)"));
}

}  // namespace torchspeed
