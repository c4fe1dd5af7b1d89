#include "coordinator/server/document_registry.h"

#include <bit>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>

#include <glog/logging.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include "common/crypto.h"
#include "common/hash.h"
#include "common/record.h"

namespace penumbra::coordinator {
namespace {

// Ids are "doc-" and 16 hex digits: 64 bits from the CSPRNG (not guessable
// from other ids; a document is found only by its tenant or a tenant it is
// published to, so they are not capabilities). The format is the stored
// one; the caller still checks that an id is free.
std::string NewId() { return "doc-" + HexOf(RandomBytes(8)); }

bool WellFormedId(std::string_view id) {
  if (id.size() != 20 || id.substr(0, 4) != "doc-") return false;
  return id.find_first_not_of("0123456789abcdef", 4) == std::string_view::npos;
}

// ---- records -------------------------------------------------------------------
// Key: 'd' and the document id. Value, numbers little-endian:
//   u32 format version
//   tenant, name (each u32 length, bytes)
//   i64 tokens, i64 leading_special, i64 created_unix_ms, f64 factor_seconds
//   u32 n, n x i32 token ids (n == tokens)
//   u64 checksum: Hash64 of everything before it, seeded with Hash64(key),
//       so a value read under another key fails too.
constexpr uint32_t kFormatVersion = 1;
constexpr char kDocumentKind = 'd';

std::string DocumentKey(const std::string& id) { return std::string(1, kDocumentKind) + id; }

std::string Encode(const std::string& key, const DocumentView& d) {
  const std::vector<int32_t>& ids = *d.ids;
  RecordWriter w(kFormatVersion);
  w.Reserve(64 + d.tenant.size() + d.name.size() + 4 * ids.size());
  w.Str(d.tenant).Str(d.name).I64(d.tokens).I64(d.leading_special).I64(d.created_unix_ms).F64(d.factor_seconds);
  w.I32s(ids);
  return w.Seal(key);
}

// A stored document (READY, no worker), or Corruption saying which check failed.
Status Decode(std::string_view key, std::string_view value, DocumentView* d) {
  if (key.empty() || key[0] != kDocumentKind || !WellFormedId(key.substr(1))) {
    return Status::Corruption("not a document key");
  }
  std::string_view fields;
  PENUMBRA_RETURN_IF_ERROR(UnsealRecord(key, value, kFormatVersion, &fields));
  RecordReader in(fields);
  auto ids = std::make_shared<std::vector<int32_t>>();
  if (!in.Str(&d->tenant) || !in.Str(&d->name) || !in.I64(&d->tokens) || !in.I64(&d->leading_special) ||
      !in.I64(&d->created_unix_ms) || !in.F64(&d->factor_seconds) || !in.I32s(ids.get()) || !in.done()) {
    return Status::Corruption("malformed fields");
  }
  if (d->tokens != static_cast<int64_t>(ids->size())) {
    return Status::Corruption(std::to_string(d->tokens) + " tokens but " + std::to_string(ids->size()) + " token ids");
  }
  if (d->leading_special < 0 || d->leading_special > d->tokens) {
    return Status::Corruption("leading_special " + std::to_string(d->leading_special) + " of " +
                              std::to_string(d->tokens) + " tokens");
  }
  d->id = std::string(key.substr(1));
  d->state = DocumentState::kReady;
  d->factored_tokens = d->tokens;
  d->ids = std::move(ids);
  return Status::OK();
}

// A key for a log line: printable, cut short.
std::string Printable(std::string_view key) {
  std::string s;
  for (char c : key.substr(0, 64)) s.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  return "'" + s + (key.size() > 64 ? "...'" : "'");
}

}  // namespace

struct DocumentRegistry::Store {
  std::string path;
  std::unique_ptr<rocksdb::DB> db;

  ~Store() {
    if (db) (void)db->Close();
  }
};

DocumentRegistry::DocumentRegistry(int64_t max_documents_per_tenant) : max_per_tenant_(max_documents_per_tenant) {}

DocumentRegistry::~DocumentRegistry() = default;

Result<std::unique_ptr<DocumentRegistry>> DocumentRegistry::Open(const std::string& path,
                                                                 int64_t max_documents_per_tenant) {
  if (path.empty()) return Status::InvalidArgument("document registry: path is empty");
  std::error_code ec;
  std::filesystem::create_directories(path, ec);  // RocksDB creates the last level only
  if (ec) return Status::IOError("document registry " + path + ": cannot create the directory: " + ec.message());
  auto store = std::make_unique<Store>();
  store->path = path;
  rocksdb::Options o;
  o.create_if_missing = true;
  o.paranoid_checks = true;  // refuse to open over detected corruption rather than drop data silently
  o.max_open_files = 64;
  rocksdb::DB* db = nullptr;
  rocksdb::Status rs = rocksdb::DB::Open(o, path, &db);
  if (!rs.ok()) return Status::IOError("document registry " + path + ": cannot open RocksDB: " + rs.ToString());
  store->db.reset(db);
  auto reg = std::make_unique<DocumentRegistry>(max_documents_per_tenant);
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string_view key = it->key().ToStringView();
    DocumentView d;
    Status s = Decode(key, it->value().ToStringView(), &d);
    if (!s.ok()) {
      LOG(ERROR) << "document registry " << path << ": record " << Printable(key) << " skipped: " << s.message();
      ++reg->corrupt_records_;
      if (!key.empty() && WellFormedId(key.substr(1))) reg->stale_ids_.insert(std::string(key.substr(1)));
      continue;
    }
    ++reg->per_tenant_[d.tenant];
    std::string id = d.id;
    reg->docs_.emplace(std::move(id), std::move(d));
  }
  rs = it->status();
  if (!rs.ok()) return Status::IOError("document registry " + path + ": reading records: " + rs.ToString());
  it.reset();
  LOG(INFO) << "document registry " << path << ": " << reg->docs_.size() << " documents"
            << (reg->corrupt_records_ ? ", " + std::to_string(reg->corrupt_records_) + " damaged records skipped"
                                      : std::string());
  reg->store_ = std::move(store);
  return reg;
}

std::unique_lock<std::mutex> DocumentRegistry::LockWrites() {
  return store_ ? std::unique_lock<std::mutex>(write_mu_) : std::unique_lock<std::mutex>();
}

void DocumentRegistry::Persist(const std::string& id, const std::string* value, const char* what) {
  rocksdb::WriteOptions w;
  w.sync = true;
  const std::string key = DocumentKey(id);
  const rocksdb::Status rs = value ? store_->db->Put(w, key, *value) : store_->db->Delete(w, key);
  if (rs.ok()) return;
  LOG(ERROR) << "document registry " << store_->path << ": " << what << " document " << id << " failed ("
             << (value ? "it is missing after the next restart" : "it is back after the next restart")
             << "): " << rs.ToString();
  std::lock_guard<std::mutex> lk(mu_);
  ++persist_errors_;
  stale_ids_.insert(id);
}

const char* DocumentStateName(DocumentState s) {
  switch (s) {
    case DocumentState::kFactoring: return "factoring";
    case DocumentState::kReady: return "ready";
    case DocumentState::kFailed: return "failed";
  }
  return "?";
}

Result<DocumentView> DocumentRegistry::Add(const std::string& tenant, const std::string& name,
                                           std::vector<int32_t> ids, int64_t leading_special) {
  std::lock_guard<std::mutex> lk(mu_);
  if (per_tenant_[tenant] >= max_per_tenant_) {
    return Status::ResourceExhausted("tenant has " + std::to_string(max_per_tenant_) +
                                     " documents, the most it may hold; delete some first");
  }
  DocumentView d;
  do {
    d.id = NewId();
  } while (docs_.count(d.id) || stale_ids_.count(d.id));
  d.tenant = tenant;
  d.name = name;
  d.tokens = static_cast<int64_t>(ids.size());
  d.leading_special = leading_special;
  d.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  d.ids = std::make_shared<const std::vector<int32_t>>(std::move(ids));
  docs_[d.id] = d;
  ++per_tenant_[tenant];
  return d;
}

Result<DocumentView> DocumentRegistry::Get(const std::string& tenant, const std::string& id) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end() || it->second.tenant != tenant) return Status::NotFound("document '" + id + "' is unknown");
  return it->second;
}

Result<DocumentView> DocumentRegistry::GetReadable(const std::string& reader, const std::string& id,
                                                  const std::function<bool(const std::string&)>& may_read) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end() || (it->second.tenant != reader && !may_read(it->second.tenant))) {
    return Status::NotFound("document '" + id + "' is unknown");
  }
  return it->second;
}

Result<DocumentPage> DocumentRegistry::List(const std::string& tenant, const std::string& page_token,
                                            int page_size) const {
  if (!page_token.empty() && !WellFormedId(page_token)) {
    return Status::InvalidArgument("page_token '" + page_token + "' is not one this server returned");
  }
  std::lock_guard<std::mutex> lk(mu_);
  DocumentPage p;
  for (auto it = page_token.empty() ? docs_.begin() : docs_.upper_bound(page_token); it != docs_.end(); ++it) {
    if (it->second.tenant != tenant) continue;
    if (static_cast<int>(p.documents.size()) == page_size) {
      p.next_page_token = p.documents.back().id;
      break;
    }
    p.documents.push_back(it->second);
  }
  return p;
}

Result<DocumentView> DocumentRegistry::Remove(const std::string& tenant, const std::string& id) {
  std::unique_lock<std::mutex> writes = LockWrites();
  bool stored = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = docs_.find(id);
    if (it == docs_.end() || it->second.tenant != tenant) return Status::NotFound("document '" + id + "' is unknown");
    stored = store_ && it->second.state == DocumentState::kReady;
  }
  if (stored) Persist(id, nullptr, "deleting");
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);  // in memory, another Remove may have come between
  if (it == docs_.end() || it->second.tenant != tenant) return Status::NotFound("document '" + id + "' is unknown");
  DocumentView d = std::move(it->second);
  docs_.erase(it);
  --per_tenant_[tenant];
  return d;
}

void DocumentRegistry::SetReady(const std::string& id, int worker, double factor_seconds) {
  std::unique_lock<std::mutex> writes = LockWrites();
  if (store_) {
    DocumentView stored;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = docs_.find(id);
      if (it == docs_.end()) return;  // deleted meanwhile
      stored = it->second;  // the token ids are shared, not copied
    }
    stored.factor_seconds = factor_seconds;
    const std::string value = Encode(DocumentKey(id), stored);
    Persist(id, &value, "storing");
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) return;  // deleted meanwhile (in memory; durable: Remove waits for `writes`)
  it->second.state = DocumentState::kReady;
  it->second.factor_seconds = factor_seconds;
  it->second.factored_tokens = it->second.tokens;
  it->second.workers.insert(worker);
}

void DocumentRegistry::SetFailed(const std::string& id, const Status& error) {
  std::unique_lock<std::mutex> writes = LockWrites();
  if (store_) {
    bool stored = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = docs_.find(id);
      if (it == docs_.end()) return;
      stored = it->second.state == DocumentState::kReady;
    }
    if (stored) Persist(id, nullptr, "deleting failed");
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) return;
  it->second.state = DocumentState::kFailed;
  it->second.error = error.message();
  it->second.error_code = error.code();
}

void DocumentRegistry::SetProgress(const std::string& id, int64_t factored_tokens) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it != docs_.end()) it->second.factored_tokens = factored_tokens;
}

void DocumentRegistry::AddWorker(const std::string& id, int worker) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it != docs_.end()) it->second.workers.insert(worker);
}

int64_t DocumentRegistry::count(const std::string& tenant) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = per_tenant_.find(tenant);
  return it == per_tenant_.end() ? 0 : it->second;
}

int64_t DocumentRegistry::count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(docs_.size());
}

std::map<int, int64_t> DocumentRegistry::held_per_worker() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::map<int, int64_t> m;
  for (const auto& [id, d] : docs_) {
    for (int w : d.workers) ++m[w];
  }
  return m;
}

int64_t DocumentRegistry::persist_errors() const {
  std::lock_guard<std::mutex> lk(mu_);
  return persist_errors_;
}

int64_t DocumentRegistry::corrupt_records() const {
  std::lock_guard<std::mutex> lk(mu_);
  return corrupt_records_;
}

Status DocumentRegistry::CorruptRecordForTest(const std::string& id) {
  if (!store_) return Status::FailedPrecondition("document registry: in memory, nothing is stored");
  std::unique_lock<std::mutex> writes = LockWrites();
  const std::string key = DocumentKey(id);
  std::string value;
  rocksdb::Status rs = store_->db->Get(rocksdb::ReadOptions(), key, &value);
  if (rs.IsNotFound()) return Status::NotFound("document registry: document '" + id + "' has no record");
  if (rs.ok()) {
    value[value.size() / 2] ^= 0x40;
    rocksdb::WriteOptions w;
    w.sync = true;
    rs = store_->db->Put(w, key, value);
  }
  if (!rs.ok()) return Status::IOError("document registry " + store_->path + ": " + rs.ToString());
  return Status::OK();
}

}  // namespace penumbra::coordinator
