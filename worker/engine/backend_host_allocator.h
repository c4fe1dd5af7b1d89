// BackendHostAllocator: value-store memory from a Backend's host allocations
// (pinned and mapped on CUDA, so kernels read stored values in place).
#pragma once

#include <unordered_map>

#include "common/status.h"
#include "storage/host_allocator.h"
#include "worker/engine/backend.h"

namespace penumbra {

class BackendHostAllocator final : public storage::HostAllocator {
 public:
  explicit BackendHostAllocator(Backend* b) : b_(b) {}
  Result<void*> Allocate(size_t bytes) override {
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer buf, b_->AllocateHost(bytes));
    void* p = buf.get();
    bufs_.emplace(p, std::move(buf));
    return p;
  }
  void Free(void* p) override { bufs_.erase(p); }

 private:
  Backend* b_;
  std::unordered_map<void*, DeviceBuffer> bufs_;
};

}  // namespace penumbra
