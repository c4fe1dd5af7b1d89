// BackendHostAllocator: value-store memory from a Backend's host allocations
// (pinned and mapped on CUDA, so kernels read stored values in place).
#pragma once

#include <mutex>
#include <unordered_map>

#include "common/status.h"
#include "storage/host_allocator.h"
#include "worker/engine/backend.h"

namespace penumbra {

class BackendHostAllocator final : public storage::HostAllocator {
 public:
  explicit BackendHostAllocator(Backend* b) : b_(b) {}
  Result<void*> Allocate(size_t bytes) override {
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer buf, b_->AllocateHostLarge(bytes));
    void* p = buf.get();
    std::lock_guard<std::mutex> lk(mu_);
    bufs_.emplace(p, std::move(buf));
    return p;
  }
  void Free(void* p) override {
    DeviceBuffer b;  // freed outside the lock
    std::lock_guard<std::mutex> lk(mu_);
    auto it = bufs_.find(p);
    if (it == bufs_.end()) return;
    b = std::move(it->second);
    bufs_.erase(it);
  }
  // Hands the allocation at `p` (from Allocate) to the caller, as the buffer
  // that frees it; an empty buffer if `p` is not one of ours.
  DeviceBuffer Take(void* p) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = bufs_.find(p);
    if (it == bufs_.end()) return DeviceBuffer();
    DeviceBuffer b = std::move(it->second);
    bufs_.erase(it);
    return b;
  }

 private:
  Backend* b_;
  std::mutex mu_;
  std::unordered_map<void*, DeviceBuffer> bufs_;
};

}  // namespace penumbra
