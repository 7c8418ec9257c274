// The chat-template interpreter's front end: the template lexed into text and tags, expressions
// tokenized, and both parsed to a tree (chat_template_internal.h).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <functional>
#include <map>
#include <set>

#include "torchspeed/data/chat_template_internal.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data::jinja {

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

std::vector<NodeP> parse_template(const std::string& source, const std::string& origin) {
  Parser p;
  p.pieces = lex(source, origin);
  p.origin = origin;
  std::string end;
  return p.body({}, &end);
}

}  // namespace torchspeed::data::jinja
