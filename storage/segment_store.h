// SegmentStore: the persistent tier of the document cache. A cached segment
// (the KV state of a prompt's leading segments, as a policy exports it: named
// byte blobs) is stored under its 128-bit content key in RocksDB on local disk
// and survives restarts and kill -9.
//
// Layout (docs/storage.md): column family "meta" holds one record per
// segment (format version, namespace, token count, blob names and sizes,
// bytes, pinned, last use); "blocks" holds the blobs cut into blocks of
// block_bytes, each with a header carrying its own XXH3 checksum, stored as
// BlobDB blob files (large values kept out of the LSM's compactions);
// "pending" holds intents, the keys of writes and removals under way.
//
// Commit protocol: Put writes an intent, every block, then the segment's meta
// record together with the intent's removal in one synced write (WAL on,
// WriteOptions::sync). Only a segment whose meta record is on disk is
// visible, so a crash mid-Put leaves nothing visible; Open deletes the blocks
// of every intent that has no record (the remains of such a crash). What Put
// acknowledged is on disk. Open reads no block, so a damaged block cannot
// keep the store from opening.
//
// Integrity: every block read back is checked against its checksum, its
// segment key, blob index and block number, and every record against its
// format version; a mismatch is Corruption (counted in stats), never bytes
// that were not stored. A record of an unknown format version is treated as
// absent and counted.
//
// Space: per-namespace byte quotas and a total capacity. Put makes room by
// evicting least-recently-used segments that are neither pinned nor attached;
// when it cannot, it refuses with ResourceExhausted and stores nothing.
// Attach/Detach count in memory the users of a segment (a running request);
// Erase refuses an attached segment.
//
// Thread-safe: one mutex serializes every call.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/hash.h"
#include "common/status.h"

namespace penumbra::storage {

struct SegmentStoreOptions {
  std::string path;                  // RocksDB directory (created when missing). Required.
  size_t capacity_bytes = size_t{64} << 30;  // stored blob bytes at most. Default: 64 GiB.
  size_t block_bytes = size_t{4} << 20;      // blob bytes per block (a RocksDB value). Default: 4 MiB.
  // Bytes per namespace at most; a namespace not named has no quota beyond
  // the capacity. Default: none.
  std::map<std::string, size_t> namespace_quota_bytes;
  bool sync_commit = true;           // fsync the WAL when a segment is committed. Default: true.
  size_t block_cache_bytes = size_t{64} << 20;  // RocksDB block cache. Default: 64 MiB.
  bool direct_reads = false;         // read files with O_DIRECT (bypassing the page cache). Default: false.
  size_t read_threads = 8;           // blocks a Get reads at once (in [1, 256]). Default: 8.
};

// Reads the keys path, capacity_bytes, block_bytes, sync_commit,
// block_cache_bytes, direct_reads and read_threads (engine.yaml's prefix_store:, configs/engine.yaml);
// errors name the key. Per-namespace quotas come from the tenants' config.
Status LoadSegmentStoreOptions(ConfigReader& r, SegmentStoreOptions* o);

struct SegmentInfo {
  std::string cache_namespace;
  int64_t tokens = 0;
  size_t bytes = 0;                  // blob bytes
  bool pinned = false;
  int attached = 0;                  // in-memory users (0 after a reopen)
  uint64_t last_used = 0;            // logical clock, larger = more recent
};

struct SegmentStoreStats {
  int64_t puts = 0, gets = 0, hits = 0, misses = 0, evictions = 0;
  int64_t corruptions_detected = 0;  // blocks or records that failed a check
  int64_t unknown_versions = 0;      // records of another format version, ignored
  int64_t orphans_removed = 0;       // unfinished writes or removals cleaned up at Open
};

class SegmentStore {
 public:
  static constexpr uint32_t kFormatVersion = 1;

  // Opens (or creates) the store and finishes or undoes what a crash
  // interrupted (intents). IOError or
  // Corruption naming the path when RocksDB cannot open it; InvalidArgument
  // for bad options.
  static Result<std::unique_ptr<SegmentStore>> Open(const SegmentStoreOptions& options);
  ~SegmentStore();
  SegmentStore(const SegmentStore&) = delete;
  SegmentStore& operator=(const SegmentStore&) = delete;

  // Stores a segment (blobs: name -> bytes; names are non-empty). A key
  // already present is left as it is (OK). ResourceExhausted when the
  // namespace quota or the capacity cannot be met by eviction; then nothing
  // is stored.
  Status Put(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
             const std::map<std::string, std::string>& blobs);
  // The blobs of a committed segment, every block verified (read_threads
  // blocks read at once); marks it used.
  // NotFound when absent, Corruption when a check fails (the segment stays:
  // the caller may Erase it and recompute).
  Result<std::map<std::string, std::string>> Get(const Hash128& key);
  Result<SegmentInfo> Info(const Hash128& key) const;
  bool Contains(const Hash128& key) const;

  Status Attach(const Hash128& key);  // NotFound when absent
  Status Detach(const Hash128& key);  // FailedPrecondition when not attached
  Status Pin(const Hash128& key, bool pinned);
  // Removes a segment. FailedPrecondition while attached; NotFound when absent.
  Status Erase(const Hash128& key);

  // Writes memtables to files (blob and SST); committed data is durable
  // without it (WAL), this only moves it out of the log.
  Status Flush();

  size_t bytes() const;
  size_t NamespaceBytes(const std::string& cache_namespace) const;
  std::vector<Hash128> Keys() const;  // committed segments, in key order
  SegmentStoreStats stats() const;

 private:
  struct Impl;
  explicit SegmentStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace penumbra::storage
