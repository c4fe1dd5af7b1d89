#include "coordinator/server/document_registry.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <string_view>

#include <glog/logging.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "common/crypto.h"
#include "common/hash.h"
#include "common/kv_policies.h"
#include "common/record.h"
#include "storage/rocks_store_db.h"

namespace penumbra::coordinator {
namespace {

void SetDigests(DocumentView* d) {
  const std::vector<int32_t>& ids = *d->ids;
  d->digest = DocumentDigest(ids.data(), ids.size());
  const auto skip = static_cast<size_t>(std::clamp<int64_t>(d->leading_special, 0, d->tokens));
  d->digest_after_special = skip == 0 ? d->digest : DocumentDigest(ids.data() + skip, ids.size() - skip);
}

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
//   u32 format version (2; 1 is read too: no kv_policy)
//   tenant, name (each u32 length, bytes)
//   i64 tokens, i64 leading_special, i64 created_unix_ms, f64 factor_seconds
//   kv_policy (u32 length, bytes; version 2 only)
//   u32 n, n x i32 token ids (n == tokens)
//   u64 checksum: Hash64 of everything before it, seeded with Hash64(key),
//       so a value read under another key fails too.
//
// Tombstone key: 't' and the document id. Value: u32 format version, tenant
// (u32 length, bytes), i64 tokens, u32 n, n x i32 token ids, u64 checksum
// (as above).
constexpr uint32_t kFormatVersion = 1;          // tombstones
constexpr uint32_t kDocumentFormatVersion = 2;  // documents (1: before kv_policy)
constexpr char kDocumentKind = 'd';
constexpr char kTombstoneKind = 't';

std::string DocumentKey(const std::string& id) { return std::string(1, kDocumentKind) + id; }
std::string TombstoneKey(const std::string& id) { return std::string(1, kTombstoneKind) + id; }

std::string EncodeTombstone(const std::string& key, const DocumentTombstone& t) {
  RecordWriter w(kFormatVersion);
  w.Reserve(32 + t.tenant.size() + 4 * t.ids->size());
  w.Str(t.tenant).I64(t.tokens).I32s(*t.ids);
  return w.Seal(key);
}

Status DecodeTombstone(std::string_view key, std::string_view value, DocumentTombstone* t) {
  std::string_view fields;
  PENUMBRA_RETURN_IF_ERROR(UnsealRecord(key, value, kFormatVersion, &fields));
  RecordReader in(fields);
  auto ids = std::make_shared<std::vector<int32_t>>();
  if (!in.Str(&t->tenant) || !in.I64(&t->tokens) || !in.I32s(ids.get()) || !in.done()) {
    return Status::Corruption("malformed tombstone fields");
  }
  if (t->tokens != static_cast<int64_t>(ids->size())) return Status::Corruption("tombstone: token count mismatch");
  t->id = std::string(key.substr(1));
  t->ids = std::move(ids);
  return Status::OK();
}

std::string Encode(const std::string& key, const DocumentView& d) {
  const std::vector<int32_t>& ids = *d.ids;
  RecordWriter w(kDocumentFormatVersion);
  w.Reserve(64 + d.tenant.size() + d.name.size() + d.kv_policy.size() + 4 * ids.size());
  w.Str(d.tenant).Str(d.name).I64(d.tokens).I64(d.leading_special).I64(d.created_unix_ms).F64(d.factor_seconds);
  w.Str(d.kv_policy).I32s(ids);
  return w.Seal(key);
}

// A stored document (READY, no worker), or Corruption saying which check failed.
Status Decode(std::string_view key, std::string_view value, DocumentView* d) {
  if (key.empty() || key[0] != kDocumentKind || !WellFormedId(key.substr(1))) {
    return Status::Corruption("not a document key");
  }
  std::string_view fields;
  uint32_t version = 0;
  PENUMBRA_RETURN_IF_ERROR(UnsealRecordVersions(key, value, 1, kDocumentFormatVersion, &version, &fields));
  RecordReader in(fields);
  auto ids = std::make_shared<std::vector<int32_t>>();
  if (!in.Str(&d->tenant) || !in.Str(&d->name) || !in.I64(&d->tokens) || !in.I64(&d->leading_special) ||
      !in.I64(&d->created_unix_ms) || !in.F64(&d->factor_seconds) || (version >= 2 && !in.Str(&d->kv_policy)) ||
      !in.I32s(ids.get()) || !in.done()) {
    return Status::Corruption("malformed fields");
  }
  if (!d->kv_policy.empty() && !IsKvPolicyPin(d->kv_policy)) {
    return Status::Corruption("kv_policy '" + d->kv_policy.substr(0, 32) + "'");
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
  SetDigests(d);
  return Status::OK();
}

// A key for a log line: printable, cut short.
std::string Printable(std::string_view key) {
  std::string s;
  for (char c : key.substr(0, 64)) s.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  return "'" + s + (key.size() > 64 ? "...'" : "'");
}

}  // namespace

// The registry's RocksDB: readers never touch it (they read memory), and
// writers hold write_mu_ (a failed write may reopen it).
struct DocumentRegistry::Store {
  std::unique_ptr<storage::RocksStoreDb> rdb;
};

DocumentRegistry::DocumentRegistry(int64_t max_documents_per_tenant) : max_per_tenant_(max_documents_per_tenant) {}

DocumentRegistry::~DocumentRegistry() = default;

Result<std::unique_ptr<DocumentRegistry>> DocumentRegistry::Open(const std::string& path,
                                                                 int64_t max_documents_per_tenant) {
  auto store = std::make_unique<Store>();
  PENUMBRA_ASSIGN_OR_RETURN(store->rdb, storage::RocksStoreDb::Open({"document registry", path, 64, /*sync=*/true}));
  rocksdb::DB* db = store->rdb->db();
  auto reg = std::make_unique<DocumentRegistry>(max_documents_per_tenant);
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string_view key = it->key().ToStringView();
    if (!key.empty() && key[0] == kTombstoneKind) {
      DocumentTombstone t;
      Status s = WellFormedId(key.substr(1)) ? DecodeTombstone(key, it->value().ToStringView(), &t)
                                             : Status::Corruption("not a tombstone key");
      if (!s.ok()) {
        LOG(ERROR) << "document registry " << path << ": tombstone " << Printable(key) << " skipped: " << s.message();
        ++reg->corrupt_records_;
        if (WellFormedId(key.substr(1))) reg->stale_ids_.insert(std::string(key.substr(1)));
        continue;
      }
      std::string id = t.id;
      reg->tombstones_.emplace(std::move(id), std::move(t));
      continue;
    }
    DocumentView d;
    Status s = Decode(key, it->value().ToStringView(), &d);
    if (!s.ok()) {
      LOG(ERROR) << "document registry " << path << ": record " << Printable(key) << " skipped: " << s.message();
      ++reg->corrupt_records_;
      if (!key.empty() && WellFormedId(key.substr(1))) reg->stale_ids_.insert(std::string(key.substr(1)));
      continue;
    }
    ++reg->per_tenant_[d.tenant];
    reg->IndexPrefix(d, true);
    std::string id = d.id;
    reg->docs_.emplace(std::move(id), std::move(d));
  }
  if (rocksdb::Status rs = it->status(); !rs.ok()) {
    return Status::IOError("document registry " + path + ": reading records: " + rs.ToString());
  }
  it.reset();
  LOG(INFO) << "document registry " << path << ": " << reg->docs_.size() << " documents, " << reg->tombstones_.size()
            << " tombstones"
            << (reg->corrupt_records_ ? ", " + std::to_string(reg->corrupt_records_) + " damaged records skipped"
                                      : std::string());
  reg->store_ = std::move(store);
  return reg;
}

std::unique_lock<std::mutex> DocumentRegistry::LockWrites() {
  return store_ ? std::unique_lock<std::mutex>(write_mu_) : std::unique_lock<std::mutex>();
}

Status DocumentRegistry::Persist(const std::string& id, const std::string* value, const DocumentTombstone* tombstone,
                                 const std::string& what) {
  rocksdb::WriteBatch batch;
  const std::string key = DocumentKey(id);
  if (value) {
    batch.Put(key, *value);
  } else {
    batch.Delete(key);
  }
  if (tombstone) {
    const std::string tkey = TombstoneKey(id);
    batch.Put(tkey, EncodeTombstone(tkey, *tombstone));
  }
  return store_->rdb->Commit(&batch, what);
}

const char* DocumentStateName(DocumentState s) {
  switch (s) {
    case DocumentState::kFactoring:
      return "factoring";
    case DocumentState::kReady:
      return "ready";
    case DocumentState::kFailed:
      return "failed";
  }
  return "?";
}

Result<DocumentView> DocumentRegistry::Add(const std::string& tenant, const std::string& name, std::vector<int32_t> ids,
                                           int64_t leading_special, std::string kv_policy) {
  std::lock_guard<std::mutex> lk(mu_);
  if (per_tenant_[tenant] >= max_per_tenant_) {
    return Status::ResourceExhausted("tenant has " + std::to_string(max_per_tenant_) +
                                     " documents, the most it may hold; delete some first");
  }
  DocumentView d;
  do {
    d.id = NewId();
  } while (docs_.count(d.id) || stale_ids_.count(d.id) || tombstones_.count(d.id));
  d.tenant = tenant;
  d.name = name;
  d.tokens = static_cast<int64_t>(ids.size());
  d.leading_special = leading_special;
  d.kv_policy = std::move(kv_policy);
  d.created_unix_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  d.ids = std::make_shared<const std::vector<int32_t>>(std::move(ids));
  SetDigests(&d);
  docs_[d.id] = d;
  IndexPrefix(d, true);
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

namespace {
// A document's tokens as the first of a prompt's documents (all of them) or
// as a following one (without its leading special tokens).
std::span<const int32_t> PrefixForm(const DocumentView& d, bool first) {
  const std::vector<int32_t>& ids = *d.ids;
  const size_t skip = first ? 0 : static_cast<size_t>(std::min<int64_t>(d.leading_special, d.tokens));
  return std::span<const int32_t>(ids).subspan(skip);
}
uint64_t HashIds(std::span<const int32_t> ids) { return Hash64(ids.data(), ids.size() * sizeof(int32_t)); }
}  // namespace

void DocumentRegistry::IndexPrefix(const DocumentView& d, bool add) {
  if (!d.ids) return;
  for (bool first : {true, false}) {
    const std::span<const int32_t> form = PrefixForm(d, first);
    if (form.empty()) continue;
    const size_t k = std::min(kPrefixKeyTokens, form.size());
    const PrefixKey key{first, d.tenant, k, HashIds(form.first(k))};
    if (add) {
      prefix_index_.emplace(key, d.id);
      continue;
    }
    auto [lo, hi] = prefix_index_.equal_range(key);
    for (auto it = lo; it != hi; ++it) {
      if (it->second == d.id) {
        prefix_index_.erase(it);
        break;
      }
    }
  }
}

std::vector<DocumentView> DocumentRegistry::MatchPrefix(const std::string& tenant, const std::vector<int32_t>& prompt,
                                                        size_t max_documents, int64_t* consumed) const {
  std::vector<DocumentView> out;
  size_t pos = 0;
  std::lock_guard<std::mutex> lk(mu_);
  while (out.size() < max_documents && pos + 1 < prompt.size()) {
    const bool first = out.empty();
    const std::span<const int32_t> rest = std::span<const int32_t>(prompt).subspan(pos);
    const DocumentView* best = nullptr;
    size_t best_len = 0;
    for (size_t k = 1; k <= std::min(kPrefixKeyTokens, rest.size() - 1); ++k) {
      auto [lo, hi] = prefix_index_.equal_range(PrefixKey{first, tenant, k, HashIds(rest.first(k))});
      for (auto it = lo; it != hi; ++it) {
        auto d = docs_.find(it->second);
        if (d == docs_.end() || d->second.state != DocumentState::kReady) continue;
        const std::span<const int32_t> form = PrefixForm(d->second, first);
        // Longer than one found already, and a token of the prompt left after it.
        if (form.size() <= best_len || form.size() >= rest.size()) continue;
        if (std::equal(form.begin(), form.end(), rest.begin())) {
          best = &d->second;
          best_len = form.size();
        }
      }
    }
    if (best == nullptr) break;
    out.push_back(*best);
    pos += best_len;
  }
  *consumed = static_cast<int64_t>(pos);
  return out;
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
  DocumentTombstone t;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = docs_.find(id);
    if (it == docs_.end() || it->second.tenant != tenant) return Status::NotFound("document '" + id + "' is unknown");
    t.id = id;
    t.tenant = tenant;
    t.tokens = it->second.tokens;
    t.ids = it->second.ids;
  }
  if (store_) {
    // (A document never stored has no record: deleting it anyway is harmless.)
    PENUMBRA_RETURN_IF_ERROR(Persist(id, nullptr, &t, "deleting document " + id));
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);  // in memory, another Remove may have come between
  if (it == docs_.end() || it->second.tenant != tenant) return Status::NotFound("document '" + id + "' is unknown");
  DocumentView d = std::move(it->second);
  IndexPrefix(d, false);
  docs_.erase(it);
  --per_tenant_[tenant];
  tombstones_[id] = std::move(t);
  return d;
}

Status DocumentRegistry::SetReady(const std::string& id, int worker, double factor_seconds) {
  std::unique_lock<std::mutex> writes = LockWrites();
  if (store_) {
    DocumentView stored;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = docs_.find(id);
      if (it == docs_.end()) return Status::OK();  // deleted meanwhile
      stored = it->second;                         // the token ids are shared, not copied
    }
    stored.factor_seconds = factor_seconds;
    const std::string value = Encode(DocumentKey(id), stored);
    Status s = Persist(id, &value, nullptr, "storing document " + id);
    if (!s.ok()) {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = docs_.find(id);
      if (it == docs_.end()) return s;
      it->second.state = DocumentState::kFailed;
      it->second.error = s.message() + "; document " + id + " was factored but is not stored (delete it, put it again)";
      it->second.error_code = s.code();
      it->second.not_stored = true;
      it->second.workers.insert(worker);  // it holds the state: a Remove tells it to forget
      return Status(s.code(), it->second.error);
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) return Status::OK();  // deleted meanwhile (in memory; durable: Remove waits for `writes`)
  it->second.state = DocumentState::kReady;
  it->second.factor_seconds = factor_seconds;
  it->second.factored_tokens = it->second.tokens;
  it->second.workers.insert(worker);
  return Status::OK();
}

Status DocumentRegistry::SetFailed(const std::string& id, const Status& error) {
  std::unique_lock<std::mutex> writes = LockWrites();
  if (store_) {
    bool stored = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = docs_.find(id);
      if (it == docs_.end()) return Status::OK();
      stored = it->second.state == DocumentState::kReady;
    }
    if (stored) PENUMBRA_RETURN_IF_ERROR(Persist(id, nullptr, nullptr, "deleting failed document " + id));
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) return Status::OK();
  it->second.state = DocumentState::kFailed;
  it->second.error = error.message();
  it->second.error_code = error.code();
  return Status::OK();
}

Status DocumentRegistry::CheckWritable() {
  if (!store_) return Status::OK();
  std::unique_lock<std::mutex> writes = LockWrites();
  return store_->rdb->Recover();
}

std::vector<DocumentTombstone> DocumentRegistry::Tombstones() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<DocumentTombstone> out;
  out.reserve(tombstones_.size());
  for (const auto& [id, t] : tombstones_) out.push_back(t);
  return out;
}

int64_t DocumentRegistry::tombstone_count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(tombstones_.size());
}

void DocumentRegistry::ConfirmForgotten(const std::string& id, int worker) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tombstones_.find(id);
  if (it != tombstones_.end()) it->second.confirmed.insert(worker);
}

Status DocumentRegistry::DropConfirmed(int workers) {
  std::unique_lock<std::mutex> writes = LockWrites();
  std::vector<std::string> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [id, t] : tombstones_) {
      int n = 0;
      for (int w : t.confirmed) n += w >= 0 && w < workers;
      if (n == workers) done.push_back(id);
    }
  }
  Status first;
  for (const std::string& id : done) {
    if (store_) {
      rocksdb::WriteBatch drop;
      drop.Delete(TombstoneKey(id));
      Status s = store_->rdb->Commit(&drop, "dropping the tombstone of " + id);
      if (!s.ok()) {
        if (first.ok()) first = s;
        continue;
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    tombstones_.erase(id);
  }
  return first;
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

void DocumentRegistry::RemoveWorker(const std::string& id, int worker) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it != docs_.end()) it->second.workers.erase(worker);
}

bool DocumentRegistry::Holds(const std::string& id, int worker) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  return it != docs_.end() && it->second.workers.count(worker) > 0;
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

int64_t DocumentRegistry::persist_errors() const { return write_health().write_errors; }

storage::WriteHealth DocumentRegistry::write_health() const {
  return store_ ? store_->rdb->health() : storage::WriteHealth{};
}

int64_t DocumentRegistry::corrupt_records() const {
  std::lock_guard<std::mutex> lk(mu_);
  return corrupt_records_;
}

Status DocumentRegistry::EditRecordForTest(
    const std::string& id, const std::function<Status(const std::string& key, std::string* value)>& edit) {
  if (!store_) return Status::FailedPrecondition("document registry: in memory, nothing is stored");
  std::unique_lock<std::mutex> writes = LockWrites();
  const std::string key = DocumentKey(id);
  std::string value;
  PENUMBRA_RETURN_IF_ERROR(store_->rdb->Readable());
  rocksdb::DB* db = store_->rdb->db();
  rocksdb::Status rs = db->Get(rocksdb::ReadOptions(), key, &value);
  if (rs.IsNotFound()) return Status::NotFound("document registry: document '" + id + "' has no record");
  if (!rs.ok()) return Status::IOError("document registry " + store_->rdb->path() + ": " + rs.ToString());
  PENUMBRA_RETURN_IF_ERROR(edit(key, &value));
  rocksdb::WriteOptions w;
  w.sync = true;
  rs = db->Put(w, key, value);
  if (!rs.ok()) return Status::IOError("document registry " + store_->rdb->path() + ": " + rs.ToString());
  return Status::OK();
}

Status DocumentRegistry::CorruptRecordForTest(const std::string& id) {
  return EditRecordForTest(id, [](const std::string&, std::string* value) {
    (*value)[value->size() / 2] ^= 0x40;
    return Status::OK();
  });
}

Status DocumentRegistry::RewriteRecordAsVersion1ForTest(const std::string& id) {
  return EditRecordForTest(id, [](const std::string& key, std::string* value) {
    DocumentView d;
    PENUMBRA_RETURN_IF_ERROR(Decode(key, *value, &d));
    RecordWriter w(1);
    w.Str(d.tenant).Str(d.name).I64(d.tokens).I64(d.leading_special).I64(d.created_unix_ms).F64(d.factor_seconds);
    w.I32s(*d.ids);
    *value = w.Seal(key);
    return Status::OK();
  });
}

}  // namespace penumbra::coordinator
