#include "transport/thrift_util.h"

#include <thrift/TApplicationException.h>
#include <thrift/protocol/TProtocolException.h>
#include <thrift/transport/TTransportException.h>

#include <glog/logging.h>

namespace penumbra::transport {
namespace {

using apache::thrift::TConfiguration;
using apache::thrift::transport::TTransport;
using apache::thrift::transport::TTransportException;

// Frames every accepted connection with the server's limits (Thrift's own
// TFramedTransportFactory uses the default configuration).
class LimitedFramedTransportFactory : public apache::thrift::transport::TTransportFactory {
 public:
  explicit LimitedFramedTransportFactory(std::shared_ptr<TConfiguration> config) : config_(std::move(config)) {}
  std::shared_ptr<TTransport> getTransport(std::shared_ptr<TTransport> trans) override {
    return std::make_shared<apache::thrift::transport::TFramedTransport>(std::move(trans), config_);
  }

 private:
  std::shared_ptr<TConfiguration> config_;
};

// A server socket that may be bound before serve() (which calls listen()
// again), so the port the OS picked is known before the first client.
class PreboundServerSocket : public apache::thrift::transport::TServerSocket {
 public:
  using TServerSocket::TServerSocket;
  void listen() override {
    if (listening_) return;
    TServerSocket::listen();
    listening_ = true;
  }

 private:
  bool listening_ = false;
};

}  // namespace

rpc::PenumbraError ToRpcError(const Status& s, int32_t retry_after_ms) {
  rpc::PenumbraError e;
  e.message = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument: e.code = rpc::ErrorCode::INVALID_ARGUMENT; break;
    case StatusCode::kNotFound: e.code = rpc::ErrorCode::NOT_FOUND; break;
    case StatusCode::kPermissionDenied: e.code = rpc::ErrorCode::PERMISSION_DENIED; break;
    case StatusCode::kResourceExhausted:
      e.code = rpc::ErrorCode::RESOURCE_EXHAUSTED;
      e.__set_retry_after_ms(s.retry_after_ms() > 0 ? s.retry_after_ms() : retry_after_ms);
      break;
    case StatusCode::kUnavailable: e.code = rpc::ErrorCode::UNAVAILABLE; break;
    case StatusCode::kDeadlineExceeded: e.code = rpc::ErrorCode::DEADLINE_EXCEEDED; break;
    case StatusCode::kFailedPrecondition: e.code = rpc::ErrorCode::FAILED_PRECONDITION; break;
    case StatusCode::kCancelled: e.code = rpc::ErrorCode::CANCELLED; break;
    default: e.code = rpc::ErrorCode::INTERNAL; break;
  }
  return e;
}

Status FromRpcError(const rpc::PenumbraError& e) {
  switch (e.code) {
    case rpc::ErrorCode::INVALID_ARGUMENT: return Status::InvalidArgument(e.message);
    case rpc::ErrorCode::NOT_FOUND: return Status::NotFound(e.message);
    case rpc::ErrorCode::PERMISSION_DENIED: return Status::PermissionDenied(e.message);
    case rpc::ErrorCode::RESOURCE_EXHAUSTED:
      return Status::ResourceExhausted(e.message).WithRetryAfter(e.__isset.retry_after_ms ? e.retry_after_ms : 0);
    case rpc::ErrorCode::UNAVAILABLE: return Status::Unavailable(e.message);
    case rpc::ErrorCode::DEADLINE_EXCEEDED: return Status::DeadlineExceeded(e.message);
    case rpc::ErrorCode::FAILED_PRECONDITION: return Status::FailedPrecondition(e.message);
    case rpc::ErrorCode::CANCELLED: return Status::Cancelled(e.message);
    default: return Status::Internal(e.message);
  }
}

Status FromThriftException(const std::exception& e, const std::string& what) {
  if (const auto* t = dynamic_cast<const TTransportException*>(&e)) {
    if (t->getType() == TTransportException::TIMED_OUT) return Status::DeadlineExceeded(what + ": timed out");
    return Status::Unavailable(what + ": " + t->what());
  }
  if (dynamic_cast<const apache::thrift::protocol::TProtocolException*>(&e) != nullptr) {
    return Status::Unavailable(what + ": protocol error: " + e.what());
  }
  if (dynamic_cast<const apache::thrift::TApplicationException*>(&e) != nullptr) {
    return Status::Internal(what + ": the server failed: " + e.what());
  }
  return Status::Unavailable(what + ": " + e.what());
}

std::shared_ptr<TConfiguration> MakeConfiguration(const ThriftLimits& limits) {
  return std::make_shared<TConfiguration>(limits.max_frame_bytes, limits.max_frame_bytes);
}

Result<std::unique_ptr<ThriftServer>> ThriftServer::Start(std::shared_ptr<apache::thrift::TProcessor> processor,
                                                          const std::string& host, int port,
                                                          const ThriftLimits& limits) {
  if (port < 0 || port > 65535) return Status::InvalidArgument("port must be in [0, 65535], got " + std::to_string(port));
  auto s = std::unique_ptr<ThriftServer>(new ThriftServer());
  auto socket = std::make_shared<PreboundServerSocket>(host, port);
  try {
    socket->listen();
  } catch (const std::exception& e) {
    return Status::Unavailable("cannot listen on " + host + ":" + std::to_string(port) + ": " + e.what());
  }
  s->port_ = socket->getPort();
  auto config = MakeConfiguration(limits);
  s->server_ = std::make_shared<apache::thrift::server::TThreadedServer>(
      std::move(processor), socket, std::make_shared<LimitedFramedTransportFactory>(config),
      std::make_shared<apache::thrift::protocol::TBinaryProtocolFactory>(limits.max_string_bytes,
                                                                         limits.max_container_elements, true, true));
  s->server_->setConcurrentClientLimit(limits.max_connections);
  auto server = s->server_;
  s->thread_ = std::thread([server] {
    try {
      server->serve();
    } catch (const std::exception& e) {
      LOG(ERROR) << "thrift server stopped: " << e.what();
    }
  });
  return s;
}

ThriftServer::~ThriftServer() { Stop(); }

void ThriftServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace penumbra::transport
