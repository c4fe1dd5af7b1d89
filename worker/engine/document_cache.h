// DocumentCache: the one owner of a lane's document cache (docs/storage.md,
// "Tiers"): the captured states of prompts' leading documents (KvPrefix),
// found by their document keys, over three tiers, one interface each:
//   - tier 0 (ValueTiers, worker/engine/value_tiers.h): device copies of hot
//     documents' host-resident values; one placement step between the lane's
//     steps (Place), and device memory given back to an admission that needs
//     it (FreeDeviceFor);
//   - tier 1, memory (DocumentMemoryTier, worker/engine/document_memory_tier.h):
//     the LRU index of captured states, device and host bytes;
//   - tier 2, persistent (DocumentPersistentTier, below): a
//     storage::DocumentStore (disk segments or a store node) shared by the
//     engine's lanes, not owned, read (thread-safe: the scheduler's store I/O
//     threads), written in the background (DocumentWriter,
//     worker/engine/document_writer.h) and erased;
// plus the keys (Fence and DocumentKeys, worker/engine/document_keys.h) and
// the operations across tiers the runtime needs: find the longest held run of
// a request's leading documents (memory, then the persistent tier), the
// lookups to prefetch and the fetch itself, import a read state, capture
// (memory + a queued write), forget a document everywhere, drop a damaged one.
// The runtime keeps the compute (prefill, attaching a found state to a
// sequence, exporting a segment's state at capture) and owns one of these
// when prefix reuse is on (RuntimeOptions::prefix_cache_bytes > 0).
// Not thread-safe except where a method says so: the lane's runtime thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "storage/segment_store.h"
#include "worker/engine/document_keys.h"
#include "worker/engine/document_memory_tier.h"
#include "worker/engine/document_writer.h"
#include "worker/engine/kv_policy.h"
#include "worker/engine/value_tiers.h"

namespace penumbra {

// Built from RuntimeOptions (Runtime::Create); the fields say which option.
struct DocumentCacheOptions {
  // Tier 1: device bytes (prefix_cache_bytes, > 0), host bytes
  // (prefix_cache_host_bytes; SIZE_MAX: bounded only by the device bytes)
  // and the low watermark an evicting insert evicts down to. Defaults: 1, SIZE_MAX, 1.
  size_t memory_bytes = 1;
  size_t memory_host_bytes = SIZE_MAX;
  double memory_low_watermark = 1.0;
  // Tier 2 (prefix_store_*): the writer's queue bound, lazy reads (the blobs
  // KvPolicy::LazyBlobs names, stored in blocks of lazy_block_bytes, read by
  // lazy_threads threads after import), the size up to which a lazily read
  // blob is still read whole first, whole reads for fetches ahead of
  // admission, and the bound on draining the writes before a forget.
  // Defaults: as RuntimeOptions.
  size_t queue_bytes = size_t{16} << 30;
  bool lazy_reads = true;
  size_t lazy_block_bytes = 16384;
  int lazy_threads = 32;
  uint64_t eager_blob_bytes = uint64_t{16} << 20;
  bool fetch_whole = false;
  int64_t drain_ms = 10000;
  // The keys: the deployment secret (document_key_secret; empty: unkeyed)
  // and the activations' dtype name (part of every fence). Default: empty.
  std::string key_secret;
  std::string dtype;
};

// A stored document looked up for a request: its key and its tokens (a
// leading segment's end).
struct StoreLookup {
  Hash128 key;
  int64_t tokens = 0;
};

// A document's state read from the persistent tier
// (DocumentPersistentTier::Read), not yet imported into the policy.
struct StoredDocumentRead {
  Hash128 key;
  int64_t tokens = 0;
  bool present = false;  // the store said it holds key with these tokens
  Status status;         // OK: read (below); else why not (absent, the store's error, damage)
  std::map<std::string, std::string> blobs;
  std::shared_ptr<storage::BlobReader> reader;  // the blobs the policy reads lazily (null: all in blobs)
  double read_seconds = 0;
  int64_t read_bytes = 0;
  // Present, and the read failed for another reason than the store not
  // answering (Unavailable, DeadlineExceeded): the stored copy is damaged.
  bool damaged() const {
    return present && !status.ok() && status.code() != StatusCode::kUnavailable &&
           status.code() != StatusCode::kDeadlineExceeded;
  }
};

// What the scheduler fetched for a request before admitting it
// (DocumentCache::Fetch); BeginPrefill imports `found` and asks the store
// nothing more.
struct PrefetchedDocuments {
  std::optional<StoredDocumentRead> found;  // the longest stored document read (none: none usable)
  int64_t failures = 0;                     // lookups the store did not answer (the request prefills)
  int64_t corruptions = 0;                  // stored documents found damaged (queued for erasure)
  Status last_failure;                      // the last of those failures (logs)
};

// The document cache's counters (RunStats' prefix_store_* fields; tier 1's
// own are DocumentMemoryTier::stats, tier 0's ValueTiers::stats).
struct DocumentCacheStats {
  int64_t store_hits = 0;          // states imported from the persistent tier
  int64_t store_corruptions = 0;   // found damaged (dropped, recomputed)
  int64_t store_errors = 0;        // writes that failed or were not exported (the request went on)
  int64_t stores = 0;              // states written to the persistent tier
  int64_t store_skipped = 0;       // not written: the write queue was full
  double store_write_seconds = 0;  // writing them (on the writer thread)
  double store_read_seconds = 0;   // reading stored states (checked)
  double import_seconds = 0;       // ... and importing them into the policy (to the device)
  int64_t store_read_bytes = 0;
  int64_t fetch_failures = 0;  // lookups the store did not answer (prefilled instead)
  TierStats tiers;             // tier 0
  // A per-document policy's moves of documents from the exact form to
  // ShadowKV (Place): done, their time (on the lane's thread, one layer a
  // step), and moves that failed (the document stayed exact).
  int64_t moves = 0;
  double move_seconds = 0;
  int64_t move_failures = 0;
  // Tier 1's documents and bytes by the policy holding them.
  std::map<std::string, DocumentFormUsage> by_policy;
};

// Tier 2: the persistent store behind memory, with its background writer.
// Read is thread-safe (it touches only the store); the rest is the runtime
// thread's (the writer itself is thread-safe).
class DocumentPersistentTier {
 public:
  // `store` (not owned) outlives this; `lazy_blobs`: the policy's
  // KvPolicy::LazyBlobs (stored in small blocks, read lazily when
  // options.lazy_reads).
  DocumentPersistentTier(storage::DocumentStore* store, const DocumentCacheOptions& options,
                         std::vector<std::string> lazy_blobs);

  // Reads the state stored under `key` if it has `tokens` tokens (whole:
  // every blob, none left to read lazily). Thread-safe.
  StoredDocumentRead Read(const Hash128& key, int64_t tokens, bool whole) const;
  // Queues a write (DocumentWriter::Enqueue); false when the queue is full.
  bool Write(const Hash128& key, std::string cache_namespace, int64_t tokens,
             std::map<std::string, std::string> blobs) {
    return writer_->Enqueue(key, std::move(cache_namespace), tokens, std::move(blobs));
  }
  // Queues an erase after the writes queued before it. Thread-safe.
  void EraseQueued(const Hash128& key) const { writer_->EnqueueErase(key); }
  // Erases now (NotFound when absent).
  Status Erase(const Hash128& key) { return store_->Erase(key); }
  // Erases `key` if the store holds it: OK when erased, NotFound when it
  // was not there, else the store's error (the state may still be there).
  Status EraseIfHeld(const Hash128& key);
  // Erases a damaged state, retrying briefly while a lazy reader of it lets
  // go (FailedPrecondition); logs what it could not erase.
  void EraseDamaged(const Hash128& key);
  // Waits for the queued writes, at most `max_wait`; true when all finished.
  bool Drain(std::chrono::milliseconds max_wait) { return writer_->Drain(max_wait); }
  const DocumentWriter& writer() const { return *writer_; }

 private:
  storage::DocumentStore* const store_;
  const DocumentCacheOptions options_;
  const std::vector<std::string> lazy_blobs_;
  const std::unique_ptr<DocumentWriter> writer_;  // thread-safe
};

class DocumentCache {
 public:
  // `policy` (not owned, outlives this) makes, imports and fingerprints the
  // states; `tier0`: tier 0 (null: none).
  DocumentCache(const DocumentCacheOptions& options, KvPolicy* policy, std::unique_ptr<ValueTiers> tier0);
  ~DocumentCache();

  // ---- the tiers ----
  ValueTiers* tier0() { return tier0_.get(); }
  DocumentMemoryTier& memory() { return memory_; }
  const DocumentMemoryTier& memory() const { return memory_; }
  // Null without a persistent store.
  DocumentPersistentTier* persistent() { return persistent_.get(); }
  // The persistent store (not owned; shared by the engine's lanes; null:
  // none) and the model's identity, part of every fence. Replacing it
  // drains the writes to the previous one.
  void SetPersistentTier(storage::DocumentStore* store, std::string model_identity);

  // ---- keys ----
  // What every key names besides the documents: the policy's state-shaping
  // options, the dtype, the model, the namespace and, in a context group,
  // the group's shape (this rank's shard: SetShard).
  std::string Fence(const std::string& cache_namespace) const;
  // Context parallel: the states captured and looked up from now on are
  // rank `rank`'s shards of a group of `world` ranks (world 1: whole
  // sequences), so a shard is never attached by a single worker or by
  // another rank, in memory or from the persistent tier.
  void SetShard(int rank, int world) {
    shard_rank_ = rank;
    shard_world_ = world;
  }
  // The keys of a prompt's leading documents (DocumentKeys over their
  // digests under the fence and the deployment secret).
  std::vector<Hash128> Keys(const std::string& cache_namespace, const std::vector<Hash128>& digests,
                            const std::vector<int64_t>& document_ends) const;

  // ---- across tiers ----
  struct Found {
    std::shared_ptr<const KvPrefix> state;  // null: none held
    size_t index = 0;                       // the last document it covers
  };
  // The longest held run of leading documents (keys[i] ends at ends[i]):
  // memory, then the persistent tier (with `prefetched`: only its `found`,
  // imported here and moved out; without: read here). A damaged state met
  // on the way is dropped everywhere.
  Found FindLongest(const std::vector<Hash128>& keys, const std::vector<int64_t>& ends,
                    PrefetchedDocuments* prefetched);
  // The stored documents FindLongest would read, longest first: those
  // longer than the longest held in memory; empty without a persistent tier.
  std::vector<StoreLookup> Lookups(const std::vector<Hash128>& keys, const std::vector<int64_t>& ends) const;
  // Reads the longest of `lookups` the store holds (whole when
  // fetch_whole): any thread. The store's failures are counted in the
  // result, never returned; a damaged stored copy is queued for erasure.
  PrefetchedDocuments Fetch(const std::vector<StoreLookup>& lookups) const;
  // Folds a prefetch's failure counts into the counters (once: zeroed).
  void CountPrefetch(PrefetchedDocuments* prefetched);
  // Imports a read state into the policy and memory; null when it fails
  // (counted as damaged and erased: at once, or queued when queue_erase).
  std::shared_ptr<const KvPrefix> Import(StoredDocumentRead read, bool queue_erase);
  // Memory holds `key`: a capture of it is not needed.
  bool Holds(const Hash128& key) const { return memory_.Contains(key); }
  // A captured state of `tokens` tokens: into memory, and queued for the
  // persistent tier (exported here; a failure costs only the reuse after a
  // restart).
  // `pinned`: the request chose its form (a per-document policy keeps it).
  void Capture(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
               std::shared_ptr<const KvPrefix> state, bool pinned = false);
  // Drops the documents under `keys` from memory and the persistent tier
  // (after draining its queued writes, at most drain_ms). Returns the entries
  // dropped; an error when the store could not erase (or look up) one that
  // may be there.
  Result<int> Forget(const std::vector<Hash128>& keys);
  // A state that failed a check: out of memory and the store, counted.
  void DropDamaged(const Hash128& key, const Status& why);
  // One placement step over memory's documents: under a per-document
  // policy (KvPolicy::ExactBudgetBytes > 0) one layer of a move of the least
  // recently used unpinned exact document to ShadowKV while the exact ones
  // take more than the budget (the moved form replaces it in memory and in
  // the persistent tier); then tier 0's step.
  void Place();
  // After `s`, an allocation that failed for device memory: true when tier 0
  // gave some back (the caller tries once more).
  bool FreeDeviceFor(const Status& s);
  // Waits for the persistent tier's queued writes; true without one.
  bool Drain(std::chrono::milliseconds max_wait) { return persistent_ ? persistent_->Drain(max_wait) : true; }
  // The writer's counts folded in.
  DocumentCacheStats stats() const;

 private:
  // The state stored under `key` with `tokens` tokens, imported; null when
  // absent, unreadable or damaged (dropped).
  std::shared_ptr<const KvPrefix> Load(const Hash128& key, int64_t tokens);
  // Place's moves: a step of the one in flight, or a new one.
  void MoveStep();

  // Place calls to wait after a move failed before trying another.
  static constexpr int kMoveRetrySteps = 256;

  const DocumentCacheOptions options_;
  KvPolicy* const policy_;
  DocumentMemoryTier memory_;
  std::unique_ptr<ValueTiers> tier0_;
  std::string model_identity_;
  int shard_rank_ = 0, shard_world_ = 1;                // SetShard
  std::unique_ptr<DocumentPersistentTier> persistent_;  // destroyed (drained) before the store
  DocumentCacheStats stats_;
  std::unique_ptr<PrefixMove> move_;  // in flight (null: none)
  Hash128 move_key_;                  // its document's key and namespace
  std::string move_namespace_;
  int move_wait_ = 0;
};

}  // namespace penumbra
