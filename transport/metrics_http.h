// The metrics plane: a Prometheus registry (prometheus-cpp, Debian's
// prometheus-cpp-dev) served as the text exposition format on GET /metrics
// over HTTP (cpp-httplib), with GET /healthz beside it. Every Penumbra
// process (coordinator, worker) runs one on its own port.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <prometheus/registry.h>

#include "common/status.h"

namespace httplib {
class Server;
}

namespace penumbra::transport {

class MetricsServer {
 public:
  // Binds host:port (0: the OS picks; see port()). `before_scrape` runs at
  // each scrape before the registry is read (it refreshes gauges); `healthy`
  // answers /healthz (200 "ok" or 503 "draining").
  static Result<std::unique_ptr<MetricsServer>> Start(std::shared_ptr<prometheus::Registry> registry,
                                                      const std::string& host, int port,
                                                      std::function<void()> before_scrape = {},
                                                      std::function<bool()> healthy = {});
  ~MetricsServer();
  int port() const { return port_; }
  void Stop();

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

// The registry's text exposition (what /metrics returns).
std::string RenderMetrics(const prometheus::Registry& registry);

}  // namespace penumbra::transport
