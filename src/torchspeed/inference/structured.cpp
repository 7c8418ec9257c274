#include "torchspeed/inference/structured.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

namespace torchspeed::inference {

// Note [Structured output]
// A grammar is a graph of nodes (literal text, alternatives, object, array, string, number,
// optional space); a parse position is a stack of frames, one per open node, each with its
// phase (what it expects next) and two counters. Alternatives make several parses live at
// once (anyOf of two objects sharing a first key), so the matcher's state is a set of stacks,
// deduplicated after every byte. Feeding a byte to a stack gives the stacks that can follow:
// the top frame consumes it, or, where the top may end here (a number, an optional space), it
// ends and the byte goes to the frame below. A child that ends moves its parent on.
//
// The text is compact JSON: no whitespace but one optional space after ':' and ',' (valid JSON,
// and a model cannot loop on whitespace); an object's properties in the schema's order, the
// optional ones free to be left out; numbers at most 32 characters, exponents 2 digits (a finite
// double), integers 18 digits (an int64). So every parse ends.
//
// The mask: a token can come next when feeding its bytes leaves some parse alive. The tokens'
// bytes form a trie walked depth first, a branch dropped when no parse survives its bytes, so a
// mask costs the prefixes that are valid, not the vocabulary times the token length. Inside a
// string an ordinary byte only counts a character (and past minLength, in an unbounded string,
// not even that), so the walk passes the state on uncopied and counts the bytes it owes it.
// Masks are cached per state: the states inside an unbounded string, or between an object's
// members, recur, and then the mask costs a lookup. End tokens are allowed exactly when some
// parse is complete.

namespace {
using Kind = Grammar::Kind;
using Node = Grammar::Node;
using Frame = GrammarMatcher::Frame;
using Stack = GrammarMatcher::Stack;
using State = GrammarMatcher::State;

constexpr size_t kMaxDepth = 64;     // open frames in one parse
constexpr size_t kMaxParses = 256;   // live parses
constexpr int kMaxGuard = 512;       // nested epsilon moves in one feed
constexpr int32_t kMaxNumber = 32;   // characters of a number
constexpr int64_t kMaxSteps = 20000; // pushes for one byte over all parses

class Runner {
 public:
  explicit Runner(const Grammar& g) : g_(g) {}
  // Work allowed for one byte: alternatives nested in alternatives could multiply otherwise.
  void reset_budget() const { budget_ = kMaxSteps; }

  // node pushed on s, then c fed to it.
  void push(Stack s, int32_t node, uint8_t c, State& out, int guard) const {
    if (guard > kMaxGuard || --budget_ < 0 || out.size() >= kMaxParses) return;
    const Node& n = g_.nodes[static_cast<size_t>(node)];
    if (n.kind == Kind::kAlt) {
      for (int32_t k : n.kids) push(s, k, c, out, guard + 1);
      return;
    }
    if (s.size() >= kMaxDepth) return;
    s.push_back(Frame{node, 0, 0, 0});
    feed(std::move(s), c, out, guard + 1);
  }

  // The top frame is complete: popped, and its parent moved on.
  void done(Stack& s) const {
    s.pop_back();
    if (s.empty()) return;
    Frame& p = s.back();
    const Node& n = g_.nodes[static_cast<size_t>(p.node)];
    switch (n.kind) {
      case Kind::kRoot:
        p.phase = 2;
        break;
      case Kind::kObject:
        if (p.phase == 3) {
          p.phase = 4;  // key literal "name": done
        } else if (p.phase == 7) {
          p.phase = 8;  // free key string done: ':' next
        } else if (p.phase == 6) {
          p.phase = 1;  // value done
          p.a = n.free_keys ? 0 : p.a + 1;
          ++p.b;
        }
        break;
      case Kind::kArray:
        p.phase = 4;
        ++p.b;
        break;
      default:
        break;
    }
  }

  void feed(Stack s, uint8_t c, State& out, int guard) const {
    if (s.empty() || guard > kMaxGuard) return;
    Frame& f = s.back();
    const Node& n = g_.nodes[static_cast<size_t>(f.node)];
    switch (n.kind) {
      case Kind::kRoot:
        if (f.phase == 0) {
          f.phase = 1;
          push(std::move(s), n.kids[0], c, out, guard + 1);
        }
        return;  // phase 2: complete, nothing may follow
      case Kind::kLiteral:
        if (static_cast<uint8_t>(n.text[static_cast<size_t>(f.phase)]) != c) return;
        if (++f.phase == static_cast<int32_t>(n.text.size())) done(s);
        out.push_back(std::move(s));
        return;
      case Kind::kWs: {
        if (c == ' ') {
          Stack t = s;
          done(t);
          out.push_back(std::move(t));
        }
        done(s);
        feed(std::move(s), c, out, guard + 1);
        return;
      }
      case Kind::kString:
        return feed_string(std::move(s), n, c, out);
      case Kind::kNumber:
        return feed_number(std::move(s), n, c, out, guard);
      case Kind::kObject:
        return feed_object(std::move(s), n, c, out, guard);
      case Kind::kArray:
        return feed_array(std::move(s), n, c, out, guard);
      case Kind::kRegex: {
        const Grammar::Dfa& d = g_.dfas[static_cast<size_t>(n.dfa)];
        if (d.accepting[static_cast<size_t>(f.a)]) {  // or it ends here and c goes on
          Stack t = s;
          done(t);
          feed(std::move(t), c, out, guard + 1);
        }
        const int32_t next = d.next[static_cast<size_t>(f.a) * 256 + c];
        if (next < 0) return;
        f.a = next;
        if (d.accepting[static_cast<size_t>(next)] && !d.leaves[static_cast<size_t>(next)]) done(s);
        out.push_back(std::move(s));
        return;
      }
      case Kind::kAlt:
        return;  // never on a stack
    }
  }

  // Whether the parse is complete: only frames that may end here above a finished root.
  bool complete(Stack s) const {
    while (!s.empty()) {
      const Frame& f = s.back();
      const Node& n = g_.nodes[static_cast<size_t>(f.node)];
      if (n.kind == Kind::kRoot) return f.phase == 2;
      const bool regex_end = n.kind == Kind::kRegex && g_.dfas[static_cast<size_t>(n.dfa)].accepting[static_cast<size_t>(f.a)];
      if (!(n.kind == Kind::kWs || regex_end || (n.kind == Kind::kNumber && number_may_end(f.phase)))) return false;
      done(s);
    }
    return false;
  }

  // How many ordinary bytes (printable ASCII but '"' and '\\') the stack can take inside a
  // string, each changing nothing but the character count: 0 unless the top is a string's body
  // past its minLength.
  int64_t string_room(const Stack& s) const {
    const Frame& f = s.back();
    const Node& n = g_.nodes[static_cast<size_t>(f.node)];
    if (!(n.kind == Kind::kString && f.phase == 1 && f.b == 0 && f.a >= n.min)) return 0;
    return n.max < 0 ? INT64_MAX : n.max - f.a;
  }
  // The stack after `k` ordinary bytes (string_room(s) >= k).
  void pass_ordinary(Stack& s, int64_t k) const {
    Frame& f = s.back();
    if (g_.nodes[static_cast<size_t>(f.node)].max >= 0) f.a += static_cast<int32_t>(k);
  }

 private:
  static bool number_may_end(int32_t phase) { return phase == 2 || phase == 3 || phase == 5 || phase == 8; }

  // Characters are counted while a bound needs them: past minLength an unbounded string's frame
  // stays as it is, so its state (and its cached mask) repeats character after character.
  static void count_char(Frame& f, const Node& n) {
    if (n.max >= 0 || f.a < n.min) ++f.a;
  }

  void feed_string(Stack s, const Node& n, uint8_t c, State& out) const {
    Frame& f = s.back();
    auto keep = [&] { out.push_back(std::move(s)); };
    switch (f.phase) {
      case 0:
        if (c == '"') f.phase = 1, keep();
        return;
      case 1:
        if (f.b > 0) {  // inside a UTF-8 sequence: b = bytes left | (range of the next one) << 4
          static constexpr uint8_t lo[] = {0x80, 0xA0, 0x80, 0x90, 0x80}, hi[] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
          const int32_t range = f.b >> 4;
          if (c >= lo[range] && c <= hi[range]) f.b = (f.b & 15) - 1, keep();
          return;
        }
        if (c == '"') {
          if (f.a >= n.min) done(s), keep();
          return;
        }
        if (n.max >= 0 && f.a >= n.max) return;
        if (c == '\\') {
          f.phase = 2, keep();
        } else if (c >= 0x20 && c < 0x80) {
          count_char(f, n), keep();
        } else if (c >= 0xC2 && c <= 0xF4) {
          // Well-formed UTF-8 only (RFC 3629): no overlong forms, surrogates, or past U+10FFFF.
          count_char(f, n);
          const int32_t left = c <= 0xDF ? 1 : c <= 0xEF ? 2 : 3;
          const int32_t range = c == 0xE0 ? 1 : c == 0xED ? 2 : c == 0xF0 ? 3 : c == 0xF4 ? 4 : 0;
          f.b = left | range << 4;
          keep();
        }
        return;
      case 2:
        if (std::strchr("\"\\/bfnrt", c) && c != 0) {
          f.phase = 1, count_char(f, n), keep();
        } else if (c == 'u') {
          f.phase = 3, f.b = 4, keep();
        }
        return;
      case 3:
        if (std::isxdigit(c)) {
          if (--f.b == 0) f.phase = 1, count_char(f, n);
          keep();
        }
        return;
      default:
        return;
    }
  }

  void feed_number(Stack s, const Node& n, uint8_t c, State& out, int guard) const {
    Frame& f = s.back();
    if (number_may_end(f.phase)) {  // or it ends here and c goes on
      Stack t = s;
      done(t);
      feed(std::move(t), c, out, guard + 1);
    }
    if (f.a >= kMaxNumber) return;
    const bool digit = c >= '0' && c <= '9';
    int32_t next = -1;
    switch (f.phase) {
      case 0:
        next = c == '-' ? 1 : c == '0' ? 2 : digit ? 3 : -1;
        break;
      case 1:
        next = c == '0' ? 2 : digit ? 3 : -1;
        break;
      case 2:
      case 3:
        if (digit && f.phase == 3) next = 3;
        else if (!n.integer && c == '.') next = 4;
        else if (!n.integer && (c == 'e' || c == 'E')) next = 6;
        break;
      case 4:
        next = digit ? 5 : -1;
        break;
      case 5:
        next = digit ? 5 : (c == 'e' || c == 'E') ? 6 : -1;
        break;
      case 6:
        next = (c == '+' || c == '-') ? 7 : digit ? 8 : -1;
        break;
      case 7:
      case 8:
        next = digit && f.b < 2 ? 8 : -1;  // exponents of 2 digits at most: every number is a finite double
        break;
      default:
        break;
    }
    if (next < 0) return;
    // An integer has at most 18 digits (every one fits an int64); an exponent at most 2.
    if (n.integer && digit && f.b >= 18) return;
    if (next == 8 || (n.integer && digit)) ++f.b;
    f.phase = next;
    ++f.a;
    out.push_back(std::move(s));
  }

  static bool closable(const Node& n, int32_t from) {
    if (n.free_keys) return true;
    for (size_t j = static_cast<size_t>(from); j < n.required.size(); ++j) {
      if (n.required[j]) return false;
    }
    return true;
  }

  void feed_object(Stack s, const Node& n, uint8_t c, State& out, int guard) const {
    Frame& f = s.back();
    switch (f.phase) {
      case 0:
        if (c == '{') f.phase = 1, out.push_back(std::move(s));
        return;
      case 1:
        if (c == '}' && closable(n, f.a)) {
          done(s);
          out.push_back(std::move(s));
          return;
        }
        if (f.b == 0) {
          f.phase = 2;
          feed(std::move(s), c, out, guard + 1);
        } else if (c == ',' && (n.free_keys || static_cast<size_t>(f.a) < n.keys.size())) {
          f.phase = 9;
          out.push_back(std::move(s));
        }
        return;
      case 9:  // after ',': an optional space, then a key
        return optional_space(std::move(s), c, 2, out, guard);
      case 2:  // a key
        if (n.free_keys) {
          f.phase = 7;
          push(std::move(s), g_.key_string, c, out, guard + 1);
          return;
        }
        for (size_t j = static_cast<size_t>(f.a); j < n.keys.size(); ++j) {
          Stack t = s;
          t.back().phase = 3;
          t.back().a = static_cast<int32_t>(j);
          push(std::move(t), n.keys[j], c, out, guard + 1);
          if (n.required[j]) break;  // a required property cannot be skipped
        }
        return;
      case 8:  // free key: ':'
        if (c == ':') f.phase = 4, out.push_back(std::move(s));
        return;
      case 4:  // after ':': an optional space, then the value
        return optional_space(std::move(s), c, 5, out, guard);
      case 5:
        f.phase = 6;
        push(std::move(s), n.kids[n.free_keys ? 0 : static_cast<size_t>(f.a)], c, out, guard + 1);
        return;
      default:
        return;
    }
  }

  void feed_array(Stack s, const Node& n, uint8_t c, State& out, int guard) const {
    Frame& f = s.back();
    switch (f.phase) {
      case 0:
        if (c == '[') f.phase = 1, out.push_back(std::move(s));
        return;
      case 1:
        if (c == ']' && n.min == 0) {
          done(s);
          out.push_back(std::move(s));
          return;
        }
        if (n.max == 0) return;
        f.phase = 2;
        feed(std::move(s), c, out, guard + 1);
        return;
      case 2:
        f.phase = 3;
        push(std::move(s), n.kids[0], c, out, guard + 1);
        return;
      case 4:
        if (c == ',' && (n.max < 0 || f.b < n.max)) {
          f.phase = 5;
          out.push_back(std::move(s));
        } else if (c == ']' && f.b >= n.min) {
          done(s);
          out.push_back(std::move(s));
        }
        return;
      case 5:  // after ',': an optional space, then an item
        return optional_space(std::move(s), c, 2, out, guard);
      default:
        return;
    }
  }

  // One optional space, after which the top frame is in phase `next`: c is that space, or c goes
  // to phase `next` at once.
  void optional_space(Stack s, uint8_t c, int32_t next, State& out, int guard) const {
    s.back().phase = next;
    if (c == ' ') out.push_back(s);
    feed(std::move(s), c, out, guard + 1);
  }

  const Grammar& g_;
  mutable int64_t budget_ = kMaxSteps;
};

bool less_stack(const Stack& x, const Stack& y) {
  return std::lexicographical_compare(x.begin(), x.end(), y.begin(), y.end(), [](const Frame& a, const Frame& b) {
    return std::tie(a.node, a.phase, a.a, a.b) < std::tie(b.node, b.phase, b.a, b.b);
  });
}
bool same_stack(const Stack& x, const Stack& y) {
  return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](const Frame& a, const Frame& b) {
           return a.node == b.node && a.phase == b.phase && a.a == b.a && a.b == b.b;
         });
}

State feed_state(const Runner& r, const State& st, uint8_t c) {
  State out;
  r.reset_budget();
  for (const Stack& s : st) r.feed(s, c, out, 0);
  std::sort(out.begin(), out.end(), less_stack);
  out.erase(std::unique(out.begin(), out.end(), same_stack), out.end());
  if (out.size() > kMaxParses) out.resize(kMaxParses);
  return out;
}

std::string key_of(const State& st) {
  std::string k;
  for (const Stack& s : st) {
    const auto n = static_cast<uint32_t>(s.size());
    k.append(reinterpret_cast<const char*>(&n), sizeof(n));
    k.append(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(Frame));
  }
  return k;
}


// ----- regular expressions: a Thompson NFA over bytes, then a DFA by subset construction

constexpr size_t kMaxNfa = 20000, kMaxDfa = 4096;

struct Nfa {
  struct State {
    std::vector<std::tuple<uint8_t, uint8_t, int32_t>> edges;  // [lo, hi] -> state
    std::vector<int32_t> eps;
  };
  std::vector<State> st;
  int32_t add() {
    if (st.size() >= kMaxNfa) throw GrammarError("", "the pattern is too large (over " + std::to_string(kMaxNfa) + " states)");
    st.emplace_back();
    return static_cast<int32_t>(st.size() - 1);
  }
};
struct Frag {
  int32_t in, out;
};

class RegexParser {
 public:
  // forbid: bytes no edge may take (JSON string contents: '"', '\\' and controls).
  RegexParser(const std::string& p, Nfa& n, const std::array<bool, 256>& forbid) : p_(p), n_(n), forbid_(forbid) {}

  Frag parse() {
    size_t end = p_.size();
    size_t from = 0;
    if (!p_.empty() && p_[0] == '^') from = 1;
    if (end > from && p_[end - 1] == '$' && (end < 2 || p_[end - 2] != '\\')) --end;
    i_ = from;
    end_ = end;
    Frag f = alt();
    if (i_ != end_) fail("unexpected '" + std::string(1, p_[i_]) + "'");
    return f;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw GrammarError("", "pattern, at offset " + std::to_string(i_) + ": " + what);
  }
  bool more() const { return i_ < end_; }
  char peek() const { return p_[i_]; }

  Frag edge(uint8_t lo, uint8_t hi) {
    Frag f{n_.add(), n_.add()};
    // Split the range around forbidden bytes.
    int a = lo;
    for (int b = lo; b <= hi + 1; ++b) {
      if (b == hi + 1 || forbid_[static_cast<size_t>(b)]) {
        if (a < b) n_.st[static_cast<size_t>(f.in)].edges.emplace_back(static_cast<uint8_t>(a), static_cast<uint8_t>(b - 1), f.out);
        a = b + 1;
      }
    }
    return f;
  }
  Frag cat(Frag a, Frag b) {
    n_.st[static_cast<size_t>(a.out)].eps.push_back(b.in);
    return {a.in, b.out};
  }
  Frag either(const std::vector<Frag>& fs) {
    Frag f{n_.add(), n_.add()};
    for (const Frag& x : fs) {
      n_.st[static_cast<size_t>(f.in)].eps.push_back(x.in);
      n_.st[static_cast<size_t>(x.out)].eps.push_back(f.out);
    }
    return f;
  }
  Frag empty() {
    Frag f{n_.add(), n_.add()};
    n_.st[static_cast<size_t>(f.in)].eps.push_back(f.out);
    return f;
  }
  Frag bytes(const std::string& b) {
    Frag f = empty();
    for (unsigned char c : b) f = cat(f, edge(c, c));
    return f;
  }
  // A set of ASCII characters, and optionally every multi-byte UTF-8 character.
  Frag chars(const std::array<bool, 128>& ascii, bool multibyte) {
    std::vector<Frag> fs;
    for (int a = 0; a < 128;) {
      if (!ascii[static_cast<size_t>(a)]) {
        ++a;
        continue;
      }
      int b = a;
      while (b + 1 < 128 && ascii[static_cast<size_t>(b + 1)]) ++b;
      fs.push_back(edge(static_cast<uint8_t>(a), static_cast<uint8_t>(b)));
      a = b + 1;
    }
    if (multibyte) {  // RFC 3629's well-formed sequences
      auto seq = [&](std::vector<std::pair<uint8_t, uint8_t>> parts) {
        Frag f = edge(parts[0].first, parts[0].second);
        for (size_t k = 1; k < parts.size(); ++k) f = cat(f, edge(parts[k].first, parts[k].second));
        fs.push_back(f);
      };
      seq({{0xC2, 0xDF}, {0x80, 0xBF}});
      seq({{0xE0, 0xE0}, {0xA0, 0xBF}, {0x80, 0xBF}});
      seq({{0xE1, 0xEC}, {0x80, 0xBF}, {0x80, 0xBF}});
      seq({{0xED, 0xED}, {0x80, 0x9F}, {0x80, 0xBF}});
      seq({{0xEE, 0xEF}, {0x80, 0xBF}, {0x80, 0xBF}});
      seq({{0xF0, 0xF0}, {0x90, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}});
      seq({{0xF1, 0xF3}, {0x80, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}});
      seq({{0xF4, 0xF4}, {0x80, 0x8F}, {0x80, 0xBF}, {0x80, 0xBF}});
    }
    if (fs.empty()) fail("a class that matches nothing");
    return either(fs);
  }
  // \d \w \s (and \D \W \S) into `set`; false if `c` is not one of them.
  static bool shorthand(char c, std::array<bool, 128>& set, bool* negated) {
    std::array<bool, 128> s{};
    const char lower = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == 'd') {
      for (int x = '0'; x <= '9'; ++x) s[static_cast<size_t>(x)] = true;
    } else if (lower == 'w') {
      for (int x = 0; x < 128; ++x) s[static_cast<size_t>(x)] = std::isalnum(x) || x == '_';
    } else if (lower == 's') {
      for (char x : std::string(" \t\n\r\f\v")) s[static_cast<size_t>(x)] = true;
    } else {
      return false;
    }
    *negated = c != lower;
    if (*negated) {
      for (auto& x : s) x = !x;
    }
    for (size_t k = 0; k < 128; ++k) set[k] = set[k] || s[k];
    return true;
  }
  static int escaped(char c) {
    switch (c) {
      case 'n': return '\n';
      case 't': return '\t';
      case 'r': return '\r';
      case 'f': return '\f';
      case 'v': return '\v';
      case '0': return 0;
      default: return std::isalnum(static_cast<unsigned char>(c)) ? -1 : static_cast<unsigned char>(c);
    }
  }
  // One UTF-8 character of the pattern (its bytes).
  std::string character() {
    const unsigned char c = static_cast<unsigned char>(p_[i_]);
    const size_t len = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    if (i_ + len > end_) fail("a UTF-8 character cut short");
    std::string out = p_.substr(i_, len);
    i_ += len;
    return out;
  }

  Frag klass() {
    ++i_;  // '['
    bool negated = false;
    if (more() && peek() == '^') negated = true, ++i_;
    std::array<bool, 128> ascii{};
    std::vector<std::string> wide;
    bool first = true;
    while (more() && (peek() != ']' || first)) {
      first = false;
      int lo = -1;
      if (peek() == '\\') {
        ++i_;
        if (!more()) fail("a class ends in '\\'");
        bool neg = false;
        if (shorthand(peek(), ascii, &neg)) {
          if (neg) fail("\\D, \\W and \\S inside a class are not supported");
          ++i_;
          continue;
        }
        lo = escaped(peek());
        if (lo < 0) fail(std::string("unknown escape \\") + peek());
        ++i_;
      } else if (static_cast<unsigned char>(peek()) >= 0x80) {
        wide.push_back(character());
        continue;
      } else {
        lo = static_cast<unsigned char>(p_[i_++]);
      }
      int hi = lo;
      if (i_ + 1 < end_ && peek() == '-' && p_[i_ + 1] != ']') {
        ++i_;
        if (peek() == '\\') {
          ++i_;
          if (!more()) fail("a class ends in '\\'");
          hi = escaped(p_[i_++]);
        } else {
          hi = static_cast<unsigned char>(p_[i_++]);
        }
        if (hi < 0 || hi >= 0x80) fail("a range must be of ASCII characters");
        if (hi < lo) fail("a range whose end comes before its start");
      }
      for (int x = lo; x <= hi; ++x) ascii[static_cast<size_t>(x)] = true;
    }
    if (!more()) fail("'[' without ']'");
    ++i_;  // ']'
    if (negated) {
      if (!wide.empty()) fail("non-ASCII characters in a negated class are not supported");
      for (auto& x : ascii) x = !x;
      return chars(ascii, true);
    }
    Frag f = chars_or_empty(ascii);
    if (wide.empty()) return f;
    std::vector<Frag> fs;
    if (std::any_of(ascii.begin(), ascii.end(), [](bool x) { return x; })) fs.push_back(f);
    for (const auto& w : wide) fs.push_back(bytes(w));
    return either(fs);
  }
  Frag chars_or_empty(const std::array<bool, 128>& ascii) {
    if (std::none_of(ascii.begin(), ascii.end(), [](bool x) { return x; })) return Frag{n_.add(), n_.add()};  // matches nothing
    return chars(ascii, false);
  }

  Frag atom() {
    const char c = peek();
    if (c == '(') {
      ++i_;
      if (more() && peek() == '?') {
        if (i_ + 1 < end_ && p_[i_ + 1] == ':') {
          i_ += 2;
        } else {
          fail("only (?:...) groups are supported (no lookaround, flags or names)");
        }
      }
      Frag f = alt();
      if (!more() || peek() != ')') fail("'(' without ')'");
      ++i_;
      return f;
    }
    if (c == '[') return klass();
    if (c == '.') {
      ++i_;
      std::array<bool, 128> all{};
      for (auto& x : all) x = true;
      all['\n'] = false;
      return chars(all, true);
    }
    if (c == '\\') {
      ++i_;
      if (!more()) fail("the pattern ends in '\\'");
      std::array<bool, 128> set{};
      bool neg = false;
      if (shorthand(peek(), set, &neg)) {
        ++i_;
        return chars(set, neg);
      }
      const int e = escaped(peek());
      if (e < 0) fail(std::string("\\") + peek() + " is not supported");
      ++i_;
      return edge(static_cast<uint8_t>(e), static_cast<uint8_t>(e));
    }
    if (c == ')' || c == '|') fail("an empty expression");
    if (c == '*' || c == '+' || c == '?' || c == '{') fail("a quantifier with nothing before it");
    if (c == '^' || c == '$') fail("anchors are supported only at the ends");
    return bytes(character());
  }

  Frag repeat(size_t atom_start, size_t atom_end, Frag first, int64_t lo, int64_t hi) {
    // Copies of the atom come from parsing its text again.
    auto again = [&] {
      const size_t save = i_, save_end = end_;
      i_ = atom_start;
      end_ = atom_end;
      Frag f = atom();
      i_ = save;
      end_ = save_end;
      return f;
    };
    Frag f = lo > 0 ? first : empty();
    bool used_first = lo > 0;
    for (int64_t k = 1; k < lo; ++k) f = cat(f, again());
    if (hi < 0) {  // then any number more
      Frag x = used_first ? again() : first;
      Frag loop{n_.add(), n_.add()};
      n_.st[static_cast<size_t>(loop.in)].eps.push_back(x.in);
      n_.st[static_cast<size_t>(loop.in)].eps.push_back(loop.out);
      n_.st[static_cast<size_t>(x.out)].eps.push_back(x.in);
      n_.st[static_cast<size_t>(x.out)].eps.push_back(loop.out);
      return cat(f, loop);
    }
    for (int64_t k = lo; k < hi; ++k) {
      Frag x = used_first ? again() : first;
      used_first = true;
      f = cat(f, either({x, empty()}));
    }
    return f;
  }

  Frag quantified() {
    const size_t start = i_;
    Frag f = atom();
    const size_t end = i_;
    while (more()) {
      int64_t lo, hi;
      const char c = peek();
      if (c == '*') lo = 0, hi = -1, ++i_;
      else if (c == '+') lo = 1, hi = -1, ++i_;
      else if (c == '?') lo = 0, hi = 1, ++i_;
      else if (c == '{') {
        const size_t close = p_.find('}', i_);
        if (close == std::string::npos || close >= end_) fail("'{' without '}'");
        const std::string body = p_.substr(i_ + 1, close - i_ - 1);
        const size_t comma = body.find(',');
        auto num = [&](const std::string& t) -> int64_t {
          if (t.empty() || t.size() > 4 || t.find_first_not_of("0123456789") != std::string::npos) fail("a bad {n,m} quantifier");
          return std::stoll(t);
        };
        lo = num(comma == std::string::npos ? body : body.substr(0, comma));
        hi = comma == std::string::npos ? lo : (comma + 1 == body.size() ? -1 : num(body.substr(comma + 1)));
        if ((hi >= 0 && hi < lo) || lo > 256 || hi > 256) fail("{n,m} needs n <= m <= 256");
        i_ = close + 1;
      } else {
        break;
      }
      if (more() && peek() == '?') ++i_;  // lazy: the same language
      f = repeat(start, end, f, lo, hi);
      if (more() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{')) fail("multiple repeat (as Python's re says)");
    }
    return f;
  }

  Frag seq() {
    Frag f = empty();
    while (more() && peek() != '|' && peek() != ')') f = cat(f, quantified());
    return f;
  }

  Frag alt() {
    std::vector<Frag> fs{seq()};
    while (more() && peek() == '|') {
      ++i_;
      fs.push_back(seq());
    }
    return fs.size() == 1 ? fs[0] : either(fs);
  }

  const std::string& p_;
  Nfa& n_;
  const std::array<bool, 256>& forbid_;
  size_t i_ = 0, end_ = 0;
};

Grammar::Dfa to_dfa(const Nfa& n, int32_t start, int32_t final) {
  auto closure = [&](std::vector<int32_t> set) {
    std::vector<uint8_t> in(n.st.size(), 0);
    for (int32_t x : set) in[static_cast<size_t>(x)] = 1;
    for (size_t k = 0; k < set.size(); ++k) {
      for (int32_t e : n.st[static_cast<size_t>(set[k])].eps) {
        if (!in[static_cast<size_t>(e)]) in[static_cast<size_t>(e)] = 1, set.push_back(e);
      }
    }
    std::sort(set.begin(), set.end());
    return set;
  };
  Grammar::Dfa d;
  std::map<std::vector<int32_t>, int32_t> ids;
  std::vector<std::vector<int32_t>> sets{closure({start})};
  ids[sets[0]] = 0;
  for (size_t k = 0; k < sets.size(); ++k) {
    d.next.resize((k + 1) * 256, -1);
    d.accepting.push_back(std::binary_search(sets[k].begin(), sets[k].end(), final) ? 1 : 0);
    std::array<std::vector<int32_t>, 256> moves;
    for (int32_t x : sets[k]) {
      for (const auto& [lo, hi, t] : n.st[static_cast<size_t>(x)].edges) {
        for (int b = lo; b <= hi; ++b) moves[static_cast<size_t>(b)].push_back(t);
      }
    }
    bool leaves = false;
    for (int b = 0; b < 256; ++b) {
      if (moves[static_cast<size_t>(b)].empty()) continue;
      std::vector<int32_t> next = closure(moves[static_cast<size_t>(b)]);
      auto it = ids.find(next);
      if (it == ids.end()) {
        if (sets.size() >= kMaxDfa) throw GrammarError("", "the pattern needs over " + std::to_string(kMaxDfa) + " automaton states");
        it = ids.emplace(next, static_cast<int32_t>(sets.size())).first;
        sets.push_back(std::move(next));
      }
      d.next[k * 256 + static_cast<size_t>(b)] = it->second;
      leaves = true;
    }
    d.leaves.push_back(leaves ? 1 : 0);
  }
  return d;
}

// pattern -> DFA. json_string: the text is a JSON string whose contents match the pattern
// (quotes around, no byte that would need escaping inside).
Grammar::Dfa compile_regex(const std::string& pattern, bool json_string) {
  std::array<bool, 256> forbid{};
  if (json_string) {
    for (int b = 0; b < 0x20; ++b) forbid[static_cast<size_t>(b)] = true;
    forbid['"'] = forbid['\\'] = true;
  }
  Nfa n;
  RegexParser parser(pattern, n, forbid);
  Frag body = parser.parse();
  if (json_string) {
    std::array<bool, 256> none{};
    Nfa& m = n;
    const int32_t a = m.add(), b = m.add(), z = m.add();
    m.st[static_cast<size_t>(a)].edges.emplace_back('"', '"', body.in);
    m.st[static_cast<size_t>(body.out)].eps.push_back(b);
    m.st[static_cast<size_t>(b)].edges.emplace_back('"', '"', z);
    (void)none;
    return to_dfa(m, a, z);
  }
  return to_dfa(n, body.in, body.out);
}

// ----- building grammars

struct Builder {
  Grammar g;
  const nlohmann::ordered_json* root_schema = nullptr;
  std::map<std::string, int32_t> refs;
  int32_t any_value = -1;

  int32_t add(Node n) {
    g.nodes.push_back(std::move(n));
    return static_cast<int32_t>(g.nodes.size() - 1);
  }
  int32_t literal(std::string text) {
    Node n;
    n.kind = Kind::kLiteral;
    n.text = std::move(text);
    return add(std::move(n));
  }
  int32_t alt(std::vector<int32_t> kids) {
    if (kids.size() == 1) return kids[0];
    Node n;
    n.kind = Kind::kAlt;
    n.kids = std::move(kids);
    return add(std::move(n));
  }
  int32_t string(int64_t min = 0, int64_t max = -1) {
    Node n;
    n.kind = Kind::kString;
    n.min = min;
    n.max = max;
    return add(std::move(n));
  }
  int32_t regex(const std::string& pattern, bool json_string, const std::string& path) {
    try {
      g.dfas.push_back(compile_regex(pattern, json_string));
    } catch (const GrammarError& e) {
      refuse(path, e.what());
    }
    Node n;
    n.kind = Kind::kRegex;
    n.dfa = static_cast<int32_t>(g.dfas.size() - 1);
    return add(std::move(n));
  }
  int32_t number(bool integer) {
    Node n;
    n.kind = Kind::kNumber;
    n.integer = integer;
    return add(std::move(n));
  }
  int32_t key_string() {
    if (g.key_string < 0) g.key_string = string();
    return g.key_string;
  }
  int32_t free_object(int32_t value) {
    key_string();
    Node n;
    n.kind = Kind::kObject;
    n.free_keys = true;
    n.kids = {value};
    return add(std::move(n));
  }
  int32_t array(int32_t item, int64_t min = 0, int64_t max = -1) {
    Node n;
    n.kind = Kind::kArray;
    n.kids = {item};
    n.min = min;
    n.max = max;
    return add(std::move(n));
  }
  // Any JSON value (recursive: objects and arrays of any values).
  int32_t any() {
    if (any_value >= 0) return any_value;
    any_value = add(Node{});  // filled below: an alternative
    const int32_t obj = free_object(any_value), arr = array(any_value);
    Node n;
    n.kind = Kind::kAlt;
    n.kids = {obj, arr, string(), number(false), literal("true"), literal("false"), literal("null")};
    g.nodes[static_cast<size_t>(any_value)] = std::move(n);
    return any_value;
  }
  int32_t finish(int32_t value) {
    Node r;
    r.kind = Kind::kRoot;
    r.kids = {value};
    g.root = add(std::move(r));
    return g.root;
  }

  [[noreturn]] static void refuse(const std::string& path, const std::string& what) { throw GrammarError(path, what); }
  static std::string join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }

  static int64_t count(const nlohmann::ordered_json& s, const char* k, const std::string& path) {
    if (!s.contains(k)) return -1;
    const auto& v = s.at(k);
    if (!v.is_number_integer() || v.get<int64_t>() < 0) refuse(join(path, k), "expected a non-negative integer");
    return v.get<int64_t>();
  }

  int32_t compile(const nlohmann::ordered_json& s, const std::string& path, int depth) {
    if (depth > 64) refuse(path, "nests deeper than 64 schemas");
    if (s.is_boolean()) {
      if (!s.get<bool>()) refuse(path, "false admits no value");
      return any();
    }
    if (!s.is_object()) refuse(path, "a schema must be an object or a boolean");
    static const std::set<std::string> annotations{"title", "description", "default", "examples", "$schema", "$id",
                                                   "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                                                   "definitions"};
    static const std::set<std::string> known{"type", "properties", "required", "additionalProperties", "items",
                                             "minItems", "maxItems", "minLength", "maxLength", "pattern", "enum", "const",
                                             "anyOf", "oneOf", "allOf", "$ref"};
    for (const auto& [k, v] : s.items()) {
      if (!annotations.count(k) && !known.count(k)) refuse(join(path, k), "this keyword is not supported");
    }
    if (s.contains("$ref")) {
      if (s.size() > 1) {
        for (const auto& [k, v] : s.items()) {
          if (k != "$ref" && !annotations.count(k)) refuse(join(path, k), "beside $ref only annotations are supported");
        }
      }
      return ref(s.at("$ref"), join(path, "$ref"), depth);
    }
    if (s.contains("const")) return literal(s.at("const").dump());
    if (s.contains("enum")) {
      const auto& e = s.at("enum");
      if (!e.is_array() || e.empty()) refuse(join(path, "enum"), "expected a non-empty list");
      std::vector<int32_t> kids;
      for (const auto& v : e) kids.push_back(literal(v.dump()));
      return alt(kids);
    }
    for (const char* k : {"anyOf", "oneOf"}) {
      if (!s.contains(k)) continue;
      const auto& list = s.at(k);
      if (!list.is_array() || list.empty()) refuse(join(path, k), "expected a non-empty list of schemas");
      std::vector<int32_t> kids;
      for (size_t i = 0; i < list.size(); ++i) kids.push_back(compile(list[i], join(path, k) + "[" + std::to_string(i) + "]", depth + 1));
      return alt(kids);
    }
    if (s.contains("allOf")) {
      const auto& list = s.at("allOf");
      if (!list.is_array() || list.size() != 1) refuse(join(path, "allOf"), "only a list of one schema is supported");
      return compile(list[0], join(path, "allOf") + "[0]", depth + 1);
    }
    if (!s.contains("type")) {
      if (s.contains("properties")) return object(s, path, depth);
      if (s.contains("items")) return array_of(s, path, depth);
      return any();
    }
    const auto& t = s.at("type");
    if (t.is_array()) {
      if (t.empty()) refuse(join(path, "type"), "expected a type or a non-empty list of types");
      std::vector<int32_t> kids;
      for (const auto& one : t) kids.push_back(typed(s, one, path, depth));
      return alt(kids);
    }
    return typed(s, t, path, depth);
  }

  int32_t typed(const nlohmann::ordered_json& s, const nlohmann::ordered_json& t, const std::string& path, int depth) {
    if (!t.is_string()) refuse(join(path, "type"), "expected a type name");
    const std::string name = t.get<std::string>();
    if (name == "string") {
      if (s.contains("pattern")) {
        // JSON Schema's pattern is a search: unanchored ends match anything.
        if (!s.at("pattern").is_string()) refuse(join(path, "pattern"), "expected a string");
        if (s.contains("minLength") || s.contains("maxLength")) refuse(join(path, "pattern"), "pattern with minLength or maxLength is not supported");
        std::string p = s.at("pattern").get<std::string>();
        const bool head = !p.empty() && p[0] == '^';
        const bool tail = p.size() > 1 && p.back() == '$' && p[p.size() - 2] != '\\';
        if (head) p = p.substr(1);
        if (tail) p.pop_back();
        p = (head ? "" : ".*") + std::string("(?:") + p + ")" + (tail ? "" : ".*");
        return regex(p, /*json_string=*/true, join(path, "pattern"));
      }
      return string(std::max<int64_t>(0, count(s, "minLength", path)), count(s, "maxLength", path));
    }
    if (name == "integer") return number(true);
    if (name == "number") return number(false);
    if (name == "boolean") return alt({literal("true"), literal("false")});
    if (name == "null") return literal("null");
    if (name == "object") return object(s, path, depth);
    if (name == "array") return array_of(s, path, depth);
    refuse(join(path, "type"), "unknown type \"" + name + "\"");
  }

  int32_t object(const nlohmann::ordered_json& s, const std::string& path, int depth) {
    std::set<std::string> required;
    if (s.contains("required")) {
      const auto& r = s.at("required");
      if (!r.is_array()) refuse(join(path, "required"), "expected a list of property names");
      for (const auto& x : r) {
        if (!x.is_string()) refuse(join(path, "required"), "expected property names");
        required.insert(x.get<std::string>());
      }
    }
    if (s.contains("additionalProperties")) {
      const auto& a = s.at("additionalProperties");
      if (!a.is_boolean() && !a.is_object()) refuse(join(path, "additionalProperties"), "expected a boolean or a schema");
    }
    if (!s.contains("properties")) {
      if (!required.empty()) refuse(join(path, "required"), "names properties the schema does not list");
      // Free keys; values as additionalProperties says (absent or true: any).
      const auto* a = s.contains("additionalProperties") ? &s.at("additionalProperties") : nullptr;
      if (a && a->is_boolean() && !a->get<bool>()) return literal("{}");
      const int32_t value = a && a->is_object() ? compile(*a, join(path, "additionalProperties"), depth + 1) : any();
      return free_object(value);
    }
    const auto& props = s.at("properties");
    if (!props.is_object()) refuse(join(path, "properties"), "expected an object of schemas");
    Node n;
    n.kind = Kind::kObject;
    for (const auto& [name, sub] : props.items()) {
      n.keys.push_back(literal(nlohmann::json(name).dump() + ":"));
      n.kids.push_back(compile(sub, join(join(path, "properties"), name), depth + 1));
      n.required.push_back(required.count(name) ? 1 : 0);
      required.erase(name);
    }
    if (!required.empty()) refuse(join(path, "required"), "names \"" + *required.begin() + "\", which properties does not list");
    return add(std::move(n));
  }

  int32_t array_of(const nlohmann::ordered_json& s, const std::string& path, int depth) {
    const int32_t item = s.contains("items") ? compile(s.at("items"), join(path, "items"), depth + 1) : any();
    const int64_t lo = std::max<int64_t>(0, count(s, "minItems", path)), hi = count(s, "maxItems", path);
    if (hi >= 0 && hi < lo) refuse(join(path, "maxItems"), "is less than minItems");
    return array(item, lo, hi);
  }

  int32_t ref(const nlohmann::ordered_json& r, const std::string& path, int depth) {
    if (!r.is_string()) refuse(path, "expected a string");
    const std::string target = r.get<std::string>();
    auto it = refs.find(target);
    if (it != refs.end()) return it->second;
    std::string section, name;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      if (target.rfind(prefix, 0) == 0) {
        section = std::string(prefix).substr(2, std::strlen(prefix) - 3);
        name = target.substr(std::strlen(prefix));
      }
    }
    if (target == "#") {
      section.clear();
    } else if (section.empty() || name.empty() || name.find('/') != std::string::npos) {
      refuse(path, "only \"#\" and references into #/$defs/ or #/definitions/ are supported, got \"" + target + "\"");
    }
    const nlohmann::ordered_json* sub = root_schema;
    if (!section.empty()) {
      if (!root_schema->contains(section) || !root_schema->at(section).contains(name)) {
        refuse(path, "\"" + target + "\" names no schema");
      }
      sub = &root_schema->at(section).at(name);
    }
    // A placeholder first, so a schema that refers to itself refers to this node.
    const int32_t id = add(Node{});
    refs[target] = id;
    const int32_t body = compile(*sub, section.empty() ? "" : section + "." + name, depth + 1);
    Node n;
    n.kind = Kind::kAlt;
    n.kids = {body};
    g.nodes[static_cast<size_t>(id)] = std::move(n);
    return id;
  }
};

std::shared_ptr<const Grammar> done_grammar(Builder& b, int32_t value) {
  // An alternative that reaches itself through alternatives alone ({"anyOf": [{"$ref": "#"}]})
  // admits no text (it would have to begin with itself): refused.
  const auto& nodes = b.g.nodes;
  for (size_t start = 0; start < nodes.size(); ++start) {
    if (nodes[start].kind != Kind::kAlt) continue;
    std::vector<int32_t> todo(nodes[start].kids.begin(), nodes[start].kids.end());
    std::vector<uint8_t> seen(nodes.size(), 0);
    while (!todo.empty()) {
      const auto k = static_cast<size_t>(todo.back());
      todo.pop_back();
      if (k == start) Builder::refuse("$ref", "the schema refers to itself with no object or array in between");
      if (seen[k] || nodes[k].kind != Kind::kAlt) continue;
      seen[k] = 1;
      todo.insert(todo.end(), nodes[k].kids.begin(), nodes[k].kids.end());
    }
  }
  b.finish(value);
  return std::make_shared<const Grammar>(std::move(b.g));
}
}  // namespace

std::shared_ptr<const Grammar> Grammar::json_schema(const nlohmann::ordered_json& schema) {
  Builder b;
  b.root_schema = &schema;
  const int32_t value = b.compile(schema, "", 0);
  return done_grammar(b, value);
}

std::shared_ptr<const Grammar> Grammar::json_object() {
  Builder b;
  return done_grammar(b, b.free_object(b.any()));
}

std::shared_ptr<const Grammar> Grammar::regex(const std::string& pattern) {
  Builder b;
  return done_grammar(b, b.regex(pattern, /*json_string=*/false, ""));
}

std::shared_ptr<const Grammar> Grammar::choice(const std::vector<std::string>& options) {
  Builder b;
  std::vector<int32_t> kids;
  for (const auto& o : options) {
    if (o.empty()) Builder::refuse("choice", "an option must not be empty");
    kids.push_back(b.literal(o));
  }
  if (kids.empty()) Builder::refuse("choice", "expected at least one option");
  return done_grammar(b, b.alt(kids));
}

TokenTrie::TokenTrie(const data::Tokenizer& tokenizer, int64_t vocab_) : vocab(vocab_) {
  nodes.emplace_back();
  const int64_t n = std::min(vocab, tokenizer.vocab_size());
  for (int64_t id = 0; id < n; ++id) {
    std::string bytes;
    try {
      bytes = tokenizer.token_bytes(id);
    } catch (const std::exception&) {
      continue;  // a gap in the vocabulary
    }
    if (bytes.empty()) continue;
    this->bytes.resize(static_cast<size_t>(n));
    this->bytes[static_cast<size_t>(id)] = bytes;
    int32_t at = 0;
    for (unsigned char c : bytes) {
      auto& kids = nodes[static_cast<size_t>(at)].kids;
      auto it = std::find_if(kids.begin(), kids.end(), [&](const auto& k) { return k.first == c; });
      if (it != kids.end()) {
        at = it->second;
      } else {
        const auto next = static_cast<int32_t>(nodes.size());
        kids.emplace_back(c, next);
        nodes.emplace_back();
        at = next;
      }
    }
    nodes[static_cast<size_t>(at)].tokens.push_back(static_cast<int32_t>(id));
  }
}

GrammarMatcher::GrammarMatcher(GrammarPtr grammar, std::shared_ptr<const TokenTrie> trie, std::vector<int64_t> end_ids)
    : g_(std::move(grammar)), trie_(std::move(trie)), end_ids_(std::move(end_ids)) {
  state_.push_back(Stack{Frame{g_->root, 0, 0, 0}});
}

GrammarMatcher::~GrammarMatcher() = default;

bool GrammarMatcher::complete() const {
  Runner r(*g_);
  return std::any_of(state_.begin(), state_.end(), [&](const Stack& s) { return r.complete(s); });
}

bool GrammarMatcher::finished() const {
  return std::all_of(state_.begin(), state_.end(), [&](const Stack& s) {
    return s.size() == 1 && g_->nodes[static_cast<size_t>(s[0].node)].kind == Kind::kRoot && s[0].phase == 2;
  });
}

void GrammarMatcher::mask(float* logits, int64_t vocab) {
  const std::string key = key_of(state_);
  auto it = cache_.find(key);
  if (it == cache_.end()) {
    if (cache_.size() >= 512) cache_.clear();  // 512 masks of the vocabulary: 3 MB a sequence at 49k tokens
    std::vector<uint64_t> bits(static_cast<size_t>((trie_->vocab + 63) / 64), 0);
    Runner r(*g_);
    auto room = [&](const State& st) {
      int64_t k = INT64_MAX;
      for (const Stack& s : st) k = std::min(k, r.string_room(s));
      return k;
    };
    // Depth-first over the trie: the state after the path's bytes is `st` followed by `pending`
    // ordinary string bytes (passed without copying the state while `room` lasts).
    auto walk = [&](auto&& self, int32_t node, const State& st, int64_t space, int64_t pending) -> void {
      for (const auto& [c, kid] : trie_->nodes[static_cast<size_t>(node)].kids) {
        const bool ordinary = c >= 0x20 && c < 0x80 && c != '"' && c != '\\';
        if (ordinary && pending < space) {
          for (int32_t t : trie_->nodes[static_cast<size_t>(kid)].tokens) bits[static_cast<size_t>(t) / 64] |= uint64_t{1} << (t % 64);
          self(self, kid, st, space, pending + 1);
          continue;
        }
        State next;
        if (pending > 0) {
          State moved = st;
          for (Stack& s : moved) r.pass_ordinary(s, pending);
          next = feed_state(r, moved, c);
        } else {
          next = feed_state(r, st, c);
        }
        if (next.empty()) continue;
        for (int32_t t : trie_->nodes[static_cast<size_t>(kid)].tokens) bits[static_cast<size_t>(t) / 64] |= uint64_t{1} << (t % 64);
        self(self, kid, next, room(next), 0);
      }
    };
    walk(walk, 0, state_, room(state_), 0);
    it = cache_.emplace(key, std::move(bits)).first;
  }
  const auto& bits = it->second;
  const bool end = complete();
  std::vector<float> ends;
  for (int64_t t : end_ids_) ends.push_back(t >= 0 && t < vocab ? logits[t] : 0.0f);
  for (int64_t t = 0; t < vocab; ++t) {
    const bool ok = t < trie_->vocab && (bits[static_cast<size_t>(t) / 64] >> (t % 64) & 1);
    if (!ok) logits[t] = -INFINITY;
  }
  // End tokens: exactly when the text is whole (their bytes may also be valid text: not then).
  for (size_t i = 0; i < end_ids_.size(); ++i) {
    const int64_t t = end_ids_[i];
    if (t >= 0 && t < vocab) logits[t] = end ? ends[i] : -INFINITY;
  }
}

bool GrammarMatcher::accept(int64_t token) {
  if (std::find(end_ids_.begin(), end_ids_.end(), token) != end_ids_.end()) return complete();
  if (token < 0 || token >= static_cast<int64_t>(trie_->bytes.size())) return false;
  const std::string& bytes = trie_->bytes[static_cast<size_t>(token)];
  if (bytes.empty()) return false;
  Runner r(*g_);
  State st = state_;
  for (unsigned char c : bytes) {
    st = feed_state(r, st, c);
    if (st.empty()) return false;
  }
  state_ = std::move(st);
  return true;
}

}  // namespace torchspeed::inference
