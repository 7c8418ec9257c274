// Reading a whole file, with an error naming it.
#pragma once

#include <string>

namespace torchspeed {

// The file's bytes; a file that cannot be opened is an error naming it.
std::string read_file(const std::string& path);

}  // namespace torchspeed
