// OpenAI's completions and chat completions API as JSON in and out, with no HTTP and no
// tensors: requests are validated field by field (an error names its field as OpenAI's
// `param`, with the status to answer), and responses, stream chunks and errors are built in
// OpenAI's shapes. The chat template for our byte-level models is in docs/serving.md.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "torchspeed/data/model_tokenizer.h"
#include "torchspeed/data/tokenizer.h"
#include "torchspeed/inference/serving_engine.h"
#include "torchspeed/serve/tool_calls.h"

namespace torchspeed::serve {

struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int status_, const std::string& message, std::string param_ = "", std::string type_ = "invalid_request_error",
           std::string code_ = "")
      : std::runtime_error(message), status(status_), type(std::move(type_)), param(std::move(param_)),
        code(std::move(code_)) {}
  nlohmann::json to_json() const;
};

struct ProtocolLimits {
  std::string model_name;
  int64_t context_length = 0;  // the model's seq_len
  int64_t vocab = 256;
  int64_t max_tokens = 0;      // per choice; 0: up to the context
  int64_t max_n = 16;          // choices per request (prompts x n)
  int64_t max_request_tokens = 0;  // sum over choices of prompt + max_tokens; 0: no limit
  data::TokenizerPtr tokenizer;  // text <-> token ids; null: bytes
  int64_t max_token_bytes = 0;   // the tokenizer's longest token in bytes (0: unknown, no pre-check)
  // The model's own chat template and end-of-turn tokens; null or without a template: ours.
  data::ChatFormatPtr chat;
  int64_t hidden_size = 0;  // the model's d (embeddings' length)
  std::string tool_parser;  // --tool-call-parser: what tool_choice "auto" reads calls with (empty: refused)
  // LoRA adapters served beside the base model (--lora-modules): a request's `model` names one;
  // adapter i's id is i + 1 (InferenceModel::add_adapter).
  std::vector<std::string> adapters;
};

// The value at `where` (object keys, or array indices as digits) with objects' keys in the order
// the client wrote them (read again from `raw`, the body's text; without it, sorted).
nlohmann::ordered_json ordered_at(const nlohmann::json& body, const std::vector<std::string>& where, const std::string* raw);

// The messages checked field by field and normalised to [{role, content: string}] (text parts
// joined), as chat templates read them.
nlohmann::json chat_messages(const nlohmann::json& messages);
// Our chat template, for models without one: "<|system|>\n...\n<|user|>\n...\n<|assistant|>\n"
// per message, then "<|assistant|>\n"; generation stops at "<|" (the start of the next turn).
std::string chat_prompt(const nlohmann::json& messages);
inline constexpr const char* kChatStop = "<|";

struct CompletionRequest {
  bool chat = false;
  std::vector<std::vector<int64_t>> prompts;  // token ids, one per prompt
  std::vector<std::string> prompt_texts;      // the prompts as text (echo)
  inference::SamplingParams params;           // per choice; seed + k for choice k
  int64_t n = 1;
  int64_t best_of = 1;  // >= n: completions generated per prompt (choice k of prompt p: p * best_of + k)
  bool stream = false, echo = false, include_usage = false;
  int64_t logprobs = -1;  // completions: top-N; chat: top_logprobs when logprobs is true
  ToolRequest tools;      // chat: tools and tool_choice (Note [Tool calls])
  std::string model;      // as the request named it: the base model or a LoRA adapter (answers name it)
  int32_t adapter = 0;    // the adapter's id; 0: the base model
};

// Throws ApiError (400 naming the field, 404 for an unknown model). raw: the body's text, from
// which a JSON schema is read again with its properties in the client's order (null: sorted).
CompletionRequest parse_completion(const nlohmann::json& body, const ProtocolLimits& limits, const std::string* raw = nullptr);
CompletionRequest parse_chat(const nlohmann::json& body, const ProtocolLimits& limits, const std::string* raw = nullptr);
// 400 with the offset of a JSON error, or past kMaxJsonDepth levels of nesting.
inline constexpr int kMaxJsonDepth = 64;
nlohmann::json parse_body(const std::string& body);

struct ChoiceResult {
  std::string text;
  std::vector<inference::GeneratedToken> tokens, prompt_lps;
  std::string finish_reason;
  int64_t completion_tokens = 0;
};

// The whole answer of a non-streamed request; `choices` in index order.
nlohmann::json completion_response(const std::string& id, int64_t created, const ProtocolLimits& limits,
                                   const CompletionRequest& req, const std::vector<ChoiceResult>& choices);
// One server-sent event's JSON for choice `index`: new text (and its tokens' logprobs), and
// the finish reason when it is the last for that choice. `text_offset` (in and out, per
// choice): where this chunk's text starts in the choice's whole text (logprobs' text_offset).
nlohmann::json stream_chunk(const std::string& id, int64_t created, const ProtocolLimits& limits,
                            const CompletionRequest& req, int64_t index, const std::string& text,
                            const std::vector<inference::GeneratedToken>& tokens, const std::string& finish_reason,
                            bool first, int64_t* text_offset = nullptr);
// OpenAI's /v1/embeddings: `input` (a string, strings, token ids, or lists of them) tokenized;
// `encoding_format` float or base64; `dimensions` only as the model's own. Throws ApiError.
struct EmbeddingRequest {
  std::vector<std::vector<int64_t>> inputs;
  bool base64 = false;
};
EmbeddingRequest parse_embeddings(const nlohmann::json& body, const ProtocolLimits& limits);
nlohmann::json embeddings_response(const ProtocolLimits& limits, const EmbeddingRequest& req,
                                   const std::vector<std::vector<float>>& vectors);

// vLLM's /tokenize (a prompt, or chat messages through the chat template) and /detokenize:
// the answer's JSON; throws ApiError naming the field.
nlohmann::json tokenize(const nlohmann::json& body, const ProtocolLimits& limits);
nlohmann::json detokenize(const nlohmann::json& body, const ProtocolLimits& limits);

nlohmann::json usage_chunk(const std::string& id, int64_t created, const ProtocolLimits& limits,
                           const CompletionRequest& req, int64_t prompt_tokens, int64_t completion_tokens);

}  // namespace torchspeed::serve
