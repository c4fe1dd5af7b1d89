// ValueStore: where the value cache of offloaded segments lives. Values are
// put and gathered in chunks: one chunk is the C tokens' values of one
// (segment, layer, kv_head, chunk index), a contiguous row of C*d elements.
//
// Tiers implement this interface: DramValueStore (host DRAM arena laid out for
// gathers, read by the GPU in place), later RocksDB on NVMe and remote stores.
// Every tier checksums the rows it stores; reads through the copy paths
// (GatherChunks) verify them and report Corruption rather than return wrong
// values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "common/dtype.h"
#include "common/status.h"

namespace penumbra::storage {

using SegmentId = uint64_t;  // 0 is never a valid id

// Shape of one segment's value storage.
struct SegmentLayout {
  int layers = 0;              // model layers
  int kv_heads = 0;            // KV heads per layer
  int chunk_capacity = 0;      // chunks per (layer, head) this segment may hold
  int chunk_tokens = 0;        // tokens per chunk (C)
  int head_dim = 0;            // d
  DType dtype = DType::kBF16;  // element type of the rows
  // Bytes of a row when the rows are not chunk_elements() of dtype (fp8
  // values: codes and scales, kernels/value_format.h); 0: they are.
  size_t row_bytes = 0;

  size_t chunk_elements() const { return static_cast<size_t>(chunk_tokens) * head_dim; }
  size_t chunk_bytes() const { return row_bytes > 0 ? row_bytes : chunk_elements() * DTypeSize(dtype); }
  size_t chunks_per_layer() const { return static_cast<size_t>(kv_heads) * chunk_capacity; }
  size_t layer_bytes() const { return chunks_per_layer() * chunk_bytes(); }
  size_t total_bytes() const { return layer_bytes() * static_cast<size_t>(layers); }
  // InvalidArgument naming the field when a size is < 1 or the total overflows.
  Status Validate() const;
  std::string ToString() const;
};

// One chunk row of a given layer.
struct ChunkRef {
  int32_t kv_head = 0;
  int32_t chunk = 0;
  bool operator==(const ChunkRef&) const = default;
};

// Thread-safety: implementations are safe to call from several threads at
// once. Writing a chunk while another thread writes or reads the same chunk
// is the caller's race (the read may see a mix and report Corruption).
class ValueStore {
 public:
  virtual ~ValueStore() = default;

  // Reserves storage for a segment. InvalidArgument on a bad layout,
  // ResourceExhausted when over capacity (nothing is reserved then).
  virtual Result<SegmentId> CreateSegment(const SegmentLayout& layout) = 0;
  virtual Result<SegmentLayout> Layout(SegmentId id) const = 0;

  // Stores n_chunks consecutive chunks [first_chunk, first_chunk + n_chunks) of
  // (layer, kv_head) from `src` (n_chunks contiguous rows), overwriting. Checks
  // every argument before writing anything: NotFound for an unknown segment,
  // InvalidArgument for a layer, head or chunk range out of bounds.
  virtual Status PutChunks(SegmentId id, int layer, int kv_head, int first_chunk, int n_chunks, const void* src) = 0;

  // Copies the rows `refs` of `layer`, in order, to `dst` (refs.size()
  // contiguous rows) and verifies each row's checksum. NotFound for an unknown
  // segment or a chunk never put, InvalidArgument for out-of-range refs (both
  // checked before copying), Corruption on a checksum mismatch (dst then holds
  // unspecified bytes).
  virtual Status GatherChunks(SegmentId id, int layer, std::span<const ChunkRef> refs, void* dst) = 0;

  // Checks every stored row of the segment against its checksum.
  virtual Status Verify(SegmentId id) const = 0;

  // Releases the segment's storage. NotFound if unknown.
  virtual Status DropSegment(SegmentId id) = 0;

  // Bytes reserved by live segments (their row storage).
  virtual size_t bytes_used() const = 0;
};

}  // namespace penumbra::storage
