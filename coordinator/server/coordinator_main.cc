// penumbra-coordinator: the public API (transport/penumbra.thrift) in front
// of N penumbra-worker processes, with its own Prometheus /metrics.
//
//   penumbra-coordinator --model DIR --workers [NAME=]HOST:PORT,... [--port 0] [--port-file F]
//
// --model names the model the workers serve (its tokenizer.json tokenizes
// requests here). --data-dir DIR keeps what survives a restart there
// (RocksDB): the documents (DIR/documents: their tokens; the workers' own
// document stores keep their factored states) and the batch jobs (DIR/jobs),
// which a restarted coordinator resumes. Prints one line when serving; with --port-file it writes
// {"port": P, "metrics_port": M, "pid": N} there (atomically). SIGTERM or
// SIGINT: stops taking requests, lets running generations end (at most
// --drain-seconds), exits 0. SIGHUP rereads --tenants (or --api-keys) and the
// public API's TLS files (for new connections) and stops nothing; a file
// that does not load keeps the old configuration, with the reason logged.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <unistd.h>
#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/crypto.h"
#include "common/logging.h"
#include "common/process.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/worker_pool.h"
#include "transport/metrics_http.h"
#include "transport/thrift_util.h"
#include "transport/tls.h"

namespace penumbra {
namespace {

constexpr const char* kUsage = "usage: penumbra-coordinator --model DIR --workers [NAME=]HOST:PORT,... [options]\n";

Status Run(int argc, char** argv) {
  Args a;
  a.Flag("model", "the workers' model directory (its tokenizer tokenizes requests)")
      .Flag("workers", "comma-separated [NAME=]HOST:PORT of the workers' control API")
      .Flag("host", "address of the public API (default 127.0.0.1; any other needs TLS and tenants, or --insecure)")
      .Flag("port", "public API port (default 0: one the OS picks)")
      .Flag("port-file", "write {\"port\": P, \"metrics_port\": M, \"pid\": N} here once serving")
      .Flag("tenants", "tenants YAML (configs/tenants.yaml: hashed API keys, quotas); reread on SIGHUP")
      .Flag("api-keys",
            "YAML file `keys: {KEY: TENANT, ...}` in plain text (keys of 16+ bytes), no quotas: for "
            "development only (default: none, every caller is tenant \"default\")")
      .Flag("max-frame-mb", "largest request frame in MiB (default 64)")
      .Flag("max-running", "generations running at once, all tenants (default 4096)")
      .Flag("min-free-memory-mb",
            "placement: workers reporting less free device memory are tried after the others "
            "(default 2048)")
      .Flag("max-documents", "documents per tenant (default 10000)")
      .Flag("health-interval-ms", "how often each worker is checked (default 1000)")
      .Flag("drain-seconds", "on SIGTERM, how long running generations may finish (default 30)")
      .Flag("data-dir",
            "directory for what survives a restart: documents and batch jobs (default: none: documents "
            "in memory, jobs off)")
      .Flag("job-concurrency", "job items generating at once, all jobs (default 16)")
      .Flag("abandon-timeout-s", "a streaming generation no client polls for this long is cancelled (default 120)")
      .Flag("max-connections", "open connections of the public API (default 4096)")
      .Flag("max-connections-per-peer", "open connections of the public API from one address (default 1024)")
      // Request limits (coordinator/server/validation.h RequestLimits): past
      // one a call is INVALID_ARGUMENT naming it.
      .Flag("max-document-ids", "documents one generation may follow (default 64)")
      .Flag("max-new-tokens", "a generation's max_new_tokens at most (default 1048576)")
      .Flag("max-stop-ids", "stop_ids of one generation (default 1000, at most 1000)")
      .Flag("max-stop-strings", "stop strings of one generation (default 16)")
      .Flag("max-text-bytes", "bytes of one document's or question's text (default 33554432)")
      .Flag("max-deadline-s", "deadline_ms of any call at most this, in seconds (default 604800: a week)")
      .Flag("max-job-items", "items of one batch job (default 50000)")
      .Flag("max-job-metadata-bytes", "bytes of a batch job's metadata (default 16384)")
      .Flag("max-completion-window-s", "a batch job's completion window at most (default 604800: a week)")
      .Flag("max-background-puts",
            "documents one tenant may have factoring in the background (wait = false) "
            "at once (default 16)");
  transport::AddSecurityFlags(a);
  transport::AddAdminFlags(a);
  Status ps = a.Parse(argc, argv, 1);
  if (!ps.ok()) return Status::InvalidArgument(ps.message() + "\n" + kUsage + "options:\n" + a.Help());
  if (!a.Has("model") || !a.Has("workers")) {
    return Status::InvalidArgument(std::string("--model and --workers are required\n") + kUsage);
  }
  coordinator::CoordinatorOptions co;
  if (a.Has("api-keys")) {
    PENUMBRA_ASSIGN_OR_RETURN(co.api_keys, coordinator::LoadApiKeys(a.Get("api-keys")));
    LOG(WARNING) << "--api-keys: plain-text API keys without quotas, admin or client certificates (a development "
                    "setup); deployments use --tenants (configs/tenants.yaml: hashed keys)";
  }
  if (a.Has("tenants")) {
    PENUMBRA_ASSIGN_OR_RETURN(tenants::TenantsConfig tc, tenants::LoadTenantsConfig(a.Get("tenants")));
    PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<tenants::TenantRegistry> reg, tenants::TenantRegistry::Create(tc));
    co.tenants = std::move(reg);
  }
  PENUMBRA_ASSIGN_OR_RETURN(co.max_running_requests, a.GetIntIn("max-running", co.max_running_requests, 1, 1 << 24));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t min_free_mb,
                            a.GetIntIn("min-free-memory-mb", co.min_free_memory_bytes >> 20, 0, int64_t{1} << 30));
  co.min_free_memory_bytes = min_free_mb << 20;
  PENUMBRA_ASSIGN_OR_RETURN(co.max_documents_per_tenant,
                            a.GetIntIn("max-documents", co.max_documents_per_tenant, 1, int64_t{1} << 32));
  {
    coordinator::RequestLimits& l = co.limits;
    PENUMBRA_ASSIGN_OR_RETURN(int64_t docs, a.GetIntIn("max-document-ids", l.max_document_ids, 1, 4096));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t new_tokens, a.GetIntIn("max-new-tokens", l.max_new_tokens, 1, 1 << 30));
    PENUMBRA_ASSIGN_OR_RETURN(
        int64_t stop_ids, a.GetIntIn("max-stop-ids", l.max_stop_ids, 0, coordinator::RequestLimits::kMaxStopIdsLimit));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t stops, a.GetIntIn("max-stop-strings", l.max_stop_strings, 0, 1024));
    PENUMBRA_ASSIGN_OR_RETURN(l.max_text_bytes, a.GetIntIn("max-text-bytes", l.max_text_bytes, 1, int64_t{1} << 31));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t deadline_s,
                              a.GetIntIn("max-deadline-s", l.max_deadline_ms / 1000, 1, int64_t{365} * 86400));
    l.max_deadline_ms = deadline_s * 1000;
    PENUMBRA_ASSIGN_OR_RETURN(l.max_job_items, a.GetIntIn("max-job-items", l.max_job_items, 1, int64_t{1} << 24));
    PENUMBRA_ASSIGN_OR_RETURN(l.max_job_metadata_bytes,
                              a.GetIntIn("max-job-metadata-bytes", l.max_job_metadata_bytes, 0, int64_t{1} << 26));
    PENUMBRA_ASSIGN_OR_RETURN(
        l.max_completion_window_s,
        a.GetIntIn("max-completion-window-s", l.max_completion_window_s, 1, int64_t{365} * 86400));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t puts,
                              a.GetIntIn("max-background-puts", co.max_background_puts_per_tenant, 1, 4096));
    l.max_document_ids = static_cast<int>(docs);
    l.max_new_tokens = static_cast<int>(new_tokens);
    l.max_stop_ids = static_cast<int>(stop_ids);
    l.max_stop_strings = static_cast<int>(stops);
    co.max_background_puts_per_tenant = static_cast<int>(puts);
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t abandon_s, a.GetIntIn("abandon-timeout-s", co.abandon_timeout.count() / 1000, 1,
                                                          co.keep_finished.count() / 1000));
  co.abandon_timeout = std::chrono::seconds(abandon_s);
  PENUMBRA_RETURN_IF_ERROR(co.Validate());
  PENUMBRA_ASSIGN_OR_RETURN(int64_t port, a.GetIntIn("port", 0, 0, 65535));
  PENUMBRA_ASSIGN_OR_RETURN(transport::ProcessSecurity security, transport::SecurityFromFlags(a));
  PENUMBRA_ASSIGN_OR_RETURN(transport::AdminHttpOptions admin, transport::AdminFromFlags(a, security));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t frame_mb, a.GetIntIn("max-frame-mb", 64, 1, 1024));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t drain_s, a.GetIntIn("drain-seconds", 30, 0, 86400));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t health_ms, a.GetIntIn("health-interval-ms", 1000, 10, 600000));
  const std::string host = a.Get("host", "127.0.0.1");
  const bool tls = security.tls.enabled();
  PENUMBRA_RETURN_IF_ERROR(transport::CheckPlaintextBind("the public API", host, tls, security.insecure));
  const bool authenticated = co.tenants || !co.api_keys.empty();
  if (!authenticated) {
    if (!transport::IsLoopbackHost(host) && !security.insecure) {
      return Status::InvalidArgument("the public API on " + host +
                                     " without tenants: refused (give --tenants; "
                                     "--insecure lets anyone who reaches it use the service)");
    }
    LOG(WARNING) << "no tenants: every caller of the public API is tenant \"default\" (a development setup)";
  }

  std::vector<coordinator::WorkerEndpoint> endpoints;
  std::stringstream list(a.Get("workers"));
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    PENUMBRA_ASSIGN_OR_RETURN(auto e, coordinator::ParseWorkerEndpoint(item, "w" + std::to_string(endpoints.size())));
    endpoints.push_back(e);
  }
  coordinator::WorkerPoolOptions wo;
  wo.health_interval = std::chrono::milliseconds(health_ms);
  wo.limits.max_frame_bytes = static_cast<int32_t>(frame_mb << 20);
  wo.limits.max_string_bytes = wo.limits.max_frame_bytes;
  if (tls) {
    transport::TlsClientOptions to;
    to.files = security.tls;
    to.server_roles = {transport::role::kWorker};
    PENUMBRA_ASSIGN_OR_RETURN(wo.tls, transport::TlsClientContext::Create(to));
  } else {
    for (const auto& e : endpoints) {
      PENUMBRA_RETURN_IF_ERROR(
          transport::CheckPlaintextBind("the control API of worker " + e.name, e.host, false, security.insecure));
    }
  }
  // The owner id the workers' leases are held under: the journal's (a
  // restart on the same data directory is the same owner), else new.
  std::unique_ptr<coordinator::RequestJournal> journal;
  if (a.Has("data-dir")) {
    PENUMBRA_ASSIGN_OR_RETURN(journal, coordinator::RequestJournal::Open(a.Get("data-dir") + "/requests"));
    wo.owner_id = journal->owner_id();
  } else {
    wo.owner_id = "c-" + RandomHandle();
  }
  PENUMBRA_ASSIGN_OR_RETURN(auto pool, coordinator::WorkerPool::Create(endpoints, wo));
  std::unique_ptr<TextCodec> codec;
  if (Result<std::unique_ptr<TextCodec>> c = TextCodec::ForModel(a.Get("model")); c.ok()) {
    codec = std::move(*c);
  } else {
    LOG(WARNING) << "no tokenizer (" << c.status() << "): requests must carry token ids";
  }
  std::unique_ptr<coordinator::DocumentRegistry> documents;
  if (a.Has("data-dir")) {
    std::error_code ec;
    std::filesystem::create_directories(a.Get("data-dir"), ec);
    if (ec) return Status::IOError("--data-dir " + a.Get("data-dir") + ": " + ec.message());
    PENUMBRA_ASSIGN_OR_RETURN(
        documents, coordinator::DocumentRegistry::Open(a.Get("data-dir") + "/documents", co.max_documents_per_tenant));
  }
  auto handler = std::make_shared<coordinator::Coordinator>(co, std::move(codec), a.Get("model"), pool.get(),
                                                            std::move(documents));
  // Before jobs resume: their items' old copies are cancelled, then run again.
  if (journal) PENUMBRA_RETURN_IF_ERROR(handler->Recover(std::move(journal)));
  if (a.Has("data-dir")) {
    coordinator::JobServiceOptions jo;
    jo.store.path = a.Get("data-dir") + "/jobs";
    jo.store.max_items_per_job = static_cast<size_t>(co.limits.max_job_items);
    PENUMBRA_ASSIGN_OR_RETURN(int64_t conc, a.GetIntIn("job-concurrency", jo.max_running_items, 1, 4096));
    jo.max_running_items = static_cast<int>(conc);
    PENUMBRA_RETURN_IF_ERROR(handler->StartJobs(jo));
  }
  transport::ThriftServerOptions so;
  so.host = host;
  so.port = static_cast<int>(port);
  so.name = "public API";
  so.limits = wo.limits;
  PENUMBRA_ASSIGN_OR_RETURN(int64_t max_conn, a.GetIntIn("max-connections", so.limits.max_connections, 1, 1 << 20));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t max_peer,
                            a.GetIntIn("max-connections-per-peer", so.limits.max_connections_per_peer, 1, 1 << 20));
  so.limits.max_connections = static_cast<int32_t>(max_conn);
  so.limits.max_connections_per_peer = static_cast<int32_t>(max_peer);
  if (tls) {
    // Server TLS; a client certificate is optional (a tenant may require
    // one), and one given must be of role client or admin.
    transport::TlsServerOptions t;
    t.files = security.tls;
    t.client_roles = {transport::role::kClient, transport::role::kAdmin};
    so.tls = t;
  }
  PENUMBRA_ASSIGN_OR_RETURN(auto server,
                            transport::ThriftServer::Start(std::make_shared<rpc::PenumbraProcessor>(handler), so));
  std::unique_ptr<transport::MetricsServer> metrics;
  if (admin.port >= 0) {
    coordinator::Coordinator* h = handler.get();
    PENUMBRA_ASSIGN_OR_RETURN(metrics,
                              transport::MetricsServer::Start(handler->metrics(), admin, [h] { h->RefreshMetrics(); }));
  }
  const int mport = metrics ? metrics->port() : -1;
  if (a.Has("port-file")) {
    nlohmann::json j = {{"port", server->port()}, {"metrics_port", mport}, {"pid", static_cast<int64_t>(getpid())}};
    PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(a.Get("port-file"), j.dump() + "\n"));
  }
  int healthy = 0;
  for (const auto& w : pool->states()) healthy += w.healthy;
  std::printf("penumbra-coordinator: serving %s with %d of %d workers healthy on %s:%d (%s), admin on %s:%d%s\n",
              a.Get("model").c_str(), healthy, pool->size(), host.c_str(), server->port(), tls ? "TLS" : "plaintext",
              admin.host.c_str(), mport, authenticated ? "" : " (no API keys: every caller is tenant \"default\")");
  std::fflush(stdout);

  // SIGHUP rereads the tenants (or the plain API keys) and the public API's
  // TLS files; whatever fails to load keeps what was in use. It stops nothing.
  const int sig = WaitForStopSignal([&] {
    LOG(INFO) << "penumbra-coordinator: SIGHUP: reloading the configuration";
    if (co.tenants) {
      Result<tenants::TenantsConfig> tc = tenants::LoadTenantsConfig(a.Get("tenants"));
      Status s = tc.ok() ? handler->ReloadTenants(*tc) : tc.status();
      if (s.ok()) {
        LOG(INFO) << "penumbra-coordinator: SIGHUP: tenants reloaded from " << a.Get("tenants") << " ("
                  << tc->tenants.size() << " tenants)";
      } else {
        LOG(ERROR) << "penumbra-coordinator: SIGHUP: tenants not reloaded, the old ones stay: " << s;
      }
    }
    if (a.Has("api-keys")) {
      Result<std::map<std::string, std::string>> keys = coordinator::LoadApiKeys(a.Get("api-keys"));
      const size_t n = keys.ok() ? keys->size() : 0;
      Status s = keys.ok() ? handler->ReloadApiKeys(std::move(*keys)) : keys.status();
      if (s.ok()) {
        LOG(INFO) << "penumbra-coordinator: SIGHUP: API keys reloaded from " << a.Get("api-keys") << " (" << n
                  << " keys)";
      } else {
        LOG(ERROR) << "penumbra-coordinator: SIGHUP: API keys not reloaded, the old ones stay: " << s;
      }
    }
    if (tls) {
      if (Status s = server->ReloadTls(); s.ok()) {
        LOG(INFO) << "penumbra-coordinator: SIGHUP: the public API's TLS files reloaded (" << security.tls.cert_file
                  << ", " << security.tls.key_file << ", CA " << security.tls.ca_file << ") for new connections";
      } else {
        LOG(ERROR) << "penumbra-coordinator: SIGHUP: " << s;
      }
    }
    if (!co.tenants && !a.Has("api-keys") && !tls) {
      LOG(INFO) << "penumbra-coordinator: SIGHUP: nothing to reload (no tenants, API keys or TLS files); serving on";
    }
  });
  LOG(INFO) << "penumbra-coordinator: signal " << sig << ", draining (at most " << drain_s << " s)";
  if (!handler->Drain(std::chrono::seconds(drain_s))) {
    LOG(WARNING) << "penumbra-coordinator: generations still running after " << drain_s << " s";
  }
  server->Stop();
  if (metrics) metrics->Stop();
  std::printf("penumbra-coordinator: stopped\n");
  return Status::OK();
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  return penumbra::ServerMain("penumbra-coordinator", penumbra::kUsage, argc, argv, penumbra::Run);
}
