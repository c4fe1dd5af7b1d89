#include "storage/dram_value_store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <utility>

#include "common/hash.h"

namespace penumbra::storage {

Status SegmentLayout::Validate() const {
  auto positive = [](int v, const char* name) -> Status {
    if (v < 1)
      return Status::InvalidArgument(std::string("SegmentLayout.") + name + " must be >= 1, got " + std::to_string(v));
    return Status::OK();
  };
  PENUMBRA_RETURN_IF_ERROR(positive(layers, "layers"));
  PENUMBRA_RETURN_IF_ERROR(positive(kv_heads, "kv_heads"));
  PENUMBRA_RETURN_IF_ERROR(positive(chunk_capacity, "chunk_capacity"));
  PENUMBRA_RETURN_IF_ERROR(positive(chunk_tokens, "chunk_tokens"));
  PENUMBRA_RETURN_IF_ERROR(positive(head_dim, "head_dim"));
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    return Status::InvalidArgument("SegmentLayout.dtype must be f32, f16 or bf16, got " +
                                   std::string(DTypeName(dtype)));
  // A row's bytes, when given, hold at least a byte per element (fp8 codes)
  // and at most the dtype's (the checks below bound the product by it).
  if (row_bytes > 0 && (row_bytes < chunk_elements() || row_bytes > chunk_elements() * DTypeSize(dtype) + 4 * 64)) {
    return Status::InvalidArgument("SegmentLayout.row_bytes " + std::to_string(row_bytes) + " is not a row of " +
                                   std::to_string(chunk_elements()) + " elements");
  }
  // Every factor is < 2^31 and the element size <= 4: check the product stepwise.
  size_t total = DTypeSize(dtype) + (row_bytes > 0 ? 1 : 0);
  for (int f : {chunk_tokens, head_dim, chunk_capacity, kv_heads, layers}) {
    if (total > std::numeric_limits<size_t>::max() / static_cast<size_t>(f))
      return Status::InvalidArgument("SegmentLayout too large: " + ToString());
    total *= static_cast<size_t>(f);
  }
  return Status::OK();
}

std::string SegmentLayout::ToString() const {
  return "layers " + std::to_string(layers) + ", kv_heads " + std::to_string(kv_heads) + ", chunk_capacity " +
         std::to_string(chunk_capacity) + ", chunk_tokens " + std::to_string(chunk_tokens) + ", head_dim " +
         std::to_string(head_dim) + ", dtype " + std::string(DTypeName(dtype)) +
         (row_bytes > 0 ? ", row_bytes " + std::to_string(row_bytes) : "");
}

struct DramValueStore::Segment {
  SegmentLayout layout;
  size_t row_bytes = 0;
  std::vector<char*> layers;  // one allocation per layer; null until allocated
  // Per row ((layer * kv_heads + head) * chunk_capacity + chunk). Distinct rows
  // are distinct objects, so concurrent puts of different rows do not race.
  std::vector<uint64_t> checksum;
  std::vector<uint8_t> written;

  size_t Row(int layer, int head, int chunk) const {
    return (static_cast<size_t>(layer) * layout.kv_heads + head) * layout.chunk_capacity + chunk;
  }
  // Rows of an allocated layer only (callers check Allocated first).
  char* RowPtr(size_t row) const {
    const size_t per_layer = layout.chunks_per_layer();
    return layers[row / per_layer] + row % per_layer * row_bytes;
  }
  bool Allocated(int layer) const { return layers[static_cast<size_t>(layer)] != nullptr; }
};

namespace {

uint64_t RowChecksum(const void* p, size_t bytes, size_t row) { return Hash64(p, bytes, row); }

std::string RowName(const SegmentLayout& l, SegmentId id, size_t row) {
  const size_t chunk = row % l.chunk_capacity;
  const size_t head = row / l.chunk_capacity % l.kv_heads;
  const size_t layer = row / l.chunks_per_layer();
  return "segment " + std::to_string(id) + " layer " + std::to_string(layer) + " kv_head " + std::to_string(head) +
         " chunk " + std::to_string(chunk);
}

}  // namespace

DramValueStore::DramValueStore(HostAllocator* allocator, DramValueStoreOptions options)
    : allocator_(allocator), options_(options) {
  CHECK(allocator_ != nullptr);
}

DramValueStore::~DramValueStore() {
  for (auto& [id, seg] : segments_) {
    for (char* p : seg->layers) {
      if (p) allocator_->Free(p);
    }
  }
}

Status DramValueStore::NotAllocated(SegmentId id, int layer, const char* op) {
  return Status::FailedPrecondition(std::string(op) + ": layer " + std::to_string(layer) + " of segment " +
                                    std::to_string(id) + " is not allocated (AllocateLayer)");
}

Result<DramValueStore::Segment*> DramValueStore::Find(SegmentId id) const {
  auto it = segments_.find(id);
  if (it == segments_.end()) return Status::NotFound("value store: no segment " + std::to_string(id));
  return it->second.get();
}

Result<SegmentId> DramValueStore::CreateSegment(const SegmentLayout& layout) {
  PENUMBRA_ASSIGN_OR_RETURN(SegmentId id, ReserveSegment(layout));
  for (int l = 0; l < layout.layers; ++l) {
    Result<const void*> base = AllocateLayer(id, l);
    if (!base.ok()) {
      (void)DropSegment(id);
      return base.status();
    }
  }
  return id;
}

Result<SegmentId> DramValueStore::ReserveSegment(const SegmentLayout& layout) {
  PENUMBRA_RETURN_IF_ERROR(layout.Validate());
  const size_t bytes = layout.total_bytes();
  std::unique_lock lock(mu_);
  if (options_.capacity_bytes > 0 && bytes > options_.capacity_bytes - std::min(bytes_used_, options_.capacity_bytes))
    return Status::ResourceExhausted("value store: segment of " + std::to_string(bytes) + " bytes does not fit (" +
                                     std::to_string(bytes_used_) + " of " + std::to_string(options_.capacity_bytes) +
                                     " used)");
  auto seg = std::make_unique<Segment>();
  seg->layout = layout;
  seg->row_bytes = layout.chunk_bytes();
  seg->layers.assign(static_cast<size_t>(layout.layers), nullptr);
  const size_t rows = layout.chunks_per_layer() * static_cast<size_t>(layout.layers);
  seg->checksum.assign(rows, 0);
  seg->written.assign(rows, 0);
  const SegmentId id = next_id_++;
  segments_.emplace(id, std::move(seg));
  bytes_used_ += bytes;
  return id;
}

Result<const void*> DramValueStore::AllocateLayer(SegmentId id, int layer) {
  size_t bytes = 0;
  {
    std::shared_lock lock(mu_);
    PENUMBRA_ASSIGN_OR_RETURN(const Segment* s, Find(id));
    if (layer < 0 || layer >= s->layout.layers)
      return Status::InvalidArgument("AllocateLayer: layer " + std::to_string(layer) + " out of range for " +
                                     s->layout.ToString());
    if (s->Allocated(layer)) return static_cast<const void*>(s->layers[static_cast<size_t>(layer)]);
    bytes = s->layout.layer_bytes();
  }
  // Allocated without the lock (pinning a layer of a long segment takes
  // tenths of a second; other segments are read meanwhile).
  PENUMBRA_ASSIGN_OR_RETURN(void* mem, allocator_->Allocate(bytes));
  std::unique_lock lock(mu_);
  Result<Segment*> s = Find(id);
  if (!s.ok() || (*s)->Allocated(layer)) {  // dropped, or allocated by a racing call
    allocator_->Free(mem);
    if (!s.ok()) return s.status();
    return static_cast<const void*>((*s)->layers[static_cast<size_t>(layer)]);
  }
  (*s)->layers[static_cast<size_t>(layer)] = static_cast<char*>(mem);
  return static_cast<const void*>(mem);
}

Result<SegmentLayout> DramValueStore::Layout(SegmentId id) const {
  std::shared_lock lock(mu_);
  PENUMBRA_ASSIGN_OR_RETURN(const Segment* s, Find(id));
  return s->layout;
}

Status DramValueStore::PutChunks(SegmentId id, int layer, int kv_head, int first_chunk, int n_chunks, const void* src) {
  std::shared_lock lock(mu_);
  PENUMBRA_ASSIGN_OR_RETURN(Segment * s, Find(id));
  const SegmentLayout& l = s->layout;
  if (layer < 0 || layer >= l.layers || kv_head < 0 || kv_head >= l.kv_heads || first_chunk < 0 || n_chunks < 0 ||
      first_chunk > l.chunk_capacity - n_chunks)
    return Status::InvalidArgument("PutChunks: layer " + std::to_string(layer) + ", kv_head " +
                                   std::to_string(kv_head) + ", chunks [" + std::to_string(first_chunk) + ", +" +
                                   std::to_string(n_chunks) + ") out of range for " + l.ToString());
  if (n_chunks > 0 && src == nullptr) return Status::InvalidArgument("PutChunks: null src");
  if (!s->Allocated(layer)) return NotAllocated(id, layer, "PutChunks");
  const size_t first = s->Row(layer, kv_head, first_chunk);
  const char* in = static_cast<const char*>(src);
  for (int i = 0; i < n_chunks; ++i) {
    const size_t row = first + i;
    std::memcpy(s->RowPtr(row), in + i * s->row_bytes, s->row_bytes);
    // Checksum the bytes as stored (src may change under a racing caller).
    s->checksum[row] = RowChecksum(s->RowPtr(row), s->row_bytes, row);
    s->written[row] = 1;
  }
  return Status::OK();
}

Status DramValueStore::VerifyRow(const Segment& s, size_t row) {
  if (RowChecksum(s.RowPtr(row), s.row_bytes, row) != s.checksum[row])
    return Status::Corruption("value store: checksum mismatch");
  return Status::OK();
}

Status DramValueStore::GatherChunks(SegmentId id, int layer, std::span<const ChunkRef> refs, void* dst) {
  std::shared_lock lock(mu_);
  PENUMBRA_ASSIGN_OR_RETURN(const Segment* s, Find(id));
  const SegmentLayout& l = s->layout;
  if (layer < 0 || layer >= l.layers)
    return Status::InvalidArgument("GatherChunks: layer " + std::to_string(layer) + " out of range for " +
                                   l.ToString());
  if (!refs.empty() && dst == nullptr) return Status::InvalidArgument("GatherChunks: null dst");
  if (!refs.empty() && !s->Allocated(layer)) return NotAllocated(id, layer, "GatherChunks");
  for (size_t i = 0; i < refs.size(); ++i) {
    const ChunkRef& r = refs[i];
    if (r.kv_head < 0 || r.kv_head >= l.kv_heads || r.chunk < 0 || r.chunk >= l.chunk_capacity)
      return Status::InvalidArgument("GatherChunks: ref " + std::to_string(i) + " (kv_head " +
                                     std::to_string(r.kv_head) + ", chunk " + std::to_string(r.chunk) +
                                     ") out of range for " + l.ToString());
    if (!s->written[s->Row(layer, r.kv_head, r.chunk)])
      return Status::NotFound("GatherChunks: " + RowName(l, id, s->Row(layer, r.kv_head, r.chunk)) + " was never put");
  }
  char* out = static_cast<char*>(dst);
  for (size_t i = 0; i < refs.size(); ++i) {
    const size_t row = s->Row(layer, refs[i].kv_head, refs[i].chunk);
    char* o = out + i * s->row_bytes;
    std::memcpy(o, s->RowPtr(row), s->row_bytes);
    // Verify the copy that the caller will use, not the source again.
    if (RowChecksum(o, s->row_bytes, row) != s->checksum[row])
      return Status::Corruption("GatherChunks: checksum mismatch at " + RowName(l, id, row));
  }
  return Status::OK();
}

Status DramValueStore::Verify(SegmentId id) const {
  std::shared_lock lock(mu_);
  PENUMBRA_ASSIGN_OR_RETURN(const Segment* s, Find(id));
  for (size_t row = 0; row < s->written.size(); ++row) {
    if (!s->written[row]) continue;
    Status st = VerifyRow(*s, row);
    if (!st.ok()) return st.WithContext(RowName(s->layout, id, row));
  }
  return Status::OK();
}

Status DramValueStore::DropSegment(SegmentId id) {
  std::unique_ptr<Segment> seg;
  {
    std::unique_lock lock(mu_);
    auto it = segments_.find(id);
    if (it == segments_.end()) return Status::NotFound("value store: no segment " + std::to_string(id));
    seg = std::move(it->second);
    bytes_used_ -= seg->layout.total_bytes();
    segments_.erase(it);
  }
  for (char* p : seg->layers) {
    if (p) allocator_->Free(p);
  }
  return Status::OK();
}

Result<std::vector<void*>> DramValueStore::DetachSegment(SegmentId id) {
  std::unique_lock lock(mu_);
  auto it = segments_.find(id);
  if (it == segments_.end()) return Status::NotFound("value store: no segment " + std::to_string(id));
  std::vector<void*> layers(it->second->layers.begin(), it->second->layers.end());
  bytes_used_ -= it->second->layout.total_bytes();
  segments_.erase(it);
  return layers;
}

size_t DramValueStore::bytes_used() const {
  std::shared_lock lock(mu_);
  return bytes_used_;
}

Result<const void*> DramValueStore::LayerBase(SegmentId id, int layer) const {
  std::shared_lock lock(mu_);
  PENUMBRA_ASSIGN_OR_RETURN(const Segment* s, Find(id));
  if (layer < 0 || layer >= s->layout.layers)
    return Status::InvalidArgument("LayerBase: layer " + std::to_string(layer) + " out of range for " +
                                   s->layout.ToString());
  if (!s->Allocated(layer)) return NotAllocated(id, layer, "LayerBase");
  return static_cast<const void*>(s->layers[static_cast<size_t>(layer)]);
}

}  // namespace penumbra::storage
