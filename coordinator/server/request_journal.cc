#include "coordinator/server/request_journal.h"

#include <filesystem>
#include <mutex>

#include <glog/logging.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "common/crypto.h"
#include "common/record.h"
#include "storage/rocksdb_status.h"
#include "storage/rocksdb_writer.h"

namespace penumbra::coordinator {
namespace {

// Keys: "o" the owner id, "r/<request id>" a generation, "u/<tenant>" usage.
constexpr uint32_t kRequestFormat = 1, kUsageFormat = 1, kOwnerFormat = 1;
const std::string kOwnerKey = "o";
std::string RequestKey(const std::string& id) { return "r/" + id; }
std::string UsageKey(const std::string& tenant) { return "u/" + tenant; }

std::string EncodeUsage(const std::string& tenant, const TenantUsage& u) {
  RecordWriter w(kUsageFormat);
  w.I64(u.requests).I64(u.failed).I64(u.prompt).I64(u.cached).I64(u.generated);
  return w.Seal(UsageKey(tenant));
}

Status DecodeUsage(const std::string& key, const std::string& value, TenantUsage* u) {
  std::string_view fields;
  PENUMBRA_RETURN_IF_ERROR(UnsealRecord(key, value, kUsageFormat, &fields));
  RecordReader r(fields);
  if (!r.I64(&u->requests) || !r.I64(&u->failed) || !r.I64(&u->prompt) || !r.I64(&u->cached) || !r.I64(&u->generated) ||
      !r.done()) {
    return Status::Corruption("usage record: fields do not parse");
  }
  return Status::OK();
}

}  // namespace

struct RequestJournal::Db {
  std::string path;
  rocksdb::Options options;
  std::unique_ptr<rocksdb::DB> db;  // null only after a reopen that failed (writes then fail Unavailable)
  std::unique_ptr<storage::RocksWriter> writer;
  std::mutex mu;  // orders writes (RocksWriter's contract)
  ~Db() {
    if (db) (void)db->Close();
  }
  // RocksWriter's reopen (called with mu held, from Write).
  Result<rocksdb::DB*> Reopen() {
    if (db) (void)db->Close();
    db.reset();
    rocksdb::DB* fresh = nullptr;
    PENUMBRA_RETURN_IF_ERROR(
        storage::FromRocks(rocksdb::DB::Open(options, path, &fresh), "request journal " + path + ": reopen"));
    db.reset(fresh);
    return fresh;
  }
};

RequestJournal::~RequestJournal() = default;

std::string RequestJournal::Encode(const JournalRecord& r) {
  RecordWriter w(kRequestFormat);
  w.Str(r.request_id).Str(r.tenant).Str(r.worker).Str(r.handle).U8(r.job_item ? 1 : 0);
  w.Strs(r.document_ids).Str(r.cache_namespace).I32s(r.question);
  w.U32(static_cast<uint32_t>(r.max_new_tokens));
  w.F64(r.sampling.temperature).F64(r.sampling.top_p).U32(static_cast<uint32_t>(r.sampling.top_k)).I64(r.sampling.seed);
  w.I32s(r.stop_ids).Strs(r.stop).Str(r.kv_policy).F64(r.share_weight).I64(r.draws_done);
  w.I32s(r.made_before).U32(static_cast<uint32_t>(r.resumes)).I64(r.created_unix_ms).I64(r.deadline_unix_ms);
  return w.Seal(RequestKey(r.request_id));
}

Status RequestJournal::Decode(const std::string& key, const std::string& value, JournalRecord* r) {
  std::string_view fields;
  PENUMBRA_RETURN_IF_ERROR(UnsealRecord(key, value, kRequestFormat, &fields));
  RecordReader in(fields);
  uint8_t job = 0;
  uint32_t max_new = 0, top_k = 0, resumes = 0;
  const bool ok = in.Str(&r->request_id) && in.Str(&r->tenant) && in.Str(&r->worker) && in.Str(&r->handle) &&
                  in.U8(&job) && in.Strs(&r->document_ids) && in.Str(&r->cache_namespace) && in.I32s(&r->question) &&
                  in.U32(&max_new) && in.F64(&r->sampling.temperature) && in.F64(&r->sampling.top_p) &&
                  in.U32(&top_k) && in.I64(&r->sampling.seed) && in.I32s(&r->stop_ids) && in.Strs(&r->stop) &&
                  in.Str(&r->kv_policy) && in.F64(&r->share_weight) && in.I64(&r->draws_done) &&
                  in.I32s(&r->made_before) && in.U32(&resumes) && in.I64(&r->created_unix_ms) &&
                  in.I64(&r->deadline_unix_ms) && in.done();
  if (!ok) return Status::Corruption("request record: fields do not parse");
  if (key != RequestKey(r->request_id)) return Status::Corruption("request record: stored under another id");
  r->job_item = job != 0;
  r->max_new_tokens = static_cast<int32_t>(max_new);
  r->sampling.top_k = static_cast<int32_t>(top_k);
  r->resumes = static_cast<int32_t>(resumes);
  if (r->max_new_tokens < 0 || r->draws_done < 0 || r->resumes < 0) {
    return Status::Corruption("request record: negative counts");
  }
  return Status::OK();
}

Result<std::unique_ptr<RequestJournal>> RequestJournal::Open(const std::string& path) {
  if (path.empty()) return Status::InvalidArgument("request journal: path is empty");
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return Status::IOError("request journal " + path + ": cannot create the directory: " + ec.message());
  auto j = std::unique_ptr<RequestJournal>(new RequestJournal());
  j->path_ = path;
  j->db_ = std::make_unique<Db>();
  j->db_->path = path;
  j->db_->writer = std::make_unique<storage::RocksWriter>("request journal", path);
  rocksdb::Options& o = j->db_->options;
  j->db_->writer->Configure(&o);  // a full disk must not abort us (storage/rocksdb_writer.h)
  o.create_if_missing = true;
  o.paranoid_checks = true;
  o.max_open_files = 64;
  rocksdb::DB* db = nullptr;
  PENUMBRA_RETURN_IF_ERROR(storage::FromRocks(rocksdb::DB::Open(o, path, &db), "request journal " + path + ": open"));
  j->db_->db.reset(db);
  j->db_->writer->Attach(db, [d = j->db_.get()] { return d->Reopen(); });
  std::vector<std::string> damaged;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string key = it->key().ToString(), value = it->value().ToString();
    Status s;
    if (key == kOwnerKey) {
      std::string_view fields;
      s = UnsealRecord(key, value, kOwnerFormat, &fields);
      RecordReader r(fields);
      if (s.ok() && (!r.Str(&j->owner_id_) || !r.done() || j->owner_id_.empty())) {
        s = Status::Corruption("owner record: fields do not parse");
      }
    } else if (key.rfind("r/", 0) == 0) {
      JournalRecord rec;
      s = Decode(key, value, &rec);
      if (s.ok()) j->records_.push_back(std::move(rec));
    } else if (key.rfind("u/", 0) == 0) {
      TenantUsage u;
      s = DecodeUsage(key, value, &u);
      if (s.ok()) j->usage_[key.substr(2)] = u;
    } else {
      s = Status::Corruption("unknown key");
    }
    if (!s.ok()) {
      LOG(ERROR) << "request journal " << path << ": record of " << key.size() << "-byte key '" << key.substr(0, 40)
                 << "' skipped: " << s.message();
      ++j->corrupt_records_;
      damaged.push_back(key);
    }
  }
  PENUMBRA_RETURN_IF_ERROR(storage::FromRocks(it->status(), "request journal " + path + ": read"));
  it.reset();
  std::vector<std::pair<std::string, const std::string*>> changes;
  for (const std::string& k : damaged) changes.emplace_back(k, nullptr);
  std::string owner_value;
  if (j->owner_id_.empty()) {
    // The owner id: 128 random bits, kept for every later start on this directory.
    j->owner_id_ = "c-" + RandomHandle();
    RecordWriter w(kOwnerFormat);
    w.Str(j->owner_id_);
    owner_value = w.Seal(kOwnerKey);
    changes.emplace_back(kOwnerKey, &owner_value);
  }
  if (!changes.empty()) PENUMBRA_RETURN_IF_ERROR(j->Write(changes, "store the owner id"));
  LOG(INFO) << "request journal " << path << ": owner " << j->owner_id_ << ", " << j->records_.size()
            << " generations, usage of " << j->usage_.size() << " tenants"
            << (j->corrupt_records_ ? ", " + std::to_string(j->corrupt_records_) + " damaged records dropped"
                                    : std::string());
  return j;
}

Status RequestJournal::Write(const std::vector<std::pair<std::string, const std::string*>>& changes,
                             const std::string& what) {
  rocksdb::WriteBatch batch;
  for (const auto& [key, value] : changes) {
    rocksdb::Status s = value ? batch.Put(key, *value) : batch.Delete(key);
    if (!s.ok()) return storage::FromRocks(s, "request journal " + path_ + ": " + what);
  }
  std::lock_guard<std::mutex> lk(db_->mu);
  return db_->writer->Write("request journal: " + what, [&] {
    rocksdb::WriteOptions w;
    w.sync = true;
    return db_->db->Write(w, &batch);
  });
}

storage::WriteHealth RequestJournal::write_health() const { return db_->writer->health(); }

Status RequestJournal::Start(const JournalRecord& r, const TenantUsage& usage) {
  const std::string rec = Encode(r), use = EncodeUsage(r.tenant, usage);
  return Write({{RequestKey(r.request_id), &rec}, {UsageKey(r.tenant), &use}}, "journal request " + r.request_id);
}

Status RequestJournal::Put(const JournalRecord& r) {
  const std::string rec = Encode(r);
  return Write({{RequestKey(r.request_id), &rec}}, "rewrite request " + r.request_id);
}

Status RequestJournal::Finish(const std::string& request_id, const std::string& tenant, const TenantUsage& usage) {
  const std::string use = EncodeUsage(tenant, usage);
  return Write({{RequestKey(request_id), nullptr}, {UsageKey(tenant), &use}}, "end request " + request_id);
}

Status RequestJournal::Remove(const std::string& request_id) {
  return Write({{RequestKey(request_id), nullptr}}, "drop request " + request_id);
}

}  // namespace penumbra::coordinator
