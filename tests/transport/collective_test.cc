// transport/collective.h's TCP group with real processes (label
// distributed): each test binds rank 0's listener on loopback (port 0),
// then forks one child per rank (before this process has any other
// thread); the children join, make their calls and write a report to the
// parent on a pipe. Checked: AllGather of 0 B to 64 MiB (in place too) and
// Broadcast from every root on both planes, byte for byte, for worlds 2 and
// 3; Barrier waits for the last rank; ranks in different calls fail on
// every rank with both calls named, and every later call with the same
// error; a rank killed with SIGKILL mid-exchange fails the others with
// Unavailable, a stopped rank with DeadlineExceeded, both in bounded time;
// a wrong hello (rank out of range, world mismatch, duplicate rank) is
// InvalidArgument naming it, a rank that never comes DeadlineExceeded.
// Children on the data plane use a CPU backend (cpu_threads 1); the others
// pass none (null is the CPU's plane too).
#include "transport/collective.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <set>
#include <thread>
#include <vector>

namespace penumbra {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

::testing::AssertionResult Has(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}
::testing::AssertionResult Starts(const std::string& text, const std::string& prefix) {
  if (text.rfind(prefix, 0) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not start with \"" << prefix << "\"";
}

// What a child gets: which child it is, rank 0's port, and the listener
// (child 0's alone; null in the others).
struct Child {
  int index = 0;
  int port = 0;
  std::unique_ptr<CollectiveListener> listener;
};
using Body = std::function<std::string(Child)>;

struct Outcome {
  std::string report;  // what the child's body returned
  int status = -1;     // exit code; 128 + signal when killed
  bool killed = false; // still running when the test gave up on it (a hang, or reap_early)
  double seconds = 0;  // from the fork to its end
};

// Forks n children running `body`, each reporting its result on a pipe, and
// waits for them: at most `limit`, after which those still running are
// killed with SIGKILL (hung). Children in `reap_early` (expected to be
// stuck) are killed once all the others have ended.
std::vector<Outcome> RunChildren(int n, const Body& body, std::chrono::seconds limit = 25s,
                                 const std::set<int>& reap_early = {}) {
  auto bound = CollectiveListener::Bind("127.0.0.1", 0);
  CHECK(bound.ok()) << bound.status();
  std::unique_ptr<CollectiveListener> listener = std::move(*bound);
  const int port = listener->port();
  std::vector<pid_t> pids(n, -1);
  std::vector<int> fds(n, -1);
  const auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    int p[2];
    CHECK_EQ(pipe(p), 0);
    const pid_t pid = fork();
    CHECK_GE(pid, 0);
    if (pid == 0) {
      close(p[0]);
      Child c{i, port, nullptr};
      if (i == 0) c.listener = std::move(listener);
      listener.reset();  // the others' copy of the socket
      const std::string report = body(std::move(c));
      for (size_t off = 0; off < report.size();) {
        const ssize_t k = write(p[1], report.data() + off, report.size() - off);
        if (k <= 0) break;
        off += static_cast<size_t>(k);
      }
      _exit(0);
    }
    close(p[1]);
    pids[i] = pid;
    fds[i] = p[0];
  }
  listener.reset();  // only child 0 listens
  std::vector<Outcome> out(n);
  auto end = [&](int i) {
    int st = 0;
    waitpid(pids[i], &st, 0);
    out[i].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    out[i].seconds = std::chrono::duration<double>(Clock::now() - start).count();
    close(fds[i]);
    fds[i] = -1;
  };
  auto kill_child = [&](int i) {
    kill(pids[i], SIGKILL);
    out[i].killed = true;
    end(i);
  };
  for (;;) {
    std::vector<pollfd> pfds;
    std::vector<int> who;
    bool others_running = false;
    for (int i = 0; i < n; ++i) {
      if (fds[i] < 0) continue;
      pfds.push_back({fds[i], POLLIN, 0});
      who.push_back(i);
      if (!reap_early.count(i)) others_running = true;
    }
    if (pfds.empty()) break;
    if (!others_running) {
      for (int i : who) kill_child(i);
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(start + limit - Clock::now()).count();
    if (left <= 0) {
      for (int i : who) kill_child(i);
      break;
    }
    if (poll(pfds.data(), pfds.size(), static_cast<int>(left)) <= 0) continue;
    for (size_t j = 0; j < pfds.size(); ++j) {
      if (pfds[j].revents == 0) continue;
      char buf[4096];
      const ssize_t k = read(pfds[j].fd, buf, sizeof buf);
      if (k > 0) {
        out[who[j]].report.append(buf, static_cast<size_t>(k));
      } else {
        end(who[j]);  // EOF: the child has exited
      }
    }
  }
  return out;
}

CollectiveOptions Options(int rank, int world, int port, double timeout_s = 5) {
  CollectiveOptions o;
  o.rank = rank;
  o.world = world;
  o.rendezvous = "127.0.0.1:" + std::to_string(port);
  o.timeout_s = timeout_s;
  return o;
}

std::unique_ptr<Backend> CpuBackend() {
  BackendOptions o;
  o.device = "cpu";
  o.cpu_threads = 1;
  auto b = CreateCpuBackend(o);
  CHECK(b.ok()) << b.status();
  return std::move(*b);
}

uint8_t Pattern(int rank, size_t i, int salt) {
  return static_cast<uint8_t>(i * 167 + (i >> 11) * 13 + static_cast<size_t>(rank) * 59 + static_cast<size_t>(salt));
}

void Fill(uint8_t* p, size_t n, int rank, int salt) {
  for (size_t i = 0; i < n; ++i) p[i] = Pattern(rank, i, salt);
}

// "" when p holds rank's pattern, else where it does not.
std::string Check(const uint8_t* p, size_t n, int rank, int salt) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != Pattern(rank, i, salt)) {
      return "byte " + std::to_string(i) + " of rank " + std::to_string(rank) + "'s " + std::to_string(n) +
             " bytes is " + std::to_string(p[i]) + ", not " + std::to_string(Pattern(rank, i, salt));
    }
  }
  return "";
}

void ExpectAllOk(const std::vector<Outcome>& out) {
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].report, "ok") << "child " << i;
    EXPECT_EQ(out[i].status, 0) << "child " << i;
    EXPECT_FALSE(out[i].killed) << "child " << i << " hung";
  }
}

// ------------------------------------------------------------ in process

TEST(CollectiveTest, ParsesRendezvous) {
  std::string host;
  int port = -1;
  ASSERT_TRUE(ParseRendezvous("127.0.0.1:7000", &host, &port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 7000);
  ASSERT_TRUE(ParseRendezvous("[::1]:0", &host, &port).ok());
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 0);
  ASSERT_TRUE(ParseRendezvous("node-3.cluster:29500", &host, &port).ok());
  EXPECT_EQ(host, "node-3.cluster");
  for (const char* bad : {"", "host", ":80", "host:", "host:x", "host:65536", "::1:80", "[::1]80", "[::1"}) {
    const Status s = ParseRendezvous(bad, &host, &port);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Has(s.message(), "rendezvous '" + std::string(bad) + "'")) << bad;
  }
}

TEST(CollectiveTest, RejectsBadOptions) {
  auto code = [](const CollectiveOptions& o, std::unique_ptr<CollectiveListener> l = nullptr) {
    return ConnectCollective(nullptr, o, std::move(l)).status().code();
  };
  EXPECT_EQ(code(Options(0, 0, 1)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Options(2, 2, 1)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Options(-1, 2, 1)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Options(1, 2, 1, 0)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Options(1, 2, 0)), StatusCode::kInvalidArgument);  // port 0 is for rank 0's listener
  CollectiveOptions no_port = Options(1, 2, 1);
  no_port.rendezvous = "127.0.0.1";
  EXPECT_EQ(code(no_port), StatusCode::kInvalidArgument);
  auto l = CollectiveListener::Bind("127.0.0.1", 0);
  ASSERT_TRUE(l.ok()) << l.status();
  const int port = (*l)->port();
  const auto r = ConnectCollective(nullptr, Options(1, 2, port), std::move(*l));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(r.status().message(), "only rank 0 listens"));
}

TEST(CollectiveTest, WorldOfOneCopiesLocally) {
  auto backend = CpuBackend();
  auto g = ConnectCollective(backend.get(), Options(0, 1, 0));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->rank(), 0);
  EXPECT_EQ((*g)->world(), 1);
  std::vector<uint8_t> send(1000), recv(1000, 0);
  Fill(send.data(), send.size(), 0, 1);
  ASSERT_TRUE((*g)->AllGather(send.data(), recv.data(), send.size()).ok());
  EXPECT_EQ(Check(recv.data(), recv.size(), 0, 1), "");
  ASSERT_TRUE((*g)->AllGather(recv.data(), recv.data(), recv.size()).ok());  // in place
  EXPECT_EQ(Check(recv.data(), recv.size(), 0, 1), "");
  ASSERT_TRUE((*g)->Broadcast(recv.data(), recv.size(), 0).ok());
  ASSERT_TRUE((*g)->BroadcastHost(recv.data(), recv.size(), 0).ok());
  ASSERT_TRUE((*g)->AllGatherHost(send.data(), recv.data(), send.size()).ok());
  ASSERT_TRUE((*g)->Barrier().ok());
  EXPECT_EQ(Check(recv.data(), recv.size(), 0, 1), "");
  // A root that is not a rank breaks the group.
  const Status bad = (*g)->Broadcast(recv.data(), recv.size(), 1);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(bad.message(), "root 1"));
  EXPECT_EQ((*g)->Barrier().ToString(), bad.ToString());
}

TEST(CollectiveTest, NoRankZeroIsDeadlineExceeded) {
  int port = 0;
  {
    auto l = CollectiveListener::Bind("127.0.0.1", 0);
    ASSERT_TRUE(l.ok()) << l.status();
    port = (*l)->port();
  }  // closed: nothing listens there now
  const auto start = Clock::now();
  auto g = ConnectCollective(nullptr, Options(1, 2, port, 1));
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(g.status().code(), StatusCode::kDeadlineExceeded) << g.status();
  EXPECT_TRUE(Has(g.status().message(), "could not reach rank 0 at 127.0.0.1:" + std::to_string(port)));
  EXPECT_GE(s, 0.9);
  EXPECT_LT(s, 3);
}

// ------------------------------------------------------------ worlds 2, 3

class CollectiveGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectiveGroupTest, AllGatherOfEverySizeByteForByte) {
  const int world = GetParam();
  const auto out = RunChildren(world, [world](Child c) -> std::string {
    auto backend = CpuBackend();
    auto g = ConnectCollective(backend.get(), Options(c.index, world, c.port), std::move(c.listener));
    if (!g.ok()) return g.status().ToString();
    const int rank = (*g)->rank();
    if (rank != c.index || (*g)->world() != world) return "wrong rank/world";
    int salt = 0;
    for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{1000003}, size_t{1} << 20, size_t{64} << 20}) {
      for (bool in_place : {false, true}) {
        ++salt;
        std::vector<uint8_t> recv(n * static_cast<size_t>(world) + 1, 0xEE), send(n);
        uint8_t* mine = in_place ? recv.data() + static_cast<size_t>(rank) * n : send.data();
        Fill(mine, n, rank, salt);
        const Status s = (*g)->AllGather(mine, recv.data(), n);
        if (!s.ok()) return s.ToString();
        for (int r = 0; r < world; ++r) {
          const std::string bad = Check(recv.data() + static_cast<size_t>(r) * n, n, r, salt);
          if (!bad.empty()) return "AllGather of " + std::to_string(n) + (in_place ? " in place" : "") + ": " + bad;
        }
        if (recv.back() != 0xEE) return "AllGather of " + std::to_string(n) + " wrote past world * bytes";
      }
    }
    // The host plane: the same on the CPU, its own op.
    for (size_t n : {size_t{0}, size_t{7}, size_t{100000}}) {
      ++salt;
      std::vector<uint8_t> send(n), recv(n * static_cast<size_t>(world));
      Fill(send.data(), n, rank, salt);
      const Status s = (*g)->AllGatherHost(send.data(), recv.data(), n);
      if (!s.ok()) return s.ToString();
      for (int r = 0; r < world; ++r) {
        const std::string bad = Check(recv.data() + static_cast<size_t>(r) * n, n, r, salt);
        if (!bad.empty()) return "AllGatherHost of " + std::to_string(n) + ": " + bad;
      }
    }
    return "ok";
  });
  ExpectAllOk(out);
}

TEST_P(CollectiveGroupTest, BroadcastFromEveryRoot) {
  const int world = GetParam();
  const auto out = RunChildren(world, [world](Child c) -> std::string {
    auto backend = CpuBackend();
    auto g = ConnectCollective(backend.get(), Options(c.index, world, c.port), std::move(c.listener));
    if (!g.ok()) return g.status().ToString();
    const int rank = (*g)->rank();
    int salt = 0;
    for (int root = 0; root < world; ++root) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{4097}, size_t{3} << 20}) {
        for (bool host : {false, true}) {
          ++salt;
          std::vector<uint8_t> buf(n + 1, 0xEE);
          if (rank == root) Fill(buf.data(), n, root, salt);
          const Status s = host ? (*g)->BroadcastHost(buf.data(), n, root) : (*g)->Broadcast(buf.data(), n, root);
          if (!s.ok()) return s.ToString();
          const std::string bad = Check(buf.data(), n, root, salt);
          if (!bad.empty()) {
            return std::string(host ? "BroadcastHost" : "Broadcast") + " from root " + std::to_string(root) + ": " +
                   bad;
          }
          if (buf.back() != 0xEE) return "Broadcast wrote past its bytes";
        }
      }
    }
    return "ok";
  });
  ExpectAllOk(out);
}

TEST_P(CollectiveGroupTest, BarrierWaitsForTheLastRank) {
  const int world = GetParam();
  const auto out = RunChildren(world, [world](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, world, c.port), std::move(c.listener));
    if (!g.ok()) return g.status().ToString();
    for (int last = 0; last < world; ++last) {
      if ((*g)->rank() == last) std::this_thread::sleep_for(300ms);
      const auto start = Clock::now();
      const Status s = (*g)->Barrier();
      if (!s.ok()) return s.ToString();
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if ((*g)->rank() != last && waited < 0.2) {
        return "Barrier returned after " + std::to_string(waited) + " s, before rank " + std::to_string(last) +
               " (300 ms late) called it";
      }
    }
    return "ok";
  });
  ExpectAllOk(out);
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectiveGroupTest, ::testing::Values(2, 3));

// ------------------------------------------------------------ misuse and failures

// Calls `first` (the mismatched call), then Barrier: reports both statuses
// and the first call's seconds, "|"-separated.
std::string TwoCalls(Collective& g, const std::function<Status()>& first) {
  const auto start = Clock::now();
  const Status a = first();
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  const Status b = g.Barrier();
  return a.ToString() + "|" + b.ToString() + "|" + std::to_string(s);
}

struct Report {
  std::string first, later;
  double seconds = 0;
};
Report Parse(const std::string& r) {
  const size_t a = r.find('|'), b = r.rfind('|');
  if (a == std::string::npos || a == b) return {r, "", 0};
  return {r.substr(0, a), r.substr(a + 1, b - a - 1), std::stod(r.substr(b + 1))};
}

TEST(CollectiveTest, DifferentSizesFailOnBothRanksNamingBoth) {
  const auto out = RunChildren(2, [](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, 2, c.port), std::move(c.listener));
    if (!g.ok()) return g.status().ToString();
    const size_t n = c.index == 0 ? 8 : 16;
    std::vector<uint8_t> send(n), recv(2 * n);
    return TwoCalls(**g, [&] { return (*g)->AllGather(send.data(), recv.data(), n); });
  });
  for (int i = 0; i < 2; ++i) {
    const Report r = Parse(out[i].report);
    SCOPED_TRACE("rank " + std::to_string(i) + ": " + out[i].report);
    EXPECT_TRUE(Starts(r.first, "FailedPrecondition: collective (rank " + std::to_string(i) + " of 2)"));
    EXPECT_TRUE(Has(r.first, "rank 0 is in AllGather #1 of 8 bytes, rank 1 in AllGather #1 of 16 bytes"));
    EXPECT_EQ(r.later, r.first);  // broken: every later call, the first error
    EXPECT_LT(r.seconds, 2);      // found at once, not at the 5 s deadline
    EXPECT_FALSE(out[i].killed);
  }
}

TEST(CollectiveTest, DifferentCallsFailOnEveryRank) {
  // Rank 2 sends 64 MiB into an AllGather of 8 bytes: rank 0 stops reading
  // it, and rank 2 must hear why while still sending, not hang.
  const auto out = RunChildren(3, [](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, 3, c.port), std::move(c.listener));
    if (!g.ok()) return g.status().ToString();
    const size_t n = c.index == 2 ? size_t{64} << 20 : 8;
    std::vector<uint8_t> send(n), recv(3 * n);
    return TwoCalls(**g, [&] { return (*g)->AllGather(send.data(), recv.data(), n); });
  });
  for (int i = 0; i < 3; ++i) {
    const Report r = Parse(out[i].report);
    SCOPED_TRACE("rank " + std::to_string(i) + ": " + out[i].report);
    EXPECT_TRUE(Starts(r.first, "FailedPrecondition"));
    EXPECT_TRUE(Has(r.first, "rank 0 is in AllGather #1 of 8 bytes, rank 2 in AllGather #1 of 67108864 bytes"));
    EXPECT_EQ(r.later, r.first);
    EXPECT_LT(r.seconds, 3);
  }
  // Rank 0 the odd one: Broadcast where the others are in a Barrier.
  const auto odd = RunChildren(3, [](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, 3, c.port), std::move(c.listener));
    if (!g.ok()) return g.status().ToString();
    std::vector<uint8_t> buf(100);
    if (c.index == 0) return TwoCalls(**g, [&] { return (*g)->Broadcast(buf.data(), buf.size(), 0); });
    return TwoCalls(**g, [&] { return (*g)->Barrier(); });
  });
  for (int i = 0; i < 3; ++i) {
    const Report r = Parse(odd[i].report);
    SCOPED_TRACE("rank " + std::to_string(i) + ": " + odd[i].report);
    EXPECT_TRUE(Has(r.first, "rank 0 is in Broadcast #1 of 100 bytes from root 0, rank 1 in Barrier #1"));
    EXPECT_LT(r.seconds, 3);
  }
}

// Every rank makes AllGathers of 16 MiB until one fails; the victim kills
// itself with SIGKILL (from a thread) 150 ms in, mid-exchange.
std::vector<Outcome> KillMidExchange(int world, int victim) {
  return RunChildren(world, [world, victim](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, world, c.port), std::move(c.listener));
    if (!g.ok()) return g.status().ToString();
    if (c.index == victim) {
      std::thread([] {
        std::this_thread::sleep_for(150ms);
        kill(getpid(), SIGKILL);
      }).detach();
    }
    const size_t n = size_t{16} << 20;
    std::vector<uint8_t> send(n, static_cast<uint8_t>(c.index)), recv(n * static_cast<size_t>(world));
    for (int i = 0; i < 2000; ++i) {
      const auto start = Clock::now();
      const Status s = (*g)->AllGather(send.data(), recv.data(), n);
      if (!s.ok()) {
        return s.ToString() + "|" + (*g)->Barrier().ToString() + "|" +
               std::to_string(std::chrono::duration<double>(Clock::now() - start).count());
      }
    }
    return "no error in 2000 calls";
  });
}

TEST(CollectiveTest, RankKilledMidExchangeFailsTheOthersWithUnavailable) {
  for (int victim : {2, 0}) {
    SCOPED_TRACE("victim rank " + std::to_string(victim));
    const auto out = KillMidExchange(3, victim);
    EXPECT_EQ(out[victim].status, 128 + SIGKILL);
    for (int i = 0; i < 3; ++i) {
      if (i == victim) continue;
      const Report r = Parse(out[i].report);
      SCOPED_TRACE("rank " + std::to_string(i) + ": " + out[i].report);
      EXPECT_TRUE(Starts(r.first, "Unavailable: collective (rank " + std::to_string(i) + " of 3)"));
      EXPECT_TRUE(Has(r.first, "rank " + std::to_string(victim) + " closed the connection in AllGather #"));
      EXPECT_EQ(r.later, r.first);
      EXPECT_LT(r.seconds, 3);  // the call that saw it: well within the 5 s timeout
      EXPECT_FALSE(out[i].killed);
    }
  }
}

// Both ranks join, then `stopped` stops (SIGSTOP): no byte moves, its
// connection stays open, and the other's Barrier gives up.
std::vector<Outcome> StopOne(int stopped) {
  return RunChildren(
      2,
      [stopped](Child c) -> std::string {
        auto g = ConnectCollective(nullptr, Options(c.index, 2, c.port, 1), std::move(c.listener));
        if (!g.ok()) return g.status().ToString();
        if (c.index == stopped) kill(getpid(), SIGSTOP);
        const auto start = Clock::now();
        const Status s = (*g)->Barrier();
        return s.ToString() + "|" + (*g)->Barrier().ToString() + "|" +
               std::to_string(std::chrono::duration<double>(Clock::now() - start).count());
      },
      25s, /*reap_early=*/{stopped});
}

TEST(CollectiveTest, StoppedRankIsDeadlineExceeded) {
  // Rank 1 stopped: rank 0 gives up after timeout_s.
  auto out = StopOne(1);
  Report r = Parse(out[0].report);
  EXPECT_TRUE(Starts(r.first, "DeadlineExceeded: collective (rank 0 of 2): nothing moved for 1 s waiting for rank 1 "
                              "in Barrier #1"));
  EXPECT_EQ(r.later, r.first);
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_LT(r.seconds, 3);
  EXPECT_FALSE(out[0].killed);
  // Rank 0 stopped: rank 1 waits for rank 0's word 1.5 timeouts (rank 0
  // would have said which rank it waited for).
  out = StopOne(0);
  r = Parse(out[1].report);
  EXPECT_TRUE(Starts(r.first, "DeadlineExceeded: collective (rank 1 of 2): nothing moved for 1.5 s waiting for "
                              "rank 0 in Barrier #1"));
  EXPECT_EQ(r.later, r.first);
  EXPECT_GE(r.seconds, 1.4);
  EXPECT_LT(r.seconds, 4);
  EXPECT_FALSE(out[1].killed);
}

TEST(CollectiveTest, BadHellosAreInvalidArgumentNamingThem) {
  // Rank 2 of world 3 joining rank 0's world of 2: out of range.
  auto out = RunChildren(2, [](Child c) -> std::string {
    const CollectiveOptions o = c.index == 0 ? Options(0, 2, c.port) : Options(2, 3, c.port);
    return ConnectCollective(nullptr, o, std::move(c.listener)).status().ToString();
  });
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(Starts(out[i].report, "InvalidArgument")) << i;
    EXPECT_TRUE(Has(out[i].report, "rank 2 is out of range for rank 0's world of 2")) << i;
    EXPECT_LT(out[i].seconds, 3) << i;
  }
  // Rank 1 of world 3 joining a world of 2.
  out = RunChildren(2, [](Child c) -> std::string {
    const CollectiveOptions o = c.index == 0 ? Options(0, 2, c.port) : Options(1, 3, c.port);
    return ConnectCollective(nullptr, o, std::move(c.listener)).status().ToString();
  });
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(Starts(out[i].report, "InvalidArgument")) << i;
    EXPECT_TRUE(Has(out[i].report, "a peer says it is rank 1 of world 3, but rank 0's world is 2 (world mismatch)"))
        << i;
    EXPECT_LT(out[i].seconds, 3) << i;
  }
  // Two rank 1s (and no rank 2): rank 0 and both of them.
  out = RunChildren(3, [](Child c) -> std::string {
    const CollectiveOptions o = Options(c.index == 0 ? 0 : 1, 3, c.port);
    return ConnectCollective(nullptr, o, std::move(c.listener)).status().ToString();
  });
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(Starts(out[i].report, "InvalidArgument")) << i;
    EXPECT_TRUE(Has(out[i].report, "rank 1 has joined already (duplicate rank)")) << i;
    EXPECT_LT(out[i].seconds, 3) << i;
  }
}

TEST(CollectiveTest, MissingRankIsDeadlineExceededOnTheOthers) {
  // World 3, rank 2 never comes: rank 0 gives up after 1 s, and rank 1
  // hears why from rank 0 (before its own deadline).
  const auto out = RunChildren(2, [](Child c) -> std::string {
    return ConnectCollective(nullptr, Options(c.index, 3, c.port, 1), std::move(c.listener)).status().ToString();
  });
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(Starts(out[i].report, "DeadlineExceeded: collective (rank " + std::to_string(i) + " of 3)")) << i;
    EXPECT_TRUE(Has(out[i].report, "rank(s) 2 did not join within 1 s")) << i;
    EXPECT_LT(out[i].seconds, 3) << i;
  }
}

}  // namespace
}  // namespace penumbra
