#include "transport/http_server.h"

#include <glog/logging.h>

#include "transport/thrift_util.h"
#include "transport/tls_openssl.h"

namespace penumbra::transport {

Status HttpServerOptions::Validate() const {
  if (port < 0 || port > 65535) return Status::InvalidArgument(name + ": port must be in [0, 65535]");
  if (threads < 1 || threads > 65536) return Status::InvalidArgument(name + ": threads must be in [1, 65536]");
  if (max_body_bytes < 1) return Status::InvalidArgument(name + ": max_body_bytes must be >= 1");
  if (read_timeout.count() < 1 || write_timeout.count() < 1 || idle_timeout.count() < 1000) {
    return Status::InvalidArgument(name + ": timeouts must be >= 1 ms (the idle timeout >= 1 s)");
  }
  if (tls) return tls->files.Validate(name);
  return Status::OK();
}

namespace {

// What the constructor of an SSLServer made of the TLS files (its callback
// cannot return a Status).
struct TlsSetup {
  Status status;
};

}  // namespace

HttpServer::HttpServer(HttpServerOptions options) : o_(std::move(options)) {
  if (o_.tls) {
    auto setup = std::make_shared<TlsSetup>();
    const TlsServerOptions tls = *o_.tls;
    server_ = std::make_unique<httplib::SSLServer>([setup, tls](SSL_CTX& ctx) {
      // A client certificate is asked for and checked when given; required
      // only when the options say so.
      setup->status = ConfigureSslContext(&ctx, tls.files, /*server=*/true, tls.require_client_certificate);
      return setup->status.ok();
    });
    if (!setup->status.ok()) LOG(ERROR) << o_.name << ": " << setup->status;
  } else {
    server_ = std::make_unique<httplib::Server>();
  }
  const int threads = o_.threads;
  server_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  server_->set_payload_max_length(static_cast<size_t>(o_.max_body_bytes));
  server_->set_read_timeout(o_.read_timeout);
  server_->set_write_timeout(o_.write_timeout);
  server_->set_keep_alive_timeout(static_cast<time_t>(o_.idle_timeout.count() / 1000));
  server_->set_keep_alive_max_count(100000);
  server_->set_error_handler(
      httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || !on_error_) return httplib::Server::HandlerResponse::Unhandled;
        std::string why;
        switch (res.status) {
          case 404:
            why = "no such route: " + req.method + " " + req.path;
            break;
          case 405:
            why = "method " + req.method + " is not allowed on " + req.path;
            break;
          case 413:
            why = "the body is larger than " + std::to_string(o_.max_body_bytes) + " bytes";
            break;
          default:
            why = "HTTP status " + std::to_string(res.status);
            break;
        }
        on_error_(req, res, why);
        return httplib::Server::HandlerResponse::Handled;
      }));
  server_->set_exception_handler([this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    LOG(ERROR) << o_.name << ": " << req.method << " " << req.path << " failed: " << what;
    res.status = 500;
    if (on_error_) on_error_(req, res, "internal error");
  });
}

HttpServer::~HttpServer() { Stop(); }

HttpServer::Handler HttpServer::Wrap(Handler h) {
  return [this, h = std::move(h)](const httplib::Request& req, httplib::Response& res) {
    PeerIdentity id;
    id.address = req.remote_addr + ":" + std::to_string(req.remote_port);
    int fd = -1;
    if (req.ssl != nullptr) {
      Result<PeerIdentity> checked =
          CheckPeer(req.ssl, id.address, o_.tls ? o_.tls->client_roles : std::vector<std::string>{}, nullptr,
                    o_.tls && o_.tls->require_client_certificate);
      if (!checked.ok()) {
        LOG(WARNING) << o_.name << ": " << checked.status();
        res.status = 403;
        if (on_error_) on_error_(req, res, checked.status().message());
        return;
      }
      id = *checked;
      fd = SSL_get_fd(req.ssl);
    }
    ScopedPeer caller(std::move(id), fd);
    h(req, res);
  };
}

void HttpServer::Get(const std::string& pattern, Handler h) { server_->Get(pattern, Wrap(std::move(h))); }
void HttpServer::Post(const std::string& pattern, Handler h) { server_->Post(pattern, Wrap(std::move(h))); }
void HttpServer::Delete(const std::string& pattern, Handler h) { server_->Delete(pattern, Wrap(std::move(h))); }

Status HttpServer::Start() {
  PENUMBRA_RETURN_IF_ERROR(o_.Validate());
  if (!server_->is_valid()) return Status::InvalidArgument(o_.name + ": the TLS files did not load");
  if (o_.port == 0) {
    port_ = server_->bind_to_any_port(o_.host);
    if (port_ <= 0) return Status::Unavailable(o_.name + ": cannot bind " + o_.host + ":0");
  } else {
    if (!server_->bind_to_port(o_.host, o_.port)) {
      return Status::Unavailable(o_.name + ": cannot bind " + o_.host + ":" + std::to_string(o_.port));
    }
    port_ = o_.port;
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  return Status::OK();
}

void HttpServer::Stop() {
  if (!thread_.joinable()) return;
  server_->stop();
  thread_.join();
}

}  // namespace penumbra::transport
