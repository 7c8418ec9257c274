#include "torchspeed/zero/partition_store.h"

#include <ATen/ATen.h>

#include "torchspeed/base/error.h"

namespace torchspeed::zero {

void MemoryStore::open(std::vector<std::string> kinds, int64_t part_numel, std::vector<PieceRange> pieces) {
  tensors_.clear();
  for (size_t k = 0; k < kinds.size(); ++k) tensors_.push_back(at::zeros({part_numel}, at::kFloat));
  pieces_ = std::move(pieces);
}

void MemoryStore::visit(const Visitor& fn, bool, bool) {
  std::vector<float*> base, ptrs(tensors_.size());
  for (auto& t : tensors_) base.push_back(t.data_ptr<float>());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    for (size_t k = 0; k < base.size(); ++k) ptrs[k] = base[k] + pieces_[i].begin;
    fn(i, ptrs.data());
  }
}

bool MemoryStore::adopt(size_t kind, at::Tensor t) {
  at::Tensor& live = tensors_.at(kind);
  TS_INTERNAL_ASSERT(t.numel() == live.numel() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                     "adopting a tensor of the wrong shape");
  live = std::move(t);
  return true;
}

int64_t MemoryStore::resident_bytes() const {
  int64_t n = 0;
  for (const auto& t : tensors_) n += static_cast<int64_t>(t.nbytes());
  return n;
}

}  // namespace torchspeed::zero
