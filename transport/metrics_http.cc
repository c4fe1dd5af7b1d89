#include "transport/metrics_http.h"

#include <chrono>
#include <condition_variable>
#include <mutex>

#include <glog/logging.h>
#include <httplib.h>
#include <prometheus/text_serializer.h>

#include "transport/tls_openssl.h"

namespace penumbra::transport {
namespace {

// One thread per connection, up to `cap` at once (httplib's own pool would
// let a few idle connections hold every scrape back). Past the cap the
// connection is still served (its socket must be closed by its task), but
// only after one of the running ones ends.
class ThreadPerConnection final : public httplib::TaskQueue {
 public:
  explicit ThreadPerConnection(int cap) : cap_(cap) {}
  ~ThreadPerConnection() override { ThreadPerConnection::shutdown(); }
  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return running_ < cap_; });
    ++running_;
    lk.unlock();
    std::thread([this, fn = std::move(fn)] {
      fn();
      std::lock_guard<std::mutex> g(mu_);
      --running_;
      cv_.notify_all();
    }).detach();
  }
  void shutdown() override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return running_ == 0; });
  }

 private:
  const int cap_;
  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = 0;
};

}  // namespace

std::string RenderMetrics(const prometheus::Registry& registry) {
  return prometheus::TextSerializer().Serialize(registry.Collect());
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(std::shared_ptr<prometheus::Registry> registry,
                                                            const AdminHttpOptions& o,
                                                            std::function<void()> before_scrape,
                                                            std::function<bool()> healthy) {
  if (o.port < 0 || o.port > 65535) {
    return Status::InvalidArgument("metrics port must be in [0, 65535], got " + std::to_string(o.port));
  }
  if (o.max_connections < 1) return Status::InvalidArgument("admin endpoint: max_connections must be >= 1");
  auto m = std::unique_ptr<MetricsServer>(new MetricsServer());
  std::vector<std::string> roles;
  if (o.tls) {
    Status setup = Status::OK();
    const TlsServerOptions tls = *o.tls;
    m->server_ = std::make_unique<httplib::SSLServer>([&setup, tls](SSL_CTX& ctx) {
      setup = ConfigureSslContext(&ctx, tls.files, true, tls.require_client_certificate);
      return setup.ok();
    });
    if (!setup.ok()) return setup;
    if (!m->server_->is_valid()) return Status::Internal("admin endpoint: the TLS server did not start");
    roles = o.tls->client_roles;
  } else {
    m->server_ = std::make_unique<httplib::Server>();
  }
  const bool tls = o.tls.has_value();
  // A verified client certificate of an allowed role, under TLS.
  auto allowed = [tls, roles](const httplib::Request& req, httplib::Response& res) {
    if (!tls) return true;
    Result<PeerIdentity> peer = CheckPeer(req.ssl, req.remote_addr, roles, nullptr, true);
    if (peer.ok()) return true;
    res.status = 403;
    res.set_content(peer.status().message() + "\n", "text/plain");
    return false;
  };
  m->server_->Get("/metrics", [registry, before_scrape, allowed](const httplib::Request& req, httplib::Response& res) {
    if (!allowed(req, res)) return;
    if (before_scrape) before_scrape();
    res.set_content(RenderMetrics(*registry), "text/plain; version=0.0.4; charset=utf-8");
  });
  m->server_->Get("/healthz", [healthy, allowed](const httplib::Request& req, httplib::Response& res) {
    if (!allowed(req, res)) return;
    const bool ok = !healthy || healthy();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "ok\n" : "draining\n", "text/plain");
  });
  // Requests are small: refuse large bodies and slow clients.
  m->server_->set_payload_max_length(64 << 10);
  const auto rt = o.read_timeout;
  m->server_->set_read_timeout(rt.count() / 1000, (rt.count() % 1000) * 1000);
  m->server_->set_write_timeout(5, 0);
  m->server_->set_keep_alive_max_count(100);
  const int cap = o.max_connections;
  m->server_->new_task_queue = [cap] { return new ThreadPerConnection(cap); };
  if (o.port == 0) {
    m->port_ = m->server_->bind_to_any_port(o.host);
    if (m->port_ < 0) return Status::Unavailable("metrics: cannot bind " + o.host + " (any port)");
  } else {
    if (!m->server_->bind_to_port(o.host, o.port)) {
      return Status::Unavailable("metrics: cannot bind " + o.host + ":" + std::to_string(o.port));
    }
    m->port_ = o.port;
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

void AddAdminFlags(Args& a) {
  a.Flag("admin-host", "address of the admin endpoint (/metrics, /healthz; default 127.0.0.1). Off loopback it "
                       "takes TLS client certificates of role admin")
      .Flag("metrics-port", "port of the admin endpoint (default 0: one the OS picks; -1: off)");
}

Result<AdminHttpOptions> AdminFromFlags(const Args& a, const ProcessSecurity& security) {
  AdminHttpOptions o;
  o.host = a.Get("admin-host", "127.0.0.1");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t port, a.GetIntIn("metrics-port", 0, -1, 65535));
  o.port = static_cast<int>(port);
  if (!IsLoopbackHost(o.host)) {
    if (security.tls.enabled()) {
      TlsServerOptions t;
      t.files = security.tls;
      t.require_client_certificate = true;
      t.client_roles = {role::kAdmin};
      o.tls = t;
    } else {
      PENUMBRA_RETURN_IF_ERROR(CheckPlaintextBind("the admin endpoint", o.host, false, security.insecure));
    }
  }
  return o;
}

}  // namespace penumbra::transport
