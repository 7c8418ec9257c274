// Which tokenizer goes with a model that checkpoint::load_model(path) returned.
#pragma once

#include <string>

#include "torchspeed/checkpoint/consolidated.h"
#include "torchspeed/data/chat_template.h"
#include "torchspeed/data/tokenizer.h"

namespace torchspeed::data {

// `spec` when given ("bytes" or a tokenizer path); else tokenizer files beside the model (a
// Hugging Face folder, or the model/ folder of a run); else the training config's
// data.tokenizer; else bytes. Its vocabulary must fit the model's (an error naming both).
TokenizerPtr tokenizer_of_model(const std::string& path, const checkpoint::Model& model, const std::string& spec = "");

// How a model's chats become prompts: its own chat template with the values templates read
// (bos_token, eos_token), and the token ids that end an assistant turn (the tokenizer's EOS and
// generation_config.json's eos_token_id list).
struct ChatFormat {
  std::shared_ptr<const ChatTemplate> tmpl;  // null: the model has none
  nlohmann::json context = nlohmann::json::object();  // bos_token, eos_token, ...
  std::vector<int64_t> stop_ids;
  std::string source;  // where the template came from
  std::string text;    // the template's Jinja text
};
using ChatFormatPtr = std::shared_ptr<const ChatFormat>;

// The chat format found for the model at `path`: a GGUF's tokenizer.chat_template; a Hugging Face
// folder's chat_template.jinja or tokenizer_config.json "chat_template" (beside the model, or
// beside the tokenizer it uses: a run fine-tuned from such a model); none otherwise.
ChatFormatPtr chat_format_of_model(const std::string& path, const checkpoint::Model& model, const Tokenizer& tokenizer);

}  // namespace torchspeed::data
