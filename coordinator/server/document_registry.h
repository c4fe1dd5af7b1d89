// The coordinator's documents: which tenant owns each, its tokens (kept here,
// so any worker can be given the document again), its state and the workers
// that hold its factored state in their document cache. Tenants never see
// each other's documents: a lookup of another tenant's id is NotFound, as for
// an id that does not exist.
//
// Two kinds: in memory (the constructor: a restart forgets every document),
// or durable (Open: a RocksDB directory; what follows is about that kind).
//
// Durability: a document is stored when it becomes READY (SetReady); a
// removal (Remove) replaces its record with a tombstone; FACTORING and FAILED
// documents are never stored. Each change is one synced RocksDB write (WAL
// fsynced before the call returns), done before the change is visible in
// memory, so a document any reader has seen READY survives a restart or
// kill -9, and a removal acknowledged stays removed. A record holds the id,
// tenant, name, token ids, leading_special, created_unix_ms and
// factor_seconds -- not the workers: after Open every stored document is
// READY with no worker (any worker can be given the tokens again; it attaches
// the state from its own document cache or prefills). A put under way when
// the coordinator died is gone (its client's call failed or never returned).
//
// A failed write changes nothing in memory and fails the call with a typed
// error (storage/rocksdb_writer.h: ResourceExhausted "the disk is full",
// naming the registry and its path; IOError for other I/O errors): a Remove
// that fails leaves the document as it was; a SetReady that fails leaves the
// document FAILED with that error (not_stored set; its workers kept, so a
// later Remove tells them to forget it) -- it is not READY and not stored.
// (RocksDB applies nothing of a write that failed; only one whose bytes all
// reached the log before a failed fsync could show after a crash.)
// After a failed write the registry is degraded (write_health()) and becomes
// writable again by itself when the disk has room (Resume or reopen before
// the next write, at most every 500 ms); CheckWritable tries that first, so
// a put is refused before any worker factors it.
//
// Tombstones: a removed document (any state: a FACTORING or FAILED one's
// worker may hold part of it) leaves a tombstone (id, tenant, token ids)
// until every worker has confirmed that it dropped the document's cached
// state (ConfirmForgotten; a worker forwards that to its store node). The
// coordinator's TombstoneSweeper (tombstones.h) calls the workers and
// DropConfirmed deletes the tombstones all of them confirmed. Durable
// tombstones are stored (key 't'), so they survive restarts (confirmations
// do not: after a restart every worker is asked again; forgetting is
// idempotent). An id in a tombstone is never handed out.
//
// Integrity: each record starts with its format version and ends with a
// checksum over the key and the value. A record that fails a check at Open is
// skipped (its document is missing), logged and counted (corrupt_records());
// Open fails only when RocksDB itself cannot be opened or read. Per-tenant
// counts are rebuilt at Open (a tenant may then hold more than
// max_documents_per_tenant if the limit was lowered: Add refuses until it
// holds fewer). An id is never handed out while a record under it may exist
// (stored documents, skipped records, tombstones).
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
#include <tuple>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "storage/write_health.h"

namespace penumbra::coordinator {

enum class DocumentState { kFactoring, kReady, kFailed };

struct DocumentView {
  std::string id, tenant, name;
  int64_t tokens = 0;
  int64_t leading_special = 0;  // its first tokens that are the tokenizer's (a BOS)
  DocumentState state = DocumentState::kFactoring;
  std::string error;  // kFailed: why
  StatusCode error_code = StatusCode::kOk;
  int64_t created_unix_ms = 0;
  double factor_seconds = -1;
  int64_t factored_tokens = 0;  // kFactoring: progress
  std::set<int> workers;        // holding its factored state
  std::shared_ptr<const std::vector<int32_t>> ids;
  // Its content digests (DocumentDigest): of all its ids (where it leads a
  // prompt) and of the ids after its leading special tokens (where it
  // follows another document): what names it to a worker that holds it.
  // Computed once when it is added or loaded (not stored).
  Hash128 digest, digest_after_special;
  bool not_stored = false;  // kFailed: factored, but storing it READY failed (error says why)
  // The KV policy its put pinned it to ("full" or "shadowkv"; "": the
  // workers' choice): it is factored on workers of that policy or of auto,
  // held there under it, and its questions are too unless they pin another.
  std::string kv_policy;
};

// A removed document whose cached state workers may still hold.
struct DocumentTombstone {
  std::string id, tenant;  // the tenant is the cache namespace
  int64_t tokens = 0;
  std::shared_ptr<const std::vector<int32_t>> ids;
  std::set<int> confirmed;  // workers that dropped its state (in memory only)
};

struct DocumentPage {
  std::vector<DocumentView> documents;
  std::string next_page_token;  // "" on the last page
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
  // kv_policy: "", "full" or "shadowkv" (the put's pin; checked by the caller).
  Result<DocumentView> Add(const std::string& tenant, const std::string& name, std::vector<int32_t> ids,
                           int64_t leading_special = 0, std::string kv_policy = "");
  // NotFound for an unknown id or another tenant's.
  Result<DocumentView> Get(const std::string& tenant, const std::string& id) const;
  // As Get, for reading only: also another tenant's document when
  // may_read(its tenant) (a corpus its owner publishes to `reader`).
  Result<DocumentView> GetReadable(const std::string& reader, const std::string& id,
                                   const std::function<bool(const std::string&)>& may_read) const;
  // The READY documents of `tenant` that `prompt` starts with, in order, as
  // a request naming them would concatenate them: the first whole (its
  // leading special tokens included), each next one without its own; the
  // longest that matches at each point, at most max_documents, leaving at
  // least one token of the prompt after them. *consumed: their tokens. Looked
  // up by an index of each document's first kPrefixKeyTokens tokens, so the
  // cost does not grow with the tenant's documents.
  std::vector<DocumentView> MatchPrefix(const std::string& tenant, const std::vector<int32_t>& prompt,
                                        size_t max_documents, int64_t* consumed) const;
  static constexpr size_t kPrefixKeyTokens = 16;
  // Documents of `tenant` by id, after `page_token` (the last id of the
  // previous page; InvalidArgument when malformed).
  Result<DocumentPage> List(const std::string& tenant, const std::string& page_token, int page_size) const;
  // Removes it, leaving a tombstone; NotFound as Get. Returns what it was.
  // Durable: the tombstone and the record's deletion are one synced write
  // first; when it fails, so does the call (typed, see the top) and the
  // document stays.
  Result<DocumentView> Remove(const std::string& tenant, const std::string& id);

  // The end of factoring; an unknown id (removed meanwhile) is ignored (OK).
  // Durable: SetReady stores the document (synced) before it shows READY;
  // when that fails the document becomes FAILED (not_stored) and the error
  // is returned. SetFailed of a READY document deletes its record (a failed
  // delete leaves it READY and is returned).
  Status SetReady(const std::string& id, int worker, double factor_seconds);
  Status SetFailed(const std::string& id, const Status& error);
  // Durable and degraded: tries to become writable again (rate-limited) and
  // returns the error while it cannot. OK otherwise.
  Status CheckWritable();

  // Tombstones not yet confirmed by every worker, by id.
  std::vector<DocumentTombstone> Tombstones() const;
  int64_t tombstone_count() const;
  // Worker `worker` dropped the state of tombstone `id` (unknown ids ignored).
  void ConfirmForgotten(const std::string& id, int worker);
  // Deletes every tombstone that workers 0..workers-1 all confirmed; the
  // first failed write is returned (those tombstones stay, retried next time).
  Status DropConfirmed(int workers);
  // Neither is stored.
  void AddWorker(const std::string& id, int worker);
  // Worker `worker` turned out not to hold document `id` (evicted, restarted).
  void RemoveWorker(const std::string& id, int worker);
  // Whether `worker` is known to hold document `id`'s state.
  bool Holds(const std::string& id, int worker) const;
  void SetProgress(const std::string& id, int64_t factored_tokens);
  int64_t count(const std::string& tenant) const;
  int64_t count() const;
  // Documents each worker holds (by worker index).
  std::map<int, int64_t> held_per_worker() const;

  // Durable only (always 0 / healthy in memory): writes refused since Open
  // (write_health().write_errors), how the writes fare, and records skipped
  // at Open because a check failed.
  int64_t persist_errors() const;
  storage::WriteHealth write_health() const;
  int64_t corrupt_records() const;

  // Test only: flips a byte in the middle of the stored record of `id`, so
  // the next Open skips it. NotFound when it has no record; FailedPrecondition
  // for an in-memory registry.
  Status CorruptRecordForTest(const std::string& id);
  // Test only: rewrites the stored record of `id` in format version 1 (as a
  // binary before kv_policy wrote it: no pin), so the next Open reads an old
  // record. As CorruptRecordForTest for the errors.
  Status RewriteRecordAsVersion1ForTest(const std::string& id);

 private:
  // The test hooks' edit of the stored record of `id`: `edit` gets its key
  // and value and changes the value, which is written back (synced).
  Status EditRecordForTest(const std::string& id,
                           const std::function<Status(const std::string& key, std::string* value)>& edit);
  struct Store;  // RocksDB (document_registry.cc): the header includes none of it

  // Held (durable only) by SetReady, SetFailed and Remove from before they
  // read the document until their write is done; taken before mu_.
  std::unique_lock<std::mutex> LockWrites();
  // Writes `id`'s record (`value` set) or deletes it, and (`tombstone` set)
  // puts that tombstone in the same write; a failure is typed, counted and
  // logged (storage::RocksWriter). Call with write_mu_ held, mu_ not.
  Status Persist(const std::string& id, const std::string* value, const DocumentTombstone* tombstone,
                 const std::string& what);

  // MatchPrefix's index: (as the first document or a following one, tenant,
  // k = min(kPrefixKeyTokens, its tokens in that form), Hash64 of its first
  // k tokens in that form) -> document ids. Kept with docs_ (under mu_).
  using PrefixKey = std::tuple<bool, std::string, size_t, uint64_t>;
  void IndexPrefix(const DocumentView& d, bool add);
  std::multimap<PrefixKey, std::string> prefix_index_;

  std::unique_ptr<Store> store_;  // null: in memory
  std::mutex write_mu_;
  mutable std::mutex mu_;
  int64_t max_per_tenant_;
  std::map<std::string, DocumentView> docs_;  // by id
  std::map<std::string, int64_t> per_tenant_;
  std::set<std::string> stale_ids_;                      // a record may be left (skipped at Open): never handed out
  std::map<std::string, DocumentTombstone> tombstones_;  // by id; never handed out either
  int64_t corrupt_records_ = 0;
};

const char* DocumentStateName(DocumentState s);

}  // namespace penumbra::coordinator
