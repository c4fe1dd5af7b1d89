// Thrift plumbing shared by every Penumbra server and client: the framed
// binary protocol with size limits (a frame, a string or a container past
// them is refused before it is allocated), errors mapped between Status and
// the IDL's PenumbraError at the boundary, TLS (transport/tls.h) with the
// caller's identity available to handlers, servers bounded against floods,
// and clients with connect and call timeouts (the deadline of every call).
//
// A server is a thread per connection (a long poll blocks only its own
// connection) with these bounds, each a ThriftLimits field:
// - at most max_connections open connections, max_connections_per_peer of
//   them from one address; past either a new connection is closed at once
//   (the others are not delayed);
// - a connection must finish its TLS handshake and send its first request
//   within handshake_timeout, and may then idle idle_timeout between
//   requests; a reply must be taken within send_timeout;
// - the request frames over 64 KiB that connections are reading hold at
//   most max_buffered_frame_bytes together (a frame that would pass it closes
//   its connection), so many clients announcing large frames cannot exhaust
//   memory before any key is checked;
// - an accept that fails (EMFILE: no file descriptors left) is retried, the
//   server keeps serving.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <thrift/TProcessor.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/server/TThreadedServer.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TSocket.h>

#include "common/status.h"
#include "gen-cpp/common_types.h"
#include "transport/tls.h"

namespace penumbra::transport {

struct ThriftLimits {
  int32_t max_frame_bytes = 64 << 20;        // one framed message
  int32_t max_string_bytes = 64 << 20;       // one string or binary field
  int32_t max_container_elements = 1 << 24;  // one list, set or map
  // Servers only:
  int32_t max_connections = 4096;                       // open connections, all peers
  int32_t max_connections_per_peer = 1024;              // open connections from one address
  int64_t max_buffered_frame_bytes = int64_t{1} << 30;  // request frames being read, all connections
  std::chrono::milliseconds handshake_timeout{10000};   // connect -> TLS handshake and first request
  std::chrono::milliseconds idle_timeout{300000};       // between two requests of a connection
  std::chrono::milliseconds send_timeout{60000};        // writing one reply
  Status Validate() const;
};

// Status -> the IDL's error (RESOURCE_EXHAUSTED carries retry_after_ms).
rpc::PenumbraError ToRpcError(const Status& s, int32_t retry_after_ms = 1000);
// The IDL's error -> Status (the code and the message).
Status FromRpcError(const rpc::PenumbraError& e);
// A Thrift transport or protocol error on a client -> Unavailable (the
// connection failed or the server went away) or DeadlineExceeded (timeout).
Status FromThriftException(const std::exception& e, const std::string& what);

std::shared_ptr<apache::thrift::TConfiguration> MakeConfiguration(const ThriftLimits& limits);

// The binary protocol as every server reads requests: Thrift's TBinaryProtocol
// with a type code (of a field, list, set or map) or a message type outside
// Thrift's refused (TProtocolException INVALID_DATA) before it is stored in an
// enum -- Thrift's own reader casts the wire byte unchecked, which is
// undefined behaviour and a type that means nothing. Only the versioned
// (strict) message header is read. Skipping unknown fields goes through the
// same checks.
class CheckedBinaryProtocol final : public apache::thrift::protocol::TBinaryProtocol {
 public:
  using apache::thrift::protocol::TBinaryProtocol::TBinaryProtocolT;
  uint32_t readMessageBegin_virt(std::string& name, apache::thrift::protocol::TMessageType& type,
                                 int32_t& seqid) override;
  uint32_t readFieldBegin_virt(std::string& name, apache::thrift::protocol::TType& type, int16_t& id) override;
  uint32_t readMapBegin_virt(apache::thrift::protocol::TType& key, apache::thrift::protocol::TType& value,
                             uint32_t& size) override;
  uint32_t readListBegin_virt(apache::thrift::protocol::TType& elem, uint32_t& size) override;
  uint32_t readSetBegin_virt(apache::thrift::protocol::TType& elem, uint32_t& size) override;
  uint32_t skip_virt(apache::thrift::protocol::TType type) override;

 private:
  // A container's size: not negative, within the container limit and the
  // bytes left in the message.
  uint32_t ReadContainerSize(int64_t min_element_bytes);
};

class CheckedBinaryProtocolFactory final : public apache::thrift::protocol::TProtocolFactory {
 public:
  CheckedBinaryProtocolFactory(int32_t string_limit, int32_t container_limit)
      : string_limit_(string_limit), container_limit_(container_limit) {}
  std::shared_ptr<apache::thrift::protocol::TProtocol> getProtocol(
      std::shared_ptr<apache::thrift::transport::TTransport> trans) override {
    return std::make_shared<CheckedBinaryProtocol>(std::move(trans), string_limit_, container_limit_, true, true);
  }

 private:
  int32_t string_limit_, container_limit_;
};

// The caller of the request being served on this thread: its verified
// certificate's role and name under TLS, else only its address. Outside a
// server's handler, an empty identity.
const PeerIdentity& CurrentPeer();
// Whether the caller of the request being served on this thread has closed
// its connection (or it failed): a handler that waits long for an answer
// (the coordinator's Complete) checks it between waits and stops the work
// nobody will read. Looks at the socket without reading (poll(2) for a hang
// up); false outside a server's handler.
bool CurrentPeerHungUp();
// For a server that is not Thrift's (the coordinator's OpenAI HTTP gateway):
// names the caller of the request served on this thread, while it lives, for
// CurrentPeer and CurrentPeerHungUp (through `fd`, the connection's socket;
// -1 when the server does not expose it: hang-ups are then not seen).
class ScopedPeer {
 public:
  ScopedPeer(PeerIdentity identity, int fd);
  ~ScopedPeer();
  ScopedPeer(const ScopedPeer&) = delete;
  ScopedPeer& operator=(const ScopedPeer&) = delete;
};

struct ThriftServerStats {
  int64_t open_connections = 0;
  int64_t accepted = 0;
  int64_t refused_over_limit = 0;    // closed at accept: max_connections or per peer
  int64_t refused_frame_budget = 0;  // closed: a frame past max_buffered_frame_bytes
  int64_t accept_errors = 0;         // accept() failures retried (EMFILE...)
};

struct ThriftServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: one the OS picks (port() says which)
  ThriftLimits limits;
  std::optional<TlsServerOptions> tls;  // none: plaintext
  std::string name = "thrift server";   // in log lines
};

// A Thrift server on its own threads (see the file comment).
class ThriftServer {
 public:
  static Result<std::unique_ptr<ThriftServer>> Start(std::shared_ptr<apache::thrift::TProcessor> processor,
                                                     const ThriftServerOptions& options);
  ~ThriftServer();  // Stop()
  int port() const { return port_; }
  bool tls() const { return tls_.has_value(); }
  ThriftServerStats stats() const;
  // Rereads the TLS files (certificate, key, CA) as at Start, for the
  // connections accepted from now on; open connections keep the files they
  // began with. When the files do not load or check (Validate, key matching
  // the certificate...), the old ones stay in use and the error says why.
  // FailedPrecondition on a plaintext server. Thread-safe.
  Status ReloadTls();
  // Stops accepting, closes connections, joins.
  void Stop();

  struct Shared;  // the limits' counters, shared with live connections

 private:
  ThriftServer() = default;
  std::shared_ptr<apache::thrift::server::TThreadedServer> server_;
  std::shared_ptr<Shared> shared_;
  std::thread thread_;
  int port_ = 0;
  std::optional<TlsServerOptions> tls_;  // as started (the files ReloadTls rereads)
  bool stopped_ = false;
};

// A client's TLS settings, loaded once (the CA, certificate and key read and
// checked) and shared by its connections.
class TlsClientContext {
 public:
  static Result<std::shared_ptr<const TlsClientContext>> Create(const TlsClientOptions& options);
  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  explicit TlsClientContext(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

// A connected socket to host:port, over TLS when `tls` is set (the
// handshake and the server's checks done before it returns).
Result<std::shared_ptr<apache::thrift::transport::TSocket>> ConnectSocket(
    const std::string& host, int port, std::chrono::milliseconds timeout,
    std::shared_ptr<apache::thrift::TConfiguration> config, const std::shared_ptr<const TlsClientContext>& tls);

// A connected client of service `Client` (a generated *Client class) with
// per-call timeouts.
template <typename Client>
class ThriftClient {
 public:
  static Result<std::unique_ptr<ThriftClient>> Connect(const std::string& host, int port,
                                                       std::chrono::milliseconds timeout,
                                                       const ThriftLimits& limits = {},
                                                       std::shared_ptr<const TlsClientContext> tls = nullptr) {
    auto c = std::unique_ptr<ThriftClient>(new ThriftClient());
    auto config = MakeConfiguration(limits);
    PENUMBRA_ASSIGN_OR_RETURN(c->socket_, ConnectSocket(host, port, timeout, config, tls));
    try {
      c->transport_ = std::make_shared<apache::thrift::transport::TFramedTransport>(c->socket_, config);
      auto protocol = std::make_shared<apache::thrift::protocol::TBinaryProtocol>(
          c->transport_, limits.max_string_bytes, limits.max_container_elements, true, true);
      c->client_ = std::make_unique<Client>(protocol);
    } catch (const std::exception& e) {
      return FromThriftException(e, "connect to " + host + ":" + std::to_string(port));
    }
    c->last_used_ = std::chrono::steady_clock::now();
    return c;
  }
  ~ThriftClient() {
    try {
      if (transport_) transport_->close();
    } catch (...) {
    }
  }
  Client& operator*() {
    last_used_ = std::chrono::steady_clock::now();
    return *client_;
  }
  Client* operator->() {
    last_used_ = std::chrono::steady_clock::now();
    return client_.get();
  }
  // The timeout of the next calls (a long poll needs its wait plus a margin).
  void SetTimeout(std::chrono::milliseconds timeout) {
    socket_->setRecvTimeout(static_cast<int>(timeout.count()));
    socket_->setSendTimeout(static_cast<int>(timeout.count()));
  }
  // When a call last used the connection (a pool drops connections idle
  // for longer than the server keeps them).
  std::chrono::steady_clock::time_point last_used() const { return last_used_; }

 private:
  ThriftClient() = default;
  std::shared_ptr<apache::thrift::transport::TSocket> socket_;
  std::shared_ptr<apache::thrift::transport::TTransport> transport_;
  std::unique_ptr<Client> client_;
  std::chrono::steady_clock::time_point last_used_;
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
