// serve/openai_protocol.h under hostile requests: nesting that would overflow the stack, numbers
// past a double, fields of the wrong type deep inside, error messages that must not echo a
// megabyte, the per-request token budget, and streamed text_offset across chunks. Every
// refusal is a 400 naming its field, never a crash or a 500. CI runs it again under
// AddressSanitizer and UndefinedBehaviorSanitizer (fuzz/CMakeLists.txt).
#include <gtest/gtest.h>

#include <string>

#include "torchspeed/serve/openai_protocol.h"

using namespace torchspeed::serve;
using nlohmann::json;

namespace {

ProtocolLimits limits() {
  ProtocolLimits l;
  l.model_name = "m";
  l.context_length = 128;
  l.vocab = 256;
  return l;
}

// The ApiError a call throws (status 0 when none).
template <typename F>
ApiError error_of(F&& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "no error");
}

TEST(OpenAIProtocol, NestingPastTheLimitIsRefusedNotRecursed) {
  // ~500k levels in 1 MiB: recursion in dump() or a copy would overflow the stack.
  const std::string deep = "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": " + std::string(500000, '[') +
                           std::string(500000, ']') + "}]}";
  ApiError e = error_of([&] { parse_body(deep); });
  EXPECT_EQ(e.status, 400);
  EXPECT_NE(std::string(e.what()).find("nests deeper than 64"), std::string::npos);
  std::string ok = "{\"a\": " + std::string(kMaxJsonDepth - 1, '[') + std::string(kMaxJsonDepth - 1, ']') + "}";
  EXPECT_NO_THROW(parse_body(ok));
  std::string over = "{\"a\": " + std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']') + "}";
  EXPECT_EQ(error_of([&] { parse_body(over); }).status, 400);
}

TEST(OpenAIProtocol, BadBodiesAre400WithBoundedMessages) {
  EXPECT_EQ(error_of([] { parse_body("{\"temperature\": 1e400}"); }).status, 400);  // out_of_range, was 500
  EXPECT_EQ(error_of([] { parse_body(""); }).status, 400);
  EXPECT_EQ(error_of([] { parse_body("[1]"); }).status, 400);
  const std::string junk = "{\"a\": \"" + std::string(1 << 20, 'x') + "\x01\"}";
  ApiError e = error_of([&] { parse_body(junk); });
  EXPECT_EQ(e.status, 400);
  EXPECT_LT(std::string(e.what()).size(), 400u);
  // A field's bad value is shown cut short.
  json b = {{"model", "m"}, {"prompt", "hi"}, {"stop", json::array({std::string(1 << 20, 'y'), 3})}};
  b["stop"][0] = 3;
  e = error_of([&] { parse_completion(b, limits()); });
  EXPECT_EQ(e.status, 400);
  json big = {{"model", "m"}, {"prompt", "hi"}, {"temperature", std::string(1 << 20, 'z')}};
  e = error_of([&] { parse_completion(big, limits()); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "temperature");
  EXPECT_LT(std::string(e.what()).size(), 200u);
  json nested = {{"model", "m"}, {"prompt", json::array({json::array({json::object({{"a", json::array({1, 2})}})})})}};
  e = error_of([&] { parse_completion(nested, limits()); });
  EXPECT_EQ(e.status, 400);
}

TEST(OpenAIProtocol, WrongTypesDeepInsideAre400) {
  json chat = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", json::array({{{"type", 5}, {"text", "x"}}})}}})}};
  ApiError e = error_of([&] { parse_chat(chat, limits()); });
  EXPECT_EQ(e.status, 400);  // value("type", "") threw type_error: 500
  EXPECT_EQ(e.param, "messages[0].content[0]");
  json rf = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}, {"response_format", {{"type", 1}}}};
  EXPECT_EQ(error_of([&] { parse_chat(rf, limits()); }).status, 400);
  json role = {{"model", "m"}, {"messages", json::array({{{"role", json::array()}, {"content", "hi"}}})}};
  EXPECT_EQ(error_of([&] { parse_chat(role, limits()); }).status, 400);
  json ok = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "x"}}})}}})}};
  EXPECT_NO_THROW(parse_chat(ok, limits()));
}

TEST(OpenAIProtocol, RequestTokenBudgetIsCheckedBeforeWork) {
  ProtocolLimits l = limits();
  l.max_request_tokens = 100;
  json b = {{"model", "m"}, {"prompt", "0123456789"}, {"max_tokens", 20}, {"n", 4}};
  ApiError e = error_of([&] { parse_completion(b, l); });
  EXPECT_EQ(e.status, 400);  // 4 x (10 + 20) = 120 > 100
  EXPECT_EQ(e.param, "max_tokens");
  b["n"] = 3;  // 90
  EXPECT_NO_THROW(parse_completion(b, l));
}

TEST(OpenAIProtocol, ModelNamesTheBaseOrALoraAdapter) {
  ProtocolLimits l = limits();
  l.adapters = {"sql", "chat"};
  CompletionRequest r = parse_completion({{"model", "m"}, {"prompt", "a"}}, l);
  EXPECT_EQ(r.adapter, 0);
  r = parse_completion({{"model", "chat"}, {"prompt", "a"}}, l);
  EXPECT_EQ(r.adapter, 2);
  EXPECT_EQ(r.model, "chat");
  r = parse_chat({{"model", "sql"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}}, l);
  EXPECT_EQ(r.adapter, 1);
  // The answer names the model the request named.
  EXPECT_EQ(completion_response("id", 0, l, r, {ChoiceResult{}})["model"], "sql");
  ApiError e = error_of([&] { parse_completion({{"model", "other"}, {"prompt", "a"}}, l); });
  EXPECT_EQ(e.status, 404);
  EXPECT_EQ(e.param, "model");
  EXPECT_NE(std::string(e.what()).find("\"m\", \"sql\", \"chat\""), std::string::npos) << e.what();
  e = error_of([&] { parse_embeddings({{"model", "sql"}, {"input", "a"}}, l); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "model");
}

TEST(OpenAIProtocol, ATextThatCannotFitIsRefusedBeforeTokenizing) {
  ProtocolLimits l = limits();  // bytes: one byte per token at most
  ApiError e = error_of([&] { parse_completion({{"model", "m"}, {"prompt", std::string(1 << 20, 'a')}}, l); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_NE(std::string(e.what()).find("1048576 bytes are at least 1048576 tokens"), std::string::npos) << e.what();
  e = error_of([&] { parse_chat({{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", std::string(1000, 'b')}}})}}, l); });
  EXPECT_EQ(e.code, "context_length_exceeded");
}

TEST(OpenAIProtocol, StreamedTextOffsetsContinueAcrossChunks) {
  ProtocolLimits l = limits();
  CompletionRequest r = parse_completion({{"model", "m"}, {"prompt", "ab"}, {"logprobs", 0}, {"echo", true}, {"stream", true}}, l);
  auto tok = [](int64_t id) {
    torchspeed::inference::GeneratedToken g;
    g.id = id;
    return g;
  };
  int64_t off = 0;
  json c1 = stream_chunk("id", 0, l, r, 0, "xy", {tok('x'), tok('y')}, "", true, &off);
  json c2 = stream_chunk("id", 0, l, r, 0, "z", {tok('z')}, "length", false, &off);
  EXPECT_EQ(c1["choices"][0]["text"], "abxy");
  EXPECT_EQ(c1["choices"][0]["logprobs"]["text_offset"], json::array({2, 3}));
  EXPECT_EQ(c2["choices"][0]["logprobs"]["text_offset"], json::array({4}));
  EXPECT_EQ(off, 5);
}

}  // namespace

namespace {
json weather_tools() {
  return json::array({{{"type", "function"},
                       {"function", {{"name", "get_weather"},
                                     {"parameters", {{"type", "object"},
                                                     {"properties", {{"city", {{"type", "string"}}}}},
                                                     {"required", {"city"}}}}}}},
                      {{"type", "function"}, {"function", {{"name", "add"}}}}});
}
json chat_with(json extra) {
  json b = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}, {"tools", weather_tools()}};
  for (auto& [k, v] : extra.items()) b[k] = v;
  return b;
}
}  // namespace

// Note [Tool calls]: tool_choice picks how calls come back; each mode's text read as vLLM's
// parsers read it.
TEST(ToolCalls, ChoicesParsersAndErrors) {
  auto wide = [] {
    ProtocolLimits w = limits();
    w.context_length = 4096;  // the tools' description is longer than the default 128 bytes
    return w;
  };
  ProtocolLimits l = wide();
  // auto needs a parser; required and named do not, and hold the text to a grammar.
  ApiError e = error_of([&] { parse_chat(chat_with({}), l); });
  EXPECT_EQ(e.param, "tool_choice");
  l.tool_parser = "hermes";
  CompletionRequest r = parse_chat(chat_with({}), l);
  EXPECT_EQ(r.tools.choice, ToolChoice::kAuto);
  EXPECT_FALSE(r.params.grammar);
  EXPECT_NE(r.prompt_texts[0].find("<tools>"), std::string::npos) << "tools described to a template that does not read them";
  r = parse_chat(chat_with({{"tool_choice", "required"}}), wide());
  EXPECT_TRUE(r.params.grammar);
  r = parse_chat(chat_with({{"tool_choice", {{"type", "function"}, {"function", {{"name", "add"}}}}}}), wide());
  EXPECT_EQ(r.tools.choice, ToolChoice::kNamed);
  r = parse_chat(chat_with({{"tool_choice", "none"}}), wide());
  EXPECT_FALSE(r.tools.active());
  EXPECT_EQ(r.prompt_texts[0].find("<tools>"), std::string::npos);

  EXPECT_EQ(error_of([&] { parse_chat(chat_with({{"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}), l); }).param,
            "tool_choice.function.name");
  json bad_tool = chat_with({});
  bad_tool["tools"][0]["function"]["name"] = "has space";
  EXPECT_EQ(error_of([&] { parse_chat(bad_tool, l); }).param, "tools[0].function.name");
  json pattern = chat_with({{"tool_choice", "required"}});
  pattern["tools"][0]["function"]["parameters"]["properties"]["city"]["pattern"] = "(?=a)";
  EXPECT_EQ(error_of([&] { parse_chat(pattern, l); }).param, "tools[0].function.parameters.properties.city.pattern");
  EXPECT_EQ(error_of([&] { parse_chat(chat_with({{"tool_choice", "required"}, {"response_format", {{"type", "json_object"}}}}), l); }).param,
            "response_format");

  // The history: assistant tool calls (arguments as JSON text) and tool results.
  json hist = chat_with({{"tool_choice", "none"}});
  hist["messages"].push_back({{"role", "assistant"}, {"content", nullptr},
                              {"tool_calls", {{{"id", "c1"}, {"type", "function"}, {"function", {{"name", "add"}, {"arguments", "{\"a\":1}"}}}}}}});
  hist["messages"].push_back({{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "2"}});
  r = parse_chat(hist, l);
  EXPECT_NE(r.prompt_texts[0].find("<tool_call>\n{\"arguments\":{\"a\":1},\"name\":\"add\"}\n</tool_call>"), std::string::npos)
      << r.prompt_texts[0];
  EXPECT_NE(r.prompt_texts[0].find("<|tool|>\n2"), std::string::npos);
  hist["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json";
  EXPECT_EQ(error_of([&] { parse_chat(hist, l); }).param, "messages[1].tool_calls[0].function.arguments");

  // Reading the calls back.
  ToolRequest t;
  t.names = {"get_weather", "add"};
  t.choice = ToolChoice::kAuto;
  t.parser = "hermes";
  ToolOutput o = parse_tool_output(t, "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
                                      "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}</tool_call>");
  ASSERT_EQ(o.calls.size(), 2u);
  EXPECT_EQ(o.content, "Let me look.");
  EXPECT_EQ(o.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(o.calls[0].arguments), json({{"city", "Paris"}}));
  EXPECT_EQ(json::parse(o.calls[1].arguments), json({{"a", 1}, {"b", 2}}));
  EXPECT_TRUE(parse_tool_output(t, "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>").calls.empty());
  EXPECT_TRUE(parse_tool_output(t, "<tool_call>{broken</tool_call>").calls.empty());
  EXPECT_EQ(parse_tool_output(t, "no calls here").content, "no calls here");
  // Streamed content stops where <tool_call> begins, and holds back what could begin it.
  EXPECT_EQ(tool_content_prefix(t, "Sure <tool"), 5u);
  EXPECT_EQ(tool_content_prefix(t, "Sure <tool_call>{"), 5u);
  EXPECT_EQ(tool_content_prefix(t, "a < b"), 5u);
  t.parser = "llama3_json";
  o = parse_tool_output(t, "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b\"}}");
  ASSERT_EQ(o.calls.size(), 2u);
  EXPECT_EQ(json::parse(o.calls[1].arguments), json({{"city", "a;b"}}));
  EXPECT_EQ(tool_content_prefix(t, "{\"name\""), 0u);
  t.choice = ToolChoice::kRequired;
  o = parse_tool_output(t, "[{\"name\":\"add\",\"parameters\":{\"a\":3}}]");
  ASSERT_EQ(o.calls.size(), 1u);
  EXPECT_EQ(o.calls[0].arguments, "{\"a\":3}");
  t.choice = ToolChoice::kNamed;
  t.named = "get_weather";
  o = parse_tool_output(t, "{\"city\":\"Oslo\"}");
  ASSERT_EQ(o.calls.size(), 1u);
  EXPECT_EQ(o.calls[0].name, "get_weather");
}
