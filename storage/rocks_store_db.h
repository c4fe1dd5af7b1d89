// RocksStoreDb: the one RocksDB (its default column family) a small durable
// store keeps its records in (the job store, the file store, the document
// registry), written only through a RocksWriter (storage/rocksdb_writer.h):
// opened with the writer's configuration, create_if_missing and paranoid
// checks (a store refuses to open over detected corruption rather than drop
// records), and reopened by the writer after a failed write. Internal to the
// stores' .cc files: it includes RocksDB headers.
//
// Thread-safety: the store serializes Commit (its write lock) and reads db()
// only where no write can run (a reopen replaces the database): under the
// same lock, or before any write (loading at open).
#pragma once

#include <memory>
#include <string>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "common/status.h"
#include "storage/rocksdb_writer.h"
#include "storage/write_health.h"

namespace penumbra::storage {

class RocksStoreDb {
 public:
  struct Options {
    std::string store;  // names it in messages ("job store")
    std::string path;   // its directory (created, with its parents)
    int max_open_files = 256;
    bool sync_writes = true;  // each Commit synced to the disk before it returns
  };
  // Typed errors (FromRocks) naming the store and its path.
  static Result<std::unique_ptr<RocksStoreDb>> Open(const Options& options);
  ~RocksStoreDb();
  RocksStoreDb(const RocksStoreDb&) = delete;
  RocksStoreDb& operator=(const RocksStoreDb&) = delete;

  // Null after a reopen that failed (see Readable).
  rocksdb::DB* db() const { return db_.get(); }
  // OK, or Unavailable naming the store while a reopen after a failed write
  // has not succeeded yet.
  Status Readable() const;
  // Writes `batch` atomically (synced with sync_writes) through the writer:
  // a failure is typed, counted and recovered from, and nothing of the batch
  // is applied. `what` names the write in messages.
  Status Commit(rocksdb::WriteBatch* batch, const std::string& what);
  // Degraded: tries to become writable again now (RocksWriter::Recover).
  Status Recover() { return writer_.Recover(); }
  WriteHealth health() const { return writer_.health(); }
  const std::string& path() const { return o_.path; }

 private:
  explicit RocksStoreDb(const Options& o) : o_(o), writer_(o.store, o.path) {}
  Result<rocksdb::DB*> Reopen();

  Options o_;
  rocksdb::Options db_options_;
  std::unique_ptr<rocksdb::DB> db_;
  RocksWriter writer_;
};

}  // namespace penumbra::storage
