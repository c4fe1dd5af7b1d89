// DramValueStore: the first value-store tier, an arena of host memory laid
// out for gathers. A segment is one allocation, [layers][kv_heads]
// [chunk_capacity][C*d] elements, so (layer, head, chunk) is one contiguous
// row and a layer's rows are one block (LayerBase) that a GPU kernel can read
// in place when the memory is pinned and mapped (the engine injects such a
// HostAllocator; storage/ itself has no CUDA dependency).
//
// Integrity: each row's XXH3 checksum (seeded with the row's position, so a
// row written to the wrong place is caught too) is computed on PutChunks and
// verified by GatherChunks and Verify. DRAM is trusted memory: the zero-copy
// GPU path through LayerBase cannot verify per read. Checksums guard the copy
// paths and the tiers below this one (NVMe, network) that will copy from it.
//
// Thread-safety: all methods may be called concurrently. CreateSegment and
// DropSegment take an exclusive lock; puts, gathers and Verify a shared one
// and copy rows concurrently. A pointer from LayerBase stays valid until the
// segment is dropped; dropping a segment while someone reads it through such a
// pointer is the caller's bug.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "storage/host_allocator.h"
#include "storage/value_store.h"

namespace penumbra::storage {

struct DramValueStoreOptions {
  // Upper bound on bytes_used(); CreateSegment beyond it fails with
  // ResourceExhausted. 0 means no limit. Default: 0.
  size_t capacity_bytes = 0;
};

class DramValueStore final : public ValueStore {
 public:
  // `allocator` must outlive the store.
  DramValueStore(HostAllocator* allocator, DramValueStoreOptions options);
  ~DramValueStore() override;
  DramValueStore(const DramValueStore&) = delete;
  DramValueStore& operator=(const DramValueStore&) = delete;

  Result<SegmentId> CreateSegment(const SegmentLayout& layout) override;
  Result<SegmentLayout> Layout(SegmentId id) const override;
  Status PutChunks(SegmentId id, int layer, int kv_head, int first_chunk, int n_chunks, const void* src) override;
  Status GatherChunks(SegmentId id, int layer, std::span<const ChunkRef> refs, void* dst) override;
  Status Verify(SegmentId id) const override;
  Status DropSegment(SegmentId id) override;
  size_t bytes_used() const override;

  // Host address of `layer`'s block: row (head, chunk) at
  // base + (head * chunk_capacity + chunk) * chunk_bytes. For zero-copy
  // readers; rows never put hold unspecified bytes.
  Result<const void*> LayerBase(SegmentId id, int layer) const;

  size_t capacity_bytes() const { return options_.capacity_bytes; }

 private:
  struct Segment;
  // Caller holds mu_ (shared or exclusive).
  Result<Segment*> Find(SegmentId id) const;
  static Status VerifyRow(const Segment& s, size_t row);

  HostAllocator* const allocator_;
  const DramValueStoreOptions options_;
  mutable std::shared_mutex mu_;
  std::unordered_map<SegmentId, std::unique_ptr<Segment>> segments_;  // guarded by mu_
  size_t bytes_used_ = 0;                                             // guarded by mu_
  SegmentId next_id_ = 1;                                             // guarded by mu_
};

}  // namespace penumbra::storage
