// The admin endpoint: a Prometheus registry (prometheus-cpp) served as the
// text exposition format on GET /metrics over HTTP (cpp-httplib), with GET
// /healthz beside it. Every Penumbra process (coordinator, worker, store
// node) runs one on its own admin address, loopback by default: what it
// shows (per-tenant counts, worker names) is for operators, not tenants.
//
// Off loopback it needs TLS with client certificates of role admin (a
// Prometheus server scrapes with one: `tls_config` in its scrape job), or
// --insecure. One event loop (Boost.Beast) holds every connection, each
// with read_timeout to finish its handshake and send its request (at most
// max_connections at once), so idle or slow connections delay no one else's
// scrape.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <prometheus/registry.h>

#include "common/status.h"
#include "transport/tls.h"

namespace penumbra::transport {

struct AdminHttpOptions {
  std::string host = "127.0.0.1";
  int port = 0;                         // 0: one the OS picks (port() says which)
  std::optional<TlsServerOptions> tls;  // none: plaintext (loopback, or insecure)
  int max_connections = 4096;           // connections open at once; past it, closed at once
  std::chrono::milliseconds read_timeout{2000};
};

class MetricsServer {
 public:
  // `before_scrape` runs at each scrape before the registry is read (it
  // refreshes gauges); `healthy` answers /healthz (200 "ok" or 503
  // "draining").
  static Result<std::unique_ptr<MetricsServer>> Start(std::shared_ptr<prometheus::Registry> registry,
                                                      const AdminHttpOptions& options,
                                                      std::function<void()> before_scrape = {},
                                                      std::function<bool()> healthy = {});
  ~MetricsServer();
  int port() const { return port_; }
  void Stop();

  struct Impl;  // transport/metrics_http.cc

 private:
  MetricsServer() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

// The registry's text exposition (what /metrics returns).
std::string RenderMetrics(const prometheus::Registry& registry);

// The admin endpoint's flags (--admin-host, --metrics-port, --admin-tls-*)
// for a process whose internal planes use `security`: its TLS files are the
// default for the admin endpoint. Refuses a plaintext non-loopback bind
// unless security.insecure.
void AddAdminFlags(Args& a);
Result<AdminHttpOptions> AdminFromFlags(const Args& a, const ProcessSecurity& security);

}  // namespace penumbra::transport
