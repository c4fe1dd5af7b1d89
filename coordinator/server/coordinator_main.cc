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
// {"port": P, "metrics_port": M, "openai_port": O, "pid": N} there
// (atomically; O is -1 without --openai-port). SIGTERM or
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
#include "coordinator/server/coordinator_options.h"
#include "coordinator/server/worker_pool.h"
#include "transport/metrics_http.h"
#include "transport/thrift_util.h"
#include "transport/tls.h"

namespace penumbra {
namespace {

constexpr const char* kUsage = "usage: penumbra-coordinator --model DIR --workers [NAME=]HOST:PORT,... [options]\n";

// Every flag: the coordinator's table, the security and admin flags.
Args Flags() {
  Args a;
  coordinator::CoordinatorOptionTable().AddFlags(a);
  transport::AddSecurityFlags(a);
  transport::AddAdminFlags(a);
  return a;
}

Status Run(int argc, char** argv) {
  Args a = Flags();
  Status ps = a.Parse(argc, argv, 1);
  if (!ps.ok()) return Status::InvalidArgument(ps.message() + "\n" + kUsage + "options:\n" + a.Help());
  coordinator::CoordinatorProcessOptions po;
  PENUMBRA_RETURN_IF_ERROR(coordinator::CoordinatorOptionTable().ApplyFlags(a, &po));
  if (po.model.empty() || (po.workers.empty() && po.groups.empty())) {
    return Status::InvalidArgument(std::string("--model and --workers (or --groups) are required\n") + kUsage);
  }
  coordinator::CoordinatorOptions& co = po.coordinator;
  if (a.Has("api-keys")) {
    PENUMBRA_ASSIGN_OR_RETURN(co.api_keys, coordinator::LoadApiKeys(po.api_keys));
    LOG(WARNING) << "--api-keys: plain-text API keys without quotas, admin or client certificates (a development "
                    "setup); deployments use --tenants (configs/tenants.yaml: hashed keys)";
  }
  if (a.Has("tenants")) {
    PENUMBRA_ASSIGN_OR_RETURN(tenants::TenantsConfig tc, tenants::LoadTenantsConfig(po.tenants));
    PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<tenants::TenantRegistry> reg, tenants::TenantRegistry::Create(tc));
    co.tenants = std::move(reg);
  }
  PENUMBRA_RETURN_IF_ERROR(co.Validate());
  PENUMBRA_ASSIGN_OR_RETURN(transport::ProcessSecurity security, transport::SecurityFromFlags(a));
  PENUMBRA_ASSIGN_OR_RETURN(transport::AdminHttpOptions admin, transport::AdminFromFlags(a, security));
  const int64_t drain_s = po.drain_seconds;
  const std::string& host = po.host;
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
  std::stringstream list(po.workers);
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    PENUMBRA_ASSIGN_OR_RETURN(auto e, coordinator::ParseWorkerEndpoint(item, "w" + std::to_string(endpoints.size())));
    endpoints.push_back(e);
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<coordinator::WorkerEndpoint> ranks, coordinator::ParseGroups(po.groups));
  endpoints.insert(endpoints.end(), ranks.begin(), ranks.end());
  coordinator::WorkerPoolOptions wo = po.pool;
  wo.limits.max_frame_bytes = po.limits.max_frame_bytes;
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
  const bool durable = a.Has("data-dir");
  if (durable) {
    PENUMBRA_ASSIGN_OR_RETURN(journal, coordinator::RequestJournal::Open(po.data_dir + "/requests"));
    wo.owner_id = journal->owner_id();
  } else {
    wo.owner_id = "c-" + RandomHandle();
  }
  PENUMBRA_ASSIGN_OR_RETURN(auto pool, coordinator::WorkerPool::Create(endpoints, wo));
  std::unique_ptr<TextCodec> codec;
  if (Result<std::unique_ptr<TextCodec>> c = TextCodec::ForModel(po.model); c.ok()) {
    codec = std::move(*c);
  } else {
    LOG(WARNING) << "no tokenizer (" << c.status() << "): requests must carry token ids";
  }
  std::unique_ptr<coordinator::DocumentRegistry> documents;
  if (durable) {
    std::error_code ec;
    std::filesystem::create_directories(po.data_dir, ec);
    if (ec) return Status::IOError("--data-dir " + po.data_dir + ": " + ec.message());
    PENUMBRA_ASSIGN_OR_RETURN(
        documents, coordinator::DocumentRegistry::Open(po.data_dir + "/documents", co.max_documents_per_tenant));
  }
  auto handler =
      std::make_shared<coordinator::Coordinator>(co, std::move(codec), po.model, pool.get(), std::move(documents));
  // Before jobs resume: their items' old copies are cancelled, then run again.
  if (journal) PENUMBRA_RETURN_IF_ERROR(handler->Recover(std::move(journal)));
  if (durable) {
    coordinator::JobServiceOptions jo = po.jobs;
    jo.store.path = po.data_dir + "/jobs";
    jo.store.max_items_per_job = static_cast<size_t>(co.limits.max_job_items);
    PENUMBRA_RETURN_IF_ERROR(handler->StartJobs(jo));
  }
  transport::ThriftServerOptions so;
  so.host = host;
  so.port = po.port;
  so.name = "public API";
  so.limits = wo.limits;
  so.limits.max_connections = po.limits.max_connections;
  so.limits.max_connections_per_peer = po.limits.max_connections_per_peer;
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
  // The OpenAI-compatible API: the public API's TLS and client roles.
  std::unique_ptr<coordinator::OpenAiGateway> openai;
  if (po.openai_port >= 0) {
    coordinator::OpenAiGatewayOptions oo = po.openai;
    if (durable) oo.files.path = po.data_dir + "/files";
    oo.http.host = po.openai_host.empty() ? host : po.openai_host;
    oo.http.port = po.openai_port;
    oo.http.tls = so.tls;
    PENUMBRA_RETURN_IF_ERROR(transport::CheckPlaintextBind("the OpenAI API", oo.http.host, tls, security.insecure));
    if (!authenticated && !transport::IsLoopbackHost(oo.http.host) && !security.insecure) {
      return Status::InvalidArgument("the OpenAI API on " + oo.http.host +
                                     " without tenants: refused (give --tenants)");
    }
    PENUMBRA_ASSIGN_OR_RETURN(openai, coordinator::OpenAiGateway::Start(handler.get(), po.model, oo));
  }
  std::unique_ptr<transport::MetricsServer> metrics;
  if (admin.port >= 0) {
    coordinator::Coordinator* h = handler.get();
    PENUMBRA_ASSIGN_OR_RETURN(metrics,
                              transport::MetricsServer::Start(handler->metrics(), admin, [h] { h->RefreshMetrics(); }));
  }
  const int mport = metrics ? metrics->port() : -1;
  if (!po.port_file.empty()) {
    nlohmann::json j = {{"port", server->port()},
                        {"metrics_port", mport},
                        {"openai_port", openai ? openai->port() : -1},
                        {"pid", static_cast<int64_t>(getpid())}};
    PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(po.port_file, j.dump() + "\n"));
  }
  int healthy = 0;
  for (const auto& w : pool->states()) healthy += w.healthy;
  const std::string openai_at = openai ? ", OpenAI API on " + (po.openai_host.empty() ? host : po.openai_host) + ":" +
                                             std::to_string(openai->port())
                                       : "";
  std::printf("penumbra-coordinator: serving %s with %d of %d workers healthy on %s:%d (%s)%s, admin on %s:%d%s\n",
              po.model.c_str(), healthy, pool->size(), host.c_str(), server->port(), tls ? "TLS" : "plaintext",
              openai_at.c_str(), admin.host.c_str(), mport,
              authenticated ? "" : " (no API keys: every caller is tenant \"default\")");
  std::fflush(stdout);

  // SIGHUP rereads the tenants (or the plain API keys) and the public API's
  // TLS files; whatever fails to load keeps what was in use. It stops nothing.
  const int sig = WaitForStopSignal([&] {
    LOG(INFO) << "penumbra-coordinator: SIGHUP: reloading the configuration";
    if (co.tenants) {
      Result<tenants::TenantsConfig> tc = tenants::LoadTenantsConfig(po.tenants);
      Status s = tc.ok() ? handler->ReloadTenants(*tc) : tc.status();
      if (s.ok()) {
        LOG(INFO) << "penumbra-coordinator: SIGHUP: tenants reloaded from " << po.tenants << " (" << tc->tenants.size()
                  << " tenants)";
      } else {
        LOG(ERROR) << "penumbra-coordinator: SIGHUP: tenants not reloaded, the old ones stay: " << s;
      }
    }
    if (a.Has("api-keys")) {
      Result<std::map<std::string, std::string>> keys = coordinator::LoadApiKeys(po.api_keys);
      const size_t n = keys.ok() ? keys->size() : 0;
      Status s = keys.ok() ? handler->ReloadApiKeys(std::move(*keys)) : keys.status();
      if (s.ok()) {
        LOG(INFO) << "penumbra-coordinator: SIGHUP: API keys reloaded from " << po.api_keys << " (" << n << " keys)";
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
  if (openai) openai->Stop();
  server->Stop();
  if (metrics) metrics->Stop();
  std::printf("penumbra-coordinator: stopped\n");
  return Status::OK();
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  return penumbra::ServerMain("penumbra-coordinator", penumbra::kUsage, argc, argv, penumbra::Run,
                              [] { return penumbra::Flags().Help(); });
}
