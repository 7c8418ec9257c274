#include "torchspeed/serve/openai_protocol.h"

#include <cstdio>
#include <cstring>
#include <set>

#include "torchspeed/serve/openai_fields.h"
#include "torchspeed/serve/tool_calls.h"

#include "torchspeed/data/text.h"
#include "torchspeed/inference/text_stream.h"

namespace torchspeed::serve {

using nlohmann::json;

json ApiError::to_json() const {
  return {{"error",
           {{"message", what()}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

namespace {
// A JSON library error's text, bounded: parse errors quote the token they stopped at, which is
// the client's bytes and may be a megabyte long.
std::string bounded(const std::string& s, size_t n = 200) { return s.size() <= n ? s : s.substr(0, n) + "..."; }
}  // namespace

json parse_body(const std::string& body) {
  if (body.empty()) throw ApiError(400, "the request body is empty; expected a JSON object");
  try {
    // nlohmann's parser is iterative, but dump(), copies and comparisons of a value recurse
    // once per level: a 1 MiB body of brackets is ~500k levels, past any thread's stack. No
    // OpenAI request nests deeper than a few levels.
    json j = json::parse(body, [](int depth, json::parse_event_t, json&) {
      if (depth >= kMaxJsonDepth) {  // depth counts from 0: the body object
        throw ApiError(400, "the request body nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
      }
      return true;
    });
    if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object");
    return j;
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number past a double (1e400).
    throw ApiError(400, "the request body is not valid JSON: " + bounded(e.what()));
  }
}

namespace detail {
void bad(const std::string& field, const std::string& what) { throw ApiError(400, field + ": " + what, field); }
bool present(const json& b, const char* k) { return b.contains(k) && !b.at(k).is_null(); }
}  // namespace detail

namespace {

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%g", v);
  return b;
}

using detail::bad;

// A value as an error message shows it: scalars as JSON (strings cut short), containers by kind.
std::string shown(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  if (v.is_string()) return json(bounded(v.get<std::string>(), 40)).dump(-1, ' ', false, json::error_handler_t::replace);
  return v.dump();
}

using detail::present;

int64_t get_int(const json& b, const char* k, int64_t def, int64_t lo, int64_t hi) {
  if (!present(b, k)) return def;
  const json& v = b.at(k);
  if (!v.is_number_integer()) bad(k, "expected an integer, got " + shown(v));
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) bad(k, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(x));
  return x;
}

double get_num(const json& b, const char* k, double def, double lo, double hi, bool open_lo = false) {
  if (!present(b, k)) return def;
  const json& v = b.at(k);
  if (!v.is_number()) bad(k, "expected a number, got " + shown(v));
  const double x = v.get<double>();
  if (x < lo || x > hi || (open_lo && x == lo)) {
    bad(k, std::string("must be in ") + (open_lo ? "(" : "[") + num(lo) + ", " + num(hi) + "], got " +
               shown(v));
  }
  return x;
}

bool get_bool(const json& b, const char* k, bool def) {
  if (!present(b, k)) return def;
  if (!b.at(k).is_boolean()) bad(k, "expected true or false, got " + shown(b.at(k)));
  return b.at(k).get<bool>();
}

// The adapter `model` names: 0 for the base model, i + 1 for LoRA adapter i; 404 for another name.
int32_t check_model(const json& b, const ProtocolLimits& l) {
  if (!present(b, "model")) bad("model", "required");
  if (!b.at("model").is_string()) bad("model", "expected a string");
  const std::string& m = b.at("model").get_ref<const std::string&>();
  if (m == l.model_name) return 0;
  for (size_t i = 0; i < l.adapters.size(); ++i) {
    if (m == l.adapters[i]) return static_cast<int32_t>(i + 1);
  }
  std::string served = "\"" + l.model_name + "\"";
  for (const std::string& a : l.adapters) served += ", \"" + a + "\"";
  throw ApiError(404, "model \"" + m + "\" does not exist; this server serves " + served, "model", "invalid_request_error",
                 "model_not_found");
}

// Fields neither OpenAI nor vLLM define, or that we do not implement, are refused as OpenAI
// refuses unknown ones: by name.
void check_fields(const json& b, const std::set<std::string>& known) {
  for (const auto& [k, v] : b.items()) {
    if (!known.count(k)) throw ApiError(400, "unrecognized request argument supplied: " + k, k);
  }
}

// A list of token ids in the vocabulary, at most `most` of them.
std::vector<int64_t> token_ids(const json& b, const char* k, int64_t vocab, size_t most) {
  std::vector<int64_t> out;
  if (!present(b, k)) return out;
  const json& v = b.at(k);
  if (!v.is_array()) bad(k, "expected a list of token ids");
  if (v.size() > most) bad(k, "at most " + std::to_string(most) + " token ids, got " + std::to_string(v.size()));
  for (const json& t : v) {
    if (!t.is_number_integer()) bad(k, "token ids must be integers, got " + shown(t));
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= vocab) bad(k, "token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    out.push_back(id);
  }
  return out;
}

// OpenAI's logit_bias: {"token id": bias in [-100, 100]}.
std::vector<std::pair<int64_t, float>> logit_bias(const json& b, int64_t vocab) {
  std::vector<std::pair<int64_t, float>> out;
  if (!present(b, "logit_bias")) return out;
  const json& v = b.at("logit_bias");
  if (!v.is_object()) bad("logit_bias", "expected an object mapping token ids to biases");
  for (const auto& [key, bias] : v.items()) {
    const std::string f = "logit_bias." + bounded(key, 40);
    int64_t id = -1;
    size_t used = 0;
    try {
      id = std::stoll(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != key.size()) bad(f, "a key must be a token id (an integer), got " + shown(json(key)));
    if (id < 0 || id >= vocab) bad(f, "token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    if (!bias.is_number()) bad(f, "expected a number, got " + shown(bias));
    const double x = bias.get<double>();
    if (!(x >= -100 && x <= 100)) bad(f, "must be in [-100, 100], got " + shown(bias));
    out.emplace_back(id, static_cast<float>(x));
  }
  return out;
}

void common_sampling(const json& b, const ProtocolLimits& l, CompletionRequest& r, const char* max_key) {
  auto& p = r.params;
  const int64_t cap = l.max_tokens > 0 ? std::min(l.max_tokens, l.context_length) : l.context_length;
  p.max_tokens = get_int(b, max_key, 16, 1, cap);
  p.temperature = get_num(b, "temperature", 1.0, 0.0, 2.0);
  p.top_p = get_num(b, "top_p", 1.0, 0.0, 1.0, /*open_lo=*/true);
  p.top_k = get_int(b, "top_k", 0, -1, 1 << 30);
  if (p.top_k < 0) p.top_k = 0;  // vLLM's -1: off
  // vLLM's extension: generate past the model's end-of-text and end-of-turn tokens (benchmark
  // clients send it to fix the output length); stop strings still end the text.
  p.ignore_eos = get_bool(b, "ignore_eos", false);
  if (present(b, "seed")) {
    if (!b.at("seed").is_number_integer()) bad("seed", "expected an integer");
    p.seed = static_cast<uint64_t>(b.at("seed").get<int64_t>());
  }
  if (present(b, "stop")) {
    const json& s = b.at("stop");
    if (s.is_string()) {
      p.stop = {s.get<std::string>()};
    } else if (s.is_array()) {
      if (s.size() > 4) bad("stop", "at most 4 stop sequences, got " + std::to_string(s.size()));
      for (const json& x : s) {
        if (!x.is_string()) bad("stop", "expected strings, got " + shown(x));
        p.stop.push_back(x.get<std::string>());
      }
    } else {
      bad("stop", "expected a string or a list of strings");
    }
    for (const auto& x : p.stop) {
      if (x.empty()) bad("stop", "a stop sequence must not be empty");
    }
  }
  // OpenAI's penalties, and the extensions vLLM and llama.cpp's server accept (Note [Logits
  // processing] in sampler.cpp says what each does).
  p.presence_penalty = get_num(b, "presence_penalty", 0.0, -2.0, 2.0);
  p.frequency_penalty = get_num(b, "frequency_penalty", 0.0, -2.0, 2.0);
  p.repetition_penalty = get_num(b, "repetition_penalty", 1.0, 0.0, 1e4, /*open_lo=*/true);
  p.min_p = get_num(b, "min_p", 0.0, 0.0, 1.0);
  p.logit_bias = logit_bias(b, l.vocab);
  p.min_tokens = get_int(b, "min_tokens", 0, 0, p.max_tokens);
  p.stop_token_ids = token_ids(b, "stop_token_ids", l.vocab, 1024);
  r.n = get_int(b, "n", 1, 1, l.max_n);
  r.best_of = r.n;
  r.stream = get_bool(b, "stream", false);
  if (present(b, "stream_options")) {
    const json& so = b.at("stream_options");
    if (!r.stream) bad("stream_options", "only allowed with stream: true");
    if (!so.is_object()) bad("stream_options", "expected an object");
    for (const auto& [k, v] : so.items()) {
      if (k != "include_usage") bad("stream_options." + k, "unrecognized");
    }
    if (so.contains("include_usage")) {
      if (!so.at("include_usage").is_boolean()) bad("stream_options.include_usage", "expected true or false");
      r.include_usage = so.at("include_usage").get<bool>();
    }
  }
  if (present(b, "user") && !b.at("user").is_string()) bad("user", "expected a string");
}

const data::Tokenizer& tokenizer_of(const ProtocolLimits& l) {
  static const data::ByteTokenizer bytes;
  return l.tokenizer ? *l.tokenizer : static_cast<const data::Tokenizer&>(bytes);
}
// A token's bytes; ids the tokenizer lacks (a model vocabulary padded past it) have none.
std::string bytes_of_token(const ProtocolLimits& l, int64_t id) {
  const auto& t = tokenizer_of(l);
  return id < t.vocab_size() ? t.token_bytes(id) : std::string();
}
// A text whose bytes could not fit the context even if every token were the longest one is
// refused before it is tokenized (encoding a megabyte costs more than refusing it).
void check_text_fits(const ProtocolLimits& l, const std::string& s, const std::string& field, int64_t max_tokens) {
  const int64_t longest = l.tokenizer ? l.max_token_bytes : 1;
  if (longest <= 0) return;
  const int64_t min_tokens = (static_cast<int64_t>(s.size()) + longest - 1) / longest;
  if (min_tokens + max_tokens > l.context_length) {
    throw ApiError(400, "this model's maximum context length is " + std::to_string(l.context_length) + " tokens; the prompt's " +
                            std::to_string(s.size()) + " bytes are at least " + std::to_string(min_tokens) +
                            " tokens and max_tokens is " + std::to_string(max_tokens),
                   field, "invalid_request_error", "context_length_exceeded");
  }
}
std::vector<int64_t> encode(const ProtocolLimits& l, const std::string& s) { return tokenizer_of(l).encode(s); }
// A completion's prompt text as Hugging Face encodes it with special tokens (vLLM does): the
// tokenizer's BOS first where it adds one. (A chat prompt's template writes its own BOS.)
std::vector<int64_t> encode_prompt(const ProtocolLimits& l, const std::string& s) { return tokenizer_of(l).encode_prompt(s); }

std::vector<int64_t> token_list(const json& a, const std::string& field, int64_t vocab) {
  std::vector<int64_t> out;
  for (const json& t : a) {
    if (!t.is_number_integer()) bad(field, "token ids must be integers, got " + shown(t));
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= vocab) bad(field, "token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    out.push_back(id);
  }
  return out;
}

void add_prompt(CompletionRequest& r, std::vector<int64_t> toks, const std::string& field, const ProtocolLimits& l) {
  if (toks.empty()) bad(field, "the prompt is empty");
  const int64_t n = static_cast<int64_t>(toks.size());
  if (n + r.params.max_tokens > l.context_length) {
    throw ApiError(400, "this model's maximum context length is " + std::to_string(l.context_length) + " tokens; the prompt has " +
                            std::to_string(n) + " and max_tokens is " + std::to_string(r.params.max_tokens),
                   field, "invalid_request_error", "context_length_exceeded");
  }
  std::string text;
  for (int64_t t : toks) text += bytes_of_token(l, t);
  r.prompt_texts.push_back(inference::sanitize_utf8(text));
  r.prompts.push_back(std::move(toks));
}



void check_choices(const CompletionRequest& r, const ProtocolLimits& l) {
  const int64_t total = static_cast<int64_t>(r.prompts.size()) * r.best_of;
  const char* field = r.best_of > r.n ? "best_of" : "n";
  if (total > l.max_n) {
    bad(field, std::string("prompts x ") + field + " is " + std::to_string(total) + ", at most " + std::to_string(l.max_n) + " per request");
  }
  // The most KV-cache positions the request can hold at once, checked before any work.
  int64_t tokens = 0;
  for (const auto& p : r.prompts) tokens += (static_cast<int64_t>(p.size()) + r.params.max_tokens) * r.best_of;
  if (l.max_request_tokens > 0 && tokens > l.max_request_tokens) {
    bad("max_tokens", "prompts x n x (prompt + max_tokens) is " + std::to_string(tokens) + " tokens, more than the " +
                          std::to_string(l.max_request_tokens) + " this server holds for one request");
  }
}
}  // namespace

CompletionRequest parse_completion(const json& b, const ProtocolLimits& l, const std::string* raw) {
  check_fields(b, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "n", "best_of", "logprobs", "echo", "stream", "stream_options", "user",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "suffix",
                   "ignore_eos", "response_format", "structured_outputs"});
  const int32_t adapter = check_model(b, l);
  if (present(b, "suffix")) bad("suffix", "not supported");
  CompletionRequest r;
  r.adapter = adapter;
  r.model = b.at("model").get<std::string>();
  common_sampling(b, l, r, "max_tokens");
  detail::parse_structured(b, r, raw);
  // OpenAI's best_of: that many completions per prompt, the n with the highest log probability
  // per token returned (all of them counted in usage); not with stream.
  r.best_of = get_int(b, "best_of", r.n, r.n, l.max_n);
  if (r.best_of > r.n && r.stream) bad("best_of", "best_of > n cannot be streamed");
  r.echo = get_bool(b, "echo", false);
  r.logprobs = get_int(b, "logprobs", -1, 0, 20);
  r.params.logprobs = r.logprobs;
  r.params.prompt_logprobs = r.echo && r.logprobs >= 0;
  if (!present(b, "prompt")) bad("prompt", "required");
  const json& p = b.at("prompt");
  if (p.is_string()) {
    check_text_fits(l, p.get<std::string>(), "prompt", r.params.max_tokens);
    add_prompt(r, encode_prompt(l, p.get<std::string>()), "prompt", l);
  } else if (p.is_array() && !p.empty() && p[0].is_number()) {
    add_prompt(r, token_list(p, "prompt", l.vocab), "prompt", l);
  } else if (p.is_array() && !p.empty()) {
    for (size_t i = 0; i < p.size(); ++i) {
      const std::string f = "prompt[" + std::to_string(i) + "]";
      if (p[i].is_string()) {
        check_text_fits(l, p[i].get<std::string>(), f, r.params.max_tokens);
        add_prompt(r, encode_prompt(l, p[i].get<std::string>()), f, l);
      }
      else if (p[i].is_array()) add_prompt(r, token_list(p[i], f, l.vocab), f, l);
      else bad(f, "expected a string or a list of token ids");
    }
  } else {
    bad("prompt", "expected a string, a list of strings, a list of token ids or a list of such lists");
  }
  check_choices(r, l);
  return r;
}

json chat_messages(const json& messages) {
  json out = json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string f = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad(f, "expected an object with role and content");
    if (!m.contains("role") || !m.at("role").is_string()) bad(f + ".role", "required string");
    const std::string role = m.at("role").get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "developer" && role != "tool") {
      bad(f + ".role", "\"" + role + "\" is not one of system, developer, user, assistant, tool");
    }
    const bool calls = role == "assistant" && m.contains("tool_calls") && !m.at("tool_calls").is_null();
    std::string content;
    static const json kNull = nullptr;
    const json& c = m.contains("content") ? m.at("content") : kNull;
    if (c.is_string()) {
      content = c.get<std::string>();
    } else if (c.is_array()) {
      for (size_t k = 0; k < c.size(); ++k) {
        const json& part = c[k];
        if (!part.is_object() || !part.contains("type") || part.at("type") != "text" || !part.contains("text") ||
            !part.at("text").is_string()) {
          bad(f + ".content[" + std::to_string(k) + "]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported");
        }
        content += part.at("text").get<std::string>();
      }
    } else if (!(c.is_null() && calls)) {
      bad(f + ".content", "expected a string or a list of text parts");
    }
    json msg = {{"role", role}, {"content", content}};
    for (const auto& [k, v] : m.items()) {
      if (k == "role" || k == "content") continue;
      if (k == "name") {  // the participant's name: the chat template reads it where it wants it
        if (!v.is_string()) bad(f + ".name", "expected a string");
        msg["name"] = v;
        continue;
      }
      if (k == "tool_call_id" && role == "tool") {
        if (!v.is_string()) bad(f + ".tool_call_id", "expected a string");
        msg["tool_call_id"] = v;
      } else if (k == "tool_calls" && role == "assistant") {
        if (v.is_null()) continue;
        if (!v.is_array()) bad(f + ".tool_calls", "expected a list");
        json list = json::array();
        for (size_t k2 = 0; k2 < v.size(); ++k2) {
          const std::string g = f + ".tool_calls[" + std::to_string(k2) + "]";
          const json& tc = v[k2];
          if (!tc.is_object() || !tc.contains("function") || !tc.at("function").is_object() ||
              !tc.at("function").contains("name") || !tc.at("function").at("name").is_string()) {
            bad(g, "expected {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}");
          }
          const json& fn = tc.at("function");
          // Templates read the arguments as an object (transformers' convention); OpenAI sends JSON text.
          json args = json::object();
          if (fn.contains("arguments") && fn.at("arguments").is_string()) {
            args = json::parse(fn.at("arguments").get<std::string>(), nullptr, false);
            if (args.is_discarded()) bad(g + ".function.arguments", "is not JSON");
          } else if (fn.contains("arguments") && fn.at("arguments").is_object()) {
            args = fn.at("arguments");
          }
          json one = {{"type", "function"}, {"function", {{"name", fn.at("name")}, {"arguments", args}}}};
          if (tc.contains("id") && tc.at("id").is_string()) one["id"] = tc.at("id");
          list.push_back(std::move(one));
        }
        msg["tool_calls"] = std::move(list);
      } else {
        bad(f + "." + k, "not supported");
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

std::string chat_prompt(const json& messages) {
  std::string out;
  for (const json& m : chat_messages(messages)) {
    const std::string role = m.at("role").get<std::string>();
    out += "<|" + (role == "developer" ? std::string("system") : role) + "|>\n" + m.at("content").get<std::string>();
    if (m.contains("tool_calls")) {
      for (const json& c : m.at("tool_calls")) {
        out += "<tool_call>\n" + json{{"name", c.at("function").at("name")}, {"arguments", c.at("function").at("arguments")}}.dump() +
               "\n</tool_call>";
      }
    }
    out += "\n";
  }
  return out + "<|assistant|>\n";
}

namespace {
// The tool instructions of Qwen 2.5's template (the Hermes format), for templates that do not
// take `tools` themselves (Note [Tool calls]).
std::string hermes_tool_prompt(const nlohmann::ordered_json& tools) {
  std::string s = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
                  "function signatures within <tools></tools> XML tags:\n<tools>";
  for (const auto& t : tools) s += "\n" + t.dump();
  return s + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
}
// Llama 3.1's, for the llama3_json format.
std::string llama_tool_prompt(const nlohmann::ordered_json& tools) {
  std::string s = "Given the following functions, please respond with a JSON for a function call with its proper arguments "
                  "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
                  "dictionary of argument name and its value}. Do not use variables.\n\n";
  for (const auto& t : tools) s += t.dump(4) + "\n\n";
  return s;
}

// The messages as the prompt text: the model's own template, as transformers'
// apply_chat_template(messages, tools=..., add_generation_prompt=...), or ours (which always ends
// in the assistant's turn). With tools and a template that does not read them, their description
// goes first as a system message (merged into the first one when there is one).
std::string chat_text(const ProtocolLimits& l, const json& raw_messages, bool add_generation_prompt,
                      const ToolRequest* tools = nullptr, const nlohmann::ordered_json* tools_ordered = nullptr) {
  json messages = raw_messages;
  const bool with_tools = tools && tools->active() && tools_ordered;
  const bool template_reads_tools = l.chat && l.chat->tmpl && l.chat->text.find("tools") != std::string::npos;
  if (with_tools && !template_reads_tools) {
    const std::string desc = tools->parser == "llama3_json" ? llama_tool_prompt(*tools_ordered) : hermes_tool_prompt(*tools_ordered);
    if (!messages.empty() && messages[0].is_object() && (messages[0].value("role", "") == "system") && messages[0].contains("content") &&
        messages[0].at("content").is_string()) {
      messages[0]["content"] = messages[0].at("content").get<std::string>() + "\n\n" + desc;
    } else {
      messages.insert(messages.begin(), json{{"role", "system"}, {"content", desc}});
    }
  }
  if (!(l.chat && l.chat->tmpl)) return chat_prompt(messages);
  try {
    if (with_tools && template_reads_tools) {
      nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(l.chat->context.dump());
      ctx["messages"] = nlohmann::ordered_json::parse(chat_messages(messages).dump());
      ctx["tools"] = *tools_ordered;
      ctx["add_generation_prompt"] = add_generation_prompt;
      return l.chat->tmpl->render(ctx);
    }
    json ctx = l.chat->context;
    ctx["messages"] = chat_messages(messages);
    ctx["add_generation_prompt"] = add_generation_prompt;
    return l.chat->tmpl->render(ctx);
  } catch (const ApiError&) {
    throw;
  } catch (const std::exception& e) {
    bad("messages", std::string("the model's chat template refused them: ") + e.what());
  }
}

void check_optional_model(const json& b, const ProtocolLimits& l) {
  if (present(b, "model")) check_model(b, l);
}
}  // namespace

EmbeddingRequest parse_embeddings(const json& b, const ProtocolLimits& l) {
  check_fields(b, {"model", "input", "encoding_format", "dimensions", "user", "add_special_tokens"});
  if (check_model(b, l) != 0) {
    bad("model", "\"" + b.at("model").get<std::string>() + "\" is a LoRA adapter; embeddings are the base model's (\"" +
                     l.model_name + "\")");
  }
  EmbeddingRequest r;
  if (present(b, "encoding_format")) {
    const json& f = b.at("encoding_format");
    if (f != "float" && f != "base64") bad("encoding_format", "expected \"float\" or \"base64\"");
    r.base64 = f == "base64";
  }
  if (present(b, "dimensions")) {
    const int64_t dims = get_int(b, "dimensions", 0, 1, 1 << 20);
    if (dims != l.hidden_size) bad("dimensions", "this model's embeddings have " + std::to_string(l.hidden_size) + " dimensions, not " + std::to_string(dims));
  }
  if (present(b, "user") && !b.at("user").is_string()) bad("user", "expected a string");
  const bool special = get_bool(b, "add_special_tokens", true);
  if (!present(b, "input")) bad("input", "required");
  const json& in = b.at("input");
  auto add = [&](std::vector<int64_t> ids, const std::string& f) {
    if (ids.empty()) bad(f, "an input is empty");
    if (static_cast<int64_t>(ids.size()) > l.context_length) {
      throw ApiError(400, "this model's maximum context length is " + std::to_string(l.context_length) + " tokens; the input has " +
                              std::to_string(ids.size()), f, "invalid_request_error", "context_length_exceeded");
    }
    r.inputs.push_back(std::move(ids));
  };
  auto text = [&](const std::string& s, const std::string& f) {
    check_text_fits(l, s, f, 0);
    add(special ? encode_prompt(l, s) : encode(l, s), f);
  };
  if (in.is_string()) {
    text(in.get<std::string>(), "input");
  } else if (in.is_array() && !in.empty() && in[0].is_number()) {
    add(token_list(in, "input", l.vocab), "input");
  } else if (in.is_array() && !in.empty()) {
    if (in.size() > 2048) bad("input", "at most 2048 inputs, got " + std::to_string(in.size()));
    for (size_t i = 0; i < in.size(); ++i) {
      const std::string f = "input[" + std::to_string(i) + "]";
      if (in[i].is_string()) text(in[i].get<std::string>(), f);
      else if (in[i].is_array()) add(token_list(in[i], f, l.vocab), f);
      else bad(f, "expected a string or a list of token ids");
    }
  } else {
    bad("input", "expected a string, a list of strings, a list of token ids or a list of such lists");
  }
  int64_t tokens = 0;
  for (const auto& x : r.inputs) tokens += static_cast<int64_t>(x.size());
  if (l.max_request_tokens > 0 && tokens > l.max_request_tokens) {
    bad("input", std::to_string(tokens) + " tokens in all, more than the " + std::to_string(l.max_request_tokens) + " this server takes in one request");
  }
  return r;
}

namespace {
std::string base64_of(const std::string& bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const uint32_t n = static_cast<uint32_t>(static_cast<unsigned char>(bytes[i])) << 16 |
                       (i + 1 < bytes.size() ? static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 1])) << 8 : 0) |
                       (i + 2 < bytes.size() ? static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 2])) : 0);
    out += kAlphabet[n >> 18 & 63];
    out += kAlphabet[n >> 12 & 63];
    out += i + 1 < bytes.size() ? kAlphabet[n >> 6 & 63] : '=';
    out += i + 2 < bytes.size() ? kAlphabet[n & 63] : '=';
  }
  return out;
}
}  // namespace

json embeddings_response(const ProtocolLimits& l, const EmbeddingRequest& r, const std::vector<std::vector<float>>& vectors) {
  json data = json::array();
  int64_t tokens = 0;
  for (size_t i = 0; i < vectors.size(); ++i) {
    tokens += static_cast<int64_t>(r.inputs[i].size());
    json e;
    if (r.base64) {  // OpenAI's: the float32 values' little-endian bytes
      std::string bytes(vectors[i].size() * sizeof(float), '\0');
      for (size_t k = 0; k < vectors[i].size(); ++k) {
        uint32_t u;
        std::memcpy(&u, &vectors[i][k], sizeof(u));
        for (int b = 0; b < 4; ++b) bytes[k * 4 + static_cast<size_t>(b)] = static_cast<char>(u >> (8 * b) & 0xFF);
      }
      e = base64_of(bytes);
    } else {
      e = vectors[i];
    }
    data.push_back({{"object", "embedding"}, {"index", i}, {"embedding", std::move(e)}});
  }
  return {{"object", "list"}, {"data", data}, {"model", l.model_name}, {"usage", {{"prompt_tokens", tokens}, {"total_tokens", tokens}}}};
}

json tokenize(const json& b, const ProtocolLimits& l) {
  std::vector<int64_t> ids;
  if (present(b, "messages")) {
    check_fields(b, {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                     "return_token_strs"});
    check_optional_model(b, l);
    if (!b.at("messages").is_array() || b.at("messages").empty()) bad("messages", "a non-empty list of {role, content}");
    if (get_bool(b, "continue_final_message", false)) bad("continue_final_message", "not supported");
    const std::string text = chat_text(l, b.at("messages"), get_bool(b, "add_generation_prompt", true));
    // The template writes its own special tokens; add_special_tokens adds the BOS on top.
    ids = get_bool(b, "add_special_tokens", false) ? encode_prompt(l, text) : encode(l, text);
  } else {
    check_fields(b, {"model", "prompt", "add_special_tokens", "return_token_strs"});
    check_optional_model(b, l);
    if (!present(b, "prompt") || !b.at("prompt").is_string()) bad("prompt", "required: a string (or give messages)");
    const std::string& text = b.at("prompt").get_ref<const std::string&>();
    ids = get_bool(b, "add_special_tokens", true) ? encode_prompt(l, text) : encode(l, text);
  }
  json strs = nullptr;
  if (get_bool(b, "return_token_strs", false)) {
    strs = json::array();
    for (int64_t id : ids) strs.push_back(inference::token_text(bytes_of_token(l, id)));
  }
  return {{"count", ids.size()}, {"max_model_len", l.context_length}, {"tokens", ids}, {"token_strs", strs}};
}

json detokenize(const json& b, const ProtocolLimits& l) {
  check_fields(b, {"model", "tokens"});
  check_optional_model(b, l);
  if (!present(b, "tokens") || !b.at("tokens").is_array()) bad("tokens", "required: a list of token ids");
  std::string text;
  for (int64_t id : token_list(b.at("tokens"), "tokens", l.vocab)) text += bytes_of_token(l, id);
  return {{"prompt", inference::sanitize_utf8(text)}};
}

CompletionRequest parse_chat(const json& b, const ProtocolLimits& l, const std::string* raw) {
  check_fields(b, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
                   "seed", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "stream", "stream_options", "user",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                   "response_format", "structured_outputs", "ignore_eos", "tools", "tool_choice", "parallel_tool_calls"});
  CompletionRequest r;
  r.adapter = check_model(b, l);
  r.model = b.at("model").get<std::string>();
  detail::parse_structured(b, r, raw);
  inference::GrammarPtr tool_grammar;
  r.tools = parse_tools(b, l.tool_parser, raw, &tool_grammar);
  if (tool_grammar) {
    if (r.params.grammar) bad("response_format", "cannot be combined with tool_choice \"required\" or a named function");
    r.params.grammar = tool_grammar;
  }
  r.chat = true;
  if (present(b, "max_tokens") && present(b, "max_completion_tokens")) bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both");
  common_sampling(b, l, r, present(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens");
  const bool lp = get_bool(b, "logprobs", false);
  const int64_t top = get_int(b, "top_logprobs", 0, 0, 20);
  if (present(b, "top_logprobs") && !lp) bad("top_logprobs", "needs logprobs: true");
  r.logprobs = lp ? top : -1;
  r.params.logprobs = r.logprobs;
  if (!present(b, "messages") || !b.at("messages").is_array() || b.at("messages").empty()) {
    bad("messages", "required: a non-empty list of {role, content}");
  }
  nlohmann::ordered_json tools_ordered;
  if (r.tools.active()) tools_ordered = ordered_at(b, {"tools"}, raw);
  const std::string text = chat_text(l, b.at("messages"), true, &r.tools, &tools_ordered);
  if (l.chat && l.chat->tmpl) {
    r.params.eos_token_ids = l.chat->stop_ids;
  } else {
    r.params.stop.push_back(kChatStop);
  }
  check_text_fits(l, text, "messages", r.params.max_tokens);
  add_prompt(r, encode(l, text), "messages", l);
  check_choices(r, l);
  return r;
}

namespace {
json token_bytes(const ProtocolLimits& l, int64_t t) {
  json out = json::array();
  for (unsigned char c : bytes_of_token(l, t)) out.push_back(static_cast<int>(c));
  return out;
}
std::string token_text(const ProtocolLimits& l, int64_t t) { return inference::token_text(bytes_of_token(l, t)); }

json completion_logprobs(const ProtocolLimits& l, const CompletionRequest& req, const ChoiceResult& c, size_t prompt_index,
                         bool with_prompt, const std::vector<inference::GeneratedToken>& tokens, int64_t offset0,
                         int64_t* offset_end = nullptr) {
  json toks = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
  int64_t off = offset0;
  auto add = [&](int64_t id, const json& lp, const json& top) {
    toks.push_back(token_text(l, id));
    lps.push_back(lp);
    tops.push_back(top);
    offs.push_back(off);
    off += static_cast<int64_t>(bytes_of_token(l, id).size());
  };
  if (with_prompt) {
    const auto& prompt = req.prompts[prompt_index];
    add(prompt[0], nullptr, nullptr);
    for (const auto& g : c.prompt_lps) {
      json top = json::object();
      for (const auto& [id, v] : g.logprobs.top) top[token_text(l, id)] = v;
      add(g.id, g.logprobs.logprob, top);
    }
  }
  for (const auto& g : tokens) {
    json top = json::object();
    for (const auto& [id, v] : g.logprobs.top) top[token_text(l, id)] = v;
    add(g.id, g.logprobs.logprob, top);
  }
  if (offset_end) *offset_end = off;
  return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

json chat_logprobs(const ProtocolLimits& l, const std::vector<inference::GeneratedToken>& tokens) {
  json content = json::array();
  for (const auto& g : tokens) {
    json top = json::array();
    for (const auto& [id, v] : g.logprobs.top) {
      top.push_back({{"token", token_text(l, id)}, {"logprob", v}, {"bytes", token_bytes(l, id)}});
    }
    content.push_back({{"token", token_text(l, g.id)}, {"logprob", g.logprobs.logprob}, {"bytes", token_bytes(l, g.id)},
                       {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json usage_of(int64_t prompt, int64_t completion) {
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}
}  // namespace

json completion_response(const std::string& id, int64_t created, const ProtocolLimits& l, const CompletionRequest& req,
                         const std::vector<ChoiceResult>& choices) {
  json out_choices = json::array();
  int64_t prompt_tokens = 0, completion_tokens = 0;
  for (size_t p = 0; p < req.prompts.size(); ++p) prompt_tokens += static_cast<int64_t>(req.prompts[p].size());
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    const size_t pi = i / static_cast<size_t>(req.n);
    completion_tokens += c.completion_tokens;
    if (req.chat) {
      json message = {{"role", "assistant"}, {"content", c.text}};
      std::string reason = c.finish_reason;
      if (req.tools.active()) {
        // Note [Tool calls]: the calls read from the text; content null when there is none.
        const ToolOutput t = parse_tool_output(req.tools, c.text);
        if (!t.calls.empty()) {
          message["content"] = t.content.empty() ? json(nullptr) : json(t.content);
          message["tool_calls"] = tool_calls_json(t.calls, "call_" + id + "_" + std::to_string(i) + "_", false);
          if (reason == "stop" && req.tools.choice != ToolChoice::kNamed) reason = "tool_calls";
        }
      }
      out_choices.push_back({{"index", i},
                             {"message", message},
                             {"logprobs", req.logprobs >= 0 ? chat_logprobs(l, c.tokens) : json(nullptr)},
                             {"finish_reason", reason}});
    } else {
      const std::string text = req.echo ? req.prompt_texts[pi] + c.text : c.text;
      json lp = nullptr;
      if (req.logprobs >= 0) {
        lp = completion_logprobs(l, req, c, pi, req.echo, c.tokens, 0);
      }
      out_choices.push_back({{"index", i}, {"text", text}, {"logprobs", lp}, {"finish_reason", c.finish_reason}});
    }
  }
  return {{"id", id},
          {"object", req.chat ? "chat.completion" : "text_completion"},
          {"created", created},
          {"model", req.model.empty() ? l.model_name : req.model},
          {"choices", out_choices},
          {"usage", usage_of(prompt_tokens, completion_tokens)}};
}

json stream_chunk(const std::string& id, int64_t created, const ProtocolLimits& l, const CompletionRequest& req, int64_t index,
                  const std::string& text, const std::vector<inference::GeneratedToken>& tokens,
                  const std::string& finish_reason, bool first, int64_t* text_offset) {
  const size_t pi = static_cast<size_t>(index / req.n);
  const json reason = finish_reason.empty() ? json(nullptr) : json(finish_reason);
  json choice;
  if (req.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || first) delta["content"] = text;
    choice = {{"index", index}, {"delta", delta}, {"logprobs", req.logprobs >= 0 && !tokens.empty() ? chat_logprobs(l, tokens) : json(nullptr)},
              {"finish_reason", reason}};
  } else {
    const std::string t = first && req.echo ? req.prompt_texts[pi] + text : text;
    json lp = nullptr;
    if (req.logprobs >= 0) {
      // text_offset counts from the start of the choice's whole text, across chunks.
      int64_t off = text_offset ? *text_offset : 0;
      if (first && req.echo) off += static_cast<int64_t>(req.prompt_texts[pi].size());
      ChoiceResult c;
      lp = completion_logprobs(l, req, c, pi, false, tokens, off, &off);
      if (text_offset) *text_offset = off;
    }
    choice = {{"index", index}, {"text", t}, {"logprobs", lp}, {"finish_reason", reason}};
  }
  return {{"id", id},
          {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", req.model.empty() ? l.model_name : req.model},
          {"choices", json::array({choice})}};
}

json usage_chunk(const std::string& id, int64_t created, const ProtocolLimits& l, const CompletionRequest& req,
                 int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"id", id},
          {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", req.model.empty() ? l.model_name : req.model},
          {"choices", json::array()},
          {"usage", usage_of(prompt_tokens, completion_tokens)}};
}

}  // namespace torchspeed::serve
