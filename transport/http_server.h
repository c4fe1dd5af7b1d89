// An HTTP/1.1 server for an API of JSON over HTTP (the coordinator's
// OpenAI-compatible API): cpp-httplib with this project's TLS policy
// (transport/tls.h: the process's certificate, client certificates checked
// against the CA and their roles) and the caller named for the handlers
// (CurrentPeer, CurrentPeerHungUp: transport/thrift_util.h), as on the
// Thrift planes.
//
// One thread per open connection, from a pool of `threads` (a stream holds
// its thread while it runs; connections past the pool wait to be served).
// A body over max_body_bytes is refused with 413 before it is read; a client
// that sends nothing for read_timeout, or reads nothing for write_timeout,
// is disconnected.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

#include "common/status.h"
#include "transport/tls.h"

namespace penumbra::transport {

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // Default: 127.0.0.1.
  int port = 0;                    // 0: one the OS picks (port() says which). Default: 0.
  // TLS; a client certificate, when one is given, must be from the CA and of
  // one of tls->client_roles. None: plaintext. Default: none.
  std::optional<TlsServerOptions> tls;
  int threads = 256;                               // connections served at once. Default: 256.
  int64_t max_body_bytes = int64_t{64} << 20;      // larger request bodies get 413. Default: 64 MiB.
  std::chrono::milliseconds read_timeout{30000};   // a request's bytes, each wait. Default: 30 s.
  std::chrono::milliseconds write_timeout{30000};  // an answer's bytes, each wait. Default: 30 s.
  std::chrono::milliseconds idle_timeout{60000};   // a kept-alive connection between requests. Default: 60 s.
  std::string name = "HTTP server";                // in log lines. Default: "HTTP server".
  Status Validate() const;
};

class HttpServer {
 public:
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  // What answers a request no route took, or one a route left with an error
  // status and no body (404, 405, 413, a refused client certificate: 403).
  using ErrorHandler = std::function<void(const httplib::Request&, httplib::Response&, const std::string& why)>;

  // Routes first (Get, Post, Delete), then Start.
  explicit HttpServer(HttpServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // `pattern`: a path, or a regular expression with groups (req.matches).
  // The handler runs with the caller named (CurrentPeer).
  void Get(const std::string& pattern, Handler h);
  void Post(const std::string& pattern, Handler h);
  void Delete(const std::string& pattern, Handler h);
  void OnError(ErrorHandler h) { on_error_ = std::move(h); }

  // Binds and serves on a thread of its own; the port once bound.
  Status Start();
  int port() const { return port_; }
  // Stops listening and waits for the connections to end.
  void Stop();

 private:
  Handler Wrap(Handler h);
  HttpServerOptions o_;
  std::unique_ptr<httplib::Server> server_;
  ErrorHandler on_error_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace penumbra::transport
