// A model's own chat template: the Jinja text Hugging Face keeps in tokenizer_config.json (or
// chat_template.jinja) and llama.cpp in GGUF metadata (tokenizer.chat_template), rendered as
// transformers' apply_chat_template renders it (jinja2 with trim_blocks and lstrip_blocks, the
// loopcontrols extension, raise_exception, strftime_now and a tojson that keeps non-ASCII).
//
// The engine covers what real templates use: text with {{ }}, {% %} and {# #} and their
// whitespace control (-), if/elif/else, for (with loop.*, else, an if filter, unpacking,
// break/continue), set (names, namespace attributes, blocks), macros and calls, filter blocks,
// generation blocks; expressions with Python's literals, arithmetic, comparisons, in, is-tests,
// `~`, conditional expressions, slices, attribute and item access, filters and the string, list
// and dict methods templates call. A template is parsed once; rendering is bounded in steps and
// output, and every error names the template and its line.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

namespace torchspeed::data {

class ChatTemplate {
 public:
  // Parses `source`; a syntax error names `origin`, the line and what was expected.
  explicit ChatTemplate(const std::string& source, const std::string& origin = "chat template");
  // Renders with `context` (an object: messages, add_generation_prompt, bos_token, eos_token,
  // tools, ...). A template's raise_exception, an unknown filter or a type error is an error
  // naming the template and line.
  std::string render(const nlohmann::json& context) const;
  // The same with the context's object keys in their given order (as Python dicts keep them:
  // tojson of a tool's schema prints them so).
  std::string render(const nlohmann::ordered_json& context) const;
  const std::string& origin() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

// Python's json.dumps(value, ensure_ascii=False, indent=indent, separators=(", ", ": ") or with
// an indent (",", ": ")), the form templates' tojson writes. `indent` < 0: none.
std::string python_json(const nlohmann::json& value, int indent = -1, bool sort_keys = false);

}  // namespace torchspeed::data
