// What the coordinator counts: its Prometheus metrics (registered at
// construction, gauges refreshed before a scrape) and Stats, a tenant's
// usage (and the workers, for an admin).
#include "coordinator/server/coordinator.h"

#include <string>
#include <vector>

#include "coordinator/server/coordinator_internal.h"

namespace penumbra::coordinator {
using internal::OrThrow;

namespace {

const std::vector<double> kLatencyBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
const std::vector<double> kTokenBuckets = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1};

}  // namespace

void Coordinator::RegisterMetrics() {
  using namespace prometheus;
  requests_total_ = &BuildCounter()
                         .Name("penumbra_coordinator_requests_total")
                         .Help(
                             "Generations ended, by tenant and finish reason (stop, length, cancelled, deadline, "
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
  auto& sent = BuildCounter()
                   .Name("penumbra_coordinator_worker_documents_total")
                   .Help(
                       "Documents sent to workers with generations: by digest alone (the worker holds them) or with "
                       "their ids.")
                   .Register(*registry_);
  documents_by_digest_ = &sent.Add({{"sent", "digest"}});
  documents_with_ids_ = &sent.Add({{"sent", "ids"}});
  document_resends_ = &plain("penumbra_coordinator_document_resends_total",
                             "Generations sent again with their documents' ids: the worker named them by digest but "
                             "no longer held one (evicted, restarted).");
  reattached_ = &plain("penumbra_coordinator_requests_reattached_total",
                       "Generations taken over from the journal after a restart (still on their workers).");
  orphans_cancelled_ = &plain("penumbra_coordinator_orphans_cancelled_total",
                              "Generations a worker held for this coordinator without a journal record, cancelled.");
  abandoned_ = &plain("penumbra_coordinator_requests_abandoned_total",
                      "Streaming generations cancelled because no client polled them (abandon timeout).");
  drain_cancelled_ =
      &plain("penumbra_coordinator_drain_cancelled_total", "Generations cancelled because a drain expired.");
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
  running_gauge_ = &BuildGauge()
                        .Name("penumbra_coordinator_requests_running")
                        .Help("Generations not ended.")
                        .Register(*registry_)
                        .Add({});
  documents_gauge_ = &BuildGauge()
                          .Name("penumbra_coordinator_documents")
                          .Help("Documents in the registry.")
                          .Register(*registry_)
                          .Add({});
  worker_up_ = &BuildGauge()
                    .Name("penumbra_coordinator_worker_up")
                    .Help("1 when the worker answers and serves.")
                    .Register(*registry_);
  worker_routed_ = &BuildGauge()
                        .Name("penumbra_coordinator_worker_routed")
                        .Help("Generations routed to the worker and not ended.")
                        .Register(*registry_);
  group_formed_ = &BuildGauge()
                       .Name("penumbra_coordinator_group_formed")
                       .Help("1 while the context group is formed (every rank answers, all in one formation).")
                       .Register(*registry_);
  group_formations_ = &BuildGauge()
                           .Name("penumbra_coordinator_group_formations")
                           .Help(
                               "Formations of the context group this coordinator started (a group that lost a "
                               "rank is formed again).")
                           .Register(*registry_);
  store_write_errors_ = &BuildCounter()
                             .Name("penumbra_coordinator_store_write_errors_total")
                             .Help("Writes a durable store refused (a full disk, an I/O error), by store.")
                             .Register(*registry_);
  store_degraded_ = &BuildGauge()
                         .Name("penumbra_coordinator_store_degraded")
                         .Help("1 while a durable store refuses writes (it retries by itself), by store.")
                         .Register(*registry_);
  tombstones_gauge_ = &BuildGauge()
                           .Name("penumbra_coordinator_document_tombstones")
                           .Help("Deleted documents some worker has not yet confirmed forgetting.")
                           .Register(*registry_)
                           .Add({});
}

void Coordinator::Stats(rpc::StatsResponse& out, const std::string& api_key) {
  const std::string tenant = OrThrow(Tenant(api_key));
  out.workers.clear();
  if (SeesInternals(tenant)) {
    const auto held = docs_->held_per_worker();
    std::vector<WorkerState> s = workers_->states();
    const std::vector<GroupState> groups = workers_->groups();
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
      if (!s[i].stats.capacity_limit.empty()) {
        w.__set_capacity_context_tokens(s[i].stats.capacity_context_tokens);
        w.__set_capacity_sequences(s[i].stats.capacity_held + s[i].stats.capacity_more);
        w.__set_capacity_limit(s[i].stats.capacity_limit);
      }
      if (!s[i].stats.last_wait_reason.empty()) w.__set_last_wait_reason(s[i].stats.last_wait_reason);
      if (!s[i].endpoint.group.empty()) {
        w.__set_group(s[i].endpoint.group);
        w.__set_group_rank(s[i].endpoint.rank);
        for (const GroupState& g : groups) {
          if (g.name == s[i].endpoint.group) w.__set_group_state(g.formed ? "formed" : "not formed: " + g.error);
        }
      }
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
  for (const GroupState& g : workers_->groups()) {
    group_formed_->Add({{"group", g.name}}).Set(g.formed ? 1 : 0);
    group_formations_->Add({{"group", g.name}}).Set(static_cast<double>(g.formations));
  }
}

}  // namespace penumbra::coordinator
