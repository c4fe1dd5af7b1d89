// PrefixCache: one lane's index of captured prompt prefixes (KvPrefix), so
// that a request whose prompt starts with segments another request already
// prefilled (documents, then its own text) attaches their KV state instead of
// prefilling them again.
//
// Keys are content keys with exact prefix semantics: the key of a prompt's
// first i documents covers a fence (what else determines the state: the
// policy's parameters, the dtype, the model, the tenant namespace) and the
// digest of every one of those documents, chained document by document
// (PrefixKeys), so a document's key depends on everything before it. With a
// deployment secret (RuntimeOptions::document_key_secret, from the cluster
// secret) each link is an HMAC-SHA256 under it: nobody without the secret
// can compute a document's key from its tokens, or guess another tenant's,
// and keys from a store shared by workers (a value-store node) are
// unguessable there.
//
// Capacity is in device bytes and, separately, host bytes (a shadowkv
// prefix's values live in host memory). Inserting past either evicts least-recently-used
// entries that no sequence holds (an entry held by a live sequence stays: its
// memory would not be freed anyway) until the new entry fits under
// low_watermark x capacity (the DRAM tier's low watermark: evicting a little
// more than needed leaves room for the next documents without evicting at
// every insert; 1: only what is needed), or at least under the capacity; an
// entry that cannot fit is not kept. What is evicted stays in the persistent
// store when one is configured (the runtime's tier behind this one).
// Not thread-safe: one runtime thread uses it.
//
// This is the in-memory, per-process tier of the document cache; the
// persistent segment store (storage/, docs/storage.md) sits behind it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "worker/engine/kv_policy.h"

namespace penumbra {

// keys[i] covers the prompt's first i + 1 documents: a chain over `fence`
// (everything besides the documents that the state depends on) and each
// document's length and content digest (DocumentDigest), so a document's key
// depends on everything before it. Each link is an HMAC-SHA256 under
// `secret` (the deployment's document-key secret; empty: a plain keyed-by-
// nothing HMAC), truncated to 128 bits. digests and document_ends have one
// entry per document; the ends ascend (Runtime::Validate checks requests).
std::vector<Hash128> DocumentKeys(const std::string& fence, const std::vector<Hash128>& digests,
                                  const std::vector<int64_t>& document_ends, std::string_view secret = {});
// The same keys from the documents' ids (their digests computed here).
std::vector<Hash128> PrefixKeys(const std::string& fence, const std::vector<int32_t>& prompt,
                                const std::vector<int64_t>& document_ends, std::string_view secret = {});
// The digests of the prompt's documents (DocumentDigest of each
// [previous end, end) of document_ends).
std::vector<Hash128> DocumentDigests(const std::vector<int32_t>& prompt, const std::vector<int64_t>& document_ends);

struct PrefixCacheStats {
  int64_t hits = 0, misses = 0, inserts = 0, evictions = 0;
};

class PrefixCache {
 public:
  explicit PrefixCache(size_t capacity_bytes, size_t host_capacity_bytes = SIZE_MAX, double low_watermark = 1.0)
      : capacity_bytes_(capacity_bytes),
        host_capacity_bytes_(host_capacity_bytes),
        low_watermark_(std::clamp(low_watermark, 0.0, 1.0)) {}

  // The prefix stored under `key` with `tokens` tokens (null when absent),
  // marked most recently used.
  std::shared_ptr<const KvPrefix> Find(const Hash128& key, int64_t tokens);
  bool Contains(const Hash128& key) const { return index_.count(Key(key)) > 0; }
  // Stores `prefix` under `key` (replacing nothing: a key already present is
  // kept as it is), evicting as above. False when it was not kept.
  bool Insert(const Hash128& key, std::shared_ptr<const KvPrefix> prefix);

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
  const PrefixCacheStats& stats() const { return stats_; }

 private:
  using KeyT = std::pair<uint64_t, uint64_t>;
  static KeyT Key(const Hash128& h) { return {h.hi, h.lo}; }
  struct Entry {
    KeyT key;
    std::shared_ptr<const KvPrefix> prefix;
  };
  // Evicts unheld entries, oldest first, until `need` more device bytes and
  // `host_need` more host bytes fit under the capacities scaled by `fraction`.
  void MakeRoom(size_t need, size_t host_need, double fraction);

  size_t capacity_bytes_, host_capacity_bytes_;
  double low_watermark_;
  size_t bytes_ = 0, host_bytes_ = 0;
  std::list<Entry> lru_;  // front: most recently used
  std::map<KeyT, std::list<Entry>::iterator> index_;
  PrefixCacheStats stats_;
};

}  // namespace penumbra
