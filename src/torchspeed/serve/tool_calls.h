// Tool calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`, checked field by
// field; the model's tool calls read back from its text in the format its family writes
// (vLLM's tool-call parsers `hermes`: <tool_call>{"name", "arguments"}</tool_call>, as Qwen and
// Hermes models write them; `llama3_json`: {"name", "parameters"}, as Llama 3.1 writes them),
// and, for tool_choice "required" or a named function, the text held to the calls' JSON by
// structured output, as vLLM does (Note [Tool calls] in tool_calls.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "torchspeed/inference/structured.h"

namespace torchspeed::serve {

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

struct ToolRequest {
  ToolChoice choice = ToolChoice::kNone;
  std::string named;              // kNamed: the function
  std::string parser;             // kAuto: "hermes" or "llama3_json"
  bool parallel = true;           // parallel_tool_calls
  std::vector<std::string> names;  // the tools' function names, in order
  nlohmann::json for_template;    // the tools as the chat template reads them (HF's `tools`)
  bool active() const { return choice != ToolChoice::kNone; }
};

struct ToolCall {
  std::string name, arguments;  // arguments: JSON text
};

struct ToolOutput {
  std::string content;  // text outside the calls
  std::vector<ToolCall> calls;
};

inline constexpr const char* kToolParsers = "hermes, llama3_json";
bool known_tool_parser(const std::string& name);

// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request (`raw`: the body's text, for
// the parameters' property order). For "required" and a named function, the grammar the text is
// held to (else null). Throws ApiError naming the field.
ToolRequest parse_tools(const nlohmann::json& body, const std::string& parser, const std::string* raw,
                        inference::GrammarPtr* grammar);
// The calls in a finished text (none: all of it is content).
ToolOutput parse_tool_output(const ToolRequest& t, const std::string& text);
// How much of a text still being generated is surely content, never part of a call: streamed
// as it comes (hermes: what precedes <tool_call>, less a tail that could begin it; otherwise 0).
size_t tool_content_prefix(const ToolRequest& t, const std::string& text);
// A message's tool_calls as OpenAI writes them (ids from `id_prefix`).
nlohmann::json tool_calls_json(const std::vector<ToolCall>& calls, const std::string& id_prefix, bool with_index);

}  // namespace torchspeed::serve
