// DramValueStore: the first value-store tier, an arena of host memory laid
// out for gathers. A segment is [layers][kv_heads][chunk_capacity][C*d]
// elements, one allocation per layer, so (layer, head, chunk) is one
// contiguous row and a layer's rows are one block (LayerBase) that a GPU
// kernel can read in place when the memory is pinned and mapped (the engine
// injects such a HostAllocator; storage/ itself has no CUDA dependency).
// A segment's bytes count against the capacity from its creation; its layers
// are allocated then (CreateSegment) or one at a time as the writer reaches
// them (ReserveSegment, then AllocateLayer): pinning 8 GB for a long
// sequence takes seconds, which a layer-by-layer prefill spreads over its
// layers instead of paying before it starts.
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

  // Host memory a segment of `layout` takes in this store: its rows and,
  // per row, a checksum and a written mark.
  static size_t SegmentHostBytes(const SegmentLayout& layout) {
    return layout.total_bytes() + layout.chunks_per_layer() * static_cast<size_t>(layout.layers) * kRowOverheadBytes;
  }
  static constexpr size_t kRowOverheadBytes = sizeof(uint64_t) + sizeof(uint8_t);

  Result<SegmentId> CreateSegment(const SegmentLayout& layout) override;  // every layer allocated
  // A segment counted against the capacity with no layer allocated yet.
  Result<SegmentId> ReserveSegment(const SegmentLayout& layout);
  // Allocates `layer` of a reserved segment (a no-op when it is) and returns
  // its base, as LayerBase. Puts, gathers and LayerBase on a layer not
  // allocated are FailedPrecondition.
  Result<const void*> AllocateLayer(SegmentId id, int layer);
  Result<SegmentLayout> Layout(SegmentId id) const override;
  Status PutChunks(SegmentId id, int layer, int kv_head, int first_chunk, int n_chunks, const void* src) override;
  Status GatherChunks(SegmentId id, int layer, std::span<const ChunkRef> refs, void* dst) override;
  Status Verify(SegmentId id) const override;
  Status DropSegment(SegmentId id) override;
  size_t bytes_used() const override;

  // Takes the segment out of the store without freeing its memory: the
  // caller owns the allocations from then on (they came from the allocator
  // given to the constructor, and go back to it) and the store forgets the
  // segment (NotFound for it afterwards). Returns each layer's base (null
  // for a layer never allocated): the rows as LayerBase described them. This
  // is how a finished sequence hands its values to a longer-lived owner
  // without copying them.
  Result<std::vector<void*>> DetachSegment(SegmentId id);

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
  static Status NotAllocated(SegmentId id, int layer, const char* op);

  HostAllocator* const allocator_;
  const DramValueStoreOptions options_;
  mutable std::shared_mutex mu_;
  std::unordered_map<SegmentId, std::unique_ptr<Segment>> segments_;  // guarded by mu_
  size_t bytes_used_ = 0;                                             // guarded by mu_
  SegmentId next_id_ = 1;                                             // guarded by mu_
};

}  // namespace penumbra::storage
