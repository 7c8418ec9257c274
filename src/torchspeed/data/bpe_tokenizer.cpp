// The BPE tokenizer's model: merges applied as `tokenizers` applies them, SentencePiece-style
// normalization, encoding with added tokens, and each token's bytes.
#include "torchspeed/data/bpe_tokenizer.h"

#include <algorithm>
#include <climits>

#include "torchspeed/data/bpe_internal.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data {

using namespace bpe;

BpeTokenizer::BpeTokenizer(std::unordered_map<std::string, int64_t> vocab,
                           std::vector<std::pair<std::string, std::string>> merges, const std::string& source, bool spm,
                           std::vector<int> ranks)
    : vocab_(std::move(vocab)), source_(source), spm_(spm) {
  make_byte_map(byte_to_unicode_, unicode_to_byte_);
  int64_t max_id = -1;
  // Ids are dense in real vocabularies; a sparse one (a hostile file's id 2^31 - 1) would size the
  // id table by its largest id, so ids are bounded by the vocabulary's size.
  const int64_t bound = max_token_id(static_cast<int64_t>(vocab_.size()));
  for (const auto& [tok, id] : vocab_) {
    TS_CHECK(id >= 0 && id <= bound, source_, ": token '", tok, "' has id ", id, ", outside [0, ", bound, "] (",
             vocab_.size(), " tokens)");
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : vocab_) {
    std::string& slot = id_to_token_[static_cast<size_t>(id)];
    TS_CHECK(slot.empty(), source_, ": tokens '", std::min(slot, tok), "' and '", std::max(slot, tok), "' share id ", id);
    slot = tok;
  }
  set_merges(merges, ranks);
  if (spm_) {
    byte_token_.assign(256, -1);
    static const char* hex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      const std::string name = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
      if (const auto it = vocab_.find(name); it != vocab_.end()) {
        byte_token_[static_cast<size_t>(b)] = it->second;
        byte_of_token_[it->second] = static_cast<uint8_t>(b);
      }
    }
    index_added();
    return;
  }
  int bytes = 0;
  for (int b = 0; b < 256; ++b) bytes += vocab_.count(byte_to_unicode_[b]) ? 1 : 0;
  // Real vocabularies may leave out a few control bytes (SmolLM's has no token for 0x04): text
  // holding one encodes it as the unknown token where there is one. Most bytes missing means
  // this is not a byte-level vocabulary at all.
  TS_CHECK(bytes >= 192, source_, ": the vocabulary has tokens for only ", bytes,
           " of the 256 bytes: not a byte-level BPE vocabulary");
  if (auto it = vocab_.find("<|endoftext|>"); it != vocab_.end()) {
    eos_ = it->second;
    added_.emplace_back(it->first, it->second);
  }
  index_added();
}

// Note [Added tokens]
// Added tokens match literally, before pre-tokenization: the earliest match in the text wins,
// the longest of those starting at the same byte (as `tokenizers` matches them), and the text
// between matches is plain text. Searching the rest of the text for every added token after each
// match was quadratic (a 200 KB prompt full of one added token, with a second one absent, took
// 3.5 s; a vocabulary's hundreds of reserved tokens multiply that). A byte trie of the added
// tokens finds the same matches in one scan: at each byte that can start a token, walk the trie
// as far as the text follows it; the deepest token end passed is the longest match there. Each
// position costs at most the longest added token's length.
void BpeTokenizer::index_added() {
  std::stable_sort(added_.begin(), added_.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  added_edges_.clear();
  added_end_.assign(1, -1);
  added_first_.reset();
  added_by_id_.clear();
  for (size_t i = 0; i < added_.size(); ++i) {
    const std::string& tok = added_[i].first;
    TS_CHECK(!tok.empty(), source_, ": added token ", added_[i].second, " is empty");
    TS_CHECK(added_end_.size() + tok.size() < static_cast<size_t>(INT32_MAX), source_, ": the added tokens are too long");
    added_first_.set(static_cast<unsigned char>(tok[0]));
    int32_t node = 0;
    for (unsigned char c : tok) {
      const auto [it, fresh] = added_edges_.emplace((static_cast<uint64_t>(node) << 8) | c, static_cast<int32_t>(added_end_.size()));
      if (fresh) added_end_.push_back(-1);
      node = it->second;
    }
    // Contents are distinct (the readers skip repeats); were one repeated, the first would keep it.
    if (added_end_[static_cast<size_t>(node)] < 0) added_end_[static_cast<size_t>(node)] = static_cast<int32_t>(i);
    added_by_id_.emplace(added_[i].second, i);
  }
  added_indexed_ = added_.size();
}

std::pair<size_t, size_t> BpeTokenizer::find_added(const std::string& text, size_t from) const {
  TS_INTERNAL_ASSERT(added_indexed_ == added_.size(), source_, ": added tokens changed without index_added()");
  constexpr size_t npos = std::string::npos;
  if (added_.empty()) return {npos, npos};
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = from; i < n; ++i) {
    if (!added_first_[p[i]]) continue;
    int32_t node = 0, best = -1;
    for (size_t k = i; k < n; ++k) {
      const auto it = added_edges_.find((static_cast<uint64_t>(node) << 8) | p[k]);
      if (it == added_edges_.end()) break;
      node = it->second;
      if (added_end_[static_cast<size_t>(node)] >= 0) best = added_end_[static_cast<size_t>(node)];
    }
    if (best >= 0) return {i, static_cast<size_t>(best)};
  }
  return {npos, npos};
}

void BpeTokenizer::set_merges(const std::vector<std::pair<std::string, std::string>>& merges, const std::vector<int>& ranks) {
  merges_.clear();
  merge_order_.clear();
  merges_.reserve(merges.size());
  merge_order_.reserve(merges.size());
  auto id_of = [&](const std::string& t, size_t r, const std::string& pair) {
    const auto it = vocab_.find(t);
    TS_CHECK(it != vocab_.end(), source_, ": merge ", r, " '", pair, "': '", t, "' is not in the vocabulary");
    return it->second;
  };
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    const std::string pair = a + " " + b;
    const int64_t ia = id_of(a, r, pair), ib = id_of(b, r, pair), in = id_of(a + b, r, pair);
    const int rank = ranks.empty() ? static_cast<int>(r) : ranks[r];
    // A pair listed twice keeps its first (lowest) rank, as `tokenizers` keeps it.
    if (merges_.emplace((static_cast<uint64_t>(ia) << 32) | static_cast<uint64_t>(ib), std::make_pair(rank, in)).second)
      merge_order_.emplace_back(ia, ib);
  }
}

std::string BpeTokenizer::normalized(const std::string& text) const {
  if (!nfc_ && !spm_) return text;
  auto norm = [&](const std::string& span, bool at_start) {
    if (!spm_) return nfc(span);
    return meta_to_spaces(spm_normalize(span, at_start));
  };
  // Added tokens are matched before normalization, as in encode (Note [Added tokens]).
  std::string out;
  size_t start = 0;
  while (start < text.size()) {
    const auto [at, k] = find_added(text, start);
    if (at == std::string::npos) break;
    const size_t len = added_[k].first.size();
    if (at > start) out += norm(text.substr(start, at - start), start == 0);  // as in encode
    out += text.substr(at, len);
    start = at + len;
  }
  return out + (start < text.size() ? norm(text.substr(start), start == 0) : std::string());
}

void BpeTokenizer::bpe(const std::string& piece, std::vector<int64_t>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {  // a piece that is a token of its own is taken whole
    std::string whole;
    if (spm_) {
      whole = piece;
    } else {
      for (unsigned char c : piece) whole += byte_to_unicode_[c];
    }
    if (const auto it = vocab_.find(whole); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // The first symbols: one per byte (byte-level) or per character (SentencePiece style, with
  // byte fallback), as tokenizers' BPE::merge_word makes them. A symbol the vocabulary lacks is
  // the unknown token (consecutive ones fused into one under fuse_unk).
  std::vector<int64_t> ids;
  ids.reserve(piece.size());
  bool last_unk = false;
  auto unknown = [&](const std::string& what) {
    TS_CHECK(unk_ >= 0, source_, ": '", what, "' is not in the vocabulary, which has no unknown token");
    if (!(fuse_unk_ && last_unk)) ids.push_back(unk_);
    last_unk = true;
  };
  if (!spm_) {
    for (unsigned char c : piece) {
      const auto it = vocab_.find(byte_to_unicode_[c]);
      if (it == vocab_.end()) {
        unknown(byte_to_unicode_[c]);
        continue;
      }
      ids.push_back(it->second);
      last_unk = false;
    }
  } else {
    for (const CodePoint& c : code_points(piece)) {
      const std::string ch = piece.substr(c.begin, c.len);
      if (const auto it = vocab_.find(ch); it != vocab_.end()) {
        ids.push_back(it->second);
        last_unk = false;
        continue;
      }
      bool all = byte_fallback_;
      for (size_t k = 0; all && k < ch.size(); ++k) all = byte_token_[static_cast<unsigned char>(ch[k])] >= 0;
      if (all) {
        for (unsigned char b : ch) ids.push_back(byte_token_[b]);
        last_unk = false;
        continue;
      }
      unknown(ch);
    }
  }
  // Merge the lowest-ranked adjacent pair, leftmost first, one at a time, until none is left:
  // symbols in a linked list, candidate pairs in a min-heap by (rank, position), so a piece of n
  // symbols costs O(n log n), not the O(n^2) of rescanning it for every merge (a 200 KB run
  // without spaces is one piece). Positions are the symbols' first indexes, which keep their
  // order along the list, so the smallest position is the leftmost pair. A candidate is stale
  // when its left symbol is gone or either symbol has changed since it was pushed: then it is
  // skipped, and the pair that replaced it has been pushed with its own rank.
  TS_CHECK(ids.size() < static_cast<size_t>(INT_MAX), source_, ": a piece of ", ids.size(), " symbols is too long");
  const int n = static_cast<int>(ids.size());
  if (n > 1 && !merges_.empty()) {
    std::vector<int> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
    std::vector<char> alive(static_cast<size_t>(n), 1);
    for (int k = 0; k < n; ++k) prev[static_cast<size_t>(k)] = k - 1, next[static_cast<size_t>(k)] = k + 1 < n ? k + 1 : -1;
    struct Cand {
      int rank, pos;
      int64_t left, right, merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::vector<Cand> heap;
    auto consider = [&](int pos) {
      const int nx = next[static_cast<size_t>(pos)];
      if (pos < 0 || nx < 0) return;
      const auto it = merges_.find((static_cast<uint64_t>(ids[static_cast<size_t>(pos)]) << 32) |
                                   static_cast<uint64_t>(ids[static_cast<size_t>(nx)]));
      if (it == merges_.end()) return;
      heap.push_back({it->second.first, pos, ids[static_cast<size_t>(pos)], ids[static_cast<size_t>(nx)], it->second.second});
      std::push_heap(heap.begin(), heap.end(), std::greater<Cand>());
    };
    for (int k = 0; k + 1 < n; ++k) consider(k);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<Cand>());
      const Cand c = heap.back();
      heap.pop_back();
      const size_t p = static_cast<size_t>(c.pos);
      if (!alive[p] || next[p] < 0) continue;
      const size_t q = static_cast<size_t>(next[p]);
      if (ids[p] != c.left || ids[q] != c.right) continue;  // stale
      ids[p] = c.merged;
      alive[q] = 0;
      next[p] = next[q];
      if (next[q] >= 0) prev[static_cast<size_t>(next[q])] = c.pos;
      if (prev[p] >= 0) consider(prev[p]);
      consider(c.pos);
    }
    for (int k = 0; k >= 0; k = next[static_cast<size_t>(k)]) out.push_back(ids[static_cast<size_t>(k)]);
    return;
  }
  out.insert(out.end(), ids.begin(), ids.end());
}

// Note [SentencePiece-style BPE]
// Llama 2's and Mistral's tokenizer.json (converted from SentencePiece models) mark spaces with
// U+2581 "▁" instead of mapping bytes: either a normalizer Sequence [Prepend("▁"), Replace(" ",
// "▁")] with no pre-tokenizer (the "legacy" form: every span between added tokens, the whole span
// one word, gets the prefix) or a Metaspace pre-tokenizer (replacement "▁", prepend_scheme
// always/first/never: first = only the span at the start of the text, and not when it already
// starts with "▁"; split: a new word at each "▁"). The BPE model merges characters; with
// byte_fallback a character the vocabulary lacks becomes the <0xXX> tokens of its UTF-8 bytes.
// Decoding maps "▁" back to a space and <0xXX> tokens to their byte. GGUF's "llama" tokenizers
// (SentencePiece: tokens with scores, no merges) are the same with merges made from the scores:
// every split of a token into two tokens merges at the rank of the token's score, highest score
// first, equal scores leftmost first, which is what llama.cpp's SPM tokenizer computes.
std::string BpeTokenizer::spm_normalize(const std::string& raw, bool at_start) const {
  std::string text = nfc_ ? nfc(raw) : raw;
  if (prepend_ && !text.empty()) text = kMeta + text;
  auto replace_spaces = [&](std::string& t) {
    std::string r;
    r.reserve(t.size() + t.size() / 4);
    for (char c : t) {
      if (c == ' ') {
        r += kMeta;
      } else {
        r += c;
      }
    }
    t.swap(r);
  };
  if (replace_space_) replace_spaces(text);
  if (metaspace_ != Metaspace::kNone) {
    replace_spaces(text);
    const bool starts = text.compare(0, kMeta.size(), kMeta) == 0;
    if (!starts && (metaspace_ == Metaspace::kAlways || (metaspace_ == Metaspace::kFirst && at_start))) text = kMeta + text;
  }
  return text;
}

void BpeTokenizer::encode_plain(const std::string& raw, bool at_start, std::vector<int64_t>& out) const {
  if (spm_) {
    const std::string text = spm_normalize(raw, at_start);
    if (metaspace_ == Metaspace::kNone || !metaspace_split_) {
      bpe(text, out);
      return;
    }
    // Metaspace split: a new word at each "▁", which begins it (MergedWithNext).
    size_t begin = 0;
    for (size_t at = text.find(kMeta, 1); at != std::string::npos; at = text.find(kMeta, at + 1)) {
      bpe(text.substr(begin, at - begin), out);
      begin = at;
    }
    bpe(text.substr(begin), out);
    return;
  }
  const std::string text = nfc_ ? nfc(raw) : raw;
  for (const auto& piece : pre_split(text)) bpe(piece, out);
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start < text.size()) {
    // The earliest added token (the longest one at a tie), else the rest is plain text (Note
    // [Added tokens]). An empty span (the text starts with an added token, or two are adjacent)
    // is no text at all: `tokenizers` makes no split of it, and a Metaspace pre-tokenizer would
    // otherwise turn it into a lone "▁" token.
    const auto [at, k] = find_added(text, start);
    if (at == std::string::npos) break;
    if (at > start) encode_plain(text.substr(start, at - start), start == 0, out);
    out.push_back(added_[k].second);
    start = at + added_[k].first.size();
  }
  if (start < text.size()) encode_plain(text.substr(start), start == 0, out);
  return out;
}

std::string BpeTokenizer::token_bytes(int64_t id) const {
  TS_CHECK(id >= 0 && id < vocab_size() && !id_to_token_[static_cast<size_t>(id)].empty(), source_, ": token id ", id,
           " is not in the vocabulary (", vocab_size(), " ids)");
  const std::string& tok = id_to_token_[static_cast<size_t>(id)];
  if (spm_ && byte_fallback_) {  // a <0xXX> token is its byte (Note [SentencePiece-style BPE])
    if (const auto it = byte_of_token_.find(id); it != byte_of_token_.end()) return std::string(1, static_cast<char>(it->second));
  }
  // Added tokens are their literal text.
  if (const auto it = added_by_id_.find(id); it != added_by_id_.end()) return added_[it->second].first;
  if (spm_) {
    return meta_to_spaces(tok);
  }
  std::string out;
  for (const auto& cp : code_points(tok)) {
    const auto it = unicode_to_byte_.find(tok.substr(cp.begin, cp.len));
    TS_CHECK(it != unicode_to_byte_.end(), source_, ": token ", id, " ('", tok, "') holds a character outside the byte map");
    out += static_cast<char>(it->second);
  }
  return out;
}

}  // namespace torchspeed::data
