#include "coordinator/server/coordinator.h"
#include "coordinator/server/placement.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>

#include <glog/logging.h>
#include <yaml-cpp/yaml.h>

#include "common/crypto.h"
#include "transport/thrift_util.h"

namespace penumbra::coordinator {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

[[noreturn]] void Throw(const Status& s) { throw transport::ToRpcError(s); }

template <typename T>
T OrThrow(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(*r);
}

void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}

// 128 bits from the CSPRNG: a request id is not guessable (and is scoped to
// its tenant besides).
std::string NewRequestId() { return "req-" + RandomHandle(); }

// The model's name as Health shows it: its directory's last component, not
// the path.
std::string ModelName(const std::string& model) {
  std::filesystem::path p(model);
  while (p.has_parent_path() && p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() ? model : name;
}

// The time left before `deadline_ms` from now (0: `fallback`).
Clock::time_point DeadlineOf(int64_t deadline_ms, milliseconds fallback) {
  return Clock::now() + (deadline_ms > 0 ? milliseconds(deadline_ms) : fallback);
}

milliseconds Left(Clock::time_point deadline) {
  return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

const std::vector<double> kLatencyBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
const std::vector<double> kTokenBuckets = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1};

// A quota's refusal as a Status that carries its retry-after.
Status QuotaStatus(const tenants::QuotaDecision& d, prometheus::Family<prometheus::Counter>* refusals,
                   const std::string& tenant) {
  if (d.ok()) return Status::OK();
  if (d.status.code() == StatusCode::kResourceExhausted) refusals->Add({{"tenant", tenant}}).Increment();
  return d.status.WithRetryAfter(d.retry_after_ms());
}

}  // namespace

struct Coordinator::Request {
  std::string id, tenant;
  int worker = -1;
  std::string wid;  // the worker's handle of its generation
  std::vector<std::string> stop;
  Clock::time_point created, finished;
  std::optional<Clock::time_point> deadline;  // enforced here too (the worker checks between steps)
  std::mutex mu;  // the fields below
  std::vector<int32_t> ids;
  std::string text;
  bool done = false;
  std::string finish_reason;
  Status error;
  rpc::Usage usage;
  tenants::Lease sequence;  // the tenant's concurrent-sequence quota, held until Finalize
  tenants::TokenReservation tokens;  // its generated tokens, reserved at admission; settled by Finalize
  // To resume it on another worker when its worker is lost: what was sent,
  // its documents and policy, the tokens it had made before the current
  // worker's (base), and how often it moved.
  rpc::WorkerGenerateRequest gen;
  std::vector<DocumentView> docs;
  std::string kv_policy;
  int64_t base = 0;
  int resumes = 0;
  bool job_item = false;
  bool recovered = false;  // taken over from the journal at a restart
  int64_t created_unix_ms = 0;
  Clock::time_point last_poll;  // a client's latest Poll (abandon_timeout)
  // Where it runs, readable without mu (a drain cancels generations whose
  // mu a waiting Complete holds).
  std::mutex where_mu;
  int where_worker = -1;
  std::string where_wid;
  void SetWhere(int w, const std::string& h) {
    std::lock_guard<std::mutex> lk(where_mu);
    worker = where_worker = w;
    wid = where_wid = h;
  }
};

namespace {

int64_t UnixMs() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
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

Result<std::map<std::string, std::string>> LoadApiKeys(const std::string& path) {
  std::map<std::string, std::string> keys;
  try {
    YAML::Node root = YAML::LoadFile(path);
    if (!root.IsMap() || !root["keys"] || !root["keys"].IsMap()) {
      return Status::InvalidArgument(path + ": expected a map `keys: {KEY: TENANT, ...}`");
    }
    size_t i = 0;
    for (const auto& kv : root["keys"]) {
      const std::string key = kv.first.as<std::string>(), tenant = kv.second.as<std::string>();
      const std::string at = path + ": keys entry " + std::to_string(i++);
      if (tenant.empty()) return Status::InvalidArgument(at + ": the tenant is empty");
      // The key itself is never echoed.
      if (key.size() < tenants::kMinApiKeyBytes || key.size() > tenants::kMaxApiKeyBytes) {
        return Status::InvalidArgument(at + " (tenant '" + tenant + "'): a key must be " +
                                       std::to_string(tenants::kMinApiKeyBytes) + " to " +
                                       std::to_string(tenants::kMaxApiKeyBytes) + " bytes, got " +
                                       std::to_string(key.size()) + " (`penumbra tenant new-key` makes one)");
      }
      keys[key] = tenant;
    }
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(path + ": " + e.what());
  }
  if (keys.empty()) return Status::InvalidArgument(path + ": no keys");
  return keys;
}

Coordinator::Coordinator(const CoordinatorOptions& options, std::unique_ptr<TextCodec> codec, std::string model,
                         WorkerPool* workers, std::unique_ptr<DocumentRegistry> documents)
    : o_(options),
      api_keys_(std::make_shared<const std::map<std::string, std::string>>(options.api_keys)),
      codec_(std::move(codec)),
      model_(ModelName(model)),
      workers_(workers),
      docs_(documents ? std::move(documents)
                      : std::make_unique<DocumentRegistry>(options.max_documents_per_tenant)),
      registry_(std::make_shared<prometheus::Registry>()) {
  using namespace prometheus;
  requests_total_ = &BuildCounter()
                         .Name("penumbra_coordinator_requests_total")
                         .Help("Generations ended, by tenant and finish reason (stop, length, cancelled, deadline, "
                               "error).")
                         .Register(*registry_);
  auto per_tenant = [&](const char* name, const char* help) {
    return &BuildCounter().Name(name).Help(help).Register(*registry_);
  };
  auto histogram = [&](const char* name, const char* help, const std::vector<double>& b) -> Histogram& {
    return BuildHistogram().Name(name).Help(help).Register(*registry_).Add({}, b);
  };
  prompt_tokens_ =
      per_tenant("penumbra_coordinator_prompt_tokens_total", "Prompt tokens of ended generations, by tenant.");
  cached_tokens_ = per_tenant("penumbra_coordinator_cached_prompt_tokens_total",
                              "Of them, attached from the document cache, by tenant.");
  generated_tokens_ = per_tenant("penumbra_coordinator_generated_tokens_total", "Tokens generated, by tenant.");
  resumed_ = &BuildCounter()
                  .Name("penumbra_coordinator_requests_resumed_total")
                  .Help("Generations moved to another worker after theirs was lost (continued where they were).")
                  .Register(*registry_)
                  .Add({});
  auto plain = [&](const char* name, const char* help) -> Counter& {
    return BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
  };
  reattached_ = &plain("penumbra_coordinator_requests_reattached_total",
                       "Generations taken over from the journal after a restart (still on their workers).");
  orphans_cancelled_ = &plain("penumbra_coordinator_orphans_cancelled_total",
                              "Generations a worker held for this coordinator without a journal record, cancelled.");
  abandoned_ = &plain("penumbra_coordinator_requests_abandoned_total",
                      "Streaming generations cancelled because no client polled them (abandon timeout).");
  drain_cancelled_ = &plain("penumbra_coordinator_drain_cancelled_total",
                            "Generations cancelled because a drain expired.");
  hangups_ = &plain("penumbra_coordinator_complete_hangups_total",
                    "Complete calls whose client closed its connection (their generations cancelled).");
  journal_errors_ = &plain("penumbra_coordinator_journal_errors_total",
                           "Failed writes of the request journal (a failed start fails its call).");
  documents_put_ = per_tenant("penumbra_coordinator_documents_put_total", "Documents put, by tenant.");
  quota_refusals_ = per_tenant("penumbra_coordinator_quota_refusals_total",
                               "Calls refused by a tenant's quota (RESOURCE_EXHAUSTED), by tenant.");
  ttft_ = &histogram("penumbra_coordinator_ttft_seconds", "Time to first token (worker: submitted to first token).",
                     kLatencyBuckets);
  tpot_ = &histogram("penumbra_coordinator_time_per_output_token_seconds",
                     "Per generated token after the first, per request.", kTokenBuckets);
  duration_ = &histogram("penumbra_coordinator_request_seconds", "Generate to the end.", kLatencyBuckets);
  factor_ = &histogram("penumbra_coordinator_document_factor_seconds", "Put to ready.", kLatencyBuckets);
  running_gauge_ = &BuildGauge().Name("penumbra_coordinator_requests_running").Help("Generations not ended.")
                        .Register(*registry_).Add({});
  documents_gauge_ = &BuildGauge().Name("penumbra_coordinator_documents").Help("Documents in the registry.")
                          .Register(*registry_).Add({});
  worker_up_ = &BuildGauge().Name("penumbra_coordinator_worker_up").Help("1 when the worker answers and serves.")
                    .Register(*registry_);
  worker_routed_ = &BuildGauge().Name("penumbra_coordinator_worker_routed")
                        .Help("Generations routed to the worker and not ended.").Register(*registry_);
  last_sweep_ = Clock::now();
  store_write_errors_ = &BuildCounter().Name("penumbra_coordinator_store_write_errors_total")
                             .Help("Writes a durable store refused (a full disk, an I/O error), by store.")
                             .Register(*registry_);
  store_degraded_ = &BuildGauge().Name("penumbra_coordinator_store_degraded")
                         .Help("1 while a durable store refuses writes (it retries by itself), by store.")
                         .Register(*registry_);
  tombstones_gauge_ = &BuildGauge().Name("penumbra_coordinator_document_tombstones")
                           .Help("Deleted documents some worker has not yet confirmed forgetting.")
                           .Register(*registry_).Add({});
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

// ---- validation ------------------------------------------------------------

Result<std::string> Coordinator::Tenant(const std::string& api_key) const {
  // The caller's client certificate, when it presented a verified one of role
  // client (a tenant may require it).
  const transport::PeerIdentity& peer = transport::CurrentPeer();
  const std::string cert = peer.verified && peer.role == transport::role::kClient ? peer.name : std::string();
  if (o_.tenants) return o_.tenants->Authenticate(api_key, cert);
  if (o_.api_keys.empty()) return std::string("default");
  std::shared_ptr<const std::map<std::string, std::string>> keys;
  {
    std::lock_guard<std::mutex> lk(api_keys_mu_);
    keys = api_keys_;
  }
  // Every key is compared (in constant time), so the time taken does not
  // tell which matched.
  const std::string* tenant = nullptr;
  if (api_key.size() <= tenants::kMaxApiKeyBytes) {
    for (const auto& [key, t] : *keys) {
      if (ConstantTimeEquals(key, api_key)) tenant = &t;
    }
  }
  if (!tenant) return Status::PermissionDenied(std::string(tenants::TenantRegistry::kNotAuthorized));
  return *tenant;
}

bool Coordinator::SeesInternals(const std::string& tenant) const {
  if (o_.tenants) {
    Result<tenants::TenantConfig> t = o_.tenants->Tenant(tenant);
    return t.ok() && t->admin;
  }
  return o_.api_keys.empty();  // no authentication: a development setup
}

ModelLimits Coordinator::model_limits() const {
  ModelLimits m;
  for (const WorkerState& w : workers_->states()) {
    m.vocab_size = std::max(m.vocab_size, w.health.vocab_size);
    if (w.healthy) m.max_context = std::max(m.max_context, w.health.max_context);
  }
  m.can_encode = codec_ && codec_->can_encode();
  m.can_decode = codec_ != nullptr;
  return m;
}

Result<std::vector<int32_t>> Coordinator::TextOrIds(const std::string& what, const std::string* text,
                                                    const std::vector<int32_t>* ids, bool starts_prompt,
                                                    const ModelLimits& model) const {
  if (!text) return *ids;  // validated: count and vocabulary
  if (!codec_ || !codec_->can_encode()) {
    return Status::InvalidArgument(what + ": the coordinator has no tokenizer for this model; send token_ids");
  }
  // The tokenizer's template (a BOS) only where the prompt starts.
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<int32_t> out, codec_->Encode(*text, starts_prompt));
  if (out.empty()) return Status::InvalidArgument(what + " is empty");
  for (int32_t id : out) {
    if (id < 0 || (model.vocab_size > 0 && id >= model.vocab_size)) {
      return Status::InvalidArgument(what + ": the tokenizer gave id " + std::to_string(id) +
                                     ", outside the workers' vocabulary [0, " + std::to_string(model.vocab_size) +
                                     ")");
    }
  }
  return out;
}

rpc::DocumentInfo Coordinator::ToInfo(const DocumentView& d) const {
  rpc::DocumentInfo i;
  i.id = d.id;
  i.name = d.name;
  i.tokens = d.tokens;
  i.state = d.state == DocumentState::kReady     ? rpc::DocumentState::READY
            : d.state == DocumentState::kFailed  ? rpc::DocumentState::FAILED
                                                 : rpc::DocumentState::FACTORING;
  i.created_unix_ms = d.created_unix_ms;
  if (!d.workers.empty()) i.worker = workers_->state(*d.workers.begin()).endpoint.name;
  if (d.state == DocumentState::kFailed) i.__set_error(d.error);
  i.factor_seconds = d.factor_seconds;
  i.factored_tokens = d.factored_tokens;
  return i;
}

std::vector<int> Coordinator::Route(const std::string& kv_policy, const std::vector<DocumentView>& docs) const {
  std::vector<WorkerState> s = workers_->states();
  const std::map<int, int64_t> held = docs_->held_per_worker();
  std::vector<PlacementCandidate> c;
  for (int i = 0; i < static_cast<int>(s.size()); ++i) {
    if (!s[i].healthy || (!kv_policy.empty() && s[i].health.kv_policy != kv_policy)) continue;
    PlacementCandidate w;
    w.worker = i;
    w.holds_document = !docs.empty() && docs.front().workers.count(i) > 0;
    w.routed = s[i].routed;
    auto it = held.find(i);
    w.documents_held = it == held.end() ? 0 : it->second;
    w.memory_free_bytes = s[i].stats.memory_free_bytes;
    c.push_back(w);
  }
  return OrderWorkers(std::move(c), o_.min_free_memory_bytes);
}

// ---- documents -------------------------------------------------------------

Result<rpc::DocumentInfo> Coordinator::DoPut(const rpc::PutDocumentRequest& r) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string tenant, Tenant(r.api_key));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (draining_) return Status::Unavailable("the coordinator is draining: not accepting documents");
  }
  const ModelLimits model = model_limits();
  PENUMBRA_RETURN_IF_ERROR(ValidatePutDocumentRequest(r, o_.limits, model));
  const int64_t context = model.max_context;
  if (context == 0) return Status::Unavailable("no healthy worker");
  if (!r.wait) {
    std::lock_guard<std::mutex> lk(mu_);
    int in_flight = 0;
    for (const BackgroundPut& p : puts_) in_flight += p.tenant == tenant && !*p.done;
    if (in_flight >= o_.max_background_puts_per_tenant) {
      return Status::ResourceExhausted("tenant '" + tenant + "' has " + std::to_string(in_flight) +
                                       " documents being factored in the background, the most at once "
                                       "(max_background_puts_per_tenant); retry when one is READY")
          .WithRetryAfter(1000);
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                            TextOrIds("document", r.__isset.text ? &r.text : nullptr,
                                      r.__isset.token_ids ? &r.token_ids : nullptr, /*starts_prompt=*/true, model));
  // A text document starts with the template's special tokens (a BOS); where
  // it follows another document they are left out.
  const int leading_special = r.__isset.text && codec_ ? codec_->LeadingSpecialTokens(ids) : 0;
  if (static_cast<int64_t>(ids.size()) >= context) {
    return Status::InvalidArgument("document of " + std::to_string(ids.size()) +
                                   " tokens leaves no room for a question in the model's " + std::to_string(context) +
                                   "-token context");
  }
  // Stored document bytes: its token ids, as the coordinator keeps them.
  const int64_t doc_bytes = static_cast<int64_t>(ids.size() * sizeof(int32_t));
  // A registry that cannot store (a full disk) refuses the put before a worker factors it.
  PENUMBRA_RETURN_IF_ERROR(docs_->CheckWritable());
  if (o_.tenants) PENUMBRA_RETURN_IF_ERROR(QuotaStatus(o_.tenants->ReserveDocumentBytes(tenant, doc_bytes), quota_refusals_, tenant));
  Result<DocumentView> added = docs_->Add(tenant, r.name, std::move(ids), leading_special);
  if (!added.ok()) {
    if (o_.tenants) o_.tenants->ReleaseDocumentBytes(tenant, doc_bytes);
    return added.status();
  }
  DocumentView d = std::move(*added);
  documents_put_->Add({{"tenant", tenant}}).Increment();
  const Clock::time_point deadline = DeadlineOf(r.deadline_ms, o_.put_timeout);
  if (!r.wait) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = puts_.begin(); it != puts_.end();) {
      if (*it->done) {
        it->thread.join();
        it = puts_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    puts_.push_back({std::thread([this, d, deadline, done] {
                       Factor(d, deadline);
                       *done = true;
                     }),
                     done, tenant});
    return ToInfo(d);
  }
  Factor(d, deadline);
  PENUMBRA_ASSIGN_OR_RETURN(DocumentView now, docs_->Get(tenant, d.id));
  if (now.state == DocumentState::kFailed && now.error_code == StatusCode::kInvalidArgument) {
    // Refused by the worker as input (not a failure of the service): not kept.
    (void)docs_->Remove(tenant, d.id);
    return Status::InvalidArgument(now.error);
  }
  // Factored but not stored (the registry's write failed): the put fails, typed.
  if (now.state == DocumentState::kFailed && now.not_stored) return Status(now.error_code, now.error);
  return ToInfo(now);
}

void Coordinator::Factor(DocumentView d, Clock::time_point deadline) {
  const Clock::time_point t0 = Clock::now();
  Status last = Status::Unavailable("no healthy worker");
  for (int w : Route("", {})) {
    rpc::WorkerGenerateRequest g;
    g.prompt = *d.ids;
    g.segment_ends = {d.tokens};
    g.cache_namespace = d.tenant;
    g.max_new_tokens = 0;  // prefill only: factored into the document cache
    g.deadline_ms = std::max<int64_t>(1, Left(deadline).count());
    std::string wid;
    Status s = workers_->Call(w, "put " + d.id, [&](rpc::WorkerClient& c) { c.Generate(wid, g); });
    if (!s.ok()) {
      last = s;
      if (s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kUnavailable) continue;
      break;
    }
    workers_->AddRouted(w, 1);
    rpc::TokenChunk ch;
    while (!ch.done) {
      // Short waits: the progress (tokens prefilled) is refreshed for GetDocument.
      const milliseconds wait = std::min(milliseconds(500), Left(deadline) + milliseconds(1000));
      s = workers_->Call(w, "put " + d.id, [&](rpc::WorkerClient& c) {
        c.Poll(ch, wid, 0, static_cast<int32_t>(wait.count()));
      }, wait + milliseconds(10000));
      if (!s.ok() && s.code() != StatusCode::kDeadlineExceeded) break;
      if (s.ok()) docs_->SetProgress(d.id, ch.usage.prefilled_tokens);
      if (!s.ok() && Clock::now() > deadline + std::chrono::seconds(30)) {
        (void)CancelOnWorker(w, wid);
        break;  // the worker does not answer past the deadline
      }
    }
    workers_->AddRouted(w, -1);
    if (!s.ok()) {
      last = s;
      continue;  // the worker went away: the next one
    }
    (void)workers_->Call(w, "release", [&](rpc::WorkerClient& c) { c.Release(wid); });
    if (ch.finish_reason == "prefilled") {
      const double secs = Seconds(Clock::now() - t0);
      factor_->Observe(secs);
      if (Status stored = docs_->SetReady(d.id, w, secs); !stored.ok()) {
        LOG(WARNING) << "document " << d.id << " factored, not stored: " << stored;
        return;
      }
      LOG(INFO) << "document " << d.id << " (" << d.tokens << " tokens) factored on worker "
                << workers_->state(w).endpoint.name << " in " << secs << " s";
      return;
    }
    last = ch.__isset.error_code ? transport::FromRpcError([&] {
      rpc::PenumbraError e;
      e.code = ch.error_code;
      e.message = ch.__isset.error_message ? ch.error_message : ch.finish_reason;
      return e;
    }())
                                 : Status::Internal("the worker ended the put: " + ch.finish_reason);
    if (last.code() != StatusCode::kResourceExhausted) break;
  }
  LOG(WARNING) << "document " << d.id << " not factored: " << last;
  if (Status s = docs_->SetFailed(d.id, last); !s.ok()) LOG(WARNING) << "document " << d.id << ": " << s;
}

void Coordinator::PutDocument(rpc::DocumentInfo& out, const rpc::PutDocumentRequest& request) {
  out = OrThrow(DoPut(request));
}

void Coordinator::GetDocument(rpc::DocumentInfo& out, const std::string& api_key, const std::string& document_id,
                              int64_t deadline_ms) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("document_id", document_id, o_.limits));
  Check(ValidateDeadline("deadline_ms", deadline_ms, o_.limits));
  out = ToInfo(OrThrow(docs_->Get(tenant, document_id)));
}

void Coordinator::ListDocuments(rpc::DocumentList& out, const rpc::ListDocumentsRequest& request) {
  const std::string tenant = OrThrow(Tenant(request.api_key));
  Check(ValidatePageSize(request.page_size, o_.limits));
  Check(ValidateId("page_token", request.page_token, o_.limits));
  Check(ValidateDeadline("deadline_ms", request.deadline_ms, o_.limits));
  DocumentPage p = OrThrow(docs_->List(tenant, request.page_token, request.page_size));
  out.documents.clear();
  for (const auto& d : p.documents) out.documents.push_back(ToInfo(d));
  out.next_page_token = p.next_page_token;
}

void Coordinator::DeleteDocument(const std::string& api_key, const std::string& document_id, int64_t deadline_ms) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("document_id", document_id, o_.limits));
  Check(ValidateDeadline("deadline_ms", deadline_ms, o_.limits));
  DocumentView d = OrThrow(docs_->Remove(tenant, document_id));
  if (o_.tenants) o_.tenants->ReleaseDocumentBytes(tenant, d.tokens * static_cast<int64_t>(sizeof(int32_t)));
  // Its cached state goes too (requests attached now keep theirs until they
  // end): at once on the workers known to hold it, on the others (and those
  // that did not answer) by the tombstone sweep.
  for (int w : d.workers) {
    Status s = ForgetOn(w, d.id, d.tenant, d.ids);
    if (s.ok()) {
      docs_->ConfirmForgotten(d.id, w);
    } else {
      LOG(WARNING) << "document " << d.id << ": cached state not dropped yet: " << s;
    }
  }
  tombstones_->Kick();
}

Status Coordinator::ForgetOn(int w, const std::string& id, const std::string& tenant,
                             const std::shared_ptr<const std::vector<int32_t>>& ids) {
  return workers_->Call(w, "forget " + id, [&](rpc::WorkerClient& c) {
    (void)c.ForgetPrefixes(*ids, {static_cast<int64_t>(ids->size())}, tenant);
  });
}

// ---- generation --------------------------------------------------------------

Result<std::shared_ptr<Coordinator::Request>> Coordinator::DoGenerate(const rpc::GenerateRequest& r) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string tenant, Tenant(r.api_key));
  return DoGenerateAs(tenant, r);
}

Result<std::shared_ptr<Coordinator::Request>> Coordinator::DoGenerateAs(const std::string& tenant,
                                                                        const rpc::GenerateRequest& r,
                                                                        bool job_item) {
  // The request's own bounds first: nothing below (a lookup, tokenizing,
  // concatenating, a worker) runs for a request past them.
  const ModelLimits model = model_limits();
  PENUMBRA_RETURN_IF_ERROR(ValidateGenerateRequest(r, o_.limits, model));
  DropExpired();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (draining_) return Status::Unavailable("the coordinator is draining: not accepting requests");
    if (running_ >= o_.max_running_requests) {
      return Status::ResourceExhausted(std::to_string(running_) + " requests are running, the most this coordinator "
                                       "takes; retry later");
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(Checked checked, CheckGenerate(tenant, r, model));
  // Quotas: the tokens it may generate are reserved now (the unused part
  // comes back when it ends), then one concurrent sequence.
  tenants::TokenReservation tokens;
  tenants::Lease sequence;
  if (o_.tenants) {
    PENUMBRA_RETURN_IF_ERROR(
        QuotaStatus(o_.tenants->ReserveTokens(tenant, checked.generated_bound, &tokens), quota_refusals_, tenant));
    PENUMBRA_RETURN_IF_ERROR(QuotaStatus(o_.tenants->AcquireSequence(tenant, &sequence), quota_refusals_, tenant));
  }
  rpc::WorkerGenerateRequest g = BuildGenerate(tenant, r, checked);
  g.owner_id = workers_->owner_id();
  std::vector<DocumentView> docs = std::move(checked.docs);

  Status last = Status::Unavailable(r.kv_policy.empty() ? "no healthy worker"
                                                        : "no healthy worker of kv policy " + r.kv_policy);
  auto q = std::make_shared<Request>();
  for (int w : Route(r.kv_policy, docs)) {
    g.stop_ids = r.stop_ids;
    if (!r.ignore_eos) {
      for (int32_t eos : workers_->state(w).health.eos_ids) {
        if (std::find(g.stop_ids.begin(), g.stop_ids.end(), eos) == g.stop_ids.end()) g.stop_ids.push_back(eos);
      }
    }
    std::string wid;
    Status s = workers_->Call(w, "generate", [&](rpc::WorkerClient& c) { c.Generate(wid, g); });
    if (s.ok()) {
      q->SetWhere(w, wid);
      break;
    }
    last = s;
    // Full or gone: the next worker; anything else is about the request.
    if (s.code() != StatusCode::kResourceExhausted && s.code() != StatusCode::kUnavailable) return s;
  }
  if (q->worker < 0) return last;
  workers_->AddRouted(q->worker, 1);
  for (const DocumentView& d : docs) docs_->AddWorker(d.id, q->worker);
  q->id = NewRequestId();
  q->tenant = tenant;
  q->stop = r.stop;
  q->created = Clock::now();
  if (r.deadline_ms > 0) q->deadline = q->created + milliseconds(r.deadline_ms);
  q->usage.prompt_tokens = static_cast<int64_t>(g.prompt.size());
  q->usage.queue_seconds = -1;
  q->usage.ttft_seconds = -1;
  q->sequence = std::move(sequence);
  q->tokens = std::move(tokens);
  q->gen = std::move(g);
  q->docs = std::move(docs);
  q->kv_policy = r.kv_policy;
  q->job_item = job_item;
  q->created_unix_ms = UnixMs();
  q->last_poll = q->created;
  // Journalled before anyone learns of it: a failed write fails the call
  // and leaves nothing running.
  std::unique_lock<std::mutex> jl(journal_mu_, std::defer_lock);
  if (journal_) {
    jl.lock();
    TenantUsage u;
    {
      std::lock_guard<std::mutex> lk(mu_);
      const TenantCounts& c = counts_[tenant];
      u = TenantUsage{c.requests + 1, c.failed, c.prompt, c.cached, c.generated};
    }
    Status js = journal_->Start(ToRecord(*q), u);
    if (!js.ok()) {
      journal_errors_->Increment();
      LOG(ERROR) << "request journal: " << js << "; the generation is refused";
      (void)workers_->Call(q->worker, "release", [&](rpc::WorkerClient& c) { c.Release(q->wid); });
      workers_->AddRouted(q->worker, -1);
      return Status::Unavailable("the coordinator cannot journal the request (" + js.message() + "); retry later")
          .WithRetryAfter(1000);
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  requests_[q->id] = q;
  ++running_;
  ++counts_[tenant].requests;
  return q;
}

JournalRecord Coordinator::ToRecord(const Request& q) const {
  JournalRecord r;
  r.request_id = q.id;
  r.tenant = q.tenant;
  r.worker = q.worker >= 0 ? workers_->state(q.worker).endpoint.name : "";
  r.handle = q.wid;
  r.job_item = q.job_item;
  for (const DocumentView& d : q.docs) r.document_ids.push_back(d.id);
  r.cache_namespace = q.gen.cache_namespace;
  // The question: the prompt after the documents' segments.
  const int64_t docs_end = q.gen.segment_ends.empty() ? 0 : q.gen.segment_ends.back();
  r.question.assign(q.gen.prompt.begin() + docs_end, q.gen.prompt.end());
  r.max_new_tokens = q.gen.max_new_tokens;
  r.sampling = JournalSampling{q.gen.sampling.temperature, q.gen.sampling.top_p, q.gen.sampling.top_k,
                               q.gen.sampling.seed};
  r.stop_ids = q.gen.stop_ids;
  r.stop = q.stop;
  r.kv_policy = q.kv_policy;
  r.share_weight = q.gen.share_weight;
  r.draws_done = q.gen.draws_done;
  r.made_before.assign(q.ids.begin(), q.ids.begin() + std::min<int64_t>(q.base, static_cast<int64_t>(q.ids.size())));
  r.resumes = q.resumes;
  r.created_unix_ms = q.created_unix_ms;
  if (q.deadline) r.deadline_unix_ms = q.created_unix_ms + std::chrono::duration_cast<milliseconds>(*q.deadline - q.created).count();
  return r;
}

void Coordinator::JournalMove(const Request& q) {
  if (!journal_) return;
  std::lock_guard<std::mutex> jl(journal_mu_);
  Status s = journal_->Put(ToRecord(q));
  if (!s.ok()) {
    journal_errors_->Increment();
    LOG(ERROR) << "request " << q.id << ": its move to another worker is not journalled (a restart would look for it "
               << "on the old one and start it again): " << s;
  }
}

Result<Coordinator::Checked> Coordinator::CheckGenerate(const std::string& tenant, const rpc::GenerateRequest& r,
                                                        const ModelLimits& model) const {
  Checked c;
  // Documents are the tenant's own, or a corpus another tenant publishes to
  // it (publishes_to), read in the owner's cache namespace; one request's
  // documents all have one owner, so nothing of one tenant is cached under
  // another's namespace. (At most max_document_ids of them, each once.)
  auto may_read = [&](const std::string& owner) { return o_.tenants && o_.tenants->CanRead(tenant, owner); };
  int64_t document_tokens = 0;
  for (const std::string& id : r.document_ids) {
    PENUMBRA_ASSIGN_OR_RETURN(DocumentView d, docs_->GetReadable(tenant, id, may_read));
    if (!c.docs.empty() && d.tenant != c.docs.front().tenant) {
      return Status::InvalidArgument("documents of one request must have one owner: '" + c.docs.front().id +
                                     "' and '" + id + "' do not");
    }
    if (d.state == DocumentState::kFactoring) {
      return Status::FailedPrecondition("document '" + id + "' is still being factored; retry when it is READY");
    }
    if (d.state == DocumentState::kFailed) {
      return Status::FailedPrecondition("document '" + id + "' failed to factor: " + d.error);
    }
    // As BuildGenerate concatenates them: a document after the first
    // without its leading special tokens.
    document_tokens += d.tokens - (c.docs.empty() ? 0 : d.leading_special);
    c.docs.push_back(std::move(d));
  }
  // The documents alone must leave room: checked before the question is
  // tokenized and before anything is concatenated.
  if (model.max_context > 0 && document_tokens + r.max_new_tokens >= model.max_context) {
    return Status::InvalidArgument("the documents (" + std::to_string(document_tokens) + " tokens) + max_new_tokens (" +
                                   std::to_string(r.max_new_tokens) + ") leave no room for a question in the model's " +
                                   std::to_string(model.max_context) + "-token context");
  }
  PENUMBRA_ASSIGN_OR_RETURN(c.question, TextOrIds("question", r.__isset.text ? &r.text : nullptr,
                                                  r.__isset.token_ids ? &r.token_ids : nullptr,
                                                  /*starts_prompt=*/c.docs.empty(), model));
  c.prompt_tokens = document_tokens + static_cast<int64_t>(c.question.size());
  PENUMBRA_RETURN_IF_ERROR(ValidatePromptLength(c.prompt_tokens, r.max_new_tokens, model));
  c.generated_bound = GeneratedTokensBound(c.prompt_tokens, r.max_new_tokens, model);
  return c;
}

rpc::WorkerGenerateRequest Coordinator::BuildGenerate(const std::string& tenant, const rpc::GenerateRequest& r,
                                                      const Checked& c) const {
  rpc::WorkerGenerateRequest g;
  g.prompt.reserve(static_cast<size_t>(c.prompt_tokens));
  for (const DocumentView& d : c.docs) {
    const int64_t skip = g.prompt.empty() ? 0 : d.leading_special;
    g.prompt.insert(g.prompt.end(), d.ids->begin() + skip, d.ids->end());
    g.segment_ends.push_back(static_cast<int64_t>(g.prompt.size()));
  }
  g.prompt.insert(g.prompt.end(), c.question.begin(), c.question.end());
  g.cache_namespace = c.docs.empty() ? tenant : c.docs.front().tenant;
  g.max_new_tokens = r.max_new_tokens;
  g.sampling = r.sampling;
  g.deadline_ms = r.deadline_ms;
  g.tenant = tenant;
  g.share_weight = 1.0;
  if (o_.tenants) {
    if (Result<tenants::TenantConfig> t = o_.tenants->Tenant(tenant); t.ok()) g.share_weight = t->weight;
  }
  return g;
}

Result<std::shared_ptr<Coordinator::Request>> Coordinator::Find(const std::string& tenant, const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->tenant != tenant) {
    return Status::NotFound("request '" + Excerpt(id, 40) + "' is unknown (or ended more than " +
                            std::to_string(std::chrono::duration_cast<std::chrono::seconds>(o_.keep_finished).count()) +
                            " s ago)");
  }
  return it->second;
}

Status Coordinator::Advance(Request& q, int64_t offset, milliseconds wait) {
  if (q.done || static_cast<int64_t>(q.ids.size()) > offset) return Status::OK();
  auto expire = [&] {
    if (q.deadline && !q.done && Clock::now() >= *q.deadline) {
      Finalize(q, "deadline", Status::DeadlineExceeded("the request's deadline passed after " +
                                                       std::to_string(q.ids.size()) + " generated tokens"));
    }
  };
  expire();
  if (q.done) return Status::OK();
  if (q.deadline) wait = std::min(wait, Left(*q.deadline));
  // A worker the health checks find unreachable (not one that drains: it
  // finishes what it runs) has lost the request: it goes on elsewhere at
  // once, rather than after a poll to a silent link times out.
  auto unreachable = [&] {
    const WorkerState st = workers_->state(q.worker);
    return !st.healthy && st.error != "draining";
  };
  auto lost = [&](const std::string& why) {
    const std::string what = "worker " + workers_->state(q.worker).endpoint.name + " lost the request: " + why;
    if (!Resume(q, what)) Finalize(q, "error", Status::Unavailable(what));
    return Status::OK();
  };
  if (unreachable()) return lost(workers_->state(q.worker).error);
  rpc::TokenChunk ch;
  const int64_t from = static_cast<int64_t>(q.ids.size()) - q.base;  // the current worker's offset
  // The worker answers a long poll within its wait; the margin stays under
  // a client's (10 s), so a silent worker is noticed here first.
  Status s = workers_->Call(q.worker, "poll", [&](rpc::WorkerClient& c) {
    c.Poll(ch, q.wid, from, static_cast<int32_t>(wait.count()));
  }, wait + kWorkerPollMargin);
  if (!s.ok()) {
    if (s.code() == StatusCode::kDeadlineExceeded) {
      workers_->CheckNow(q.worker);  // no answer in time: is the worker still there?
      if (unreachable()) return lost(s.message());
      expire();  // it is: nothing new in time
      return Status::OK();
    }
    return lost(s.message());
  }
  q.ids.insert(q.ids.end(), ch.ids.begin(), ch.ids.end());
  const int64_t prompt = q.usage.prompt_tokens;
  const double queued = q.usage.queue_seconds, ttft = q.usage.ttft_seconds;
  q.usage = ch.usage;
  q.usage.prompt_tokens = prompt;
  q.usage.generated_tokens = static_cast<int64_t>(q.ids.size());
  if (q.resumes > 0) {  // the first worker's timings are the request's
    if (queued >= 0) q.usage.queue_seconds = queued;
    if (ttft >= 0) q.usage.ttft_seconds = ttft;
  }
  if (!ch.ids.empty()) {
    if (codec_) {
      Result<std::string> text = codec_->Decode(q.ids);
      if (text.ok()) q.text = std::move(*text);
    }
    size_t cut = std::string::npos;
    for (const std::string& stop : q.stop) cut = std::min(cut, q.text.find(stop));
    if (cut != std::string::npos) {
      q.text.resize(cut);
      Finalize(q, "stop", Status::OK());  // Release cancels it on the worker
      return Status::OK();
    }
  }
  if (ch.done) {
    Status err = Status::OK();
    if (ch.__isset.error_code) {
      rpc::PenumbraError e;
      e.code = ch.error_code;
      e.message = ch.__isset.error_message ? ch.error_message : ch.finish_reason;
      err = transport::FromRpcError(e);
    }
    Finalize(q, ch.finish_reason, err);
  }
  expire();
  return Status::OK();
}

bool Coordinator::Resume(Request& q, const std::string& why) {
  const int64_t made = static_cast<int64_t>(q.ids.size());
  const int64_t left = q.gen.max_new_tokens - made;
  if (q.resumes >= kMaxResumes || left < 1 || q.gen.max_new_tokens < 1) return false;
  if (q.deadline && Clock::now() >= *q.deadline) return false;
  // The same request with what it generated so far as part of its prompt
  // (the documents stay leading segments: another worker attaches them from
  // its cache or a value-store node), the rest of its budget, and its random
  // stream where it was.
  rpc::WorkerGenerateRequest g = q.gen;
  g.prompt.insert(g.prompt.end(), q.ids.begin(), q.ids.end());
  g.max_new_tokens = static_cast<int32_t>(left);
  g.draws_done = q.gen.draws_done + made;
  if (q.deadline) g.deadline_ms = std::max<int64_t>(1, Left(*q.deadline).count());
  const int dead = q.worker;
  std::vector<int> order;
  bool dead_serves = false;
  for (int w : Route(q.kv_policy, q.docs)) {
    if (w == dead) {
      dead_serves = true;  // it serves again (it lost the generation, e.g. restarted): tried last
    } else {
      order.push_back(w);
    }
  }
  if (dead_serves) order.push_back(dead);
  for (int w : order) {
    std::string wid;
    Status s = workers_->Call(w, "generate", [&](rpc::WorkerClient& c) { c.Generate(wid, g); });
    if (!s.ok()) continue;
    LOG(WARNING) << "request " << q.id << ": " << why << "; resumed on worker " << workers_->state(w).endpoint.name
                 << " after " << made << " tokens";
    if (dead >= 0) workers_->AddRouted(dead, -1);
    workers_->AddRouted(w, 1);
    for (const DocumentView& d : q.docs) docs_->AddWorker(d.id, w);
    q.SetWhere(w, wid);
    q.base = made;
    ++q.resumes;
    resumed_->Increment();
    JournalMove(q);
    return true;
  }
  return false;
}

void Coordinator::Finalize(Request& q, const std::string& reason, const Status& error) {
  if (q.done) return;
  q.done = true;
  q.finish_reason = reason;
  q.error = error;
  q.finished = Clock::now();
  // Forgotten on the worker (cancelled first if it still runs there).
  if (q.worker >= 0) {
    (void)workers_->Call(q.worker, "release", [&](rpc::WorkerClient& c) { c.Release(q.wid); });
    workers_->AddRouted(q.worker, -1);
  }
  q.sequence.Release();
  // The tokens reserved at admission and not generated go back to the
  // tenant's bucket.
  q.tokens.Settle(q.usage.generated_tokens);
  requests_total_->Add({{"tenant", q.tenant}, {"reason", reason}}).Increment();
  prompt_tokens_->Add({{"tenant", q.tenant}}).Increment(static_cast<double>(q.usage.prompt_tokens));
  cached_tokens_->Add({{"tenant", q.tenant}}).Increment(static_cast<double>(q.usage.cached_prompt_tokens));
  generated_tokens_->Add({{"tenant", q.tenant}}).Increment(static_cast<double>(q.usage.generated_tokens));
  const double total = Seconds(q.finished - q.created);
  duration_->Observe(total);
  if (q.usage.ttft_seconds >= 0) ttft_->Observe(q.usage.ttft_seconds);
  if (q.usage.generated_tokens > 1 && q.usage.ttft_seconds >= 0 && total > q.usage.ttft_seconds) {
    tpot_->Observe((total - q.usage.ttft_seconds) / static_cast<double>(q.usage.generated_tokens - 1));
  }
  std::unique_lock<std::mutex> jl(journal_mu_, std::defer_lock);
  if (journal_) jl.lock();
  TenantUsage u;
  {
    std::lock_guard<std::mutex> lk(mu_);
    --running_;
    TenantCounts& c = counts_[q.tenant];
    if (reason == "error" || reason == "deadline") ++c.failed;
    c.prompt += q.usage.prompt_tokens;
    c.cached += q.usage.cached_prompt_tokens;
    c.generated += q.usage.generated_tokens;
    u = TenantUsage{c.requests, c.failed, c.prompt, c.cached, c.generated};
    idle_cv_.notify_all();
  }
  if (journal_) {
    Status s = journal_->Finish(q.id, q.tenant, u);
    if (!s.ok()) {
      journal_errors_->Increment();
      LOG(ERROR) << "request " << q.id << ": its end is not journalled (a restart takes it up again; tenant "
                 << q.tenant << "'s usage since the last write is lost): " << s;
    }
  }
}

void Coordinator::ToChunk(const Request& q, int64_t offset, rpc::GenerateChunk* out) const {
  out->request_id = q.id;
  out->ids.assign(q.ids.begin() + offset, q.ids.end());
  out->text = q.text;
  if (!q.done) {
    // The streamed text only grows: an ending that may still become a stop
    // string, or a character whose bytes have not all come (decoded as
    // U+FFFD for now), waits for the next chunk.
    size_t keep = out->text.size();
    static const std::string kReplacement = "\xEF\xBF\xBD";
    if (keep >= 3 && out->text.compare(keep - 3, 3, kReplacement) == 0) keep -= 3;
    for (const std::string& stop : q.stop) {
      for (size_t n = std::min(stop.size() - 1, keep); n > 0; --n) {
        if (out->text.compare(keep - n, n, stop, 0, n) == 0) {
          keep -= n;
          break;
        }
      }
    }
    out->text.resize(keep);
  }
  out->offset = offset;
  out->done = q.done;
  out->finish_reason = q.finish_reason;
  if (!q.error.ok()) {
    const rpc::PenumbraError e = transport::ToRpcError(q.error);
    out->__set_error_code(e.code);
    out->__set_error_message(e.message);
  }
  out->usage = q.usage;
}

void Coordinator::Generate(std::string& out, const rpc::GenerateRequest& request) {
  out = OrThrow(DoGenerate(request))->id;
}

void Coordinator::Poll(rpc::GenerateChunk& out, const std::string& api_key, const std::string& request_id,
                       int64_t offset, int32_t wait_ms) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateWaitMs(wait_ms, o_.limits));
  Check(ValidateId("request_id", request_id, o_.limits));
  std::shared_ptr<Request> q = OrThrow(Find(tenant, request_id));
  std::lock_guard<std::mutex> lk(q->mu);
  q->last_poll = Clock::now();
  if (offset < 0) Throw(Status::InvalidArgument("offset must be >= 0, got " + std::to_string(offset)));
  // A reattached generation's tokens are polled again from its worker: an
  // offset past what is known here waits for them (up to wait_ms).
  if (q->recovered && offset > static_cast<int64_t>(q->ids.size()) && !q->done) {
    const Clock::time_point until = Clock::now() + milliseconds(wait_ms);
    while (!q->done && offset > static_cast<int64_t>(q->ids.size()) && Clock::now() < until) {
      Status s = Advance(*q, static_cast<int64_t>(q->ids.size()), Left(until));
      if (!s.ok()) Throw(s);
    }
  }
  if (q->recovered && !q->done && offset > static_cast<int64_t>(q->ids.size())) {
    // Not made again yet (it restarted on another worker): nothing new.
    ToChunk(*q, static_cast<int64_t>(q->ids.size()), &out);
    out.offset = offset;
    return;
  }
  if (offset > static_cast<int64_t>(q->ids.size())) {
    Throw(Status::InvalidArgument("offset " + std::to_string(offset) + " is outside [0, " +
                                  std::to_string(q->ids.size()) + "], the tokens made so far"));
  }
  Status s = Advance(*q, offset, milliseconds(wait_ms));
  if (!s.ok()) Throw(s);
  ToChunk(*q, offset, &out);
}

void Coordinator::Cancel(const std::string& api_key, const std::string& request_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("request_id", request_id, o_.limits));
  std::shared_ptr<Request> q = OrThrow(Find(tenant, request_id));
  Status s;
  {
    std::lock_guard<std::mutex> lk(q->mu);
    if (q->done) return;
    s = CancelOnWorker(q->worker, q->wid);
  }
  if (!s.ok()) Throw(s);
}

Status Coordinator::CancelOnWorker(int w, const std::string& wid) {
  Status s = workers_->Call(w, "cancel", [&](rpc::WorkerClient& c) { c.Cancel(wid); });
  return s.code() == StatusCode::kNotFound ? Status::OK() : s;
}

void Coordinator::Complete(rpc::GenerateChunk& out, const rpc::GenerateRequest& request) {
  std::shared_ptr<Request> q = OrThrow(DoGenerate(request));
  std::lock_guard<std::mutex> lk(q->mu);
  while (!q->done) {
    // Short waits: a client that hangs up is noticed within one, and its
    // generation cancelled (nobody would read the answer).
    if (transport::CurrentPeerHungUp()) {
      hangups_->Increment();
      LOG(INFO) << "request " << q->id << ": the client of Complete closed its connection after "
                << q->ids.size() << " tokens; cancelled";
      (void)CancelOnWorker(q->worker, q->wid);
      Finalize(*q, "cancelled", Status::Cancelled("the client closed its connection"));
      Throw(Status::Cancelled("the client closed its connection"));
    }
    Status s = Advance(*q, static_cast<int64_t>(q->ids.size()), milliseconds(1000));
    if (!s.ok()) Throw(s);
  }
  if (q->finish_reason == "error" || q->finish_reason == "deadline") Throw(q->error);
  ToChunk(*q, 0, &out);
}

// ---- service -------------------------------------------------------------------

void Coordinator::DropExpired() {
  std::vector<std::shared_ptr<Request>> unpolled;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const Clock::time_point now = Clock::now();
    if (now - last_sweep_ < std::chrono::seconds(1)) return;
    last_sweep_ = now;
    for (auto it = requests_.begin(); it != requests_.end();) {
      Request& q = *it->second;
      std::unique_lock<std::mutex> ql(q.mu, std::try_to_lock);
      if (ql.owns_lock() && q.done && now - q.finished > o_.keep_finished) {
        ql.unlock();
        it = requests_.erase(it);
        continue;
      }
      if (ql.owns_lock() && !q.done) unpolled.push_back(it->second);
      ++it;
    }
  }
  // Streaming generations nobody polls any more are cancelled (a job's
  // items and Complete calls hold their mu while they wait: never here).
  for (auto& q : unpolled) {
    std::unique_lock<std::mutex> ql(q->mu, std::try_to_lock);
    if (!ql.owns_lock() || q->done || q->job_item || Clock::now() - q->last_poll <= o_.abandon_timeout) continue;
    abandoned_->Increment();
    LOG(INFO) << "request " << q->id << " (tenant " << q->tenant << "): not polled for "
              << std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - q->last_poll).count()
              << " s; cancelled";
    (void)CancelOnWorker(q->worker, q->wid);
    Finalize(*q, "cancelled", Status::Cancelled("no client polled the request for " +
                                                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                                                                   o_.abandon_timeout).count()) + " s"));
  }
  // Generations nobody polls still end on their worker: learn of it, so they
  // stop counting as running.
  for (auto& q : unpolled) {
    std::unique_lock<std::mutex> ql(q->mu, std::try_to_lock);
    if (ql.owns_lock()) (void)Advance(*q, static_cast<int64_t>(q->ids.size()), milliseconds(0));
  }
}

// ---- ownership: the request journal ----------------------------------------------

Status Coordinator::Recover(std::unique_ptr<RequestJournal> journal) {
  if (journal_) return Status::FailedPrecondition("the request journal is already taken");
  if (!journal) return Status::InvalidArgument("no request journal");
  if (journal->owner_id() != workers_->owner_id()) {
    return Status::InvalidArgument("the worker pool renews owner '" + workers_->owner_id() + "', the journal is '" +
                                   journal->owner_id() + "'s");
  }
  journal_ = std::move(journal);  // from here on every change is journalled
  // Usage counters first (Stats and /metrics go on from where they were).
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [tenant, u] : journal_->usage()) {
      counts_[tenant] = TenantCounts{u.requests, u.failed, u.prompt, u.cached, u.generated};
      prompt_tokens_->Add({{"tenant", tenant}}).Increment(static_cast<double>(u.prompt));
      cached_tokens_->Add({{"tenant", tenant}}).Increment(static_cast<double>(u.cached));
      generated_tokens_->Add({{"tenant", tenant}}).Increment(static_cast<double>(u.generated));
    }
  }
  // What each worker holds for this owner (nullopt: it did not answer; its
  // generations are looked at when polled, as for any worker lost later).
  std::vector<std::optional<std::set<std::string>>> held(static_cast<size_t>(workers_->size()));
  for (int i = 0; i < workers_->size(); ++i) {
    Result<std::vector<std::string>> h = workers_->Renew(i);
    if (h.ok()) {
      held[static_cast<size_t>(i)] = std::set<std::string>(h->begin(), h->end());
    } else {
      LOG(WARNING) << "recovery: worker " << workers_->state(i).endpoint.name << " did not answer: " << h.status();
    }
  }
  std::set<std::pair<int, std::string>> claimed;
  int64_t attached = 0, restarted = 0, dropped = 0, failed = 0;
  const ModelLimits model = model_limits();
  const Clock::time_point now = Clock::now();
  const int64_t now_unix = UnixMs();
  for (const JournalRecord& r : journal_->records()) {
    const int w = workers_->Find(r.worker);
    const bool has = w >= 0 && held[static_cast<size_t>(w)] && held[static_cast<size_t>(w)]->count(r.handle) > 0;
    if (r.job_item) {
      // A batch job's item: the job runs it again (its store says it is not
      // done), so this copy is cancelled -- one copy, one answer.
      if (has) {
        (void)CancelOnWorker(w, r.handle);
        (void)workers_->Call(w, "release", [&](rpc::WorkerClient& c) { c.Release(r.handle); });
        claimed.emplace(w, r.handle);
      }
      Status s = journal_->Remove(r.request_id);
      if (!s.ok()) LOG(ERROR) << "recovery: " << s;
      ++dropped;
      continue;
    }
    auto q = std::make_shared<Request>();
    q->id = r.request_id;
    q->tenant = r.tenant;
    q->stop = r.stop;
    q->kv_policy = r.kv_policy;
    q->recovered = true;
    q->created_unix_ms = r.created_unix_ms;
    q->created = now - milliseconds(std::max<int64_t>(0, now_unix - r.created_unix_ms));
    if (r.deadline_unix_ms > 0) q->deadline = q->created + milliseconds(r.deadline_unix_ms - r.created_unix_ms);
    q->last_poll = now;
    q->ids = r.made_before;
    q->base = static_cast<int64_t>(r.made_before.size());
    q->resumes = r.resumes;
    q->usage.queue_seconds = -1;
    q->usage.ttft_seconds = -1;
    q->usage.generated_tokens = q->base;
    if (codec_ && !q->ids.empty()) {
      if (Result<std::string> text = codec_->Decode(q->ids); text.ok()) q->text = std::move(*text);
    }
    // What was sent, rebuilt from the documents and the question (to start it
    // again if its worker lost it; a document deleted since: it cannot be).
    rpc::GenerateRequest g;
    g.document_ids = r.document_ids;
    g.__set_token_ids(r.question);
    g.max_new_tokens = r.max_new_tokens;
    Result<Checked> checked = CheckGenerate(r.tenant, g, model);
    if (checked.ok()) {
      q->gen = BuildGenerate(r.tenant, g, *checked);
      q->docs = std::move(checked->docs);
    } else {
      LOG(WARNING) << "recovery: request " << r.request_id << " cannot be started again if its worker lost it: "
                   << checked.status();
      q->gen.max_new_tokens = 0;  // Resume refuses
    }
    q->gen.cache_namespace = r.cache_namespace;
    q->gen.sampling.temperature = r.sampling.temperature;
    q->gen.sampling.top_p = r.sampling.top_p;
    q->gen.sampling.top_k = r.sampling.top_k;
    q->gen.sampling.seed = r.sampling.seed;
    q->gen.stop_ids = r.stop_ids;
    q->gen.share_weight = r.share_weight;
    q->gen.draws_done = r.draws_done;
    q->gen.owner_id = workers_->owner_id();
    q->usage.prompt_tokens = static_cast<int64_t>(q->gen.prompt.size());
    std::lock_guard<std::mutex> ql(q->mu);
    if (has || (w >= 0 && !held[static_cast<size_t>(w)])) {
      // Still there (or its worker did not answer: the first poll tells).
      q->SetWhere(w, r.handle);
      claimed.emplace(w, r.handle);
      workers_->AddRouted(w, 1);
      for (const DocumentView& d : q->docs) docs_->AddWorker(d.id, w);
      reattached_->Increment();
      ++attached;
    } else {
      // Its worker lost it (restarted, or it outlived our lease there): it
      // starts again from the tokens journalled.
      q->SetWhere(w, "");
      if (w >= 0) workers_->AddRouted(w, 1);  // Resume moves it off
      if (!Resume(*q, "its worker no longer has it after the coordinator's restart")) {
        ++failed;
        {
          std::lock_guard<std::mutex> lk(mu_);
          ++running_;  // Finalize counts it down
        }
        Finalize(*q, "error", Status::Unavailable("the request's worker lost it while the coordinator restarted, "
                                                  "and it could not be started again"));
        std::lock_guard<std::mutex> lk(mu_);
        requests_[q->id] = q;
        continue;
      }
      ++restarted;
    }
    std::lock_guard<std::mutex> lk(mu_);
    requests_[q->id] = q;
    ++running_;
  }
  // Generations of this owner that no record claims (started by a
  // coordinator killed before it journalled them): nobody will read them.
  int64_t orphans = 0;
  for (int i = 0; i < workers_->size(); ++i) {
    if (!held[static_cast<size_t>(i)]) continue;
    for (const std::string& h : *held[static_cast<size_t>(i)]) {
      if (claimed.count({i, h})) continue;
      (void)workers_->Call(i, "release", [&](rpc::WorkerClient& c) { c.Release(h); });
      orphans_cancelled_->Increment();
      ++orphans;
    }
  }
  LOG(INFO) << "recovery (owner " << workers_->owner_id() << "): " << attached << " generations reattached, "
            << restarted << " started again, " << dropped << " job items left to their jobs, " << failed
            << " failed, " << orphans << " orphans cancelled";
  return Status::OK();
}

// ---- batch jobs ----------------------------------------------------------------

Status Coordinator::StartJobs(JobServiceOptions options) {
  if (jobs_) return Status::FailedPrecondition("jobs are already started");
  PENUMBRA_ASSIGN_OR_RETURN(jobs_, JobService::Start(options, [this](const std::string& tenant,
                                                                     const rpc::GenerateRequest& r,
                                                                     const std::atomic<bool>& cancel) {
                              return RunItem(tenant, r, cancel);
                            }));
  return Status::OK();
}

Result<JobService*> Coordinator::Jobs() const {
  if (!jobs_) {
    return Status::FailedPrecondition("batch jobs need a coordinator with a data directory (--data-dir)");
  }
  return jobs_.get();
}

ItemOutcome Coordinator::RunItem(const std::string& tenant, const rpc::GenerateRequest& request,
                                 const std::atomic<bool>& cancel) {
  ItemOutcome out;
  rpc::GenerateRequest r = request;
  r.deadline_ms = 0;  // the job's window applies
  Result<std::shared_ptr<Request>> started = DoGenerateAs(tenant, r, /*job_item=*/true);
  if (!started.ok()) {
    out.status = started.status();
    return out;
  }
  Request& q = **started;
  std::lock_guard<std::mutex> lk(q.mu);
  bool cancel_sent = false;
  while (!q.done) {
    if (stopping_) {
      out.status = Status::Unavailable("the coordinator is stopping");
      return out;
    }
    if (cancel.load() && !cancel_sent) {
      // Its job was cancelled: the worker stops it as a client's Cancel
      // would, and the generation ends as "cancelled".
      cancel_sent = true;
      Status c = CancelOnWorker(q.worker, q.wid);
      if (!c.ok()) LOG(WARNING) << "jobs: cancelling a job's item: " << c;
    }
    // Short waits: a cancel of the job is noticed within one.
    Status s = Advance(q, static_cast<int64_t>(q.ids.size()), milliseconds(200));
    if (!s.ok()) {
      out.status = s;
      return out;
    }
  }
  if (drain_expired_ && (q.finish_reason == "cancelled" || q.finish_reason == "drained")) {
    // Stopped by an expired drain, not by its job: the item stays for the
    // next start (worth retrying), not answered "cancelled".
    out.status = Status::Unavailable("the coordinator stopped (its drain expired) before the item ended");
    return out;
  }
  rpc::GenerateChunk c;
  ToChunk(q, 0, &c);
  if (q.finish_reason == "error" || q.finish_reason == "deadline") {
    out.status = q.error.ok() ? Status::Internal("the generation failed") : q.error;
    return out;
  }
  out.text = c.text;
  out.ids = c.ids;
  out.finish_reason = c.finish_reason;
  out.usage = c.usage;
  return out;
}

std::optional<int64_t> Coordinator::JobQuota(const std::string& tenant) const {
  if (!o_.tenants) return std::nullopt;
  Result<tenants::TenantConfig> t = o_.tenants->Tenant(tenant);
  return t.ok() ? t->quotas.max_jobs_in_flight : std::nullopt;
}

Status Coordinator::ReloadTenants(const tenants::TenantsConfig& config) {
  if (!o_.tenants) return Status::FailedPrecondition("the coordinator was started without tenants");
  return o_.tenants->Reload(config);
}

Status Coordinator::ReloadApiKeys(std::map<std::string, std::string> keys) {
  if (o_.api_keys.empty()) return Status::FailedPrecondition("the coordinator was started without API keys");
  if (keys.empty()) return Status::InvalidArgument("no API keys");
  CoordinatorOptions check;
  check.api_keys = keys;
  PENUMBRA_RETURN_IF_ERROR(check.Validate());
  auto fresh = std::make_shared<const std::map<std::string, std::string>>(std::move(keys));
  std::lock_guard<std::mutex> lk(api_keys_mu_);
  api_keys_ = std::move(fresh);
  return Status::OK();
}

void Coordinator::SubmitJob(rpc::JobInfo& out, const rpc::SubmitJobRequest& request) {
  const std::string tenant = OrThrow(Tenant(request.api_key));
  JobService* jobs = OrThrow(Jobs());
  // Every item's shape (as Generate checks it) and the job's own bounds,
  // before any item is looked at further.
  const ModelLimits model = model_limits();
  Check(ValidateSubmitJobRequest(request, o_.limits, model));
  if (std::optional<int64_t> quota = JobQuota(tenant)) {
    // Counted from the store (unfinished jobs survive restarts; a lease in
    // memory would not).
    const int64_t unfinished = jobs->Unfinished(tenant);
    if (unfinished >= *quota) {
      quota_refusals_->Add({{"tenant", tenant}}).Increment();
      Throw(Status::ResourceExhausted("tenant '" + tenant + "' has " + std::to_string(unfinished) +
                                      " jobs in flight, its quota (max_jobs_in_flight " + std::to_string(*quota) +
                                      "); retry when one finishes")
                .WithRetryAfter(5000));
    }
  }
  out = OrThrow(jobs->Submit(tenant, request, [&](const rpc::GenerateRequest& r) -> Status {
    // Its documents, its prompt's length and whether its tokens can ever fit
    // the tenant's rate; nothing is concatenated or reserved here (each item
    // reserves when it runs).
    PENUMBRA_ASSIGN_OR_RETURN(Checked c, CheckGenerate(tenant, r, model));
    if (o_.tenants) return o_.tenants->CheckTokensFit(tenant, c.generated_bound).status;
    return Status::OK();
  }));
}

void Coordinator::GetJob(rpc::JobInfo& out, const std::string& api_key, const std::string& job_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  out = OrThrow(OrThrow(Jobs())->Get(tenant, job_id));
}

void Coordinator::ListJobs(rpc::JobList& out, const std::string& api_key, const std::string& page_token,
                           int32_t page_size) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidatePageSize(page_size, o_.limits));
  Check(ValidateId("page_token", page_token, o_.limits));
  out = OrThrow(OrThrow(Jobs())->List(tenant, page_token, page_size));
}

void Coordinator::GetJobResults(rpc::JobResults& out, const std::string& api_key, const std::string& job_id,
                                const std::string& after_custom_id, int32_t page_size) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  Check(ValidatePageSize(page_size, o_.limits));
  Check(ValidateId("after_custom_id", after_custom_id, o_.limits));
  out = OrThrow(OrThrow(Jobs())->Results(tenant, job_id, after_custom_id, page_size));
}

void Coordinator::CancelJob(rpc::JobInfo& out, const std::string& api_key, const std::string& job_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  out = OrThrow(OrThrow(Jobs())->Cancel(tenant, job_id));
}

void Coordinator::DeleteJob(const std::string& api_key, const std::string& job_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  Status s = OrThrow(Jobs())->Delete(tenant, job_id);
  if (!s.ok()) Throw(s);
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
      Finalize(*q, "drained", Status::Unavailable("the coordinator stopped: its drain expired before the request ended"));
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

void Coordinator::Stats(rpc::StatsResponse& out, const std::string& api_key) {
  const std::string tenant = OrThrow(Tenant(api_key));
  out.workers.clear();
  if (SeesInternals(tenant)) {
    const auto held = docs_->held_per_worker();
    std::vector<WorkerState> s = workers_->states();
    for (int i = 0; i < static_cast<int>(s.size()); ++i) {
      rpc::WorkerStatus w;
      w.name = s[i].endpoint.name;
      w.address = s[i].endpoint.address();
      w.healthy = s[i].healthy;
      w.kv_policy = s[i].health.kv_policy;
      w.backend = s[i].health.backend;
      w.running = s[i].stats.queued + s[i].stats.prefilling + s[i].stats.decoding;
      auto h = held.find(i);
      w.documents = h == held.end() ? 0 : h->second;
      if (!s[i].healthy) w.__set_error(s[i].error);
      out.workers.push_back(std::move(w));
    }
  }
  out.documents = docs_->count(tenant);
  std::lock_guard<std::mutex> lk(mu_);
  const TenantCounts c = counts_[tenant];
  out.requests = c.requests;
  out.requests_failed = c.failed;
  int64_t running = 0;
  for (const auto& [id, q] : requests_) {
    std::unique_lock<std::mutex> ql(q->mu, std::try_to_lock);
    if (q->tenant == tenant && (!ql.owns_lock() || !q->done)) ++running;
  }
  out.requests_running = running;
  out.prompt_tokens = c.prompt;
  out.cached_prompt_tokens = c.cached;
  out.generated_tokens = c.generated;
}

void Coordinator::RefreshMetrics() {
  DropExpired();
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_gauge_->Set(static_cast<double>(running_));
  }
  documents_gauge_->Set(static_cast<double>(docs_->count()));
  tombstones_gauge_->Set(static_cast<double>(docs_->tombstone_count()));
  auto store = [&](const char* name, const storage::WriteHealth& h) {
    std::lock_guard<std::mutex> lk(mu_);  // scrapes may come at once: one catch-up of the counter
    prometheus::Counter& c = store_write_errors_->Add({{"store", name}});
    if (static_cast<double>(h.write_errors) > c.Value()) c.Increment(static_cast<double>(h.write_errors) - c.Value());
    store_degraded_->Add({{"store", name}}).Set(h.degraded ? 1 : 0);
  };
  store("document_registry", docs_->write_health());
  if (jobs_) store("job_store", jobs_->write_health());
  if (journal_) store("request_journal", journal_->write_health());
  for (const WorkerState& w : workers_->states()) {
    worker_up_->Add({{"worker", w.endpoint.name}}).Set(w.healthy ? 1 : 0);
    worker_routed_->Add({{"worker", w.endpoint.name}}).Set(static_cast<double>(w.routed));
  }
}

}  // namespace penumbra::coordinator
