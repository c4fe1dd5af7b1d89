// The ShadowKV state of a prompt prefix (a KvPrefix of the shadowkv policy):
// what a sequence holds right after a prefill ended at `tokens`, minus the
// per-sequence parts (selection slots, capacity). Per layer:
//   a          [n_chunks*C][r]     low-rank coordinates of the chunks' pre-RoPE keys
//   b          [hkv][r][d]         the factor they multiply (singular values folded in)
//   p          [hkv*d][r] f32      projection of later tokens' keys (ShadowKV+, A.1)
//   lm         [hkv][n_chunks] landmark records (kernels/landmark_format.h: S =
//                                  landmarks_per_chunk rows of d per chunk, of
//                                  dtype, or fp8 codes and a scale)
//   excl       [hkv][n_chunks] u8  1 = outlier chunk
//   out_k/v    [hkv][O*C][d]       the outlier chunks' exact K/V, in ascending chunk order
//   tail_k/v   [hkv][tail][d]      the exact local rows
//   tail_prek  [tail][hkv*d] f32   their pre-RoPE keys
//   values     [hkv][stride][row]  every chunk's values (rows [0, n_chunks) of each
//                                  head; a row is C*d in dtype, or with value_format=fp8
//                                  kernels/value_format.h's fp8 row), in pinned host
//                                  memory; stride = n_chunks, or
//                                  more when the values were adopted from a finished
//                                  sequence's store (AdoptValues, one buffer per layer)
//                                  instead of copied
// (a dense prefix, under min_prompt_tokens, is only its tail rows). The big
// parts are read in place by every attached sequence: the values
// (ShadowkvFetchVArgs::shared_store), the A rows (ShadowkvRebuildKArgs::
// shared_a) and the landmarks (ShadowkvScoreArgs::shared_landmarks): one copy
// however many sequences use the document. The small ones (b, p, excl, the
// outlier and local rows) are copied into each sequence, whose kernels read
// them from its own buffers.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "storage/lazy_blob.h"
#include "worker/engine/kv_policy.h"

namespace penumbra {

struct ShadowKvPrefixGeometry {
  int64_t tokens = 0;    // prefix length
  int64_t factored = 0;  // tokens of the first prefill, where the keys were factored (sets sparse and outliers)
  bool sparse = false;
  int n_chunks = 0, outliers = 0;
  int64_t tail = 0;  // exact local rows: tokens - n_chunks * chunk_size
  int layers = 0, hkv = 0, head_dim = 0, rank = 0, chunk_size = 0;
  int landmarks_per_chunk = 1;  // in the meta only when > 1 (documents stored before it parse as 1)
  bool landmark_fp8 = false;    // landmark_format=fp8 in the meta (absent: the model's dtype)
  bool value_fp8 = false;       // value_format=fp8 in the meta (absent: the model's dtype)
  DType dtype = DType::kF32;

  // Bytes of one value row (a head's chunk: C x d in dtype, or
  // kernels/value_format.h's fp8 row).
  size_t ValueRowBytes() const;

  // Bytes of each blob (Export's names).
  std::map<std::string, size_t> BlobBytes() const;
  // The "meta" blob; ParseMeta inverts it (InvalidArgument naming the field).
  std::string Meta() const;
  static Result<ShadowKvPrefixGeometry> ParseMeta(const std::string& meta);
  // InvalidArgument naming the first inconsistent field.
  Status Validate() const;
};

class ShadowKvPrefix final : public KvPrefix {
 public:
  ~ShadowKvPrefix() override;
  // Allocates every buffer of `g` (device, and pinned host for the values
  // unless `values` is false: then AdoptValues must give them).
  static Result<std::shared_ptr<ShadowKvPrefix>> Allocate(const ShadowKvPrefixGeometry& g, Backend* backend,
                                                          bool values = true);
  // From Export's blobs: InvalidArgument when the meta does not describe
  // `expect` (its tokens, factored, sparse, n_chunks, outliers and tail are
  // free), Corruption when a blob's size or the outlier table is wrong.
  // With `lazy_values` (a reader of the stored segment), `given` may lack
  // blobs: the values are read from it on demand (EnsureValues,
  // `read_threads` at once) and in the background (StartValueRestore), any
  // other missing blob now (device blobs through pinned staging, straight
  // into place); Corruption when a blob's size is not the geometry's.
  static Result<std::shared_ptr<ShadowKvPrefix>> Import(const std::map<std::string, std::string>& given,
                                                        const ShadowKvPrefixGeometry& expect, Backend* backend,
                                                        std::shared_ptr<storage::BlobReader> lazy_values = nullptr,
                                                        int read_threads = 8);

  std::string policy() const override { return "shadowkv"; }
  int64_t tokens() const override { return g_.tokens; }
  size_t device_bytes() const override;
  size_t host_bytes() const override;
  Result<std::map<std::string, std::string>> Export() const override;
  Status health() const override { return lazy_ ? lazy_->error() : Status::OK(); }

  const ShadowKvPrefixGeometry& geometry() const { return g_; }
  // Takes `layers` (pinned host, one buffer per layer, each [hkv][stride]
  // [row] with stride >= n_chunks; rows [0, n_chunks) of each head are the
  // values) as the values. InvalidArgument when their count or sizes are
  // not that.
  Status AdoptValues(std::vector<DeviceBuffer> layers, int stride);
  // Chunk rows from one head's values to the next's.
  int value_stride() const { return value_stride_; }
  // Device address of layer l's values ([hkv][value_stride][row]).
  const void* values_device(int layer) const;
  const char* values_host(int layer) const;
  // Device addresses of layer l's A rows ([n_chunks*C][r]) and landmarks
  // ([hkv][n_chunks] records); null for a dense prefix.
  const void* a_layer(int layer) const;
  const void* lm_layer(int layer) const;

  // Lazily read values (Import with lazy_values). They go to host memory
  // that is not pinned (allocating 8 GB of pinned memory takes seconds,
  // which a first token need not wait for) and is pinned once every block
  // is in: until then values_device is null and values_complete false, and
  // readers take the host path (values_host, after EnsureValues).
  // values_complete: every chunk in pinned memory (always, without lazy
  // values); EnsureValues makes the chunks chunk[h * per_head + j] of each
  // head h of `layer` present in values_host (entries < 0 ignored), reading
  // what is missing now; StartValueRestore reads the rest in the
  // background; EnsureAllValues waits for all of it, pinned. A read error
  // (Corruption: a block failed its checksum) is returned by every later
  // call: the caller drops the prefix and recomputes.
  bool values_complete() const { return !lazy_ || (lazy_->complete() && registered_.load()); }
  Status EnsureValues(int layer, const int32_t* chunk, int per_head) const;
  void StartValueRestore() const;
  Status EnsureAllValues() const;
  const storage::LazyBlob* lazy_values() const { return lazy_.get(); }

  // Tier 0 (KvPrefix's placement calls): the values copied to device memory
  // layer by layer, each [hkv][value_stride][row] like the host copy; once a
  // layer is there values_device returns its device copy. Only complete
  // values (values_complete) of a sparse prefix are promoted.
  size_t promotable_bytes() const override;
  size_t promoted_bytes() const override { return tier0_bytes_; }
  Result<bool> PromoteStep(size_t max_bytes) const override;
  void Demote() const override;
  int64_t TakeReads() const override { return reads_.exchange(0); }
  int64_t total_reads() const override { return total_reads_.load(); }
  // Counts `rows` value chunks read by an attached sequence (decode misses,
  // a continuation's selection).
  void NoteReads(int64_t rows) const {
    reads_ += rows;
    total_reads_ += rows;
  }
  // Layer l's values are in device memory (tier 0).
  bool values_on_device(int layer) const {
    return static_cast<size_t>(layer) < tier0_.size() && tier0_[static_cast<size_t>(layer)].get() != nullptr;
  }

  // The state (written by the policy that captures or imports it).
  DeviceBuffer a, b, p, lm, excl, out_k, out_v, tail_k, tail_v, tail_prek, values;
  std::vector<int32_t> outlier_ids;  // [layers][hkv][outliers], ascending per (layer, head)

 private:
  ShadowKvPrefix(const ShadowKvPrefixGeometry& g, Backend* backend)
      : g_(g), backend_(backend), value_stride_(g.n_chunks) {}
  // (name, buffer, on the host) of every buffer blob.
  std::vector<std::tuple<std::string, const DeviceBuffer*, bool>> Buffers() const;

  ShadowKvPrefixGeometry g_;
  Backend* backend_;
  int value_stride_;
  std::vector<DeviceBuffer> value_layers_;   // adopted values, one per layer (else `values` holds them)
  std::unique_ptr<storage::LazyBlob> lazy_;  // reads `values` from a stored segment (Import with lazy_values)
  std::atomic<bool> registered_{false};      // `values` (not from AllocateHost) pinned by RegisterHost
  // Placement state (mutable: see KvPrefix), touched by the policy's thread only.
  size_t LayerValueBytes() const;
  mutable std::vector<DeviceBuffer> tier0_;  // per layer: the device copy of its values, or empty
  mutable size_t tier0_bytes_ = 0;
  mutable std::atomic<int64_t> reads_{0}, total_reads_{0};
};

}  // namespace penumbra
