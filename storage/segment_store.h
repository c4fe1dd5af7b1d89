// SegmentStore: the persistent tier of the document cache. A cached segment
// (the KV state of a prompt's leading segments, as a policy exports it: named
// byte blobs) is stored under its 128-bit key in RocksDB on local disk and
// survives restarts and kill -9.
//
// Layout (docs/storage.md, format version 3): column family "meta" holds one
// record per segment (format version, namespace, token count, pinned, last
// use, the generation of its blocks, a SHA-256 content digest, per blob its
// name, size, block size and block count); "blocks" holds each blob cut into
// blocks of its own block size (options.block_bytes unless Put names another
// for that blob), keyed by segment key, generation, blob and block, each with
// a header carrying its own XXH3 checksum, stored as BlobDB blob files (large
// values kept out of the LSM's compactions); "pending" holds intents, the
// (key, generation) of writes and removals under way. Reads use the block
// size the record holds, so a store reopened with another block_bytes reads
// what it stored.
//
// Versions: a Put over a key already stored compares content digests. The
// same content is a no-op (OK); other content is a new version, written
// under a new generation beside the old one and made visible by its record
// in one write, after which the old version's blocks are deleted: a reader
// sees one version or the other, never blocks of both. While the segment
// is attached (a reader holds it) another version is refused
// (FailedPrecondition naming the key).
//
// Commit protocol: Put writes an intent, every block, then the segment's meta
// record together with the intent's removal (and, replacing, an intent for
// the old version) in one synced write (WAL on, WriteOptions::sync). Only a
// version named by a meta record on disk is visible, so a crash mid-Put
// leaves the old state visible; Open deletes the blocks of every intent
// whose version no record names (the remains of such a crash, or of a
// replacement or removal it interrupted). What Put acknowledged is on disk.
// Open reads no block, so a damaged block cannot keep the store from
// opening.
//
// Failed writes (a full disk): Put, Erase and Pin return a typed error
// (ResourceExhausted saying the disk is full, IOError for other I/O errors)
// and change nothing visible: a Put that fails leaves its intent, its blocks
// are deleted at once or at the next Open, and the old version (if any)
// stays. Reads go on. The store is then degraded (write_health()) and
// becomes writable again by itself when the disk has room
// (storage/rocksdb_writer.h: Resume or reopen before the next write, at most
// every 500 ms).
//
// Integrity: every block read back is checked against its checksum, its
// segment key, generation, blob index and block number, and every record
// against its format version; a mismatch is Corruption (counted in stats),
// never bytes that were not stored. A record of another format version (1
// and 2 included) is treated as absent and counted; its blocks are left
// alone.
//
// Reads: Get reads whole blobs, ReadBlob a byte range of one blob (only the
// blocks that cover it: the engine reads a document's values lazily, the
// chunks a question selects first).
//
// Space: per-namespace byte quotas and a total capacity. Put makes room by
// evicting least-recently-used segments that are neither pinned nor attached;
// when it cannot, it refuses with ResourceExhausted and stores nothing.
// Attach/Detach count in memory the users of a segment (a running request);
// Erase refuses an attached segment.
//
// Thread-safe. One mutex serializes every call except the block reads of Get
// and ReadBlob: those run outside it, on a RocksDB snapshot taken with the
// record's lookup, so concurrent reads proceed in parallel and a segment
// erased or evicted under a read still reads back whole. A caller that reads
// a segment over several calls (ReadBlob) Attaches it first, so that it
// stays stored between them. Put holds the mutex while it writes its blocks:
// a read that starts meanwhile waits for it to finish.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/hash.h"
#include "common/option_table.h"
#include "common/status.h"
#include "storage/document_store.h"
#include "storage/write_health.h"

namespace penumbra::storage {

struct SegmentStoreOptions {
  std::string path;                          // RocksDB directory (created when missing). Required.
  size_t capacity_bytes = size_t{64} << 30;  // stored blob bytes at most. Default: 64 GiB.
  // Blob bytes per block (a RocksDB value) for blobs Put gives no block size;
  // in [4096, 256 MiB]. Default: 4 MiB.
  size_t block_bytes = size_t{4} << 20;
  // Bytes per namespace at most; a namespace not named has no quota beyond
  // the capacity. Default: none.
  std::map<std::string, size_t> namespace_quota_bytes;
  bool sync_commit = true;                      // fsync the WAL when a segment is committed. Default: true.
  size_t block_cache_bytes = size_t{64} << 20;  // RocksDB block cache. Default: 64 MiB.
  bool direct_reads = false;                    // read files with O_DIRECT (bypassing the page cache). Default: false.
  size_t read_threads = 8;                      // blocks one Get or ReadBlob reads at once (in [1, 256]). Default: 8.
};

// The store's keys of the storage YAML's `disk:` section (configs/storage.yaml;
// the worker's own keys of that section are worker/engine/storage_options.h's):
// path, capacity_bytes, block_bytes, read_threads, block_cache_bytes,
// sync_commit, direct_reads, each with its range. Per-namespace quotas come
// from the tenants' config.
const OptionTable<SegmentStoreOptions>& SegmentStoreOptionTable();
// Reads those keys from `r` (the section; any other key is an error naming
// it) and validates them; errors name the key.
Status LoadSegmentStoreOptions(ConfigReader& r, SegmentStoreOptions* o);

struct SegmentStoreStats {
  int64_t puts = 0, gets = 0, hits = 0, misses = 0, evictions = 0;
  int64_t corruptions_detected = 0;  // blocks or records that failed a check
  int64_t unknown_versions = 0;      // records of another format version, ignored
  int64_t orphans_removed = 0;       // unfinished writes or removals cleaned up at Open
  int64_t blob_reads = 0;            // ReadBlob calls that returned their bytes
  int64_t replacements = 0;          // Puts that replaced a segment of other content
};

class SegmentStore final : public DocumentStore {
 public:
  static constexpr uint32_t kFormatVersion = 3;
  // The range of block sizes, store-wide (block_bytes) or per blob.
  static constexpr size_t kMinBlockBytes = 4096;
  static constexpr size_t kMaxBlockBytes = size_t{256} << 20;

  // Opens (or creates) the store and finishes or undoes what a crash
  // interrupted (intents). IOError or
  // Corruption naming the path when RocksDB cannot open it; InvalidArgument
  // for bad options.
  static Result<std::unique_ptr<SegmentStore>> Open(const SegmentStoreOptions& options);
  ~SegmentStore() override;
  SegmentStore(const SegmentStore&) = delete;
  SegmentStore& operator=(const SegmentStore&) = delete;

  // Stores a segment (blobs: name -> bytes; names are non-empty), each blob
  // cut into blocks of blob_block_bytes[name] bytes when given (in
  // [kMinBlockBytes, kMaxBlockBytes]; every name a blob of the segment), else
  // options.block_bytes. A key already present with the same content
  // (namespace, tokens, blobs' names and bytes) is left as it is (OK); with
  // other content it is replaced whole, its pin kept (FailedPrecondition
  // naming the key while attached). ResourceExhausted when the namespace
  // quota or the capacity cannot be met by eviction (never of the segment
  // being replaced); then nothing is stored and a replaced segment stays.
  Status Put(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
             const std::map<std::string, std::string>& blobs,
             const std::map<std::string, size_t>& blob_block_bytes = {}) override;
  // The blobs of a committed segment, every block verified (read_threads
  // blocks read at once); marks it used.
  // NotFound when absent, Corruption when a check fails (the segment stays:
  // the caller may Erase it and recompute).
  Result<std::map<std::string, std::string>> Get(const Hash128& key) override;
  // As Get, reading only the blobs named in `only` (the others are absent
  // from the result). InvalidArgument naming a name that is not a blob of
  // the segment.
  Result<std::map<std::string, std::string>> Get(const Hash128& key, const std::set<std::string>& only) override;
  // Copies bytes [offset, offset + length) of one blob into dst (length
  // bytes, any memory: pinned host memory is written in place), reading and
  // verifying only the blocks that cover them, read_threads at once; marks
  // the segment used (in memory; persisted by Get, Pin and at close).
  // NotFound when the segment is absent; InvalidArgument when it has no such
  // blob or the range ends past the blob's size; Corruption when a check
  // fails (then dst holds no valid bytes). Thread-safe and parallel: many
  // ReadBlob calls run at once. A caller reading a segment piece by piece
  // Attaches it first (Erase and eviction then leave it in place); an
  // unattached segment may go between two calls (NotFound), never within one.
  Status ReadBlob(const Hash128& key, const std::string& blob, uint64_t offset, uint64_t length, void* dst);
  // The blobs of a committed segment (in blob index order: by name) and how
  // they are cut into blocks. NotFound when absent.
  Result<std::vector<BlobLayout>> Layout(const Hash128& key) const override;
  Result<SegmentInfo> Info(const Hash128& key) const override;
  bool Contains(const Hash128& key) const;

  Status Attach(const Hash128& key);  // NotFound when absent
  Status Detach(const Hash128& key);  // FailedPrecondition when not attached
  Status Pin(const Hash128& key, bool pinned);
  // Removes a segment. FailedPrecondition while attached; NotFound when absent.
  Status Erase(const Hash128& key) override;
  // A reader that keeps the segment attached while it lives (OpenSegmentReader).
  Result<std::shared_ptr<BlobReader>> OpenReader(const Hash128& key) override;

  // Whether a segment of `bytes` blob bytes in namespace `ns` could ever
  // fit: ResourceExhausted naming the limit when it exceeds the capacity or
  // the namespace's quota (what Put would refuse before evicting anything).
  Status CheckRoom(const std::string& ns, uint64_t bytes) const;

  // Writes memtables to files (blob and SST); committed data is durable
  // without it (WAL), this only moves it out of the log.
  Status Flush();

  size_t bytes() const;
  size_t NamespaceBytes(const std::string& cache_namespace) const;
  std::vector<Hash128> Keys() const;  // committed segments, in key order
  SegmentStoreStats stats() const;
  // How its writes fare (write errors, degraded), for metrics.
  WriteHealth write_health() const;

 private:
  struct Impl;
  explicit SegmentStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace penumbra::storage
