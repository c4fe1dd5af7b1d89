#include "transport/metrics_http.h"

#include <chrono>

#include <httplib.h>
#include <prometheus/text_serializer.h>

namespace penumbra::transport {

std::string RenderMetrics(const prometheus::Registry& registry) {
  return prometheus::TextSerializer().Serialize(registry.Collect());
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(std::shared_ptr<prometheus::Registry> registry,
                                                            const std::string& host, int port,
                                                            std::function<void()> before_scrape,
                                                            std::function<bool()> healthy) {
  if (port < 0 || port > 65535) return Status::InvalidArgument("metrics port must be in [0, 65535], got " + std::to_string(port));
  auto m = std::unique_ptr<MetricsServer>(new MetricsServer());
  m->server_ = std::make_unique<httplib::Server>();
  m->server_->Get("/metrics", [registry, before_scrape](const httplib::Request&, httplib::Response& res) {
    if (before_scrape) before_scrape();
    res.set_content(RenderMetrics(*registry), "text/plain; version=0.0.4; charset=utf-8");
  });
  m->server_->Get("/healthz", [healthy](const httplib::Request&, httplib::Response& res) {
    const bool ok = !healthy || healthy();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "ok\n" : "draining\n", "text/plain");
  });
  // Requests are small: refuse large bodies and slow clients.
  m->server_->set_payload_max_length(64 << 10);
  m->server_->set_read_timeout(5, 0);
  m->server_->set_write_timeout(5, 0);
  if (port == 0) {
    m->port_ = m->server_->bind_to_any_port(host);
    if (m->port_ < 0) return Status::Unavailable("metrics: cannot bind " + host + " (any port)");
  } else {
    if (!m->server_->bind_to_port(host, port)) {
      return Status::Unavailable("metrics: cannot bind " + host + ":" + std::to_string(port));
    }
    m->port_ = port;
  }
  httplib::Server* s = m->server_.get();
  m->thread_ = std::thread([s] { s->listen_after_bind(); });
  // Stop() before the loop runs would be lost: wait until it does.
  for (int i = 0; i < 5000 && !s->is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return m;
}

MetricsServer::~MetricsServer() { Stop(); }

void MetricsServer::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace penumbra::transport
