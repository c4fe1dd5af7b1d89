// Thrift plumbing shared by every Penumbra server and client: the framed
// binary protocol with size limits (a frame, a string or a container past
// them is refused before it is allocated), errors mapped between Status and
// the IDL's PenumbraError at the boundary, a server that binds loopback port 0
// and reports the port the OS picked, and clients with connect and call
// timeouts (the deadline of every call).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include <thrift/TProcessor.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/server/TThreadedServer.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TServerSocket.h>
#include <thrift/transport/TSocket.h>

#include "common/status.h"
#include "gen-cpp/common_types.h"

namespace penumbra::transport {

struct ThriftLimits {
  int32_t max_frame_bytes = 64 << 20;        // one framed message
  int32_t max_string_bytes = 64 << 20;       // one string or binary field
  int32_t max_container_elements = 1 << 24;  // one list, set or map
  int32_t max_connections = 256;             // concurrent clients of a server
};

// Status -> the IDL's error (RESOURCE_EXHAUSTED carries retry_after_ms).
rpc::PenumbraError ToRpcError(const Status& s, int32_t retry_after_ms = 1000);
// The IDL's error -> Status (the code and the message).
Status FromRpcError(const rpc::PenumbraError& e);
// A Thrift transport or protocol error on a client -> Unavailable (the
// connection failed or the server went away) or DeadlineExceeded (timeout).
Status FromThriftException(const std::exception& e, const std::string& what);

std::shared_ptr<apache::thrift::TConfiguration> MakeConfiguration(const ThriftLimits& limits);

// A Thrift server on its own threads (one per connection, up to
// max_connections; long polls block only their connection's thread).
class ThriftServer {
 public:
  // Binds host:port (port 0: one the OS picks) and starts serving.
  static Result<std::unique_ptr<ThriftServer>> Start(std::shared_ptr<apache::thrift::TProcessor> processor,
                                                     const std::string& host, int port, const ThriftLimits& limits);
  ~ThriftServer();  // Stop()
  int port() const { return port_; }
  // Stops accepting, closes connections, joins.
  void Stop();

 private:
  ThriftServer() = default;
  std::shared_ptr<apache::thrift::server::TThreadedServer> server_;
  std::thread thread_;
  int port_ = 0;
  bool stopped_ = false;
};

// A connected client of service `Client` (a generated *Client class) with
// per-call timeouts.
template <typename Client>
class ThriftClient {
 public:
  static Result<std::unique_ptr<ThriftClient>> Connect(const std::string& host, int port,
                                                       std::chrono::milliseconds timeout,
                                                       const ThriftLimits& limits = {}) {
    auto c = std::unique_ptr<ThriftClient>(new ThriftClient());
    try {
      auto config = MakeConfiguration(limits);
      c->socket_ = std::make_shared<apache::thrift::transport::TSocket>(host, port, config);
      const int ms = static_cast<int>(timeout.count());
      c->socket_->setConnTimeout(ms);
      c->socket_->setRecvTimeout(ms);
      c->socket_->setSendTimeout(ms);
      c->transport_ = std::make_shared<apache::thrift::transport::TFramedTransport>(c->socket_, config);
      auto protocol = std::make_shared<apache::thrift::protocol::TBinaryProtocol>(
          c->transport_, limits.max_string_bytes, limits.max_container_elements, true, true);
      c->client_ = std::make_unique<Client>(protocol);
      c->transport_->open();
    } catch (const std::exception& e) {
      return FromThriftException(e, "connect to " + host + ":" + std::to_string(port));
    }
    return c;
  }
  ~ThriftClient() {
    try {
      if (transport_) transport_->close();
    } catch (...) {
    }
  }
  Client& operator*() { return *client_; }
  Client* operator->() { return client_.get(); }
  // The timeout of the next calls (a long poll needs its wait plus a margin).
  void SetTimeout(std::chrono::milliseconds timeout) {
    socket_->setRecvTimeout(static_cast<int>(timeout.count()));
    socket_->setSendTimeout(static_cast<int>(timeout.count()));
  }

 private:
  ThriftClient() = default;
  std::shared_ptr<apache::thrift::transport::TSocket> socket_;
  std::shared_ptr<apache::thrift::transport::TTransport> transport_;
  std::unique_ptr<Client> client_;
};

// Runs `call` (a lambda making one RPC) and maps what it throws to Status.
template <typename F>
Status CallRpc(const std::string& what, F&& call) {
  try {
    call();
    return Status::OK();
  } catch (const rpc::PenumbraError& e) {
    return FromRpcError(e);
  } catch (const std::exception& e) {
    return FromThriftException(e, what);
  }
}

}  // namespace penumbra::transport
