#include "storage/host_allocator.h"

#include <cstdlib>
#include <string>

namespace penumbra::storage {

Result<void*> AlignedHostAllocator::Allocate(size_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("AlignedHostAllocator: zero bytes");
  void* p = nullptr;
  if (posix_memalign(&p, kAlignment, bytes) != 0 || p == nullptr)
    return Status::ResourceExhausted("AlignedHostAllocator: cannot allocate " + std::to_string(bytes) + " bytes");
  return p;
}

void AlignedHostAllocator::Free(void* ptr) { std::free(ptr); }

}  // namespace penumbra::storage
