// Helpers the OpenAI protocol's files share (internal to serve/).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "torchspeed/serve/openai_protocol.h"

namespace torchspeed::serve::detail {

// A 400 naming `field` (OpenAI's `param`).
[[noreturn]] void bad(const std::string& field, const std::string& what);
// The field is there and not null.
bool present(const nlohmann::json& body, const char* key);
// response_format / structured_outputs into r.params.grammar (openai_structured.cpp).
void parse_structured(const nlohmann::json& body, CompletionRequest& r, const std::string* raw);

}  // namespace torchspeed::serve::detail
