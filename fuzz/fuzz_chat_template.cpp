// libFuzzer target: the chat-template engine. The bytes are a template: lexed, parsed and
// rendered with a chat context (messages with text, a tool, special tokens). Refusals are
// torchspeed::Error (syntax, unknown names, raise_exception, the step and output bounds);
// anything else, a crash, a hang past libFuzzer's timeout or a stack overflow is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "torchspeed/data/chat_template.h"

namespace {
constexpr const char* kTarget = "fuzz_chat_template";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::json ctx = nlohmann::json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u00e9 {{ x }}"},
                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})");
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::run_expecting_errors(kTarget, [&] {
    const torchspeed::data::ChatTemplate t(text, "fuzz");
    (void)t.render(ctx);
  });
  return 0;
}
