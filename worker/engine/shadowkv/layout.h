// ShadowKV's per-sequence state and buffer geometry (the policy's layout).
//
// ShadowKvSeq owns one sequence's device buffers and counters (what
// worker/engine/shadowkv_policy.cc's header comment draws: the attention rows,
// A/B/P factors, landmarks, outlier marks, slot maps, local pre-RoPE keys) and
// its value-store segment id. ShadowKvLayout holds no state of its own: from
// the model's geometry (PolicyContext) and the options it decides a new
// sequence's shape (Shape: outliers, slots, capacities) and says where rows,
// layers and landmark records lie in a sequence's buffers. Every other
// ShadowKV object (compressor, decode step, exchange, prefix) addresses a
// sequence through it, so the geometry has one definition.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "storage/dram_value_store.h"
#include "worker/engine/backend.h"
#include "worker/engine/kv_policy.h"
#include "worker/engine/shadowkv_options.h"
#include "worker/engine/shadowkv_prefix.h"

namespace penumbra {

// One sequence's ShadowKV state. Buffers are per layer, layer-major (see
// ShadowKvLayout for the offsets); filled by the policy's AddSequence.
struct ShadowKvSeq {
  int64_t id = 0;
  bool sparse = false;
  bool compressed = false;    // its first prefill is factored (later prefills continue it)
  bool taken = false;         // its values moved into a prefix (TakePrefix): it may only be removed
  int64_t first_prefill = 0;  // tokens of the first prefill (sets sparse, outliers, kslots)
  // Context parallel (ShardSpec): the shard's first position; closed: no
  // decode token is stored in it.
  int64_t pos0 = 0;
  bool closed = false;
  int window = 0;  // the local window: options' local_window, 0 for a closed shard
  // A global selection over the shards (ShadowKvOptions::shard_selection):
  // the whole sequence's budget in chunks (0: the shard selects alone) and
  // the group exchanging the proposals.
  int global_k = 0;
  Collective* group = nullptr;
  std::vector<int32_t> outlier_ids;  // [layers][hkv][outliers] ascending chunk ids
  // An attached prefix: its values are this sequence's chunks [0, shared_chunks),
  // read in place; the store segment holds chunks from shared_chunks on.
  std::shared_ptr<const ShadowKvPrefix> prefix;
  int shared_chunks = 0;
  int shared_stride = 0;  // the prefix's value rows from one head to the next (>= shared_chunks)
  int64_t token_cap = 0;
  int outliers = 0, kslots = 0, chunk_cap = 0, n_chunks = 0;
  int64_t local_cap = 0, local_count = 0, att_cap = 0;
  int64_t a_rows = 0;  // A rows held per layer (the tokens after shared_chunks' chunks)
  int lm_cap = 0;      // chunks whose landmarks are held per head (from shared_chunks on; LmHead elements)
  // The continuation prefill under way: chunks a sparse one selected per
  // head (0: dense), and the temporaries' row of token t minus t.
  int cont_k = 0;
  int64_t cont_shift = 0;
  // This decode step reads the attached prefix's values through the host
  // (they are still being read from disk; set by BeginDecodeStep).
  bool values_staged = false;
  // Per layer: the last decode step read the prefix's chunks' values in
  // place (ShadowKvPolicy::ValuesInPlace), so the attention rows of the slots
  // holding them were never written.
  std::vector<uint8_t> values_read_in_place;
  DeviceBuffer att_k, att_v, a, b, p, lm, excl, slots, prek;
  storage::SegmentId segment = 0;
  std::vector<const void*> store_dev, store_host;  // per layer: the store's values (device / host address)
};

// Geometry only: needs the model's shape (ctx) and the options, both of
// which must outlive it (the options are read through the reference, so a
// policy's later change, e.g. SetForcedHitRate, is seen).
class ShadowKvLayout {
 public:
  ShadowKvLayout(const PolicyContext& ctx, const ShadowKvOptions& options);

  // A new sequence's geometry (outliers, slots, capacities). It follows
  // from the tokens of the first prefill alone (where the keys are
  // factored), so every sequence that starts with the same document,
  // attached or prefilled, has the same outliers and budget. Sets
  // token_cap, first_prefill, window, outliers, kslots, sparse, global_k,
  // group, local_cap, chunk_cap and att_cap.
  void Shape(const SequenceSpec& spec, ShadowKvSeq* out) const;

  // Allocates a shaped sequence's device buffers for every layer: the
  // attention rows and, sparse, the A rows and landmark records of the
  // chunks from shared_chunks on (sets a_rows, lm_cap), B, P, the outlier
  // marks (none), the slot maps (empty) and the local pre-RoPE keys. Its
  // value-store segment is the caller's.
  Status Allocate(ShadowKvSeq* s) const;
  // What Allocate would take for a sequence of `spec` with nothing attached
  // (device) and what its value-store segment would take (host):
  // KvPolicy::EstimateSequenceBytes.
  SequenceBytes Bytes(const SequenceSpec& spec) const;
  // The value-store segment of a shaped sparse sequence: the chunks it makes
  // (an attached prefix's are read in place), rows of value_row_bytes().
  storage::SegmentLayout ValueSegment(const ShadowKvSeq& s) const;

  // Tokens the sequence holds (after its last prefill or decode step).
  int64_t Held(const ShadowKvSeq& s) const { return static_cast<int64_t>(s.n_chunks) * o_.chunk_size + s.local_count; }
  // Sequences that share kernel launches in a decode step.
  static bool SameGeometry(const ShadowKvSeq& a, const ShadowKvSeq& b) {
    return a.sparse == b.sparse && a.att_cap == b.att_cap && a.kslots == b.kslots && a.chunk_cap == b.chunk_cap &&
           a.outliers == b.outliers && a.shared_chunks == b.shared_chunks && a.shared_stride == b.shared_stride &&
           a.global_k == b.global_k;
  }

  // Elements of one layer of the attention rows ([hkv][att_cap][d]).
  int64_t AttLayer(const ShadowKvSeq& s) const { return static_cast<int64_t>(ctx_.hkv) * s.att_cap * ctx_.head_dim; }
  // Landmark elements (bytes for fp8) held per head: a record
  // (kernels/landmark_format.h) for each chunk from shared_chunks on.
  int64_t LmHead(const ShadowKvSeq& s) const { return static_cast<int64_t>(s.lm_cap) * lm_rec_; }
  // The first local row (after the outlier and slot rows).
  int64_t LocalRow0(const ShadowKvSeq& s) const { return static_cast<int64_t>(s.outliers + s.kslots) * o_.chunk_size; }
  // Row `row` of head 0 at `layer` in an attention buffer (att_k / att_v).
  void* Row(const DeviceBuffer& buf, const ShadowKvSeq& s, int layer, int64_t row) const {
    return static_cast<char*>(buf.get()) + (layer * AttLayer(s) + row * ctx_.head_dim) * es_;
  }
  void* ALayer(const ShadowKvSeq& s, int layer) const { return Row2(s.a, layer, s.a_rows * o_.rank); }
  void* LmLayer(const ShadowKvSeq& s, int layer) const {
    return static_cast<char*>(s.lm.get()) + static_cast<int64_t>(layer) * ctx_.hkv * s.lm_cap * lm_rec_bytes_;
  }
  // Head 0's record of chunk `chunk` (>= shared_chunks) at `layer`.
  void* LmChunk(const ShadowKvSeq& s, int layer, int chunk) const {
    return static_cast<char*>(LmLayer(s, layer)) + (chunk - s.shared_chunks) * lm_rec_bytes_;
  }
  // Layer `layer` of a buffer of `per_layer` act-dtype elements per layer.
  void* Row2(const DeviceBuffer& buf, int layer, int64_t per_layer) const {
    return static_cast<char*>(buf.get()) + layer * per_layer * es_;
  }

  size_t es() const { return es_; }                       // bytes of the act dtype
  int64_t lm_rec() const { return lm_rec_; }              // landmark elements (bytes for fp8) per chunk record
  int64_t lm_rec_bytes() const { return lm_rec_bytes_; }  // bytes per chunk record
  // Bytes of one value row (a head's chunk) in the value store: C*d of the
  // act dtype, or an fp8 row (kernels/value_format.h).
  size_t value_row_bytes() const { return value_row_bytes_; }
  const PolicyContext& ctx() const { return ctx_; }
  const ShadowKvOptions& options() const { return o_; }

 private:
  PolicyContext ctx_;
  const ShadowKvOptions& o_;
  size_t es_;
  int64_t lm_rec_;        // the kernels' strides
  int64_t lm_rec_bytes_;  // the buffers' sizes and offsets
  size_t value_row_bytes_;

  // Each device buffer Allocate makes, and its bytes (the one place they are sized).
  struct Sized {
    DeviceBuffer* buf;
    size_t bytes;
  };
  std::vector<Sized> Sizes(ShadowKvSeq& s) const;
};

// Copies `bytes` from the host into *dst, first growing it (to twice the
// need, at least 4 KiB, after a synchronization: kernels may still read the
// old one) when it is smaller: the policy's per-step and per-prefill tables.
Status ShadowKvUpload(Backend& backend, DeviceBuffer* dst, const void* src, size_t bytes);

}  // namespace penumbra
