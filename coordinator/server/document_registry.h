// The coordinator's documents: which tenant owns each, its tokens (kept here,
// so any worker can be given the document again), its state and the workers
// that hold its factored state in their document cache. Tenants never see
// each other's documents: a lookup of another tenant's id is NotFound, as for
// an id that does not exist.
//
// Two kinds: in memory (the constructor: a restart forgets every document),
// or durable (Open: a RocksDB directory; what follows is about that kind).
//
// Durability: a document is stored when it becomes READY (SetReady) and its
// record is deleted when it is removed or fails (Remove, SetFailed); FACTORING
// and FAILED documents are never stored. Each change is one synced RocksDB
// write (WAL fsynced before the call returns), done before the change is
// visible in memory, so a document any reader has seen READY survives a
// restart or kill -9. A record holds the id, tenant, name, token ids,
// leading_special, created_unix_ms and factor_seconds -- not the workers: after
// Open every stored document is READY with no worker (any worker can be given
// the tokens again; it attaches the state from its own document cache or
// prefills). A put under way when the coordinator died is gone (its client's
// call failed or never returned).
//
// A failed write is logged (LOG(ERROR)) and counted (persist_errors()); the
// change is made in memory all the same: a document readied stays READY and
// usable until the next restart, where it is missing; a document removed or
// failed is gone from memory now and comes back READY at the next restart.
// No call returns an error for it.
//
// Integrity: each record starts with its format version and ends with a
// checksum over the key and the value. A record that fails a check at Open is
// skipped (its document is missing), logged and counted (corrupt_records());
// Open fails only when RocksDB itself cannot be opened or read. Per-tenant
// counts are rebuilt at Open (a tenant may then hold more than
// max_documents_per_tenant if the limit was lowered: Add refuses until it
// holds fewer). An id is never handed out while a record under it may exist
// (stored documents, skipped records, records whose deletion failed).
//
// Thread-safe. Readers (Get, List, counts) take one mutex and never wait on
// disk: SetReady, SetFailed and Remove write RocksDB outside that mutex,
// serialized among themselves by a second one (so the records on disk follow
// the order of the changes in memory; such a call may wait for another's
// fsync).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace penumbra::coordinator {

enum class DocumentState { kFactoring, kReady, kFailed };

struct DocumentView {
  std::string id, tenant, name;
  int64_t tokens = 0;
  int64_t leading_special = 0;   // its first tokens that are the tokenizer's (a BOS)
  DocumentState state = DocumentState::kFactoring;
  std::string error;             // kFailed: why
  StatusCode error_code = StatusCode::kOk;
  int64_t created_unix_ms = 0;
  double factor_seconds = -1;
  int64_t factored_tokens = 0;   // kFactoring: progress
  std::set<int> workers;         // holding its factored state
  std::shared_ptr<const std::vector<int32_t>> ids;
};

struct DocumentPage {
  std::vector<DocumentView> documents;
  std::string next_page_token;   // "" on the last page
};

class DocumentRegistry {
 public:
  // In memory: nothing is stored.
  explicit DocumentRegistry(int64_t max_documents_per_tenant);
  // Durable, in the RocksDB directory `path` (created when missing), loading
  // the documents stored there. InvalidArgument for an empty path; IOError
  // naming the path when RocksDB cannot open or read it. Damaged records do
  // not fail it (see corrupt_records()).
  static Result<std::unique_ptr<DocumentRegistry>> Open(const std::string& path, int64_t max_documents_per_tenant);
  ~DocumentRegistry();
  DocumentRegistry(const DocumentRegistry&) = delete;
  DocumentRegistry& operator=(const DocumentRegistry&) = delete;

  // A new document (FACTORING) with a fresh random id. ResourceExhausted when
  // the tenant has max_documents_per_tenant already.
  Result<DocumentView> Add(const std::string& tenant, const std::string& name, std::vector<int32_t> ids,
                           int64_t leading_special = 0);
  // NotFound for an unknown id or another tenant's.
  Result<DocumentView> Get(const std::string& tenant, const std::string& id) const;
  // As Get, for reading only: also another tenant's document when
  // may_read(its tenant) (a corpus its owner publishes to `reader`).
  Result<DocumentView> GetReadable(const std::string& reader, const std::string& id,
                                   const std::function<bool(const std::string&)>& may_read) const;
  // Documents of `tenant` by id, after `page_token` (the last id of the
  // previous page; InvalidArgument when malformed).
  Result<DocumentPage> List(const std::string& tenant, const std::string& page_token, int page_size) const;
  // Removes it; NotFound as Get. Returns what it was. Durable: its record
  // is deleted first (synced).
  Result<DocumentView> Remove(const std::string& tenant, const std::string& id);

  // The end of factoring; an unknown id (removed meanwhile) is ignored.
  // Durable: SetReady stores the document (synced) before it shows READY;
  // SetFailed of a READY document deletes its record.
  void SetReady(const std::string& id, int worker, double factor_seconds);
  void SetFailed(const std::string& id, const Status& error);
  // Neither is stored.
  void AddWorker(const std::string& id, int worker);
  void SetProgress(const std::string& id, int64_t factored_tokens);
  int64_t count(const std::string& tenant) const;
  int64_t count() const;
  // Documents each worker holds (by worker index).
  std::map<int, int64_t> held_per_worker() const;

  // Durable only (always 0 in memory): writes that failed since Open, and
  // records skipped at Open because a check failed.
  int64_t persist_errors() const;
  int64_t corrupt_records() const;

  // Test only: flips a byte in the middle of the stored record of `id`, so
  // the next Open skips it. NotFound when it has no record; FailedPrecondition
  // for an in-memory registry.
  Status CorruptRecordForTest(const std::string& id);

 private:
  struct Store;  // RocksDB (document_registry.cc): the header includes none of it

  // Held (durable only) by SetReady, SetFailed and Remove from before they
  // read the document until their write is done; taken before mu_.
  std::unique_lock<std::mutex> LockWrites();
  // Writes `id`'s record (`value` set) or deletes it; counts and logs a
  // failure. Call with write_mu_ held, mu_ not.
  void Persist(const std::string& id, const std::string* value, const char* what);

  std::unique_ptr<Store> store_;  // null: in memory
  std::mutex write_mu_;
  mutable std::mutex mu_;
  int64_t max_per_tenant_;
  std::map<std::string, DocumentView> docs_;  // by id
  std::map<std::string, int64_t> per_tenant_;
  std::set<std::string> stale_ids_;           // a record may be left (skipped at Open, write failed): never handed out
  int64_t persist_errors_ = 0;                // guarded by mu_
  int64_t corrupt_records_ = 0;
};

const char* DocumentStateName(DocumentState s);

}  // namespace penumbra::coordinator
