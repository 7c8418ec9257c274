// Structured output: generation held to a JSON Schema, to any JSON object, or to one of a
// list of strings, by masking every token that could not continue a valid text (Note
// [Structured output] in structured.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "torchspeed/data/tokenizer.h"

namespace torchspeed::inference {

// A schema we cannot hold generation to: `path` names the keyword (dotted, from the schema's
// root, e.g. "properties.age.minimum"; empty: the root itself), what() says why.
struct GrammarError : std::runtime_error {
  std::string path;
  GrammarError(std::string path_, const std::string& what) : std::runtime_error(what), path(std::move(path_)) {}
};

class Grammar {
 public:
  // The JSON Schema subset: type (one or a list), properties, required, additionalProperties,
  // items, minItems, maxItems, minLength, maxLength, enum, const, anyOf, oneOf (as anyOf),
  // allOf of one schema, $ref into $defs / definitions (recursion allowed), and annotations
  // (title, description, default, examples, $schema, $id, $comment). Anything else throws
  // GrammarError naming it. Properties are written in the schema's order (ordered_json keeps it).
  static std::shared_ptr<const Grammar> json_schema(const nlohmann::ordered_json& schema);
  static std::shared_ptr<const Grammar> json_object();  // any JSON object
  static std::shared_ptr<const Grammar> choice(const std::vector<std::string>& options);
  // The whole text matches `pattern` (vLLM's structured_outputs.regex): literals, escapes
  // (\d \w \s and their negations, \n \t ...), `.`, classes [a-z] [^...], groups (...) (?:...),
  // alternation, quantifiers * + ? {n} {n,} {n,m} (lazy forms alike); `.` and negated classes
  // match whole UTF-8 characters. Anything else (backreferences, lookaround, anchors inside)
  // throws GrammarError.
  static std::shared_ptr<const Grammar> regex(const std::string& pattern);

  enum class Kind : uint8_t { kRoot, kLiteral, kAlt, kObject, kArray, kString, kNumber, kWs, kRegex };
  struct Node {
    Kind kind = Kind::kLiteral;
    std::string text;              // kLiteral
    std::vector<int32_t> kids;     // kRoot/kArray: [value]; kAlt: alternatives; kObject: property values ([value] with free keys)
    std::vector<int32_t> keys;     // kObject: literal nodes "\"name\":", one per property
    std::vector<uint8_t> required;  // kObject
    bool free_keys = false;        // kObject: any string keys (no properties listed)
    bool integer = false;          // kNumber
    int64_t min = 0, max = -1;     // kArray: items; kString: characters (-1: unbounded)
    int32_t dfa = -1;              // kRegex: index into dfas
  };
  // A regular expression as a byte DFA: next[state * 256 + byte] (-1: none); state 0 starts.
  struct Dfa {
    std::vector<int32_t> next;
    std::vector<uint8_t> accepting, leaves;  // per state: may end here; has a transition out
  };
  std::vector<Dfa> dfas;
  std::vector<Node> nodes;
  int32_t root = 0;
  int32_t key_string = -1;  // kString for free keys
};
using GrammarPtr = std::shared_ptr<const Grammar>;

// Every token's bytes as a trie (shared by the requests of one tokenizer).
class TokenTrie {
 public:
  TokenTrie(const data::Tokenizer& tokenizer, int64_t vocab);
  struct TrieNode {
    std::vector<std::pair<uint8_t, int32_t>> kids;
    std::vector<int32_t> tokens;  // tokens whose bytes end here
  };
  std::vector<TrieNode> nodes;  // [0]: the root
  std::vector<std::string> bytes;  // per token id (empty: none)
  int64_t vocab = 0;
};

// One sequence's position in a grammar.
class GrammarMatcher {
 public:
  // end_ids: the tokens that end generation (EOS, end of turn, stop ids): allowed exactly when
  // the text so far is complete.
  GrammarMatcher(GrammarPtr grammar, std::shared_ptr<const TokenTrie> trie, std::vector<int64_t> end_ids);
  ~GrammarMatcher();
  // Sets the logit of every token that cannot come next to -inf.
  void mask(float* logits, int64_t vocab);
  // Moves past `token` (an end token: no move); false (and no move) if it cannot come next.
  bool accept(int64_t token);
  bool complete() const;  // the text so far is a whole value
  bool finished() const;  // ... and nothing may follow it (the text ends here)

  struct Frame {
    int32_t node, phase, a, b;
  };
  using Stack = std::vector<Frame>;
  using State = std::vector<Stack>;  // the parses still alive

 private:
  GrammarPtr g_;
  std::shared_ptr<const TokenTrie> trie_;
  std::vector<int64_t> end_ids_;
  State state_;
  std::unordered_map<std::string, std::vector<uint64_t>> cache_;  // allowed tokens per state
};

}  // namespace torchspeed::inference
