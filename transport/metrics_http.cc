#include "transport/metrics_http.h"

#include <atomic>
#include <chrono>
#include <optional>

#include <glog/logging.h>
#include <prometheus/text_serializer.h>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "transport/tls_openssl.h"

namespace penumbra::transport {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
using tcp = net::ip::tcp;

}  // namespace

// One event loop on one thread: every connection is a few timers and
// buffers, never a thread, so idle or slow connections cost no one else's
// scrape. A connection has read_timeout to finish its TLS handshake and send
// one request; it gets one answer and is closed.
// Members are destroyed in reverse order: the sessions still queued in the
// loop go with it, before what they use (declared above it).
struct MetricsServer::Impl {
  std::optional<ssl::context> tls;
  std::vector<std::string> roles;
  std::shared_ptr<prometheus::Registry> registry;
  std::function<void()> before_scrape;
  std::function<bool()> healthy;
  int max_connections = 4096;
  std::chrono::milliseconds read_timeout{2000};
  int active = 0;  // the loop's thread only
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  std::thread thread;

  void Accept();
  http::response<http::string_body> Answer(const http::request<http::string_body>& req, const PeerIdentity* peer,
                                           const Status& peer_status);
};

namespace {

template <typename Stream>
class Session : public std::enable_shared_from_this<Session<Stream>> {
 public:
  Session(MetricsServer::Impl* server, Stream stream) : server_(server), stream_(std::move(stream)) {
    ++server_->active;
  }
  ~Session() { --server_->active; }

  void Run() {
    beast::get_lowest_layer(stream_).expires_after(server_->read_timeout);
    if constexpr (std::is_same_v<Stream, beast::ssl_stream<beast::tcp_stream>>) {
      stream_.async_handshake(ssl::stream_base::server, [self = this->shared_from_this()](beast::error_code ec) {
        if (!ec) self->Read();
      });
    } else {
      Read();
    }
  }

 private:
  void Read() {
    parser_.emplace();
    parser_->body_limit(64 << 10);  // requests are small
    parser_->header_limit(16 << 10);
    http::async_read(stream_, buffer_, *parser_, [self = this->shared_from_this()](beast::error_code ec, size_t) {
      if (!ec) self->Respond();
    });
  }
  void Respond() {
    const http::request<http::string_body>& req = parser_->get();
    Status peer_status = Status::OK();
    std::optional<PeerIdentity> peer;
    if constexpr (std::is_same_v<Stream, beast::ssl_stream<beast::tcp_stream>>) {
      std::string address = "?";
      beast::error_code ec;
      const auto ep = beast::get_lowest_layer(stream_).socket().remote_endpoint(ec);
      if (!ec) address = ep.address().to_string() + ":" + std::to_string(ep.port());
      Result<PeerIdentity> id = CheckPeer(stream_.native_handle(), address, server_->roles, nullptr, true);
      if (id.ok()) {
        peer = *id;
      } else {
        peer_status = id.status();
      }
    }
    res_ = server_->Answer(req, peer ? &*peer : nullptr, peer_status);
    res_.keep_alive(false);
    res_.prepare_payload();
    http::async_write(stream_, res_, [self = this->shared_from_this()](beast::error_code, size_t) { self->Close(); });
  }
  void Close() {
    beast::error_code ec;
    if constexpr (std::is_same_v<Stream, beast::ssl_stream<beast::tcp_stream>>) {
      beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(1));
      stream_.async_shutdown([self = this->shared_from_this()](beast::error_code) {
        beast::error_code e;
        beast::get_lowest_layer(self->stream_).socket().shutdown(tcp::socket::shutdown_both, e);
      });
    } else {
      stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    }
  }

  MetricsServer::Impl* server_;
  Stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::response<http::string_body> res_;
};

}  // namespace

http::response<http::string_body> MetricsServer::Impl::Answer(const http::request<http::string_body>& req,
                                                              const PeerIdentity* peer, const Status& peer_status) {
  http::response<http::string_body> res{http::status::ok, req.version()};
  res.set(http::field::server, "penumbra");
  auto text = [&](http::status status, std::string body) {
    res.result(status);
    res.set(http::field::content_type, "text/plain");
    res.body() = std::move(body);
  };
  if (tls && !peer_status.ok()) {
    text(http::status::forbidden, peer_status.message() + "\n");
    return res;
  }
  (void)peer;
  if (req.method() != http::verb::get) {
    text(http::status::method_not_allowed, "only GET\n");
    return res;
  }
  const std::string_view target(req.target().data(), req.target().size());
  if (target == "/metrics") {
    if (before_scrape) before_scrape();
    res.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
    res.body() = RenderMetrics(*registry);
  } else if (target == "/healthz") {
    const bool ok = !healthy || healthy();
    text(ok ? http::status::ok : http::status::service_unavailable, ok ? "ok\n" : "draining\n");
  } else {
    text(http::status::not_found, "not found: /metrics and /healthz are served here\n");
  }
  return res;
}

void MetricsServer::Impl::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted) return;  // stopping
    if (!ec) {
      if (active >= max_connections) {
        LOG_EVERY_T(WARNING, 1) << "admin endpoint: over " << max_connections << " connections; one closed";
        beast::error_code e;
        socket.close(e);
      } else if (tls) {
        std::make_shared<Session<beast::ssl_stream<beast::tcp_stream>>>(
            this, beast::ssl_stream<beast::tcp_stream>(beast::tcp_stream(std::move(socket)), *tls))
            ->Run();
      } else {
        std::make_shared<Session<beast::tcp_stream>>(this, beast::tcp_stream(std::move(socket)))->Run();
      }
    } else {
      // EMFILE and the like: keep accepting after a pause.
      LOG_EVERY_T(WARNING, 1) << "admin endpoint: accept failed: " << ec.message();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Accept();
  });
}

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
  m->impl_ = std::make_unique<Impl>();
  Impl& s = *m->impl_;
  s.registry = std::move(registry);
  s.before_scrape = std::move(before_scrape);
  s.healthy = std::move(healthy);
  s.max_connections = o.max_connections;
  s.read_timeout = o.read_timeout;
  if (o.tls) {
    s.tls.emplace(ssl::context::tls_server);
    PENUMBRA_RETURN_IF_ERROR(
        ConfigureSslContext(s.tls->native_handle(), o.tls->files, true, o.tls->require_client_certificate));
    s.roles = o.tls->client_roles;
  }
  beast::error_code ec;
  const auto address = net::ip::make_address(o.host == "localhost" ? "127.0.0.1" : o.host, ec);
  if (ec) return Status::InvalidArgument("admin endpoint: '" + o.host + "' is not an IP address");
  const tcp::endpoint ep(address, static_cast<unsigned short>(o.port));
  s.acceptor.open(ep.protocol(), ec);
  if (!ec) s.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(ep, ec);
  if (!ec) s.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    return Status::Unavailable("admin endpoint: cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " +
                               ec.message());
  m->port_ = s.acceptor.local_endpoint().port();
  s.Accept();
  Impl* raw = &s;
  s.thread = std::thread([raw] {
    try {
      raw->ioc.run();
    } catch (const std::exception& e) {
      LOG(ERROR) << "admin endpoint stopped: " << e.what();
    }
  });
  return m;
}

MetricsServer::~MetricsServer() { Stop(); }

void MetricsServer::Stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  net::post(impl_->ioc, [raw = impl_.get()] {
    beast::error_code ec;
    raw->acceptor.close(ec);
  });
  impl_->ioc.stop();
  impl_->thread.join();
}

void AddAdminFlags(Args& a) {
  a.Flag("admin-host",
         "address of the admin endpoint (/metrics, /healthz; default 127.0.0.1). Off loopback it "
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
