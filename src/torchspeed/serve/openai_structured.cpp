// Structured output's request fields: OpenAI's response_format and vLLM's structured_outputs
// (inference/structured.h holds the text to what they ask).
#include <nlohmann/json.hpp>

#include "torchspeed/serve/openai_fields.h"
#include "torchspeed/serve/openai_protocol.h"

namespace torchspeed::serve {

using nlohmann::json;

nlohmann::ordered_json ordered_at(const json& b, const std::vector<std::string>& where, const std::string* raw) {
  auto step = [](auto* at, const std::string& k) -> decltype(at) {
    if (at->is_object()) return at->contains(k) ? &at->at(k) : nullptr;
    if (at->is_array() && !k.empty() && k.find_first_not_of("0123456789") == std::string::npos && std::stoull(k) < at->size()) {
      return &at->at(std::stoull(k));
    }
    return nullptr;
  };
  if (raw) {
    const nlohmann::ordered_json o = nlohmann::ordered_json::parse(*raw, nullptr, /*allow_exceptions=*/false);
    const nlohmann::ordered_json* at = &o;
    for (const auto& k : where) {
      if (!at || !(at = step(at, k))) break;
    }
    if (at) return *at;
  }
  const json* at = &b;
  for (const auto& k : where) {
    at = step(at, k);
    if (!at) throw ApiError(400, "the request body changed shape", k);
  }
  return nlohmann::ordered_json::parse(at->dump());
}

namespace {
using detail::bad;
using detail::present;

inference::GrammarPtr schema_grammar(const nlohmann::ordered_json& schema, const std::string& field) {
  try {
    return inference::Grammar::json_schema(schema);
  } catch (const inference::GrammarError& e) {
    bad(e.path.empty() ? field : field + "." + e.path, e.what());
  }
}

// Structured output: OpenAI's response_format (text, json_object, json_schema) and vLLM's
// structured_outputs (json, json_object, choice): one grammar the text is held to.
}  // namespace

void detail::parse_structured(const json& b, CompletionRequest& r, const std::string* raw) {
  auto& p = r.params;
  if (present(b, "response_format")) {
    const json& rf = b.at("response_format");
    if (!rf.is_object() || !rf.contains("type") || !rf.at("type").is_string()) {
      bad("response_format", "expected {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}");
    }
    const std::string type = rf.at("type").get<std::string>();
    for (const auto& [k, v] : rf.items()) {
      if (k != "type" && !(type == "json_schema" && k == "json_schema")) bad("response_format." + k, "not expected with type " + type);
    }
    if (type == "json_object") {
      p.grammar = inference::Grammar::json_object();
    } else if (type == "json_schema") {
      if (!rf.contains("json_schema") || !rf.at("json_schema").is_object()) bad("response_format.json_schema", "required: {name, schema, strict}");
      const json& js = rf.at("json_schema");
      for (const auto& [k, v] : js.items()) {
        if (k != "name" && k != "description" && k != "schema" && k != "strict") bad("response_format.json_schema." + k, "unrecognized");
      }
      if (js.contains("name") && !js.at("name").is_string()) bad("response_format.json_schema.name", "expected a string");
      if (js.contains("strict") && !js.at("strict").is_boolean() && !js.at("strict").is_null()) {
        bad("response_format.json_schema.strict", "expected true or false");
      }
      if (!js.contains("schema")) bad("response_format.json_schema.schema", "required");
      p.grammar = schema_grammar(ordered_at(b, {"response_format", "json_schema", "schema"}, raw),
                                 "response_format.json_schema.schema");
    } else if (type != "text") {
      bad("response_format.type", "\"" + type + "\" is not one of text, json_object, json_schema");
    }
  }
  if (present(b, "structured_outputs")) {
    if (p.grammar) bad("structured_outputs", "give response_format or structured_outputs, not both");
    const json& so = b.at("structured_outputs");
    if (!so.is_object()) bad("structured_outputs", "expected an object");
    int given = 0;
    for (const auto& [k, v] : so.items()) {
      const std::string f = "structured_outputs." + k;
      if (v.is_null()) continue;
      if (k == "json") {
        ++given;
        if (v.is_string()) {
          const auto schema = nlohmann::ordered_json::parse(v.get<std::string>(), nullptr, false);
          if (schema.is_discarded()) bad(f, "a string here must hold a JSON schema");
          p.grammar = schema_grammar(schema, f);
        } else {
          p.grammar = schema_grammar(ordered_at(b, {"structured_outputs", "json"}, raw), f);
        }
      } else if (k == "json_object") {
        if (!v.is_boolean()) bad(f, "expected true or false");
        if (v.get<bool>()) ++given, p.grammar = inference::Grammar::json_object();
      } else if (k == "choice") {
        ++given;
        if (!v.is_array() || v.empty()) bad(f, "expected a non-empty list of strings");
        std::vector<std::string> options;
        for (const json& o : v) {
          if (!o.is_string() || o.get<std::string>().empty()) bad(f, "expected non-empty strings");
          options.push_back(o.get<std::string>());
        }
        p.grammar = inference::Grammar::choice(options);
      } else if (k == "regex") {
        ++given;
        if (!v.is_string() || v.get<std::string>().empty()) bad(f, "expected a non-empty pattern");
        try {
          p.grammar = inference::Grammar::regex(v.get<std::string>());
        } catch (const inference::GrammarError& e) {
          bad(f, e.what());
        }
      } else {
        bad(f, "not supported (json, json_object, choice and regex are)");
      }
    }
    if (given != 1) bad("structured_outputs", "give exactly one of json, json_object, choice, regex");
  }
}


}  // namespace torchspeed::serve
