#include "storage/rocksdb_writer.h"

#include <sys/statvfs.h>

#include <cstdarg>
#include <cstdio>
#include <memory>

#include <glog/logging.h>
#include <rocksdb/env.h>
#include <rocksdb/listener.h>

#include "storage/rocksdb_status.h"

namespace penumbra::storage {
namespace {

// RocksDB's info log, to glog: warnings and errors as such, the rest at
// VLOG(1). Nothing is written under the store's directory.
class GlogLogger final : public rocksdb::Logger {
 public:
  explicit GlogLogger(std::string store)
      : rocksdb::Logger(rocksdb::InfoLogLevel::INFO_LEVEL), store_(std::move(store)) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override { Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap); }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < rocksdb::InfoLogLevel::WARN_LEVEL && !VLOG_IS_ON(1)) return;
    char line[1024];
    std::vsnprintf(line, sizeof line, format, ap);
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      LOG(ERROR) << store_ << " (RocksDB): " << line;
    } else if (level >= rocksdb::InfoLogLevel::WARN_LEVEL) {
      LOG(WARNING) << store_ << " (RocksDB): " << line;
    } else {
      VLOG(1) << store_ << " (RocksDB): " << line;
    }
  }

 private:
  const std::string store_;
};

// Turns RocksDB's automatic recovery off: RocksWriter resumes by itself.
class NoAutoRecovery final : public rocksdb::EventListener {
 public:
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason, rocksdb::Status, bool* auto_recovery) override {
    *auto_recovery = false;
  }
};

}  // namespace

RocksWriter::RocksWriter(std::string store, std::string path, std::chrono::milliseconds retry_interval)
    : store_(std::move(store)), path_(std::move(path)), retry_interval_(retry_interval) {}

void RocksWriter::Configure(rocksdb::DBOptions* o) const {
  o->info_log = std::make_shared<GlogLogger>(store_ + " " + path_);
  o->listeners.push_back(std::make_shared<NoAutoRecovery>());
  o->paranoid_checks = true;
}

void RocksWriter::Attach(rocksdb::DB* db, Reopen reopen) {
  db_ = db;
  reopen_ = std::move(reopen);
}

Status RocksWriter::Write(const std::string& what, const std::function<rocksdb::Status()>& write) {
  PENUMBRA_RETURN_IF_ERROR(Recover());
  const rocksdb::Status rs = write();
  if (rs.ok()) return Status::OK();
  // An I/O failure leaves RocksDB refusing writes (a background error).
  const bool degrade = rs.IsIOError() || rs.IsNoSpace() || rs.severity() >= rocksdb::Status::Severity::kHardError;
  return Failed(FromRocks(rs, store_ + " " + path_ + ": " + what), degrade);
}

Status RocksWriter::Recover() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!health_.degraded) return Status::OK();
  }
  const auto now = std::chrono::steady_clock::now();
  if (now < next_try_) {
    return Failed(Status(last_.code(), last_.message() + " (writes are refused until it recovers; next try within " +
                                           std::to_string(retry_interval_.count()) + " ms)"),
                  true, /*keep_last=*/true);
  }
  next_try_ = now + retry_interval_;
  Status s = TryRecover();
  if (!s.ok()) return Failed(s, true);
  std::lock_guard<std::mutex> lk(mu_);
  health_.degraded = false;
  ++health_.recoveries;
  LOG(WARNING) << store_ << " " << path_ << ": writable again after " << health_.write_errors
               << " failed writes so far";
  return Status::OK();
}

Status RocksWriter::TryRecover() {
  const std::string where = store_ + " " + path_;
  uint64_t entries = 0;
  const bool memtable_holds =
      db_ != nullptr && db_->GetAggregatedIntProperty("rocksdb.num-entries-active-mem-table", &entries) && entries > 0;
  if (db_ != nullptr && (memtable_holds || !reopen_))
    return FromRocks(db_->Resume(), where + ": resuming after a failed write");
  struct statvfs fs;
  if (!reopen_) return Status::Unavailable(where + ": closed after a failed reopen");
  if (::statvfs(path_.c_str(), &fs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
    if (free_bytes < kReopenMinFreeBytes) {
      return Status::ResourceExhausted(where + ": the disk is full (" + std::to_string(free_bytes) +
                                       " bytes free); waiting for space to reopen");
    }
  }
  LOG(WARNING) << where << ": reopening RocksDB after a failed write";
  db_ = nullptr;
  Result<rocksdb::DB*> db = reopen_();
  if (!db.ok()) return db.status();
  db_ = *db;
  std::lock_guard<std::mutex> lk(mu_);
  ++health_.reopens;
  return Status::OK();
}

Status RocksWriter::Failed(Status s, bool degrade, bool keep_last) {
  std::lock_guard<std::mutex> lk(mu_);
  ++health_.write_errors;
  health_.last_error = s.message();
  if (degrade) {
    if (!health_.degraded) {
      LOG(ERROR) << s << " (writes are refused until it recovers)";
      next_try_ = std::chrono::steady_clock::now() + retry_interval_;
    }
    health_.degraded = true;
    if (!keep_last) last_ = s;
  } else {
    LOG(ERROR) << s;
  }
  return s;
}

WriteHealth RocksWriter::health() const {
  std::lock_guard<std::mutex> lk(mu_);
  return health_;
}

}  // namespace penumbra::storage
