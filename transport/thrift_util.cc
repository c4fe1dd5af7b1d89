#include "transport/thrift_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <csignal>

#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>

#include <glog/logging.h>
#include <thrift/TApplicationException.h>
#include <thrift/TOutput.h>
#include <thrift/protocol/TProtocolException.h>
#include <thrift/transport/TSSLSocket.h>
#include <thrift/transport/TTransportException.h>

#include "transport/tls_openssl.h"

namespace penumbra::transport {

using apache::thrift::TConfiguration;
using apache::thrift::TProcessor;
using apache::thrift::protocol::TProtocol;
using apache::thrift::transport::SSLContext;
using apache::thrift::transport::TSocket;
using apache::thrift::transport::TSSLException;
using apache::thrift::transport::TSSLSocket;
using apache::thrift::transport::TSSLSocketFactory;
using apache::thrift::transport::TTransport;
using apache::thrift::transport::TTransportException;
using Clock = std::chrono::steady_clock;

// What a server's connections share: the limits and their counters.
struct ThriftServer::Shared {
  ThriftLimits limits;
  std::string name;
  std::mutex mu;  // everything below
  std::map<std::string, int64_t> per_peer;
  // Connections that have not finished their first request: fd -> deadline.
  std::map<int, Clock::time_point> pending;
  bool stop = false;
  std::condition_variable cv;
  std::atomic<int64_t> open{0}, accepted{0}, refused_over_limit{0}, refused_frame_budget{0}, accept_errors{0};
  std::atomic<int64_t> frame_bytes{0};
  // The TLS context new connections get (none: plaintext); ReloadTls swaps
  // it, connections already open keep theirs.
  std::shared_ptr<SSLContext> TlsContext() const {
    std::lock_guard<std::mutex> lk(tls_mu);
    return tls_context;
  }
  void SetTlsContext(std::shared_ptr<SSLContext> c) {
    std::lock_guard<std::mutex> lk(tls_mu);
    tls_context = std::move(c);
  }
  mutable std::mutex tls_mu;
  std::shared_ptr<SSLContext> tls_context;  // guarded by tls_mu

  // Admits a connection from `peer`; false when over a limit.
  bool Admit(const std::string& peer) {
    std::lock_guard<std::mutex> lk(mu);
    int64_t& n = per_peer[peer];
    if (open.load() >= limits.max_connections || n >= limits.max_connections_per_peer) {
      if (n == 0) per_peer.erase(peer);
      return false;
    }
    ++n;
    ++open;
    return true;
  }
  void Leave(const std::string& peer) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = per_peer.find(peer);
    if (it != per_peer.end() && --it->second <= 0) per_peer.erase(it);
    --open;
  }
  void AddPending(int fd) {
    std::lock_guard<std::mutex> lk(mu);
    pending[fd] = Clock::now() + limits.handshake_timeout;
  }
  // Called before the fd is closed (and when the first request is done).
  void RemovePending(int fd) {
    std::lock_guard<std::mutex> lk(mu);
    pending.erase(fd);
  }
  // Shuts down connections past their first-request deadline (their thread
  // then reads end of file and closes them).
  void Reap() {
    std::unique_lock<std::mutex> lk(mu);
    while (!stop) {
      cv.wait_for(lk, std::chrono::milliseconds(200));
      const auto now = Clock::now();
      for (auto it = pending.begin(); it != pending.end();) {
        if (it->second <= now) {
          VLOG(1) << name << ": a connection sent no complete request within " << limits.handshake_timeout.count()
                  << " ms; closed";
          ::shutdown(it->first, SHUT_RDWR);
          it = pending.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  // Frame bytes: reserve `n` more, false when over the budget.
  bool Reserve(int64_t n) {
    int64_t cur = frame_bytes.load();
    do {
      if (cur + n > limits.max_buffered_frame_bytes) return false;
    } while (!frame_bytes.compare_exchange_weak(cur, cur + n));
    return true;
  }
  void Unreserve(int64_t n) { frame_bytes -= n; }
};

namespace {

using Shared = ThriftServer::Shared;

// OpenSSL is initialized once, by us, and never torn down (Thrift's
// factories would otherwise clean it up whenever their count drops to 0);
// Thrift's own diagnostics go to glog, at most one line a second; SIGPIPE is
// ignored unless the process handles it.
void EnsureThriftGlobals() {
  static std::once_flag once;
  std::call_once(once, [] {
    TSSLSocketFactory::setManualOpenSSLInitialization(true);
    apache::thrift::transport::initializeOpenSSL();
    // A TLS write to a peer that has gone raises SIGPIPE (OpenSSL writes
    // with write(2)); it is an error on that connection, never the end of
    // the process.
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
    apache::thrift::GlobalOutput.setOutputFunction(
        [](const char* msg) { LOG_EVERY_T(WARNING, 1) << "thrift: " << msg; });
  });
}

std::string AddressOf(int fd, bool with_port) {
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "?";
  const std::string host = NumericHost(sa);
  return with_port ? host + ":" + std::to_string(PortOf(sa)) : host;
}

// A connection's place in the server's limits: admitted at accept, let go
// (and taken off the first-request watch) before its descriptor closes.
class Admission {
 public:
  Admission(std::shared_ptr<Shared> shared, std::string peer, int fd)
      : shared_(std::move(shared)), peer_(std::move(peer)), fd_(fd) {
    shared_->AddPending(fd_);
  }
  ~Admission() { Release(); }
  void FirstRequestDone() {
    if (!first_done_) shared_->RemovePending(fd_);
    first_done_ = true;
  }
  void Release() {
    if (released_) return;
    released_ = true;
    shared_->RemovePending(fd_);
    shared_->Leave(peer_);
  }

 private:
  std::shared_ptr<Shared> shared_;
  std::string peer_;
  int fd_;
  bool first_done_ = false, released_ = false;
};

// What the server's sockets have in common: who is on the other end.
class IdentifiedSocket {
 public:
  virtual ~IdentifiedSocket() = default;
  virtual PeerIdentity identity() const = 0;
  virtual Admission* admission() = 0;
  virtual int fd() const = 0;
};

class PlainServerSocket final : public TSocket, public IdentifiedSocket {
 public:
  PlainServerSocket(THRIFT_SOCKET fd, std::shared_ptr<THRIFT_SOCKET> interrupt, std::shared_ptr<TConfiguration> config,
                    std::unique_ptr<Admission> admission, std::string address)
      : TSocket(fd, std::move(interrupt), std::move(config)), admission_(std::move(admission)) {
    identity_.address = std::move(address);
  }
  ~PlainServerSocket() override { PlainServerSocket::close(); }
  void close() override {
    admission_->Release();
    TSocket::close();
  }
  PeerIdentity identity() const override { return identity_; }
  Admission* admission() override { return admission_.get(); }
  int fd() const override { return static_cast<int>(socket_); }

 private:
  std::unique_ptr<Admission> admission_;
  PeerIdentity identity_;
};

// What a TLS socket checks of its peer (transport/tls_openssl.h, CheckPeer).
struct PeerPolicy {
  std::vector<std::string> roles;
  bool require = false;
  bool verify_host = false;  // clients: the dialled host must be named
};

// A TLS socket whose peer is checked by our policy when the handshake ends
// (Thrift's authorize() hook, which throws to refuse), and which remembers
// who the peer was.
class CheckedSslSocket final : public TSSLSocket, public IdentifiedSocket {
 public:
  // Server side.
  CheckedSslSocket(std::shared_ptr<SSLContext> ctx, THRIFT_SOCKET fd, std::shared_ptr<THRIFT_SOCKET> interrupt,
                   std::shared_ptr<TConfiguration> config, PeerPolicy policy, std::unique_ptr<Admission> admission,
                   std::string address)
      : TSSLSocket(std::move(ctx), fd, std::move(interrupt), std::move(config)),
        policy_(std::move(policy)),
        admission_(std::move(admission)) {
    server(true);
    identity_.address = std::move(address);
  }
  // Client side.
  CheckedSslSocket(std::shared_ptr<SSLContext> ctx, const std::string& host, int port,
                   std::shared_ptr<TConfiguration> config, PeerPolicy policy)
      : TSSLSocket(std::move(ctx), host, port, std::move(config)), policy_(std::move(policy)) {
    server(false);
    identity_.address = host + ":" + std::to_string(port);
  }
  ~CheckedSslSocket() override { CheckedSslSocket::close(); }
  void close() override {
    if (admission_) admission_->Release();
    TSSLSocket::close();
  }
  // Runs the handshake now (a client: errors at connect, not at the first call).
  void Handshake() { initializeHandshake(); }
  PeerIdentity identity() const override { return identity_; }
  Admission* admission() override { return admission_.get(); }
  int fd() const override { return static_cast<int>(socket_); }

 protected:
  void authorize() override {
    const std::string host = getHost();
    Result<PeerIdentity> id =
        CheckPeer(ssl_, identity_.address, policy_.roles, policy_.verify_host ? &host : nullptr, policy_.require);
    if (!id.ok()) {
      LOG_EVERY_T(WARNING, 1) << "TLS: " << id.status().message();
      throw TSSLException(id.status().message());
    }
    identity_ = *id;
  }

 private:
  PeerPolicy policy_;
  std::unique_ptr<Admission> admission_;
  PeerIdentity identity_;
};

// Thrift's factory for its SSL_CTX (loaded by ConfigureSslContext); it
// makes no sockets of its own here.
class ContextFactory final : public TSSLSocketFactory {
 public:
  ContextFactory() : TSSLSocketFactory(apache::thrift::transport::SSLTLS) {}
  std::shared_ptr<SSLContext> context() const { return ctx_; }
};

// A server socket bound before serve() (the port the OS picked is known
// first) that admits connections by the limits, wraps them in TLS when
// configured and survives failed accepts.
class GuardedServerSocket final : public apache::thrift::transport::TServerSocket {
 public:
  GuardedServerSocket(const std::string& host, int port, std::shared_ptr<Shared> shared,
                      std::shared_ptr<TConfiguration> config, PeerPolicy policy)
      : TServerSocket(host, port), shared_(std::move(shared)), config_(std::move(config)), policy_(std::move(policy)) {}
  void listen() override {
    if (listening_) return;
    TServerSocket::listen();
    listening_ = true;
  }

 protected:
  std::shared_ptr<TTransport> acceptImpl() override {
    try {
      return TServerSocket::acceptImpl();
    } catch (const TTransportException& e) {
      if (e.getType() != TTransportException::UNKNOWN) throw;
      // accept() failed (EMFILE, ENFILE, ECONNABORTED...): keep serving.
      ++shared_->accept_errors;
      LOG_EVERY_T(WARNING, 1) << shared_->name << ": accept failed (" << e.what() << "); retrying";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      throw TTransportException(TTransportException::CLIENT_DISCONNECT, "accept failed");
    }
  }
  std::shared_ptr<TSocket> createSocket(THRIFT_SOCKET fd) override {
    const std::string peer = AddressOf(fd, false);
    if (!shared_->Admit(peer)) {
      ++shared_->refused_over_limit;
      LOG_EVERY_T(WARNING, 1) << shared_->name << ": a connection from " << peer << " refused: over "
                              << shared_->limits.max_connections << " connections or "
                              << shared_->limits.max_connections_per_peer << " from one address";
      ::close(fd);
      throw TTransportException(TTransportException::CLIENT_DISCONNECT, "over the connection limits");
    }
    ++shared_->accepted;
    auto admission = std::make_unique<Admission>(shared_, peer, fd);
    std::shared_ptr<TSocket> s;
    if (std::shared_ptr<SSLContext> tls = shared_->TlsContext()) {
      // Stop() interrupts every connection's blocked read (the children's listener).
      s = std::make_shared<CheckedSslSocket>(std::move(tls), fd, pChildInterruptSockReader_, config_, policy_,
                                             std::move(admission), AddressOf(fd, true));
    } else {
      s = std::make_shared<PlainServerSocket>(fd, pChildInterruptSockReader_, config_, std::move(admission),
                                              AddressOf(fd, true));
    }
    return s;
  }

 private:
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<TConfiguration> config_;
  PeerPolicy policy_;
  bool listening_ = false;
};

// Frames every accepted connection with the server's limits, holding the
// frame being read against the server-wide budget.
class BudgetedFramedTransport final : public apache::thrift::transport::TFramedTransport {
 public:
  // A connection's buffer up to this size is its own (kept between frames,
  // not counted: max_connections bounds them); a larger one is counted.
  static constexpr uint32_t kSmall = 64 << 10;
  static int64_t Counted(uint32_t size) { return size > kSmall ? size : 0; }

  BudgetedFramedTransport(std::shared_ptr<TTransport> t, std::shared_ptr<TConfiguration> config,
                          std::shared_ptr<Shared> shared)
      : TFramedTransport(std::move(t), std::move(config)), shared_(std::move(shared)) {}
  ~BudgetedFramedTransport() override { shared_->Unreserve(Counted(rBufSize_)); }

 protected:
  bool readFrame() override {
    int32_t sz = -1;
    uint32_t got = 0;
    while (got < sizeof(sz)) {
      const uint32_t n = transport_->read(reinterpret_cast<uint8_t*>(&sz) + got, sizeof(sz) - got);
      if (n == 0) {
        if (got == 0) return false;
        throw TTransportException(TTransportException::END_OF_FILE, "end of file inside a frame header");
      }
      got += n;
    }
    sz = static_cast<int32_t>(ntohl(static_cast<uint32_t>(sz)));
    if (sz < 0) throw TTransportException(TTransportException::CORRUPTED_DATA, "a negative frame size");
    if (sz > static_cast<int32_t>(maxFrameSize_)) {
      throw TTransportException(
          TTransportException::CORRUPTED_DATA,
          "a frame of " + std::to_string(sz) + " bytes, over the limit of " + std::to_string(maxFrameSize_));
    }
    const uint32_t want = static_cast<uint32_t>(sz);
    if (want > rBufSize_ || (rBufSize_ > kSmall && want <= kSmall)) {
      const uint32_t size = std::max(want, uint32_t{4096});
      const int64_t more = Counted(size) - Counted(rBufSize_);
      if (more > 0 && !shared_->Reserve(more)) {
        ++shared_->refused_frame_budget;
        LOG_EVERY_T(WARNING, 1) << shared_->name << ": a frame of " << want << " bytes refused: the frames being "
                                << "read hold " << shared_->frame_bytes.load() << " of "
                                << shared_->limits.max_buffered_frame_bytes << " bytes";
        throw TTransportException(TTransportException::CORRUPTED_DATA, "the server's frame budget is spent");
      }
      if (more < 0) shared_->Unreserve(-more);
      rBuf_.reset(new uint8_t[size]);
      rBufSize_ = size;
    }
    transport_->readAll(rBuf_.get(), want);
    setReadBuffer(rBuf_.get(), want);
    // The first request is in: the handshake deadline is met (serving it may
    // take longer: a put that factors a document, a blocking Complete).
    if (!first_frame_read_) {
      first_frame_read_ = true;
      if (auto* s = dynamic_cast<IdentifiedSocket*>(transport_.get()); s != nullptr && s->admission() != nullptr) {
        s->admission()->FirstRequestDone();
      }
    }
    // Thrift's message-size accounting is per frame: the next message may
    // read at most this frame's bytes (a list's claimed size is checked
    // against them), and what earlier frames consumed does not count (else a
    // connection is dropped once its requests total max_frame_bytes).
    resetConsumedMessageSize();
    updateKnownMessageSize(want);
    return true;
  }

 private:
  std::shared_ptr<Shared> shared_;
  bool first_frame_read_ = false;
};

class BudgetedFramedTransportFactory final : public apache::thrift::transport::TTransportFactory {
 public:
  BudgetedFramedTransportFactory(std::shared_ptr<TConfiguration> config, std::shared_ptr<Shared> shared)
      : config_(std::move(config)), shared_(std::move(shared)) {}
  std::shared_ptr<TTransport> getTransport(std::shared_ptr<TTransport> t) override {
    return std::make_shared<BudgetedFramedTransport>(std::move(t), config_, shared_);
  }

 private:
  std::shared_ptr<TConfiguration> config_;
  std::shared_ptr<Shared> shared_;
};

thread_local const IdentifiedSocket* current_socket = nullptr;

// One connection's processor: the caller's identity for the handlers
// (CurrentPeer), the idle timeout once the first request is served, and no
// exception out of the connection's thread.
class ConnectionProcessor final : public TProcessor {
 public:
  ConnectionProcessor(std::shared_ptr<TProcessor> inner, std::shared_ptr<TTransport> client,
                      std::chrono::milliseconds idle)
      : inner_(std::move(inner)), client_(std::move(client)), idle_(idle) {
    socket_ = dynamic_cast<IdentifiedSocket*>(client_.get());
  }
  bool process(std::shared_ptr<TProtocol> in, std::shared_ptr<TProtocol> out, void* ctx) override {
    struct Scope {
      explicit Scope(const IdentifiedSocket* s) { current_socket = s; }
      ~Scope() { current_socket = nullptr; }
    } scope(socket_);
    bool keep = false;
    try {
      keep = inner_->process(std::move(in), std::move(out), ctx);
    } catch (const apache::thrift::TException&) {
      throw;  // the connection's loop ends it (a protocol or transport failure)
    } catch (const std::exception& e) {
      LOG(WARNING) << "a connection from " << (socket_ ? socket_->identity().ToString() : "?")
                   << " failed: " << e.what() << "; closed";
      return false;
    }
    if (!first_done_) {
      first_done_ = true;
      if (socket_ != nullptr && socket_->admission() != nullptr) socket_->admission()->FirstRequestDone();
      if (auto* s = dynamic_cast<TSocket*>(client_.get())) s->setRecvTimeout(static_cast<int>(idle_.count()));
    }
    return keep;
  }

 private:
  std::shared_ptr<TProcessor> inner_;
  std::shared_ptr<TTransport> client_;
  IdentifiedSocket* socket_ = nullptr;
  std::chrono::milliseconds idle_;
  bool first_done_ = false;
};

class ConnectionProcessorFactory final : public apache::thrift::TProcessorFactory {
 public:
  ConnectionProcessorFactory(std::shared_ptr<TProcessor> inner, std::chrono::milliseconds idle)
      : inner_(std::move(inner)), idle_(idle) {}
  std::shared_ptr<TProcessor> getProcessor(const apache::thrift::TConnectionInfo& info) override {
    return std::make_shared<ConnectionProcessor>(inner_, info.transport, idle_);
  }

 private:
  std::shared_ptr<TProcessor> inner_;
  std::chrono::milliseconds idle_;
};

Result<std::shared_ptr<ContextFactory>> MakeContext(const TlsFiles& files, bool server, bool require_peer) {
  EnsureThriftGlobals();
  std::shared_ptr<ContextFactory> f;
  try {
    f = std::make_shared<ContextFactory>();
  } catch (const std::exception& e) {
    return Status::Internal(std::string("TLS: ") + e.what());
  }
  PENUMBRA_RETURN_IF_ERROR(ConfigureSslContext(f->context()->get(), files, server, require_peer));
  return f;
}

}  // namespace

Status ThriftLimits::Validate() const {
  if (max_frame_bytes < 1024 || max_string_bytes < 1 || max_container_elements < 1) {
    return Status::InvalidArgument(
        "thrift limits: frame, string and container limits must be positive (frames >= 1 KiB)");
  }
  if (max_connections < 1 || max_connections_per_peer < 1) {
    return Status::InvalidArgument("thrift limits: max_connections and max_connections_per_peer must be >= 1");
  }
  if (max_buffered_frame_bytes < max_frame_bytes) {
    return Status::InvalidArgument("thrift limits: max_buffered_frame_bytes must hold at least one largest frame");
  }
  if (handshake_timeout.count() < 1 || idle_timeout.count() < 1 || send_timeout.count() < 1) {
    return Status::InvalidArgument("thrift limits: timeouts must be >= 1 ms");
  }
  return Status::OK();
}

namespace {
// The caller ScopedPeer names on this thread (nullopt: none).
struct ScopedCaller {
  PeerIdentity identity;
  int fd = -1;
};
thread_local std::optional<ScopedCaller> scoped_caller;
}  // namespace

ScopedPeer::ScopedPeer(PeerIdentity identity, int fd) { scoped_caller = ScopedCaller{std::move(identity), fd}; }
ScopedPeer::~ScopedPeer() { scoped_caller.reset(); }

const PeerIdentity& CurrentPeer() {
  static const PeerIdentity kNone;
  thread_local PeerIdentity cached;
  if (scoped_caller) return scoped_caller->identity;
  if (current_socket == nullptr) return kNone;
  cached = current_socket->identity();
  return cached;
}

bool CurrentPeerHungUp() {
  int fd = -1;
  if (scoped_caller) {
    if (scoped_caller->fd < 0) return false;
    fd = scoped_caller->fd;
  } else {
    if (current_socket == nullptr) return false;
    fd = current_socket->fd();
    if (fd < 0) return true;
  }
  pollfd p{};
  p.fd = fd;
  p.events = POLLIN | POLLRDHUP;
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

rpc::PenumbraError ToRpcError(const Status& s, int32_t retry_after_ms) {
  rpc::PenumbraError e;
  e.message = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      e.code = rpc::ErrorCode::INVALID_ARGUMENT;
      break;
    case StatusCode::kNotFound:
      e.code = rpc::ErrorCode::NOT_FOUND;
      break;
    case StatusCode::kPermissionDenied:
      e.code = rpc::ErrorCode::PERMISSION_DENIED;
      break;
    case StatusCode::kResourceExhausted:
      e.code = rpc::ErrorCode::RESOURCE_EXHAUSTED;
      e.__set_retry_after_ms(s.retry_after_ms() > 0 ? s.retry_after_ms() : retry_after_ms);
      break;
    case StatusCode::kUnavailable:
      e.code = rpc::ErrorCode::UNAVAILABLE;
      break;
    case StatusCode::kDeadlineExceeded:
      e.code = rpc::ErrorCode::DEADLINE_EXCEEDED;
      break;
    case StatusCode::kFailedPrecondition:
      e.code = rpc::ErrorCode::FAILED_PRECONDITION;
      break;
    case StatusCode::kCancelled:
      e.code = rpc::ErrorCode::CANCELLED;
      break;
    default:
      e.code = rpc::ErrorCode::INTERNAL;
      break;
  }
  return e;
}

Status FromRpcError(const rpc::PenumbraError& e) {
  switch (e.code) {
    case rpc::ErrorCode::INVALID_ARGUMENT:
      return Status::InvalidArgument(e.message);
    case rpc::ErrorCode::NOT_FOUND:
      return Status::NotFound(e.message);
    case rpc::ErrorCode::PERMISSION_DENIED:
      return Status::PermissionDenied(e.message);
    case rpc::ErrorCode::RESOURCE_EXHAUSTED:
      return Status::ResourceExhausted(e.message).WithRetryAfter(e.__isset.retry_after_ms ? e.retry_after_ms : 0);
    case rpc::ErrorCode::UNAVAILABLE:
      return Status::Unavailable(e.message);
    case rpc::ErrorCode::DEADLINE_EXCEEDED:
      return Status::DeadlineExceeded(e.message);
    case rpc::ErrorCode::FAILED_PRECONDITION:
      return Status::FailedPrecondition(e.message);
    case rpc::ErrorCode::CANCELLED:
      return Status::Cancelled(e.message);
    default:
      return Status::Internal(e.message);
  }
}

Status FromThriftException(const std::exception& e, const std::string& what) {
  if (dynamic_cast<const TSSLException*>(&e) != nullptr) {
    return Status::PermissionDenied(what + ": TLS: " + e.what());
  }
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

namespace {

using apache::thrift::protocol::TMessageType;
using apache::thrift::protocol::TProtocolException;
using apache::thrift::protocol::TType;

// The wire's type code as a TType, or INVALID_DATA.
TType CheckedType(int8_t code) {
  switch (code) {
    case apache::thrift::protocol::T_STOP:
    case apache::thrift::protocol::T_VOID:
    case apache::thrift::protocol::T_BOOL:
    case apache::thrift::protocol::T_BYTE:
    case apache::thrift::protocol::T_DOUBLE:
    case apache::thrift::protocol::T_I16:
    case apache::thrift::protocol::T_I32:
    case apache::thrift::protocol::T_U64:
    case apache::thrift::protocol::T_I64:
    case apache::thrift::protocol::T_STRING:
    case apache::thrift::protocol::T_STRUCT:
    case apache::thrift::protocol::T_MAP:
    case apache::thrift::protocol::T_SET:
    case apache::thrift::protocol::T_LIST:
    case apache::thrift::protocol::T_UTF8:
    case apache::thrift::protocol::T_UTF16:
      return static_cast<TType>(code);
    default:
      throw TProtocolException(TProtocolException::INVALID_DATA, "unknown type code " + std::to_string(code));
  }
}

// The fewest bytes one element of `type` takes on the wire (Thrift's own
// table; an unknown type was refused already).
int64_t MinBytes(TType type) {
  switch (type) {
    case apache::thrift::protocol::T_BOOL:
    case apache::thrift::protocol::T_BYTE:
    case apache::thrift::protocol::T_STRUCT:  // at least its T_STOP
      return 1;
    case apache::thrift::protocol::T_I16:
      return 2;
    case apache::thrift::protocol::T_I32:
    case apache::thrift::protocol::T_STRING:
    case apache::thrift::protocol::T_MAP:
    case apache::thrift::protocol::T_SET:
    case apache::thrift::protocol::T_LIST:
      return 4;
    case apache::thrift::protocol::T_DOUBLE:
    case apache::thrift::protocol::T_I64:
      return 8;
    default:
      return 1;
  }
}

}  // namespace

uint32_t CheckedBinaryProtocol::ReadContainerSize(int64_t min_element_bytes) {
  int32_t size = 0;
  readI32(size);
  if (size < 0) throw TProtocolException(TProtocolException::NEGATIVE_SIZE);
  if (container_limit_ != 0 && size > container_limit_) throw TProtocolException(TProtocolException::SIZE_LIMIT);
  ptrans_->checkReadBytesAvailable(static_cast<long>(size * min_element_bytes));
  return static_cast<uint32_t>(size);
}

uint32_t CheckedBinaryProtocol::readMessageBegin_virt(std::string& name, TMessageType& type, int32_t& seqid) {
  int32_t header = 0;
  uint32_t n = readI32(header);
  if (header >= 0 || (header & VERSION_MASK) != VERSION_1) {
    throw TProtocolException(TProtocolException::BAD_VERSION, "a message without the version header");
  }
  const int32_t t = header & 0xff;
  if (t < apache::thrift::protocol::T_CALL || t > apache::thrift::protocol::T_ONEWAY) {
    throw TProtocolException(TProtocolException::INVALID_DATA, "unknown message type " + std::to_string(t));
  }
  type = static_cast<TMessageType>(t);
  n += readString(name);
  n += readI32(seqid);
  return n;
}

uint32_t CheckedBinaryProtocol::readFieldBegin_virt(std::string&, TType& type, int16_t& id) {
  int8_t code = 0;
  uint32_t n = readByte(code);
  type = CheckedType(code);
  if (type == apache::thrift::protocol::T_STOP) {
    id = 0;
    return n;
  }
  return n + readI16(id);
}

uint32_t CheckedBinaryProtocol::readMapBegin_virt(TType& key, TType& value, uint32_t& size) {
  int8_t k = 0, v = 0;
  readByte(k);
  readByte(v);
  key = CheckedType(k);
  value = CheckedType(v);
  size = ReadContainerSize(MinBytes(key) + MinBytes(value));
  return 6;
}

uint32_t CheckedBinaryProtocol::readListBegin_virt(TType& elem, uint32_t& size) {
  int8_t e = 0;
  readByte(e);
  elem = CheckedType(e);
  size = ReadContainerSize(MinBytes(elem));
  return 5;
}

uint32_t CheckedBinaryProtocol::readSetBegin_virt(TType& elem, uint32_t& size) {
  int8_t e = 0;
  readByte(e);
  elem = CheckedType(e);
  size = ReadContainerSize(MinBytes(elem));
  return 5;
}

uint32_t CheckedBinaryProtocol::skip_virt(TType type) {
  // Through the virtual calls above (Thrift's own skip would call the
  // unchecked reads of TBinaryProtocol directly).
  return apache::thrift::protocol::skip(static_cast<apache::thrift::protocol::TProtocol&>(*this), type);
}

Result<std::unique_ptr<ThriftServer>> ThriftServer::Start(std::shared_ptr<TProcessor> processor,
                                                          const ThriftServerOptions& o) {
  if (o.port < 0 || o.port > 65535)
    return Status::InvalidArgument("port must be in [0, 65535], got " + std::to_string(o.port));
  PENUMBRA_RETURN_IF_ERROR(o.limits.Validate());
  EnsureThriftGlobals();
  auto s = std::unique_ptr<ThriftServer>(new ThriftServer());
  s->shared_ = std::make_shared<Shared>();
  s->shared_->limits = o.limits;
  s->shared_->name = o.name;
  PeerPolicy policy;
  if (o.tls) {
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ContextFactory> tls,
                              MakeContext(o.tls->files, true, o.tls->require_client_certificate));
    s->shared_->SetTlsContext(tls->context());
    policy.roles = o.tls->client_roles;
    policy.require = o.tls->require_client_certificate;
    s->tls_ = o.tls;
  }
  auto config = MakeConfiguration(o.limits);
  auto socket = std::make_shared<GuardedServerSocket>(o.host, o.port, s->shared_, config, policy);
  socket->setRecvTimeout(static_cast<int>(o.limits.handshake_timeout.count()));
  socket->setSendTimeout(static_cast<int>(o.limits.send_timeout.count()));
  try {
    socket->listen();
  } catch (const std::exception& e) {
    return Status::Unavailable("cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " + e.what());
  }
  s->port_ = socket->getPort();
  s->server_ = std::make_shared<apache::thrift::server::TThreadedServer>(
      std::make_shared<ConnectionProcessorFactory>(std::move(processor), o.limits.idle_timeout), socket,
      std::make_shared<BudgetedFramedTransportFactory>(config, s->shared_),
      std::make_shared<CheckedBinaryProtocolFactory>(o.limits.max_string_bytes, o.limits.max_container_elements));
  // Our own limits apply at accept (closing what is over them at once);
  // Thrift's would stop accepting and leave new clients in the backlog.
  s->server_->setConcurrentClientLimit(std::numeric_limits<int64_t>::max());
  auto server = s->server_;
  auto shared = s->shared_;
  s->thread_ = std::thread([server, shared] {
    std::thread reaper([shared] { shared->Reap(); });
    try {
      server->serve();
    } catch (const std::exception& e) {
      LOG(ERROR) << shared->name << " stopped: " << e.what();
    }
    {
      std::lock_guard<std::mutex> lk(shared->mu);
      shared->stop = true;
    }
    shared->cv.notify_all();
    reaper.join();
  });
  return s;
}

ThriftServer::~ThriftServer() { Stop(); }

Status ThriftServer::ReloadTls() {
  if (!tls_) return Status::FailedPrecondition(shared_->name + ": plaintext, no TLS files to reload");
  // A whole new context, built and checked aside: the accept path takes it
  // in one step (under the lock), so a connection gets the old files or the
  // new ones, never a mix; open connections keep the context they began
  // with (their SSL objects hold it).
  Result<std::shared_ptr<ContextFactory>> fresh = MakeContext(tls_->files, true, tls_->require_client_certificate);
  if (!fresh.ok()) return fresh.status().WithContext(shared_->name + ": TLS files not reloaded, the old ones stay");
  shared_->SetTlsContext((*fresh)->context());
  return Status::OK();
}

ThriftServerStats ThriftServer::stats() const {
  ThriftServerStats st;
  st.open_connections = shared_->open.load();
  st.accepted = shared_->accepted.load();
  st.refused_over_limit = shared_->refused_over_limit.load();
  st.refused_frame_budget = shared_->refused_frame_budget.load();
  st.accept_errors = shared_->accept_errors.load();
  return st;
}

void ThriftServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

struct TlsClientContext::Impl {
  std::shared_ptr<ContextFactory> factory;
  PeerPolicy policy;
};

Result<std::shared_ptr<const TlsClientContext>> TlsClientContext::Create(const TlsClientOptions& options) {
  if (options.files.ca_file.empty()) return Status::InvalidArgument("TLS client: a CA file is required");
  auto impl = std::make_shared<Impl>();
  // A client may go without a certificate of its own (a public API client
  // whose tenant needs none): then only the CA is loaded.
  if (options.files.cert_file.empty() && options.files.key_file.empty()) {
    EnsureThriftGlobals();
    try {
      impl->factory = std::make_shared<ContextFactory>();
    } catch (const std::exception& e) {
      return Status::Internal(std::string("TLS: ") + e.what());
    }
    SSL_CTX* ctx = impl->factory->context()->get();
    if (SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1 ||
        SSL_CTX_load_verify_locations(ctx, options.files.ca_file.c_str(), nullptr) != 1) {
      return Status::InvalidArgument("TLS client: cannot load the CA " + options.files.ca_file + ": " +
                                     OpenSslErrors());
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  } else {
    PENUMBRA_ASSIGN_OR_RETURN(impl->factory, MakeContext(options.files, false, true));
  }
  impl->policy.roles = options.server_roles;
  impl->policy.require = true;
  impl->policy.verify_host = options.verify_host;
  return std::shared_ptr<const TlsClientContext>(new TlsClientContext(std::move(impl)));
}

Result<std::shared_ptr<TSocket>> ConnectSocket(const std::string& host, int port, std::chrono::milliseconds timeout,
                                               std::shared_ptr<TConfiguration> config,
                                               const std::shared_ptr<const TlsClientContext>& tls) {
  const std::string where = "connect to " + host + ":" + std::to_string(port);
  const int ms = static_cast<int>(timeout.count());
  try {
    if (!tls) {
      auto s = std::make_shared<TSocket>(host, port, std::move(config));
      s->setConnTimeout(ms);
      s->setRecvTimeout(ms);
      s->setSendTimeout(ms);
      s->open();
      return std::shared_ptr<TSocket>(s);
    }
    const TlsClientContext::Impl& t = tls->impl();
    auto s = std::make_shared<CheckedSslSocket>(t.factory->context(), host, port, std::move(config), t.policy);
    s->setConnTimeout(ms);
    s->setRecvTimeout(ms);
    s->setSendTimeout(ms);
    s->open();
    s->Handshake();
    return std::shared_ptr<TSocket>(s);
  } catch (const std::exception& e) {
    return FromThriftException(e, where);
  }
}

}  // namespace penumbra::transport
