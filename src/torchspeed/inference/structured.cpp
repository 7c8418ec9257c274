#include "torchspeed/inference/structured.h"

#include "torchspeed/inference/structured_regex.h"

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


}  // namespace

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
