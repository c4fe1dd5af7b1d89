// ThriftServer's bounds and identities (transport/thrift_util.h), with a real
// server and real sockets in this process: the caller's certificate reaches
// the handler, a connection that sends no complete request within the
// handshake deadline is closed even when it trickles bytes (one whose first
// request is in but takes longer to serve is answered), large frames
// share one budget, connections are capped in total and per address, and
// Stop() does not wait for idle clients.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "common/crypto.h"
#include "gen-cpp/Worker.h"
#include "transport/certs.h"
#include "transport/thrift_util.h"

namespace penumbra::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Answers Health with the caller's identity.
class EchoPeer : public rpc::WorkerNull {
 public:
  void Health(rpc::WorkerHealth& out) override {
    out.serving = true;
    out.model = CurrentPeer().ToString();
  }
};

std::shared_ptr<apache::thrift::TProcessor> Processor() {
  return std::make_shared<rpc::WorkerProcessor>(std::make_shared<EchoPeer>());
}

int Connect(int port, const std::string& source = "127.0.0.1") {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in src{}, dst{};
  src.sin_family = dst.sin_family = AF_INET;
  inet_pton(AF_INET, source.c_str(), &src.sin_addr);
  inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  dst.sin_port = htons(static_cast<uint16_t>(port));
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

// How many of `fds` the server has closed (a read sees the end) by `wait`.
// Thrift's listening socket defers accepting a connection that has sent
// nothing (TCP_DEFER_ACCEPT) for a second or more: waits allow for it.
int CountClosed(const std::vector<int>& fds, std::chrono::milliseconds wait) {
  std::vector<bool> closed(fds.size(), false);
  int n = 0;
  for (const auto until = Clock::now() + wait; Clock::now() < until;) {
    for (size_t i = 0; i < fds.size(); ++i) {
      pollfd p{fds[i], POLLIN, 0};
      char c;
      if (!closed[i] && ::poll(&p, 1, 0) == 1 && ::recv(fds[i], &c, 1, MSG_DONTWAIT) <= 0) {
        closed[i] = true;
        ++n;
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  return n;
}

// Whether the server closes `fd` within `wait` (a read sees the end).
bool ClosedWithin(int fd, std::chrono::milliseconds wait) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) != 1) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
}

Status HealthOf(int port, std::string* model, std::shared_ptr<const TlsClientContext> tls = nullptr) {
  PENUMBRA_ASSIGN_OR_RETURN(auto c, ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", port, 5s, {}, tls));
  rpc::WorkerHealth h;
  PENUMBRA_RETURN_IF_ERROR(CallRpc("health", [&] { (*c)->Health(h); }));
  if (model) *model = h.model;
  return Status::OK();
}

class Certificates : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/penumbra-thrift-XXXXXX";
    dir_ = mkdtemp(tmpl);
    ASSERT_TRUE(CreateCertificateAuthority(dir_ + "/ca.pem", dir_ + "/ca.key", "test").ok());
    for (auto [role, name] : std::vector<std::pair<const char*, const char*>>{
             {role::kWorker, "w0"}, {role::kCoordinator, "coordinator"}, {role::kClient, "someone"}}) {
      CertificateSpec s;
      s.role = role;
      s.name = name;
      s.hosts = {"127.0.0.1"};
      ASSERT_TRUE(IssueCertificate(dir_ + "/ca.pem", dir_ + "/ca.key", s, dir_ + "/" + name + ".pem",
                                   dir_ + "/" + name + ".key")
                      .ok());
    }
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TlsFiles Files(const std::string& name) const {
    return {dir_ + "/ca.pem", dir_ + "/" + name + ".pem", dir_ + "/" + name + ".key"};
  }
  std::string dir_;
};

TEST_F(Certificates, TheHandlerSeesTheCallersVerifiedCertificate) {
  ThriftServerOptions o;
  TlsServerOptions t;
  t.files = Files("w0");
  t.require_client_certificate = true;
  t.client_roles = {role::kCoordinator};
  o.tls = t;
  auto server = ThriftServer::Start(Processor(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*server)->tls());
  TlsClientOptions c;
  c.files = Files("coordinator");
  c.server_roles = {role::kWorker};
  auto tls = TlsClientContext::Create(c);
  ASSERT_TRUE(tls.ok()) << tls.status();
  std::string model;
  ASSERT_TRUE(HealthOf((*server)->port(), &model, *tls).ok());
  EXPECT_EQ(model, "coordinator/coordinator");
  // Another role is refused in the handshake.
  c.files = Files("someone");
  auto other = TlsClientContext::Create(c);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(HealthOf((*server)->port(), nullptr, *other).ok());
  // A client expecting another role of the server refuses it.
  c.files = Files("coordinator");
  c.server_roles = {role::kStore};
  auto wrong_role = TlsClientContext::Create(c);
  ASSERT_TRUE(wrong_role.ok());
  EXPECT_EQ(HealthOf((*server)->port(), nullptr, *wrong_role).code(), StatusCode::kPermissionDenied);
}

TEST_F(Certificates, ACaBundleTrustsTheOldAndTheNewCaWhileRotating) {
  const std::string next = dir_ + "/next";
  std::filesystem::create_directories(next);
  ASSERT_TRUE(CreateCertificateAuthority(next + "/ca.pem", next + "/ca.key", "next").ok());
  CertificateSpec s;
  s.role = role::kCoordinator;
  s.name = "coordinator";
  ASSERT_TRUE(
      IssueCertificate(next + "/ca.pem", next + "/ca.key", s, next + "/coordinator.pem", next + "/coordinator.key")
          .ok());
  {
    std::ofstream bundle(dir_ + "/bundle.pem");
    bundle << std::ifstream(dir_ + "/ca.pem").rdbuf() << std::ifstream(next + "/ca.pem").rdbuf();
  }
  ThriftServerOptions o;
  TlsServerOptions t;
  t.files = {dir_ + "/bundle.pem", dir_ + "/w0.pem", dir_ + "/w0.key"};
  t.require_client_certificate = true;
  o.tls = t;
  auto server = ThriftServer::Start(Processor(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  for (const TlsFiles& client :
       {TlsFiles{dir_ + "/ca.pem", dir_ + "/coordinator.pem", dir_ + "/coordinator.key"},
        TlsFiles{dir_ + "/bundle.pem", next + "/coordinator.pem", next + "/coordinator.key"}}) {
    TlsClientOptions c;
    c.files = client;
    auto tls = TlsClientContext::Create(c);
    ASSERT_TRUE(tls.ok()) << tls.status();
    std::string model;
    EXPECT_TRUE(HealthOf((*server)->port(), &model, *tls).ok()) << client.cert_file;
  }
  // A certificate of neither CA is refused at load.
  TlsFiles stranger{next + "/ca.pem", dir_ + "/w0.pem", dir_ + "/w0.key"};
  EXPECT_EQ(stranger.Validate("test").code(), StatusCode::kInvalidArgument);
}

TEST(ThriftServer, WithoutTlsTheCallerIsOnlyAnAddress) {
  auto server = ThriftServer::Start(Processor(), {});
  ASSERT_TRUE(server.ok()) << server.status();
  std::string model;
  ASSERT_TRUE(HealthOf((*server)->port(), &model).ok());
  EXPECT_EQ(model.rfind("unverified@127.0.0.1:", 0), 0u) << model;
}

TEST(ThriftServer, AConnectionWithoutACompleteRequestIsClosedAtTheHandshakeDeadline) {
  ThriftServerOptions o;
  o.limits.handshake_timeout = 400ms;
  auto server = ThriftServer::Start(Processor(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  const int silent = Connect((*server)->port());
  const int trickle = Connect((*server)->port());
  ASSERT_GE(silent, 0);
  ASSERT_GE(trickle, 0);
  const auto t0 = Clock::now();
  // One byte of a frame header every 150 ms: each read is on time, the
  // request never is.
  std::thread sender([&] {
    const char header[4] = {0, 0, 0, 100};
    for (int i = 0; i < 4; ++i) {
      std::this_thread::sleep_for(150ms);
      if (::send(trickle, header + i, 1, MSG_NOSIGNAL) != 1) return;
    }
  });
  EXPECT_TRUE(ClosedWithin(trickle, 3000ms));
  EXPECT_LT(Clock::now() - t0, 1500ms);       // the deadline, not the bytes' pace, ended it
  EXPECT_TRUE(ClosedWithin(silent, 6000ms));  // accepted late (TCP_DEFER_ACCEPT), then its deadline
  sender.join();
  ::close(silent);
  ::close(trickle);
  // A prompt client is served, and keeps its connection between requests.
  auto c = ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", (*server)->port(), 5s);
  ASSERT_TRUE(c.ok());
  rpc::WorkerHealth h;
  EXPECT_TRUE(CallRpc("health", [&] { (**c)->Health(h); }).ok());
  std::this_thread::sleep_for(800ms);  // past the handshake deadline: now only the idle timeout applies
  EXPECT_TRUE(CallRpc("health", [&] { (**c)->Health(h); }).ok());
}

// Answers Health after `delay` (a handler that takes long: a put that
// factors a document, a blocking Complete).
class SlowHealth : public rpc::WorkerNull {
 public:
  explicit SlowHealth(std::chrono::milliseconds delay) : delay_(delay) {}
  void Health(rpc::WorkerHealth& out) override {
    std::this_thread::sleep_for(delay_);
    out.serving = true;
  }

 private:
  std::chrono::milliseconds delay_;
};

TEST(ThriftServer, AFirstRequestServedPastTheHandshakeDeadlineIsAnswered) {
  // The deadline bounds reading the first request, not serving it: a fresh
  // connection whose first call takes longer than the deadline gets its reply.
  ThriftServerOptions o;
  o.limits.handshake_timeout = 300ms;
  auto server = ThriftServer::Start(std::make_shared<rpc::WorkerProcessor>(std::make_shared<SlowHealth>(1200ms)), o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", (*server)->port(), 5s);
  ASSERT_TRUE(c.ok()) << c.status();
  rpc::WorkerHealth h;
  const Status first = CallRpc("health", [&] { (**c)->Health(h); });
  EXPECT_TRUE(first.ok()) << first;
  EXPECT_TRUE(h.serving);
}

TEST(ThriftServer, LargeFramesShareOneBudget) {
  ThriftServerOptions o;
  o.limits.max_frame_bytes = 1 << 20;
  o.limits.max_string_bytes = 1 << 20;
  o.limits.max_buffered_frame_bytes = 2 << 20;
  auto server = ThriftServer::Start(Processor(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  // Two connections announce 1 MiB frames and stall: the budget is spent.
  std::vector<int> stalled;
  auto announce = [&](uint32_t bytes) {
    const int fd = Connect((*server)->port());
    const uint32_t be = htonl(bytes);
    EXPECT_EQ(::send(fd, &be, 4, MSG_NOSIGNAL), 4);
    const char part[16] = {};
    EXPECT_EQ(::send(fd, part, sizeof part, MSG_NOSIGNAL), 16);
    return fd;
  };
  stalled.push_back(announce(1 << 20));
  stalled.push_back(announce(1 << 20));
  std::this_thread::sleep_for(200ms);  // the server reads both announcements (not observable from here)
  EXPECT_FALSE(ClosedWithin(stalled[0], 100ms));
  // A third large frame is refused (its connection closed)...
  const int third = announce(1 << 20);
  EXPECT_TRUE(ClosedWithin(third, 2000ms));
  EXPECT_EQ((*server)->stats().refused_frame_budget, 1);
  // ...while small requests go on.
  EXPECT_TRUE(HealthOf((*server)->port(), nullptr).ok());
  // A frame over the limit closes its connection at once.
  const int oversized = announce((1 << 20) + 1);
  EXPECT_TRUE(ClosedWithin(oversized, 2000ms));
  for (int fd : stalled) ::close(fd);
  ::close(third);
  ::close(oversized);
  // The budget comes back when they go.
  const auto until = Clock::now() + 3s;
  int again = -1;
  while (Clock::now() < until) {
    again = announce(1 << 20);
    if (!ClosedWithin(again, 200ms)) break;
    ::close(again);
    again = -1;
  }
  EXPECT_GE(again, 0) << "the budget of closed connections was not given back";
  if (again >= 0) ::close(again);
}

TEST(ThriftServer, ConnectionsAreCappedInTotalAndPerAddress) {
  ThriftServerOptions o;
  o.limits.max_connections = 20;
  o.limits.max_connections_per_peer = 8;
  auto server = ThriftServer::Start(Processor(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> a, b;
  for (int i = 0; i < 10; ++i) a.push_back(Connect((*server)->port(), "127.0.0.2"));
  EXPECT_EQ(CountClosed(a, 5000ms), 2);  // 8 per address
  for (int i = 0; i < 8; ++i) b.push_back(Connect((*server)->port(), "127.0.0.3"));
  for (int i = 0; i < 8; ++i) b.push_back(Connect((*server)->port(), "127.0.0.4"));
  EXPECT_EQ(CountClosed(b, 5000ms), 4);  // 8 + 16 > 20 in all
  EXPECT_GE((*server)->stats().refused_over_limit, 6);
  for (int fd : a) ::close(fd);
  // Room again: another address is served.
  const auto until = Clock::now() + 3s;
  Status s = Status::Internal("not tried");
  while (Clock::now() < until && !(s = HealthOf((*server)->port(), nullptr)).ok()) std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(s.ok()) << s;
  for (int fd : b) ::close(fd);
}

// Answers Health with 600 KB.
class BigHealth : public rpc::WorkerNull {
 public:
  void Health(rpc::WorkerHealth& out) override { out.model.assign(600 << 10, 'x'); }
};

TEST(ThriftServer, AConnectionOutlivesRepliesTotallingMoreThanAFrame) {
  ThriftServerOptions o;
  o.limits.max_frame_bytes = 1 << 20;
  o.limits.max_string_bytes = 1 << 20;
  auto server = ThriftServer::Start(std::make_shared<rpc::WorkerProcessor>(std::make_shared<BigHealth>()), o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", (*server)->port(), 5s, o.limits);
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 5; ++i) {  // 3 MB of replies on one connection with 1 MiB frames
    rpc::WorkerHealth h;
    ASSERT_TRUE(CallRpc("health", [&] { (**c)->Health(h); }).ok()) << "reply " << i;
    EXPECT_EQ(h.model.size(), size_t{600} << 10);
  }
}

TEST(ThriftServer, StopDoesNotWaitForIdleClients) {
  auto server = ThriftServer::Start(Processor(), {});
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", (*server)->port(), 5s);
  ASSERT_TRUE(c.ok());
  rpc::WorkerHealth h;
  ASSERT_TRUE(CallRpc("health", [&] { (**c)->Health(h); }).ok());
  const int idle = Connect((*server)->port());
  const auto t0 = Clock::now();
  (*server)->Stop();
  EXPECT_LT(Clock::now() - t0, 2000ms);
  ::close(idle);
}

}  // namespace
}  // namespace penumbra::transport
