// The paged KV cache (vLLM's paged attention, FastGen's blocked KV): keys and values of every
// sequence live in fixed-size blocks of `block_size` token slots taken from one pool sized by a
// memory budget. A sequence owns a block table (the blocks it holds, in order); token position p
// of a sequence sits in slot table[p / block_size] * block_size + p % block_size of every layer's
// cache. Blocks return to the pool when the sequence finishes, is cancelled or preempted.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

namespace torchspeed::inference {

// Hands out block ids [0, num_blocks), each with a reference count. Exact accounting: used() +
// free() == total() always, a block is never handed out while referenced, and dropping a
// reference nobody holds is an internal error.
//
// With prefix caching (`block_size` > 0; Note [Prefix caching]), a full block can be published
// under the tokens it holds and the prefix before it; a later sequence that starts with the same
// tokens takes a reference to it (`match`) instead of computing it again. A published block
// nobody references stays cached, counted as free: allocation takes empty blocks first, then
// evicts cached ones least recently released first.
class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks, int64_t block_size = 0);
  int64_t total() const { return static_cast<int64_t>(refs_.size()); }
  int64_t free() const { return static_cast<int64_t>(free_.size()) + evictable_; }
  int64_t used() const { return total() - free(); }
  bool can_allocate(int64_t n) const { return n <= free(); }
  // Takes n blocks (empty ones first, lowest ids first for locality; then the least recently
  // released cached ones, which leave the index), one reference each; throws when fewer are free.
  std::vector<int32_t> allocate(int64_t n);
  // Drops one reference of each block, last to first (so that a sequence's tail is evicted
  // before its head, which more requests share); empties `blocks`.
  void release(std::vector<int32_t>& blocks);

  // Prefix caching. `caching()`: whether it is on.
  bool caching() const { return block_size_ > 0; }
  // The published blocks that hold tokens[0, n * block_size) for the largest n <= max_blocks,
  // one reference taken on each; `keys` gets each block's prefix key (for publish). `root`: the
  // key the first block's prefix has (what publish was given as its parent; 0: none).
  std::vector<int32_t> match(const std::vector<int64_t>& tokens, int64_t max_blocks, std::vector<uint64_t>& keys,
                             uint64_t root = 0);
  // Publishes block `b` (referenced, full, never written again) as holding `tokens`
  // [0, block_size) after the prefix `parent` (0: the sequence's start; else a key publish or
  // match returned). Returns the key of the prefix that ends with this block; when that prefix
  // is published already (another sequence computed it at the same time), its key, and `b`
  // stays unpublished.
  uint64_t publish(uint64_t parent, const int64_t* tokens, int32_t b);
  int64_t cached_blocks() const { return static_cast<int64_t>(index_.size()); }  // published, referenced or not

 private:
  struct Key {
    uint64_t parent = 0;
    std::vector<int64_t> tokens;
    bool operator==(const Key& o) const { return parent == o.parent && tokens == o.tokens; }
  };
  struct KeyHash {
    uint64_t seed = 0;
    size_t operator()(const Key& k) const;
  };
  struct Entry {
    uint64_t id = 0;
    int32_t block = -1;
  };
  void retain(int32_t b);
  void lru_unlink(int32_t b);
  int64_t block_size_ = 0;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // empty blocks, a stack: the most recently freed is reused first
  // Published blocks nobody references, a list in release order (prev_/next_, head at total()).
  std::vector<int32_t> prev_, next_;
  int64_t evictable_ = 0;
  std::unordered_map<Key, Entry, KeyHash> index_;
  std::vector<std::optional<Key>> published_;  // per block: its key in index_
  uint64_t next_id_ = 1;
};

struct KVCacheOptions {
  TORCH_ARG(int64_t, block_size) = 16;      // token slots per block
  TORCH_ARG(double, budget_mb) = 256;       // bytes for keys and values of every layer
  // fp32, bf16 (half the bytes a decode step reads, twice the tokens in the budget; keys and
  // values rounded once when written, attention computed in fp32) or int8 (kChar: a quarter of
  // fp32's bytes and one fp32 scale per token and KV head, max |x| / 127, so each row is
  // quantized once, when written, whatever else shares its block; attention in fp32).
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
};

// Keys and values of every layer: [num_blocks * block_size, heads, head_dim] each, in the
// options' dtype; int8 with their scales [num_blocks * block_size, heads] fp32.
class KVCache {
 public:
  KVCache(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& options);
  static int64_t bytes_per_block(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& options);
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t bytes() const;
  at::Tensor& keys(int64_t layer) { return k_[static_cast<size_t>(layer)]; }
  at::Tensor& values(int64_t layer) { return v_[static_cast<size_t>(layer)]; }
  // int8 only (else undefined): the scale of each (slot, head) row.
  at::Tensor& key_scales(int64_t layer) { return ks_[static_cast<size_t>(layer)]; }
  at::Tensor& value_scales(int64_t layer) { return vs_[static_cast<size_t>(layer)]; }
  at::ScalarType dtype() const { return dtype_; }

 private:
  int64_t block_size_, num_blocks_;
  at::ScalarType dtype_;
  std::vector<at::Tensor> k_, v_, ks_, vs_;
};

// Blocks needed to hold `tokens` token slots.
inline int64_t blocks_for(int64_t tokens, int64_t block_size) { return (tokens + block_size - 1) / block_size; }

// Slot ids of positions [begin, end) of a sequence with this block table.
void append_slots(const std::vector<int32_t>& table, int64_t block_size, int64_t begin, int64_t end,
                  std::vector<int64_t>& out);

}  // namespace torchspeed::inference
