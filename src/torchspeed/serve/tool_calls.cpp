#include "torchspeed/serve/tool_calls.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "torchspeed/serve/openai_fields.h"
#include "torchspeed/serve/openai_protocol.h"

namespace torchspeed::serve {

// Note [Tool calls]
// The tools reach the model through its chat template (`tools`, as transformers'
// apply_chat_template(tools=...) passes them), and the history may hold assistant messages with
// tool_calls and `tool` messages with results (chat_messages). What comes back depends on
// tool_choice, as in vLLM:
// - "auto" (the default with tools): the model decides. Its text is read with the parser the
//   server was started with (--tool-call-parser): hermes finds <tool_call>{"name": ...,
//   "arguments": {...}}</tool_call> blocks, the text before the first being the content;
//   llama3_json reads a text that is one or more {"name": ..., "parameters": {...}} objects
//   (separated by ';', after an optional <|python_tag|>). A call that does not parse leaves
//   the whole text as content. Streamed, hermes content goes out as it comes until <tool_call>
//   begins; the calls go out whole when the text ends (a named function's arguments stream
//   piece by piece: the text is nothing else).
// - "required": the text is held (structured output) to a JSON list of at least one
//   {"name": one of the tools, "parameters": that tool's parameters schema} (one at most without
//   parallel_tool_calls); finish_reason "tool_calls".
// - a named function: the text is held to that function's parameters schema and is its
//   arguments; finish_reason "stop", as OpenAI answers a forced call.
// - "none": no tools in the prompt, no calls.

namespace {
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

using detail::bad;

bool valid_name(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  for (char c : n) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

inference::GrammarPtr grammar_of(const ojson& schema, const std::string& field) {
  try {
    return inference::Grammar::json_schema(schema);
  } catch (const inference::GrammarError& e) {
    bad(e.path.empty() ? field : field + "." + e.path, e.what());
  }
}

// One call from {"name": ..., key: {...}}; false if it is not one.
bool call_of(const json& j, const char* key, const std::vector<std::string>& names, ToolCall* out) {
  if (!j.is_object() || !j.contains("name") || !j.at("name").is_string()) return false;
  const std::string name = j.at("name").get<std::string>();
  if (std::find(names.begin(), names.end(), name) == names.end()) return false;
  const json* args = j.contains(key) ? &j.at(key) : nullptr;
  if (!args && std::string(key) == "parameters" && j.contains("arguments")) args = &j.at("arguments");
  if (args && args->is_string()) {  // arguments already as JSON text
    const json parsed = json::parse(args->get<std::string>(), nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object()) return false;
    *out = {name, parsed.dump()};
    return true;
  }
  if (args && !args->is_object()) return false;
  *out = {name, args ? args->dump() : "{}"};
  return true;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

constexpr const char* kOpen = "<tool_call>";
constexpr const char* kClose = "</tool_call>";
}  // namespace

bool known_tool_parser(const std::string& name) { return name == "hermes" || name == "llama3_json"; }

ToolRequest parse_tools(const json& b, const std::string& parser, const std::string* raw, inference::GrammarPtr* grammar) {
  ToolRequest t;
  const bool has_tools = b.contains("tools") && !b.at("tools").is_null();
  if (has_tools) {
    const json& tools = b.at("tools");
    if (!tools.is_array() || tools.empty()) bad("tools", "expected a non-empty list of {\"type\": \"function\", \"function\": {...}}");
    if (tools.size() > 128) bad("tools", "at most 128 tools, got " + std::to_string(tools.size()));
    for (size_t i = 0; i < tools.size(); ++i) {
      const std::string f = "tools[" + std::to_string(i) + "]";
      const json& tool = tools[i];
      if (!tool.is_object()) bad(f, "expected {\"type\": \"function\", \"function\": {...}}");
      for (const auto& [k, v] : tool.items()) {
        if (k != "type" && k != "function") bad(f + "." + k, "unrecognized");
      }
      if (!tool.contains("type") || tool.at("type") != "function") bad(f + ".type", "only \"function\" tools exist");
      if (!tool.contains("function") || !tool.at("function").is_object()) bad(f + ".function", "required: {name, description, parameters}");
      const json& fn = tool.at("function");
      for (const auto& [k, v] : fn.items()) {
        if (k != "name" && k != "description" && k != "parameters" && k != "strict") bad(f + ".function." + k, "unrecognized");
      }
      if (!fn.contains("name") || !fn.at("name").is_string() || !valid_name(fn.at("name").get<std::string>())) {
        bad(f + ".function.name", "required: 1 to 64 letters, digits, '_' or '-'");
      }
      if (fn.contains("description") && !fn.at("description").is_string()) bad(f + ".function.description", "expected a string");
      if (fn.contains("parameters") && !fn.at("parameters").is_object()) bad(f + ".function.parameters", "expected a JSON schema object");
      if (fn.contains("strict") && !fn.at("strict").is_boolean() && !fn.at("strict").is_null()) bad(f + ".function.strict", "expected true or false");
      const std::string name = fn.at("name").get<std::string>();
      if (std::find(t.names.begin(), t.names.end(), name) != t.names.end()) bad(f + ".function.name", "\"" + name + "\" is given twice");
      t.names.push_back(name);
    }
  }
  if (b.contains("parallel_tool_calls") && !b.at("parallel_tool_calls").is_null()) {
    if (!b.at("parallel_tool_calls").is_boolean()) bad("parallel_tool_calls", "expected true or false");
    t.parallel = b.at("parallel_tool_calls").get<bool>();
  }
  t.choice = has_tools ? ToolChoice::kAuto : ToolChoice::kNone;
  if (b.contains("tool_choice") && !b.at("tool_choice").is_null()) {
    const json& c = b.at("tool_choice");
    if (c == "none") {
      t.choice = ToolChoice::kNone;
    } else if (c == "auto" || c == "required") {
      if (!has_tools) bad("tool_choice", c.get<std::string>() + " needs tools");
      t.choice = c == "auto" ? ToolChoice::kAuto : ToolChoice::kRequired;
    } else if (c.is_object()) {
      if (!c.contains("type") || c.at("type") != "function" || !c.contains("function") || !c.at("function").is_object() ||
          !c.at("function").contains("name") || !c.at("function").at("name").is_string()) {
        bad("tool_choice", "expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
      }
      t.named = c.at("function").at("name").get<std::string>();
      if (std::find(t.names.begin(), t.names.end(), t.named) == t.names.end()) {
        bad("tool_choice.function.name", "\"" + t.named + "\" is not among the tools");
      }
      t.choice = ToolChoice::kNamed;
    } else {
      bad("tool_choice", "expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
  }
  if (t.choice == ToolChoice::kNone) return t;
  t.for_template = b.at("tools");
  if (t.choice == ToolChoice::kAuto) {
    if (parser.empty()) {
      bad("tool_choice", "\"auto\" tool choice needs the server started with --tool-call-parser (" + std::string(kToolParsers) +
                             "); \"required\" and a named function work without it");
    }
    t.parser = parser;
    return t;
  }
  // required / named: the calls' JSON, by structured output.
  auto params = [&](size_t i) {
    const std::vector<std::string> where{"tools", std::to_string(i), "function", "parameters"};
    const json& fn = b.at("tools")[i].at("function");
    return fn.contains("parameters") ? ordered_at(b, where, raw) : ojson{{"type", "object"}, {"properties", ojson::object()}};
  };
  const size_t n = t.names.size();
  if (t.choice == ToolChoice::kNamed) {
    const size_t i = static_cast<size_t>(std::find(t.names.begin(), t.names.end(), t.named) - t.names.begin());
    *grammar = grammar_of(params(i), "tools[" + std::to_string(i) + "].function.parameters");
    return t;
  }
  ojson anyof = ojson::array();
  for (size_t i = 0; i < n; ++i) {
    // Each tool's schema compiled alone first, so an error names the tool's own path.
    (void)grammar_of(params(i), "tools[" + std::to_string(i) + "].function.parameters");
    anyof.push_back({{"type", "object"},
                     {"properties", {{"name", {{"const", t.names[i]}}}, {"parameters", params(i)}}},
                     {"required", {"name", "parameters"}}});
  }
  ojson list = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", anyof}}}};
  if (!t.parallel) list["maxItems"] = 1;
  *grammar = grammar_of(list, "tools");
  return t;
}

ToolOutput parse_tool_output(const ToolRequest& t, const std::string& text) {
  ToolOutput out;
  out.content = text;
  if (t.choice == ToolChoice::kNamed) {
    const json args = json::parse(text, nullptr, false);
    if (args.is_discarded()) return out;  // cut short (length): the text stays content
    out.content.clear();
    out.calls.push_back({t.named, args.dump()});
    return out;
  }
  if (t.choice == ToolChoice::kRequired) {
    const json list = json::parse(text, nullptr, false);
    if (list.is_discarded() || !list.is_array()) return out;
    std::vector<ToolCall> calls;
    for (const json& x : list) {
      ToolCall c;
      if (!call_of(x, "parameters", t.names, &c)) return out;
      calls.push_back(std::move(c));
    }
    out.content.clear();
    out.calls = std::move(calls);
    return out;
  }
  if (t.choice != ToolChoice::kAuto) return out;
  std::vector<ToolCall> calls;
  if (t.parser == "hermes") {
    const size_t first = text.find(kOpen);
    if (first == std::string::npos) return out;
    size_t at = first;
    while (at != std::string::npos) {
      const size_t body = at + std::strlen(kOpen);
      const size_t end = text.find(kClose, body);
      const json j = json::parse(trim(text.substr(body, end == std::string::npos ? std::string::npos : end - body)), nullptr, false);
      ToolCall c;
      if (j.is_discarded() || !call_of(j, "arguments", t.names, &c)) return out;
      calls.push_back(std::move(c));
      if (end == std::string::npos) break;
      at = text.find(kOpen, end + std::strlen(kClose));
    }
    out.content = trim(text.substr(0, first));
  } else if (t.parser == "llama3_json") {
    std::string s = trim(text);
    if (s.rfind("<|python_tag|>", 0) == 0) s = trim(s.substr(14));
    if (s.empty() || s[0] != '{') return out;
    // One object, or several separated by ';'.
    size_t at = 0;
    while (at < s.size()) {
      size_t end = s.find(';', at);
      json j = json::parse(trim(s.substr(at, end == std::string::npos ? std::string::npos : end - at)), nullptr, false);
      if (j.is_discarded() && end != std::string::npos) {  // a ';' inside a string: the rest at once
        j = json::parse(trim(s.substr(at)), nullptr, false);
        end = std::string::npos;
      }
      ToolCall c;
      if (j.is_discarded() || !call_of(j, "parameters", t.names, &c)) return out;
      calls.push_back(std::move(c));
      if (end == std::string::npos) break;
      at = end + 1;
    }
    out.content.clear();
  }
  if (!t.parallel && calls.size() > 1) calls.resize(1);
  out.calls = std::move(calls);
  return out;
}

size_t tool_content_prefix(const ToolRequest& t, const std::string& text) {
  if (t.choice != ToolChoice::kAuto || t.parser != "hermes") return 0;
  const size_t open = text.find(kOpen);
  if (open != std::string::npos) return open;
  // Hold back a tail that could be the start of <tool_call>.
  const std::string o = kOpen;
  for (size_t k = std::min(o.size() - 1, text.size()); k > 0; --k) {
    if (text.compare(text.size() - k, k, o, 0, k) == 0) return text.size() - k;
  }
  return text.size();
}

json tool_calls_json(const std::vector<ToolCall>& calls, const std::string& id_prefix, bool with_index) {
  json out = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    json c = {{"id", id_prefix + std::to_string(k)}, {"type", "function"},
              {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}};
    if (with_index) c["index"] = k;
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace torchspeed::serve
