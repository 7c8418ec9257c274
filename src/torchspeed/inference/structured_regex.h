// The regular-expression compiler behind Grammar::regex and JSON Schema's pattern (internal to
// inference/structured.cpp): a pattern becomes a byte DFA.
#pragma once

#include <string>

#include "torchspeed/inference/structured.h"

namespace torchspeed::inference::detail {

// pattern -> DFA. json_string: the text is a JSON string whose contents match the pattern
// (quotes around, no byte that would need escaping inside). Throws GrammarError.
Grammar::Dfa compile_regex(const std::string& pattern, bool json_string);

}  // namespace torchspeed::inference::detail
