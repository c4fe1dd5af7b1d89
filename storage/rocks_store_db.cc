#include "storage/rocks_store_db.h"

#include <filesystem>
#include <system_error>

#include "storage/rocksdb_status.h"

namespace penumbra::storage {

Result<std::unique_ptr<RocksStoreDb>> RocksStoreDb::Open(const Options& options) {
  if (options.path.empty()) return Status::InvalidArgument(options.store + ": path is empty");
  std::error_code ec;
  std::filesystem::create_directories(options.path, ec);  // RocksDB creates the last level only
  if (ec) {
    return Status::IOError(options.store + " " + options.path + ": cannot create the directory: " + ec.message());
  }
  std::unique_ptr<RocksStoreDb> s(new RocksStoreDb(options));
  rocksdb::Options& dbo = s->db_options_;
  s->writer_.Configure(&dbo);
  dbo.create_if_missing = true;
  dbo.paranoid_checks = true;  // refuse to open over detected corruption rather than drop records silently
  dbo.max_open_files = options.max_open_files;
  rocksdb::DB* db = nullptr;
  PENUMBRA_RETURN_IF_ERROR(
      FromRocks(rocksdb::DB::Open(dbo, options.path, &db), options.store + " " + options.path + ": cannot open"));
  s->db_.reset(db);
  s->writer_.Attach(db, [raw = s.get()] { return raw->Reopen(); });
  return s;
}

RocksStoreDb::~RocksStoreDb() {
  if (db_) (void)db_->Close();
}

Status RocksStoreDb::Readable() const {
  return db_ ? Status::OK()
             : Status::Unavailable(o_.store + " " + o_.path + ": closed (reopening after a failed write)");
}

Status RocksStoreDb::Commit(rocksdb::WriteBatch* batch, const std::string& what) {
  return writer_.Write(what, [&] {
    rocksdb::WriteOptions w;
    w.sync = o_.sync_writes;
    return db_->Write(w, batch);
  });
}

// RocksWriter's reopen (called under the store's write lock, from Commit).
Result<rocksdb::DB*> RocksStoreDb::Reopen() {
  if (db_) (void)db_->Close();
  db_.reset();
  rocksdb::DB* fresh = nullptr;
  PENUMBRA_RETURN_IF_ERROR(
      FromRocks(rocksdb::DB::Open(db_options_, o_.path, &fresh), o_.store + " " + o_.path + ": cannot reopen"));
  db_.reset(fresh);
  return fresh;
}

}  // namespace penumbra::storage
