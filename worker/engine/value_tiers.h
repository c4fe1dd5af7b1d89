// ValueTiers: which cached documents keep a copy of their host-resident state
// in spare device memory (tier 0 of the document cache, owned by
// DocumentCache, worker/engine/document_cache.h; docs/storage.md, "Tiers").
//
// A shadowkv document's values live in pinned host memory (tier 1): every
// chunk a sequence attached to it selects and does not hold crosses the host
// link, so 64 questions decoding over one document move 64 times one
// question's values per step. When the device has room, the hottest
// documents' values are copied to it (KvPrefix::PromoteStep) and their
// sequences read them there: the same bytes, read at device bandwidth.
//
// Heat is the engine's own selection count: the value chunks read from a
// document (KvPrefix::TakeReads: decode misses, continuation reads), decayed
// by half every heat_half_life_steps steps, so it measures recent use.
// Documents are ranked by heat per promoted byte (what a byte of device
// memory saves on the host link). Each Step (between the lane's steps):
//   - the tier's size is min(capacity_bytes, device memory free + what the
//     tier holds - reserve_bytes): only spare memory, re-read every step;
//   - above the high watermark the coldest copies are freed down to the low
//     watermark; a copy of a document no longer in the cache is freed;
//   - a promotion in progress copies one more layer (so one step waits for
//     at most one layer's copy, ~256 MB at 124928 tokens of the 8B shape);
//   - else the hottest document at or above promote_min_reads that is not
//     on the device starts a promotion if it fits under the high watermark,
//     or, if not, the coldest complete copy gives way to it when the
//     candidate is replace_ratio times hotter (hysteresis: two documents of
//     equal heat do not trade places every step).
// Release frees copies when an admission needs device memory; no promotion
// starts for heat_half_life_steps steps after it (the admission takes it).
// Not thread-safe: the lane's runtime thread calls it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "common/status.h"
#include "worker/engine/kv_policy.h"

namespace penumbra {

struct TierOptions {
  // Tier 0 (device memory) at most; it only ever takes memory free beyond
  // gpu_reserve_bytes. 0: off. Default: 64 GiB.
  size_t gpu_capacity_bytes = size_t{64} << 30;
  // Device memory left free for sequences, scratch and workspaces.
  size_t gpu_reserve_bytes = size_t{8} << 30;
  double gpu_high_watermark = 0.95;  // fractions of the tier's size
  double gpu_low_watermark = 0.80;
  // Heat (decayed chunk rows read) a document needs before it is promoted.
  int64_t promote_min_reads = 4096;
  double heat_half_life_steps = 64;
  double replace_ratio = 2.0;
  // Also on a backend whose device memory is host memory (the CPU backend:
  // no gain, for tests of the tier's logic).
  bool on_host_backend = false;
  // InvalidArgument naming the field.
  Status Validate() const;
};

struct TierStats {
  int64_t promotions = 0;       // copies completed
  int64_t promoted_layers = 0;  // layers copied
  int64_t demotions = 0;        // copies freed (over the watermark, replaced, released, evicted)
  int64_t released = 0;         // ... of which for an admission that needed the memory
  size_t promoted_bytes = 0;    // device bytes the tier holds now
  size_t size_bytes = 0;        // the tier's size at the last step that needed it (one with a copy or a candidate)
  int documents = 0;            // documents with a copy (complete or in progress)
};

class ValueTiers {
 public:
  // free_device_bytes: device memory free now (Backend::FreeMemoryBytes);
  // device_is_host: the backend's device memory is host memory (CPU).
  ValueTiers(const TierOptions& options, bool device_is_host, std::function<size_t()> free_device_bytes)
      : o_(options), device_is_host_(device_is_host), free_device_bytes_(std::move(free_device_bytes)) {}
  ~ValueTiers();

  bool enabled() const;
  // One placement step over the cache's documents (most recently used first).
  void Step(const std::vector<std::shared_ptr<const KvPrefix>>& cached);
  // Frees copies, coldest first, until `need` device bytes are freed or none
  // is left. Returns the bytes freed.
  size_t Release(size_t need);
  // Heat of `p` (0 when unknown).
  double heat(const KvPrefix* p) const;
  TierStats stats() const;

 private:
  struct Doc {
    std::weak_ptr<const KvPrefix> prefix;
    double heat = 0;
    bool in_cache = false;
  };
  using Docs = std::map<std::weak_ptr<const KvPrefix>, Doc, std::owner_less<std::weak_ptr<const KvPrefix>>>;
  // Bytes every live copy holds.
  size_t Held() const;
  // Heat per byte a complete copy would take.
  static double Density(const Doc& d, const KvPrefix& p);
  // The coldest document holding a copy and its density (null: none),
  // `except` skipped.
  std::pair<std::shared_ptr<const KvPrefix>, double> Coldest(const KvPrefix* except) const;
  // A document without a copy hot enough for one.
  bool AnyCandidate() const;
  void Demote(const KvPrefix& p, bool released);

  TierOptions o_;
  bool device_is_host_;
  std::function<size_t()> free_device_bytes_;
  Docs docs_;
  std::weak_ptr<const KvPrefix> promoting_;  // the promotion in progress (one at a time)
  int64_t step_ = 0;
  int64_t hold_off_until_ = 0;  // no promotion before this step (after a Release)
  TierStats stats_;
};

}  // namespace penumbra
