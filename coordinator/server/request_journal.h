// The coordinator's request journal: what a coordinator restarted on the same
// data directory needs to continue the generations it had running, its
// owner id (the identity its workers' leases are held under), and its
// tenants' usage counters. One RocksDB directory (data_dir/requests).
//
// A generation's record names its worker (by name, not index) and the
// worker's handle of it, and holds what is needed to start it again
// elsewhere without copying documents: the document ids and their owner, the
// question's tokens, sampling, stop ids and strings, the tokens it had made
// before its current worker's generation (a resumed one), its deadline. The
// coordinator writes a record once the worker accepted the generation
// (Start), rewrites it when the generation moves (Put) and deletes it when the
// generation ends, together with the tenant's usage (Finish).
//
// Durability and failures: every write is one synced RocksDB write batch
// (the WAL fsynced before the call returns), so a record any caller was told
// about survives kill -9. A failed write returns a typed Status and changes
// nothing on disk (a write batch is all or nothing); the caller decides (a
// failed Start fails the Generate call and cancels the worker's generation).
// Integrity: values are sealed with common/record.h (format version, checksum
// over key and value); a record that fails its check at Open is skipped,
// logged and counted (corrupt_records()), and its key deleted.
//
// A failed write (a full disk: ResourceExhausted) goes through
// storage::RocksWriter like the other durable stores: counted
// (write_health()), and the journal becomes writable again by itself when
// space returns.
//
// Thread-safe (writes are serialized inside).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "storage/write_health.h"

namespace penumbra::coordinator {

struct JournalSampling {
  double temperature = 0, top_p = 1;
  int32_t top_k = 0;
  int64_t seed = 0;
};

struct JournalRecord {
  std::string request_id, tenant;
  std::string worker;     // the worker's name (WorkerEndpoint::name)
  std::string handle;     // the worker's handle of the generation
  bool job_item = false;  // a batch job's item (the job re-runs it after a restart)
  // To start it again: the documents (ids, owned by cache_namespace's
  // tenant) and the question's tokens, as BuildGenerate concatenates them.
  std::vector<std::string> document_ids;
  std::string cache_namespace;
  std::vector<int32_t> question;
  int32_t max_new_tokens = 0;
  JournalSampling sampling;
  std::vector<int32_t> stop_ids;  // as sent to the worker (with its end-of-text ids)
  std::vector<std::string> stop;  // stop strings (applied by the coordinator)
  std::string kv_policy;
  double share_weight = 1;
  int64_t draws_done = 0;  // of the original request
  // Tokens made before the current worker's generation (its prompt ends with them).
  std::vector<int32_t> made_before;
  int32_t resumes = 0;
  int64_t created_unix_ms = 0;
  int64_t deadline_unix_ms = 0;  // 0: none
};

// A tenant's usage as Stats and /metrics count it.
struct TenantUsage {
  int64_t requests = 0, failed = 0, prompt = 0, cached = 0, generated = 0;
};

class RequestJournal {
 public:
  // Opens (creates) the journal at `path` and reads it: records(), usage(),
  // owner_id() (made and stored at the first open). IOError when RocksDB
  // cannot be opened or read, or the owner id cannot be stored.
  static Result<std::unique_ptr<RequestJournal>> Open(const std::string& path);
  ~RequestJournal();

  const std::string& owner_id() const { return owner_id_; }
  // As read at Open.
  const std::vector<JournalRecord>& records() const { return records_; }
  const std::map<std::string, TenantUsage>& usage() const { return usage_; }
  int64_t corrupt_records() const { return corrupt_records_; }

  // A generation started: its record and its tenant's usage (the request
  // counted).
  Status Start(const JournalRecord& r, const TenantUsage& usage);
  // Rewrites a generation's record (it moved to another worker).
  Status Put(const JournalRecord& r);
  // A generation ended: its record goes, its tenant's usage is stored.
  Status Finish(const std::string& request_id, const std::string& tenant, const TenantUsage& usage);
  // Deletes a record (a generation dropped at recovery).
  Status Remove(const std::string& request_id);

  // The byte form of a record (exposed for tests).
  static std::string Encode(const JournalRecord& r);
  // How its writes fare (for /metrics).
  storage::WriteHealth write_health() const;
  static Status Decode(const std::string& key, const std::string& value, JournalRecord* r);

 private:
  struct Db;
  RequestJournal() = default;
  // The one place RocksDB is written: a synced batch of puts (value set) and
  // deletes (value null). `what` names the change for the error.
  Status Write(const std::vector<std::pair<std::string, const std::string*>>& changes, const std::string& what);

  std::unique_ptr<Db> db_;
  std::string path_, owner_id_;
  std::vector<JournalRecord> records_;
  std::map<std::string, TenantUsage> usage_;
  int64_t corrupt_records_ = 0;
};

}  // namespace penumbra::coordinator
