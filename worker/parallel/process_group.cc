#include "worker/parallel/process_group.h"

#include <arpa/inet.h>
#include <endian.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/crypto.h"
#include "transport/tls_openssl.h"

namespace penumbra {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// ---------------------------------------------------------------- framing
//
// Every message starts with a frame: 28 bytes, big-endian, so that hosts
// need not agree on byte order. The magic doubles as the protocol version.
//
// Joining, on each connection to rank 0 (after its TLS handshake, when the
// group uses TLS):
//   rank 0 -> Challenge: code = flags, bytes = kNonceBytes: rank 0's nonce
//   rank r -> Hello:     code = flags, arg = r, seq = its world,
//                        bytes = kHelloBytes: its nonce, then its proof
//   rank 0 -> Welcome (once every rank has joined): arg = world,
//                        bytes = kProofBytes: rank 0's proof
// or rank 0 -> Abort with why it refused the hello. A proof is
// HMAC-SHA256(group secret, label, rank, world, both nonces, the TLS
// session's exporter) when the group has a secret (flags: kFlagSecret),
// else zeros.
constexpr uint32_t kMagic = 0x50434f32;  // "PCO2"
constexpr size_t kFrameBytes = 28;
// An abort's message (text for a Status) longer than this is cut.
constexpr size_t kMaxAbortMessage = 4096;
constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;
constexpr size_t kHelloBytes = kNonceBytes + kProofBytes;
constexpr uint8_t kFlagSecret = 1;  // the sender holds a group secret
constexpr size_t kMinGroupSecretBytes = 16;

enum Op : uint8_t {
  kHello = 1,    // rank > 0 -> rank 0 after the challenge (above)
  kWelcome = 2,  // rank 0 -> every rank once all have joined (above)
  kAbort = 3,    // the sender gave up: code = its StatusCode, then `bytes` of message
  kAllGather = 4,
  kBroadcast = 5,
  kAllGatherHost = 6,
  kBroadcastHost = 7,
  kBarrier = 8,
  kChallenge = 9,  // rank 0 -> each connection before its hello (above)
};

struct Frame {
  uint8_t op = 0;
  uint8_t code = 0;
  int32_t arg = -1;    // Broadcast*: the root
  uint64_t seq = 0;    // the call's number on every rank: 1, 2, ...
  uint64_t bytes = 0;  // the call's `bytes` argument
  bool operator==(const Frame&) const = default;
};

void Encode(const Frame& f, uint8_t* out) {
  const uint32_t magic = htobe32(kMagic);
  const uint32_t arg = htobe32(static_cast<uint32_t>(f.arg));
  const uint64_t seq = htobe64(f.seq);
  const uint64_t bytes = htobe64(f.bytes);
  std::memcpy(out, &magic, 4);
  out[4] = f.op;
  out[5] = f.code;
  out[6] = out[7] = 0;
  std::memcpy(out + 8, &arg, 4);
  std::memcpy(out + 12, &seq, 8);
  std::memcpy(out + 20, &bytes, 8);
}

bool Decode(const uint8_t* in, Frame* f) {
  uint32_t magic = 0, arg = 0;
  uint64_t seq = 0, bytes = 0;
  std::memcpy(&magic, in, 4);
  if (be32toh(magic) != kMagic) return false;
  std::memcpy(&arg, in + 8, 4);
  std::memcpy(&seq, in + 12, 8);
  std::memcpy(&bytes, in + 20, 8);
  f->op = in[4];
  f->code = in[5];
  f->arg = static_cast<int32_t>(be32toh(arg));
  f->seq = be64toh(seq);
  f->bytes = be64toh(bytes);
  return true;
}

const char* OpName(uint8_t op) {
  switch (op) {
    case kHello:
      return "Hello";
    case kWelcome:
      return "Welcome";
    case kAbort:
      return "Abort";
    case kAllGather:
      return "AllGather";
    case kBroadcast:
      return "Broadcast";
    case kAllGatherHost:
      return "AllGatherHost";
    case kBroadcastHost:
      return "BroadcastHost";
    case kBarrier:
      return "Barrier";
    case kChallenge:
      return "Challenge";
    default:
      return "an unknown op";
  }
}

bool IsGather(uint8_t op) { return op == kAllGather || op == kAllGatherHost; }
bool IsBroadcast(uint8_t op) { return op == kBroadcast || op == kBroadcastHost; }

// "AllGather #3 of 16 bytes", "Broadcast #4 of 8 bytes from root 1", "Barrier #5".
std::string Describe(const Frame& f) {
  std::string s = std::string(OpName(f.op)) + " #" + std::to_string(f.seq);
  if (f.op != kBarrier) s += " of " + std::to_string(f.bytes) + " bytes";
  if (IsBroadcast(f.op)) s += " from root " + std::to_string(f.arg);
  return s;
}

// ---------------------------------------------------------------- sockets

std::string Errno(int e) { return std::strerror(e); }

std::string Seconds(Clock::duration d) {
  const double s = std::chrono::duration<double>(d).count();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Reset(); }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Milliseconds left until `deadline`, for poll().
int PollMs(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, int64_t{1} << 30));
}

// Small frames go out at once (a call's latency is a few of them in a row).
Status SetNoDelay(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) {
    return Status::IOError("setsockopt(TCP_NODELAY): " + Errno(errno));
  }
  return Status::OK();
}

struct AddrInfoFree {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoFree>;

// getaddrinfo, its error code in *gai_error.
AddrInfo Resolve(const std::string& host, int port, int flags, int* gai_error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  *gai_error = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (*gai_error != 0) return nullptr;
  return AddrInfo(res);
}

std::string HostPort(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// A connect that retries to its own address can meet itself (TCP's
// simultaneous open, when the port is free and in the ephemeral range): a
// connection whose two ends are the same address is not rank 0.
bool ConnectedToSelf(int fd) {
  sockaddr_storage a{}, b{};
  socklen_t la = sizeof a, lb = sizeof b;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0) return false;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0) return false;
  return la == lb && std::memcmp(&a, &b, la) == 0;
}

// The numeric address of a peer accepted on a listener: its host alone, and
// host:port.
void AddressOf(const sockaddr_storage& a, std::string* host, std::string* address) {
  *host = transport::NumericHost(a);
  *address = HostPort(*host, transport::PortOf(a));
}

// ---------------------------------------------------------------- TLS

struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using SslCtx = std::unique_ptr<SSL_CTX, SslCtxFree>;

// OpenSSL's socket BIO writes with write(2), so a peer that has gone raises
// SIGPIPE, which ends a process that has not ignored it (a library must
// not ask that of its host). This BIO sends with MSG_NOSIGNAL instead, and
// keeps the errno of its last failure for the caller (errno itself may be
// overwritten inside OpenSSL).
struct SocketBio {
  int fd = -1;
  int error = 0;     // errno of the last failed send/recv (0: none, or EOF)
  bool eof = false;  // recv returned 0
};

SocketBio* StateOf(BIO* b) { return static_cast<SocketBio*>(BIO_get_data(b)); }

int SocketBioWrite(BIO* b, const char* data, size_t n, size_t* written) {
  SocketBio* s = StateOf(b);
  BIO_clear_retry_flags(b);
  const ssize_t k = send(s->fd, data, n, MSG_NOSIGNAL);
  if (k >= 0) {
    *written = static_cast<size_t>(k);
    return 1;
  }
  s->error = errno;
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_write(b);
  return 0;
}

int SocketBioRead(BIO* b, char* data, size_t n, size_t* got) {
  SocketBio* s = StateOf(b);
  BIO_clear_retry_flags(b);
  const ssize_t k = recv(s->fd, data, n, 0);
  if (k > 0) {
    *got = static_cast<size_t>(k);
    return 1;
  }
  if (k == 0) {
    s->eof = true;
    return 0;
  }
  s->error = errno;
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_read(b);
  return 0;
}

long SocketBioCtrl(BIO* b, int cmd, long, void*) {
  switch (cmd) {
    case BIO_CTRL_FLUSH:
      return 1;  // nothing buffered here
    case BIO_CTRL_EOF:
      return StateOf(b)->eof ? 1 : 0;
    default:
      return 0;
  }
}

int SocketBioCreate(BIO* b) {
  BIO_set_data(b, new SocketBio);
  BIO_set_init(b, 1);
  return 1;
}

int SocketBioDestroy(BIO* b) {
  delete StateOf(b);
  BIO_set_data(b, nullptr);
  return 1;
}

BIO_METHOD* SocketBioMethod() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "penumbra collective socket");
    CHECK(m != nullptr) << "BIO_meth_new: " << transport::OpenSslErrors();
    BIO_meth_set_write_ex(m, SocketBioWrite);
    BIO_meth_set_read_ex(m, SocketBioRead);
    BIO_meth_set_ctrl(m, SocketBioCtrl);
    BIO_meth_set_create(m, SocketBioCreate);
    BIO_meth_set_destroy(m, SocketBioDestroy);
    return m;
  }();
  return method;
}

// A TLS record's payload at most: a small message and the start of its
// payload go out as one record.
constexpr size_t kTlsRecordBytes = 16384;

// One connection of the group: a non-blocking socket, and its TLS session
// when the group uses TLS. Every call is one non-blocking step:
//   Handshake: 1 when done; Recv: > 0 bytes, 0 when the peer has closed;
//   Send: > 0 bytes (of the iovecs in order);
//   otherwise -1 (0 for a Handshake the peer closed) with *err an errno:
//   EAGAIN (would block: poll for *wait), EPROTO (TLS failed: tls_error()),
//   or the socket's (ECONNRESET, EPIPE...).
class Conn {
 public:
  Conn() = default;
  explicit Conn(Fd fd) : fd_(std::move(fd)) {}
  // TLS over `fd` (server or client side); the handshake is not yet done.
  static Result<Conn> Tls(Fd fd, SSL_CTX* ctx, bool server) {
    Conn c(std::move(fd));
    c.ssl_ = SSL_new(ctx);
    BIO* bio = c.ssl_ != nullptr ? BIO_new(SocketBioMethod()) : nullptr;
    if (bio == nullptr) return Status::Internal("collective: SSL_new/BIO_new: " + transport::OpenSslErrors());
    c.bio_ = StateOf(bio);
    c.bio_->fd = c.fd();
    SSL_set_bio(c.ssl_, bio, bio);
    if (server) {
      SSL_set_accept_state(c.ssl_);
    } else {
      SSL_set_connect_state(c.ssl_);
    }
    return c;
  }
  Conn(Conn&& o) noexcept { *this = std::move(o); }
  Conn& operator=(Conn&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::move(o.fd_);
      ssl_ = std::exchange(o.ssl_, nullptr);
      bio_ = std::exchange(o.bio_, nullptr);
      fatal_ = o.fatal_;
      tls_error_ = std::move(o.tls_error_);
    }
    return *this;
  }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;
  ~Conn() { Reset(); }

  // Closes it (a TLS session in good order says close_notify first, best
  // effort and without waiting).
  void Reset() {
    if (ssl_ != nullptr) {
      if (!fatal_ && SSL_is_init_finished(ssl_)) {
        ERR_clear_error();
        (void)SSL_shutdown(ssl_);
      }
      SSL_free(ssl_);
      ERR_clear_error();
    }
    ssl_ = nullptr;
    bio_ = nullptr;
    fatal_ = false;
    fd_.Reset();
  }
  int fd() const { return fd_.get(); }
  SSL* ssl() const { return ssl_; }
  explicit operator bool() const { return static_cast<bool>(fd_); }
  const std::string& tls_error() const { return tls_error_; }
  // Received bytes already inside the TLS session (poll() cannot see them).
  bool Buffered() const { return ssl_ != nullptr && SSL_has_pending(ssl_) == 1; }

  int Handshake(int* err, short* wait) {
    Begin();
    const int r = SSL_do_handshake(ssl_);
    if (r == 1) return 1;
    return static_cast<int>(Failed(r, err, wait));
  }

  ssize_t Recv(void* p, size_t n, int* err, short* wait) {
    if (ssl_ == nullptr) {
      const ssize_t k = recv(fd(), p, n, 0);
      if (k < 0) {
        *err = errno;
        *wait = POLLIN;
      }
      return k;
    }
    Begin();
    const int r = SSL_read(ssl_, p, static_cast<int>(std::min<size_t>(n, std::numeric_limits<int>::max())));
    if (r > 0) return r;
    return Failed(r, err, wait);
  }

  ssize_t Send(const iovec* iov, size_t count, int* err, short* wait) {
    if (ssl_ == nullptr) {
      msghdr m{};
      m.msg_iov = const_cast<iovec*>(iov);
      m.msg_iovlen = count;
      const ssize_t k = sendmsg(fd(), &m, MSG_NOSIGNAL);
      if (k < 0) {
        *err = errno;
        *wait = POLLOUT;
      }
      return k;
    }
    // A frame and the start of its payload in one record. A write retried
    // after EAGAIN is given the same bytes again (the caller has not moved
    // on), as OpenSSL requires.
    const char* p = static_cast<const char*>(iov[0].iov_base);
    size_t n = iov[0].iov_len;
    if (count > 1 && n < kTlsRecordBytes) {
      const size_t take = std::min(iov[1].iov_len, kTlsRecordBytes - n);
      staging_.assign(p, p + n);
      staging_.append(static_cast<const char*>(iov[1].iov_base), take);
      p = staging_.data();
      n = staging_.size();
    }
    Begin();
    const int r = SSL_write(ssl_, p, static_cast<int>(std::min<size_t>(n, std::numeric_limits<int>::max())));
    if (r > 0) return r;
    const ssize_t f = Failed(r, err, wait);
    if (f == 0) *err = EPIPE;  // the peer closed: no write can go through
    return -1;
  }

 private:
  void Begin() {
    ERR_clear_error();
    bio_->error = 0;
  }
  // After an SSL_* call returned r <= 0: what happened.
  ssize_t Failed(int r, int* err, short* wait) {
    switch (SSL_get_error(ssl_, r)) {
      case SSL_ERROR_WANT_READ:
        *err = EAGAIN;
        *wait = POLLIN;
        return -1;
      case SSL_ERROR_WANT_WRITE:
        *err = EAGAIN;
        *wait = POLLOUT;
        return -1;
      case SSL_ERROR_ZERO_RETURN:
        return 0;
      case SSL_ERROR_SYSCALL:
        fatal_ = true;
        ERR_clear_error();
        if (bio_->error == 0) return 0;  // the connection ended
        *err = bio_->error;
        return -1;
      default:
        fatal_ = true;
        tls_error_ = transport::OpenSslErrors();
        *err = EPROTO;
        return -1;
    }
  }

  Fd fd_;
  SSL* ssl_ = nullptr;
  SocketBio* bio_ = nullptr;  // owned by ssl_'s BIO
  bool fatal_ = false;        // after a fatal error a TLS session must not be shut down in order
  std::string tls_error_;
  std::string staging_;
};

// The context for every TLS session of a group: mutual, certificates from
// the CA (transport/tls_openssl.h), non-blocking I/O in records.
Result<SslCtx> MakeSslContext(const transport::TlsFiles& files, bool server) {
  SslCtx ctx(SSL_CTX_new(TLS_method()));
  if (!ctx) return Status::Internal("collective: SSL_CTX_new: " + transport::OpenSslErrors());
  PENUMBRA_RETURN_IF_ERROR(transport::ConfigureSslContext(ctx.get(), files, server, /*require_peer_certificate=*/true)
                               .WithContext("collective"));
  // A write returns once a record is out (the group's idle deadline sees
  // progress), retried from wherever the caller's buffer now is.
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Records read several at a time rather than header, then body.
  SSL_CTX_set_read_ahead(ctx.get(), 1);
  SSL_CTX_set_default_read_buffer_len(ctx.get(), 4 * (kTlsRecordBytes + 512));
  // Every message is framed with its length: an end without close_notify
  // cannot truncate one unseen, and reads as the peer closing.
  SSL_CTX_set_options(ctx.get(), SSL_OP_IGNORE_UNEXPECTED_EOF);
  // A group's sessions are never resumed.
  if (server) (void)SSL_CTX_set_num_tickets(ctx.get(), 0);
  return ctx;
}

// 32 bytes both ends of a TLS session share and nobody else knows (RFC
// 5705): a hello's proof over it is good for this session only.
Result<std::string> SessionBinding(SSL* ssl) {
  static constexpr char kLabel[] = "EXPORTER-penumbra-context-group";
  std::string out(32, '\0');
  if (SSL_export_keying_material(ssl, reinterpret_cast<unsigned char*>(out.data()), out.size(), kLabel,
                                 sizeof kLabel - 1, nullptr, 0, 0) != 1) {
    return Status::Internal("collective: SSL_export_keying_material: " + transport::OpenSslErrors());
  }
  return out;
}

// A proof that the sender holds `secret` (HMAC-SHA256; `label` tells a
// hello's from a welcome's).
std::string Proof(std::string_view secret, std::string_view label, int64_t rank, uint64_t world, const uint8_t* nonce0,
                  const uint8_t* nonce_r, const std::string& binding) {
  if (secret.empty()) return std::string(kProofBytes, '\0');
  const uint64_t r = htobe64(static_cast<uint64_t>(rank)), w = htobe64(world);
  HmacSha256Stream h(secret);
  h.Update(label).Update("\0", 1).Update(&r, 8).Update(&w, 8);
  h.Update(nonce0, kNonceBytes).Update(nonce_r, kNonceBytes).Update(binding);
  const Sha256Digest d = h.Final();
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

constexpr std::string_view kHelloLabel = "penumbra/cp-hello";
constexpr std::string_view kWelcomeLabel = "penumbra/cp-welcome";

// ---------------------------------------------------------------- the group

// When an exchange gives up: `at`, pushed back by `idle` whenever a byte
// moves (idle 0: a fixed deadline, joining's).
struct Deadline {
  Clock::time_point at;
  Clock::duration idle{0};
  void Progress() {
    if (idle.count() > 0) at = Clock::now() + idle;
  }
};

Clock::duration ToDuration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

class TcpCollective final : public Collective {
 public:
  // `ctx`: the group's TLS context (null: plaintext).
  TcpCollective(const CollectiveOptions& o, Clock::duration timeout, SslCtx ctx)
      : rank_(o.rank),
        world_(o.world),
        timeout_(timeout),
        grace_(o.rank == 0 ? Clock::duration(0) : timeout / 2),
        ctx_(std::move(ctx)),
        secret_(o.security.group_secret),
        peer_roles_(o.security.peer_roles),
        verify_host_(o.security.verify_host),
        hello_timeout_(std::min(ToDuration(o.hello_timeout_s), timeout)),
        max_pending_(static_cast<size_t>(o.max_pending)),
        max_pending_per_host_(static_cast<size_t>(o.max_pending_per_host)),
        peers_(static_cast<size_t>(o.world)),
        send_cut_(static_cast<size_t>(o.world), false) {}

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Status AllGather(const void* send, void* recv, size_t bytes) override {
    return Call(kAllGather, -1, send, recv, bytes);
  }
  Status Broadcast(void* buf, size_t bytes, int root) override { return Call(kBroadcast, root, buf, buf, bytes); }
  Status BroadcastHost(void* buf, size_t bytes, int root) override {
    return Call(kBroadcastHost, root, buf, buf, bytes);
  }
  Status AllGatherHost(const void* send, void* recv, size_t bytes) override {
    return Call(kAllGatherHost, -1, send, recv, bytes);
  }
  Status Barrier() override { return Call(kBarrier, -1, nullptr, nullptr, 0); }
  // A peer's connection closed (its FIN or reset seen by poll, nothing
  // read): its process is gone.
  Status Probe() override {
    std::lock_guard<std::mutex> lk(probe_mu_);
    for (int r = 0; r < world_; ++r) {
      if (r == rank_ || !peers_[r]) continue;
      pollfd p{peers_[r].fd(), POLLRDHUP, 0};
      if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        return Status::Unavailable("collective (rank " + std::to_string(rank_) + " of " + std::to_string(world_) +
                                   "): rank " + std::to_string(r) + "'s connection closed (its process gone?)");
      }
    }
    return Status::OK();
  }

  // Joining: rank 0 accepts the others on `listener`; a rank > 0 connects
  // to host:port. Both return once every rank has joined (rank 0's welcome).
  Status Listen(std::unique_ptr<CollectiveListener> listener, Clock::time_point deadline);
  Status Join(const std::string& host, int port, Clock::time_point deadline);

  // Breaks the group with `s` (the first failure wins): tells the peers
  // why, so that they fail with this reason now rather than later with a
  // closed connection or a deadline, and closes every connection. Returns
  // the group's error.
  Status Fail(const Status& s);

 private:
  // A connection rank 0 has accepted that has not joined yet.
  struct Pending {
    enum class Stage { kHandshake, kChallenge, kHello };
    Conn conn;
    std::string host;     // its address alone (the per-host cap)
    std::string address;  // host:port
    std::string who;      // its certificate's role/name, once checked
    Clock::time_point deadline;
    Stage stage = Stage::kChallenge;
    short wait = POLLIN;  // the event it waits for
    std::string out;      // the challenge
    size_t out_done = 0;
    uint8_t nonce[kNonceBytes] = {};
    std::string binding;  // the TLS session's exporter ("" in plaintext)
    uint8_t in[kFrameBytes + kHelloBytes] = {};
    size_t got = 0;
    Frame hello;
    std::string welcome;  // rank 0's proof for its welcome
  };
  enum class Next { kWait, kJoined, kDrop };
  // Moves `p` on as far as it goes without blocking: kJoined sets *rank,
  // kDrop says why.
  Next Step(Pending& p, std::string* why, int* rank);
  // A hello's rank, world and proof, against this group (rank 0).
  Status CheckHello(const Pending& p) const;
  // Logs a refused connection (the first few, then one in a hundred) and
  // remembers the last for the timeout's message.
  void Refused(const std::string& who, const std::string& why);
  // Tells a refused peer why, best effort, without waiting.
  static void SendAbortNow(Conn& c, const Status& s);
  // A rank > 0 on a new connection to rank 0: the TLS handshake, rank 0's
  // challenge, the hello and rank 0's welcome. *retry: rank 0 closed it
  // before its challenge (it was busy, or it refused a connection without
  // saying why): connecting again may succeed.
  Status Introduce(Fd fd, const std::string& host, int port, Clock::time_point deadline, bool* retry);

  Status Call(Op op, int root, const void* send, void* recv, size_t bytes);
  Status Exchange(const void* send, void* recv);
  Deadline Idle(Clock::duration extra = Clock::duration(0)) const {
    return {Clock::now() + timeout_ + extra, timeout_ + extra};
  }

  // Sends frame `f` and then n bytes of payload to `peer`. On each
  // connection one side talks at a time, so whatever arrives from the peer
  // meanwhile is an abort (or its close): read, it becomes the error.
  Status Send(int peer, const Frame& f, const void* payload, size_t n, Deadline& d, bool watch = true);
  Status Recv(int peer, void* data, size_t n, Deadline& d);
  // The next frame from `peer`; an abort becomes the peer's error (and
  // sets *aborted).
  Result<Frame> RecvFrame(int peer, Deadline& d, bool* aborted = nullptr);
  // Why the connection to `peer` failed with errno `e`: the abort the peer
  // sent before it closed, when there is one to read.
  Status PeerFailure(int peer, int e);
  Status Timeout(int peer, const char* doing, const Deadline& d) const;
  Status Mismatch(int other, const Frame& theirs) const;
  // " in AllGather #3 of 8 bytes", or " while joining".
  std::string In() const { return call_.op == 0 ? " while joining" : " in " + Describe(call_); }

  const int rank_, world_;
  const Clock::duration timeout_;
  // Rank 0 is the one that finds which rank is late, stopped or gone, and
  // tells the others: they wait for its word this much longer than it
  // waits, so that they fail with its reason rather than their own timeout.
  const Clock::duration grace_;
  const SslCtx ctx_;
  const std::string secret_;
  const std::vector<std::string> peer_roles_;
  const bool verify_host_;
  const Clock::duration hello_timeout_;
  const size_t max_pending_, max_pending_per_host_;
  // Rank 0: a connection to each rank > 0; a rank > 0: peers_[0].
  std::vector<Conn> peers_;
  std::mutex probe_mu_;  // Probe's reads of peers_ against Fail's closing them
  // A message to the peer was cut off midway: the stream is out of step,
  // so no abort can follow it (the peer would read it as payload).
  std::vector<bool> send_cut_;
  uint64_t seq_ = 0;
  Frame call_;  // the call in progress (op 0 while joining)
  Status broken_;
  // Rank 0: connections refused while joining, and the last one's reason.
  uint64_t refused_ = 0;
  std::string last_refusal_;
};

Status TcpCollective::Call(Op op, int root, const void* send, void* recv, size_t bytes) {
  if (!broken_.ok()) return broken_;
  call_ = Frame{op, 0, root, ++seq_, bytes};
  Status s;
  if (IsBroadcast(op) && (root < 0 || root >= world_)) {
    s = Status::InvalidArgument(Describe(call_) + ": root " + std::to_string(root) + " is not a rank of world " +
                                std::to_string(world_));
  } else if (bytes > 0 && (send == nullptr || recv == nullptr)) {
    s = Status::InvalidArgument(Describe(call_) + ": a null buffer");
  } else if (IsGather(op) && bytes > std::numeric_limits<size_t>::max() / static_cast<size_t>(world_)) {
    s = Status::InvalidArgument(Describe(call_) + ": world * bytes overflows");
  } else {
    s = Exchange(send, recv);
  }
  // A failed call leaves the ranks out of step (some may have finished it):
  // no later call can be trusted.
  if (!s.ok()) return Fail(s);
  return Status::OK();
}

// Rank 0 takes every rank's frame (checking it is in the same call) and
// contribution, then sends each the result; a rank > 0 sends its frame and
// contribution, then takes rank 0's frame (the same check) and the result.
// Rank 0 serves the ranks one after the other (simple; on one host the
// copies, not the order, bound the time): a rank waits while those before
// it are served, so timeout_s must cover one rank's transfer. Every
// payload read is the size of this rank's own call (the frames are
// compared first), never a size the peer names.
Status TcpCollective::Exchange(const void* send, void* recv) {
  const Frame& mine = call_;
  const size_t bytes = mine.bytes;
  const bool gather = IsGather(mine.op), bcast = IsBroadcast(mine.op);
  const int root = mine.arg;
  char* out = static_cast<char*>(recv);
  const size_t all = gather ? bytes * static_cast<size_t>(world_) : bytes;
  if (rank_ == 0) {
    // send may be out itself (AllGather in place).
    if (gather && bytes > 0 && send != out) std::memmove(out, send, bytes);
    for (int r = 1; r < world_; ++r) {
      Deadline d = Idle();
      PENUMBRA_ASSIGN_OR_RETURN(const Frame f, RecvFrame(r, d));
      if (!(f == mine)) return Mismatch(r, f);
      if (gather) {
        PENUMBRA_RETURN_IF_ERROR(Recv(r, out + static_cast<size_t>(r) * bytes, bytes, d));
      } else if (bcast && root == r) {
        PENUMBRA_RETURN_IF_ERROR(Recv(r, out, bytes, d));
      }
    }
    for (int r = 1; r < world_; ++r) {
      Deadline d = Idle();
      const bool data = gather || (bcast && root != r);
      PENUMBRA_RETURN_IF_ERROR(Send(r, mine, data ? out : nullptr, data ? all : 0, d));
    }
    return Status::OK();
  }
  Deadline d = Idle();
  const bool give = gather || (bcast && root == rank_);
  PENUMBRA_RETURN_IF_ERROR(Send(0, mine, give ? send : nullptr, give ? bytes : 0, d));
  d = Idle(grace_);
  PENUMBRA_ASSIGN_OR_RETURN(const Frame f, RecvFrame(0, d));
  if (!(f == mine)) return Mismatch(0, f);
  if (gather || (bcast && root != rank_)) PENUMBRA_RETURN_IF_ERROR(Recv(0, out, all, d));
  return Status::OK();
}

Status TcpCollective::Send(int peer, const Frame& f, const void* payload, size_t n, Deadline& d, bool watch) {
  Conn& c = peers_[peer];
  uint8_t head[kFrameBytes];
  Encode(f, head);
  // The frame and its payload in one sendmsg: small messages are one segment.
  iovec iov[2] = {{head, kFrameBytes}, {const_cast<void*>(payload), n}};
  iovec* first = iov;
  size_t count = n > 0 ? 2 : 1;
  bool started = false;
  while (count > 0) {
    int e = 0;
    short wait = POLLOUT;
    const ssize_t k = c.Send(first, count, &e, &wait);
    if (k > 0) {
      started = true;
      d.Progress();
      size_t done = static_cast<size_t>(k);
      while (count > 0 && done >= first->iov_len) {
        done -= first->iov_len;
        ++first;
        --count;
      }
      if (count > 0) {
        first->iov_base = static_cast<char*>(first->iov_base) + done;
        first->iov_len -= done;
      }
      continue;
    }
    if (k == 0) e = EAGAIN;
    if (e == EINTR) continue;
    if (e != EAGAIN && e != EWOULDBLOCK) {
      if (started) send_cut_[peer] = true;
      if (e == EPROTO) {
        return Status::Unavailable("connection to rank " + std::to_string(peer) + In() + ": TLS: " + c.tls_error());
      }
      return PeerFailure(peer, e);
    }
    pollfd p{c.fd(), static_cast<short>(wait | (watch ? POLLIN : 0)), 0};
    int ready = 1;
    if (watch && c.Buffered()) {
      p.revents = POLLIN;  // received already, inside the TLS session
    } else {
      ready = poll(&p, 1, PollMs(d.at));
    }
    if (ready < 0 && errno != EINTR) return Status::Internal("poll: " + Errno(errno));
    if (ready == 0 && Clock::now() >= d.at) {
      if (started) send_cut_[peer] = true;
      return Timeout(peer, "sending to", d);
    }
    if (watch && ready > 0 && (p.revents & POLLIN)) {
      if (started) send_cut_[peer] = true;
      Deadline brief{Clock::now() + 1s, 1s};
      auto got = RecvFrame(peer, brief);
      if (!got.ok()) return got.status();
      return Status::Internal("rank " + std::to_string(peer) + " sent " + Describe(*got) +
                              " while this rank was sending" + In() + " (protocol error)");
    }
    // POLLERR / POLLHUP: the next send says what.
  }
  return Status::OK();
}

Status TcpCollective::Recv(int peer, void* data, size_t n, Deadline& d) {
  Conn& c = peers_[peer];
  char* p = static_cast<char*>(data);
  while (n > 0) {
    int e = 0;
    short wait = POLLIN;
    const ssize_t k = c.Recv(p, n, &e, &wait);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      d.Progress();
      continue;
    }
    if (k == 0) return Status::Unavailable("rank " + std::to_string(peer) + " closed the connection" + In());
    if (e == EINTR) continue;
    if (e == ECONNRESET) {
      return Status::Unavailable("rank " + std::to_string(peer) + " closed the connection" + In() + " (" + Errno(e) +
                                 ")");
    }
    if (e == EPROTO) {
      // While joining: the other side's certificate check refused this
      // rank's (TLS 1.3 says so after the handshake), or the session broke.
      const std::string m = "TLS with rank " + std::to_string(peer) + In() + ": " + c.tls_error();
      return call_.op == 0 ? Status::PermissionDenied(m) : Status::Unavailable(m);
    }
    if (e != EAGAIN && e != EWOULDBLOCK) {
      return Status::Unavailable("connection to rank " + std::to_string(peer) + In() + ": " + Errno(e));
    }
    pollfd pf{c.fd(), wait, 0};
    const int ready = poll(&pf, 1, PollMs(d.at));
    if (ready < 0 && errno != EINTR) return Status::Internal("poll: " + Errno(errno));
    if (ready == 0 && Clock::now() >= d.at) return Timeout(peer, "waiting for", d);
  }
  return Status::OK();
}

Result<Frame> TcpCollective::RecvFrame(int peer, Deadline& d, bool* aborted) {
  uint8_t head[kFrameBytes];
  if (aborted != nullptr) *aborted = false;
  PENUMBRA_RETURN_IF_ERROR(Recv(peer, head, kFrameBytes, d));
  Frame f;
  if (!Decode(head, &f)) {
    return Status::Corruption("rank " + std::to_string(peer) + " sent bytes that are not a collective frame" + In());
  }
  if (f.op != kAbort) return f;
  std::string message(std::min<uint64_t>(f.bytes, kMaxAbortMessage), '\0');
  if (!Recv(peer, message.data(), message.size(), d).ok()) message = "(its message was cut off)";
  auto code = static_cast<StatusCode>(f.code);
  if (code == StatusCode::kOk || code > StatusCode::kPermissionDenied) code = StatusCode::kInternal;
  if (aborted != nullptr) *aborted = true;
  return Status(code, "from rank " + std::to_string(peer) + ": " + message);
}

Status TcpCollective::PeerFailure(int peer, int e) {
  // The peer may have sent its reason before closing; it is still readable.
  Conn& c = peers_[peer];
  pollfd p{c.fd(), POLLIN, 0};
  if (c.Buffered() || (poll(&p, 1, 0) == 1 && (p.revents & POLLIN))) {
    Deadline brief{Clock::now() + 200ms, 200ms};
    bool aborted = false;
    auto got = RecvFrame(peer, brief, &aborted);
    if (aborted) return got.status();
  }
  if (e == EPIPE || e == ECONNRESET) {
    return Status::Unavailable("rank " + std::to_string(peer) + " closed the connection" + In() + " (" + Errno(e) +
                               ")");
  }
  return Status::Unavailable("connection to rank " + std::to_string(peer) + In() + ": " + Errno(e));
}

Status TcpCollective::Timeout(int peer, const char* doing, const Deadline& d) const {
  if (d.idle.count() == 0) {
    return Status::DeadlineExceeded("the group was not complete within " + Seconds(timeout_ + grace_) + " (" + doing +
                                    " rank " + std::to_string(peer) + ")");
  }
  return Status::DeadlineExceeded("nothing moved for " + Seconds(d.idle) + " " + doing + " rank " +
                                  std::to_string(peer) + In() +
                                  " (a rank late, stopped, or not making the same calls)");
}

Status TcpCollective::Mismatch(int other, const Frame& theirs) const {
  const bool joining = theirs.op == kHello || theirs.op == kWelcome || theirs.op == kChallenge;
  return Status::FailedPrecondition("ranks are not in the same call (SPMD misuse): rank " + std::to_string(rank_) +
                                    " is in " + Describe(call_) + ", rank " + std::to_string(other) + " in " +
                                    (joining ? std::string(OpName(theirs.op)) : Describe(theirs)));
}

Status TcpCollective::Fail(const Status& s) {
  if (!broken_.ok()) return broken_;
  broken_ = s.WithContext("collective (rank " + std::to_string(rank_) + " of " + std::to_string(world_) + ")");
  const std::string message = s.message().substr(0, kMaxAbortMessage);
  const Frame abort{kAbort, static_cast<uint8_t>(s.code()), rank_, seq_, message.size()};
  for (int r = 0; r < world_; ++r) {
    if (!peers_[r] || send_cut_[r]) continue;
    // Best effort and brief: a peer that takes nothing for 100 ms is
    // stopped or gone, and finds out from the closed connection.
    Deadline brief{Clock::now() + 100ms, 100ms};
    (void)Send(r, abort, message.data(), message.size(), brief, /*watch=*/false);
  }
  std::lock_guard<std::mutex> lk(probe_mu_);
  for (auto& p : peers_) p.Reset();
  return broken_;
}

// ---------------------------------------------------------------- joining

void TcpCollective::SendAbortNow(Conn& c, const Status& s) {
  const std::string message = s.message().substr(0, kMaxAbortMessage);
  uint8_t head[kFrameBytes];
  Encode(Frame{kAbort, static_cast<uint8_t>(s.code()), 0, 0, message.size()}, head);
  iovec iov[2] = {{head, kFrameBytes}, {const_cast<char*>(message.data()), message.size()}};
  int e = 0;
  short wait = 0;
  (void)c.Send(iov, message.empty() ? 1 : 2, &e, &wait);
}

void TcpCollective::Refused(const std::string& who, const std::string& why) {
  ++refused_;
  last_refusal_ = who + ": " + why;
  if (refused_ <= 32 || refused_ % 100 == 0) {
    LOG(WARNING) << "collective: rank 0 refused a connection from " << who << " (" << refused_ << " so far): " << why;
  }
}

Status TcpCollective::CheckHello(const Pending& p) const {
  const Frame& f = p.hello;
  const uint8_t* nonce_r = p.in + kFrameBytes;
  const std::string proof(reinterpret_cast<const char*>(nonce_r + kNonceBytes), kProofBytes);
  const std::string said = "a peer says it is rank " + std::to_string(f.arg) + " of world " + std::to_string(f.seq);
  // The secret first: a peer that cannot prove it learns nothing of the group.
  if (!secret_.empty()) {
    if (!(f.code & kFlagSecret)) {
      return Status::PermissionDenied(
          "a peer holds no group secret, and this group has one (give every rank "
          "the same secret)");
    }
    const std::string want = Proof(secret_, kHelloLabel, f.arg, f.seq, p.nonce, nonce_r, p.binding);
    if (!ConstantTimeEquals(want, proof)) {
      return Status::PermissionDenied("a peer's proof of the group secret is wrong (another group's secret)");
    }
  }
  if (f.arg < 1 || f.arg >= world_) {
    return Status::InvalidArgument(said + ": rank " + std::to_string(f.arg) +
                                   " is out of range for rank 0's world of " + std::to_string(world_) +
                                   " (the ranks that connect are 1.." + std::to_string(world_ - 1) + ")");
  }
  if (f.seq != static_cast<uint64_t>(world_)) {
    return Status::InvalidArgument(said + ", but rank 0's world is " + std::to_string(world_) + " (world mismatch)");
  }
  if (peers_[f.arg]) {
    return Status::InvalidArgument(said + ", but rank " + std::to_string(f.arg) +
                                   " has joined already (duplicate rank)");
  }
  return Status::OK();
}

TcpCollective::Next TcpCollective::Step(Pending& p, std::string* why, int* rank) {
  for (;;) {
    int e = 0;
    short wait = POLLIN;
    switch (p.stage) {
      case Pending::Stage::kHandshake: {
        const int r = p.conn.Handshake(&e, &wait);
        if (r < 0 && e == EINTR) continue;
        if (r < 0 && e == EAGAIN) {
          p.wait = wait;
          return Next::kWait;
        }
        if (r != 1) {
          *why = "TLS handshake failed: " + (r == 0        ? std::string("the peer closed the connection")
                                             : e == EPROTO ? p.conn.tls_error()
                                                           : Errno(e));
          return Next::kDrop;
        }
        auto id = transport::CheckPeer(p.conn.ssl(), p.address, peer_roles_, nullptr, /*require=*/true);
        if (!id.ok()) {
          // One of the CA's certificates, of a role this plane refuses: a
          // process of ours, misconfigured, that had better hear why.
          *why = id.status().message();
          SendAbortNow(p.conn, id.status());
          return Next::kDrop;
        }
        p.who = id->ToString() + " at " + p.address;
        auto binding = SessionBinding(p.conn.ssl());
        if (!binding.ok()) {
          *why = binding.status().message();
          return Next::kDrop;
        }
        p.binding = std::move(*binding);
        p.stage = Pending::Stage::kChallenge;
        continue;
      }
      case Pending::Stage::kChallenge: {
        if (p.out.empty()) {
          const std::string nonce = RandomBytes(kNonceBytes);
          std::memcpy(p.nonce, nonce.data(), kNonceBytes);
          uint8_t head[kFrameBytes];
          Encode(Frame{kChallenge, static_cast<uint8_t>(secret_.empty() ? 0 : kFlagSecret), 0, 0, kNonceBytes}, head);
          p.out.assign(reinterpret_cast<const char*>(head), kFrameBytes);
          p.out += nonce;
        }
        while (p.out_done < p.out.size()) {
          iovec v{p.out.data() + p.out_done, p.out.size() - p.out_done};
          const ssize_t k = p.conn.Send(&v, 1, &e, &wait);
          if (k > 0) {
            p.out_done += static_cast<size_t>(k);
            continue;
          }
          if (k < 0 && e == EINTR) continue;
          if (k < 0 && (e == EAGAIN || e == EWOULDBLOCK)) {
            p.wait = wait;
            return Next::kWait;
          }
          *why = "the connection failed before its hello: " + (e == EPROTO ? p.conn.tls_error() : Errno(e));
          return Next::kDrop;
        }
        p.stage = Pending::Stage::kHello;
        continue;
      }
      case Pending::Stage::kHello: {
        // The frame first, checked, then its fixed-size body: nothing a peer
        // says sets how much is read.
        const size_t want = p.got < kFrameBytes ? kFrameBytes : kFrameBytes + kHelloBytes;
        const ssize_t k = p.conn.Recv(p.in + p.got, want - p.got, &e, &wait);
        if (k == 0) {
          *why = "it closed the connection without a hello";
          return Next::kDrop;
        }
        if (k < 0) {
          if (e == EINTR) continue;
          if (e == EAGAIN || e == EWOULDBLOCK) {
            p.wait = wait;
            return Next::kWait;
          }
          *why = "the connection failed before its hello: " + (e == EPROTO ? p.conn.tls_error() : Errno(e));
          return Next::kDrop;
        }
        p.got += static_cast<size_t>(k);
        if (p.got == kFrameBytes) {
          if (!Decode(p.in, &p.hello) || p.hello.op != kHello) {
            *why = "it sent bytes that are not a collective hello (another program, another version, or a scan)";
            return Next::kDrop;
          }
          if (p.hello.bytes != kHelloBytes) {
            *why = "it sent a hello of " + std::to_string(p.hello.bytes) + " bytes (a hello is " +
                   std::to_string(kHelloBytes) + ")";
            return Next::kDrop;
          }
        }
        if (p.got < kFrameBytes + kHelloBytes) continue;
        const Status bad = CheckHello(p);
        if (!bad.ok()) {
          // A peer that gives a wrong rank or world is most likely one of
          // ours, misconfigured: it hears why (the group does not fail).
          *why = bad.message();
          SendAbortNow(p.conn, bad);
          return Next::kDrop;
        }
        p.welcome = Proof(secret_, kWelcomeLabel, p.hello.arg, p.hello.seq, p.nonce, p.in + kFrameBytes, p.binding);
        *rank = p.hello.arg;
        return Next::kJoined;
      }
    }
  }
}

Status TcpCollective::Listen(std::unique_ptr<CollectiveListener> listener, Clock::time_point deadline) {
  std::vector<std::unique_ptr<Pending>> pending;
  std::vector<std::string> welcome(static_cast<size_t>(world_));
  int joined = 1;
  // Moves a connection on; false once it has joined or been dropped.
  auto advance = [&](Pending& p) {
    std::string why;
    int rank = -1;
    switch (Step(p, &why, &rank)) {
      case Next::kJoined:
        LOG(INFO) << "collective: rank " << rank << " joined from " << p.who;
        peers_[rank] = std::move(p.conn);
        welcome[rank] = std::move(p.welcome);
        ++joined;
        return false;
      case Next::kDrop:
        Refused(p.who.empty() ? p.address : p.who, why);
        return false;
      case Next::kWait:
        if (Clock::now() < p.deadline) return true;
        Refused(p.who.empty() ? p.address : p.who,
                "no hello within " + Seconds(hello_timeout_) +
                    (p.stage == Pending::Stage::kHandshake ? " (its TLS handshake did not finish)" : ""));
        return false;
    }
    return false;
  };
  while (joined < world_) {
    std::vector<pollfd> fds;
    fds.push_back({listener->fd(), POLLIN, 0});
    Clock::time_point wake = deadline;
    for (const auto& p : pending) {
      fds.push_back({p->conn.fd(), p->wait, 0});
      wake = std::min(wake, p->deadline);
    }
    const int ready = poll(fds.data(), fds.size(), PollMs(wake));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return Status::Internal("poll: " + Errno(errno));
    }
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int r = 1; r < world_; ++r) {
        if (!peers_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      std::string refused;
      if (refused_ > 0) {
        refused = "; it refused " + std::to_string(refused_) + " connection(s), the last from " + last_refusal_;
      }
      return Status::DeadlineExceeded("rank(s) " + missing + " did not join within " + Seconds(timeout_) +
                                      " (rank 0 listening on port " + std::to_string(listener->port()) + refused + ")");
    }
    std::vector<std::unique_ptr<Pending>> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = *pending[i];
      const bool go = fds[i + 1].revents != 0 ? advance(p) : Clock::now() < p.deadline || advance(p);
      if (go) still.push_back(std::move(pending[i]));
    }
    pending = std::move(still);
    if (!(fds[0].revents & POLLIN)) continue;
    for (;;) {
      sockaddr_storage from{};
      socklen_t len = sizeof from;
      Fd fd(accept4(listener->fd(), reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd) break;  // EAGAIN: none left (or a connection that died in the queue)
      auto p = std::make_unique<Pending>();
      AddressOf(from, &p->host, &p->address);
      size_t same_host = 0;
      for (const auto& q : pending) same_host += q->host == p->host;
      if (pending.size() >= max_pending_) {
        Refused(p->address, std::to_string(pending.size()) + " connections are pending already (max_pending)");
        continue;
      }
      if (same_host >= max_pending_per_host_) {
        Refused(p->address, std::to_string(same_host) + " connections from " + p->host +
                                " are pending already (max_pending_per_host)");
        continue;
      }
      if (const Status s = SetNoDelay(fd.get()); !s.ok()) {
        Refused(p->address, s.message());
        continue;
      }
      p->deadline = std::min(Clock::now() + hello_timeout_, deadline);
      if (ctx_) {
        auto c = Conn::Tls(std::move(fd), ctx_.get(), /*server=*/true);
        if (!c.ok()) return c.status();
        p->conn = std::move(*c);
        p->stage = Pending::Stage::kHandshake;
      } else {
        p->conn = Conn(std::move(fd));
        p->who = transport::PeerIdentity{false, "", "", p->address}.ToString();
      }
      if (advance(*p)) pending.push_back(std::move(p));
      if (joined == world_) break;
    }
  }
  listener.reset();  // the group is complete: nobody else may join
  if (!pending.empty()) {
    LOG(INFO) << "collective: rank 0 closed " << pending.size() << " connection(s) that had not joined";
  }
  pending.clear();
  for (int r = 1; r < world_; ++r) {
    Deadline d{deadline};
    PENUMBRA_RETURN_IF_ERROR(Send(r, Frame{kWelcome, 0, world_, 0, kProofBytes}, welcome[r].data(), kProofBytes, d));
  }
  return Status::OK();
}

Status TcpCollective::Introduce(Fd fd, const std::string& host, int port, Clock::time_point deadline, bool* retry) {
  *retry = false;
  const std::string where = "rank 0 at " + HostPort(host, port);
  std::string binding;
  if (ctx_) {
    PENUMBRA_ASSIGN_OR_RETURN(peers_[0], Conn::Tls(std::move(fd), ctx_.get(), /*server=*/false));
    Conn& c = peers_[0];
    for (;;) {
      int e = 0;
      short wait = POLLIN;
      const int r = c.Handshake(&e, &wait);
      if (r == 1) break;
      if (r < 0 && e == EINTR) continue;
      if (r < 0 && e == EAGAIN) {
        pollfd pf{c.fd(), wait, 0};
        if (poll(&pf, 1, PollMs(deadline)) == 0 && Clock::now() >= deadline) {
          return Status::DeadlineExceeded("the TLS handshake with " + where + " did not finish within " +
                                          Seconds(timeout_));
        }
        continue;
      }
      if (r < 0 && e == EPROTO) {
        return Status::PermissionDenied("the TLS handshake with " + where + " failed: " + c.tls_error());
      }
      // Closed during the handshake: rank 0 was busy, or refused it.
      *retry = true;
      return Status::Unavailable(where + " closed the connection during the TLS handshake" +
                                 (r < 0 ? " (" + Errno(e) + ")" : ""));
    }
    PENUMBRA_ASSIGN_OR_RETURN(const transport::PeerIdentity id,
                              transport::CheckPeer(c.ssl(), HostPort(host, port), peer_roles_,
                                                   verify_host_ ? &host : nullptr, /*require=*/true));
    PENUMBRA_ASSIGN_OR_RETURN(binding, SessionBinding(c.ssl()));
  } else {
    peers_[0] = Conn(std::move(fd));
  }
  Deadline d{deadline};
  bool aborted = false;
  auto challenge = RecvFrame(0, d, &aborted);
  if (!challenge.ok()) {
    // Closed before its challenge: rank 0 was busy, or dropped it (e.g. a
    // plaintext rank at a TLS rank 0). Silence until the deadline: the
    // same, as the caller reports it.
    const StatusCode code = challenge.status().code();
    *retry = !aborted && (code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded);
    if (code == StatusCode::kDeadlineExceeded && !aborted) {
      return Status::DeadlineExceeded(where + " sent no challenge (does one side use TLS and the other not?)");
    }
    return challenge.status();
  }
  if (challenge->op != kChallenge || challenge->bytes != kNonceBytes) {
    return Status::Corruption(where + " did not send a collective challenge (not a rendezvous of this version)");
  }
  uint8_t nonce0[kNonceBytes];
  PENUMBRA_RETURN_IF_ERROR(Recv(0, nonce0, kNonceBytes, d));
  const bool group_has_secret = (challenge->code & kFlagSecret) != 0;
  if (group_has_secret && secret_.empty()) {
    return Status::PermissionDenied(where + " requires a group secret, and this rank has none");
  }
  if (!group_has_secret && !secret_.empty()) {
    // Rank 0 could not prove it in its welcome: not the group this rank's
    // secret is for.
    return Status::PermissionDenied(where + " does not use a group secret, and this rank has one");
  }
  const std::string nonce_r = RandomBytes(kNonceBytes);
  const auto* nr = reinterpret_cast<const uint8_t*>(nonce_r.data());
  const std::string hello =
      nonce_r + Proof(secret_, kHelloLabel, rank_, static_cast<uint64_t>(world_), nonce0, nr, binding);
  d = Deadline{deadline + grace_};
  PENUMBRA_RETURN_IF_ERROR(Send(0,
                                Frame{kHello, static_cast<uint8_t>(secret_.empty() ? 0 : kFlagSecret), rank_,
                                      static_cast<uint64_t>(world_), kHelloBytes},
                                hello.data(), hello.size(), d));
  PENUMBRA_ASSIGN_OR_RETURN(const Frame f, RecvFrame(0, d));
  if (f.op != kWelcome || f.arg != world_ || f.bytes != kProofBytes) {
    return Status::Internal("rank 0 answered the hello with " + std::string(OpName(f.op)) + " (protocol error)");
  }
  std::string proof(kProofBytes, '\0');
  PENUMBRA_RETURN_IF_ERROR(Recv(0, proof.data(), proof.size(), d));
  const std::string want = Proof(secret_, kWelcomeLabel, rank_, static_cast<uint64_t>(world_), nonce0, nr, binding);
  if (!ConstantTimeEquals(proof, want)) {
    return Status::PermissionDenied(where + " did not prove the group secret in its welcome");
  }
  return Status::OK();
}

Status TcpCollective::Join(const std::string& host, int port, Clock::time_point deadline) {
  // Rank 0 may not listen yet, or may be busy: retry until the deadline.
  std::string last = "not tried";
  for (;;) {
    int gai = 0;
    AddrInfo addrs = Resolve(host, port, 0, &gai);
    if (!addrs && gai != EAI_AGAIN) {
      return Status::InvalidArgument("cannot resolve rendezvous host '" + host + "': " + gai_strerror(gai));
    }
    if (!addrs) last = gai_strerror(gai);
    Fd conn;
    for (addrinfo* a = addrs.get(); a != nullptr && !conn; a = a->ai_next) {
      Fd fd(socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!fd) {
        last = "socket: " + Errno(errno);
        continue;
      }
      if (connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) {
          last = Errno(errno);
          continue;
        }
        pollfd p{fd.get(), POLLOUT, 0};
        while (poll(&p, 1, PollMs(deadline)) < 0 && errno == EINTR) {
        }
        if (!(p.revents & (POLLOUT | POLLERR | POLLHUP))) {
          last = "connect timed out";
          continue;
        }
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        if (err != 0) {
          last = Errno(err);
          continue;
        }
      }
      if (ConnectedToSelf(fd.get())) {
        last = Errno(ECONNREFUSED);
        continue;
      }
      conn = std::move(fd);
    }
    if (conn) {
      PENUMBRA_RETURN_IF_ERROR(SetNoDelay(conn.get()));
      bool retry = false;
      const Status s = Introduce(std::move(conn), host, port, deadline, &retry);
      if (s.ok() || !retry) return s;
      last = s.message();
      peers_[0].Reset();
    }
    if (Clock::now() + 50ms >= deadline) {
      return Status::DeadlineExceeded("could not reach rank 0 at " + HostPort(host, port) + " within " +
                                      Seconds(timeout_) + " (last: " + last + ")");
    }
    std::this_thread::sleep_for(50ms);
  }
}

}  // namespace

Status ParseRendezvous(const std::string& text, std::string* host, int* port) {
  const auto bad = [&](const std::string& why) { return Status::InvalidArgument("rendezvous '" + text + "' " + why); };
  std::string h, p;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return bad("is not [host]:port");
    }
    h = text.substr(1, close - 1);
    p = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos) return bad("is not host:port");
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
    if (h.find(':') != std::string::npos) return bad("is not host:port (an IPv6 address goes in brackets)");
  }
  if (h.empty()) return bad("has no host");
  if (p.empty() || p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos || std::stoi(p) > 65535) {
    return bad("has no port in [0, 65535]");
  }
  *host = h;
  *port = std::stoi(p);
  return Status::OK();
}

Result<std::unique_ptr<CollectiveListener>> CollectiveListener::Bind(const std::string& host, int port) {
  if (port < 0 || port > 65535) return Status::InvalidArgument("collective: port " + std::to_string(port));
  const std::string h = host.empty() ? "0.0.0.0" : host;
  int gai = 0;
  AddrInfo addrs = Resolve(h, port, AI_PASSIVE, &gai);
  if (!addrs) return Status::InvalidArgument("collective: cannot resolve '" + h + "': " + gai_strerror(gai));
  std::string last = "no address";
  for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
    Fd fd(socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) {
      last = "socket: " + Errno(errno);
      continue;
    }
    int one = 1;
    (void)setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || listen(fd.get(), SOMAXCONN) != 0) {
      last = Errno(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      last = "getsockname: " + Errno(errno);
      continue;
    }
    const int p = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                              : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return std::unique_ptr<CollectiveListener>(new CollectiveListener(fd.Release(), p, h));
  }
  return Status::Unavailable("collective: cannot listen on " + HostPort(h, port) + ": " + last);
}

CollectiveListener::~CollectiveListener() {
  if (fd_ >= 0) close(fd_);
}

Result<std::unique_ptr<Collective>> ConnectTcpCollective(const CollectiveOptions& o,
                                                         std::unique_ptr<CollectiveListener> listener) {
  if (o.world < 1) return Status::InvalidArgument("collective: world " + std::to_string(o.world) + " (must be >= 1)");
  if (o.rank < 0 || o.rank >= o.world) {
    return Status::InvalidArgument("collective: rank " + std::to_string(o.rank) + " is out of range for world " +
                                   std::to_string(o.world));
  }
  if (!(o.timeout_s > 0) || !std::isfinite(o.timeout_s)) {
    return Status::InvalidArgument("collective: timeout_s must be > 0");
  }
  if (!(o.hello_timeout_s > 0) || !std::isfinite(o.hello_timeout_s)) {
    return Status::InvalidArgument("collective: hello_timeout_s must be > 0");
  }
  if (o.max_pending < 1 || o.max_pending_per_host < 1) {
    return Status::InvalidArgument("collective: max_pending and max_pending_per_host must be >= 1");
  }
  const CollectiveSecurity& sec = o.security;
  if (!sec.group_secret.empty() && sec.group_secret.size() < kMinGroupSecretBytes) {
    return Status::InvalidArgument("collective: a group secret of " + std::to_string(sec.group_secret.size()) +
                                   " bytes (at least " + std::to_string(kMinGroupSecretBytes) + ")");
  }
  if (listener && o.rank != 0) {
    return Status::InvalidArgument("collective: rank " + std::to_string(o.rank) +
                                   " was given a listener; only rank 0 listens");
  }
  const Clock::duration timeout = ToDuration(o.timeout_s);
  if (o.world == 1) return std::unique_ptr<Collective>(std::make_unique<TcpCollective>(o, timeout, nullptr));
  std::string host;
  int port = 0;
  if (o.rank != 0 || !listener) PENUMBRA_RETURN_IF_ERROR(ParseRendezvous(o.rendezvous, &host, &port));
  if (o.rank != 0 && port == 0) {
    return Status::InvalidArgument("rendezvous '" + o.rendezvous + "': port 0 is for rank 0's listener alone");
  }
  const bool tls = sec.tls.enabled();
  PENUMBRA_RETURN_IF_ERROR(transport::CheckPlaintextBind(
      o.rank == 0 ? "context-parallel rendezvous (rank 0)"
                  : "context-parallel rank " + std::to_string(o.rank) + "'s connection to rank 0",
      o.rank == 0 && listener ? listener->host() : host, tls, sec.insecure));
  SslCtx ctx;
  if (tls) {
    PENUMBRA_ASSIGN_OR_RETURN(ctx, MakeSslContext(sec.tls, /*server=*/o.rank == 0));
  }
  auto g = std::make_unique<TcpCollective>(o, timeout, std::move(ctx));
  const auto deadline = Clock::now() + timeout;
  Status s;
  if (o.rank == 0) {
    if (!listener) {
      PENUMBRA_ASSIGN_OR_RETURN(listener, CollectiveListener::Bind(host, port));
    }
    s = g->Listen(std::move(listener), deadline);
  } else {
    s = g->Join(host, port, deadline);
  }
  if (!s.ok()) return g->Fail(s);
  return std::unique_ptr<Collective>(std::move(g));
}

Result<std::unique_ptr<Collective>> ConnectCollective(Backend* backend, const CollectiveOptions& options,
                                                      std::unique_ptr<CollectiveListener> listener) {
  const bool cuda = backend != nullptr && backend->device() == Device::kCUDA;
  // Before joining: the other ranks then fail the same way, not on a peer
  // that joined and left.
  if (cuda && !NcclCollectiveCompiled()) {
    return Status::Unimplemented("collective: a CUDA backend's group needs NCCL, and this build has none");
  }
  PENUMBRA_ASSIGN_OR_RETURN(auto control, ConnectTcpCollective(options, std::move(listener)));
  if (!cuda) return control;
  return ConnectNcclCollective(backend, std::move(control), options.timeout_s);
}

}  // namespace penumbra
