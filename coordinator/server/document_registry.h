// The coordinator's documents: which tenant owns each, its tokens (kept here,
// so any worker can be given the document again), its state and the workers
// that hold its factored state in their document cache. Tenants never see
// each other's documents: a lookup of another tenant's id is NotFound, as for
// an id that does not exist.
//
// In memory: a coordinator restart forgets the registry (the workers'
// persistent document stores keep the factored states, so a document put
// again is attached from disk, not prefilled).
#pragma once

#include <cstdint>
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
  explicit DocumentRegistry(int64_t max_documents_per_tenant) : max_per_tenant_(max_documents_per_tenant) {}

  // A new document (FACTORING) with a fresh random id. ResourceExhausted when
  // the tenant has max_documents_per_tenant already.
  Result<DocumentView> Add(const std::string& tenant, const std::string& name, std::vector<int32_t> ids,
                           int64_t leading_special = 0);
  // NotFound for an unknown id or another tenant's.
  Result<DocumentView> Get(const std::string& tenant, const std::string& id) const;
  // Documents of `tenant` by id, after `page_token` (the last id of the
  // previous page; InvalidArgument when malformed).
  Result<DocumentPage> List(const std::string& tenant, const std::string& page_token, int page_size) const;
  // Removes it; NotFound as Get. Returns what it was.
  Result<DocumentView> Remove(const std::string& tenant, const std::string& id);

  void SetReady(const std::string& id, int worker, double factor_seconds);
  void SetFailed(const std::string& id, const Status& error);
  void AddWorker(const std::string& id, int worker);
  void SetProgress(const std::string& id, int64_t factored_tokens);
  int64_t count(const std::string& tenant) const;
  int64_t count() const;
  // Documents each worker holds (by worker index).
  std::map<int, int64_t> held_per_worker() const;

 private:
  mutable std::mutex mu_;
  int64_t max_per_tenant_;
  std::map<std::string, DocumentView> docs_;  // by id
  std::map<std::string, int64_t> per_tenant_;
};

const char* DocumentStateName(DocumentState s);

}  // namespace penumbra::coordinator
