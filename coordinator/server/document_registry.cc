#include "coordinator/server/document_registry.h"

#include <chrono>
#include <cstdio>
#include <random>

namespace penumbra::coordinator {
namespace {

std::string NewId() {
  static std::mutex mu;
  static std::mt19937_64 rng(std::random_device{}());
  std::lock_guard<std::mutex> lk(mu);
  char buf[32];
  std::snprintf(buf, sizeof buf, "doc-%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

bool WellFormedId(const std::string& id) {
  if (id.size() != 20 || id.compare(0, 4, "doc-") != 0) return false;
  return id.find_first_not_of("0123456789abcdef", 4) == std::string::npos;
}

}  // namespace

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
  } while (docs_.count(d.id));
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
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end() || it->second.tenant != tenant) return Status::NotFound("document '" + id + "' is unknown");
  DocumentView d = std::move(it->second);
  docs_.erase(it);
  --per_tenant_[tenant];
  return d;
}

void DocumentRegistry::SetReady(const std::string& id, int worker, double factor_seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = docs_.find(id);
  if (it == docs_.end()) return;  // deleted meanwhile
  it->second.state = DocumentState::kReady;
  it->second.factor_seconds = factor_seconds;
  it->second.factored_tokens = it->second.tokens;
  it->second.workers.insert(worker);
}

void DocumentRegistry::SetFailed(const std::string& id, const Status& error) {
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

}  // namespace penumbra::coordinator
