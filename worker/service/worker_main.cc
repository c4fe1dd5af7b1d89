// penumbra-worker: one engine (one GPU, or the CPU) behind the control API
// (transport/worker.thrift), batching requests continuously, with its own
// Prometheus /metrics. Started by `penumbra serve` or by hand:
//
//   penumbra-worker --model DIR [--config engine.yaml] [--port 0] [--port-file F]
//
// Prints one line when serving ("penumbra-worker: serving ... on HOST:PORT");
// with --port-file it also writes {"port": P, "metrics_port": M} there (atomically).
// SIGTERM or SIGINT: stops accepting, lets running requests finish (at most
// --drain-seconds; the rest end "cancelled" for the coordinator to retry),
// then exits 0. SIGHUP rereads the control API's TLS files (for new
// connections) and stops nothing.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/crypto.h"
#include "common/logging.h"
#include "common/process.h"
#include "store_node/store_node.h"
#include "transport/metrics_http.h"
#include "transport/tls.h"
#include "worker/engine/engine.h"
#include "worker/engine/engine_flags.h"
#include "worker/service/scheduler.h"
#include "worker/service/worker_options.h"
#include "worker/service/worker_server.h"

namespace penumbra {
namespace {

constexpr const char* kUsage = "usage: penumbra-worker --model DIR [options]\n";

// Scheduler counters mirrored into Prometheus at each scrape.
class WorkerMetrics {
 public:
  WorkerMetrics(service::Scheduler* s, service::WorkerServer* server,
                std::function<storage::WriteHealth()> store_health)
      : s_(s),
        server_(server),
        store_health_(std::move(store_health)),
        registry_(std::make_shared<prometheus::Registry>()) {
    auto counter = [&](const std::string& name, const std::string& help) -> prometheus::Counter& {
      return prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
    };
    auto gauge = [&](const std::string& name, const std::string& help) -> prometheus::Gauge& {
      return prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add({});
    };
    submitted_ = &counter("penumbra_worker_requests_submitted_total", "Requests accepted by the scheduler.");
    finished_ = &counter("penumbra_worker_requests_finished_total", "Requests ended (any reason).");
    failed_ = &counter("penumbra_worker_requests_failed_total", "Requests ended by an error or their deadline.");
    cancelled_ = &counter("penumbra_worker_requests_cancelled_total", "Requests cancelled.");
    lease_expired_ = &counter("penumbra_worker_lease_expired_total",
                              "Generations cancelled because their coordinator's lease expired (--lease-ms).");
    decode_steps_ = &counter("penumbra_worker_decode_steps_total", "Batched decode steps.");
    interleaved_ = &counter("penumbra_worker_interleaved_decode_steps_total",
                            "Decode steps taken while a prompt was part-way through its prefill.");
    prefill_pieces_ = &counter("penumbra_worker_prefill_pieces_total", "Prefill pieces run between decode steps.");
    prompt_ = &counter("penumbra_worker_prompt_tokens_total", "Prompt tokens of admitted requests.");
    cached_ = &counter("penumbra_worker_cached_prompt_tokens_total",
                       "Prompt tokens attached from the document cache instead of prefilled.");
    generated_ = &counter("penumbra_worker_generated_tokens_total", "Tokens generated.");
    waits_ = &counter("penumbra_worker_admission_waits_total",
                      "Admissions deferred because the request did not fit beside the running ones.");
    queued_ = &gauge("penumbra_worker_requests_queued", "Requests waiting for admission.");
    prefilling_ = &gauge("penumbra_worker_requests_prefilling", "Requests in prefill.");
    decoding_ = &gauge("penumbra_worker_requests_decoding", "Requests in the decode batch.");
    piece_max_ = &gauge("penumbra_worker_prefill_piece_max_seconds",
                        "The longest prefill piece so far: the longest the running batch waited for one.");
    memory_free_ =
        &gauge("penumbra_worker_memory_free_bytes",
               "Free memory of the worker's device (host RAM on a CPU worker), sampled about once a second.");
    documents_ = &gauge("penumbra_worker_documents_cached", "Documents in the memory tier of the document cache.");
    document_device_ = &gauge("penumbra_worker_documents_device_bytes", "Device bytes of the cached documents' state.");
    document_host_ = &gauge("penumbra_worker_documents_host_bytes", "Host bytes of the cached documents' values.");
    tier0_bytes_ = &gauge("penumbra_worker_documents_tier0_bytes",
                          "Device bytes of hot documents' values copied to spare GPU memory (tier 0).");
    tier0_documents_ = &gauge("penumbra_worker_documents_tier0", "Documents with a copy in tier 0.");
    tier0_promotions_ = &counter("penumbra_worker_documents_tier0_promotions_total",
                                 "Documents' values copied to tier 0 (completed copies).");
    tier0_demotions_ = &counter("penumbra_worker_documents_tier0_demotions_total",
                                "Tier-0 copies freed (over the watermark, replaced, evicted, or for an admission).");
    store_hits_ = &counter("penumbra_worker_documents_store_hits_total", "Documents read back from the disk tier.");
    store_corruptions_ = &counter("penumbra_worker_documents_store_corruptions_total",
                                  "Stored documents found damaged (dropped and recomputed, never served).");
    store_write_errors_ = &counter("penumbra_worker_store_write_errors_total",
                                   "Writes the local --prefix-store refused (a full disk, an I/O error).");
    store_degraded_ = &gauge("penumbra_worker_store_degraded",
                             "1 while the local --prefix-store refuses writes (it retries by itself).");
    store_fetch_failures_ = &counter("penumbra_worker_documents_store_fetch_failures_total",
                                     "Stored documents the store did not answer for (a node down, slow or its "
                                     "breaker open): the requests prefilled them instead.");
    fetching_ = &gauge("penumbra_worker_requests_fetching",
                       "Queued requests whose stored documents are being read (off the decode loop).");
    capacity_sequences_ = &gauge("penumbra_worker_capacity_sequences",
                                 "Sequences of --capacity-context tokens the worker holds plus those that fit "
                                 "beside them now (the KV policy's estimate against free memory and max_batch).");
    capacity_tokens_ = &gauge("penumbra_worker_capacity_context_tokens",
                              "The sequence length penumbra_worker_capacity_sequences counts.");
    auto& by_policy = prometheus::BuildGauge()
                          .Name("penumbra_worker_documents_by_policy")
                          .Help(
                              "Documents in the memory tier held under each KV policy (kv_policy auto: full or "
                              "shadowkv per document; otherwise the worker's one policy).")
                          .Register(*registry_);
    auto& by_policy_device = prometheus::BuildGauge()
                                 .Name("penumbra_worker_documents_by_policy_device_bytes")
                                 .Help("Device bytes of the cached documents held under each KV policy.")
                                 .Register(*registry_);
    auto& by_policy_host = prometheus::BuildGauge()
                               .Name("penumbra_worker_documents_by_policy_host_bytes")
                               .Help("Host bytes of the cached documents held under each KV policy.")
                               .Register(*registry_);
    for (const char* p : {"full", "shadowkv", "spindlekv", "specontext"}) {
      by_policy_.push_back({p, &by_policy.Add({{"policy", p}}), &by_policy_device.Add({{"policy", p}}),
                            &by_policy_host.Add({{"policy", p}})});
    }
    moves_ = &counter("penumbra_worker_document_moves_total",
                      "kv_policy auto: cached documents moved from the exact form (full) to shadowkv.");
    move_seconds_ = &counter("penumbra_worker_document_move_seconds_total",
                             "Seconds the worker's loop spent on those moves (one layer per step).");
    move_failures_ = &counter("penumbra_worker_document_move_failures_total",
                              "Moves that failed (the document stayed exact; retried later).");
    auto& limit = prometheus::BuildGauge()
                      .Name("penumbra_worker_capacity_limit")
                      .Help(
                          "1 for what stops the next sequence of that length: device memory, host memory, "
                          "max_batch, or unknown (no estimate).")
                      .Register(*registry_);
    for (const char* l : {"device memory", "host memory", "max_batch", "unknown"}) {
      capacity_limit_.emplace_back(l, &limit.Add({{"limit", l}}));
    }
  }
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  // Called at each scrape (the HTTP server's threads).
  void Refresh() {
    std::lock_guard<std::mutex> lk(mu_);
    const service::SchedulerStats n = s_->stats();
    auto bump = [](prometheus::Counter* c, int64_t now, int64_t& last) {
      if (now > last) c->Increment(static_cast<double>(now - last));
      last = now;
    };
    bump(submitted_, n.submitted, last_.submitted);
    bump(finished_, n.finished, last_.finished);
    bump(failed_, n.failed, last_.failed);
    bump(cancelled_, n.cancelled, last_.cancelled);
    bump(lease_expired_, server_->lease_expired(), last_lease_expired_);
    bump(decode_steps_, n.decode_steps, last_.decode_steps);
    bump(interleaved_, n.interleaved_decode_steps, last_.interleaved_decode_steps);
    bump(prefill_pieces_, n.prefill_pieces, last_.prefill_pieces);
    bump(prompt_, n.prompt_tokens, last_.prompt_tokens);
    bump(cached_, n.cached_prompt_tokens, last_.cached_prompt_tokens);
    bump(generated_, n.generated_tokens, last_.generated_tokens);
    bump(waits_, n.admission_waits, last_.admission_waits);
    queued_->Set(static_cast<double>(n.queued));
    prefilling_->Set(static_cast<double>(n.prefilling));
    decoding_->Set(static_cast<double>(n.decoding));
    piece_max_->Set(n.prefill_piece_max_seconds);
    if (n.memory_free_bytes >= 0) memory_free_->Set(static_cast<double>(n.memory_free_bytes));
    const service::SchedulerStats::Documents& d = n.documents;
    documents_->Set(static_cast<double>(d.cached));
    document_device_->Set(static_cast<double>(d.device_bytes));
    document_host_->Set(static_cast<double>(d.host_bytes));
    tier0_bytes_->Set(static_cast<double>(d.tier0_bytes));
    tier0_documents_->Set(static_cast<double>(d.tier0_documents));
    bump(tier0_promotions_, d.tier0_promotions, last_.documents.tier0_promotions);
    bump(tier0_demotions_, d.tier0_demotions, last_.documents.tier0_demotions);
    for (const ByPolicy& p : by_policy_) {
      auto it = d.by_policy.find(p.policy);
      const DocumentFormUsage u = it == d.by_policy.end() ? DocumentFormUsage{} : it->second;
      p.documents->Set(static_cast<double>(u.documents));
      p.device_bytes->Set(static_cast<double>(u.device_bytes));
      p.host_bytes->Set(static_cast<double>(u.host_bytes));
    }
    bump(moves_, d.moves, last_.documents.moves);
    bump(move_failures_, d.move_failures, last_.documents.move_failures);
    if (d.move_seconds > last_.documents.move_seconds) {
      move_seconds_->Increment(d.move_seconds - last_.documents.move_seconds);
      last_.documents.move_seconds = d.move_seconds;
    }
    bump(store_hits_, d.store_hits, last_.documents.store_hits);
    bump(store_corruptions_, d.store_corruptions, last_.documents.store_corruptions);
    const storage::WriteHealth h = store_health_();
    bump(store_write_errors_, h.write_errors, last_store_write_errors_);
    store_degraded_->Set(h.degraded ? 1 : 0);
    bump(store_fetch_failures_, d.store_fetch_failures, last_.documents.store_fetch_failures);
    fetching_->Set(static_cast<double>(n.fetching));
    if (!n.capacity.limit.empty()) {
      capacity_sequences_->Set(static_cast<double>(n.capacity.sequences()));
      capacity_tokens_->Set(static_cast<double>(n.capacity.context_tokens));
      for (auto& [name, g] : capacity_limit_) g->Set(name == n.capacity.limit ? 1 : 0);
    }
  }

 private:
  service::Scheduler* s_;
  service::WorkerServer* server_;
  std::function<storage::WriteHealth()> store_health_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::mutex mu_;
  service::SchedulerStats last_;
  int64_t last_lease_expired_ = 0;
  prometheus::Counter* lease_expired_;
  prometheus::Counter *submitted_, *finished_, *failed_, *cancelled_, *decode_steps_, *interleaved_, *prefill_pieces_,
      *prompt_, *cached_, *generated_, *waits_;
  prometheus::Gauge *queued_, *prefilling_, *decoding_, *piece_max_, *memory_free_;
  prometheus::Gauge *documents_, *document_device_, *document_host_, *tier0_bytes_, *tier0_documents_;
  prometheus::Counter *tier0_promotions_, *tier0_demotions_, *store_hits_, *store_corruptions_, *store_fetch_failures_;
  prometheus::Counter* store_write_errors_;
  prometheus::Gauge* store_degraded_;
  int64_t last_store_write_errors_ = 0;
  prometheus::Gauge* fetching_;
  struct ByPolicy {
    std::string policy;
    prometheus::Gauge *documents, *device_bytes, *host_bytes;
  };
  std::vector<ByPolicy> by_policy_;
  prometheus::Counter *moves_, *move_seconds_, *move_failures_;
  prometheus::Gauge *capacity_sequences_, *capacity_tokens_;
  std::vector<std::pair<std::string, prometheus::Gauge*>> capacity_limit_;
};

// Each store node's calls as this worker's client saw them (deadlines and
// circuit breaker), labelled node="HOST:PORT", mirrored at each scrape.
class StoreNodeMetrics {
 public:
  StoreNodeMetrics(prometheus::Registry& registry, std::vector<std::shared_ptr<transport::RemoteDocumentStore>> nodes)
      : nodes_(std::move(nodes)) {
    auto& state = prometheus::BuildGauge()
                      .Name("penumbra_store_node_breaker_state")
                      .Help("The store node's circuit breaker: 0 closed, 1 open (calls fail at once), 2 half-open.")
                      .Register(registry);
    auto& calls = prometheus::BuildCounter()
                      .Name("penumbra_store_node_calls_total")
                      .Help("Calls sent to the store node (a retry counts again).")
                      .Register(registry);
    auto& failures = prometheus::BuildCounter()
                         .Name("penumbra_store_node_failures_total")
                         .Help(
                             "Calls the store node did not answer (unreachable, connection lost, or past their "
                             "deadline).")
                         .Register(registry);
    auto& timeouts = prometheus::BuildCounter()
                         .Name("penumbra_store_node_timeouts_total")
                         .Help("Calls to the store node past their deadline.")
                         .Register(registry);
    auto& rejected = prometheus::BuildCounter()
                         .Name("penumbra_store_node_rejected_total")
                         .Help("Calls failed at once by the store node's open circuit breaker (never sent).")
                         .Register(registry);
    auto& opens = prometheus::BuildCounter()
                      .Name("penumbra_store_node_breaker_opens_total")
                      .Help("Times the store node's circuit breaker opened.")
                      .Register(registry);
    for (const auto& n : nodes_) {
      const std::map<std::string, std::string> label = {{"node", n->name()}};
      rows_.push_back(Row{&state.Add(label),
                          &calls.Add(label),
                          &failures.Add(label),
                          &timeouts.Add(label),
                          &rejected.Add(label),
                          &opens.Add(label),
                          {}});
    }
  }
  void Refresh() {
    std::lock_guard<std::mutex> lk(mu_);
    auto bump = [](prometheus::Counter* c, int64_t now, int64_t& last) {
      if (now > last) c->Increment(static_cast<double>(now - last));
      last = now;
    };
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const transport::StoreNodeCallStats n = nodes_[i]->call_stats();
      Row& r = rows_[i];
      r.state->Set(static_cast<double>(static_cast<int>(n.breaker)));
      bump(r.calls, n.calls, r.last.calls);
      bump(r.failures, n.failures, r.last.failures);
      bump(r.timeouts, n.timeouts, r.last.timeouts);
      bump(r.rejected, n.rejected, r.last.rejected);
      bump(r.opens, n.opens, r.last.opens);
    }
  }

 private:
  struct Row {
    prometheus::Gauge* state;
    prometheus::Counter *calls, *failures, *timeouts, *rejected, *opens;
    transport::StoreNodeCallStats last;
  };
  std::vector<std::shared_ptr<transport::RemoteDocumentStore>> nodes_;
  std::mutex mu_;
  std::vector<Row> rows_;
};

// Device bytes one token of context takes (WorkerHealth's estimate, by
// which the coordinator places long documents): full attention's K and V of
// every layer; ShadowKV's low-rank key factor and landmarks (its values
// live in host memory). Under auto, ShadowKV's: what a document that does
// not fit the exact form's budget is held in. SpindleKV's at most: the
// tokens a KV head holds (its query heads' kept tokens, reserve_ratio of the
// prompt each) with key and value entries of their own (f32) and 24 bytes of
// position, references, magnitudes and query-head mask.
int64_t DeviceBytesPerToken(Engine& e) {
  const ModelConfig& c = e.config();
  const int64_t es = static_cast<int64_t>(DTypeSize(e.backend().act_dtype()));
  const int64_t kv = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  if (e.options().kv_policy == "full") return 2 * c.num_layers * kv * es;
  if (e.options().kv_policy == "spindlekv") {
    const double r = e.options().spindlekv.reserve_ratio;
    const double held = std::min(1.0, r * c.num_heads / std::max(1, c.num_kv_heads));
    const double per_layer = held * (2.0 * kv * sizeof(float) + c.num_kv_heads * 24.0);
    return static_cast<int64_t>(std::ceil(c.num_layers * per_layer));
  }
  const ShadowKvOptions& o = e.options().shadowkv;
  const int64_t lm_bytes = o.landmark_fp8() ? 1 : es;
  return c.num_layers * (o.rank * es + kv * lm_bytes * o.landmarks_per_chunk / std::max(1, o.chunk_size));
}

// Every flag: the worker's table, the engine's, the security and admin flags.
Args Flags() {
  Args a;
  service::WorkerOptionTable().AddFlags(a);
  AddEngineFlags(a);
  transport::AddSecurityFlags(a);
  transport::AddAdminFlags(a);
  return a;
}

Status Run(int argc, char** argv) {
  Args a = Flags();
  Status ps = a.Parse(argc, argv, 1);
  if (!ps.ok()) return Status::InvalidArgument(ps.message() + "\n" + kUsage + "options:\n" + a.Help());
  service::WorkerProcessOptions wo;
  PENUMBRA_RETURN_IF_ERROR(service::WorkerOptionTable().ApplyFlags(a, &wo));
  if (wo.model.empty()) return Status::InvalidArgument(std::string("--model is required\n") + kUsage);

  EngineOptions eo;
  PENUMBRA_RETURN_IF_ERROR(ApplyEngineFlags(a, &eo));
  if (wo.prefix_cache_mb > 0) {
    eo.runtime.prefix_cache_bytes = static_cast<size_t>(wo.prefix_cache_mb) << 20;
  } else if (eo.runtime.prefix_cache_bytes == 0) {
    eo.runtime.prefix_cache_bytes = size_t{4096} << 20;  // a worker serves documents
  }
  PENUMBRA_ASSIGN_OR_RETURN(transport::ProcessSecurity security, transport::SecurityFromFlags(a));
  // The cluster secret: the store plane's key, and the document keys' (a
  // document's key is then an HMAC nobody without the secret can compute).
  std::optional<ClusterSecret> secret;
  if (!security.cluster_secret_file.empty()) {
    Result<ClusterSecret> loaded = ClusterSecret::Load(security.cluster_secret_file);
    if (!loaded.ok()) return loaded.status().WithContext("--cluster-secret-file");
    secret = *loaded;
    eo.runtime.document_key_secret = secret->Derive("document-keys");
  }
  if (a.Has("prefix-store")) eo.prefix_store.path = wo.prefix_store;
  std::vector<std::shared_ptr<transport::RemoteDocumentStore>> store_nodes;
  if (a.Has("store-node")) {
    if (a.Has("prefix-store")) return Status::InvalidArgument("--store-node and --prefix-store: one or the other");
    eo.prefix_store.path.clear();
    transport::RemoteStoreOptions calls = wo.store_calls;
    calls.plane.secret = secret;
    // A node off loopback without the secret is refused unless --insecure.
    calls.allow_plaintext_remote = security.insecure;
    PENUMBRA_ASSIGN_OR_RETURN(eo.document_store, transport::ConnectStoreNodes(wo.store_nodes, calls, &store_nodes));
    // Stored documents are read whole before their request is admitted: no
    // value is read from a node during a decode step.
    eo.runtime.prefix_store_fetch_whole = true;
  }
  PENUMBRA_ASSIGN_OR_RETURN(transport::AdminHttpOptions admin, transport::AdminFromFlags(a, security));
  const int64_t drain_s = wo.drain_seconds;
  service::SchedulerOptions so = wo.scheduler;
  so.max_batch = wo.max_batch > 0 ? wo.max_batch : eo.runtime.max_batch;
  eo.runtime.max_batch = std::max(eo.runtime.max_batch, so.max_batch);
  const std::string& host = wo.host;
  const std::string& name = wo.name;
  PENUMBRA_RETURN_IF_ERROR(
      transport::CheckPlaintextBind("the control API", host, security.tls.enabled(), security.insecure));

  // A group's rank 0 keeps idle followers hearing from it well within the
  // group's timeout.
  eo.runtime.group_heartbeat_ms =
      std::clamp<int64_t>(static_cast<int64_t>(wo.group.timeout_s * 1000 / 4), 50, eo.runtime.group_heartbeat_ms);
  std::unique_ptr<Engine> engine;
  if (wo.random_weights >= 0) {
    PENUMBRA_ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(wo.model + "/config.json"));
    PENUMBRA_ASSIGN_OR_RETURN(engine, Engine::OpenRandom(c, eo, static_cast<uint64_t>(wo.random_weights)));
  } else {
    PENUMBRA_ASSIGN_OR_RETURN(engine, Engine::Open(wo.model, eo));
  }
  PENUMBRA_ASSIGN_OR_RETURN(auto scheduler, service::Scheduler::Create(&engine->runtime(), so));
  service::WorkerIdentity id;
  id.model = wo.model + (wo.random_weights >= 0 ? " (random weights)" : "");
  id.backend = engine->backend().name();
  id.kv_policy = engine->options().kv_policy;
  id.kv_forms = engine->runtime().policy().Forms();
  id.max_context = engine->config().max_position_embeddings;
  id.vocab_size = engine->config().vocab_size;
  id.eos_ids = engine->config().eos_token_ids;
  id.device_bytes_per_token = DeviceBytesPerToken(*engine);
  // A rank of a context group: formed by the coordinator (JoinGroup).
  std::unique_ptr<service::GroupMember> group;
  if (!wo.group.name.empty()) {
    service::GroupMemberOptions go = wo.group;
    go.host = host;
    go.tls = security.tls;
    go.insecure = security.insecure;
    group = std::make_unique<service::GroupMember>(scheduler.get(), &engine->runtime(), go);
  }
  transport::ThriftServerOptions to;
  to.host = host;
  to.port = wo.port;
  to.name = "control API";
  to.limits.max_frame_bytes = wo.max_frame_mb << 20;
  to.limits.max_string_bytes = to.limits.max_frame_bytes;
  if (security.tls.enabled()) {
    transport::TlsServerOptions t;  // mutual TLS: only coordinators
    t.files = security.tls;
    t.require_client_certificate = true;
    t.client_roles = {transport::role::kCoordinator};
    to.tls = t;
  }
  PENUMBRA_ASSIGN_OR_RETURN(auto server, service::WorkerServer::Start(scheduler.get(), id, to, wo.lease, group.get()));
  WorkerMetrics metrics(scheduler.get(), server.get(), [&engine] { return engine->prefix_store_health(); });
  StoreNodeMetrics node_metrics(*metrics.registry(), store_nodes);
  std::unique_ptr<transport::MetricsServer> metrics_server;
  if (admin.port >= 0) {
    service::Scheduler* s = scheduler.get();
    PENUMBRA_ASSIGN_OR_RETURN(metrics_server, transport::MetricsServer::Start(
                                                  metrics.registry(), admin,
                                                  [&metrics, &node_metrics] {
                                                    metrics.Refresh();
                                                    node_metrics.Refresh();
                                                  },
                                                  [s] { return s->accepting(); }));
  }
  const int mport = metrics_server ? metrics_server->port() : -1;
  if (!wo.port_file.empty()) {
    nlohmann::json j = {{"port", server->port()}, {"metrics_port", mport}, {"pid", static_cast<int64_t>(getpid())}};
    PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(wo.port_file, j.dump() + "\n"));
  }
  std::printf("penumbra-worker %s: serving %s (%s, kv policy %s) on %s:%d (%s), admin on %s:%d%s\n", name.c_str(),
              id.model.c_str(), id.backend.c_str(), id.kv_policy.c_str(), host.c_str(), server->port(),
              security.tls.enabled() ? "mutual TLS" : "plaintext", admin.host.c_str(), mport,
              group ? (", rank " + std::to_string(wo.group.rank) + " of group " + wo.group.name + " (" +
                       std::to_string(wo.group.world) + " ranks)")
                          .c_str()
                    : "");
  std::fflush(stdout);

  // SIGHUP rereads the control API's TLS files (for new connections) and
  // stops nothing; files that do not load keep the old ones.
  const int sig = WaitForStopSignal([&] {
    if (!security.tls.enabled()) {
      LOG(INFO) << "penumbra-worker " << name << ": SIGHUP: nothing to reload (no TLS files); serving on";
    } else if (Status s = server->ReloadTls(); s.ok()) {
      LOG(INFO) << "penumbra-worker " << name << ": SIGHUP: the control API's TLS files reloaded ("
                << security.tls.cert_file << ", " << security.tls.key_file << ", CA " << security.tls.ca_file
                << ") for new connections; serving on";
    } else {
      LOG(ERROR) << "penumbra-worker " << name << ": SIGHUP: " << s << "; serving on";
    }
  });
  LOG(INFO) << "penumbra-worker " << name << ": signal " << sig << ", draining (at most " << drain_s << " s)";
  if (group && wo.group.rank > 0) {
    // A follower owns no request: it stops serving and exits without
    // waiting for the steps it runs for rank 0 (its group breaks; rank 0's
    // requests fail over). What it is storing is kept first.
    server->Stop();
    if (metrics_server) metrics_server->Stop();
    group->Stop();
    if (!engine->runtime().DrainPrefixStores(std::chrono::seconds(drain_s))) {
      LOG(WARNING) << "penumbra-worker " << name << ": documents still being stored after " << drain_s
                   << " s; not waiting for them";
    }
    std::printf("penumbra-worker %s: stopped\n", name.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(0);
  }
  // Drain: no new requests; the running ones finish unless they outlast the
  // limit, then the scheduler's destruction ends them "cancelled".
  if (!scheduler->Drain(std::chrono::seconds(drain_s))) {
    LOG(WARNING) << "penumbra-worker " << name << ": requests still running after " << drain_s << " s; cancelled";
    scheduler->Stop();  // the rest end "cancelled" now, not after the answers' wait below
  }
  // The answers of what finished are read before the port closes.
  if (!scheduler->WaitReleased(std::chrono::seconds(std::min<int64_t>(drain_s, 10)))) {
    LOG(WARNING) << "penumbra-worker " << name << ": answers not read by their clients; dropped";
  }
  if (group) group->Stop();  // rank 0: the followers return
  scheduler->Stop();         // cancels what is left; pollers see "cancelled"
  server->Stop();
  if (metrics_server) metrics_server->Stop();
  // Documents being stored are kept (a store node that stopped answering
  // holds this up at most --drain-seconds; its calls have deadlines).
  if (!engine->runtime().DrainPrefixStores(std::chrono::seconds(drain_s))) {
    LOG(WARNING) << "penumbra-worker " << name << ": documents still being stored after " << drain_s
                 << " s; not waiting for them";
  }
  std::printf("penumbra-worker %s: stopped\n", name.c_str());
  return Status::OK();
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  return penumbra::ServerMain("penumbra-worker", penumbra::kUsage, argc, argv, penumbra::Run,
                              [] { return penumbra::Flags().Help(); });
}
