// The paged KV cache (vLLM's paged attention, FastGen's blocked KV): keys and values of every
// sequence live in fixed-size blocks of `block_size` token slots taken from one pool sized by a
// memory budget. A sequence owns a block table (the blocks it holds, in order); token position p
// of a sequence sits in slot table[p / block_size] * block_size + p % block_size of every layer's
// cache. Blocks return to the pool when the sequence finishes, is cancelled or preempted.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace torchspeed::inference {

// Hands out block ids [0, num_blocks). Exact accounting: used() + free() == total() always, a
// block is never handed out twice, and freeing a block that is not in use is an internal error.
class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks);
  int64_t total() const { return static_cast<int64_t>(in_use_.size()); }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  int64_t used() const { return total() - free(); }
  bool can_allocate(int64_t n) const { return n <= free(); }
  // Takes n blocks (lowest ids first, for locality); throws when fewer are free.
  std::vector<int32_t> allocate(int64_t n);
  void release(std::vector<int32_t>& blocks);  // empties `blocks`

 private:
  std::vector<int32_t> free_;  // a stack: the most recently freed block is reused first
  std::vector<bool> in_use_;
};

struct KVCacheOptions {
  TORCH_ARG(int64_t, block_size) = 16;      // token slots per block
  TORCH_ARG(double, budget_mb) = 256;       // bytes for keys and values of every layer
  // fp32 or bf16 (half the bytes a decode step reads, twice the tokens in the budget; keys and
  // values rounded once when written, attention computed in fp32).
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
};

// Keys and values of every layer: [num_blocks * block_size, heads, head_dim] each, in the
// options' dtype.
class KVCache {
 public:
  KVCache(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& options);
  static int64_t bytes_per_block(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& options);
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t bytes() const;
  at::Tensor& keys(int64_t layer) { return k_[static_cast<size_t>(layer)]; }
  at::Tensor& values(int64_t layer) { return v_[static_cast<size_t>(layer)]; }
  at::ScalarType dtype() const { return dtype_; }

 private:
  int64_t block_size_, num_blocks_;
  at::ScalarType dtype_;
  std::vector<at::Tensor> k_, v_;
};

// Blocks needed to hold `tokens` token slots.
inline int64_t blocks_for(int64_t tokens, int64_t block_size) { return (tokens + block_size - 1) / block_size; }

// Slot ids of positions [begin, end) of a sequence with this block table.
void append_slots(const std::vector<int32_t>& table, int64_t block_size, int64_t begin, int64_t end,
                  std::vector<int64_t>& out);

}  // namespace torchspeed::inference
