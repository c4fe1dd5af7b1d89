// The coordinator's options and lifetime: CoordinatorOptions::Validate,
// construction (the metrics, the sweepers), destruction, Drain and Health.
// The rest of Coordinator is in one file per job (coordinator.h says which).
#include "coordinator/server/coordinator.h"

#include <filesystem>
#include <string>

#include <glog/logging.h>

#include "coordinator/server/coordinator_internal.h"

namespace penumbra::coordinator {
using internal::Clock;
using internal::milliseconds;

namespace {

// The model's name as Health shows it: its directory's last component, not
// the path.
std::string ModelName(const std::string& model) {
  std::filesystem::path p(model);
  while (p.has_parent_path() && p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() ? model : name;
}

}  // namespace

Status CoordinatorOptions::Validate() const {
  if (tenants && !api_keys.empty()) {
    return Status::InvalidArgument("tenants and plain API keys are exclusive: give one of them");
  }
  for (const auto& [key, tenant] : api_keys) {
    if (key.size() < tenants::kMinApiKeyBytes || tenant.empty()) {
      return Status::InvalidArgument("api keys must be at least " + std::to_string(tenants::kMinApiKeyBytes) +
                                     " bytes and tenants not empty (tenant '" + tenant + "')");
    }
  }
  PENUMBRA_RETURN_IF_ERROR(limits.Validate());
  if (max_documents_per_tenant < 1) return Status::InvalidArgument("max_documents_per_tenant must be >= 1");
  if (max_running_requests < 1) return Status::InvalidArgument("max_running_requests must be >= 1");
  if (max_background_puts_per_tenant < 1) {
    return Status::InvalidArgument("max_background_puts_per_tenant must be >= 1");
  }
  if (min_free_memory_bytes < 0) return Status::InvalidArgument("min_free_memory_bytes must be >= 0");
  if (abandon_timeout < milliseconds(1000) || abandon_timeout > keep_finished) {
    return Status::InvalidArgument("abandon_timeout must be in [1 s, keep_finished]");
  }
  return Status::OK();
}

Coordinator::Coordinator(const CoordinatorOptions& options, std::unique_ptr<TextCodec> codec, std::string model,
                         WorkerPool* workers, std::unique_ptr<DocumentRegistry> documents)
    : o_(options),
      api_keys_(std::make_shared<const std::map<std::string, std::string>>(options.api_keys)),
      codec_(std::move(codec)),
      model_(ModelName(model)),
      workers_(workers),
      docs_(documents ? std::move(documents) : std::make_unique<DocumentRegistry>(options.max_documents_per_tenant)),
      registry_(std::make_shared<prometheus::Registry>()) {
  RegisterMetrics();
  for (int w = 0; w < workers_->size(); ++w) watches_.push_back(std::make_unique<WorkerWatch>(workers_, w));
  last_sweep_ = Clock::now();
  tombstones_ = std::make_unique<TombstoneSweeper>(
      docs_.get(), [this] { return workers_->size(); },
      [this](int w, const DocumentTombstone& t) {
        // A worker known to be down is asked at a later sweep, not waited for.
        if (!workers_->state(w).healthy) return Status::Unavailable("worker " + std::to_string(w) + " is down");
        return ForgetOn(w, t.id, t.tenant, t.ids);
      },
      std::chrono::seconds(2));
  sweeper_ = std::thread([this] {
    std::unique_lock<std::mutex> lk(sweep_mu_);
    while (!sweep_cv_.wait_for(lk, std::chrono::seconds(1), [this] { return stopping_.load(); })) {
      lk.unlock();
      DropExpired();
      lk.lock();
    }
  });
  if (o_.tenants) {
    // Documents kept from before a restart count against their tenants'
    // stored-bytes quotas.
    for (const tenants::TenantConfig& t : o_.tenants->config()->tenants) {
      std::string token;
      do {
        Result<DocumentPage> p = docs_->List(t.name, token, 1000);
        if (!p.ok()) break;
        for (const DocumentView& d : p->documents) {
          (void)o_.tenants->ReserveDocumentBytes(t.name, d.tokens * static_cast<int64_t>(sizeof(int32_t)));
        }
        token = p->next_page_token;
      } while (!token.empty());
    }
  }
}

Coordinator::~Coordinator() {
  tombstones_.reset();
  {
    std::lock_guard<std::mutex> lk(sweep_mu_);
    stopping_ = true;
  }
  sweep_cv_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
  if (jobs_) jobs_->Stop();
  for (auto& p : puts_) {
    if (p.thread.joinable()) p.thread.join();
  }
}

bool Coordinator::Drain(milliseconds max_wait) {
  std::unique_lock<std::mutex> lk(mu_);
  draining_ = true;
  const Clock::time_point until = Clock::now() + max_wait;
  while (running_ > 0) {
    lk.unlock();
    DropExpired();  // learns of generations nobody polls
    lk.lock();
    if (running_ == 0 || Clock::now() >= until) break;
    idle_cv_.wait_for(lk, milliseconds(200));
  }
  if (running_ == 0) return true;
  drain_expired_ = true;
  // Expired: what is left is cancelled on its worker (by where it runs, so a
  // Complete holding the request's mu is not waited for; it sees the worker
  // end it "cancelled"), and the requests free end "drained".
  std::vector<std::shared_ptr<Request>> left;
  for (const auto& [id, q] : requests_) left.push_back(q);
  lk.unlock();
  int64_t cancelled = 0;
  for (auto& q : left) {
    int w;
    std::string wid;
    {
      std::lock_guard<std::mutex> wl(q->where_mu);
      w = q->where_worker;
      wid = q->where_wid;
    }
    std::unique_lock<std::mutex> ql(q->mu, std::try_to_lock);
    if (ql.owns_lock() && q->done) continue;
    if (w >= 0) {
      Status s = CancelOnWorker(w, wid);
      if (!s.ok()) LOG(WARNING) << "drain: request " << q->id << " not cancelled on its worker: " << s;
    }
    ++cancelled;
    drain_cancelled_->Increment();
    if (ql.owns_lock()) {
      Finalize(*q, "drained",
               Status::Unavailable("the coordinator stopped: its drain expired before the request ended"));
    }
  }
  LOG(WARNING) << "drain expired: " << cancelled << " generations cancelled on their workers";
  return false;
}

void Coordinator::Health(rpc::HealthResponse& out) {
  // Anyone may call it (no key): whether it serves and the model's name,
  // nothing about the workers or the host (their details are in Stats for an
  // admin tenant).
  out.model = model_;
  out.workers.clear();
  bool any = false;
  for (const WorkerState& w : workers_->states()) any = any || w.healthy;
  std::lock_guard<std::mutex> lk(mu_);
  out.serving = any && !draining_;
}

}  // namespace penumbra::coordinator
