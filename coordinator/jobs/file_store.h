// FileStore: the files tenants upload for batches (the OpenAI API's
// /v1/files, purpose "batch": the JSONL input of a batch), durable in their
// own RocksDB beside the job store. A file is whole or absent: its record
// and its content (in chunks of kChunkBytes) are one synced WriteBatch, and
// a call acknowledged is on disk, also after kill -9.
//
// Integrity: every stored value is a common/record.h record (format
// version, checksum seeded with its key); the file's record also keeps a
// hash of the whole content. Records are checked at Open (a damaged one is
// logged, counted and its file shown as damaged: reads are Corruption, its
// owner may Delete it); chunks and the content hash when the content is
// read (Corruption naming the file; nothing is returned in part).
//
// Writes that fail (a full disk: ResourceExhausted; other I/O: IOError)
// change nothing, and the store recovers by itself (storage/rocksdb_writer.h).
//
// Tenancy: every call names the tenant; another tenant's file is NotFound,
// exactly as one that does not exist.
//
// Thread-safe: one mutex serializes every call (a reopen after a failed
// write replaces the database, so content reads hold it too).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "storage/write_health.h"

namespace penumbra::jobs {

struct FileStoreOptions {
  std::string path;                                  // RocksDB directory (created when missing). Required.
  bool sync_writes = true;                           // fsync the WAL on every change. Default: true.
  int64_t max_file_bytes = int64_t{200} << 20;       // bytes of one file. Default: 200 MiB (OpenAI's limit).
  int64_t max_bytes_per_tenant = int64_t{10} << 30;  // bytes of all a tenant's files. Default: 10 GiB.
  int64_t max_files_per_tenant = 10000;              // files a tenant may keep. Default: 10000.
  std::function<int64_t()> clock;                    // seconds since the epoch. Default: the wall clock.
};

// Reads the keys path, sync_writes, max_file_bytes, max_bytes_per_tenant and
// max_files_per_tenant; errors name the key.
Status LoadFileStoreOptions(ConfigReader& r, FileStoreOptions* o);

inline constexpr size_t kMaxFilenameBytes = 255;
inline constexpr size_t kMaxPurposeBytes = 64;

struct FileInfo {
  std::string id;  // "file-" and 16 hex digits, never reused by this store
  std::string tenant;
  std::string filename;
  std::string purpose;
  int64_t bytes = 0;
  int64_t created_at = 0;  // seconds, from the clock
  std::string damage;      // empty, or why the file is unusable (List only; Get returns Corruption)
};

struct FilePage {
  std::vector<FileInfo> files;  // oldest first
  bool has_more = false;
};

struct FileStoreStats {
  int64_t files = 0;  // held now
  int64_t bytes = 0;  // held now
  int64_t puts = 0;
  int64_t deletes = 0;
  int64_t corrupt_records = 0;
};

class FileStore {
 public:
  static constexpr uint32_t kFormatVersion = 1;
  static constexpr size_t kChunkBytes = size_t{1} << 20;

  // Opens (or creates) the store. InvalidArgument for bad options; IOError
  // or Corruption naming the path when RocksDB cannot open it.
  static Result<std::unique_ptr<FileStore>> Open(const FileStoreOptions& options);
  ~FileStore();
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  // Stores a file. InvalidArgument for an empty or too long filename or
  // purpose, or content over max_file_bytes (named with the limit);
  // ResourceExhausted when the tenant's files would pass their count or
  // bytes limit.
  Result<FileInfo> Put(const std::string& tenant, const std::string& filename, const std::string& purpose,
                       std::string_view content);
  Result<FileInfo> Get(const std::string& tenant, const std::string& id) const;
  // The whole content, every chunk and the content hash checked.
  Result<std::string> Content(const std::string& tenant, const std::string& id) const;
  // The tenant's files in creation order (of `purpose` when not empty),
  // `limit` (1..10000) at a time, after the file `after` (empty: from the
  // first; a deleted one still marks its place). InvalidArgument for a
  // malformed `after` or limit.
  Result<FilePage> List(const std::string& tenant, const std::string& after, size_t limit,
                        const std::string& purpose) const;
  Status Delete(const std::string& tenant, const std::string& id);

  FileStoreStats stats() const;
  storage::WriteHealth write_health() const;

  // ---- tests only ----
  // Flips one byte in the middle of the file's first content chunk (shown at
  // the next Content), or of its record (shown at the next Open).
  Status CorruptForTest(const std::string& id, bool record);

 private:
  struct Impl;
  explicit FileStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace penumbra::jobs
