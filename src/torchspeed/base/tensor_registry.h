// A value attached to tensors by identity (their TensorImpl): what a parameter is beyond its
// data (a tensor-parallel split, an expert shard), which LibTorch tensors have no field for.
// Tensor::set_data keeps the TensorImpl, so an entry survives ZeRO's re-homing of parameters.
// A weak reference per entry keeps a dead tensor's address from being reused by a new tensor
// while its entry exists; dead entries are pruned on insertion. Thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <mutex>
#include <optional>
#include <unordered_map>

namespace torchspeed {

template <typename T>
class TensorRegistry {
 public:
  void set(const at::Tensor& t, T value) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = map_.begin(); it != map_.end();) it = it->second.tensor.expired() ? map_.erase(it) : std::next(it);
    map_.insert_or_assign(t.unsafeGetTensorImpl(),
                          Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), std::move(value)});
  }
  std::optional<T> get(const at::Tensor& t) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(t.unsafeGetTensorImpl());
    if (it == map_.end() || it->second.tensor.expired()) return std::nullopt;
    return it->second.value;
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
    T value;
  };
  mutable std::mutex mu_;
  std::unordered_map<const void*, Entry> map_;
};

}  // namespace torchspeed
