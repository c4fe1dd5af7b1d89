// A document's ShadowKV state in and out of sequences: the policy's document
// capture (CapturePrefix, TakePrefix), import (ImportPrefix) and attach
// (AddSequence with a prefix), one implementation for the policy and the
// independent check.
//   Capture: a prefilled sequence's state into a new ShadowKvPrefix (take:
//            the sequence's store segment becomes the prefix's values
//            instead of being copied; the sequence may then only be removed);
//   Import:  a prefix from Export's blobs, checked against what the options
//            make of a first prefill of its length;
//   Fit:     a shaped sequence (ShadowKvLayout::Shape with first_prefill =
//            the prefix's factored tokens) takes the prefix's chunks as its
//            shared ones; before its buffers are allocated (they then hold
//            only the chunks after them);
//   Attach:  the prefix's small state (b, p, exclusion marks, outlier and
//            local rows) copied into the allocated sequence; its A rows,
//            landmarks and values are read in place by the decode step.
// Needs the layout (geometry, options), the backend, and for Capture the
// value store holding the sequence's segment and the host allocator behind
// that store (a taken segment's layers change owner).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "storage/dram_value_store.h"
#include "worker/engine/backend_host_allocator.h"
#include "worker/engine/shadowkv/layout.h"
#include "worker/engine/shadowkv_prefix.h"

namespace penumbra {

class ShadowKvPrefixIo {
 public:
  ShadowKvPrefixIo(const ShadowKvLayout& layout, Backend& backend, storage::DramValueStore& store,
                   BackendHostAllocator& host_alloc)
      : lay_(layout), backend_(backend), store_(store), host_alloc_(host_alloc) {}

  // The geometry fields every prefix of this layout shares (model shape,
  // rank, chunk size, landmark format, dtype).
  ShadowKvPrefixGeometry Geometry() const;

  // All that `s` holds (`tokens` must be that, Held(s); a context-parallel
  // shard's own tokens). FailedPrecondition (taken already, not prefilled,
  // other length); allocation errors.
  Result<std::shared_ptr<ShadowKvPrefix>> Capture(ShadowKvSeq& s, int64_t tokens, bool take);

  // ShadowKvPrefix::Import for this layout, then Corruption when the options
  // would not make the prefix's sparse decision and outliers.
  Result<std::shared_ptr<ShadowKvPrefix>> Import(const std::map<std::string, std::string>& blobs,
                                                 std::shared_ptr<storage::BlobReader> lazy = nullptr,
                                                 int read_threads = 8) const;

  // InvalidArgument when `p` does not fit the shaped `s`; else sets
  // s.shared_chunks and s.shared_stride.
  Status Fit(const ShadowKvPrefix& p, ShadowKvSeq& s) const;

  // Copies p's small state into `s` (fitted, its buffers allocated) and
  // sets its counts (n_chunks, local_count, outlier_ids, compressed).
  Status Attach(const ShadowKvPrefix& p, ShadowKvSeq& s);

 private:
  const ShadowKvLayout& lay_;
  Backend& backend_;
  storage::DramValueStore& store_;
  BackendHostAllocator& host_alloc_;
};

}  // namespace penumbra
