// libFuzzer target: the OpenAI request parser of serve/openai_protocol.h, which reads every
// request body a client sends. The first byte picks the route (completions, chat, /tokenize,
// /detokenize) and the limits; the rest is the body: parse_body (depth-limited JSON), then the
// route's parser against a byte-level model of 256 tokens. An accepted request must keep its
// limits (choices, context, token budget, ids in the vocabulary), its sampling parameters must
// shape and sample a row of logits, and its answer must be buildable: the whole response and a
// stream chunk with logprobs for every choice. A refusal is an ApiError with a 4xx status;
// anything else (a 5xx, another exception, a sanitizer report) is a bug.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "torchspeed/data/text.h"
#include "torchspeed/inference/sampler.h"
#include "torchspeed/inference/structured.h"
#include "torchspeed/serve/openai_protocol.h"

namespace sv = torchspeed::serve;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t sel = data[0];
  sv::ProtocolLimits l;
  l.model_name = "m";
  l.adapters = {"a", "b"};  // LoRA adapters: "model" may name one
  l.context_length = 64 + (sel >> 4) * 8;
  l.vocab = 256;
  l.max_n = 1 + (sel >> 1) % 8;
  l.max_tokens = (sel & 4) ? 32 : 0;
  l.max_request_tokens = (sel & 8) ? 512 : 0;
  const int route = sel & 3;
  l.tool_parser = (sel & 0x40) ? ((sel & 0x20) ? "llama3_json" : "hermes") : "";
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    const nlohmann::json j = sv::parse_body(body);
    if (route >= 2) {
      const nlohmann::json out = route == 2 ? sv::tokenize(j, l) : sv::detokenize(j, l);
      (void)out.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);  // valid UTF-8 or a bug
      if (route == 2) {
        for (const auto& t : out.at("tokens")) {
          if (t.get<int64_t>() < 0 || t.get<int64_t>() >= l.vocab) fuzz::bug("fuzz_openai", "/tokenize gave an id outside the vocabulary");
        }
      }
      return 0;
    }
    const sv::CompletionRequest r = route == 1 ? sv::parse_chat(j, l, &body) : sv::parse_completion(j, l, &body);
    if (r.tools.active()) {
      // The body's bytes as if the model had written them: the calls parser must not fail.
      const sv::ToolOutput out = sv::parse_tool_output(r.tools, body);
      for (const auto& c : out.calls) {
        if (std::find(r.tools.names.begin(), r.tools.names.end(), c.name) == r.tools.names.end()) fuzz::bug("fuzz_openai", "a call to an unknown tool");
        if (!nlohmann::json::accept(c.arguments)) fuzz::bug("fuzz_openai", "a call whose arguments are not JSON");
      }
      if (sv::tool_content_prefix(r.tools, body) > body.size()) fuzz::bug("fuzz_openai", "content prefix past the text");
      (void)sv::tool_calls_json(out.calls, "call_", true).dump();
    }
    const int64_t total = static_cast<int64_t>(r.prompts.size()) * r.n;
    const int64_t generated = static_cast<int64_t>(r.prompts.size()) * r.best_of;
    if (r.prompts.empty() || r.best_of < r.n || generated > l.max_n) {
      fuzz::bug("fuzz_openai", "accepted a request generating " + std::to_string(generated) + " choices");
    }
    const auto& sp = r.params;
    if (sp.min_tokens < 0 || sp.min_tokens > sp.max_tokens) fuzz::bug("fuzz_openai", "accepted min_tokens past max_tokens");
    for (const auto& [t, b] : sp.logit_bias) {
      if (t < 0 || t >= l.vocab || !(b >= -100 && b <= 100)) fuzz::bug("fuzz_openai", "accepted a logit_bias outside its bounds");
    }
    for (int64_t t : sp.stop_token_ids) {
      if (t < 0 || t >= l.vocab) fuzz::bug("fuzz_openai", "accepted a stop token outside the vocabulary");
    }
    // The parameters sample: a row of logits, a history of prompt and generated tokens.
    {
      std::vector<float> row(static_cast<size_t>(l.vocab));
      for (size_t i = 0; i < row.size(); ++i) row[i] = static_cast<float>((i * 37) % 23) * 0.25f - 2.0f;
      std::vector<int64_t> history = r.prompts[0];
      torchspeed::inference::Sampler smp(sp, 0);
      if (sp.grammar) {  // structured output: the mask over a byte vocabulary
        static const auto trie = std::make_shared<const torchspeed::inference::TokenTrie>(torchspeed::data::ByteTokenizer(), l.vocab);
        smp.constrain(std::make_unique<torchspeed::inference::GrammarMatcher>(sp.grammar, trie, std::vector<int64_t>{0}));
      }
      torchspeed::inference::TokenLogprobs lp;
      for (int k = 0; k < 6; ++k) {
        const int64_t t = smp.sample(row.data(), l.vocab, &lp, history, static_cast<int64_t>(r.prompts[0].size()));
        if (t < 0 || t >= l.vocab) fuzz::bug("fuzz_openai", "the sampler chose a token outside the vocabulary");
        history.push_back(t);
      }
    }
    int64_t tokens = 0;
    for (const auto& p : r.prompts) {
      if (p.empty() || static_cast<int64_t>(p.size()) + r.params.max_tokens > l.context_length)
        fuzz::bug("fuzz_openai", "accepted a prompt past the context");
      for (int64_t t : p) {
        if (t < 0 || t >= l.vocab) fuzz::bug("fuzz_openai", "accepted a token outside the vocabulary");
      }
      tokens += (static_cast<int64_t>(p.size()) + r.params.max_tokens) * r.best_of;
    }
    if (l.max_request_tokens > 0 && tokens > l.max_request_tokens) fuzz::bug("fuzz_openai", "accepted a request past the token budget");
    // Answers: one made-up token with logprobs per choice.
    torchspeed::inference::GeneratedToken g;
    g.id = 'a';
    g.logprobs.logprob = -0.5;
    g.logprobs.top = {{'a', -0.5}, {0xff, -2.0}};
    std::vector<sv::ChoiceResult> choices(static_cast<size_t>(total));
    for (auto& c : choices) {
      c.text = "a";
      c.tokens = {g};
      c.finish_reason = "length";
      c.completion_tokens = 1;
      if (r.params.prompt_logprobs) c.prompt_lps.assign(r.prompts[0].size() - 1, g);
    }
    (void)sv::completion_response("id", 0, l, r, choices).dump();
    int64_t off = 0;
    for (int64_t i = 0; i < total; ++i) (void)sv::stream_chunk("id", 0, l, r, i, "a", {g}, "", i == 0, &off).dump();
    (void)sv::usage_chunk("id", 0, l, r, 1, 1).dump();
  } catch (const sv::ApiError& e) {
    if (e.status < 400 || e.status >= 500) fuzz::bug("fuzz_openai", "status " + std::to_string(e.status) + ": " + e.what());
    (void)e.to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const std::exception& e) {
    fuzz::bug("fuzz_openai", std::string("an exception other than ApiError escaped: ") + e.what());
  }
  return 0;
}
