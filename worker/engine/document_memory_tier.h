// DocumentMemoryTier: tier 1 of a lane's document cache (DocumentCache,
// worker/engine/document_cache.h): the LRU index of captured documents'
// states (KvPrefix: the KV state of a prompt's leading documents), so that a
// request whose prompt starts with documents another request already
// prefilled attaches their state instead of prefilling them again. Entries
// are keyed by the document keys (worker/engine/document_keys.h): exact
// prefix semantics, a document's key depends on everything before it.
//
// Capacity is in device bytes and, separately, host bytes (a shadowkv
// prefix's values live in host memory). Inserting past either evicts least-recently-used
// entries that no sequence holds (an entry held by a live sequence stays: its
// memory would not be freed anyway) until the new entry fits under
// low_watermark x capacity (the DRAM tier's low watermark: evicting a little
// more than needed leaves room for the next documents without evicting at
// every insert; 1: only what is needed), or at least under the capacity; an
// entry that cannot fit is not kept. What is evicted stays in the persistent
// tier when one is configured (the document cache's tier behind this one).
// Not thread-safe: one runtime thread uses it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "worker/engine/kv_policy.h"

namespace penumbra {

struct DocumentMemoryStats {
  int64_t hits = 0, misses = 0, inserts = 0, evictions = 0;
};

// The documents one policy's form holds (KvPrefix::policy()).
struct DocumentFormUsage {
  int64_t documents = 0;
  size_t device_bytes = 0, host_bytes = 0;
};

class DocumentMemoryTier {
 public:
  explicit DocumentMemoryTier(size_t capacity_bytes, size_t host_capacity_bytes = SIZE_MAX, double low_watermark = 1.0)
      : capacity_bytes_(capacity_bytes),
        host_capacity_bytes_(host_capacity_bytes),
        low_watermark_(std::clamp(low_watermark, 0.0, 1.0)) {}

  // The prefix stored under `key` with `tokens` tokens (null when absent),
  // marked most recently used.
  std::shared_ptr<const KvPrefix> Find(const Hash128& key, int64_t tokens);
  bool Contains(const Hash128& key) const { return index_.count(Key(key)) > 0; }
  // Stores `prefix` under `key` (replacing nothing: a key already present is
  // kept as it is), evicting as above. False when it was not kept.
  // `pinned`: its form was chosen by the request that made it (a per-document
  // policy does not move it); `cache_namespace`: the namespace it was
  // captured under (a moved form is stored again under it).
  bool Insert(const Hash128& key, std::shared_ptr<const KvPrefix> prefix, bool pinned = false,
              std::string cache_namespace = "");
  // Puts `prefix` in place of the entry under `key` if that entry still
  // holds `expected` (a document moved to another form), keeping its place
  // in the LRU order and its pin; evicts other entries (as an insert does)
  // when the new form takes more. False when the entry changed or is gone.
  bool Replace(const Hash128& key, const KvPrefix* expected, std::shared_ptr<const KvPrefix> prefix);
  struct Held {
    Hash128 key;
    std::shared_ptr<const KvPrefix> prefix;
    bool pinned = false;
    std::string cache_namespace;
  };
  // Every entry, most recently used first.
  std::vector<Held> Entries() const;
  // Documents and bytes by the policy holding them.
  std::map<std::string, DocumentFormUsage> ByPolicy() const;

  // Drops the entry under `key` (sequences attached to it keep their
  // reference until they end). False when absent.
  bool Erase(const Hash128& key);
  // Drops every entry no sequence holds.
  void Clear();
  // Every entry's prefix, most recently used first.
  std::vector<std::shared_ptr<const KvPrefix>> Prefixes() const;

  size_t bytes() const { return bytes_; }  // device bytes held
  size_t host_bytes() const { return host_bytes_; }
  size_t entries() const { return index_.size(); }
  size_t capacity_bytes() const { return capacity_bytes_; }
  const DocumentMemoryStats& stats() const { return stats_; }

 private:
  using KeyT = std::pair<uint64_t, uint64_t>;
  static KeyT Key(const Hash128& h) { return {h.hi, h.lo}; }
  struct Entry {
    KeyT key;
    std::shared_ptr<const KvPrefix> prefix;
    bool pinned = false;
    std::string cache_namespace;
  };
  // Evicts unheld entries, oldest first, until `need` more device bytes and
  // `host_need` more host bytes fit under the capacities scaled by `fraction`.
  void MakeRoom(size_t need, size_t host_need, double fraction);

  size_t capacity_bytes_, host_capacity_bytes_;
  double low_watermark_;
  size_t bytes_ = 0, host_bytes_ = 0;
  std::list<Entry> lru_;  // front: most recently used
  std::map<KeyT, std::list<Entry>::iterator> index_;
  DocumentMemoryStats stats_;
};

}  // namespace penumbra
