// JobStore: the durable record of batch document-analysis jobs. A tenant
// submits a job (a list of items, each a question over some documents); the
// coordinator leases pending items to workers (Claim), records each item's
// result exactly once (Complete), and the tenant reads the job's progress
// and its results page by page. Everything survives restarts and kill -9.
//
// Life of a job: Submit validates synchronously and stores the job as
// in_progress (so `validating` is never stored). When the last item has a
// result the job is `completed`, whether its items succeeded or failed (as
// batch APIs do); the step through `finalizing` happens inside that one
// write and is never stored either. `failed` is kept for job-level failures
// a caller may declare; this store never sets it. Cancel cancels the
// pending items at once; the job is `cancelling` while leased items still
// run and `cancelled` once none does (the coordinator's JobService stops
// them and releases their leases, which cancels them). A job not finished when its
// completion window has passed (now >= created_at + window, checked by
// ExpireDue) is `expired`: its unfinished items fail with error "expired",
// results already recorded stay. Completed, failed, cancelled and expired
// are final; only a final job can be deleted.
//
// Items: pending -> running (Claim, with a new attempt number) -> succeeded
// or failed (Complete); running -> pending (Release, or Open after a crash);
// pending -> cancelled (Cancel); running -> cancelled when the lease of a
// cancelling job's item is released, dropped at Open or outlives the window;
// pending or running -> failed (expiry). Attempt numbers start at 1, grow by
// one per lease, and are stored, so they never repeat.
//
// Exactly once: the first result recorded for an item wins, whichever
// leased attempt sends it (a worker whose lease was lost or recovered may
// still finish first). A result for an item that already has one, or is
// cancelled or expired, is acknowledged (OK), changes nothing, and is
// counted in stats().duplicate_results_ignored.
//
// Durability: every change is one RocksDB WriteBatch (WAL on, synced when
// JobStoreOptions::sync_writes): a job with all its items, a result with
// the item's state and the job's counters, a lease batch. After a crash a
// job is either whole or absent, and what a call acknowledged is on disk.
// A write that fails changes nothing (on disk or in memory) and fails the
// call with a typed error (storage/rocksdb_writer.h): ResourceExhausted
// saying the disk is full, IOError for other I/O errors; the store is then
// degraded (write_health()) and becomes writable again by itself when the
// disk has room (before the next write, at most every 500 ms).
// Open recovers: items left running go back to pending (attempt kept), so
// every unfinished job resumes; the running items of a cancelling job are
// cancelled and the job becomes cancelled.
//
// Integrity: every stored value starts with the format version and ends
// with a checksum over the value and its key. A record that fails either
// check marks its job damaged (counted in stats().corrupt_records, logged):
// calls on that job return Corruption naming the record kind and the job,
// Claim skips it, List shows it with JobInfo::damage set, and its owner may
// Delete it. Job and item-state records are checked at Open (where the
// stored counters are also checked against a recount of the items), item
// specs when leased, custom-id index entries when results are read.
//
// Tenancy: every call that names a job also names the tenant; another
// tenant's job is NotFound, exactly as a job that does not exist. (A job
// whose own record is damaged has no known owner: it is Corruption to all.)
//
// Thread-safe: one mutex serializes every call.
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

enum class JobStatus : uint8_t {
  kValidating = 0,
  kInProgress = 1,
  kFinalizing = 2,
  kCompleted = 3,
  kFailed = 4,
  kCancelling = 5,
  kCancelled = 6,
  kExpired = 7,
};
// "validating", "in_progress", "finalizing", "completed", "failed",
// "cancelling", "cancelled", "expired".
std::string_view ToString(JobStatus status);
// Completed, failed, cancelled or expired: nothing about the job changes any more.
bool IsFinal(JobStatus status);

enum class ItemState : uint8_t {
  kPending = 0,
  kRunning = 1,
  kSucceeded = 2,
  kFailed = 3,
  kCancelled = 4,
};
// "pending", "running", "succeeded", "failed", "cancelled".
std::string_view ToString(ItemState state);

// Caps that are not options.
inline constexpr size_t kMaxCustomIdBytes = 256;
inline constexpr size_t kMaxTenantBytes = 256;
inline constexpr size_t kMaxPageSize = 1000;

struct JobStoreOptions {
  std::string path;                             // RocksDB directory (created when missing). Required.
  bool sync_writes = true;                      // fsync the WAL on every change. Default: true.
  size_t max_items_per_job = 50000;             // items a job may hold. Default: 50000.
  size_t max_question_bytes = size_t{1} << 20;  // bytes of one item's question. Default: 1 MiB.
  int64_t default_completion_window_s = 86400;  // window of a job that names none. Default: 24 h.
  // Seconds since the epoch, for created_at / finished_at (tests inject a
  // fake clock). Default: the system wall clock.
  std::function<int64_t()> clock;
};

// Reads the keys path, sync_writes, max_items_per_job, max_question_bytes and
// default_completion_window_s; errors name the key.
Status LoadJobStoreOptions(ConfigReader& r, JobStoreOptions* o);

struct JobItem {
  std::string custom_id;  // the caller's name for the item: unique in the job, 1..256 bytes
  std::vector<std::string> document_ids;
  std::string question;
  std::string options;  // opaque to the store: the caller's serialized sampling options
};

struct JobSpec {
  std::vector<JobItem> items;       // 1..max_items_per_job
  int64_t completion_window_s = 0;  // 0: JobStoreOptions::default_completion_window_s
  std::string metadata;             // opaque to the store
};

struct JobCounts {
  int64_t total = 0;
  int64_t pending = 0;
  int64_t running = 0;
  int64_t completed = 0;  // items that succeeded
  int64_t failed = 0;     // items whose result is a failure, expired ones included
  int64_t cancelled = 0;
  bool operator==(const JobCounts&) const = default;
};

struct JobInfo {
  std::string id;
  std::string tenant;
  JobStatus status = JobStatus::kInProgress;
  int64_t created_at = 0;  // seconds, from JobStoreOptions::clock
  int64_t completion_window_s = 0;
  int64_t expires_at = 0;   // created_at + completion_window_s
  int64_t finished_at = 0;  // when it became final; 0 before
  std::string metadata;
  JobCounts counts;
  std::string damage;  // empty, or why the job is unusable (List only; Get returns Corruption)
};

struct JobPage {
  std::vector<JobInfo> jobs;    // oldest first
  std::string next_page_token;  // empty on the last page
};

struct ItemResult {
  bool ok = false;
  std::string answer;
  std::string error;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t generated_tokens = 0;
  double ttft_ms = 0;
  bool operator==(const ItemResult&) const = default;
};

// One leased item: what a worker needs to run it, and the (job, index,
// attempt) to report back with.
struct ItemLease {
  std::string job_id;
  std::string tenant;
  uint32_t item_index = 0;
  std::string custom_id;
  uint32_t attempt = 0;
  std::vector<std::string> document_ids;
  std::string question;
  std::string options;
};

// A finished item. Cancelled items carry {ok: false, error: "cancelled"},
// expired ones {ok: false, error: "expired"}.
struct ItemOutcome {
  std::string custom_id;
  uint32_t item_index = 0;
  ItemState state = ItemState::kSucceeded;
  ItemResult result;
};

struct ResultsPage {
  std::vector<ItemOutcome> items;    // in custom_id order (bytewise)
  std::string next_after_custom_id;  // pass as after_custom_id for the next page; empty on the last
};

struct JobStoreStats {
  int64_t submits = 0;
  int64_t items_claimed = 0;  // leases handed out
  int64_t results_recorded = 0;
  int64_t duplicate_results_ignored = 0;  // results for items already finished or cancelled
  int64_t releases = 0;
  int64_t stale_releases_ignored = 0;  // releases of an attempt that is not the running one
  int64_t cancels = 0;
  int64_t jobs_expired = 0;
  int64_t deletes = 0;
  int64_t recoveries = 0;       // items found running at Open (back to pending, or cancelled)
  int64_t corrupt_records = 0;  // records that failed a check
};

class JobStore {
 public:
  static constexpr uint32_t kFormatVersion = 1;

  // Opens (or creates) the store and recovers what a crash left running
  // (see the top of this file). InvalidArgument for bad options; IOError or
  // Corruption naming the path when RocksDB cannot open it or the store's
  // own record is damaged.
  static Result<std::unique_ptr<JobStore>> Open(const JobStoreOptions& options);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Stores a new job, all of it in one synced write, and returns its id
  // ("job-" and 16 hex digits; never reused by this store, even after
  // Delete). InvalidArgument naming the item (index and custom_id) and the
  // problem for a bad spec; then nothing is stored.
  Result<std::string> Submit(const std::string& tenant, const JobSpec& spec);

  // Leases up to max_items pending items: oldest job first, a job's items in
  // index order. Each becomes running with the next attempt number. Skips
  // jobs that are not in_progress and damaged ones (a damaged item spec met
  // here damages its job).
  Result<std::vector<ItemLease>> Claim(size_t max_items);

  // Records an item's result (see "Exactly once" above). NotFound for an
  // unknown job or item; InvalidArgument for an attempt never leased;
  // Corruption for a damaged job. Finishes the job when this was its last
  // unfinished item (completed; cancelled for a cancelling job).
  Status Complete(const std::string& job_id, uint32_t item_index, uint32_t attempt, const ItemResult& result);

  // A running item's worker was lost: the item goes back to pending (to
  // cancelled in a cancelling job, which is then finished when no item runs).
  // An attempt that is not the running one is ignored (OK, counted).
  Status Release(const std::string& job_id, uint32_t item_index, uint32_t attempt);

  // Cancels a job (see above). OK for a job already cancelling;
  // FailedPrecondition for a final one.
  Status Cancel(const std::string& tenant, const std::string& job_id);

  // Expires every in_progress job with now >= expires_at. A cancelling job
  // past its window stops waiting: its running items are cancelled and it
  // becomes cancelled. finished_at is `now`.
  Status ExpireDue(int64_t now);

  Result<JobInfo> Get(const std::string& tenant, const std::string& job_id) const;
  // The tenant's jobs in creation order, page_size (1..kMaxPageSize) at a
  // time, starting after page_token (empty: from the first). The token is
  // the id of the last job of the previous page, so deleting that job does
  // not break paging. InvalidArgument for a malformed token or page size.
  Result<JobPage> List(const std::string& tenant, const std::string& page_token, size_t page_size) const;
  // The job's finished items in custom_id order, page_size (1..kMaxPageSize)
  // at a time, starting after after_custom_id (empty: from the first).
  Result<ResultsPage> Results(const std::string& tenant, const std::string& job_id, const std::string& after_custom_id,
                              size_t page_size);

  // Removes a final (or damaged) job and everything stored for it.
  // FailedPrecondition while it is in_progress or cancelling.
  Status Delete(const std::string& tenant, const std::string& job_id);

  // The tenant's jobs not final yet (in progress or cancelling), from memory.
  int64_t Unfinished(const std::string& tenant) const;

  JobStoreStats stats() const;
  // How its writes fare (write errors, degraded), for /metrics.
  storage::WriteHealth write_health() const;

  // ---- tests only ----
  enum class RecordKind : uint8_t { kJob, kItemSpec, kItemState, kCustomIdIndex };
  // Flips one byte in the middle of a stored record of `job_id` (the job's
  // own record, or item 0's spec / state, or its first custom-id index
  // entry) so that it fails verification. What this store holds in memory
  // is left as it is: job and item-state damage shows after the next Open,
  // item-spec damage at the next Claim of that item, index damage at the
  // next Results. NotFound when there is no such record.
  Status CorruptRecordForTest(const std::string& job_id, RecordKind kind);

 private:
  struct Impl;
  explicit JobStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace penumbra::jobs
