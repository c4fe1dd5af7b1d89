#include "transport/collective.h"

#include <endian.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

namespace penumbra {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// ---------------------------------------------------------------- framing
//
// Every message starts with a frame: 28 bytes, big-endian, so that hosts
// need not agree on byte order. The magic doubles as the protocol version.
constexpr uint32_t kMagic = 0x50434f31;  // "PCO1"
constexpr size_t kFrameBytes = 28;
// An abort's message (text for a Status) longer than this is cut.
constexpr size_t kMaxAbortMessage = 4096;

enum Op : uint8_t {
  kHello = 1,    // rank > 0 -> rank 0 on connecting: arg = the sender's rank, bytes = its world
  kWelcome = 2,  // rank 0 -> every rank once all have joined: arg = world
  kAbort = 3,    // the sender gave up: code = its StatusCode, then `bytes` of message
  kAllGather = 4,
  kBroadcast = 5,
  kAllGatherHost = 6,
  kBroadcastHost = 7,
  kBarrier = 8,
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
    case kHello: return "Hello";
    case kWelcome: return "Welcome";
    case kAbort: return "Abort";
    case kAllGather: return "AllGather";
    case kBroadcast: return "Broadcast";
    case kAllGatherHost: return "AllGatherHost";
    case kBroadcastHost: return "BroadcastHost";
    case kBarrier: return "Barrier";
    default: return "an unknown op";
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

class TcpCollective final : public Collective {
 public:
  TcpCollective(int rank, int world, Clock::duration timeout)
      : rank_(rank), world_(world), timeout_(timeout), grace_(rank == 0 ? Clock::duration(0) : timeout / 2),
        peers_(static_cast<size_t>(world)),
        send_cut_(static_cast<size_t>(world), false) {}

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
  Status CheckHello(const Frame& f) const;

  const int rank_, world_;
  const Clock::duration timeout_;
  // Rank 0 is the one that finds which rank is late, stopped or gone, and
  // tells the others: they wait for its word this much longer than it
  // waits, so that they fail with its reason rather than their own timeout.
  const Clock::duration grace_;
  // Rank 0: a connection to each rank > 0; a rank > 0: peers_[0].
  std::vector<Fd> peers_;
  // A message to the peer was cut off midway: the stream is out of step,
  // so no abort can follow it (the peer would read it as payload).
  std::vector<bool> send_cut_;
  uint64_t seq_ = 0;
  Frame call_;  // the call in progress (op 0 while joining)
  Status broken_;
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
// it are served, so timeout_s must cover one rank's transfer.
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
  const int fd = peers_[peer].get();
  uint8_t head[kFrameBytes];
  Encode(f, head);
  // The frame and its payload in one sendmsg: small messages are one segment.
  iovec iov[2] = {{head, kFrameBytes}, {const_cast<void*>(payload), n}};
  iovec* first = iov;
  size_t count = n > 0 ? 2 : 1;
  bool started = false;
  while (count > 0) {
    msghdr m{};
    m.msg_iov = first;
    m.msg_iovlen = count;
    const ssize_t k = sendmsg(fd, &m, MSG_NOSIGNAL);
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
    const int e = k < 0 ? errno : EAGAIN;
    if (e == EINTR) continue;
    if (e != EAGAIN && e != EWOULDBLOCK) {
      if (started) send_cut_[peer] = true;
      return PeerFailure(peer, e);
    }
    pollfd p{fd, static_cast<short>(POLLOUT | (watch ? POLLIN : 0)), 0};
    const int ready = poll(&p, 1, PollMs(d.at));
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
    // POLLERR / POLLHUP: the next sendmsg says what.
  }
  return Status::OK();
}

Status TcpCollective::Recv(int peer, void* data, size_t n, Deadline& d) {
  const int fd = peers_[peer].get();
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      d.Progress();
      continue;
    }
    if (k == 0) return Status::Unavailable("rank " + std::to_string(peer) + " closed the connection" + In());
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) {
      return Status::Unavailable("rank " + std::to_string(peer) + " closed the connection" + In() + " (" +
                                 Errno(errno) + ")");
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return Status::Unavailable("connection to rank " + std::to_string(peer) + In() + ": " + Errno(errno));
    }
    pollfd pf{fd, POLLIN, 0};
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
  pollfd p{peers_[peer].get(), POLLIN, 0};
  if (poll(&p, 1, 0) == 1 && (p.revents & POLLIN)) {
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
    return Status::DeadlineExceeded("the group was not complete within " + Seconds(timeout_ + grace_) + " (" +
                                    doing + " rank " + std::to_string(peer) + ")");
  }
  return Status::DeadlineExceeded("nothing moved for " + Seconds(d.idle) + " " + doing + " rank " +
                                  std::to_string(peer) + In() +
                                  " (a rank late, stopped, or not making the same calls)");
}

Status TcpCollective::Mismatch(int other, const Frame& theirs) const {
  return Status::FailedPrecondition("ranks are not in the same call (SPMD misuse): rank " + std::to_string(rank_) +
                                    " is in " + Describe(call_) + ", rank " + std::to_string(other) + " in " +
                                    (theirs.op == kHello || theirs.op == kWelcome ? std::string(OpName(theirs.op))
                                                                                   : Describe(theirs)));
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
  for (auto& p : peers_) p.Reset();
  return broken_;
}

Status TcpCollective::CheckHello(const Frame& f) const {
  const std::string said = "a peer says it is rank " + std::to_string(f.arg) + " of world " + std::to_string(f.bytes);
  if (f.arg < 1 || f.arg >= world_) {
    return Status::InvalidArgument(said + ": rank " + std::to_string(f.arg) +
                                   " is out of range for rank 0's world of " + std::to_string(world_) +
                                   " (the ranks that connect are 1.." + std::to_string(world_ - 1) + ")");
  }
  if (f.bytes != static_cast<uint64_t>(world_)) {
    return Status::InvalidArgument(said + ", but rank 0's world is " + std::to_string(world_) + " (world mismatch)");
  }
  if (peers_[f.arg]) {
    return Status::InvalidArgument(said + ", but rank " + std::to_string(f.arg) +
                                   " has joined already (duplicate rank)");
  }
  return Status::OK();
}

Status TcpCollective::Listen(std::unique_ptr<CollectiveListener> listener, Clock::time_point deadline) {
  // Connections not yet identified, each reading its hello.
  struct Pending {
    Fd fd;
    uint8_t head[kFrameBytes];
    size_t got = 0;
  };
  std::vector<Pending> pending;
  int joined = 1;
  while (joined < world_) {
    std::vector<pollfd> fds;
    fds.push_back({listener->fd(), POLLIN, 0});
    for (const auto& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
    const int ready = poll(fds.data(), fds.size(), PollMs(deadline));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return Status::Internal("poll: " + Errno(errno));
    }
    if (ready == 0 && Clock::now() >= deadline) {
      std::string missing;
      for (int r = 1; r < world_; ++r) {
        if (!peers_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      return Status::DeadlineExceeded("rank(s) " + missing + " did not join within " + Seconds(timeout_) +
                                      " (rank 0 listening on port " + std::to_string(listener->port()) + ")");
    }
    std::vector<Pending> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (fds[i + 1].revents == 0) {
        still.push_back(std::move(p));
        continue;
      }
      const ssize_t k = recv(p.fd.get(), p.head + p.got, kFrameBytes - p.got, 0);
      if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
        still.push_back(std::move(p));
        continue;
      }
      if (k <= 0) continue;  // closed before saying hello: not a rank
      p.got += static_cast<size_t>(k);
      if (p.got < kFrameBytes) {
        still.push_back(std::move(p));
        continue;
      }
      Frame f;
      if (!Decode(p.head, &f) || f.op != kHello) {
        // Not a rank of this protocol (a port scan, a stale process of
        // another version): no reason to fail the group.
        LOG(WARNING) << "collective: rank 0 dropped a connection that did not say hello";
        continue;
      }
      const Status bad = CheckHello(f);
      if (!bad.ok()) {
        // That peer hears why before the ranks that joined do (Fail).
        const std::string message = bad.message();
        const Frame abort{kAbort, static_cast<uint8_t>(bad.code()), 0, 0, message.size()};
        uint8_t head[kFrameBytes];
        Encode(abort, head);
        std::string out(reinterpret_cast<const char*>(head), kFrameBytes);
        out += message;
        (void)send(p.fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        return bad;
      }
      peers_[f.arg] = std::move(p.fd);
      ++joined;
    }
    pending = std::move(still);
    if (fds[0].revents & POLLIN) {
      for (;;) {
        Fd fd(accept4(listener->fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) break;  // EAGAIN: none left (or a connection that died in the queue)
        PENUMBRA_RETURN_IF_ERROR(SetNoDelay(fd.get()));
        pending.push_back(Pending{std::move(fd), {}, 0});
      }
    }
  }
  listener.reset();  // the group is complete: nobody else may join
  for (int r = 1; r < world_; ++r) {
    Deadline d{deadline};
    PENUMBRA_RETURN_IF_ERROR(Send(r, Frame{kWelcome, 0, world_, 0, 0}, nullptr, 0, d));
  }
  return Status::OK();
}

Status TcpCollective::Join(const std::string& host, int port, Clock::time_point deadline) {
  // Rank 0 may not listen yet: retry until the deadline.
  std::string last = "not tried";
  Fd conn;
  for (;;) {
    int gai = 0;
    AddrInfo addrs = Resolve(host, port, 0, &gai);
    if (!addrs && gai != EAI_AGAIN) {
      return Status::InvalidArgument("cannot resolve rendezvous host '" + host + "': " + gai_strerror(gai));
    }
    if (!addrs) last = gai_strerror(gai);
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
    if (conn) break;
    if (Clock::now() + 50ms >= deadline) {
      return Status::DeadlineExceeded("could not reach rank 0 at " + HostPort(host, port) + " within " +
                                      Seconds(timeout_) + " (last: " + last + ")");
    }
    std::this_thread::sleep_for(50ms);
  }
  PENUMBRA_RETURN_IF_ERROR(SetNoDelay(conn.get()));
  peers_[0] = std::move(conn);
  Deadline d{deadline + grace_};
  PENUMBRA_RETURN_IF_ERROR(Send(0, Frame{kHello, 0, rank_, 0, static_cast<uint64_t>(world_)}, nullptr, 0, d));
  PENUMBRA_ASSIGN_OR_RETURN(const Frame f, RecvFrame(0, d));
  if (f.op != kWelcome || f.arg != world_) {
    return Status::Internal("rank 0 answered the hello with " + std::string(OpName(f.op)) + " (protocol error)");
  }
  return Status::OK();
}

}  // namespace

Status ParseRendezvous(const std::string& text, std::string* host, int* port) {
  const auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("rendezvous '" + text + "' " + why);
  };
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
    return std::unique_ptr<CollectiveListener>(new CollectiveListener(fd.Release(), p));
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
  if (listener && o.rank != 0) {
    return Status::InvalidArgument("collective: rank " + std::to_string(o.rank) +
                                   " was given a listener; only rank 0 listens");
  }
  const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.timeout_s));
  auto g = std::make_unique<TcpCollective>(o.rank, o.world, timeout);
  if (o.world == 1) return std::unique_ptr<Collective>(std::move(g));
  const auto deadline = Clock::now() + timeout;
  std::string host;
  int port = 0;
  if (o.rank != 0 || !listener) PENUMBRA_RETURN_IF_ERROR(ParseRendezvous(o.rendezvous, &host, &port));
  Status s;
  if (o.rank == 0) {
    if (!listener) {
      PENUMBRA_ASSIGN_OR_RETURN(listener, CollectiveListener::Bind(host, port));
    }
    s = g->Listen(std::move(listener), deadline);
  } else if (port == 0) {
    s = Status::InvalidArgument("rendezvous '" + o.rendezvous + "': port 0 is for rank 0's listener alone");
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
