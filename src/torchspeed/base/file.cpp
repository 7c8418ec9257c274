#include "torchspeed/base/file.h"

#include <fstream>
#include <sstream>

#include "torchspeed/base/error.h"

namespace torchspeed {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.good(), "cannot read '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace torchspeed
