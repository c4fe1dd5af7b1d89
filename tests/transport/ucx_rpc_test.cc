// The UCX request/reply plane on loopback: round trips small and large
// (rendezvous) payloads, plain and sealed (a cluster secret), many calls in
// flight from many threads, handler errors carried back as they are,
// deadlines, a server that stops, and a server process killed with SIGKILL
// mid-call (the caller gets Unavailable, never a hang, and reaches a new
// server after). Its security: a client without the secret or with a wrong
// one is refused; forged, tampered, replayed and unauthenticated frames
// (sent by hand, tests/transport/raw_ucx_peer.h) close their connection
// while honest clients go on; an oversized body is refused before it is
// received; a handshake not finished in time is closed; connections beyond
// the cap are rejected; the UCX devices follow the bound address.
#include "transport/ucx_rpc.h"

#include <gtest/gtest.h>

#include <ifaddrs.h>
#include <net/if.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "tests/crash_child.h"
#include "tests/test_util.h"
#include "tests/transport/raw_ucx_peer.h"

namespace penumbra::transport {
namespace {

using namespace std::chrono_literals;
using testing::Eventually;

// method 1: echo; 2: the payload reversed; 3: fails with NotFound; 4: sleeps
// the payload's milliseconds, then echoes; 5: `n` (the payload, decimal)
// bytes of a pattern; 6: the caller as the server sees it; 7: "MS:N", method
// 5's N bytes after MS milliseconds.
Result<std::string> Handle(const UcxCaller& caller, uint32_t method, std::string payload) {
  switch (method) {
    case 1:
      return payload;
    case 2:
      return std::string(payload.rbegin(), payload.rend());
    case 3:
      return Status::NotFound("no such thing: " + payload);
    case 4:
      std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(payload)));
      return payload;
    case 5: {
      std::string out(std::stoul(payload), '\0');
      for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 131 + 7);
      return out;
    }
    case 6:
      return caller.client_id + (caller.authenticated ? " authenticated" : " plain");
    case 7: {  // "MS:N": sleeps MS milliseconds, then N bytes of method 5's pattern
      const size_t colon = payload.find(':');
      std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(payload.substr(0, colon))));
      std::string out(std::stoul(payload.substr(colon + 1)), '\0');
      for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 131 + 7);
      return out;
    }
    default:
      return Status::InvalidArgument("method " + std::to_string(method));
  }
}

ClusterSecret Secret(char fill) { return ClusterSecret::FromBytes(std::string(32, fill)); }

UcxServerOptions Threads(int n) {
  UcxServerOptions o;
  o.threads = n;
  return o;
}

std::string Pattern(size_t n, int salt) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 31 + salt);
  return s;
}

TEST(UcxRpcTest, RoundTripsSmallAndLargePayloads) {
  auto server = UcxServer::Start("127.0.0.1", 0, Handle);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  auto client = UcxClient::Connect("127.0.0.1", (*server)->port());
  ASSERT_TRUE(client.ok()) << client.status();
  for (size_t n : {size_t{0}, size_t{1}, size_t{100}, size_t{16384}, size_t{1} << 20, size_t{9} << 20}) {
    const std::string p = Pattern(n, static_cast<int>(n));
    auto echo = (*client)->Call(1, p, 20s);
    ASSERT_TRUE(echo.ok()) << n << ": " << echo.status();
    EXPECT_EQ(*echo, p) << n;
    auto rev = (*client)->Call(2, p, 20s);
    ASSERT_TRUE(rev.ok()) << rev.status();
    EXPECT_EQ(*rev, std::string(p.rbegin(), p.rend()));
  }
  auto big = (*client)->Call(5, std::to_string(6 << 20), 20s);
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_EQ(big->size(), size_t{6} << 20);
  EXPECT_EQ((*big)[12345], static_cast<char>(12345 * 131 + 7));
}

TEST(UcxRpcTest, ManyCallsInFlightFromManyThreads) {
  for (bool sealed : {false, true}) {
    SCOPED_TRACE(sealed ? "sealed" : "plain");
    UcxServerOptions so = Threads(4);
    UcxClientOptions co;
    if (sealed) so.secret = co.secret = Secret('a');
    auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = UcxClient::Connect("127.0.0.1", (*server)->port(), co);
    ASSERT_TRUE(client.ok());
    std::atomic<int> wrong{0}, failed{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < 100; ++i) {
          const std::string p = Pattern(static_cast<size_t>(1 + (i * 997 + t) % 70000), t * 1000 + i);
          auto r = (*client)->Call(1, p, 20s);
          if (!r.ok()) {
            ++failed;
          } else if (*r != p) {
            ++wrong;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(failed.load(), 0);
    EXPECT_EQ(wrong.load(), 0);
    EXPECT_EQ((*server)->stats().requests, 800);
    EXPECT_EQ((*server)->stats().frames_rejected, 0);
  }
}

TEST(UcxRpcTest, ErrorsDeadlinesAndAStoppedServer) {
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, Threads(2));
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  auto client = UcxClient::Connect("127.0.0.1", port);
  ASSERT_TRUE(client.ok());
  auto nf = (*client)->Call(3, "x", 10s);
  EXPECT_EQ(nf.status().code(), StatusCode::kNotFound);
  EXPECT_NE(nf.status().message().find("no such thing: x"), std::string::npos) << nf.status();
  EXPECT_EQ((*client)->Call(99, "", 10s).status().code(), StatusCode::kInvalidArgument);
  // The handler takes 1.5 s; the caller waits 200 ms.
  const auto t0 = std::chrono::steady_clock::now();
  auto slow = (*client)->Call(4, "1500", 200ms);
  EXPECT_EQ(slow.status().code(), StatusCode::kDeadlineExceeded) << slow.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  // The late reply is dropped; the next call gets its own answer.
  auto next = (*client)->Call(1, "after", 10s);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*next, "after");
  (*server)->Stop();
  const auto t1 = std::chrono::steady_clock::now();
  auto gone = (*client)->Call(1, "anyone?", 10s);
  EXPECT_FALSE(gone.ok());
  EXPECT_TRUE(gone.status().code() == StatusCode::kUnavailable || gone.status().code() == StatusCode::kDeadlineExceeded)
      << gone.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 11s);
  // Bad addresses are refused at once.
  EXPECT_EQ(UcxClient::Connect("127.0.0.1", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(UcxClient::Connect("no-such-host.invalid", 1234).status().code(), StatusCode::kInvalidArgument);
}

// The child's part: a server whose port goes to the parent on the pipe; it
// serves until killed.
TEST(UcxRpcTest, ChildServer) {
  const char* fd = std::getenv("PENUMBRA_UCX_CHILD_FD");
  if (fd == nullptr) GTEST_SKIP() << "the child of AServerKilledMidCallFailsItsCallers";
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, Threads(2));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string port = std::to_string((*server)->port()) + "\n";
  ASSERT_EQ(write(std::atoi(fd), port.data(), port.size()), static_cast<ssize_t>(port.size()));
  for (;;) std::this_thread::sleep_for(1s);
}

int ReadPort(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line += c;
  return line.empty() ? -1 : std::stoi(line);
}

TEST(UcxRpcTest, AServerKilledMidCallFailsItsCallers) {
  int rfd = -1;
  pid_t pid = testing::SpawnCrashChild("UcxRpcTest.ChildServer", {}, "PENUMBRA_UCX_CHILD_FD", &rfd);
  ASSERT_GT(pid, 0);
  const int port = ReadPort(rfd);
  close(rfd);
  ASSERT_GT(port, 0);
  auto client = UcxClient::Connect("127.0.0.1", port);
  ASSERT_TRUE(client.ok());
  auto warm = (*client)->Call(1, "hello", 10s);
  ASSERT_TRUE(warm.ok()) << warm.status();
  // Calls in flight (the handler sleeps 3 s) when the server dies.
  std::vector<std::thread> callers;
  std::vector<Status> got(4);
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] { got[i] = (*client)->Call(4, "3000", 30s).status(); });
  }
  // The calls reach the server (in another process: not observable here)
  // before it is killed.
  std::this_thread::sleep_for(300ms);
  const auto t0 = std::chrono::steady_clock::now();
  testing::KillCrashChild(pid);
  for (auto& t : callers) t.join();
  for (const Status& s : got) EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  // A new server (another process) on another port: a new client reaches it.
  pid = testing::SpawnCrashChild("UcxRpcTest.ChildServer", {}, "PENUMBRA_UCX_CHILD_FD", &rfd);
  ASSERT_GT(pid, 0);
  const int port2 = ReadPort(rfd);
  close(rfd);
  auto again = UcxClient::Connect("127.0.0.1", port2);
  ASSERT_TRUE(again.ok());
  auto r = (*again)->Call(2, "abc", 10s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "cba");
  testing::KillCrashChild(pid);
}

bool IsPattern(const char* p, size_t n, size_t from) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != static_cast<char>((from + i) * 131 + 7)) return false;
  }
  return true;
}

// CallInto: a reply's body lands in the caller's parts (eager and
// rendezvous sizes, plain and sealed); a reply of another size is refused
// before it is received; an error reply comes back as Call's.
TEST(UcxRpcTest, RepliesLandInTheCallersBuffers) {
  for (bool sealed : {false, true}) {
    SCOPED_TRACE(sealed ? "sealed" : "plain");
    UcxServerOptions so = Threads(2);
    UcxClientOptions co;
    if (sealed) so.secret = co.secret = Secret('a');
    auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = UcxClient::Connect("127.0.0.1", (*server)->port(), co);
    ASSERT_TRUE(client.ok());
    for (size_t n : {size_t{0}, size_t{3}, size_t{100}, size_t{20000}, size_t{1} << 20, size_t{9} << 20}) {
      SCOPED_TRACE(n);
      // Three destinations in one buffer, out of order, with guards around.
      std::string buf(n + 300, '#');
      const size_t a = n / 3, b = n / 2;
      std::vector<ucx_frame::BodyPart> parts = {
          {buf.data() + 200 + b, n - b}, {buf.data() + 100, a}, {buf.data() + 150 + a, b - a}};
      // The server sends [0, n): parts take [0, n-b), [n-b, n-b+a), ...: the
      // pattern checks below follow the parts' order.
      const Status st = (*client)->CallInto(5, std::to_string(n), 20s, parts);
      ASSERT_TRUE(st.ok()) << st;
      size_t from = 0;
      for (const auto& p : parts) {
        EXPECT_TRUE(IsPattern(p.data, p.size, from)) << "part at " << (p.data - buf.data());
        from += p.size;
      }
      EXPECT_EQ(buf.substr(0, 100), std::string(100, '#'));
      EXPECT_EQ(buf[buf.size() - 1], '#');
    }
    // A reply shorter or longer than the parts: refused, naming both sizes.
    std::string small(1000, '\0');
    std::vector<ucx_frame::BodyPart> part = {{small.data(), small.size()}};
    for (const char* n : {"999", "1001", "5000000"}) {
      const Status st = (*client)->CallInto(5, n, 20s, part);
      EXPECT_EQ(st.code(), StatusCode::kCorruption) << n << ": " << st;
      EXPECT_NE(st.message().find("expected " + std::to_string(1000 + (sealed ? ucx_frame::kTagBytes : 0))),
                std::string::npos)
          << st;
    }
    // Errors are Call's; the client goes on.
    const Status nf = (*client)->CallInto(3, "x", 10s, part);
    EXPECT_EQ(nf.code(), StatusCode::kNotFound) << nf;
    EXPECT_NE(nf.message().find("no such thing: x"), std::string::npos) << nf;
    ASSERT_TRUE((*client)->CallInto(5, "1000", 10s, part).ok());
    EXPECT_TRUE(IsPattern(small.data(), small.size(), 0));
    EXPECT_EQ((*server)->stats().frames_rejected, 0);
  }
}

// Several connections per client: concurrent calls spread over them (every
// one made, one identity on all), each reply in its own caller's buffer;
// the server spreads the connections over its UCX workers, and counts them
// closed when the client goes.
TEST(UcxRpcTest, ConcurrentCallsSpreadOverTheClientsConnections) {
  UcxServerOptions so = Threads(4);
  so.workers = 2;
  UcxClientOptions co;
  co.connections = 3;
  so.secret = co.secret = Secret('s');
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = UcxClient::Connect("127.0.0.1", (*server)->port(), co);
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->connections(), 3);
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      std::vector<char> buf(size_t{3} << 20);
      for (int i = 0; i < 12; ++i) {
        const size_t n = (size_t{1} << 20) + static_cast<size_t>(t * 4099 + i * 777);
        std::vector<ucx_frame::BodyPart> parts = {{buf.data(), 4096}, {buf.data() + 8192, n - 4096}};
        const Status st = (*client)->CallInto(5, std::to_string(n), 30s, parts);
        if (!st.ok()) {
          ++failed;
        } else if (!IsPattern(buf.data(), 4096, 0) || !IsPattern(buf.data() + 8192, n - 4096, 4096)) {
          ++wrong;
        }
        auto who = (*client)->Call(6, "", 30s);
        if (!who.ok() || *who != (*client)->client_id() + " authenticated") ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ((*server)->stats().handshakes, 3);
  EXPECT_EQ((*server)->stats().requests, 6 * 12 * 2);
  EXPECT_EQ((*client)->Transports().size() >= 3, true);
  EXPECT_EQ((*server)->stats().endpoints_open, 3);
  client->reset();
  EXPECT_TRUE(Eventually([&] { return (*server)->stats().endpoints_open == 0; }, 20s, "the connections to close"));
  EXPECT_EQ(UcxClient::Connect("127.0.0.1", (*server)->port(),
                               [] {
                                 UcxClientOptions o;
                                 o.connections = 0;
                                 return o;
                               }())
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

// Deadlines that fall before, during or after a reply's arrival into the
// caller's buffer: each call is either whole or DeadlineExceeded, and once
// it has returned nothing more is written into its buffer (a reply still
// arriving closes its connection; the next call connects again).
TEST(UcxRpcTest, ACallPastItsDeadlineLeavesTheBufferAlone) {
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, Threads(2));
  ASSERT_TRUE(server.ok()) << server.status();
  UcxClientOptions co;
  co.connections = 1;
  auto client = UcxClient::Connect("127.0.0.1", (*server)->port(), co);
  ASSERT_TRUE(client.ok());
  const size_t n = size_t{16} << 20;
  // How long a whole read takes here, then deadlines around it.
  std::vector<char> buf(n);
  std::vector<ucx_frame::BodyPart> parts = {{buf.data(), n}};
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*client)->CallInto(7, "0:" + std::to_string(n), 20s, parts).ok());
  const auto whole = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  int ok = 0, late = 0;
  for (int i = 1; i <= 12; ++i) {
    const auto deadline = std::max<std::chrono::milliseconds>(1ms, whole * i / 8);
    std::fill(buf.begin(), buf.end(), 0);
    const Status st = (*client)->CallInto(7, "0:" + std::to_string(n), deadline, parts);
    if (st.ok()) {
      EXPECT_TRUE(IsPattern(buf.data(), n, 0));
      ++ok;
    } else {
      ASSERT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st;
      ++late;
    }
    // Returned: the buffer is the caller's again.
    std::fill(buf.begin(), buf.end(), 'z');
    std::vector<char> other(n);
    std::vector<ucx_frame::BodyPart> other_parts = {{other.data(), n}};
    const Status next = (*client)->CallInto(7, "0:" + std::to_string(n), 20s, other_parts);
    ASSERT_TRUE(next.ok()) << next;
    EXPECT_TRUE(IsPattern(other.data(), n, 0));
    EXPECT_EQ(std::count(buf.begin(), buf.end(), 'z'), static_cast<std::ptrdiff_t>(n)) << "written after return";
  }
  EXPECT_GT(ok + late, 0);
}

// A server killed while reads into callers' buffers are in flight over
// every connection (some waiting for the handler, some arriving): each
// fails Unavailable, in bounded time, and no caller hangs.
TEST(UcxRpcTest, AServerKilledMidReadFailsEveryPendingRead) {
  int rfd = -1;
  pid_t pid = testing::SpawnCrashChild("UcxRpcTest.ChildServer", {}, "PENUMBRA_UCX_CHILD_FD", &rfd);
  ASSERT_GT(pid, 0);
  const int port = ReadPort(rfd);
  close(rfd);
  ASSERT_GT(port, 0);
  UcxClientOptions co;
  co.connections = 4;
  auto client = UcxClient::Connect("127.0.0.1", port, co);
  ASSERT_TRUE(client.ok());
  std::atomic<int> reads{0};
  std::vector<Status> got(8);
  std::vector<std::thread> readers;
  for (int i = 0; i < 8; ++i) {
    readers.emplace_back([&, i] {
      std::vector<char> buf(size_t{16} << 20);
      std::vector<ucx_frame::BodyPart> parts = {{buf.data(), buf.size()}};
      // Half wait in the handler (it sleeps 3 s), half stream 16 MiB replies.
      const std::string ask = (i % 2 ? "3000:" : "0:") + std::to_string(buf.size());
      for (;;) {
        Status s = (*client)->CallInto(7, ask, 30s, parts);
        if (!s.ok()) {
          got[i] = s;
          return;
        }
        ++reads;
      }
    });
  }
  // The streaming readers are reading (each completed some), the others
  // wait in the handler.
  ASSERT_TRUE(Eventually([&] { return reads.load() >= 8; }, 20s, "reads to complete"));
  const auto t0 = std::chrono::steady_clock::now();
  testing::KillCrashChild(pid);
  for (auto& t : readers) t.join();
  for (const Status& s : got) EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
}

TEST(UcxRpcTest, SealedRoundTripsNameTheClient) {
  UcxServerOptions so;
  so.secret = Secret('a');
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*server)->sealed());
  UcxClientOptions co;
  co.secret = Secret('a');
  auto client = UcxClient::Connect("127.0.0.1", (*server)->port(), co);
  ASSERT_TRUE(client.ok()) << client.status();
  for (size_t n : {size_t{0}, size_t{1}, size_t{16384}, size_t{1} << 20, size_t{9} << 20}) {
    const std::string p = Pattern(n, static_cast<int>(n));
    auto rev = (*client)->Call(2, p, 20s);
    ASSERT_TRUE(rev.ok()) << n << ": " << rev.status();
    EXPECT_EQ(*rev, std::string(p.rbegin(), p.rend())) << n;
  }
  auto big = (*client)->Call(5, std::to_string(6 << 20), 20s);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ((*big)[12345], static_cast<char>(12345 * 131 + 7));
  // The handler sees the client's id, authenticated; another client has another.
  auto who = (*client)->Call(6, "", 10s);
  ASSERT_TRUE(who.ok()) << who.status();
  EXPECT_EQ(*who, (*client)->client_id() + " authenticated");
  EXPECT_EQ((*client)->client_id().size(), 32u);
  auto other = UcxClient::Connect("127.0.0.1", (*server)->port(), co);
  ASSERT_TRUE(other.ok());
  auto who2 = (*other)->Call(6, "", 10s);
  ASSERT_TRUE(who2.ok()) << who2.status();
  EXPECT_NE(*who2, *who);
  // The first client's calls went round its connections (each made at its
  // first call), the other's one call over one.
  EXPECT_EQ((*server)->stats().handshakes, co.connections + 1);
  EXPECT_EQ((*server)->stats().frames_rejected, 0);
  // Handler errors travel sealed too.
  EXPECT_EQ((*client)->Call(3, "x", 10s).status().code(), StatusCode::kNotFound);
}

TEST(UcxRpcTest, AClientWithoutTheSecretOrWithAWrongOneIsRefused) {
  UcxServerOptions so;
  so.secret = Secret('a');
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  auto plain = UcxClient::Connect("127.0.0.1", port);
  ASSERT_TRUE(plain.ok());
  auto r = (*plain)->Call(1, "let me in", 10s);
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("requires the cluster secret"), std::string::npos) << r.status();
  UcxClientOptions wrong;
  wrong.secret = Secret('b');
  auto guesser = UcxClient::Connect("127.0.0.1", port, wrong);
  ASSERT_TRUE(guesser.ok());
  r = (*guesser)->Call(1, "let me in", 10s);
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("authentication failed"), std::string::npos) << r.status();
  // Again: refused every time, never a handler call.
  EXPECT_EQ((*guesser)->Call(1, "again", 10s).status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ((*server)->stats().requests, 0);
  EXPECT_EQ((*server)->stats().handshakes, 0);
  EXPECT_GE((*server)->stats().handshake_failures, 3);
  // A client with the secret is served meanwhile.
  UcxClientOptions right;
  right.secret = Secret('a');
  auto good = UcxClient::Connect("127.0.0.1", port, right);
  ASSERT_TRUE(good.ok());
  auto ok = (*good)->Call(1, "hello", 10s);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, "hello");
  // A client with a secret does not fall back to a plain server.
  auto plain_server = UcxServer::Start("127.0.0.1", 0, Handle);
  ASSERT_TRUE(plain_server.ok());
  auto downgrade = UcxClient::Connect("127.0.0.1", (*plain_server)->port(), right);
  ASSERT_TRUE(downgrade.ok());
  r = (*downgrade)->Call(1, "x", 10s);
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status();
  EXPECT_EQ((*plain_server)->stats().requests, 0);
}

// A request sealed as a client of `keys` would seal it.
struct Sealed {
  std::string header, body;
};
Sealed SealRequest(ucx_frame::FrameSealer& sealer, uint64_t call_id, uint32_t method, std::string payload) {
  ucx_frame::FrameHeader h;
  h.type = ucx_frame::FrameType::kRequest;
  h.call_id = call_id;
  h.code = static_cast<int32_t>(method);
  Sealed s;
  s.body = std::move(payload);
  s.header = sealer.Seal(h, &s.body);
  return s;
}

TEST(UcxRpcTest, ForgedTamperedReplayedAndUnauthenticatedFramesCloseTheirConnection) {
  UcxServerOptions so;
  so.secret = Secret('a');
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  const std::string plane_key = Secret('a').Derive("store-plane");
  UcxClientOptions co;
  co.secret = Secret('a');
  auto honest = UcxClient::Connect("127.0.0.1", port, co);
  ASSERT_TRUE(honest.ok());
  auto still_served = [&](const char* after) {
    auto r = (*honest)->Call(1, after, 10s);
    ASSERT_TRUE(r.ok()) << after << ": " << r.status();
    EXPECT_EQ(*r, after);
  };
  still_served("first");
  using ucx_frame::FrameSealer;
  int64_t rejected = 0;

  {  // A request without a handshake.
    auto peer = testing::RawUcxPeer::Connect("127.0.0.1", port);
    ASSERT_NE(peer, nullptr);
    FrameSealer plain(nullptr);
    Sealed q = SealRequest(plain, 1, 1, "no handshake");
    ASSERT_TRUE(peer->Send(q.header, q.body));
    EXPECT_TRUE(peer->WaitClosed(10s));
    EXPECT_FALSE(peer->Receive(100ms).has_value());
    EXPECT_EQ((*server)->stats().frames_rejected, ++rejected);
  }
  still_served("after a frame without handshake");

  auto honest_peer = [&](std::unique_ptr<testing::RawUcxPeer>* peer,
                         std::shared_ptr<const ucx_frame::SessionKeys>* keys) {
    *peer = testing::RawUcxPeer::Connect("127.0.0.1", port);
    ASSERT_NE(*peer, nullptr);
    auto k = (*peer)->Handshake(plane_key, RandomBytes(16));
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_NE(*k, nullptr);
    *keys = *k;
  };
  auto read_reply = [&](testing::RawUcxPeer& peer, const ucx_frame::SessionKeys& keys) -> Result<std::string> {
    auto f = peer.Receive(10s);
    if (!f) return Status::Unavailable("no reply");
    ucx_frame::FrameOpener opener(std::shared_ptr<const ucx_frame::DirectionKeys>(
                                      std::make_shared<ucx_frame::DirectionKeys>(keys.server_to_client)),
                                  ucx_frame::kDefaultMaxBody);
    PENUMBRA_ASSIGN_OR_RETURN(ucx_frame::FrameHeader h, opener.Check(f->header, f->body.size()));
    return opener.Open(h, f->body);
  };

  {  // An honest request, then the same frame again: a replay.
    std::unique_ptr<testing::RawUcxPeer> peer;
    std::shared_ptr<const ucx_frame::SessionKeys> keys;
    honest_peer(&peer, &keys);
    FrameSealer sealer(std::make_shared<ucx_frame::DirectionKeys>(keys->client_to_server));
    Sealed q = SealRequest(sealer, 7, 2, "abc");
    ASSERT_TRUE(peer->Send(q.header, q.body));
    auto reply = read_reply(*peer, *keys);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(*reply, "cba");
    ASSERT_TRUE(peer->Send(q.header, q.body));
    EXPECT_TRUE(peer->WaitClosed(10s));
    EXPECT_EQ((*server)->stats().replays, 1);
    EXPECT_EQ((*server)->stats().frames_rejected, ++rejected);
    EXPECT_EQ((*server)->stats().requests, 3);  // two honest calls and "abc": the replay was not handled
  }
  still_served("after a replay");

  {  // A header changed after sealing (the method): its MAC fails.
    std::unique_ptr<testing::RawUcxPeer> peer;
    std::shared_ptr<const ucx_frame::SessionKeys> keys;
    honest_peer(&peer, &keys);
    FrameSealer sealer(std::make_shared<ucx_frame::DirectionKeys>(keys->client_to_server));
    Sealed q = SealRequest(sealer, 8, 1, "echo me");
    q.header[24] = 3;  // method 1 -> 3
    ASSERT_TRUE(peer->Send(q.header, q.body));
    EXPECT_TRUE(peer->WaitClosed(10s));
    EXPECT_EQ((*server)->stats().frames_rejected, ++rejected);
  }
  {  // A body changed after sealing: it does not decrypt.
    std::unique_ptr<testing::RawUcxPeer> peer;
    std::shared_ptr<const ucx_frame::SessionKeys> keys;
    honest_peer(&peer, &keys);
    FrameSealer sealer(std::make_shared<ucx_frame::DirectionKeys>(keys->client_to_server));
    Sealed q = SealRequest(sealer, 9, 1, "echo me");
    q.body[2] ^= 1;
    ASSERT_TRUE(peer->Send(q.header, q.body));
    EXPECT_TRUE(peer->WaitClosed(10s));
    EXPECT_EQ((*server)->stats().frames_rejected, ++rejected);
  }
  {  // A frame sealed with keys of a guessed secret, after an honest handshake.
    std::unique_ptr<testing::RawUcxPeer> peer;
    std::shared_ptr<const ucx_frame::SessionKeys> keys;
    honest_peer(&peer, &keys);
    const ucx_frame::SessionKeys guessed = ucx_frame::DeriveSessionKeys(Secret('b').Derive("store-plane"), "x");
    FrameSealer sealer(std::make_shared<ucx_frame::DirectionKeys>(guessed.client_to_server));
    Sealed q = SealRequest(sealer, 10, 1, "echo me");
    ASSERT_TRUE(peer->Send(q.header, q.body));
    EXPECT_TRUE(peer->WaitClosed(10s));
    EXPECT_EQ((*server)->stats().frames_rejected, ++rejected);
  }
  {  // The handshake with a wrong key: refused, nothing learned.
    auto peer = testing::RawUcxPeer::Connect("127.0.0.1", port);
    ASSERT_NE(peer, nullptr);
    auto k = peer->Handshake(Secret('b').Derive("store-plane"), RandomBytes(16));
    EXPECT_EQ(k.status().code(), StatusCode::kPermissionDenied) << k.status();
    EXPECT_TRUE(peer->WaitClosed(10s));
  }
  still_served("after forged frames");
  EXPECT_EQ((*server)->stats().requests, 4 + 1);  // the honest client's calls and "abc": nothing forged
}

TEST(UcxRpcTest, AnOversizedBodyIsRefusedBeforeItIsReceived) {
  for (bool sealed : {false, true}) {
    SCOPED_TRACE(sealed ? "sealed" : "plain");
    UcxServerOptions so;
    so.max_body_bytes = 64 << 10;
    UcxClientOptions co;
    if (sealed) so.secret = co.secret = Secret('a');
    auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = UcxClient::Connect("127.0.0.1", (*server)->port(), co);
    ASSERT_TRUE(client.ok());
    auto big = (*client)->Call(1, std::string(200 << 10, 'x'), 10s);
    EXPECT_EQ(big.status().code(), StatusCode::kUnavailable) << big.status();
    EXPECT_EQ((*server)->stats().frames_rejected, 1);
    EXPECT_EQ((*server)->stats().requests, 0);
    // The client connects again; what fits is served.
    auto small = (*client)->Call(1, std::string(1000, 'y'), 10s);
    ASSERT_TRUE(small.ok()) << small.status();
    EXPECT_EQ(small->size(), 1000u);
  }
  // A header that announces more than the message holds, by hand.
  auto server = UcxServer::Start("127.0.0.1", 0, Handle);
  ASSERT_TRUE(server.ok());
  auto peer = testing::RawUcxPeer::Connect("127.0.0.1", (*server)->port());
  ASSERT_NE(peer, nullptr);
  ASSERT_TRUE(peer->Handshake("", RandomBytes(16)).ok());
  ucx_frame::FrameHeader h;
  h.type = ucx_frame::FrameType::kRequest;
  h.code = 1;
  h.body_bytes = uint64_t{1} << 40;  // 1 TiB
  ASSERT_TRUE(peer->Send(ucx_frame::EncodeHeader(h), "tiny"));
  EXPECT_TRUE(peer->WaitClosed(10s));
  EXPECT_EQ((*server)->stats().frames_rejected, 1);
}

TEST(UcxRpcTest, AHandshakeNotFinishedInTimeIsClosed) {
  UcxServerOptions so;
  so.secret = Secret('a');
  so.handshake_timeout = 300ms;
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
  ASSERT_TRUE(server.ok());
  // One says nothing; another sends its HELLO and never proves anything.
  auto silent = testing::RawUcxPeer::Connect("127.0.0.1", (*server)->port());
  auto halfway = testing::RawUcxPeer::Connect("127.0.0.1", (*server)->port());
  ASSERT_NE(silent, nullptr);
  ASSERT_NE(halfway, nullptr);
  ucx_frame::ClientHandshake hs(Secret('a').Derive("store-plane"), RandomBytes(16));
  const ucx_frame::HandshakeStep hello = hs.Start();
  ASSERT_TRUE(halfway->Send(ucx_frame::HandshakeHeader(hello.type, hello.body), hello.body));
  auto challenge = halfway->Receive(10s);
  ASSERT_TRUE(challenge.has_value());
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(halfway->WaitClosed(10s));
  EXPECT_TRUE(silent->WaitClosed(10s));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  // The silent peer may not have reached the server's handler before it
  // closed (UCX finishes a connection on its first message): at least the
  // half-finished one was timed out.
  EXPECT_GE((*server)->stats().handshake_timeouts, 1);
  EXPECT_EQ((*server)->stats().endpoints_open, 0);
}

TEST(UcxRpcTest, ConnectionsBeyondTheCapAreRejected) {
  UcxServerOptions so;
  so.max_endpoints = 2;
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, so);
  ASSERT_TRUE(server.ok());
  std::vector<std::unique_ptr<testing::RawUcxPeer>> peers;
  for (int i = 0; i < 2; ++i) {
    peers.push_back(testing::RawUcxPeer::Connect("127.0.0.1", (*server)->port()));
    ASSERT_NE(peers.back(), nullptr);
    ASSERT_TRUE(peers.back()->Handshake("", RandomBytes(16)).ok());
  }
  EXPECT_EQ((*server)->stats().endpoints_open, 2);
  auto client = UcxClient::Connect("127.0.0.1", (*server)->port());
  ASSERT_TRUE(client.ok());
  auto r = (*client)->Call(1, "x", 10s);
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status();
  EXPECT_GE((*server)->stats().connections_rejected, 1);
  // One goes: a place is free again (once the server has seen it go).
  peers.pop_back();
  Result<std::string> again = Status::Unavailable("not tried");
  for (int i = 0; i < 100 && !again.ok(); ++i) {
    again = (*client)->Call(1, "y", 2s);
    if (!again.ok()) std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, "y");
}

TEST(UcxRpcTest, TheUcxDevicesFollowTheAddress) {
  auto lo = UcxNetDevices("127.0.0.1", false);
  ASSERT_TRUE(lo.ok()) << lo.status();
  EXPECT_EQ(*lo, "lo");
  EXPECT_EQ(*UcxNetDevices("127.0.0.7", false), "lo");
  EXPECT_EQ(*UcxNetDevices("127.0.0.1", true), "lo");
  EXPECT_EQ(*UcxNetDevices("0.0.0.0", false), "");  // every device: the address is every device's
  EXPECT_EQ(UcxNetDevices("not-an-ip", false).status().code(), StatusCode::kInvalidArgument);
  // Another address of this machine, when it has one: that interface only.
  ifaddrs* list = nullptr;
  ASSERT_EQ(getifaddrs(&list), 0);
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK)) continue;
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, ip, sizeof ip);
    auto d = UcxNetDevices(ip, false);
    ASSERT_TRUE(d.ok()) << ip << ": " << d.status();
    EXPECT_EQ(d->substr(0, d->find(',')), std::string(i->ifa_name)) << ip;
  }
  freeifaddrs(list);
  // An address no interface holds: a server cannot bind it.
  EXPECT_EQ(UcxNetDevices("203.0.113.77", false).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace penumbra::transport
