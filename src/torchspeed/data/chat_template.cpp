// A Jinja interpreter for chat templates (see chat_template.h): lexer, parser to a tree, and a
// tree-walking renderer over JSON values.
#include "torchspeed/data/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <set>

#include "torchspeed/runtime/error.h"

namespace torchspeed::data {
// Python's dicts keep their insertion order, and templates print them (tojson of a tool's
// schema): values here keep theirs too.
using json = nlohmann::ordered_json;

namespace {

constexpr int kMaxDepth = 200;                 // nesting of expressions, blocks and macro calls
constexpr int64_t kMaxSteps = 2'000'000;       // nodes evaluated (and list elements made) in one render
constexpr size_t kMaxOutput = size_t{64} << 20;

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
void py_json(const json& v, const JsonStyle& st, int level, std::string& out);

// Dict keys: JSON objects key by string, Python dicts by any value; an integer key (a template's
// {4096: 512}) is kept as "\x01" + its digits and comes back as an integer.
std::string py_str(const json& v);
std::string dict_key(const json& k) { return k.is_number_integer() ? "\x01" + std::to_string(k.get<int64_t>()) : py_str(k); }
json key_json(const std::string& k) {
  if (k.size() > 1 && k[0] == '\x01') {
    try {
      return std::stoll(k.substr(1));
    } catch (const std::exception&) {
    }
  }
  return k;
}

// markupsafe's escape.
std::string html_escape(const std::string& s) {
  std::string r;
  for (char c : s) {
    switch (c) {
      case '&': r += "&amp;"; break;
      case '<': r += "&lt;"; break;
      case '>': r += "&gt;"; break;
      case '"': r += "&#34;"; break;
      case '\'': r += "&#39;"; break;
      default: r += c;
    }
  }
  return r;
}

// Python's repr of a float: the shortest text that reads back, with ".0" on whole numbers.
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eE") == std::string::npos && s.find("inf") == std::string::npos) s += ".0";
  // to_chars writes 1e+20 as "1e+20"; Python writes "1e+20" too.
  return s;
}

std::string py_repr(const json& v);

std::string py_str(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "None";
    case json::value_t::boolean: return v.get<bool>() ? "True" : "False";
    case json::value_t::number_integer: return std::to_string(v.get<int64_t>());
    case json::value_t::number_unsigned: return std::to_string(v.get<uint64_t>());
    case json::value_t::number_float: return py_float(v.get<double>());
    case json::value_t::string: return v.get<std::string>();
    default: return py_repr(v);
  }
}

std::string py_repr(const json& v) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
    std::string out(1, dq ? '"' : '\'');
    for (char c : s) {
      if (c == '\\') out += "\\\\";
      else if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c == '\r') out += "\\r";
      else if (c == (dq ? '"' : '\'')) out += std::string("\\") + c;
      else out += c;
    }
    return out + (dq ? '"' : '\'');
  }
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + py_repr(v[i]);
    return out + "]";
  }
  if (v.is_object()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      out += (first ? "" : ", ") + py_repr(key_json(k)) + ": " + py_repr(x);
      first = false;
    }
    return out + "}";
  }
  return py_str(v);
}

bool truthy(const Value& v) {
  if (v.k == Value::K::kUndef) return false;
  if (v.k != Value::K::kJson) return true;
  const json& j = v.j;
  switch (j.type()) {
    case json::value_t::null: return false;
    case json::value_t::boolean: return j.get<bool>();
    case json::value_t::number_integer: return j.get<int64_t>() != 0;
    case json::value_t::number_unsigned: return j.get<uint64_t>() != 0;
    case json::value_t::number_float: return j.get<double>() != 0.0;
    case json::value_t::string: return !j.get_ref<const std::string&>().empty();
    case json::value_t::array:
    case json::value_t::object: return !j.empty();
    default: return true;
  }
}

// ---------------------------------------------------------------------------------------------
// Lexing the template into text and tags.

struct Piece {
  enum class K { kText, kExpr, kBlock } k;
  std::string text;  // the text, or the tag's inside
  int line;
};

bool space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::vector<Piece> lex(const std::string& src, const std::string& origin) {
  std::vector<Piece> out;
  size_t i = 0;
  int line = 1;
  bool strip_next = false;  // a "-" closing the previous tag: strip leading whitespace
  bool trim_newline = false;  // trim_blocks: drop one newline after a block tag
  auto line_at = [&](size_t upto) {
    for (size_t k = i; k < upto; ++k) line += src[k] == '\n';
  };
  while (i < src.size()) {
    size_t open = src.find('{', i);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' &&
           src[open + 1] != '#') {
      open = src.find('{', open + 1);
    }
    if (open != std::string::npos && open + 1 >= src.size()) open = std::string::npos;
    const std::string raw = src.substr(i, open == std::string::npos ? std::string::npos : open - i);
    std::string text = raw;
    if (trim_newline && !text.empty() && text[0] == '\n') text.erase(0, 1);
    else if (trim_newline && text.size() > 1 && text[0] == '\r' && text[1] == '\n') text.erase(0, 2);
    if (strip_next) {
      size_t k = 0;
      while (k < text.size() && space(text[k])) ++k;
      text.erase(0, k);
    }
    strip_next = trim_newline = false;
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({Piece::K::kText, text, line});
      break;
    }
    const char kind = src[open + 1];
    const bool minus = open + 2 < src.size() && src[open + 2] == '-';
    const bool plus = open + 2 < src.size() && src[open + 2] == '+';
    if (minus) {
      while (!text.empty() && space(text.back())) text.pop_back();
    } else if ((kind == '%' || kind == '#') && !plus) {
      // lstrip_blocks: the spaces and tabs between a line's start and the tag, when only they
      // stand there (the line starts after a newline of this text, or at the template's start).
      const size_t nl = raw.rfind('\n');
      const size_t tail = nl == std::string::npos ? 0 : nl + 1;
      const bool blanks = raw.find_first_not_of(" \t", tail) == std::string::npos;
      if (blanks && (nl != std::string::npos || i == 0)) {
        const size_t cut = raw.size() - tail;
        text.resize(text.size() >= cut ? text.size() - cut : 0);
      }
    }
    if (!text.empty()) out.push_back({Piece::K::kText, text, line});
    line_at(open);
    i = open;
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    size_t start = open + 2 + (minus || plus ? 1 : 0);
    size_t end = std::string::npos;
    if (kind == '#') {
      end = src.find("#}", start);
    } else {
      // The closing delimiter outside string literals.
      char quote = 0;
      for (size_t k = start; k + 1 < src.size(); ++k) {
        const char c = src[k];
        if (quote) {
          if (c == '\\') ++k;
          else if (c == quote) quote = 0;
          continue;
        }
        if (c == '\'' || c == '"') quote = c;
        else if (c == close[0] && src[k + 1] == close[1]) {
          end = k;
          break;
        }
      }
    }
    TS_CHECK(end != std::string::npos, origin, " line ", line, ": a tag opened with '{", kind, "' is never closed");
    size_t inner_end = end;
    bool close_minus = inner_end > start && src[inner_end - 1] == '-';
    if (close_minus) --inner_end;
    const std::string inner = src.substr(start, inner_end - start);
    if (kind == '{') out.push_back({Piece::K::kExpr, inner, line});
    else if (kind == '%') out.push_back({Piece::K::kBlock, inner, line});
    line_at(end + 2);
    i = end + 2;
    strip_next = close_minus;
    trim_newline = !close_minus && kind != '{';
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Expression tokens and the tree.

struct Tok {
  enum class K { kName, kInt, kFloat, kStr, kOp, kEnd } k;
  std::string s;
  int64_t i = 0;
  double f = 0;
};

std::vector<Tok> tokenize(const std::string& s, const std::string& where) {
  std::vector<Tok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (space(c)) {
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Tok::K::kName, s.substr(i, j - i)});
      i = j;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        is_float = true;
        ++j;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
        size_t k = j + 1;
        if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
        if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
          is_float = true;
          j = k;
          while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
        }
      }
      std::string num = s.substr(i, j - i);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Tok t{is_float ? Tok::K::kFloat : Tok::K::kInt, num};
      try {
        if (is_float) t.f = std::stod(num);
        else t.i = std::stoll(num);
      } catch (const std::exception&) {
        TS_CHECK(false, where, ": the number ", num, " is out of range");
      }
      out.push_back(t);
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          switch (e) {
            case 'n': v += '\n'; break;
            case 't': v += '\t'; break;
            case 'r': v += '\r'; break;
            case '\\': v += '\\'; break;
            case '\'': v += '\''; break;
            case '"': v += '"'; break;
            case '0': v += '\0'; break;
            case 'u': {
              TS_CHECK(j + 4 < s.size(), where, ": a \\u escape needs four hex digits");
              const uint32_t cp = static_cast<uint32_t>(std::stoul(s.substr(j + 1, 4), nullptr, 16));
              j += 4;
              if (cp < 0x80) v += static_cast<char>(cp);
              else if (cp < 0x800) v += {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
              else v += {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
                         static_cast<char>(0x80 | (cp & 0x3F))};
              break;
            }
            default: v += '\\'; v += e; break;
          }
        } else {
          v += s[j];
        }
      }
      TS_CHECK(j < s.size(), where, ": a string literal is not closed");
      out.push_back({Tok::K::kStr, v});
      i = j + 1;
      continue;
    }
    static const char* const ops[] = {"**", "//", "==", "!=", "<=", ">=", "(", ")", "[", "]", "{", "}", ".", ",", ":",
                                      "|",  "~",  "+",  "-",  "*",  "/",  "%", "<", ">", "="};
    bool matched = false;
    for (const char* op : ops) {
      const size_t n = std::char_traits<char>::length(op);
      if (s.compare(i, n, op) == 0) {
        out.push_back({Tok::K::kOp, op});
        i += n;
        matched = true;
        break;
      }
    }
    TS_CHECK(matched, where, ": unexpected character '", std::string(1, c), "'");
  }
  out.push_back({Tok::K::kEnd, ""});
  return out;
}

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

NodeP node(Node::K k, int line) {
  auto n = std::make_shared<Node>();
  n->k = k;
  n->line = line;
  return n;
}

class ExprParser {
 public:
  ExprParser(const std::string& s, std::string where, int line) : where_(std::move(where)), line_(line) {
    toks_ = tokenize(s, where_);
  }
  NodeP parse_all() {
    NodeP e = expr();
    expect_end();
    return e;
  }
  NodeP expr() { return conditional(); }
  bool at_end() const { return toks_[p_].k == Tok::K::kEnd; }
  void expect_end() { TS_CHECK(at_end(), where_, ": unexpected '", toks_[p_].s, "'"); }
  bool accept_name(const char* n) {
    if (toks_[p_].k == Tok::K::kName && toks_[p_].s == n) {
      ++p_;
      return true;
    }
    return false;
  }
  bool accept_op(const char* o) {
    if (toks_[p_].k == Tok::K::kOp && toks_[p_].s == o) {
      ++p_;
      return true;
    }
    return false;
  }
  void expect_op(const char* o) { TS_CHECK(accept_op(o), where_, ": expected '", o, "', found '", toks_[p_].s, "'"); }
  std::string name() {
    TS_CHECK(toks_[p_].k == Tok::K::kName, where_, ": expected a name, found '", toks_[p_].s, "'");
    return toks_[p_++].s;
  }
  bool peek_name(const char* n) const { return toks_[p_].k == Tok::K::kName && toks_[p_].s == n; }
  // Call arguments after "(": positional, then name=value.
  void args(Node& n) {
    std::vector<NodeP> kw;
    while (!accept_op(")")) {
      if (toks_[p_].k == Tok::K::kName && toks_[p_ + 1].k == Tok::K::kOp && toks_[p_ + 1].s == "=") {
        n.kw_names.push_back(toks_[p_].s);
        p_ += 2;
        kw.push_back(expr());
      } else {
        TS_CHECK(kw.empty(), where_, ": a positional argument after a keyword argument");
        n.kids.push_back(expr());
      }
      if (!accept_op(",")) {
        expect_op(")");
        break;
      }
    }
    n.kids.insert(n.kids.end(), kw.begin(), kw.end());
  }
  int depth_ = 0;

 private:
  struct Guard {
    int& d;
    Guard(int& d_, const std::string& where) : d(d_) { TS_CHECK(++d <= kMaxDepth, where, ": expression nested too deeply"); }
    ~Guard() { --d; }
  };
  NodeP conditional() {
    Guard g(depth_, where_);
    NodeP a = or_expr();
    if (accept_name("if")) {
      NodeP c = or_expr();
      NodeP b;
      if (accept_name("else")) b = conditional();
      NodeP n = node(Node::K::kCond, line_);
      n->kids = {c, a, b};
      return n;
    }
    return a;
  }
  NodeP or_expr() {
    NodeP a = and_expr();
    while (accept_name("or")) {
      NodeP n = node(Node::K::kOr, line_);
      n->kids = {a, and_expr()};
      a = n;
    }
    return a;
  }
  NodeP and_expr() {
    NodeP a = not_expr();
    while (accept_name("and")) {
      NodeP n = node(Node::K::kAnd, line_);
      n->kids = {a, not_expr()};
      a = n;
    }
    return a;
  }
  NodeP not_expr() {
    if (accept_name("not")) {
      Guard g(depth_, where_);
      NodeP n = node(Node::K::kNot, line_);
      n->kids = {not_expr()};
      return n;
    }
    return compare();
  }
  NodeP compare() {
    NodeP a = concat();
    for (;;) {
      const Tok& t = toks_[p_];
      std::string op;
      bool negate = false;
      if (t.k == Tok::K::kOp && (t.s == "==" || t.s == "!=" || t.s == "<" || t.s == "<=" || t.s == ">" || t.s == ">=")) {
        op = t.s;
        ++p_;
      } else if (accept_name("in")) {
        op = "in";
      } else if (peek_name("not") && toks_[p_ + 1].k == Tok::K::kName && toks_[p_ + 1].s == "in") {
        p_ += 2;
        op = "in";
        negate = true;
      } else if (accept_name("is")) {
        NodeP n = node(Node::K::kTest, line_);
        n->negate = accept_name("not");
        n->name = name();
        n->kids.push_back(a);
        if (accept_op("(")) {
          args(*n);
        } else if (!at_end() && toks_[p_].k != Tok::K::kOp && !peek_name("and") && !peek_name("or") &&
                   !peek_name("else") && !peek_name("if") && !peek_name("is")) {
          n->kids.push_back(concat());  // "is divisibleby 3", "is equalto x"
        }
        a = n;
        continue;
      } else {
        return a;
      }
      NodeP n = node(Node::K::kBinary, line_);
      n->name = op;
      n->negate = negate;
      n->kids = {a, concat()};
      a = n;
    }
  }
  NodeP concat() {
    NodeP a = additive();
    while (accept_op("~")) {
      NodeP n = node(Node::K::kBinary, line_);
      n->name = "~";
      n->kids = {a, additive()};
      a = n;
    }
    return a;
  }
  NodeP additive() {
    NodeP a = multiplicative();
    for (;;) {
      std::string op;
      if (accept_op("+")) op = "+";
      else if (accept_op("-")) op = "-";
      else return a;
      NodeP n = node(Node::K::kBinary, line_);
      n->name = op;
      n->kids = {a, multiplicative()};
      a = n;
    }
  }
  NodeP multiplicative() {
    NodeP a = power();
    for (;;) {
      std::string op;
      if (accept_op("*")) op = "*";
      else if (accept_op("//")) op = "//";
      else if (accept_op("/")) op = "/";
      else if (accept_op("%")) op = "%";
      else return a;
      NodeP n = node(Node::K::kBinary, line_);
      n->name = op;
      n->kids = {a, power()};
      a = n;
    }
  }
  // jinja2's parse_pow: unary operands, left to right.
  NodeP power() {
    NodeP a = unary(true);
    while (accept_op("**")) {
      NodeP n = node(Node::K::kBinary, line_);
      n->name = "**";
      n->kids = {a, unary(true)};
      a = n;
    }
    return a;
  }
  // jinja2's parse_unary: a sign applies to the operand's primary and its postfix (-x.y is
  // -(x.y)); filters apply to the signed value (-x|abs is abs(-x)).
  NodeP unary(bool with_filter) {
    Guard g(depth_, where_);
    NodeP a;
    if (accept_op("-")) {
      a = node(Node::K::kUnary, line_);
      a->name = "-";
      a->kids = {unary(false)};
    } else if (accept_op("+")) {
      a = unary(false);
    } else {
      a = primary();
    }
    a = postfix(a);
    return with_filter ? filters(a) : a;
  }
  NodeP postfix(NodeP a) {
    for (;;) {
      if (accept_op(".")) {
        NodeP n = node(Node::K::kAttr, line_);
        n->name = toks_[p_].k == Tok::K::kInt ? std::to_string(toks_[p_++].i) : name();
        n->kids = {a};
        a = n;
      } else if (accept_op("[")) {
        NodeP lo, hi, st;
        bool slice = false;
        if (!(toks_[p_].k == Tok::K::kOp && toks_[p_].s == ":")) lo = expr();
        if (accept_op(":")) {
          slice = true;
          if (!(toks_[p_].k == Tok::K::kOp && (toks_[p_].s == "]" || toks_[p_].s == ":"))) hi = expr();
          if (accept_op(":") && !(toks_[p_].k == Tok::K::kOp && toks_[p_].s == "]")) st = expr();
        }
        expect_op("]");
        NodeP n = node(slice ? Node::K::kSlice : Node::K::kItem, line_);
        n->kids = {a, lo, hi, st};
        if (!slice) n->kids = {a, lo};
        a = n;
      } else if (accept_op("(")) {
        NodeP n = node(Node::K::kCall, line_);
        n->kids.push_back(a);
        args(*n);
        a = n;
      } else {
        return a;
      }
    }
  }
  NodeP filters(NodeP a) {
    while (accept_op("|")) {
      NodeP n = node(Node::K::kFilter, line_);
      n->name = name();
      while (accept_op(".")) n->name += "." + name();
      n->kids.push_back(a);
      if (accept_op("(")) args(*n);
      a = postfix(n);  // a filter's result takes attributes, items and calls too
    }
    return a;
  }
  NodeP primary() {
    const Tok t = toks_[p_];
    if (t.k == Tok::K::kEnd) TS_CHECK(false, where_, ": an expression is missing");
    ++p_;
    NodeP n = node(Node::K::kLit, line_);
    switch (t.k) {
      case Tok::K::kInt: n->lit = t.i; return n;
      case Tok::K::kFloat: n->lit = t.f; return n;
      case Tok::K::kStr: {
        std::string s = t.s;
        while (toks_[p_].k == Tok::K::kStr) s += toks_[p_++].s;  // adjacent literals join
        n->lit = s;
        return n;
      }
      case Tok::K::kName:
        if (t.s == "true" || t.s == "True") n->lit = true;
        else if (t.s == "false" || t.s == "False") n->lit = false;
        else if (t.s == "none" || t.s == "None") n->lit = nullptr;
        else {
          n->k = Node::K::kName;
          n->name = t.s;
        }
        return n;
      default: break;
    }
    if (t.s == "(") {
      if (accept_op(")")) {
        n->k = Node::K::kList;
        return n;
      }
      NodeP e = expr();
      if (accept_op(",")) {  // a tuple: a list here
        NodeP l = node(Node::K::kList, line_);
        l->kids.push_back(e);
        while (!accept_op(")")) {
          l->kids.push_back(expr());
          if (!accept_op(",")) {
            expect_op(")");
            break;
          }
        }
        return l;
      }
      expect_op(")");
      return e;
    }
    if (t.s == "[") {
      n->k = Node::K::kList;
      while (!accept_op("]")) {
        n->kids.push_back(expr());
        if (!accept_op(",")) {
          expect_op("]");
          break;
        }
      }
      return n;
    }
    if (t.s == "{") {
      n->k = Node::K::kDict;
      while (!accept_op("}")) {
        n->kids.push_back(expr());
        expect_op(":");
        n->kids.push_back(expr());
        if (!accept_op(",")) {
          expect_op("}");
          break;
        }
      }
      return n;
    }
    TS_CHECK(false, where_, ": unexpected '", t.s, "'");
    return n;
  }

  std::string where_;
  int line_;
  std::vector<Tok> toks_;
  size_t p_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Statements.

struct Parser {
  std::vector<Piece> pieces;
  std::string origin;
  size_t p = 0;
  int depth = 0;

  std::string where(int line) const { return concat(origin, " line ", line); }

  // Parses nodes until a block tag whose first word is in `ends` (returned, not consumed), or
  // the end (only when `ends` is empty).
  std::vector<NodeP> body(const std::set<std::string>& ends, std::string* end_word) {
    TS_CHECK(++depth <= kMaxDepth, where(p < pieces.size() ? pieces[p].line : 0), ": blocks nested too deeply");
    std::vector<NodeP> out;
    while (p < pieces.size()) {
      const Piece& pc = pieces[p];
      if (pc.k == Piece::K::kText) {
        NodeP n = node(Node::K::kText, pc.line);
        n->lit = pc.text;
        out.push_back(n);
        ++p;
        continue;
      }
      if (pc.k == Piece::K::kExpr) {
        NodeP n = node(Node::K::kOutput, pc.line);
        n->kids.push_back(ExprParser(pc.text, where(pc.line), pc.line).parse_all());
        out.push_back(n);
        ++p;
        continue;
      }
      ExprParser ep(pc.text, where(pc.line), pc.line);
      const std::string word = ep.name();
      if (ends.count(word)) {
        *end_word = word;
        --depth;
        return out;
      }
      ++p;
      out.push_back(statement(word, ep, pc.line));
    }
    TS_CHECK(ends.empty(), origin, ": the template ends inside a block (expected ",
             [&] {
               std::string s;
               for (const auto& e : ends) s += (s.empty() ? "" : " or ") + e;
               return s;
             }(),
             ")");
    --depth;
    return out;
  }

  // The tag at p, which `body` stopped at.
  ExprParser tag_after(const std::string& word) {
    const Piece& pc = pieces[p++];
    ExprParser ep(pc.text, where(pc.line), pc.line);
    ep.name();
    (void)word;
    return ep;
  }

  NodeP statement(const std::string& word, ExprParser& ep, int line) {
    std::string end;
    if (word == "if") {
      NodeP n = node(Node::K::kIf, line);
      n->kids.push_back(ep.expr());
      ep.expect_end();
      for (;;) {
        n->bodies.push_back(body({"elif", "else", "endif"}, &end));
        ExprParser t = tag_after(end);
        if (end == "elif") {
          n->kids.push_back(t.expr());
          t.expect_end();
        } else if (end == "else") {
          t.expect_end();
          n->bodies.push_back(body({"endif"}, &end));
          tag_after(end).expect_end();
          break;
        } else {
          t.expect_end();
          break;
        }
      }
      return n;
    }
    if (word == "for") {
      NodeP n = node(Node::K::kFor, line);
      n->targets.push_back(ep.name());
      while (ep.accept_op(",")) n->targets.push_back(ep.name());
      TS_CHECK(ep.accept_name("in"), where(line), ": expected 'in' in a for tag");
      // "for x in xs if cond": the conditional expression's test is the loop filter.
      filter_ = nullptr;
      NodeP iter = or_chain(ep);
      NodeP cond = filter_;
      if (!cond && ep.accept_name("if")) cond = ep.expr();
      n->kids.push_back(iter);
      n->kids.push_back(cond);
      ep.accept_name("recursive");
      ep.expect_end();
      n->bodies.push_back(body({"else", "endfor"}, &end));
      ExprParser t = tag_after(end);
      t.expect_end();
      if (end == "else") {
        n->bodies.push_back(body({"endfor"}, &end));
        tag_after(end).expect_end();
      }
      return n;
    }
    if (word == "set") {
      std::string target = ep.name();
      std::string attr;
      if (ep.accept_op(".")) attr = ep.name();
      std::vector<std::string> more;
      while (ep.accept_op(",")) more.push_back(ep.name());
      if (ep.accept_op("=")) {
        NodeP n = node(Node::K::kSet, line);
        n->targets = {target};
        n->targets.insert(n->targets.end(), more.begin(), more.end());
        n->name = attr;
        n->kids.push_back(ep.expr());
        ep.expect_end();
        return n;
      }
      NodeP n = node(Node::K::kSetBlock, line);
      n->targets = {target};
      n->name = attr;
      if (ep.accept_op("|")) {  // {% set x | filter %}
        NodeP f = node(Node::K::kFilter, line);
        f->name = ep.name();
        if (ep.accept_op("(")) ep.args(*f);
        n->kids.push_back(f);
      }
      ep.expect_end();
      n->bodies.push_back(body({"endset"}, &end));
      tag_after(end).expect_end();
      return n;
    }
    if (word == "macro") {
      NodeP n = node(Node::K::kMacro, line);
      n->name = ep.name();
      auto m = std::make_shared<Macro>();
      ep.expect_op("(");
      while (!ep.accept_op(")")) {
        m->params.push_back(ep.name());
        m->defaults.push_back(ep.accept_op("=") ? ep.expr() : nullptr);
        if (!ep.accept_op(",")) {
          ep.expect_op(")");
          break;
        }
      }
      ep.expect_end();
      m->body = body({"endmacro"}, &end);
      tag_after(end);
      n->macro = m;
      return n;
    }
    if (word == "call") {  // {% call name(args) %}body{% endcall %}: caller() renders the body
      NodeP n = node(Node::K::kCallBlock, line);
      n->kids.push_back(ep.expr());
      ep.expect_end();
      n->bodies.push_back(body({"endcall"}, &end));
      tag_after(end);
      return n;
    }
    if (word == "filter") {
      NodeP n = node(Node::K::kFilterBlock, line);
      NodeP f = node(Node::K::kFilter, line);
      f->name = ep.name();
      if (ep.accept_op("(")) ep.args(*f);
      ep.expect_end();
      n->kids.push_back(f);
      n->bodies.push_back(body({"endfilter"}, &end));
      tag_after(end);
      return n;
    }
    if (word == "generation") {  // transformers' assistant-mask marker: the body as is
      ep.expect_end();
      NodeP n = node(Node::K::kIf, line);
      NodeP yes = node(Node::K::kLit, line);
      yes->lit = true;
      n->kids.push_back(yes);
      n->bodies.push_back(body({"endgeneration"}, &end));
      tag_after(end);
      return n;
    }
    if (word == "break" || word == "continue") {
      ep.expect_end();
      return node(word == "break" ? Node::K::kBreak : Node::K::kContinue, line);
    }
    TS_CHECK(false, where(line), ": unknown tag '", word, "'");
    return nullptr;
  }

  // The iterable of a for tag: an expression without its conditional form, so that "for x in xs
  // if cond" leaves "if cond" as the loop filter.
  NodeP or_chain(ExprParser& ep) {
    // Parse a full expression, then undo a top-level conditional that came from the filter.
    NodeP e = ep.expr();
    if (e->k == Node::K::kCond && !e->kids[2]) {
      // "xs if cond" (no else): the filter.
      NodeP cond = e->kids[0];
      filter_ = cond;
      return e->kids[1];
    }
    return e;
  }
  NodeP filter_;
};

// ---------------------------------------------------------------------------------------------
// Rendering.

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

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    static const std::set<std::string> builtins = {"range", "namespace", "raise_exception", "strftime_now", "dict",
                                                   "caller", "joiner", "cycler"};
    if (builtins.count(name)) {
      Value v;
      v.k = Value::K::kBuiltin;
      v.builtin = name;
      return v;
    }
    return {};
  }
  Value* find_var(const std::string& name) {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return &f->second;
    }
    return nullptr;
  }

  void step(int line, int64_t n = 1) {
    steps_ += n;
    if (steps_ > kMaxSteps) fail(line, concat("rendering took more than ", kMaxSteps, " steps"));
  }

  const json& need_json(const Value& v, int line, const char* what) const {
    if (v.k != Value::K::kJson) fail(line, concat(what, ": the value is ", v.undefined() ? "undefined" : "a callable"));
    return v.j;
  }

  static bool is_num(const json& j) { return j.is_number(); }
  static double num(const json& j) { return j.get<double>(); }

  Value binary(const Node& n, const Value& a, const Value& b) {
    const std::string& op = n.name;
    if (op == "~") return Value::of(to_str(a) + to_str(b));
    if (op == "==" || op == "!=") {
      bool eq;
      if (a.undefined() || b.undefined()) eq = a.undefined() && b.undefined();
      else if (a.k != Value::K::kJson || b.k != Value::K::kJson) eq = false;
      else eq = a.j == b.j;
      return Value::of(op == "==" ? eq : !eq);
    }
    if (op == "in") {
      bool r = false;
      if (!b.undefined()) {
        const json& c = need_json(b, n.line, "'in'");
        if (c.is_string()) r = a.k == Value::K::kJson && a.j.is_string() &&
                               c.get_ref<const std::string&>().find(a.j.get_ref<const std::string&>()) != std::string::npos;
        else if (c.is_array()) r = a.k == Value::K::kJson && std::find(c.begin(), c.end(), a.j) != c.end();
        else if (c.is_object()) r = a.k == Value::K::kJson && (a.j.is_string() || a.j.is_number_integer()) && c.contains(dict_key(a.j));
        else fail(n.line, concat("'in' needs a string, list or mapping on the right, got ", c.type_name()));
      }
      return Value::of(n.negate ? !r : r);
    }
    const json& x = need_json(a, n.line, op.c_str());
    const json& y = need_json(b, n.line, op.c_str());
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      bool r;
      if (is_num(x) && is_num(y)) {
        const double p = num(x), q = num(y);
        r = op == "<" ? p < q : op == "<=" ? p <= q : op == ">" ? p > q : p >= q;
      } else if (x.is_string() && y.is_string()) {
        const auto& p = x.get_ref<const std::string&>();
        const auto& q = y.get_ref<const std::string&>();
        r = op == "<" ? p < q : op == "<=" ? p <= q : op == ">" ? p > q : p >= q;
      } else {
        fail(n.line, concat("cannot compare ", x.type_name(), " and ", y.type_name(), " with ", op));
      }
      return Value::of(r);
    }
    if (op == "+") {
      if (x.is_string() && y.is_string()) {
        if (!a.safe && !b.safe) return Value::of(x.get<std::string>() + y.get<std::string>());
        // Markup.__add__ / __radd__: the plain operand is escaped, the result is Markup.
        Value r = Value::of((a.safe ? x.get<std::string>() : html_escape(x.get<std::string>())) +
                            (b.safe ? y.get<std::string>() : html_escape(y.get<std::string>())));
        r.safe = true;
        return r;
      }
      if (x.is_array() && y.is_array()) {
        json r = x;
        for (const auto& e : y) r.push_back(e);
        return Value::of(r);
      }
    }
    if (op == "*" && ((x.is_string() && y.is_number_integer()) || (y.is_string() && x.is_number_integer()))) {
      const std::string& s = x.is_string() ? x.get_ref<const std::string&>() : y.get_ref<const std::string&>();
      const int64_t times = x.is_string() ? y.get<int64_t>() : x.get<int64_t>();
      if (times > 0 && s.size() * static_cast<size_t>(times) > kMaxOutput) fail(n.line, "a string repeated past the output limit");
      std::string r;
      for (int64_t i = 0; i < times; ++i) r += s;
      return Value::of(r);
    }
    if (!(is_num(x) || x.is_boolean()) || !(is_num(y) || y.is_boolean())) {
      fail(n.line, concat("unsupported operand types for ", op, ": ", x.type_name(), " and ", y.type_name()));
    }
    const bool ints = (x.is_number_integer() || x.is_boolean()) && (y.is_number_integer() || y.is_boolean());
    auto as_int = [](const json& j) { return j.is_boolean() ? int64_t{j.get<bool>()} : j.get<int64_t>(); };
    auto as_dbl = [](const json& j) { return j.is_boolean() ? double{j.get<bool>() ? 1.0 : 0.0} : j.get<double>(); };
    if (ints && op != "/" && op != "**") {
      const int64_t p = as_int(x), q = as_int(y);
      if (op == "+") return Value::of(p + q);
      if (op == "-") return Value::of(p - q);
      if (op == "*") return Value::of(p * q);
      if (q == 0) fail(n.line, "division by zero");
      if (op == "//") return Value::of(p / q - ((p % q != 0) && ((p < 0) != (q < 0)) ? 1 : 0));
      if (op == "%") {
        int64_t r = p % q;
        if (r != 0 && ((r < 0) != (q < 0))) r += q;
        return Value::of(r);
      }
    }
    const double p = as_dbl(x), q = as_dbl(y);
    if (op == "+") return Value::of(p + q);
    if (op == "-") return Value::of(p - q);
    if (op == "*") return Value::of(p * q);
    if (op == "**") {
      if (ints && as_int(y) >= 0) return Value::of(static_cast<int64_t>(std::llround(std::pow(p, q))));
      return Value::of(std::pow(p, q));
    }
    if (q == 0) fail(n.line, "division by zero");
    if (op == "/") return Value::of(p / q);
    if (op == "//") return Value::of(std::floor(p / q));
    if (op == "%") return Value::of(p - q * std::floor(p / q));
    fail(n.line, "unknown operator " + op);
  }

  std::string to_str(const Value& v) const {
    if (v.undefined()) return "";
    if (v.k != Value::K::kJson) return "<callable>";
    return py_str(v.j);
  }

  Value attr(const Value& base, const std::string& name, int line) {
    if (base.k != Value::K::kJson) return {};
    const json& b = base.j;
    if (b.is_object()) {
      if (b.contains(name)) return Value::of(b.at(name));
      static const std::set<std::string> dict_methods = {"items", "keys", "values", "get"};
      if (dict_methods.count(name)) return bound("dict." + name, b);
      return {};
    }
    if (b.is_string()) {
      static const std::set<std::string> str_methods = {"strip", "lstrip", "rstrip", "split", "startswith", "endswith",
                                                        "replace", "lower", "upper", "title", "capitalize", "find",
                                                        "rfind", "count", "splitlines", "join", "format", "rsplit"};
      if (str_methods.count(name)) return bound("str." + name, b);
      return {};
    }
    if (b.is_array()) {
      if (name == "append" || name == "index" || name == "count") return bound("list." + name, b);
      // A digit attribute (x.0) indexes, as Jinja's getattr falls back to items.
      if (!name.empty() && std::all_of(name.begin(), name.end(), ::isdigit)) return item(base, Value::of(std::stoll(name)), line);
    }
    return {};
  }
  static Value bound(const std::string& method, const json& self) {
    Value v;
    v.k = Value::K::kBuiltin;
    v.builtin = method;
    v.j = self;
    return v;
  }

  Value item(const Value& base, const Value& key, int line) {
    if (base.k != Value::K::kJson || key.k != Value::K::kJson) return {};
    const json& b = base.j;
    const json& k = key.j;
    if (b.is_object()) {
      if ((k.is_string() || k.is_number_integer()) && b.contains(dict_key(k))) return Value::of(b.at(dict_key(k)));
      if (k.is_string()) return attr(base, k.get<std::string>(), line);
      return {};
    }
    if ((b.is_array() || b.is_string()) && k.is_number_integer()) {
      int64_t i = k.get<int64_t>();
      const int64_t size = b.is_array() ? static_cast<int64_t>(b.size()) : static_cast<int64_t>(b.get_ref<const std::string&>().size());
      if (i < 0) i += size;
      if (i < 0 || i >= size) return {};
      if (b.is_array()) return Value::of(b[static_cast<size_t>(i)]);
      return Value::of(std::string(1, b.get_ref<const std::string&>()[static_cast<size_t>(i)]));
    }
    if (k.is_string()) return attr(base, k.get<std::string>(), line);
    return {};
  }

  Value slice(const Value& base, const Value& lo, const Value& hi, const Value& st, int line) {
    const json& b = need_json(base, line, "slice");
    if (!b.is_array() && !b.is_string()) fail(line, concat("cannot slice a ", b.type_name()));
    const int64_t size = b.is_array() ? static_cast<int64_t>(b.size()) : static_cast<int64_t>(b.get_ref<const std::string&>().size());
    int64_t step = st.k == Value::K::kJson && !st.j.is_null() ? st.j.get<int64_t>() : 1;
    if (step == 0) fail(line, "slice step cannot be zero");
    auto norm = [&](const Value& v, int64_t dflt) {
      if (v.k != Value::K::kJson || v.j.is_null()) return dflt;
      int64_t i = v.j.get<int64_t>();
      if (i < 0) i += size;
      if (step > 0) return std::clamp<int64_t>(i, 0, size);
      return std::clamp<int64_t>(i, -1, size - 1);
    };
    const int64_t start = norm(lo, step > 0 ? 0 : size - 1), stop = norm(hi, step > 0 ? size : -1);
    json out = b.is_array() ? json::array() : json("");
    std::string s;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (b.is_array()) out.push_back(b[static_cast<size_t>(i)]);
      else s += b.get_ref<const std::string&>()[static_cast<size_t>(i)];
    }
    return Value::of(b.is_array() ? out : json(s));
  }

  struct Args {
    std::vector<Value> pos;
    std::map<std::string, Value> kw;
    const Value* get(size_t i, const char* name) const {
      if (auto it = kw.find(name); it != kw.end()) return &it->second;
      return i < pos.size() ? &pos[i] : nullptr;
    }
  };
  Args eval_args(const Node& n, size_t first) {
    Args a;
    const size_t n_kw = n.kw_names.size();
    const size_t n_pos = n.kids.size() - first - n_kw;
    for (size_t i = 0; i < n_pos; ++i) a.pos.push_back(eval(*n.kids[first + i]));
    for (size_t i = 0; i < n_kw; ++i) a.kw[n.kw_names[i]] = eval(*n.kids[first + n_pos + i]);
    return a;
  }

  std::string str_arg(const Args& a, size_t i, const char* name, int line, const std::string& dflt = "") {
    const Value* v = a.get(i, name);
    if (!v || v->undefined() || (v->k == Value::K::kJson && v->j.is_null())) return dflt;
    return to_str(*v);
  }

  static std::string strip(const std::string& s, const std::string& chars, bool left, bool right) {
    size_t b = 0, e = s.size();
    auto in = [&](char c) { return chars.empty() ? space(c) : chars.find(c) != std::string::npos; };
    if (left) while (b < e && in(s[b])) ++b;
    if (right) while (e > b && in(s[e - 1])) --e;
    return s.substr(b, e - b);
  }

  Value call_method(const Value& f, const Args& a, int line) {
    const std::string& m = f.builtin;
    const json& self = f.j;
    if (m.rfind("str.", 0) == 0) {
      const std::string& s = self.get_ref<const std::string&>();
      const std::string name = m.substr(4);
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        return Value::of(strip(s, str_arg(a, 0, "chars", line), name != "rstrip", name != "lstrip"));
      }
      if (name == "lower" || name == "upper") {
        std::string r = s;
        for (char& c : r) c = static_cast<char>(name == "lower" ? std::tolower(static_cast<unsigned char>(c)) : std::toupper(static_cast<unsigned char>(c)));
        return Value::of(r);
      }
      if (name == "title" || name == "capitalize") return filter("title" == name ? "title" : "capitalize", Value::of(s), {}, line);
      if (name == "startswith" || name == "endswith") {
        const Value* v = a.get(0, "prefix");
        std::vector<std::string> opts;
        if (v && v->k == Value::K::kJson && v->j.is_array()) {
          for (const auto& e : v->j) opts.push_back(py_str(e));
        } else {
          opts.push_back(str_arg(a, 0, "prefix", line));
        }
        bool r = false;
        for (const auto& o : opts) {
          r = r || (name == "startswith" ? s.rfind(o, 0) == 0 : s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0);
        }
        return Value::of(r);
      }
      if (name == "split" || name == "rsplit") {
        const std::string sep = str_arg(a, 0, "sep", line);
        const Value* mx = a.get(1, "maxsplit");
        int64_t maxsplit = mx && mx->k == Value::K::kJson && mx->j.is_number_integer() ? mx->j.get<int64_t>() : -1;
        json out = json::array();
        if (sep.empty()) {
          size_t i = 0;
          while (i < s.size()) {
            while (i < s.size() && space(s[i])) ++i;
            if (i >= s.size()) break;
            size_t j = i;
            if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) j = s.size();
            else while (j < s.size() && !space(s[j])) ++j;
            out.push_back(maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit ? strip(s.substr(i), "", false, true) : s.substr(i, j - i));
            i = j;
          }
          return Value::of(out);
        }
        size_t i = 0;
        for (;;) {
          const size_t j = s.find(sep, i);
          if (j == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) {
            out.push_back(s.substr(i));
            break;
          }
          out.push_back(s.substr(i, j - i));
          i = j + sep.size();
        }
        return Value::of(out);
      }
      if (name == "splitlines") {
        json out = json::array();
        size_t i = 0;
        while (i < s.size()) {
          size_t j = s.find('\n', i);
          if (j == std::string::npos) j = s.size();
          std::string l = s.substr(i, j - i);
          if (!l.empty() && l.back() == '\r') l.pop_back();
          out.push_back(l);
          i = j + 1;
        }
        return Value::of(out);
      }
      if (name == "replace") {
        const std::string from = str_arg(a, 0, "old", line), to = str_arg(a, 1, "new", line);
        return Value::of(replace_all(s, from, to, line));
      }
      if (name == "find" || name == "rfind") {
        const std::string sub = str_arg(a, 0, "sub", line);
        const size_t r = name == "find" ? s.find(sub) : s.rfind(sub);
        return Value::of(r == std::string::npos ? int64_t{-1} : static_cast<int64_t>(r));
      }
      if (name == "count") {
        const std::string sub = str_arg(a, 0, "sub", line);
        int64_t c = 0;
        if (!sub.empty()) for (size_t i = s.find(sub); i != std::string::npos; i = s.find(sub, i + sub.size())) ++c;
        return Value::of(c);
      }
      if (name == "join") {
        const Value* v = a.get(0, "iterable");
        std::string r;
        if (v && v->k == Value::K::kJson && v->j.is_array()) {
          for (size_t i = 0; i < v->j.size(); ++i) r += (i ? s : "") + py_str(v->j[i]);
        }
        return Value::of(r);
      }
      if (name == "format") {
        std::string r;
        size_t next = 0;
        for (size_t i = 0; i < s.size(); ++i) {
          if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '}') {
            r += next < a.pos.size() ? to_str(a.pos[next++]) : "";
            ++i;
          } else {
            r += s[i];
          }
        }
        return Value::of(r);
      }
    }
    if (m.rfind("dict.", 0) == 0) {
      const std::string name = m.substr(5);
      if (name == "items") {
        json out = json::array();
        for (const auto& [k, v] : self.items()) out.push_back(json::array({key_json(k), v}));
        return Value::of(out);
      }
      if (name == "keys" || name == "values") {
        json out = json::array();
        for (const auto& [k, v] : self.items()) out.push_back(name == "keys" ? key_json(k) : v);
        return Value::of(out);
      }
      if (name == "get") {
        const std::string k = str_arg(a, 0, "key", line);
        if (self.contains(k)) return Value::of(self.at(k));
        const Value* d = a.get(1, "default");
        return d ? *d : Value::of(nullptr);
      }
    }
    if (m.rfind("list.", 0) == 0) {
      if (m == "list.append") fail(line, "list.append: templates cannot change their inputs here; build a new list with +");
      const Value* x = a.get(0, "value");
      int64_t c = 0, first = -1;
      for (size_t i = 0; i < self.size(); ++i) {
        if (x && x->k == Value::K::kJson && self[i] == x->j) {
          ++c;
          if (first < 0) first = static_cast<int64_t>(i);
        }
      }
      if (m == "list.count") return Value::of(c);
      if (first < 0) fail(line, "list.index: the value is not in the list");
      return Value::of(first);
    }
    fail(line, "unknown method " + m);
  }

  std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int line) {
    if (from.empty()) return s;
    std::string r;
    size_t i = 0;
    for (size_t j = s.find(from); j != std::string::npos; j = s.find(from, i)) {
      r += s.substr(i, j - i) + to;
      i = j + from.size();
      if (r.size() > kMaxOutput) fail(line, "replace: the result passes the output limit");
    }
    return r + s.substr(i);
  }

  Value call(const Node& n) {
    const Value f = eval(*n.kids[0]);
    Args a = eval_args(n, 1);
    return invoke(f, a, n.line);
  }

  Value invoke(const Value& f, const Args& a, int line) {
    if (f.k == Value::K::kMacro) return call_macro(*f.macro, a, line, nullptr);
    if (f.k != Value::K::kBuiltin) fail(line, "the value called is not callable");
    const std::string& b = f.builtin;
    if (b.find('.') != std::string::npos) return call_method(f, a, line);
    if (b == "raise_exception") fail(line, "raise_exception: " + str_arg(a, 0, "message", line));
    if (b == "range") {
      std::vector<int64_t> v;
      for (const auto& x : a.pos) {
        if (x.k != Value::K::kJson || !x.j.is_number_integer()) fail(line, "range: arguments must be integers");
        v.push_back(x.j.get<int64_t>());
      }
      int64_t lo = 0, hi = 0, st = 1;
      if (v.size() == 1) hi = v[0];
      else if (v.size() >= 2) lo = v[0], hi = v[1];
      if (v.size() == 3) st = v[2];
      if (st == 0 || v.empty() || v.size() > 3) fail(line, "range: bad arguments");
      const int64_t count = st > 0 ? (hi > lo ? (hi - lo + st - 1) / st : 0) : (lo > hi ? (lo - hi - st - 1) / -st : 0);
      step(line, count);  // a list's elements cost a step each, so the step bound covers them
      json out = json::array();
      for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) out.push_back(i);
      return Value::of(out);
    }
    if (b == "namespace" || b == "dict") {
      json o = json::object();
      for (const auto& [k, v] : a.kw) o[k] = v.k == Value::K::kJson ? v.j : json(nullptr);
      return Value::of(o);
    }
    if (b == "strftime_now") {
      const std::string fmt = str_arg(a, 0, "format", line);
      const std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      const size_t len = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
      return Value::of(std::string(buf, len));
    }
    if (b == "caller") {
      if (callers_.empty()) fail(line, "caller() outside a call block");
      const auto* body = callers_.back();
      callers_.pop_back();
      std::string out;
      render_body(*body, out);
      callers_.push_back(body);
      return Value::of(out);
    }
    fail(line, "'" + b + "' cannot be called here");
  }

  Value call_macro(const Macro& m, const Args& a, int line, const std::vector<NodeP>* caller_body) {
    if (++depth_ > kMaxDepth) fail(line, "macro calls nested too deeply");
    std::map<std::string, Value> scope;
    for (size_t i = 0; i < m.params.size(); ++i) {
      const Value* v = a.get(i, m.params[i].c_str());
      if (v) scope[m.params[i]] = *v;
      else if (m.defaults[i]) scope[m.params[i]] = eval(*m.defaults[i]);
    }
    scopes_.push_back(std::move(scope));
    if (caller_body) callers_.push_back(caller_body);
    std::string out;
    render_body(m.body, out);
    if (caller_body) callers_.pop_back();
    scopes_.pop_back();
    --depth_;
    return Value::of(out);
  }

  bool test(const std::string& name, const Value& v, const Args& a, int line) {
    const bool is_j = v.k == Value::K::kJson;
    const json& j = v.j;
    if (name == "defined") return !v.undefined();
    if (name == "undefined") return v.undefined();
    if (name == "none") return is_j && j.is_null();
    if (name == "string") return is_j && j.is_string();
    if (name == "number") return is_j && j.is_number();
    if (name == "integer") return is_j && j.is_number_integer();
    if (name == "float") return is_j && j.is_number_float();
    if (name == "boolean") return is_j && j.is_boolean();
    if (name == "true") return is_j && j.is_boolean() && j.get<bool>();
    if (name == "false") return is_j && j.is_boolean() && !j.get<bool>();
    if (name == "mapping") return is_j && j.is_object();
    if (name == "sequence" || name == "iterable") return is_j && (j.is_array() || j.is_string() || j.is_object());
    if (name == "callable") return v.k == Value::K::kMacro || v.k == Value::K::kBuiltin;
    if (name == "lower" || name == "upper") {
      if (!is_j || !j.is_string()) return false;
      const auto& s = j.get_ref<const std::string&>();
      return std::none_of(s.begin(), s.end(), [&](char c) { return name == "lower" ? std::isupper(static_cast<unsigned char>(c)) : std::islower(static_cast<unsigned char>(c)); });
    }
    const Value* arg = a.get(0, "value");
    if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") {
      return arg && is_j && arg->k == Value::K::kJson && j == arg->j;
    }
    if (name == "ne" || name == "!=") return !(arg && is_j && arg->k == Value::K::kJson && j == arg->j);
    if (name == "in") {
      Node fake;
      fake.k = Node::K::kBinary;
      fake.name = "in";
      fake.line = line;
      return arg && truthy(binary(fake, v, *arg));
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (!is_j || !j.is_number_integer()) fail(line, "test '" + name + "' needs an integer");
      const int64_t x = j.get<int64_t>();
      if (name == "odd") return x % 2 != 0;
      if (name == "even") return x % 2 == 0;
      if (!arg || arg->k != Value::K::kJson || !arg->j.is_number_integer() || arg->j.get<int64_t>() == 0) fail(line, "divisibleby needs a non-zero integer");
      return x % arg->j.get<int64_t>() == 0;
    }
    if (name == "gt" || name == "ge" || name == "lt" || name == "le" || name == "greaterthan" || name == "lessthan") {
      Node fake;
      fake.k = Node::K::kBinary;
      fake.line = line;
      fake.name = name == "gt" || name == "greaterthan" ? ">" : name == "ge" ? ">=" : name == "lt" || name == "lessthan" ? "<" : "<=";
      return arg && truthy(binary(fake, v, *arg));
    }
    fail(line, "unknown test '" + name + "'");
  }

  json list_of(const Value& v, int line, const char* what) {
    if (v.undefined()) return json::array();
    const json& j = need_json(v, line, what);
    if (j.is_array()) return j;
    if (j.is_object()) {
      json out = json::array();
      for (const auto& [k, x] : j.items()) out.push_back(key_json(k));
      return out;
    }
    if (j.is_string()) {
      json out = json::array();
      for (char c : j.get_ref<const std::string&>()) out.push_back(std::string(1, c));
      return out;
    }
    fail(line, concat(what, ": a ", j.type_name(), " is not iterable"));
  }

  json attr_of(const json& x, const std::string& path, int line) {
    Value v = Value::of(x);
    size_t i = 0;
    while (i <= path.size()) {
      size_t j = path.find('.', i);
      if (j == std::string::npos) j = path.size();
      v = attr(v, path.substr(i, j - i), line);
      i = j + 1;
    }
    return v.k == Value::K::kJson ? v.j : json();
  }

  Value filter(const std::string& name, const Value& v, const Args& a, int line) {
    if (name == "default" || name == "d") {
      const Value* dflt = a.get(0, "default_value");
      const Value* boolean = a.get(1, "boolean");
      const bool use = v.undefined() || (boolean && truthy(*boolean) && !truthy(v));
      return use ? (dflt ? *dflt : Value::of("")) : v;
    }
    if (name == "safe") {
      Value r = v.k == Value::K::kJson && v.j.is_string() ? v : Value::of(to_str(v));
      r.safe = true;
      return r;
    }
    if (name == "string" && v.k == Value::K::kJson && v.j.is_string()) return v;
    if (name == "dictsort") {  // (key, value) pairs sorted by key (case-insensitive) or value
      const json& j = need_json(v, line, "dictsort");
      if (!j.is_object()) fail(line, concat("dictsort of a ", j.type_name()));
      const Value* cs = a.get(0, "case_sensitive");
      const std::string by = str_arg(a, 1, "by", line, "key");
      const Value* rev = a.get(2, "reverse");
      const bool sensitive = cs && truthy(*cs);
      std::vector<std::pair<std::string, json>> items;
      for (const auto& [k, x] : j.items()) items.emplace_back(k, x);
      auto fold = [&](const json& x) {
        if (!x.is_string() || sensitive) return x;
        std::string s = x.get<std::string>();
        for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        return json(s);
      };
      std::stable_sort(items.begin(), items.end(), [&](const auto& p, const auto& q) {
        return by == "value" ? fold(p.second) < fold(q.second) : fold(key_json(p.first)) < fold(key_json(q.first));
      });
      if (rev && truthy(*rev)) std::reverse(items.begin(), items.end());
      json out = json::array();
      for (const auto& [k, x] : items) out.push_back(json::array({key_json(k), x}));
      return Value::of(out);
    }
    if (name == "string") return Value::of(to_str(v));
    if (name == "trim") return Value::of(strip(to_str(v), str_arg(a, 0, "chars", line), true, true));
    if (name == "upper" || name == "lower") {
      std::string r = to_str(v);
      for (char& c : r) c = static_cast<char>(name == "lower" ? std::tolower(static_cast<unsigned char>(c)) : std::toupper(static_cast<unsigned char>(c)));
      return Value::of(r);
    }
    if (name == "capitalize" || name == "title") {
      std::string r = to_str(v);
      bool start = true;
      for (size_t i = 0; i < r.size(); ++i) {
        const unsigned char c = static_cast<unsigned char>(r[i]);
        if (name == "capitalize") r[i] = static_cast<char>(i == 0 ? std::toupper(c) : std::tolower(c));
        else {
          r[i] = static_cast<char>(start ? std::toupper(c) : std::tolower(c));
          start = !std::isalnum(c);
        }
      }
      return Value::of(r);
    }
    if (name == "length" || name == "count") {
      if (v.undefined()) return Value::of(0);
      const json& j = need_json(v, line, "length");
      if (j.is_string()) {
        int64_t n = 0;  // code points, as Python's len
        for (unsigned char c : j.get_ref<const std::string&>()) n += (c & 0xC0) != 0x80;
        return Value::of(n);
      }
      if (j.is_array() || j.is_object()) return Value::of(static_cast<int64_t>(j.size()));
      fail(line, concat("length of a ", j.type_name()));
    }
    if (name == "first" || name == "last") {
      const json l = list_of(v, line, name.c_str());
      if (l.empty()) return {};
      return Value::of(name == "first" ? l.front() : l.back());
    }
    if (name == "join") {
      const json l = list_of(v, line, "join");
      const std::string sep = str_arg(a, 0, "d", line);
      const std::string at = str_arg(a, 1, "attribute", line);
      std::string r;
      for (size_t i = 0; i < l.size(); ++i) r += (i ? sep : "") + py_str(at.empty() ? l[i] : attr_of(l[i], at, line));
      return Value::of(r);
    }
    if (name == "tojson") {  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
      const Value* ea = a.get(0, "ensure_ascii");
      const Value* ind = a.get(1, "indent");
      const Value* sep = a.get(2, "separators");
      const Value* sk = a.get(3, "sort_keys");
      const int indent = ind && ind->k == Value::K::kJson && ind->j.is_number_integer() ? static_cast<int>(ind->j.get<int64_t>()) : -1;
      JsonStyle st;
      st.indent = indent;
      st.sort_keys = sk && truthy(*sk);
      st.ensure_ascii = ea && truthy(*ea);
      st.item_sep = indent >= 0 ? "," : ", ";
      if (sep && sep->k == Value::K::kJson && sep->j.is_array() && sep->j.size() == 2) {
        st.item_sep = py_str(sep->j[0]);
        st.key_sep = py_str(sep->j[1]);
      }
      if (v.undefined()) fail(line, "tojson of an undefined value");
      std::string out;
      py_json(need_json(v, line, "tojson"), st, 0, out);
      return Value::of(out);
    }
    if (name == "list") return Value::of(list_of(v, line, "list"));
    if (name == "items") {
      const json& j = need_json(v, line, "items");
      json out = json::array();
      if (j.is_object()) for (const auto& [k, x] : j.items()) out.push_back(json::array({key_json(k), x}));
      return Value::of(out);
    }
    if (name == "int" || name == "float") {
      const json& j = v.k == Value::K::kJson ? v.j : json(0);
      double d = 0;
      if (j.is_number()) d = j.get<double>();
      else if (j.is_boolean()) d = j.get<bool>();
      else if (j.is_string()) {
        try {
          d = std::stod(j.get<std::string>());
        } catch (const std::exception&) {
          d = 0;
        }
      }
      if (name == "int") return Value::of(j.is_number_integer() ? j.get<int64_t>() : static_cast<int64_t>(d));
      return Value::of(d);
    }
    if (name == "abs") {
      const json& j = need_json(v, line, "abs");
      if (j.is_number_integer()) return Value::of(std::llabs(j.get<int64_t>()));
      return Value::of(std::fabs(j.get<double>()));
    }
    if (name == "round") {
      const json& j = need_json(v, line, "round");
      const Value* pr = a.get(0, "precision");
      const int64_t p = pr && pr->k == Value::K::kJson ? pr->j.get<int64_t>() : 0;
      const double s = std::pow(10.0, static_cast<double>(p));
      return Value::of(std::round(j.get<double>() * s) / s);
    }
    if (name == "replace") {
      return Value::of(replace_all(to_str(v), str_arg(a, 0, "old", line), str_arg(a, 1, "new", line), line));
    }
    if (name == "reverse") {
      if (v.k == Value::K::kJson && v.j.is_string()) {
        std::string s = v.j.get<std::string>();
        std::reverse(s.begin(), s.end());
        return Value::of(s);
      }
      json l = list_of(v, line, "reverse");
      std::reverse(l.begin(), l.end());
      return Value::of(l);
    }
    if (name == "unique") {
      json out = json::array();
      for (const auto& x : list_of(v, line, "unique")) {
        if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
      }
      return Value::of(out);
    }
    if (name == "sort") {
      json l = list_of(v, line, "sort");
      const std::string at = str_arg(a, 2, "attribute", line);
      const Value* rev = a.get(0, "reverse");
      std::vector<json> items(l.begin(), l.end());
      std::stable_sort(items.begin(), items.end(), [&](const json& x, const json& y) {
        return at.empty() ? x < y : attr_of(x, at, line) < attr_of(y, at, line);
      });
      if (rev && truthy(*rev)) std::reverse(items.begin(), items.end());
      return Value::of(json(items));
    }
    if (name == "map") {
      const json l = truthy(v) ? list_of(v, line, "map") : json::array();  // jinja2: "if value:"
      json out = json::array();
      if (auto it = a.kw.find("attribute"); it != a.kw.end()) {
        for (const auto& x : l) out.push_back(attr_of(x, to_str(it->second), line));
        return Value::of(out);
      }
      const std::string f = str_arg(a, 0, "filter", line);
      Args rest;
      rest.pos.assign(a.pos.size() > 1 ? a.pos.begin() + 1 : a.pos.end(), a.pos.end());
      for (const auto& x : l) {
        Value r = filter(f, Value::of(x), rest, line);
        out.push_back(r.k == Value::K::kJson ? r.j : json());
      }
      return Value::of(out);
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      const json l = truthy(v) ? list_of(v, line, name.c_str()) : json::array();  // jinja2: "if value:"
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep = name == "selectattr" || name == "select";
      const size_t t0 = by_attr ? 1 : 0;
      const std::string at = by_attr ? str_arg(a, 0, "attribute", line) : "";
      const std::string tname = a.pos.size() > t0 ? to_str(a.pos[t0]) : "";
      Args targs;
      if (a.pos.size() > t0 + 1) targs.pos.assign(a.pos.begin() + static_cast<long>(t0) + 1, a.pos.end());
      json out = json::array();
      for (const auto& x : l) {
        Value item_v = Value::of(x);
        if (by_attr) {
          item_v = Value::of(x);
          Value got = x.is_object() && x.contains(at) ? Value::of(x.at(at)) : attr(Value::of(x), at, line);
          item_v = got;
        }
        const bool pass = tname.empty() ? truthy(item_v) : test(tname, item_v, targs, line);
        if (pass == keep) out.push_back(x);
      }
      return Value::of(out);
    }
    if (name == "sum") {
      double s = 0;
      bool ints = true;
      for (const auto& x : list_of(v, line, "sum")) {
        ints = ints && x.is_number_integer();
        s += x.is_number() ? x.get<double>() : 0;
      }
      return ints ? Value::of(static_cast<int64_t>(s)) : Value::of(s);
    }
    if (name == "max" || name == "min") {
      const json l = list_of(v, line, name.c_str());
      if (l.empty()) return {};
      json best = l[0];
      for (const auto& x : l) if (name == "max" ? best < x : x < best) best = x;
      return Value::of(best);
    }
    if (name == "indent") {
      const Value* w = a.get(0, "width");
      std::string pad = w && w->k == Value::K::kJson && w->j.is_string() ? w->j.get<std::string>()
                                                                          : std::string(static_cast<size_t>(w && w->k == Value::K::kJson ? w->j.get<int64_t>() : 4), ' ');
      const Value* first = a.get(1, "first");
      const Value* blank = a.get(2, "blank");
      const std::string s = to_str(v);
      std::string r;
      size_t i = 0;
      bool first_line = true;
      while (i <= s.size()) {
        size_t j = s.find('\n', i);
        const bool last = j == std::string::npos;
        if (last) j = s.size();
        const std::string l = s.substr(i, j - i);
        const bool ind = (first_line ? (first && truthy(*first)) : true) && (!l.empty() || (blank && truthy(*blank)));
        r += (ind ? pad : "") + l + (last ? "" : "\n");
        first_line = false;
        if (last) break;
        i = j + 1;
      }
      return Value::of(r);
    }
    if (name == "e" || name == "escape") {
      if (v.safe) return v;
      Value r = Value::of(html_escape(to_str(v)));
      r.safe = true;
      return r;
    }
    if (name == "wordcount") {
      int64_t n = 0;
      bool in = false;
      for (char c : to_str(v)) {
        if (space(c)) in = false;
        else if (!in) ++n, in = true;
      }
      return Value::of(n);
    }
    fail(line, "unknown filter '" + name + "'");
  }

  Value eval(const Node& n) {
    step(n.line);
    if (++depth_ > kMaxDepth * 2) fail(n.line, "expression evaluated too deeply");
    struct D {
      int& d;
      ~D() { --d; }
    } guard{depth_};
    switch (n.k) {
      case Node::K::kLit: return Value::of(n.lit);
      case Node::K::kName: return lookup(n.name);
      case Node::K::kList: {
        json out = json::array();
        for (const auto& k : n.kids) {
          Value v = eval(*k);
          out.push_back(v.k == Value::K::kJson ? v.j : json());
        }
        return Value::of(out);
      }
      case Node::K::kDict: {
        json out = json::object();
        for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
          Value k = eval(*n.kids[i]), v = eval(*n.kids[i + 1]);
          out[k.k == Value::K::kJson ? dict_key(k.j) : to_str(k)] = v.k == Value::K::kJson ? v.j : json();
        }
        return Value::of(out);
      }
      case Node::K::kAttr: return attr(eval(*n.kids[0]), n.name, n.line);
      case Node::K::kItem: return item(eval(*n.kids[0]), eval(*n.kids[1]), n.line);
      case Node::K::kSlice: {
        auto opt = [&](size_t i) { return n.kids[i] ? eval(*n.kids[i]) : Value(); };
        return slice(eval(*n.kids[0]), opt(1), opt(2), opt(3), n.line);
      }
      case Node::K::kCall: return call(n);
      case Node::K::kFilter: {
        Value v = eval(*n.kids[0]);
        return filter(n.name, v, eval_args(n, 1), n.line);
      }
      case Node::K::kTest: {
        Value v = eval(*n.kids[0]);
        const bool r = test(n.name, v, eval_args(n, 1), n.line);
        return Value::of(n.negate ? !r : r);
      }
      case Node::K::kUnary: {
        const Value operand = eval(*n.kids[0]);  // held: need_json returns a reference into it
        const json& j = need_json(operand, n.line, "unary -");
        if (j.is_number_integer()) return Value::of(-j.get<int64_t>());
        if (j.is_number()) return Value::of(-j.get<double>());
        fail(n.line, concat("bad operand for unary -: ", j.type_name()));
      }
      case Node::K::kBinary: {
        Value a = eval(*n.kids[0]);
        return binary(n, a, eval(*n.kids[1]));
      }
      case Node::K::kAnd: {
        Value a = eval(*n.kids[0]);
        return truthy(a) ? eval(*n.kids[1]) : a;
      }
      case Node::K::kOr: {
        Value a = eval(*n.kids[0]);
        return truthy(a) ? a : eval(*n.kids[1]);
      }
      case Node::K::kNot: return Value::of(!truthy(eval(*n.kids[0])));
      case Node::K::kCond:
        if (truthy(eval(*n.kids[0]))) return eval(*n.kids[1]);
        return n.kids[2] ? eval(*n.kids[2]) : Value();
      default: break;
    }
    fail(n.line, "not an expression");
  }

  void emit(std::string& out, const std::string& s, int line) {
    out += s;
    if (out.size() > kMaxOutput) fail(line, concat("the output passes ", kMaxOutput, " bytes"));
  }

  void assign(const std::string& name, const std::string& attr_name, const Value& v, int line) {
    if (attr_name.empty()) {
      scopes_.back()[name] = v;
      return;
    }
    Value* ns = find_var(name);
    if (!ns || ns->k != Value::K::kJson || !ns->j.is_object()) fail(line, "set " + name + "." + attr_name + ": " + name + " is not a namespace");
    ns->j[attr_name] = v.k == Value::K::kJson ? v.j : json();
  }

  void render_body(const std::vector<NodeP>& body, std::string& out) {
    for (const auto& n : body) render(*n, out);
  }

  void render(const Node& n, std::string& out) {
    step(n.line);
    switch (n.k) {
      case Node::K::kText: emit(out, n.lit.get_ref<const std::string&>(), n.line); return;
      case Node::K::kOutput: emit(out, to_str(eval(*n.kids[0])), n.line); return;
      case Node::K::kIf:
        for (size_t i = 0; i < n.kids.size(); ++i) {
          if (truthy(eval(*n.kids[i]))) {
            render_body(n.bodies[i], out);
            return;
          }
        }
        if (n.bodies.size() > n.kids.size()) render_body(n.bodies.back(), out);
        return;
      case Node::K::kFor: {
        const Value it = eval(*n.kids[0]);
        json items = list_of(it, n.line, "for");
        if (n.kids[1]) {  // the loop filter, with the loop variables bound
          json kept = json::array();
          for (const auto& x : items) {
            scopes_.emplace_back();
            bind_targets(n, x);
            if (truthy(eval(*n.kids[1]))) kept.push_back(x);
            scopes_.pop_back();
          }
          items = kept;
        }
        if (items.empty()) {
          if (n.bodies.size() > 1) render_body(n.bodies[1], out);
          return;
        }
        const int64_t len = static_cast<int64_t>(items.size());
        for (int64_t i = 0; i < len; ++i) {
          step(n.line);
          scopes_.emplace_back();
          bind_targets(n, items[static_cast<size_t>(i)]);
          json loop = {{"index", i + 1}, {"index0", i}, {"revindex", len - i}, {"revindex0", len - i - 1},
                       {"first", i == 0}, {"last", i == len - 1}, {"length", len}, {"depth", 1}, {"depth0", 0}};
          if (i > 0) loop["previtem"] = items[static_cast<size_t>(i - 1)];
          if (i + 1 < len) loop["nextitem"] = items[static_cast<size_t>(i + 1)];
          scopes_.back()["loop"] = Value::of(loop);
          bool stop = false;
          try {
            render_body(n.bodies[0], out);
          } catch (const BreakSignal&) {
            stop = true;
          } catch (const ContinueSignal&) {
          }
          scopes_.pop_back();
          if (stop) break;
        }
        return;
      }
      case Node::K::kSet: {
        Value v = eval(*n.kids[0]);
        if (n.targets.size() == 1) {
          assign(n.targets[0], n.name, v, n.line);
        } else {
          const json l = list_of(v, n.line, "set");
          if (l.size() != n.targets.size()) fail(n.line, "set: wrong number of values to unpack");
          for (size_t i = 0; i < l.size(); ++i) assign(n.targets[i], "", Value::of(l[i]), n.line);
        }
        return;
      }
      case Node::K::kSetBlock: {
        std::string s;
        render_body(n.bodies[0], s);
        Value v = Value::of(s);
        if (!n.kids.empty()) v = filter(n.kids[0]->name, v, eval_args(*n.kids[0], 0), n.line);
        assign(n.targets[0], n.name, v, n.line);
        return;
      }
      case Node::K::kMacro: {
        Value v;
        v.k = Value::K::kMacro;
        v.macro = n.macro;
        scopes_.back()[n.name] = v;
        return;
      }
      case Node::K::kCallBlock: {
        const Node& c = *n.kids[0];
        if (c.k != Node::K::kCall) fail(n.line, "call block: expected a macro call");
        const Value f = eval(*c.kids[0]);
        if (f.k != Value::K::kMacro) fail(n.line, "call block: not a macro");
        emit(out, to_str(call_macro(*f.macro, eval_args(c, 1), n.line, &n.bodies[0])), n.line);
        return;
      }
      case Node::K::kFilterBlock: {
        std::string s;
        render_body(n.bodies[0], s);
        emit(out, to_str(filter(n.kids[0]->name, Value::of(s), eval_args(*n.kids[0], 0), n.line)), n.line);
        return;
      }
      case Node::K::kBreak: throw BreakSignal{};
      case Node::K::kContinue: throw ContinueSignal{};
      default: fail(n.line, "not a statement");
    }
  }

  void bind_targets(const Node& n, const json& x) {
    if (n.targets.size() == 1) {
      scopes_.back()[n.targets[0]] = Value::of(x);
      return;
    }
    if (!x.is_array() || x.size() != n.targets.size()) fail(n.line, "for: cannot unpack the item into " + std::to_string(n.targets.size()) + " names");
    for (size_t i = 0; i < n.targets.size(); ++i) scopes_.back()[n.targets[i]] = Value::of(x[i]);
  }
};

// The next code point of UTF-8 text at i (a stray byte stands for itself).
uint32_t next_cp(const std::string& s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (len == 1 || i + len > s.size()) {
    ++i;
    return c;
  }
  uint32_t cp = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

void py_json(const json& v, const JsonStyle& st, int level, std::string& out) {
  const int indent = st.indent;
  auto nl = [&](int lv) {
    if (indent >= 0) {
      out += '\n';
      out.append(static_cast<size_t>(indent * lv), ' ');
    }
  };
  switch (v.type()) {
    case json::value_t::null: out += "null"; return;
    case json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
    case json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); return;
    case json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); return;
    case json::value_t::number_float: {
      const double d = v.get<double>();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : py_float(d);
      return;
    }
    case json::value_t::string: {
      out += '"';
      const std::string& str = v.get_ref<const std::string&>();
      for (size_t i = 0; i < str.size();) {
        if (st.ensure_ascii && static_cast<unsigned char>(str[i]) >= 0x80) {
          uint32_t cp = next_cp(str, i);
          char buf[16];
          if (cp >= 0x10000) {
            cp -= 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
          }
          out += buf;
          continue;
        }
        const auto c = static_cast<unsigned char>(str[i++]);
        switch (c) {
          case '"': out += "\\\""; break;
          case '\\': out += "\\\\"; break;
          case '\n': out += "\\n"; break;
          case '\r': out += "\\r"; break;
          case '\t': out += "\\t"; break;
          case '\b': out += "\\b"; break;
          case '\f': out += "\\f"; break;
          default:
            if (c < 0x20) {
              char buf[8];
              std::snprintf(buf, sizeof(buf), "\\u%04x", c);
              out += buf;
            } else {
              out += static_cast<char>(c);
            }
        }
      }
      out += '"';
      return;
    }
    case json::value_t::array: {
      if (v.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += st.item_sep;
        nl(level + 1);
        py_json(v[i], st, level + 1, out);
      }
      nl(level);
      out += ']';
      return;
    }
    case json::value_t::object: {
      if (v.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      std::vector<std::string> keys;
      for (const auto& [k, x] : v.items()) keys.push_back(k);
      if (st.sort_keys) std::sort(keys.begin(), keys.end());
      for (size_t i = 0; i < keys.size(); ++i) {
        if (i) out += st.item_sep;
        nl(level + 1);
        py_json(json(key_json(keys[i]).is_string() ? key_json(keys[i]) : json(py_str(key_json(keys[i])))), st, level + 1, out);
        out += st.key_sep;
        py_json(v.at(keys[i]), st, level + 1, out);
      }
      nl(level);
      out += '}';
      return;
    }
    default: out += "null"; return;
  }
}

}  // namespace

namespace {
// A JSON value with its keys in order (no text round trip: strings need not be UTF-8).
json ordered(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      json o = json::object();
      for (const auto& [k, v] : j.items()) o[k] = ordered(v);
      return o;
    }
    case nlohmann::json::value_t::array: {
      json a = json::array();
      for (const auto& v : j) a.push_back(ordered(v));
      return a;
    }
    case nlohmann::json::value_t::string: return j.get<std::string>();
    case nlohmann::json::value_t::boolean: return j.get<bool>();
    case nlohmann::json::value_t::number_integer: return j.get<int64_t>();
    case nlohmann::json::value_t::number_unsigned: return j.get<uint64_t>();
    case nlohmann::json::value_t::number_float: return j.get<double>();
    default: return nullptr;
  }
}
}  // namespace

std::string python_json(const nlohmann::json& value, int indent, bool sort_keys) {
  JsonStyle st;
  st.indent = indent;
  st.sort_keys = sort_keys;
  st.item_sep = indent >= 0 ? "," : ", ";
  std::string out;
  py_json(ordered(value), st, 0, out);
  return out;
}

struct ChatTemplate::Impl {
  std::string origin;
  std::vector<NodeP> body;
};

ChatTemplate::ChatTemplate(const std::string& source, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  Parser p;
  try {
    p.pieces = lex(source, origin);
    p.origin = origin;
    std::string end;
    impl->body = p.body({}, &end);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // a malformed literal (std::stoul, ...): the template's fault
    TS_CHECK(false, origin, ": ", e.what());
  }
  impl_ = impl;
}

const std::string& ChatTemplate::origin() const { return impl_->origin; }

std::string ChatTemplate::render(const nlohmann::json& context) const { return render(ordered(context)); }

std::string ChatTemplate::render(const json& context) const {
  TS_CHECK(context.is_object() || context.is_null(), impl_->origin, ": the context must be an object");
  Renderer r(impl_->origin);
  r.scopes_.emplace_back();
  if (context.is_object()) {
    for (const auto& [k, v] : context.items()) r.scopes_.back()[k] = Value::of(v);
  }
  r.scopes_.emplace_back();  // the template's own top-level sets
  std::string out;
  try {
    r.render_body(impl_->body, out);
  } catch (const Error&) {
    throw;
  } catch (const json::exception& e) {  // a value of another type than the template expects
    TS_CHECK(false, impl_->origin, ": ", e.what());
  } catch (const BreakSignal&) {
    TS_CHECK(false, impl_->origin, ": break outside a loop");
  } catch (const ContinueSignal&) {
    TS_CHECK(false, impl_->origin, ": continue outside a loop");
  }
  return out;
}

}  // namespace torchspeed::data
