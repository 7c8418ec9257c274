#include "torchspeed/inference/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "torchspeed/runtime/error.h"

namespace torchspeed::inference {

BlockPool::BlockPool(int64_t num_blocks) : in_use_(static_cast<size_t>(num_blocks), false) {
  TS_CHECK(num_blocks > 0, "the KV cache needs at least one block, got ", num_blocks);
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

std::vector<int32_t> BlockPool::allocate(int64_t n) {
  TS_CHECK(n >= 0 && n <= free(), "KV cache: asked for ", n, " blocks, ", free(), " of ", total(), " are free");
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    TS_INTERNAL_ASSERT(!in_use_[static_cast<size_t>(b)], "KV block ", b, " handed out twice");
    in_use_[static_cast<size_t>(b)] = true;
    out.push_back(b);
  }
  return out;
}

void BlockPool::release(std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) {
    TS_INTERNAL_ASSERT(b >= 0 && b < total() && in_use_[static_cast<size_t>(b)], "KV block ", b,
                       " released but not in use");
    in_use_[static_cast<size_t>(b)] = false;
    free_.push_back(b);
  }
  blocks.clear();
}

int64_t KVCache::bytes_per_block(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& o) {
  return 2 * n_layer * o.block_size() * heads * head_dim * static_cast<int64_t>(c10::elementSize(o.dtype()));
}

KVCache::KVCache(int64_t n_layer, int64_t heads, int64_t head_dim, const KVCacheOptions& o)
    : block_size_(o.block_size()), dtype_(o.dtype()) {
  TS_CHECK(o.block_size() > 0, "KV cache block size must be positive, got ", o.block_size());
  TS_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "the KV cache holds fp32 or bf16, not ", dtype_);
  const int64_t per_block = bytes_per_block(n_layer, heads, head_dim, o);
  num_blocks_ = static_cast<int64_t>(o.budget_mb() * 1024.0 * 1024.0) / per_block;
  TS_CHECK(num_blocks_ > 0, "--kv-cache-mb ", o.budget_mb(), " holds no block: one block of ", o.block_size(),
           " tokens takes ", per_block, " bytes for this model");
  for (int64_t l = 0; l < n_layer; ++l) {
    k_.push_back(at::zeros({num_blocks_ * block_size_, heads, head_dim}, dtype_));
    v_.push_back(at::zeros({num_blocks_ * block_size_, heads, head_dim}, dtype_));
  }
}

int64_t KVCache::bytes() const {
  int64_t b = 0;
  for (size_t l = 0; l < k_.size(); ++l) b += k_[l].nbytes() + v_[l].nbytes();
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
