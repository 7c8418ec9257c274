#include "torchspeed/inference/structured_regex.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <tuple>
#include <vector>

namespace torchspeed::inference::detail {

namespace {
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

}  // namespace

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


}  // namespace torchspeed::inference::detail
