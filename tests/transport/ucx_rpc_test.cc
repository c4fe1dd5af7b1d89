// The UCX request/reply plane on loopback: round trips small and large
// (rendezvous) payloads, many calls in flight from many threads, handler
// errors carried back as they are, deadlines, a server that stops, and a
// server process killed with SIGKILL mid-call (the caller gets Unavailable,
// never a hang, and reaches a new server after).
#include "transport/ucx_rpc.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "tests/crash_child.h"

namespace penumbra::transport {
namespace {

using namespace std::chrono_literals;

// method 1: echo; 2: the payload reversed; 3: fails with NotFound; 4: sleeps
// the payload's milliseconds, then echoes; 5: `n` (the payload, decimal)
// bytes of a pattern.
Result<std::string> Handle(uint32_t method, std::string payload) {
  switch (method) {
    case 1: return payload;
    case 2: return std::string(payload.rbegin(), payload.rend());
    case 3: return Status::NotFound("no such thing: " + payload);
    case 4:
      std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(payload)));
      return payload;
    case 5: {
      std::string out(std::stoul(payload), '\0');
      for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 131 + 7);
      return out;
    }
    default: return Status::InvalidArgument("method " + std::to_string(method));
  }
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
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, 4);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = UcxClient::Connect("127.0.0.1", (*server)->port());
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
}

TEST(UcxRpcTest, ErrorsDeadlinesAndAStoppedServer) {
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, 2);
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
  EXPECT_TRUE(gone.status().code() == StatusCode::kUnavailable ||
              gone.status().code() == StatusCode::kDeadlineExceeded)
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
  auto server = UcxServer::Start("127.0.0.1", 0, Handle, 2);
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

}  // namespace
}  // namespace penumbra::transport
