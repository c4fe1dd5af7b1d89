// Where the value store's host memory comes from. An interface so that
// storage/ needs no CUDA: the engine injects a pinned + mapped allocator (the
// GPU then reads value chunks in place, zero-copy); tests and the CPU backend
// use AlignedHostAllocator.
#pragma once

#include <cstddef>

#include "common/status.h"

namespace penumbra::storage {

// Implementations must be thread-safe.
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  // `bytes` > 0; the memory is at least 4 KiB aligned and uninitialized.
  // ResourceExhausted when it cannot be had.
  virtual Result<void*> Allocate(size_t bytes) = 0;
  // Frees memory from Allocate on this allocator.
  virtual void Free(void* ptr) = 0;
};

// Ordinary pageable memory from posix_memalign, 4 KiB aligned.
class AlignedHostAllocator final : public HostAllocator {
 public:
  static constexpr size_t kAlignment = 4096;
  Result<void*> Allocate(size_t bytes) override;
  void Free(void* ptr) override;
};

}  // namespace penumbra::storage
