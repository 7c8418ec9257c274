// Internals of the Jinja interpreter for chat templates (chat_template.h), shared by its
// sources: chat_template_values.cpp (values, Python's str/repr/json.dumps), chat_template_parse.cpp
// (lexer, expression tokens, parser to a tree), chat_template_render.cpp (the tree-walking
// renderer), chat_template_builtins.cpp (filters, tests, str/dict/list methods) and
// chat_template.cpp (the public API). Not part of the public API.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "torchspeed/data/chat_template.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data::jinja {
// Python's dicts keep their insertion order, and templates print them (tojson of a tool's
// schema): values here keep theirs too.
using json = nlohmann::ordered_json;

inline constexpr int kMaxDepth = 200;            // nesting of expressions, blocks and macro calls
inline constexpr int64_t kMaxSteps = 2'000'000;  // nodes evaluated (and list elements made) in one render
inline constexpr size_t kMaxOutput = size_t{64} << 20;

// ---------------------------------------------------------------------------------------------
// Values: JSON data, undefined, or something callable (a macro, a builtin, a bound method).

struct Node;
struct Macro {
  std::vector<std::string> params;
  std::vector<std::shared_ptr<Node>> defaults;  // null where none
  std::vector<std::shared_ptr<Node>> body;
};

struct Value {
  enum class K { kUndef, kJson, kMacro, kBuiltin } k = K::kUndef;
  json j;
  // jinja2's Markup: a string marked |safe; adding a plain string to it HTML-escapes that one.
  bool safe = false;
  std::shared_ptr<const Macro> macro;
  std::string builtin;  // a global function, or "str.strip" etc. bound to `j`
  static Value of(json v) {
    Value x;
    x.k = K::kJson;
    x.j = std::move(v);
    return x;
  }
  bool undefined() const { return k == K::kUndef; }
};

// How json.dumps writes: separators, indent, key order, escaping of non-ASCII.
struct JsonStyle {
  int indent = -1;
  bool sort_keys = false, ensure_ascii = false;
  std::string item_sep = ", ", key_sep = ": ";
};


// Values as Python writes them (chat_template_values.cpp).
void py_json(const json& v, const JsonStyle& st, int level, std::string& out);
std::string py_str(const json& v);
std::string dict_key(const json& k);
json key_json(const std::string& k);
std::string html_escape(const std::string& s);
std::string py_float(double d);
std::string py_repr(const json& v);
bool truthy(const Value& v);
// Python's str.isspace for one ASCII character (what split() and strip() drop).
bool space(char c);
// The next code point of UTF-8 text at i (a stray byte stands for itself).
uint32_t next_cp(const std::string& s, size_t& i);
// A JSON value with its keys in order.
json ordered(const nlohmann::json& j);

// ---------------------------------------------------------------------------------------------
// The tree (chat_template_parse.cpp makes it).

struct Node {
  enum class K {
    kLit, kName, kList, kDict, kAttr, kItem, kSlice, kCall, kFilter, kTest, kUnary, kBinary, kAnd, kOr, kNot, kCond,
    // statements
    kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kFilterBlock, kBreak, kContinue, kCallBlock,
  } k;
  int line = 0;
  json lit;
  std::string name;  // name, attribute, operator, filter or test
  std::vector<std::shared_ptr<Node>> kids;  // operands, elements, arguments
  std::vector<std::string> kw_names;        // keyword argument names (the last kids)
  // statements
  std::vector<std::string> targets;
  std::vector<std::vector<std::shared_ptr<Node>>> bodies;  // if: one per branch (+ else); for: body, else
  std::shared_ptr<const Macro> macro;
  bool negate = false;  // "is not", "not in"
};
using NodeP = std::shared_ptr<Node>;

// The template's statements, parsed; errors name `origin` and the line.
std::vector<NodeP> parse_template(const std::string& source, const std::string& origin);

// ---------------------------------------------------------------------------------------------
// The renderer (chat_template_render.cpp; its filters, tests and methods in
// chat_template_builtins.cpp).

struct BreakSignal {};
struct ContinueSignal {};
class Renderer {
 public:
  Renderer(const std::string& origin) : origin_(origin) {}

  std::string origin_;
  std::vector<std::map<std::string, Value>> scopes_;
  int64_t steps_ = 0;
  int depth_ = 0;
  std::vector<const std::vector<NodeP>*> callers_;

  [[noreturn]] void fail(int line, const std::string& what) const {
    TS_CHECK(false, origin_, " line ", line, ": ", what);
    throw std::logic_error("unreachable");
  }

  Value lookup(const std::string& name) const;
  Value* find_var(const std::string& name);
  void step(int line, int64_t n = 1);
  const json& need_json(const Value& v, int line, const char* what) const;
  static bool is_num(const json& j) { return j.is_number(); }
  static double num(const json& j) { return j.get<double>(); }

  Value binary(const Node& n, const Value& a, const Value& b);
  std::string to_str(const Value& v) const;
  Value attr(const Value& base, const std::string& name, int line);
  static Value bound(const std::string& method, const json& self);
  Value item(const Value& base, const Value& key, int line);
  Value slice(const Value& base, const Value& lo, const Value& hi, const Value& st, int line);

  struct Args {
    std::vector<Value> pos;
    std::map<std::string, Value> kw;
    const Value* get(size_t i, const char* name) const {
      if (auto it = kw.find(name); it != kw.end()) return &it->second;
      return i < pos.size() ? &pos[i] : nullptr;
    }
  };
  Args eval_args(const Node& n, size_t first);
  std::string str_arg(const Args& a, size_t i, const char* name, int line, const std::string& dflt = "");
  static std::string strip(const std::string& s, const std::string& chars, bool left, bool right);
  Value call_method(const Value& f, const Args& a, int line);
  std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int line);
  Value call(const Node& n);
  Value invoke(const Value& f, const Args& a, int line);
  Value call_macro(const Macro& m, const Args& a, int line, const std::vector<NodeP>* caller_body);
  bool test(const std::string& name, const Value& v, const Args& a, int line);
  json list_of(const Value& v, int line, const char* what);
  json attr_of(const json& x, const std::string& path, int line);
  Value filter(const std::string& name, const Value& v, const Args& a, int line);
  Value eval(const Node& n);
  void emit(std::string& out, const std::string& s, int line);
  void assign(const std::string& name, const std::string& attr_name, const Value& v, int line);
  void render_body(const std::vector<NodeP>& body, std::string& out);
  void render(const Node& n, std::string& out);
  void bind_targets(const Node& n, const json& x);
};

}  // namespace torchspeed::data::jinja
