#include "coordinator/jobs/file_store.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <random>

#include <glog/logging.h>
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
// m                          the store's record: the id salt and the next sequence number
// f<file id>                 a file's record (tenant, name, purpose, bytes, time, chunks, content hash)
// d<file id><chunk, BE32>    a chunk of its content
constexpr std::string_view kStoreKey = "m";
constexpr char kFileKind = 'f';
constexpr char kChunkKind = 'd';
constexpr std::string_view kFileIdPrefix = "file-";
constexpr size_t kMaxListLimit = 10000;

std::string FileKey(const std::string& id) { return std::string(1, kFileKind) + id; }
std::string ChunkKey(const std::string& id, uint32_t chunk) {
  std::string k = std::string(1, kChunkKind) + id;
  PutBigEndian32(&k, chunk);
  return k;
}

RecordWriter Writer() { return RecordWriter(FileStore::kFormatVersion); }
Status Truncated() { return Status::Corruption("malformed fields"); }

struct StoreRecord {
  uint64_t salt = 0;
  uint64_t next_seq = 1;
};
std::string Encode(const StoreRecord& r) { return Writer().U64(r.salt).U64(r.next_seq).Seal(kStoreKey); }
Status Decode(std::string_view key, std::string_view value, StoreRecord* r) {
  std::string_view f;
  PENUMBRA_RETURN_IF_ERROR(UnsealRecord(key, value, FileStore::kFormatVersion, &f));
  RecordReader in(f);
  if (!in.U64(&r->salt) || !in.U64(&r->next_seq) || !in.done()) return Truncated();
  return Status::OK();
}

struct FileRecord {
  std::string tenant, filename, purpose;
  uint64_t seq = 0;
  int64_t bytes = 0;
  int64_t created_at = 0;
  uint32_t chunks = 0;
  uint64_t content_hash = 0;
};
std::string Encode(const std::string& key, const FileRecord& r) {
  return Writer()
      .Str(r.tenant)
      .Str(r.filename)
      .Str(r.purpose)
      .U64(r.seq)
      .I64(r.bytes)
      .I64(r.created_at)
      .U32(r.chunks)
      .U64(r.content_hash)
      .Seal(key);
}
Status Decode(std::string_view key, std::string_view value, FileRecord* r) {
  std::string_view f;
  PENUMBRA_RETURN_IF_ERROR(UnsealRecord(key, value, FileStore::kFormatVersion, &f));
  RecordReader in(f);
  if (!in.Str(&r->tenant) || !in.Str(&r->filename) || !in.Str(&r->purpose) || !in.U64(&r->seq) || !in.I64(&r->bytes) ||
      !in.I64(&r->created_at) || !in.U32(&r->chunks) || !in.U64(&r->content_hash) || !in.done()) {
    return Truncated();
  }
  const uint64_t want_chunks = (static_cast<uint64_t>(r->bytes) + FileStore::kChunkBytes - 1) / FileStore::kChunkBytes;
  if (r->bytes < 0 || r->chunks != want_chunks) return Status::Corruption("chunk count does not match the size");
  return Status::OK();
}

}  // namespace

Status LoadFileStoreOptions(ConfigReader& r, FileStoreOptions* o) {
  r.Read("path", &o->path);
  r.Read("sync_writes", &o->sync_writes);
  r.Read("max_file_bytes", &o->max_file_bytes, 1, int64_t{1} << 40);
  r.Read("max_bytes_per_tenant", &o->max_bytes_per_tenant, 1, int64_t{1} << 50);
  r.Read("max_files_per_tenant", &o->max_files_per_tenant, 1, int64_t{1} << 30);
  return r.Finish();
}

struct FileStore::Impl {
  struct File {
    FileRecord rec;
    std::string damage;  // non-empty: unusable (Corruption); rec.tenant unknown when the record itself is damaged
    bool record_ok = true;
  };
  struct TenantUse {
    int64_t files = 0, bytes = 0;
  };

  FileStoreOptions options;
  std::unique_ptr<storage::RocksStoreDb> rdb;  // every write through its RocksWriter
  mutable std::mutex mu;
  StoreRecord store;
  std::map<std::string, File> files;
  std::map<std::string, std::map<uint64_t, std::string>> by_tenant;  // seq -> id, readable records only
  std::map<std::string, TenantUse> use;
  FileStoreStats stats;

  int64_t Now() const { return options.clock ? options.clock() : WallClockSeconds(); }
  rocksdb::DB* db() const { return rdb->db(); }
  Status Commit(rocksdb::WriteBatch* batch, const std::string& what) { return rdb->Commit(batch, what); }
  Status Readable() const { return rdb->Readable(); }
  Status Damaged(const std::string& id, const std::string& what, const Status& why) {
    Status s = Status::Corruption("file store: " + what + " of file " + id + ": " + why.message());
    LOG(ERROR) << s;
    ++stats.corrupt_records;
    return s;
  }
  Result<const File*> Find(const std::string& tenant, const std::string& id) const {
    auto it = files.find(id);
    if (it == files.end()) return Status::NotFound("file " + id + " not found");
    if (!it->second.record_ok) return Status::Corruption(it->second.damage);
    if (it->second.rec.tenant != tenant) return Status::NotFound("file " + id + " not found");
    if (!it->second.damage.empty()) return Status::Corruption(it->second.damage);
    return &it->second;
  }
  FileInfo Info(const std::string& id, const File& f) const {
    FileInfo i;
    i.id = id;
    i.tenant = f.rec.tenant;
    i.filename = f.rec.filename;
    i.purpose = f.rec.purpose;
    i.bytes = f.rec.bytes;
    i.created_at = f.rec.created_at;
    i.damage = f.damage;
    return i;
  }
  void Index(const std::string& id, const File& f) {
    by_tenant[f.rec.tenant][f.rec.seq] = id;
    TenantUse& u = use[f.rec.tenant];
    ++u.files;
    u.bytes += f.rec.bytes;
    ++stats.files;
    stats.bytes += f.rec.bytes;
  }
  Status Load();
};

Status FileStore::Impl::Load() {
  std::string value;
  rocksdb::Status rs = db()->Get(rocksdb::ReadOptions(), kStoreKey, &value);
  if (rs.IsNotFound()) {
    std::unique_ptr<rocksdb::Iterator> it(db()->NewIterator(rocksdb::ReadOptions()));
    it->SeekToFirst();
    PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "file store " + options.path));
    if (it->Valid())
      return Status::Corruption("file store " + options.path + ": holds records but not the store record");
    std::random_device rd;
    store.salt = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                 static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    rocksdb::WriteBatch batch;
    batch.Put(kStoreKey, Encode(store));
    return Commit(&batch, "creating the store record");
  }
  PENUMBRA_RETURN_IF_ERROR(FromRocks(rs, "file store " + options.path));
  if (Status s = Decode(kStoreKey, value, &store); !s.ok()) {
    ++stats.corrupt_records;
    return Status::Corruption("file store " + options.path + ": store record: " + s.message());
  }
  std::unique_ptr<rocksdb::Iterator> it(db()->NewIterator(rocksdb::ReadOptions()));
  const std::string prefix(1, kFileKind);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    const std::string key = it->key().ToString();
    const std::string id = key.substr(1);
    File f;
    Status s = Decode(key, it->value().ToStringView(), &f.rec);
    uint64_t seq = 0;
    if (s.ok() && (!StoreIdSeq(kFileIdPrefix, id, store.salt, &seq) || seq != f.rec.seq)) {
      s = Status::Corruption("sequence number " + std::to_string(f.rec.seq) + " does not match the id");
    }
    if (!s.ok()) {
      f.record_ok = false;
      f.damage = Damaged(id, "record", s).message();
      files.emplace(id, std::move(f));
      continue;
    }
    store.next_seq = std::max(store.next_seq, f.rec.seq + 1);
    Index(id, f);
    files.emplace(id, std::move(f));
  }
  return FromRocks(it->status(), "file store: reading files");
}

FileStore::FileStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FileStore::~FileStore() = default;

Result<std::unique_ptr<FileStore>> FileStore::Open(const FileStoreOptions& o) {
  if (o.path.empty()) return Status::InvalidArgument("file store: path is empty");
  if (o.max_file_bytes < 1 || o.max_bytes_per_tenant < 1 || o.max_files_per_tenant < 1) {
    return Status::InvalidArgument(
        "file store: max_file_bytes, max_bytes_per_tenant and max_files_per_tenant must be >= 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  PENUMBRA_ASSIGN_OR_RETURN(impl->rdb, storage::RocksStoreDb::Open({"file store", o.path, 256, o.sync_writes}));
  PENUMBRA_RETURN_IF_ERROR(impl->Load());
  return std::unique_ptr<FileStore>(new FileStore(std::move(impl)));
}

Result<FileInfo> FileStore::Put(const std::string& tenant, const std::string& filename, const std::string& purpose,
                                std::string_view content) {
  Impl& m = *impl_;
  if (tenant.empty() || tenant.size() > 256)
    return Status::InvalidArgument("file store: the tenant must be 1..256 bytes");
  if (filename.empty() || filename.size() > kMaxFilenameBytes) {
    return Status::InvalidArgument("the file's name must be 1.." + std::to_string(kMaxFilenameBytes) + " bytes, got " +
                                   std::to_string(filename.size()));
  }
  if (purpose.empty() || purpose.size() > kMaxPurposeBytes) {
    return Status::InvalidArgument("the file's purpose must be 1.." + std::to_string(kMaxPurposeBytes) + " bytes");
  }
  const int64_t bytes = static_cast<int64_t>(content.size());
  if (bytes > m.options.max_file_bytes) {
    return Status::InvalidArgument("the file is " + std::to_string(bytes) + " bytes, more than the " +
                                   std::to_string(m.options.max_file_bytes) + " a file may hold (max_file_bytes)");
  }
  std::lock_guard<std::mutex> lk(m.mu);
  PENUMBRA_RETURN_IF_ERROR(m.Readable());
  const Impl::TenantUse u = m.use[tenant];
  if (u.files + 1 > m.options.max_files_per_tenant) {
    return Status::ResourceExhausted("tenant '" + tenant + "' keeps " + std::to_string(u.files) +
                                     " files, its limit (max_files_per_tenant): delete some first");
  }
  if (u.bytes + bytes > m.options.max_bytes_per_tenant) {
    return Status::ResourceExhausted("tenant '" + tenant + "' keeps " + std::to_string(u.bytes) + " bytes of files; " +
                                     std::to_string(bytes) + " more passes its limit of " +
                                     std::to_string(m.options.max_bytes_per_tenant) +
                                     " (max_bytes_per_tenant): delete some first");
  }
  Impl::File f;
  f.rec.tenant = tenant;
  f.rec.filename = filename;
  f.rec.purpose = purpose;
  f.rec.seq = m.store.next_seq;
  f.rec.bytes = bytes;
  f.rec.created_at = m.Now();
  f.rec.chunks = static_cast<uint32_t>((content.size() + kChunkBytes - 1) / kChunkBytes);
  f.rec.content_hash = Hash64(content);
  const std::string id = MakeStoreId(kFileIdPrefix, f.rec.seq, m.store.salt);
  StoreRecord next = m.store;
  next.next_seq = f.rec.seq + 1;
  rocksdb::WriteBatch batch;
  batch.Put(kStoreKey, Encode(next));
  batch.Put(FileKey(id), Encode(FileKey(id), f.rec));
  for (uint32_t c = 0; c < f.rec.chunks; ++c) {
    const std::string key = ChunkKey(id, c);
    RecordWriter w = Writer();
    w.Str(content.substr(size_t{c} * kChunkBytes, kChunkBytes));
    batch.Put(key, w.Seal(key));
  }
  PENUMBRA_RETURN_IF_ERROR(m.Commit(&batch, "storing file " + id));
  m.store = next;
  m.Index(id, f);
  ++m.stats.puts;
  auto [it, inserted] = m.files.emplace(id, std::move(f));
  return m.Info(id, it->second);
}

Result<FileInfo> FileStore::Get(const std::string& tenant, const std::string& id) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  PENUMBRA_ASSIGN_OR_RETURN(const Impl::File* f, m.Find(tenant, id));
  return m.Info(id, *f);
}

Result<std::string> FileStore::Content(const std::string& tenant, const std::string& id) const {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);  // held through the reads: a reopen after a failed write replaces db
  PENUMBRA_RETURN_IF_ERROR(m.Readable());
  PENUMBRA_ASSIGN_OR_RETURN(const Impl::File* f, m.Find(tenant, id));
  const FileRecord rec = f->rec;
  std::string out;
  out.reserve(static_cast<size_t>(rec.bytes));
  Status bad;
  for (uint32_t c = 0; c < rec.chunks && bad.ok(); ++c) {
    const std::string key = ChunkKey(id, c);
    std::string value;
    rocksdb::Status rs = m.db()->Get(rocksdb::ReadOptions(), key, &value);
    if (rs.IsNotFound()) {
      bad = Status::Corruption("chunk " + std::to_string(c) + " is missing");
      break;
    }
    PENUMBRA_RETURN_IF_ERROR(FromRocks(rs, "file store: reading file " + id));
    std::string_view fields;
    std::string chunk;
    bad = UnsealRecord(key, value, kFormatVersion, &fields);
    if (bad.ok()) {
      RecordReader in(fields);
      if (!in.Str(&chunk) || !in.done()) bad = Truncated();
    }
    if (bad.ok()) out += chunk;
    if (!bad.ok()) bad = Status::Corruption("chunk " + std::to_string(c) + ": " + bad.message());
  }
  if (bad.ok() && (static_cast<int64_t>(out.size()) != rec.bytes || Hash64(out) != rec.content_hash)) {
    bad = Status::Corruption("the content does not match its size and hash");
  }
  if (!bad.ok()) {
    Status s = m.Damaged(id, "content", bad);
    auto it = m.files.find(id);
    if (it != m.files.end() && it->second.damage.empty()) it->second.damage = s.message();
    return s;
  }
  return out;
}

Result<FilePage> FileStore::List(const std::string& tenant, const std::string& after, size_t limit,
                                 const std::string& purpose) const {
  const Impl& m = *impl_;
  if (limit < 1 || limit > kMaxListLimit) {
    return Status::InvalidArgument("limit must be in [1, " + std::to_string(kMaxListLimit) + "], got " +
                                   std::to_string(limit));
  }
  uint64_t after_seq = 0;
  if (!after.empty() && !StoreIdSeq(kFileIdPrefix, after, m.store.salt, &after_seq)) {
    return Status::InvalidArgument("'after' is not a file id of this service: '" + after.substr(0, 64) + "'");
  }
  std::lock_guard<std::mutex> lk(m.mu);
  FilePage page;
  auto t = m.by_tenant.find(tenant);
  if (t == m.by_tenant.end()) return page;
  for (auto it = t->second.upper_bound(after_seq); it != t->second.end(); ++it) {
    const Impl::File& f = m.files.at(it->second);
    if (!purpose.empty() && f.rec.purpose != purpose) continue;
    if (page.files.size() == limit) {
      page.has_more = true;
      break;
    }
    page.files.push_back(m.Info(it->second, f));
  }
  return page;
}

Status FileStore::Delete(const std::string& tenant, const std::string& id) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  PENUMBRA_RETURN_IF_ERROR(m.Readable());
  auto it = m.files.find(id);
  if (it == m.files.end() || (it->second.record_ok && it->second.rec.tenant != tenant)) {
    return Status::NotFound("file " + id + " not found");
  }
  if (!it->second.record_ok) return Status::Corruption(it->second.damage);
  rocksdb::WriteBatch batch;
  batch.Delete(FileKey(id));
  batch.DeleteRange(ChunkKey(id, 0), ChunkKey(id, it->second.rec.chunks));
  PENUMBRA_RETURN_IF_ERROR(m.Commit(&batch, "deleting file " + id));
  const FileRecord& r = it->second.rec;
  m.by_tenant[r.tenant].erase(r.seq);
  Impl::TenantUse& u = m.use[r.tenant];
  --u.files;
  u.bytes -= r.bytes;
  --m.stats.files;
  m.stats.bytes -= r.bytes;
  ++m.stats.deletes;
  m.files.erase(it);
  return Status::OK();
}

FileStoreStats FileStore::stats() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->stats;
}

storage::WriteHealth FileStore::write_health() const { return impl_->rdb->health(); }

Status FileStore::CorruptForTest(const std::string& id, bool record) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  const std::string key = record ? FileKey(id) : ChunkKey(id, 0);
  std::string value;
  PENUMBRA_RETURN_IF_ERROR(FromRocks(m.db()->Get(rocksdb::ReadOptions(), key, &value), "file store: " + id));
  value[value.size() / 2] ^= 0x5a;
  return FromRocks(m.db()->Put(rocksdb::WriteOptions(), key, value), "file store: " + id);
}

}  // namespace penumbra::jobs
