// RocksWriter: the one path by which a durable store (the document registry,
// the job store, the segment store) writes its RocksDB, so that none of them
// acknowledges what it did not write, and each becomes writable again by
// itself when the disk has room again. Internal to the stores' .cc files:
// it includes RocksDB headers (the stores' public headers do not).
//
// A failed write returns a typed Status (FromRocks): a full disk is
// ResourceExhausted naming the store, its path and the call ("the disk is
// full"); other I/O errors are IOError. The write is not applied (RocksDB
// inserts into its memtable only what reached the log). RocksDB then holds a
// background error and refuses every write (reads go on): the store is
// *degraded*. Before the next write, at most once per retry interval, the
// writer brings the database back:
//   - DB::Resume() when some active memtable holds entries (Resume flushes
//     them, which switches to a new WAL);
//   - else a reopen through the store's callback: RocksDB 7.8 keeps the WAL
//     writer that failed when there was nothing to flush (facebook/rocksdb
//     #11643), and every later write fails on it (or asserts, in builds with
//     assertions). A reopen is tried only with kReopenMinFreeBytes free on the
//     store's filesystem (it writes a MANIFEST, a WAL and a flush).
// Between tries a write fails at once with the last error. Every refused
// write is counted (health()).
//
// Configure() sets what every store opens RocksDB with: automatic recovery
// off (RocksDB's own, through its SstFileManager, polls every 5 s and wants a
// write buffer of free space; while it runs DB::Resume() is Busy), and the
// info log to glog (a LOG file on the full disk fails too, and its writer
// asserts on its next line in builds with assertions).
//
// Thread-safety: writes (Write, Recover) are serialized by the store (its own
// mutex); health() may be read from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include "common/status.h"
#include "storage/write_health.h"

namespace penumbra::storage {

class RocksWriter {
 public:
  // Closes the store's database and opens it again (same options, column
  // families); returns the new one. Called with the store's write lock held;
  // the store makes sure no reader uses the old one any more.
  using Reopen = std::function<Result<rocksdb::DB*>()>;

  static constexpr std::chrono::milliseconds kDefaultRetryInterval{500};
  static constexpr uint64_t kReopenMinFreeBytes = uint64_t{1} << 20;

  // `store` names it in messages ("document registry"), `path` its directory.
  RocksWriter(std::string store, std::string path, std::chrono::milliseconds retry_interval = kDefaultRetryInterval);

  // What every store sets on its DBOptions before DB::Open (see the top).
  void Configure(rocksdb::DBOptions* options) const;
  // The database to write (after Open); `reopen` may be empty (Resume only).
  void Attach(rocksdb::DB* db, Reopen reopen);
  // Null after a reopen that failed (the store's reads are then Unavailable
  // until a later reopen succeeds).
  rocksdb::DB* db() const { return db_; }

  // Runs one write (`write` calls RocksDB and returns its status; `what`
  // names it: "storing document doc-..."). Degraded: recovers first (see the
  // top) or fails at once. A failure is typed, counted and logged.
  Status Write(const std::string& what, const std::function<rocksdb::Status()>& write);
  // Degraded: tries to become writable again now (rate-limited as above);
  // OK when not degraded.
  Status Recover();

  WriteHealth health() const;
  const std::string& store() const { return store_; }
  const std::string& path() const { return path_; }

 private:
  // Counts a refused write; `degrade`: the store is degraded (keep_last: by
  // the failure recorded before, whose message `s` repeats).
  Status Failed(Status s, bool degrade, bool keep_last = false);
  Status TryRecover();

  const std::string store_, path_;
  const std::chrono::milliseconds retry_interval_;
  rocksdb::DB* db_ = nullptr;
  Reopen reopen_;
  std::chrono::steady_clock::time_point next_try_{};
  Status last_;            // degraded: why
  mutable std::mutex mu_;  // health_
  WriteHealth health_;
};

}  // namespace penumbra::storage
