#include "torchspeed/inference/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <random>

#include "torchspeed/base/error.h"

namespace torchspeed::inference {

// Note [Prefix caching]
// Requests often begin alike: a system prompt, a chat's history, few-shot examples. A full KV
// block's keys and values depend only on the tokens up to its end, so a block computed for one
// request serves every later request whose tokens agree that far (vLLM's automatic prefix
// caching, SGLang's radix cache). The index maps (the key of the prefix before the block, the
// block's tokens) to the block and a fresh key for the longer prefix: exact keys, compared token
// by token, so two prefixes never share a block by a hash collision, and a request cannot reach
// another's cache by crafting one (the table's hash is seeded per process against crafted
// bucket floods). A sequence publishes each block once it is full (prompt and generated tokens
// alike, so a chat's next turn finds the previous answer); a new sequence takes references to
// the longest published run of its tokens and computes the rest, always at least its last
// token, whose logits it needs. Only full blocks are shared and a shared block is never written
// again, so no copy-on-write is needed: the partial block at a sequence's end is its own (as in
// vLLM's v1 engine). Released published blocks stay cached until their memory is needed,
// evicted least recently released first, a sequence's tail before its head. The keys and values
// a sequence finds are bit for bit those it would compute itself when the serving kernels give
// a row the same bits in any batch or chunk (Note [AMX tiles], Note [bf16 dot products]);
// tests/unit/test_inference.cpp compares the tokens with and without the cache.
BlockPool::BlockPool(int64_t num_blocks, int64_t block_size)
    : block_size_(std::max<int64_t>(block_size, 0)),
      refs_(static_cast<size_t>(std::max<int64_t>(num_blocks, 0)), 0),
      prev_(static_cast<size_t>(std::max<int64_t>(num_blocks, 0)) + 1),
      next_(static_cast<size_t>(std::max<int64_t>(num_blocks, 0)) + 1),
      index_(16, KeyHash{std::random_device{}() * 0x9E3779B97F4A7C15ULL + 1}),
      published_(static_cast<size_t>(std::max<int64_t>(num_blocks, 0))) {
  TS_CHECK(num_blocks > 0, "the KV cache needs at least one block, got ", num_blocks);
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
  const auto head = static_cast<int32_t>(num_blocks);
  prev_[static_cast<size_t>(head)] = next_[static_cast<size_t>(head)] = head;
}

size_t BlockPool::KeyHash::operator()(const Key& k) const {
  // splitmix64's finaliser over the words, from a per-process seed.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(seed ^ k.parent);
  for (int64_t t : k.tokens) h = mix(h + static_cast<uint64_t>(t) + 0x9E3779B97F4A7C15ULL);
  return static_cast<size_t>(h);
}

void BlockPool::lru_unlink(int32_t b) {
  const auto i = static_cast<size_t>(b);
  next_[static_cast<size_t>(prev_[i])] = next_[i];
  prev_[static_cast<size_t>(next_[i])] = prev_[i];
  --evictable_;
}

void BlockPool::retain(int32_t b) {
  const auto i = static_cast<size_t>(b);
  if (refs_[i] == 0) {
    TS_INTERNAL_ASSERT(published_[i].has_value(), "KV block ", b, " retained while free");
    lru_unlink(b);
  }
  ++refs_[i];
}

std::vector<int32_t> BlockPool::allocate(int64_t n) {
  TS_CHECK(n >= 0 && n <= free(), "KV cache: asked for ", n, " blocks, ", free(), " of ", total(), " are free");
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  const auto head = static_cast<size_t>(total());
  for (int64_t i = 0; i < n; ++i) {
    int32_t b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {  // evict the least recently released cached block
      b = next_[head];
      lru_unlink(b);
      auto& key = published_[static_cast<size_t>(b)];
      TS_INTERNAL_ASSERT(key.has_value(), "KV block ", b, " evicted but not published");
      index_.erase(*key);
      key.reset();
    }
    TS_INTERNAL_ASSERT(refs_[static_cast<size_t>(b)] == 0, "KV block ", b, " handed out twice");
    refs_[static_cast<size_t>(b)] = 1;
    out.push_back(b);
  }
  return out;
}

void BlockPool::release(std::vector<int32_t>& blocks) {
  const auto head = static_cast<int32_t>(total());
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    TS_INTERNAL_ASSERT(b >= 0 && b < total() && refs_[static_cast<size_t>(b)] > 0, "KV block ", b,
                       " released but not in use");
    const auto i = static_cast<size_t>(b);
    if (--refs_[i] > 0) continue;
    if (!published_[i]) {
      free_.push_back(b);
      continue;
    }
    // To the list's end: the most recently released, evicted last.
    const int32_t last = prev_[static_cast<size_t>(head)];
    prev_[i] = last;
    next_[i] = head;
    next_[static_cast<size_t>(last)] = b;
    prev_[static_cast<size_t>(head)] = b;
    ++evictable_;
  }
  blocks.clear();
}

std::vector<int32_t> BlockPool::match(const std::vector<int64_t>& tokens, int64_t max_blocks, std::vector<uint64_t>& keys,
                                      uint64_t root) {
  std::vector<int32_t> out;
  keys.clear();
  if (!caching()) return out;
  Key key;
  key.parent = root;
  const int64_t n = std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / block_size_);
  for (int64_t i = 0; i < n; ++i) {
    key.tokens.assign(tokens.begin() + i * block_size_, tokens.begin() + (i + 1) * block_size_);
    const auto it = index_.find(key);
    if (it == index_.end()) break;
    retain(it->second.block);
    out.push_back(it->second.block);
    keys.push_back(it->second.id);
    key.parent = it->second.id;
  }
  return out;
}

uint64_t BlockPool::publish(uint64_t parent, const int64_t* tokens, int32_t b) {
  TS_INTERNAL_ASSERT(caching() && b >= 0 && b < total() && refs_[static_cast<size_t>(b)] > 0, "KV block ", b,
                     " published while not in use");
  Key key{parent, std::vector<int64_t>(tokens, tokens + block_size_)};
  const auto it = index_.find(key);
  if (it != index_.end()) return it->second.id;
  TS_INTERNAL_ASSERT(!published_[static_cast<size_t>(b)], "KV block ", b, " published twice");
  const uint64_t id = next_id_++;
  published_[static_cast<size_t>(b)] = key;
  index_.emplace(std::move(key), Entry{id, b});
  return id;
}

int64_t KVCache::bytes_per_block(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& o) {
  const int64_t scales = o.dtype() == at::kChar ? 4 : 0;  // int8: one fp32 scale per (slot, head)
  return 2 * n_layer * o.block_size() * heads * (head_dim * static_cast<int64_t>(c10::elementSize(o.dtype())) + scales);
}

KVCache::KVCache(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& o)
    : block_size_(o.block_size()), dtype_(o.dtype()) {
  TS_CHECK(o.block_size() > 0, "KV cache block size must be positive, got ", o.block_size());
  TS_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16 || dtype_ == at::kChar, "the KV cache holds fp32, bf16 or int8, not ",
           dtype_);
  const int64_t per_block = bytes_per_block(n_layer, heads, head_dim, o);
  num_blocks_ = static_cast<int64_t>(o.budget_mb() * 1024.0 * 1024.0) / per_block;
  TS_CHECK(num_blocks_ > 0, "--kv-cache-mb ", o.budget_mb(), " holds no block: one block of ", o.block_size(),
           " tokens takes ", per_block, " bytes for this model");
  for (int64_t l = 0; l < n_layer; ++l) {
    k_.push_back(at::zeros({num_blocks_ * block_size_, heads, head_dim}, dtype_));
    v_.push_back(at::zeros({num_blocks_ * block_size_, heads, head_dim}, dtype_));
    if (dtype_ == at::kChar) {
      ks_.push_back(at::zeros({num_blocks_ * block_size_, heads}, at::kFloat));
      vs_.push_back(at::zeros({num_blocks_ * block_size_, heads}, at::kFloat));
    }
  }
}

int64_t KVCache::bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += k_[l].nbytes() + v_[l].nbytes();
  for (size_t l = 0; l < ks_.size(); ++l) b += ks_[l].nbytes() + vs_[l].nbytes();
  return b;
}

void append_slots(const std::vector<int32_t>& table, int64_t block_size, int64_t begin, int64_t end,
                  std::vector<int64_t>& out) {
  TS_INTERNAL_ASSERT(blocks_for(end, block_size) <= static_cast<int64_t>(table.size()), "positions up to ", end,
                     " need more blocks than the table's ", table.size());
  for (int64_t p = begin; p < end; ++p) {
    out.push_back(static_cast<int64_t>(table[static_cast<size_t>(p / block_size)]) * block_size + p % block_size);
  }
}

}  // namespace torchspeed::inference
