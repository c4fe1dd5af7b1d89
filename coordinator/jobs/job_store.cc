#include "coordinator/jobs/job_store.h"

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <unordered_map>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "common/hash.h"
#include "common/record.h"
#include "coordinator/jobs/store_ids.h"
#include "storage/rocks_store_db.h"
#include "storage/rocksdb_status.h"

namespace penumbra::jobs {
namespace {

using storage::FromRocks;

// ---- keys -------------------------------------------------------------------
// m                        the store's record: the id salt and the next job sequence number
// j<job id>                a job's record (tenant, status, times, metadata, counters)
// i<job id><index, BE32>   an item's spec (never rewritten)
// r<job id><index, BE32>   an item's state, attempt and result
// c<job id><custom_id>     custom_id -> item index (results in custom_id order)
// Job ids have one length, so the keys of a job are exactly those under
// <kind><job id>.
constexpr std::string_view kStoreKey = "m";
constexpr char kJobKind = 'j';
constexpr char kSpecKind = 'i';
constexpr char kStateKind = 'r';
constexpr char kIndexKind = 'c';
constexpr std::string_view kJobIdPrefix = "job-";
constexpr size_t kJobIdBytes = 4 + kStoreIdHexDigits;  // "job-" and 16 hex digits

const char* KindName(char kind) {
  switch (kind) {
    case kJobKind:
      return "job";
    case kSpecKind:
      return "item spec";
    case kStateKind:
      return "item state";
    case kIndexKind:
      return "custom-id index";
    default:
      return "store";
  }
}

std::string JobKey(char kind, const std::string& job_id) { return std::string(1, kind) + job_id; }
std::string ItemKey(char kind, const std::string& job_id, uint32_t index) {
  std::string k = JobKey(kind, job_id);
  PutBigEndian32(&k, index);
  return k;
}

// ---- job ids ------------------------------------------------------------------
// "job-" and 16 hex digits (store_ids.h).
std::string MakeJobId(uint64_t seq, uint64_t salt) { return MakeStoreId(kJobIdPrefix, seq, salt); }
bool JobIdSeq(std::string_view id, uint64_t salt, uint64_t* seq) { return StoreIdSeq(kJobIdPrefix, id, salt, seq); }

// ---- values -------------------------------------------------------------------
// common/record.h records (format version, fields, a checksum seeded with the
// key) of format JobStore::kFormatVersion.
RecordWriter Writer() { return RecordWriter(JobStore::kFormatVersion); }
using Reader = RecordReader;
Status Unseal(std::string_view key, std::string_view value, std::string_view* fields) {
  return UnsealRecord(key, value, JobStore::kFormatVersion, fields);
}

Status Truncated() { return Status::Corruption("malformed fields"); }

struct StoreRecord {
  uint64_t salt = 0;
  uint64_t next_seq = 1;
};
std::string Encode(const StoreRecord& r) { return Writer().U64(r.salt).U64(r.next_seq).Seal(kStoreKey); }
Status Decode(std::string_view key, std::string_view value, StoreRecord* r) {
  std::string_view f;
  PENUMBRA_RETURN_IF_ERROR(Unseal(key, value, &f));
  Reader in(f);
  if (!in.U64(&r->salt) || !in.U64(&r->next_seq) || !in.done()) return Truncated();
  return Status::OK();
}

struct JobRecord {
  std::string tenant;
  uint64_t seq = 0;
  JobStatus status = JobStatus::kInProgress;
  int64_t created_at = 0;
  int64_t window_s = 0;
  int64_t finished_at = 0;
  std::string metadata;
  uint32_t items = 0;
  int64_t completed = 0, failed = 0, cancelled = 0;
  bool operator==(const JobRecord&) const = default;
};
std::string Encode(const std::string& key, const JobRecord& r) {
  return Writer()
      .Str(r.tenant)
      .U64(r.seq)
      .U8(static_cast<uint8_t>(r.status))
      .I64(r.created_at)
      .I64(r.window_s)
      .I64(r.finished_at)
      .Str(r.metadata)
      .U32(r.items)
      .I64(r.completed)
      .I64(r.failed)
      .I64(r.cancelled)
      .Seal(key);
}
Status Decode(std::string_view key, std::string_view value, JobRecord* r) {
  std::string_view f;
  PENUMBRA_RETURN_IF_ERROR(Unseal(key, value, &f));
  Reader in(f);
  uint8_t status = 0;
  if (!in.Str(&r->tenant) || !in.U64(&r->seq) || !in.U8(&status) || !in.I64(&r->created_at) || !in.I64(&r->window_s) ||
      !in.I64(&r->finished_at) || !in.Str(&r->metadata) || !in.U32(&r->items) || !in.I64(&r->completed) ||
      !in.I64(&r->failed) || !in.I64(&r->cancelled) || !in.done()) {
    return Truncated();
  }
  if (status > static_cast<uint8_t>(JobStatus::kExpired)) {
    return Status::Corruption("bad status " + std::to_string(status));
  }
  if (r->items == 0) return Status::Corruption("no items");
  r->status = static_cast<JobStatus>(status);
  return Status::OK();
}

struct SpecRecord {
  std::string custom_id;
  std::vector<std::string> document_ids;
  std::string question;
  std::string options;
};
std::string Encode(const std::string& key, const JobItem& r) {
  return Writer().Str(r.custom_id).Strs(r.document_ids).Str(r.question).Str(r.options).Seal(key);
}
Status Decode(std::string_view key, std::string_view value, SpecRecord* r) {
  std::string_view f;
  PENUMBRA_RETURN_IF_ERROR(Unseal(key, value, &f));
  Reader in(f);
  if (!in.Str(&r->custom_id) || !in.Strs(&r->document_ids) || !in.Str(&r->question) || !in.Str(&r->options) ||
      !in.done()) {
    return Truncated();
  }
  return Status::OK();
}

bool IsFinished(ItemState s) {
  return s == ItemState::kSucceeded || s == ItemState::kFailed || s == ItemState::kCancelled;
}

struct ItemRecord {
  std::string custom_id;
  ItemState state = ItemState::kPending;
  uint32_t attempt = 0;
  ItemResult result;  // stored for finished items only
};
std::string Encode(const std::string& key, const ItemRecord& r) {
  RecordWriter w = Writer();
  w.Str(r.custom_id).U8(static_cast<uint8_t>(r.state)).U32(r.attempt);
  if (IsFinished(r.state)) {
    const ItemResult& x = r.result;
    w.U8(x.ok ? 1 : 0).Str(x.answer).Str(x.error).I64(x.prompt_tokens).I64(x.cached_tokens).I64(x.generated_tokens);
    w.F64(x.ttft_ms);
  }
  return w.Seal(key);
}
Status Decode(std::string_view key, std::string_view value, ItemRecord* r) {
  std::string_view f;
  PENUMBRA_RETURN_IF_ERROR(Unseal(key, value, &f));
  Reader in(f);
  uint8_t state = 0;
  if (!in.Str(&r->custom_id) || !in.U8(&state) || !in.U32(&r->attempt)) return Truncated();
  if (state > static_cast<uint8_t>(ItemState::kCancelled)) {
    return Status::Corruption("bad state " + std::to_string(state));
  }
  r->state = static_cast<ItemState>(state);
  if (IsFinished(r->state)) {
    ItemResult& x = r->result;
    uint8_t ok = 0;
    if (!in.U8(&ok) || !in.Str(&x.answer) || !in.Str(&x.error) || !in.I64(&x.prompt_tokens) ||
        !in.I64(&x.cached_tokens) || !in.I64(&x.generated_tokens) || !in.F64(&x.ttft_ms)) {
      return Truncated();
    }
    x.ok = ok != 0;
  }
  if (!in.done()) return Truncated();
  return Status::OK();
}

std::string EncodeIndex(const std::string& key, uint32_t index) { return Writer().U32(index).Seal(key); }
Status DecodeIndex(std::string_view key, std::string_view value, uint32_t* index) {
  std::string_view f;
  PENUMBRA_RETURN_IF_ERROR(Unseal(key, value, &f));
  Reader in(f);
  if (!in.U32(index) || !in.done()) return Truncated();
  return Status::OK();
}

ItemResult CancelledResult() {
  ItemResult r;
  r.error = "cancelled";
  return r;
}
ItemResult ExpiredResult() {
  ItemResult r;
  r.error = "expired";
  return r;
}

}  // namespace

std::string_view ToString(JobStatus s) {
  switch (s) {
    case JobStatus::kValidating:
      return "validating";
    case JobStatus::kInProgress:
      return "in_progress";
    case JobStatus::kFinalizing:
      return "finalizing";
    case JobStatus::kCompleted:
      return "completed";
    case JobStatus::kFailed:
      return "failed";
    case JobStatus::kCancelling:
      return "cancelling";
    case JobStatus::kCancelled:
      return "cancelled";
    case JobStatus::kExpired:
      return "expired";
  }
  return "unknown";
}

bool IsFinal(JobStatus s) {
  return s == JobStatus::kCompleted || s == JobStatus::kFailed || s == JobStatus::kCancelled ||
         s == JobStatus::kExpired;
}

std::string_view ToString(ItemState s) {
  switch (s) {
    case ItemState::kPending:
      return "pending";
    case ItemState::kRunning:
      return "running";
    case ItemState::kSucceeded:
      return "succeeded";
    case ItemState::kFailed:
      return "failed";
    case ItemState::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

struct JobStore::Impl {
  struct Item {
    ItemState state = ItemState::kPending;
    uint32_t attempt = 0;
  };
  struct Job {
    std::string id;
    bool record_ok = true;  // false: the job's own record is damaged, its owner unknown
    JobRecord rec;
    std::vector<Item> items;
    std::set<uint32_t> pending;
    uint32_t running = 0;
    std::string damage;  // non-empty: the job is unusable (Corruption)
  };
  // An item's new state record (read, then changed).
  struct ItemChange {
    uint32_t index;
    ItemRecord record;
  };

  JobStoreOptions options;
  std::unique_ptr<storage::RocksStoreDb> rdb;  // every write through its RocksWriter
  mutable std::mutex mu;
  StoreRecord store;
  std::map<std::string, Job> jobs;         // every job, damaged ones included
  std::map<uint64_t, std::string> by_seq;  // jobs with a readable record, oldest first
  std::map<std::string, std::map<uint64_t, std::string>> by_tenant;
  JobStoreStats stats;

  int64_t Now() const { return options.clock ? options.clock() : WallClockSeconds(); }

  // Every write: typed, counted, recovered from (storage/rocks_store_db.h).
  // On failure nothing is written. db() is null only after a reopen that
  // failed (calls are then Unavailable: Readable).
  rocksdb::DB* db() const { return rdb->db(); }
  Status Commit(rocksdb::WriteBatch* batch, const std::string& what) { return rdb->Commit(batch, what); }
  Status Readable() const { return rdb->Readable(); }

  Status Damage(char kind, const std::string& job_id, const std::string& item, const Status& why) {
    return Status::Corruption("job store: " + std::string(KindName(kind)) + " record of job " + job_id + item + ": " +
                              why.message());
  }
  // Marks `job` unusable for `why` (a Corruption status naming the record),
  // counts it and returns it.
  Status MarkDamaged(Job& job, Status why) {
    LOG(ERROR) << why;
    ++stats.corrupt_records;
    if (job.damage.empty()) job.damage = why.message();
    return why;
  }

  // The tenant's job: NotFound when absent or another tenant's; Corruption
  // when its owner cannot be known.
  Result<Job*> Find(const std::string& tenant, const std::string& job_id) {
    auto it = jobs.find(job_id);
    if (it == jobs.end()) return Status::NotFound("job store: job " + job_id + " not found");
    if (!it->second.record_ok) return Status::Corruption(it->second.damage);
    if (it->second.rec.tenant != tenant) return Status::NotFound("job store: job " + job_id + " not found");
    return &it->second;
  }
  // A job named by a worker (no tenant): NotFound or Corruption for a damaged one.
  Result<Job*> FindUsable(const std::string& job_id, uint32_t item_index) {
    auto it = jobs.find(job_id);
    if (it == jobs.end()) return Status::NotFound("job store: job " + job_id + " not found");
    if (!it->second.damage.empty()) return Status::Corruption(it->second.damage);
    if (item_index >= it->second.items.size()) {
      return Status::NotFound("job store: job " + job_id + " has no item " + std::to_string(item_index) + " (" +
                              std::to_string(it->second.items.size()) + " items)");
    }
    return &it->second;
  }

  // An item's state record, checked against what is in memory; a failure
  // damages the job.
  Result<ItemRecord> ReadItem(Job& job, uint32_t index) {
    PENUMBRA_RETURN_IF_ERROR(Readable());
    const std::string key = ItemKey(kStateKind, job.id, index);
    const std::string item = ", item " + std::to_string(index);
    std::string value;
    rocksdb::Status rs = db()->Get(rocksdb::ReadOptions(), key, &value);
    if (rs.IsNotFound()) return MarkDamaged(job, Damage(kStateKind, job.id, item, Status::Corruption("missing")));
    PENUMBRA_RETURN_IF_ERROR(FromRocks(rs, "job store: reading item state"));
    ItemRecord r;
    Status s = Decode(key, value, &r);
    if (s.ok() && (r.state != job.items[index].state || r.attempt != job.items[index].attempt)) {
      s = Status::Corruption("stored " + std::string(ToString(r.state)) + " attempt " + std::to_string(r.attempt) +
                             ", expected " + std::string(ToString(job.items[index].state)) + " attempt " +
                             std::to_string(job.items[index].attempt));
    }
    if (!s.ok()) return MarkDamaged(job, Damage(kStateKind, job.id, item, s));
    return r;
  }

  Result<SpecRecord> ReadSpec(Job& job, uint32_t index) {
    PENUMBRA_RETURN_IF_ERROR(Readable());
    const std::string key = ItemKey(kSpecKind, job.id, index);
    const std::string item = ", item " + std::to_string(index);
    std::string value;
    rocksdb::Status rs = db()->Get(rocksdb::ReadOptions(), key, &value);
    if (rs.IsNotFound()) return MarkDamaged(job, Damage(kSpecKind, job.id, item, Status::Corruption("missing")));
    PENUMBRA_RETURN_IF_ERROR(FromRocks(rs, "job store: reading item spec"));
    SpecRecord r;
    Status s = Decode(key, value, &r);
    if (!s.ok()) return MarkDamaged(job, Damage(kSpecKind, job.id, item, s));
    return r;
  }

  // Writes the changed items and `rec` (with the counters moved by the
  // changes, and the job finished when nothing is left to run: completed,
  // or cancelled when cancelling, at finish_time) in one batch, then
  // updates memory. On failure nothing in memory changes.
  Status Apply(Job& job, JobRecord rec, const std::vector<ItemChange>& changes, int64_t finish_time,
               const std::string& what) {
    int64_t pending = static_cast<int64_t>(job.pending.size()), running = job.running;
    for (const ItemChange& c : changes) {
      const ItemState from = job.items[c.index].state, to = c.record.state;
      pending += (to == ItemState::kPending) - (from == ItemState::kPending);
      running += (to == ItemState::kRunning) - (from == ItemState::kRunning);
      rec.completed += (to == ItemState::kSucceeded) - (from == ItemState::kSucceeded);
      rec.failed += (to == ItemState::kFailed) - (from == ItemState::kFailed);
      rec.cancelled += (to == ItemState::kCancelled) - (from == ItemState::kCancelled);
    }
    if ((rec.status == JobStatus::kInProgress && pending == 0 && running == 0) ||
        (rec.status == JobStatus::kCancelling && running == 0)) {
      rec.status = rec.status == JobStatus::kInProgress ? JobStatus::kCompleted : JobStatus::kCancelled;
      rec.finished_at = finish_time;
    }
    rocksdb::WriteBatch batch;
    for (const ItemChange& c : changes) {
      const std::string key = ItemKey(kStateKind, job.id, c.index);
      batch.Put(key, Encode(key, c.record));
    }
    if (!(rec == job.rec)) {
      const std::string key = JobKey(kJobKind, job.id);
      batch.Put(key, Encode(key, rec));
    }
    if (batch.Count() == 0) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(Commit(&batch, what));
    for (const ItemChange& c : changes) {
      Item& item = job.items[c.index];
      if (item.state == ItemState::kPending) job.pending.erase(c.index);
      if (item.state == ItemState::kRunning) --job.running;
      item.state = c.record.state;
      item.attempt = c.record.attempt;
      if (item.state == ItemState::kPending) job.pending.insert(c.index);
      if (item.state == ItemState::kRunning) ++job.running;
    }
    CHECK_EQ(static_cast<int64_t>(job.pending.size()), pending);
    CHECK_EQ(static_cast<int64_t>(job.running), running);
    job.rec = std::move(rec);
    return Status::OK();
  }

  JobInfo Info(const Job& job) const {
    JobInfo i;
    i.id = job.id;
    i.tenant = job.rec.tenant;
    i.status = job.rec.status;
    i.created_at = job.rec.created_at;
    i.completion_window_s = job.rec.window_s;
    i.expires_at = job.rec.created_at + job.rec.window_s;
    i.finished_at = job.rec.finished_at;
    i.metadata = job.rec.metadata;
    i.counts.total = job.rec.items;
    i.counts.pending = static_cast<int64_t>(job.pending.size());
    i.counts.running = job.running;
    i.counts.completed = job.rec.completed;
    i.counts.failed = job.rec.failed;
    i.counts.cancelled = job.rec.cancelled;
    i.damage = job.damage;
    return i;
  }

  void Index(const Job& job) {
    by_seq[job.rec.seq] = job.id;
    by_tenant[job.rec.tenant][job.rec.seq] = job.id;
  }
  void Unindex(const Job& job) {
    if (!job.record_ok) return;
    by_seq.erase(job.rec.seq);
    auto t = by_tenant.find(job.rec.tenant);
    if (t == by_tenant.end()) return;
    t->second.erase(job.rec.seq);
    if (t->second.empty()) by_tenant.erase(t);
  }

  Status Load();
  Status Recover(Job& job);
};

// Reads every job and item state record, checks them (a failed check damages
// the job), then recovers what a crash left unfinished.
Status JobStore::Impl::Load() {
  {
    std::string value;
    rocksdb::Status rs = db()->Get(rocksdb::ReadOptions(), kStoreKey, &value);
    if (rs.IsNotFound()) {
      std::unique_ptr<rocksdb::Iterator> it(db()->NewIterator(rocksdb::ReadOptions()));
      it->SeekToFirst();
      PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "job store " + options.path));
      if (it->Valid()) {
        return Status::Corruption("job store " + options.path + ": holds records but not the store record");
      }
      std::random_device rd;
      store.salt = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                   static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
      store.next_seq = 1;
      rocksdb::WriteBatch batch;
      batch.Put(kStoreKey, Encode(store));
      PENUMBRA_RETURN_IF_ERROR(Commit(&batch, "creating the store record"));
    } else {
      PENUMBRA_RETURN_IF_ERROR(FromRocks(rs, "job store " + options.path));
      Status s = Decode(kStoreKey, value, &store);
      if (!s.ok()) {
        ++stats.corrupt_records;
        return Status::Corruption("job store " + options.path + ": store record: " + s.message());
      }
    }
  }
  // Jobs.
  std::unique_ptr<rocksdb::Iterator> it(db()->NewIterator(rocksdb::ReadOptions()));
  const std::string job_prefix(1, kJobKind);
  for (it->Seek(job_prefix); it->Valid() && it->key().starts_with(job_prefix); it->Next()) {
    const std::string key = it->key().ToString();
    Job job;
    job.id = key.substr(1);
    Status s = Decode(key, it->value().ToStringView(), &job.rec);
    uint64_t seq = 0;
    if (s.ok() && (!JobIdSeq(job.id, store.salt, &seq) || seq != job.rec.seq)) {
      s = Status::Corruption("sequence number " + std::to_string(job.rec.seq) + " does not match the id");
    }
    if (!s.ok()) {
      job.record_ok = false;
      (void)MarkDamaged(job, Damage(kJobKind, job.id, "", s));
      jobs.emplace(job.id, std::move(job));
      continue;
    }
    job.items.resize(job.rec.items);
    store.next_seq = std::max(store.next_seq, job.rec.seq + 1);
    Index(job);
    jobs.emplace(job.id, std::move(job));
  }
  PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "job store: reading jobs"));
  // Item states.
  std::map<std::string, std::vector<bool>> seen;
  const std::string state_prefix(1, kStateKind);
  for (it->Seek(state_prefix); it->Valid() && it->key().starts_with(state_prefix); it->Next()) {
    const std::string key = it->key().ToString();
    if (key.size() != 1 + kJobIdBytes + 4) {
      LOG(ERROR) << "job store: an item state key of " << key.size() << " bytes";
      ++stats.corrupt_records;
      continue;
    }
    const std::string job_id = key.substr(1, kJobIdBytes);
    const uint32_t index = GetBigEndian32(key.data() + 1 + kJobIdBytes);
    auto j = jobs.find(job_id);
    if (j == jobs.end()) {
      LOG(ERROR) << "job store: an item state record of job " << job_id << ", which has no job record";
      ++stats.corrupt_records;
      continue;
    }
    Job& job = j->second;
    if (!job.damage.empty()) continue;
    const std::string item = ", item " + std::to_string(index);
    ItemRecord r;
    Status s = Decode(key, it->value().ToStringView(), &r);
    if (s.ok() && index >= job.items.size()) {
      s = Status::Corruption("the job has " + std::to_string(job.items.size()) + " items");
    }
    if (!s.ok()) {
      (void)MarkDamaged(job, Damage(kStateKind, job_id, item, s));
      continue;
    }
    job.items[index] = {r.state, r.attempt};
    auto& flags = seen[job_id];
    flags.resize(job.items.size());
    flags[index] = true;
  }
  PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "job store: reading item states"));
  it.reset();
  // Each usable job: every item present, counters equal to a recount, a
  // final job with nothing unfinished.
  for (auto& [id, job] : jobs) {
    if (!job.damage.empty()) continue;
    auto& flags = seen[id];
    flags.resize(job.items.size());
    int64_t done[3] = {0, 0, 0};
    Status s;
    for (uint32_t i = 0; i < job.items.size() && s.ok(); ++i) {
      if (!flags[i]) {
        s = Damage(kStateKind, id, ", item " + std::to_string(i), Status::Corruption("missing"));
        break;
      }
      switch (job.items[i].state) {
        case ItemState::kPending:
          job.pending.insert(i);
          break;
        case ItemState::kRunning:
          ++job.running;
          break;
        case ItemState::kSucceeded:
          ++done[0];
          break;
        case ItemState::kFailed:
          ++done[1];
          break;
        case ItemState::kCancelled:
          ++done[2];
          break;
      }
    }
    if (s.ok() && (done[0] != job.rec.completed || done[1] != job.rec.failed || done[2] != job.rec.cancelled)) {
      s = Damage(
          kJobKind, id, "",
          Status::Corruption("counters (completed " + std::to_string(job.rec.completed) + ", failed " +
                             std::to_string(job.rec.failed) + ", cancelled " + std::to_string(job.rec.cancelled) +
                             ") differ from a recount of its items (" + std::to_string(done[0]) + ", " +
                             std::to_string(done[1]) + ", " + std::to_string(done[2]) + ")"));
    }
    if (s.ok() && IsFinal(job.rec.status) && (!job.pending.empty() || job.running > 0)) {
      s = Damage(kJobKind, id, "",
                 Status::Corruption(std::string(ToString(job.rec.status)) + " with " +
                                    std::to_string(job.pending.size() + job.running) + " unfinished items"));
    }
    if (!s.ok()) (void)MarkDamaged(job, s);
  }
  for (auto& [seq, id] : by_seq) {
    Job& job = jobs.at(id);
    if (job.damage.empty() && !IsFinal(job.rec.status)) PENUMBRA_RETURN_IF_ERROR(Recover(job));
  }
  return Status::OK();
}

// After a restart nothing runs: running items go back to pending (attempt
// kept), or to cancelled in a cancelling job; a job left validating or
// finalizing moves on.
Status JobStore::Impl::Recover(Job& job) {
  JobRecord rec = job.rec;
  if (rec.status == JobStatus::kValidating || rec.status == JobStatus::kFinalizing) rec.status = JobStatus::kInProgress;
  std::vector<ItemChange> changes;
  for (uint32_t i = 0; i < job.items.size(); ++i) {
    if (job.items[i].state != ItemState::kRunning) continue;
    PENUMBRA_ASSIGN_OR_RETURN(ItemRecord r, ReadItem(job, i));
    if (rec.status == JobStatus::kCancelling) {
      r.state = ItemState::kCancelled;
      r.result = CancelledResult();
    } else {
      r.state = ItemState::kPending;
    }
    changes.push_back({i, std::move(r)});
  }
  PENUMBRA_RETURN_IF_ERROR(Apply(job, std::move(rec), changes, Now(), "recovering job " + job.id));
  stats.recoveries += static_cast<int64_t>(changes.size());
  return Status::OK();
}

Status LoadJobStoreOptions(ConfigReader& r, JobStoreOptions* o) {
  r.Read("path", &o->path);
  r.Read("sync_writes", &o->sync_writes);
  r.Read("max_items_per_job", &o->max_items_per_job, 1, size_t{1} << 24);
  r.Read("max_question_bytes", &o->max_question_bytes, 1, size_t{1} << 30);
  r.Read("default_completion_window_s", &o->default_completion_window_s, 1, int64_t{366} * 86400);
  return r.Finish();
}

JobStore::JobStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JobStore::~JobStore() = default;

Result<std::unique_ptr<JobStore>> JobStore::Open(const JobStoreOptions& o) {
  if (o.path.empty()) return Status::InvalidArgument("job store: path is empty");
  if (o.max_items_per_job < 1) return Status::InvalidArgument("job store: max_items_per_job must be >= 1");
  if (o.max_question_bytes < 1) return Status::InvalidArgument("job store: max_question_bytes must be >= 1");
  if (o.default_completion_window_s < 1) {
    return Status::InvalidArgument("job store: default_completion_window_s must be >= 1, got " +
                                   std::to_string(o.default_completion_window_s));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  PENUMBRA_ASSIGN_OR_RETURN(impl->rdb, storage::RocksStoreDb::Open({"job store", o.path, 256, o.sync_writes}));
  PENUMBRA_RETURN_IF_ERROR(impl->Load());
  return std::unique_ptr<JobStore>(new JobStore(std::move(impl)));
}

Result<std::string> JobStore::Submit(const std::string& tenant, const JobSpec& spec) {
  Impl& m = *impl_;
  const JobStoreOptions& o = m.options;
  if (tenant.empty()) return Status::InvalidArgument("job store: tenant is empty");
  if (tenant.size() > kMaxTenantBytes) {
    return Status::InvalidArgument("job store: tenant is " + std::to_string(tenant.size()) + " bytes, at most " +
                                   std::to_string(kMaxTenantBytes));
  }
  if (spec.items.empty()) return Status::InvalidArgument("job store: the job has no items");
  if (spec.items.size() > o.max_items_per_job) {
    return Status::InvalidArgument("job store: the job has " + std::to_string(spec.items.size()) + " items, at most " +
                                   std::to_string(o.max_items_per_job) + " (max_items_per_job)");
  }
  if (spec.completion_window_s < 0) {
    return Status::InvalidArgument("job store: completion_window_s must be >= 0 (0: the default), got " +
                                   std::to_string(spec.completion_window_s));
  }
  std::unordered_map<std::string_view, size_t> first_with;
  for (size_t i = 0; i < spec.items.size(); ++i) {
    const JobItem& item = spec.items[i];
    const std::string where = "job store: item " + std::to_string(i);
    if (item.custom_id.empty()) return Status::InvalidArgument(where + ": custom_id is empty");
    const std::string named = where + " (custom_id " + Quoted(item.custom_id) + ")";
    if (item.custom_id.size() > kMaxCustomIdBytes) {
      return Status::InvalidArgument(named + ": custom_id is " + std::to_string(item.custom_id.size()) +
                                     " bytes, at most " + std::to_string(kMaxCustomIdBytes));
    }
    if (item.question.size() > o.max_question_bytes) {
      return Status::InvalidArgument(named + ": question is " + std::to_string(item.question.size()) +
                                     " bytes, at most " + std::to_string(o.max_question_bytes) +
                                     " (max_question_bytes)");
    }
    auto [at, inserted] = first_with.emplace(item.custom_id, i);
    if (!inserted) {
      return Status::InvalidArgument(named + ": custom_id is also item " + std::to_string(at->second) +
                                     "'s; custom_ids must be unique in a job");
    }
  }

  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Job job;
  job.rec.tenant = tenant;
  job.rec.seq = m.store.next_seq;
  job.rec.status = JobStatus::kInProgress;
  job.rec.created_at = m.Now();
  job.rec.window_s = spec.completion_window_s > 0 ? spec.completion_window_s : o.default_completion_window_s;
  job.rec.metadata = spec.metadata;
  job.rec.items = static_cast<uint32_t>(spec.items.size());
  job.id = MakeJobId(job.rec.seq, m.store.salt);
  CHECK(!m.jobs.count(job.id)) << "job id " << job.id << " repeated";

  StoreRecord store = m.store;
  ++store.next_seq;
  rocksdb::WriteBatch batch;
  batch.Put(kStoreKey, Encode(store));
  const std::string job_key = JobKey(kJobKind, job.id);
  batch.Put(job_key, Encode(job_key, job.rec));
  for (uint32_t i = 0; i < spec.items.size(); ++i) {
    const JobItem& item = spec.items[i];
    const std::string spec_key = ItemKey(kSpecKind, job.id, i);
    batch.Put(spec_key, Encode(spec_key, item));
    const std::string state_key = ItemKey(kStateKind, job.id, i);
    batch.Put(state_key, Encode(state_key, ItemRecord{item.custom_id, ItemState::kPending, 0, {}}));
    const std::string index_key = JobKey(kIndexKind, job.id) + item.custom_id;
    batch.Put(index_key, EncodeIndex(index_key, i));
  }
  PENUMBRA_RETURN_IF_ERROR(m.Commit(&batch, "submitting a job"));
  m.store = store;
  job.items.resize(spec.items.size());
  for (uint32_t i = 0; i < spec.items.size(); ++i) job.pending.insert(i);
  m.Index(job);
  std::string id = job.id;
  m.jobs.emplace(id, std::move(job));
  ++m.stats.submits;
  return id;
}

Result<std::vector<ItemLease>> JobStore::Claim(size_t max_items) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  std::vector<ItemLease> leases;
  // Per job: its changes, written together once every job is read.
  std::vector<std::pair<Impl::Job*, std::vector<Impl::ItemChange>>> plan;
  for (auto s = m.by_seq.begin(); s != m.by_seq.end() && leases.size() < max_items; ++s) {
    Impl::Job& job = m.jobs.at(s->second);
    if (!job.damage.empty() || job.rec.status != JobStatus::kInProgress || job.pending.empty()) continue;
    std::vector<ItemLease> mine;
    std::vector<Impl::ItemChange> changes;
    bool damaged = false;
    for (uint32_t index : job.pending) {
      if (leases.size() + mine.size() >= max_items) break;
      auto spec = m.ReadSpec(job, index);
      auto state = spec.ok() ? m.ReadItem(job, index) : Result<ItemRecord>(spec.status());
      if (state.ok() && state->custom_id != spec->custom_id) {
        (void)m.MarkDamaged(job,
                            m.Damage(kSpecKind, job.id, ", item " + std::to_string(index),
                                     Status::Corruption("custom_id " + Quoted(spec->custom_id) +
                                                        " differs from the item state's " + Quoted(state->custom_id))));
      }
      if (!job.damage.empty()) {
        damaged = true;
        break;
      }
      if (!state.ok()) return state.status();  // a RocksDB error, not damage
      ItemRecord r = std::move(state).value();
      r.state = ItemState::kRunning;
      ++r.attempt;
      ItemLease lease;
      lease.job_id = job.id;
      lease.tenant = job.rec.tenant;
      lease.item_index = index;
      lease.custom_id = r.custom_id;
      lease.attempt = r.attempt;
      lease.document_ids = std::move(spec->document_ids);
      lease.question = std::move(spec->question);
      lease.options = std::move(spec->options);
      mine.push_back(std::move(lease));
      changes.push_back({index, std::move(r)});
    }
    if (damaged) continue;
    for (auto& l : mine) leases.push_back(std::move(l));
    plan.emplace_back(&job, std::move(changes));
  }
  if (leases.empty()) return leases;
  // One batch for every job's leases.
  rocksdb::WriteBatch batch;
  for (const auto& [job, changes] : plan) {
    for (const auto& c : changes) {
      const std::string key = ItemKey(kStateKind, job->id, c.index);
      batch.Put(key, Encode(key, c.record));
    }
  }
  PENUMBRA_RETURN_IF_ERROR(m.Commit(&batch, "leasing items"));
  for (const auto& [job, changes] : plan) {
    for (const auto& c : changes) {
      job->pending.erase(c.index);
      ++job->running;
      job->items[c.index] = {ItemState::kRunning, c.record.attempt};
    }
  }
  m.stats.items_claimed += static_cast<int64_t>(leases.size());
  return leases;
}

Status JobStore::Complete(const std::string& job_id, uint32_t item_index, uint32_t attempt, const ItemResult& result) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  PENUMBRA_ASSIGN_OR_RETURN(Impl::Job * job, m.FindUsable(job_id, item_index));
  const Impl::Item& item = job->items[item_index];
  if (attempt == 0 || attempt > item.attempt) {
    return Status::InvalidArgument("job store: attempt " + std::to_string(attempt) + " of item " +
                                   std::to_string(item_index) + " of job " + job_id + " was never leased (" +
                                   std::to_string(item.attempt) + " leases so far)");
  }
  if (IsFinished(item.state)) {
    ++m.stats.duplicate_results_ignored;
    return Status::OK();
  }
  PENUMBRA_ASSIGN_OR_RETURN(ItemRecord r, m.ReadItem(*job, item_index));
  r.state = result.ok ? ItemState::kSucceeded : ItemState::kFailed;
  r.result = result;
  PENUMBRA_RETURN_IF_ERROR(m.Apply(*job, job->rec, {{item_index, std::move(r)}}, m.Now(), "recording a result"));
  ++m.stats.results_recorded;
  return Status::OK();
}

Status JobStore::Release(const std::string& job_id, uint32_t item_index, uint32_t attempt) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  PENUMBRA_ASSIGN_OR_RETURN(Impl::Job * job, m.FindUsable(job_id, item_index));
  const Impl::Item& item = job->items[item_index];
  if (item.state != ItemState::kRunning || item.attempt != attempt) {
    ++m.stats.stale_releases_ignored;
    return Status::OK();
  }
  PENUMBRA_ASSIGN_OR_RETURN(ItemRecord r, m.ReadItem(*job, item_index));
  if (job->rec.status == JobStatus::kCancelling) {
    r.state = ItemState::kCancelled;
    r.result = CancelledResult();
  } else {
    r.state = ItemState::kPending;
  }
  PENUMBRA_RETURN_IF_ERROR(m.Apply(*job, job->rec, {{item_index, std::move(r)}}, m.Now(), "releasing an item"));
  ++m.stats.releases;
  return Status::OK();
}

Status JobStore::Cancel(const std::string& tenant, const std::string& job_id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  PENUMBRA_ASSIGN_OR_RETURN(Impl::Job * job, m.Find(tenant, job_id));
  if (!job->damage.empty()) return Status::Corruption(job->damage);
  if (job->rec.status == JobStatus::kCancelling) return Status::OK();
  if (IsFinal(job->rec.status)) {
    return Status::FailedPrecondition("job store: job " + job_id + " is already " +
                                      std::string(ToString(job->rec.status)));
  }
  std::vector<Impl::ItemChange> changes;
  for (uint32_t index : job->pending) {
    PENUMBRA_ASSIGN_OR_RETURN(ItemRecord r, m.ReadItem(*job, index));
    r.state = ItemState::kCancelled;
    r.result = CancelledResult();
    changes.push_back({index, std::move(r)});
  }
  JobRecord rec = job->rec;
  rec.status = JobStatus::kCancelling;
  PENUMBRA_RETURN_IF_ERROR(m.Apply(*job, std::move(rec), changes, m.Now(), "cancelling a job"));
  ++m.stats.cancels;
  return Status::OK();
}

Status JobStore::ExpireDue(int64_t now) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  for (const auto& [seq, id] : m.by_seq) {
    Impl::Job& job = m.jobs.at(id);
    const JobStatus status = job.rec.status;
    if (!job.damage.empty() || IsFinal(status) || now < job.rec.created_at + job.rec.window_s) continue;
    JobRecord rec = job.rec;
    std::vector<Impl::ItemChange> changes;
    for (uint32_t i = 0; i < job.items.size() && job.damage.empty(); ++i) {
      const ItemState s = job.items[i].state;
      if (s != ItemState::kPending && s != ItemState::kRunning) continue;
      auto r = m.ReadItem(job, i);
      if (!r.ok()) {
        if (!job.damage.empty()) break;  // the job is left as it is
        return r.status();
      }
      if (status == JobStatus::kCancelling) {
        r->state = ItemState::kCancelled;
        r->result = CancelledResult();
      } else {
        r->state = ItemState::kFailed;
        r->result = ExpiredResult();
      }
      changes.push_back({i, std::move(r).value()});
    }
    if (!job.damage.empty()) continue;
    if (status != JobStatus::kCancelling) {
      rec.status = JobStatus::kExpired;
      rec.finished_at = now;
    }
    PENUMBRA_RETURN_IF_ERROR(m.Apply(job, std::move(rec), changes, now, "expiring job " + id));
    if (status != JobStatus::kCancelling) ++m.stats.jobs_expired;
  }
  return Status::OK();
}

Result<JobInfo> JobStore::Get(const std::string& tenant, const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  PENUMBRA_ASSIGN_OR_RETURN(Impl::Job * job, impl_->Find(tenant, job_id));
  if (!job->damage.empty()) return Status::Corruption(job->damage);
  return impl_->Info(*job);
}

Result<JobPage> JobStore::List(const std::string& tenant, const std::string& page_token, size_t page_size) const {
  const Impl& m = *impl_;
  if (page_size < 1 || page_size > kMaxPageSize) {
    return Status::InvalidArgument("job store: page_size must be in [1, " + std::to_string(kMaxPageSize) + "], got " +
                                   std::to_string(page_size));
  }
  std::lock_guard<std::mutex> lock(m.mu);
  uint64_t after = 0;
  if (!page_token.empty() && !JobIdSeq(page_token, m.store.salt, &after)) {
    return Status::InvalidArgument("job store: page_token " + Quoted(page_token) + " is not a job id");
  }
  JobPage page;
  auto t = m.by_tenant.find(tenant);
  if (t == m.by_tenant.end()) return page;
  auto it = page_token.empty() ? t->second.begin() : t->second.upper_bound(after);
  for (; it != t->second.end() && page.jobs.size() < page_size; ++it) {
    page.jobs.push_back(m.Info(m.jobs.at(it->second)));
  }
  if (it != t->second.end()) page.next_page_token = page.jobs.back().id;
  return page;
}

Result<ResultsPage> JobStore::Results(const std::string& tenant, const std::string& job_id,
                                      const std::string& after_custom_id, size_t page_size) {
  Impl& m = *impl_;
  if (page_size < 1 || page_size > kMaxPageSize) {
    return Status::InvalidArgument("job store: page_size must be in [1, " + std::to_string(kMaxPageSize) + "], got " +
                                   std::to_string(page_size));
  }
  std::lock_guard<std::mutex> lock(m.mu);
  PENUMBRA_ASSIGN_OR_RETURN(Impl::Job * job, m.Find(tenant, job_id));
  if (!job->damage.empty()) return Status::Corruption(job->damage);
  PENUMBRA_RETURN_IF_ERROR(m.Readable());
  ResultsPage page;
  const std::string prefix = JobKey(kIndexKind, job_id);
  std::unique_ptr<rocksdb::Iterator> it(m.db()->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(prefix + after_custom_id); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    const std::string key = it->key().ToString();
    const std::string custom_id = key.substr(prefix.size());
    if (!after_custom_id.empty() && custom_id == after_custom_id) continue;
    uint32_t index = 0;
    Status s = DecodeIndex(key, it->value().ToStringView(), &index);
    if (s.ok() && index >= job->items.size()) {
      s = Status::Corruption("item " + std::to_string(index) + " of " + std::to_string(job->items.size()));
    }
    if (!s.ok()) return m.MarkDamaged(*job, m.Damage(kIndexKind, job_id, ", custom_id " + Quoted(custom_id), s));
    if (!IsFinished(job->items[index].state)) continue;
    if (page.items.size() == page_size) {  // one more finished item: there is a next page
      page.next_after_custom_id = page.items.back().custom_id;
      break;
    }
    PENUMBRA_ASSIGN_OR_RETURN(ItemRecord r, m.ReadItem(*job, index));
    if (r.custom_id != custom_id) {
      return m.MarkDamaged(*job, m.Damage(kIndexKind, job_id, ", custom_id " + Quoted(custom_id),
                                          Status::Corruption("names item " + std::to_string(index) +
                                                             ", whose custom_id is " + Quoted(r.custom_id))));
    }
    page.items.push_back({custom_id, index, r.state, std::move(r.result)});
  }
  PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "job store: reading results"));
  return page;
}

Status JobStore::Delete(const std::string& tenant, const std::string& job_id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  PENUMBRA_ASSIGN_OR_RETURN(Impl::Job * job, m.Find(tenant, job_id));
  if (job->damage.empty() && !IsFinal(job->rec.status)) {
    return Status::FailedPrecondition("job store: job " + job_id + " is " + std::string(ToString(job->rec.status)) +
                                      "; only a finished job can be deleted (cancel it first)");
  }
  PENUMBRA_RETURN_IF_ERROR(m.rdb->Recover());
  PENUMBRA_RETURN_IF_ERROR(m.Readable());
  rocksdb::WriteBatch batch;
  batch.Delete(JobKey(kJobKind, job_id));
  std::unique_ptr<rocksdb::Iterator> it(m.db()->NewIterator(rocksdb::ReadOptions()));
  for (char kind : {kSpecKind, kStateKind, kIndexKind}) {
    const std::string prefix = JobKey(kind, job_id);
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) batch.Delete(it->key());
  }
  PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "job store: reading job " + job_id));
  it.reset();
  PENUMBRA_RETURN_IF_ERROR(m.Commit(&batch, "deleting job " + job_id));
  m.Unindex(*job);
  m.jobs.erase(job_id);
  ++m.stats.deletes;
  return Status::OK();
}

int64_t JobStore::Unfinished(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto t = impl_->by_tenant.find(tenant);
  if (t == impl_->by_tenant.end()) return 0;
  int64_t n = 0;
  for (const auto& [seq, id] : t->second) n += IsFinal(impl_->jobs.at(id).rec.status) ? 0 : 1;
  return n;
}

storage::WriteHealth JobStore::write_health() const { return impl_->rdb->health(); }

JobStoreStats JobStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

Status JobStore::CorruptRecordForTest(const std::string& job_id, RecordKind kind) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  PENUMBRA_RETURN_IF_ERROR(m.Readable());
  std::string key;
  switch (kind) {
    case RecordKind::kJob:
      key = JobKey(kJobKind, job_id);
      break;
    case RecordKind::kItemSpec:
      key = ItemKey(kSpecKind, job_id, 0);
      break;
    case RecordKind::kItemState:
      key = ItemKey(kStateKind, job_id, 0);
      break;
    case RecordKind::kCustomIdIndex: {
      const std::string prefix = JobKey(kIndexKind, job_id);
      std::unique_ptr<rocksdb::Iterator> it(m.db()->NewIterator(rocksdb::ReadOptions()));
      it->Seek(prefix);
      if (it->Valid() && it->key().starts_with(prefix)) key = it->key().ToString();
      PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "job store"));
      if (key.empty()) return Status::NotFound("job store: no custom-id index entry of job " + job_id);
      break;
    }
  }
  std::string value;
  PENUMBRA_RETURN_IF_ERROR(FromRocks(m.db()->Get(rocksdb::ReadOptions(), key, &value), "job store: test corruption"));
  value[value.size() / 2] ^= 0x40;
  rocksdb::WriteBatch batch;
  batch.Put(key, value);
  return m.Commit(&batch, "test corruption");
}

}  // namespace penumbra::jobs
