// worker/parallel/process_group.h's TCP group with real processes (label
// distributed): each test binds rank 0's listener on loopback (port 0),
// then forks one child per rank (before this process has any other
// thread); the children join, make their calls and write a report to the
// parent on a pipe. Checked, in plaintext and over mutual TLS (the
// certificates made once per run, before any fork): AllGather of 0 B to
// 64 MiB (in place too) and Broadcast from every root on both planes, byte
// for byte, for worlds 2 and 3; Barrier waits for the last rank; ranks in
// different calls fail on every rank with both calls named, and every later
// call with the same error; a rank killed with SIGKILL mid-exchange fails
// the others with Unavailable, a stopped rank with DeadlineExceeded, both
// in bounded time; a wrong hello (rank out of range, world mismatch,
// duplicate rank) is InvalidArgument naming it on the rank that said it,
// while rank 0 keeps waiting and forms the group with the real ranks; a
// rank that never comes is DeadlineExceeded.
// The rendezvous under attack: strangers (garbage, a wrong magic, an
// oversized hello, silence, no certificate, another CA's, another role's)
// are closed and the group still forms; the pending-connection caps; the
// group secret (every rank proves it; a wrong or missing one is refused);
// rank 0's certificate must name the host dialled; a plaintext group off
// loopback is refused unless insecure.
// Children on the data plane use a CPU backend (cpu_threads 1); the others
// pass none (null is the CPU's plane too).
#include "worker/parallel/process_group.h"

#include <arpa/inet.h>
#include <endian.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <thread>
#include <vector>

#include "transport/certs.h"

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
  std::string report;   // what the child's body returned
  int status = -1;      // exit code; 128 + signal when killed
  bool killed = false;  // still running when the test gave up on it (a hang, or reap_early)
  double seconds = 0;   // from the fork to its end
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

// ------------------------------------------------------------ certificates

// One cluster CA and its certificates for the whole run, made in the parent
// before any child is forked (the children read the files): w0..w3
// (role worker, for 127.0.0.1 and localhost), c0 (role client), wfar (a
// worker certificate for another host), and x0 (a worker certificate of
// another CA, x-ca).
class Certificates : public ::testing::Environment {
 public:
  static const std::string& Dir() { return dir_; }
  void SetUp() override {
    dir_ =
        (std::filesystem::temp_directory_path() / ("penumbra-collective-certs-" + std::to_string(getpid()))).string();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    Status s = transport::CreateCertificateAuthority(dir_ + "/ca.pem", dir_ + "/ca.key", "penumbra-test");
    if (s.ok()) s = transport::CreateCertificateAuthority(dir_ + "/x-ca.pem", dir_ + "/x-ca.key", "someone-else");
    auto issue = [&](const std::string& ca, const char* role, const std::string& name, std::vector<std::string> hosts) {
      if (!s.ok()) return;
      transport::CertificateSpec spec;
      spec.role = role;
      spec.name = name;
      spec.hosts = std::move(hosts);
      s = transport::IssueCertificate(dir_ + "/" + ca + ".pem", dir_ + "/" + ca + ".key", spec,
                                      dir_ + "/" + name + ".pem", dir_ + "/" + name + ".key");
    };
    for (int i = 0; i < 4; ++i) {
      issue("ca", transport::role::kWorker, "w" + std::to_string(i), {"127.0.0.1", "localhost"});
    }
    issue("ca", transport::role::kClient, "c0", {"127.0.0.1", "localhost"});
    issue("ca", transport::role::kWorker, "wfar", {"10.9.9.9"});
    issue("x-ca", transport::role::kWorker, "x0", {"127.0.0.1", "localhost"});
    ASSERT_TRUE(s.ok()) << s;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

 private:
  static inline std::string dir_;
};
const auto* const kCertificates = ::testing::AddGlobalTestEnvironment(new Certificates);

// Certificate `name` (and its key) with `ca`'s certificate as the trust.
transport::TlsFiles Tls(const std::string& name, const std::string& ca = "ca") {
  const std::string& d = Certificates::Dir();
  return {d + "/" + ca + ".pem", d + "/" + name + ".pem", d + "/" + name + ".key"};
}

// Rank `rank` of `world` at 127.0.0.1:port; with `tls`, certificate w<rank>.
CollectiveOptions Options(int rank, int world, int port, double timeout_s = 5, bool tls = false) {
  CollectiveOptions o;
  o.rank = rank;
  o.world = world;
  o.rendezvous = "127.0.0.1:" + std::to_string(port);
  o.timeout_s = timeout_s;
  if (tls) o.security.tls = Tls("w" + std::to_string(rank));
  return o;
}

std::string PlainOrTls(const ::testing::TestParamInfo<bool>& info) { return info.param ? "Tls" : "Plain"; }

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

// World and TLS.
class CollectiveGroupTest : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  bool tls() const { return std::get<1>(GetParam()); }
};

TEST_P(CollectiveGroupTest, AllGatherOfEverySizeByteForByte) {
  const int world = this->world();
  const bool tls = this->tls();
  const auto out = RunChildren(world, [world, tls](Child c) -> std::string {
    auto backend = CpuBackend();
    auto g = ConnectCollective(backend.get(), Options(c.index, world, c.port, 5, tls), std::move(c.listener));
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
  const int world = this->world();
  const bool tls = this->tls();
  const auto out = RunChildren(world, [world, tls](Child c) -> std::string {
    auto backend = CpuBackend();
    auto g = ConnectCollective(backend.get(), Options(c.index, world, c.port, 5, tls), std::move(c.listener));
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
  const int world = this->world();
  const bool tls = this->tls();
  const auto out = RunChildren(world, [world, tls](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, world, c.port, 5, tls), std::move(c.listener));
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

INSTANTIATE_TEST_SUITE_P(Worlds, CollectiveGroupTest, ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
                           return "World" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "Tls" : "Plain");
                         });

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

// Plaintext or mutual TLS (the same failures, the same messages).
class CollectiveFailureTest : public ::testing::TestWithParam<bool> {};

TEST_P(CollectiveFailureTest, DifferentSizesFailOnBothRanksNamingBoth) {
  const bool tls = GetParam();
  const auto out = RunChildren(2, [tls](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, 2, c.port, 5, tls), std::move(c.listener));
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

TEST_P(CollectiveFailureTest, DifferentCallsFailOnEveryRank) {
  // Rank 2 sends 64 MiB into an AllGather of 8 bytes: rank 0 stops reading
  // it, and rank 2 must hear why while still sending, not hang.
  const bool tls = GetParam();
  const auto out = RunChildren(3, [tls](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, 3, c.port, 5, tls), std::move(c.listener));
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
  const auto odd = RunChildren(3, [tls](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, 3, c.port, 5, tls), std::move(c.listener));
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
std::vector<Outcome> KillMidExchange(int world, int victim, bool tls) {
  return RunChildren(world, [world, victim, tls](Child c) -> std::string {
    auto g = ConnectCollective(nullptr, Options(c.index, world, c.port, 5, tls), std::move(c.listener));
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

TEST_P(CollectiveFailureTest, RankKilledMidExchangeFailsTheOthersWithUnavailable) {
  for (int victim : {2, 0}) {
    SCOPED_TRACE("victim rank " + std::to_string(victim));
    const auto out = KillMidExchange(3, victim, GetParam());
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
std::vector<Outcome> StopOne(int stopped, bool tls) {
  return RunChildren(2,
                     [stopped, tls](Child c) -> std::string {
                       auto g = ConnectCollective(nullptr, Options(c.index, 2, c.port, 1, tls), std::move(c.listener));
                       if (!g.ok()) return g.status().ToString();
                       if (c.index == stopped) kill(getpid(), SIGSTOP);
                       const auto start = Clock::now();
                       const Status s = (*g)->Barrier();
                       return s.ToString() + "|" + (*g)->Barrier().ToString() + "|" +
                              std::to_string(std::chrono::duration<double>(Clock::now() - start).count());
                     },
                     25s, /*reap_early=*/{stopped});
}

TEST_P(CollectiveFailureTest, StoppedRankIsDeadlineExceeded) {
  // Rank 1 stopped: rank 0 gives up after timeout_s.
  auto out = StopOne(1, GetParam());
  Report r = Parse(out[0].report);
  EXPECT_TRUE(Starts(r.first,
                     "DeadlineExceeded: collective (rank 0 of 2): nothing moved for 1 s waiting for rank 1 "
                     "in Barrier #1"));
  EXPECT_EQ(r.later, r.first);
  EXPECT_GE(r.seconds, 0.9);
  EXPECT_LT(r.seconds, 3);
  EXPECT_FALSE(out[0].killed);
  // Rank 0 stopped: rank 1 waits for rank 0's word 1.5 timeouts (rank 0
  // would have said which rank it waited for).
  out = StopOne(0, GetParam());
  r = Parse(out[1].report);
  EXPECT_TRUE(Starts(r.first,
                     "DeadlineExceeded: collective (rank 1 of 2): nothing moved for 1.5 s waiting for "
                     "rank 0 in Barrier #1"));
  EXPECT_EQ(r.later, r.first);
  EXPECT_GE(r.seconds, 1.4);
  EXPECT_LT(r.seconds, 4);
  EXPECT_FALSE(out[1].killed);
}

// Joins as Options(rank, world) says, then (when it joined) makes a Barrier
// and an AllGather of each rank's number: "ok", or the first error.
std::string JoinAndCheck(Child& c, const CollectiveOptions& o) {
  auto g = ConnectCollective(nullptr, o, std::move(c.listener));
  if (!g.ok()) return g.status().ToString();
  if (Status s = (*g)->Barrier(); !s.ok()) return s.ToString();
  const int32_t mine = (*g)->rank();
  std::vector<int32_t> all(static_cast<size_t>((*g)->world()), -1);
  if (Status s = (*g)->AllGatherHost(&mine, all.data(), sizeof mine); !s.ok()) return s.ToString();
  for (int r = 0; r < (*g)->world(); ++r) {
    if (all[r] != r) return "AllGatherHost: slot " + std::to_string(r) + " holds " + std::to_string(all[r]);
  }
  return "ok";
}

// Waits (at most 20 s) until `fd` (a pipe's read end) says go, or closes.
void WaitFor(int fd) {
  pollfd p{fd, POLLIN, 0};
  (void)poll(&p, 1, 20000);
}

// A pipe whose write end a child closes (by writing, or by exiting) when
// the next child may start.
struct Signal {
  int fds[2] = {-1, -1};
  Signal() { CHECK_EQ(pipe(fds), 0); }
  ~Signal() {
    close(fds[0]);
    close(fds[1]);
  }
  void Go() const { CHECK_EQ(write(fds[1], "g", 1), 1); }
  void Wait() const { WaitFor(fds[0]); }
};

TEST_P(CollectiveFailureTest, BadHellosAreRefusedAndTheGroupStillForms) {
  // A peer that says a wrong rank or world (one of ours, misconfigured)
  // hears why, InvalidArgument naming it; rank 0 keeps waiting, and the
  // real rank that comes after it joins.
  const bool tls = GetParam();
  struct Case {
    int world;                // rank 0's
    int bad_rank, bad_world;  // what the bad peer says
    std::string message;
  };
  for (const Case& k : std::vector<Case>{
           {2, 2, 3, "a peer says it is rank 2 of world 3: rank 2 is out of range for rank 0's world of 2"},
           {2, 1, 3, "a peer says it is rank 1 of world 3, but rank 0's world is 2 (world mismatch)"}}) {
    SCOPED_TRACE(k.message);
    Signal refused;
    // Child 0: rank 0; child 1: the bad peer; child 2: the real rank 1, once
    // the bad peer has been refused.
    const auto out = RunChildren(3, [&](Child c) -> std::string {
      if (c.index == 0) return JoinAndCheck(c, Options(0, k.world, c.port, 10, tls));
      if (c.index == 1) {
        CollectiveOptions o = Options(k.bad_rank, k.bad_world, c.port, 10, false);
        if (tls) o.security.tls = Tls("w3");
        const std::string r = ConnectCollective(nullptr, o).status().ToString();
        refused.Go();
        return r;
      }
      refused.Wait();
      return JoinAndCheck(c, Options(1, k.world, c.port, 10, tls));
    });
    EXPECT_EQ(out[0].report, "ok");
    EXPECT_EQ(out[2].report, "ok");
    EXPECT_TRUE(Starts(out[1].report, "InvalidArgument")) << out[1].report;
    EXPECT_TRUE(Has(out[1].report, k.message));
    EXPECT_LT(out[1].seconds, 3);
    for (const auto& o : out) EXPECT_FALSE(o.killed);
  }
  // Two rank 1s: whichever says its hello second is refused (duplicate
  // rank) and hears why; rank 2 then comes, and the group forms with the
  // other.
  Signal duplicate_refused;
  const auto out = RunChildren(4, [&](Child c) -> std::string {
    if (c.index == 0) return JoinAndCheck(c, Options(0, 3, c.port, 10, tls));
    if (c.index == 3) {
      duplicate_refused.Wait();
      return JoinAndCheck(c, Options(2, 3, c.port, 10, tls));
    }
    CollectiveOptions o = Options(1, 3, c.port, 10, false);
    if (tls) o.security.tls = Tls(c.index == 1 ? "w1" : "w3");
    const std::string r = JoinAndCheck(c, o);
    if (r != "ok") duplicate_refused.Go();
    return r;
  });
  EXPECT_EQ(out[0].report, "ok");
  EXPECT_EQ(out[3].report, "ok");
  const std::string& refused = out[1].report == "ok" ? out[2].report : out[1].report;
  EXPECT_TRUE(out[1].report == "ok" || out[2].report == "ok") << out[1].report << " / " << out[2].report;
  EXPECT_TRUE(Starts(refused, "InvalidArgument")) << refused;
  EXPECT_TRUE(Has(refused, "rank 1 has joined already (duplicate rank)"));
  for (const auto& o : out) EXPECT_FALSE(o.killed);
}

INSTANTIATE_TEST_SUITE_P(Transport, CollectiveFailureTest, ::testing::Bool(), PlainOrTls);

// ------------------------------------------------------------ the rendezvous under attack

// The group's wire format (worker/parallel/process_group.cc), as a stranger would
// write it: a 28-byte frame, big-endian.
constexpr uint32_t kMagic = 0x50434f32;  // "PCO2"
enum : uint8_t { kHelloOp = 1, kWelcomeOp = 2, kAbortOp = 3, kChallengeOp = 9 };
constexpr size_t kFrame = 28, kNonce = 16, kHelloBody = 48, kProof = 32;

std::string FrameBytes(uint8_t op, uint8_t code, int32_t arg, uint64_t seq, uint64_t bytes, uint32_t magic = kMagic) {
  std::string f(kFrame, '\0');
  const uint32_t m = htobe32(magic), a = htobe32(static_cast<uint32_t>(arg));
  const uint64_t q = htobe64(seq), b = htobe64(bytes);
  std::memcpy(&f[0], &m, 4);
  f[4] = static_cast<char>(op);
  f[5] = static_cast<char>(code);
  std::memcpy(&f[8], &a, 4);
  std::memcpy(&f[12], &q, 8);
  std::memcpy(&f[20], &b, 8);
  return f;
}

// One connection to the rendezvous, plaintext or TLS (raw OpenSSL: it may
// present any certificate, or none), blocking with receive deadlines.
class Visitor {
 public:
  ~Visitor() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
    if (fd_ >= 0) close(fd_);
  }
  // "" once connected (and through the TLS handshake when `tls`), else
  // "connect failed" or "tls-refused". `files`: the CA it trusts, and the
  // certificate it presents when cert_file is set.
  std::string Open(int port, bool tls, const transport::TlsFiles& files = {}, const std::string& source = "127.0.0.1",
                   Clock::time_point deadline = Clock::now() + 5s) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in src{}, dst{};
    src.sin_family = dst.sin_family = AF_INET;
    inet_pton(AF_INET, source.c_str(), &src.sin_addr);
    inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
    dst.sin_port = htons(static_cast<uint16_t>(port));
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0 ||
        connect(fd_, reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) {
      return "connect failed";
    }
    if (!tls) return "";
    ctx_ = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER, nullptr);
    if (SSL_CTX_load_verify_locations(ctx_, files.ca_file.c_str(), nullptr) != 1) return "bad test CA";
    if (!files.cert_file.empty() &&
        (SSL_CTX_use_certificate_chain_file(ctx_, files.cert_file.c_str()) != 1 ||
         SSL_CTX_use_PrivateKey_file(ctx_, files.key_file.c_str(), SSL_FILETYPE_PEM) != 1)) {
      return "bad test certificate";
    }
    ssl_ = SSL_new(ctx_);
    SSL_set_fd(ssl_, fd_);
    SetTimeout(deadline);
    return SSL_connect(ssl_) == 1 ? "" : "tls-refused";
  }
  void Send(const std::string& bytes) {
    if (bytes.empty()) return;
    if (ssl_ != nullptr) {
      (void)SSL_write(ssl_, bytes.data(), static_cast<int>(bytes.size()));
    } else {
      (void)send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    }
  }
  // Reads n bytes into *out: "" when they came, else "closed" (the other
  // end closed or reset the connection), "tls-refused" (a TLS alert), or
  // "open" (nothing more by `deadline`).
  std::string Read(size_t n, std::string* out, Clock::time_point deadline) {
    out->assign(n, '\0');
    size_t got = 0;
    while (got < n) {
      if (Clock::now() >= deadline) return "open";
      SetTimeout(deadline);
      if (ssl_ != nullptr) {
        const int k = SSL_read(ssl_, out->data() + got, static_cast<int>(n - got));
        if (k > 0) {
          got += static_cast<size_t>(k);
          continue;
        }
        const int e = SSL_get_error(ssl_, k);
        if (e == SSL_ERROR_WANT_READ) continue;  // the receive timeout: try until the deadline
        if (e == SSL_ERROR_ZERO_RETURN || e == SSL_ERROR_SYSCALL) return "closed";
        return "tls-refused";
      }
      const ssize_t k = recv(fd_, out->data() + got, n - got, 0);
      if (k > 0) {
        got += static_cast<size_t>(k);
        continue;
      }
      if (k == 0 || errno == ECONNRESET) return "closed";
      if (errno != EAGAIN && errno != EINTR) return std::string("recv: ") + std::strerror(errno);
    }
    return "";
  }

 private:
  void SetTimeout(Clock::time_point deadline) {
    const auto us =
        std::max<int64_t>(1000, std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count());
    timeval tv{static_cast<time_t>(us / 1000000), static_cast<suseconds_t>(us % 1000000)};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  int fd_ = -1;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
};

// A stranger at the rendezvous: what it speaks and sends.
struct Stranger {
  std::string name;
  bool tls = false;
  transport::TlsFiles files;  // its trust and (when set) its certificate
  std::string payload;        // sent once rank 0's challenge has come (nothing: it stays silent)
  bool eager = false;         // sent at once, without waiting for a challenge
};

// What rank 0 did with a stranger, as words: the frames it sent
// ("Challenge", "Abort(<code>)") and how the connection ended ("closed",
// "tls-refused", or "open" when still open after `limit`); *seconds: how
// long that took.
std::string Visit(int port, const Stranger& s, Clock::duration limit, double* seconds) {
  const auto start = Clock::now(), deadline = start + limit;
  Visitor v;
  std::string end = v.Open(port, s.tls, s.files, "127.0.0.1", deadline);
  std::vector<std::string> seen;
  bool sent = false;
  if (end.empty() && s.eager) {
    v.Send(s.payload);
    sent = true;
  }
  while (end.empty()) {
    std::string head, body;
    end = v.Read(kFrame, &head, deadline);
    if (!end.empty()) break;
    uint32_t magic = 0;
    uint64_t bytes = 0;
    std::memcpy(&magic, head.data(), 4);
    std::memcpy(&bytes, head.data() + 20, 8);
    bytes = be64toh(bytes);
    const uint8_t op = static_cast<uint8_t>(head[4]), code = static_cast<uint8_t>(head[5]);
    if (be32toh(magic) != kMagic) {
      end = "junk";
    } else if (op == kChallengeOp) {
      seen.push_back("Challenge");
      end = v.Read(kNonce, &body, deadline);
      if (end.empty() && !sent) {
        v.Send(s.payload);
        sent = true;
      }
    } else if (op == kAbortOp) {
      seen.push_back("Abort(" + std::string(StatusCodeName(static_cast<StatusCode>(code))) + ")");
      end = v.Read(std::min<uint64_t>(bytes, 4096), &body, deadline);
    } else {
      seen.push_back("op " + std::to_string(op));
      end = v.Read(std::min<uint64_t>(bytes, 4096), &body, deadline);
    }
  }
  seen.push_back(end);
  *seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::string out;
  for (const auto& w : seen) out += (out.empty() ? "" : " ") + w;
  return out;
}

class CollectiveRendezvousTest : public ::testing::TestWithParam<bool> {};

TEST_P(CollectiveRendezvousTest, StrangersAreClosedAndTheGroupStillForms) {
  // Rank 0 gives a connection 2 s for its handshake and hello. The strangers
  // call one after the other, each ending as expected (the silent ones once
  // their 2 s are up, the others at once); then the real rank 1 joins.
  const bool tls = GetParam();
  struct Case {
    Stranger s;
    std::string expect;
    bool silent;  // closed when its time is up, not at once
  };
  const std::string garbage(200, '\x5a');
  const std::string oversized = FrameBytes(kHelloOp, 0, 1, 2, uint64_t{1} << 40);
  const std::string wrong_magic = FrameBytes(kHelloOp, 0, 1, 2, kHelloBody, 0x47455420) + std::string(kHelloBody, 0);
  const std::string far_rank = FrameBytes(kHelloOp, 0, 7, 2, kHelloBody) + std::string(kHelloBody, 0);
  std::vector<Case> cases;
  if (!tls) {
    cases = {{{"garbage", false, {}, garbage}, "Challenge closed", false},
             {{"wrong magic", false, {}, wrong_magic}, "Challenge closed", false},
             {{"oversized hello", false, {}, oversized}, "Challenge closed", false},
             {{"rank out of range", false, {}, far_rank}, "Challenge Abort(InvalidArgument) closed", false},
             {{"silent", false, {}, ""}, "Challenge closed", true}};
  } else {
    cases = {{{"plaintext garbage", false, {}, garbage, true}, "closed", false},
             {{"plaintext hello", false, {}, far_rank, true}, "closed", false},
             {{"TLS without a certificate", true, {Tls("w0").ca_file, "", ""}, ""}, "tls-refused", false},
             {{"another CA's certificate", true, Tls("x0"), ""}, "tls-refused", false},
             {{"a client's certificate", true, Tls("c0"), ""}, "Abort(PermissionDenied) closed", false},
             {{"a worker's garbage", true, Tls("w3"), garbage}, "Challenge closed", false},
             {{"a worker's oversized hello", true, Tls("w3"), oversized}, "Challenge closed", false},
             {{"a worker's wrong magic", true, Tls("w3"), wrong_magic}, "Challenge closed", false},
             {{"a silent worker", true, Tls("w3"), ""}, "Challenge closed", true},
             {{"silent TCP", false, {}, "", true}, "closed", true}};
  }
  Signal strangers_done;
  const auto out = RunChildren(
      3,
      [&](Child c) -> std::string {
        if (c.index == 0) {
          CollectiveOptions o = Options(0, 2, c.port, 20, tls);
          o.hello_timeout_s = 2;
          return JoinAndCheck(c, o);
        }
        if (c.index == 2) {
          strangers_done.Wait();
          return JoinAndCheck(c, Options(1, 2, c.port, 20, tls));
        }
        std::string report;
        for (const Case& k : cases) {
          double seconds = 0;
          const std::string got = Visit(c.port, k.s, 6s, &seconds);
          const bool in_time = k.silent ? seconds > 1.5 && seconds < 5 : seconds < 1.5;
          if (got != k.expect || !in_time) {
            report += k.s.name + ": \"" + got + "\" after " + std::to_string(seconds) + " s (expected \"" + k.expect +
                      "\" " + (k.silent ? "after about 2 s" : "at once") + "); ";
          }
        }
        strangers_done.Go();
        return report.empty() ? "ok" : report;
      },
      40s);
  EXPECT_EQ(out[1].report, "ok");
  EXPECT_EQ(out[0].report, "ok");
  EXPECT_EQ(out[2].report, "ok");
  for (const auto& o : out) EXPECT_FALSE(o.killed);
}

TEST(CollectiveRendezvousTest, PendingConnectionsAreCapped) {
  // Rank 0 holds at most 4 connections that have not joined, 2 from one
  // address. From 127.0.0.2: 5 silent connections, 2 of them kept (they
  // hear the challenge); from 127.0.0.3: 3, 2 kept; then the cap is
  // reached: one from 127.0.0.4 is closed at once. Rank 1, refused while
  // they are held, retries and joins once they close.
  Signal full;
  const auto out = RunChildren(3, [&](Child c) -> std::string {
    if (c.index == 0) {
      CollectiveOptions o = Options(0, 2, c.port, 20);
      o.max_pending = 4;
      o.max_pending_per_host = 2;
      o.hello_timeout_s = 20;
      return JoinAndCheck(c, o);
    }
    if (c.index == 2) {
      full.Wait();
      return JoinAndCheck(c, Options(1, 2, c.port, 20));
    }
    std::vector<std::unique_ptr<Visitor>> held;
    auto visit = [&](const std::string& source) {
      auto v = std::make_unique<Visitor>();
      std::string end = v->Open(c.port, false, {}, source);
      std::string head;
      if (end.empty()) end = v->Read(kFrame, &head, Clock::now() + 1s);
      if (end.empty()) end = static_cast<uint8_t>(head[4]) == kChallengeOp ? "challenged" : "junk";
      held.push_back(std::move(v));
      return end;
    };
    std::string got;
    for (int i = 0; i < 5; ++i) got += visit("127.0.0.2") + ",";
    for (int i = 0; i < 3; ++i) got += visit("127.0.0.3") + ",";
    got += visit("127.0.0.4");
    full.Go();
    std::this_thread::sleep_for(500ms);  // rank 1 meets the cap meanwhile
    held.clear();
    const std::string want = "challenged,challenged,closed,closed,closed,challenged,challenged,closed,closed";
    return got == want ? "ok" : "got " + got + ", expected " + want;
  });
  EXPECT_EQ(out[1].report, "ok");
  EXPECT_EQ(out[0].report, "ok");
  EXPECT_EQ(out[2].report, "ok");
  for (const auto& o : out) EXPECT_FALSE(o.killed);
}

// A secret of 16 bytes (the least) and another.
const std::string kSecretA = "0123456789abcdef", kSecretB = "fedcba9876543210";

class CollectiveSecretTest : public ::testing::TestWithParam<bool> {};

TEST_P(CollectiveSecretTest, EveryRankProvesTheGroupSecret) {
  const bool tls = GetParam();
  auto with = [&](int rank, int world, int port, const std::string& secret, const char* cert = nullptr) {
    CollectiveOptions o = Options(rank, world, port, 10, false);
    if (tls) o.security.tls = Tls(cert != nullptr ? cert : "w" + std::to_string(rank));
    o.security.group_secret = secret;
    return o;
  };
  {
    SCOPED_TRACE("the same secret everywhere");
    const auto out = RunChildren(3, [&](Child c) { return JoinAndCheck(c, with(c.index, 3, c.port, kSecretA)); });
    ExpectAllOk(out);
  }
  struct Case {
    std::string rank0_secret, bad_secret;
    std::string message;
  };
  for (const Case& k :
       std::vector<Case>{{kSecretA, kSecretB,
                          "PermissionDenied: collective (rank 1 of 2): from rank 0: a peer's proof of the "
                          "group secret is wrong (another group's secret)"},
                         {kSecretA, "", "requires a group secret, and this rank has none"},
                         {"", kSecretA, "does not use a group secret, and this rank has one"}}) {
    SCOPED_TRACE(k.message);
    // Child 1, with the wrong secret (or none), is refused; child 2, with
    // rank 0's, then joins.
    Signal refused;
    const auto out = RunChildren(3, [&](Child c) -> std::string {
      if (c.index == 0) return JoinAndCheck(c, with(0, 2, c.port, k.rank0_secret));
      if (c.index == 1) {
        const std::string r = JoinAndCheck(c, with(1, 2, c.port, k.bad_secret, "w3"));
        refused.Go();
        return r;
      }
      refused.Wait();
      return JoinAndCheck(c, with(1, 2, c.port, k.rank0_secret));
    });
    EXPECT_EQ(out[0].report, "ok");
    EXPECT_EQ(out[2].report, "ok");
    EXPECT_TRUE(Starts(out[1].report, "PermissionDenied")) << out[1].report;
    EXPECT_TRUE(Has(out[1].report, k.message));
    EXPECT_LT(out[1].seconds, 3);
    for (const auto& o : out) EXPECT_FALSE(o.killed);
  }
  // Too short to be a secret.
  auto bad = ConnectCollective(nullptr, with(1, 2, 1, "0123456789abcde"));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(bad.status().message(), "a group secret of 15 bytes (at least 16)"));
}

INSTANTIATE_TEST_SUITE_P(Transport, CollectiveRendezvousTest, ::testing::Bool(), PlainOrTls);
INSTANTIATE_TEST_SUITE_P(Transport, CollectiveSecretTest, ::testing::Bool(), PlainOrTls);

TEST(CollectiveSecretTest, ARankZeroThatCannotProveTheSecretIsRefused) {
  // A fake rank 0 (plaintext, on loopback) asks for a secret it does not
  // hold, takes the hello, and welcomes with a proof of zeros.
  auto l = CollectiveListener::Bind("127.0.0.1", 0);
  ASSERT_TRUE(l.ok()) << l.status();
  const int port = (*l)->port();
  std::string hello;
  std::thread fake([&] {
    pollfd p{(*l)->fd(), POLLIN, 0};
    if (poll(&p, 1, 5000) != 1) return;
    const int fd = accept4((*l)->fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const std::string challenge = FrameBytes(kChallengeOp, 1, 0, 0, kNonce) + std::string(kNonce, 'n');
    (void)send(fd, challenge.data(), challenge.size(), MSG_NOSIGNAL);
    hello.assign(kFrame + kHelloBody, '\0');
    size_t got = 0;
    while (got < hello.size()) {
      const ssize_t k = recv(fd, hello.data() + got, hello.size() - got, 0);
      if (k <= 0) break;
      got += static_cast<size_t>(k);
    }
    hello.resize(got);
    const std::string welcome = FrameBytes(kWelcomeOp, 0, 2, 0, kProof) + std::string(kProof, '\0');
    (void)send(fd, welcome.data(), welcome.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(200ms);
    close(fd);
  });
  CollectiveOptions o = Options(1, 2, port, 5);
  o.security.group_secret = kSecretA;
  const auto g = ConnectCollective(nullptr, o);
  fake.join();
  EXPECT_EQ(g.status().code(), StatusCode::kPermissionDenied) << g.status();
  EXPECT_TRUE(Has(g.status().message(), "did not prove the group secret in its welcome"));
  // What the rank said: a hello with its proof (not zeros).
  ASSERT_EQ(hello.size(), kFrame + kHelloBody);
  EXPECT_EQ(static_cast<uint8_t>(hello[4]), kHelloOp);
  EXPECT_NE(hello.substr(kFrame + kNonce), std::string(kProof, '\0'));
}

TEST(CollectiveTlsTest, CertificatesOfTheWrongKindAreRefusedAndTheGroupStillForms) {
  struct Case {
    std::string name;
    std::string rank0_cert;   // rank 0's
    transport::TlsFiles bad;  // the refused rank 1's (plaintext when not enabled)
    std::string message;      // in its error
    std::string code;
  };
  for (const Case& k : std::vector<Case>{
           {"another role", "w0", Tls("c0"), "has role 'client'; this plane accepts worker", "PermissionDenied"},
           {"another CA", "w0", Tls("x0", "x-ca"), "TLS handshake with rank 0 at 127.0.0.1:", "PermissionDenied"},
           {"rank 0 not for this host", "wfar", Tls("w1"), "does not name the host '127.0.0.1'", "PermissionDenied"},
           {"plaintext to TLS", "w0", {}, "could not reach rank 0 at 127.0.0.1:", "DeadlineExceeded"}}) {
    SCOPED_TRACE(k.name);
    Signal refused;
    const auto out = RunChildren(3, [&](Child c) -> std::string {
      if (c.index == 0) {
        CollectiveOptions o = Options(0, 2, c.port, 15);
        o.security.tls = Tls(k.rank0_cert);
        o.hello_timeout_s = 1;
        return JoinAndCheck(c, o);
      }
      CollectiveOptions o = Options(1, 2, c.port, 15);
      if (c.index == 1) {
        o.security.tls = k.bad;
        o.timeout_s = 2.5;
        const std::string r = JoinAndCheck(c, o);
        refused.Go();
        return r;
      }
      refused.Wait();
      o.security.tls = Tls("w1");
      // Rank 0's certificate names another host: only a rank told not to
      // check the host joins it.
      o.security.verify_host = k.rank0_cert != "wfar";
      return JoinAndCheck(c, o);
    });
    EXPECT_EQ(out[0].report, "ok");
    EXPECT_EQ(out[2].report, "ok");
    EXPECT_TRUE(Starts(out[1].report, k.code)) << out[1].report;
    EXPECT_TRUE(Has(out[1].report, k.message));
    for (const auto& o : out) EXPECT_FALSE(o.killed);
  }
  // A TLS rank at a plaintext rank 0: its handshake fails on the
  // challenge; rank 0 drops the connection and forms the group later.
  Signal refused;
  const auto out = RunChildren(3, [&](Child c) -> std::string {
    if (c.index == 0) return JoinAndCheck(c, Options(0, 2, c.port, 15));
    if (c.index == 1) {
      const std::string r = JoinAndCheck(c, Options(1, 2, c.port, 15, /*tls=*/true));
      refused.Go();
      return r;
    }
    refused.Wait();
    return JoinAndCheck(c, Options(1, 2, c.port, 15));
  });
  EXPECT_EQ(out[0].report, "ok");
  EXPECT_EQ(out[2].report, "ok");
  EXPECT_TRUE(Starts(out[1].report, "PermissionDenied")) << out[1].report;
  EXPECT_TRUE(Has(out[1].report, "TLS handshake with rank 0"));
}

TEST(CollectiveTest, PlaintextOffLoopbackIsRefusedUnlessInsecure) {
  auto any = CollectiveListener::Bind("0.0.0.0", 0);
  ASSERT_TRUE(any.ok()) << any.status();
  const int port = (*any)->port();
  CollectiveOptions o = Options(0, 2, port, 0.3);
  auto g = ConnectCollective(nullptr, o, std::move(*any));
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << g.status();
  EXPECT_TRUE(Has(g.status().message(), "context-parallel rendezvous (rank 0) on 0.0.0.0 without TLS: refused"));
  // --insecure: it listens (and, alone, gives up after its timeout).
  any = CollectiveListener::Bind("0.0.0.0", 0);
  ASSERT_TRUE(any.ok()) << any.status();
  o.security.insecure = true;
  g = ConnectCollective(nullptr, o, std::move(*any));
  EXPECT_EQ(g.status().code(), StatusCode::kDeadlineExceeded) << g.status();
  // With TLS it may listen there.
  any = CollectiveListener::Bind("0.0.0.0", 0);
  ASSERT_TRUE(any.ok()) << any.status();
  o = Options(0, 2, port, 0.3, /*tls=*/true);
  g = ConnectCollective(nullptr, o, std::move(*any));
  EXPECT_EQ(g.status().code(), StatusCode::kDeadlineExceeded) << g.status();
  // A rank > 0 does not dial a non-loopback rank 0 in plaintext either.
  CollectiveOptions r1 = Options(1, 2, 9);
  r1.rendezvous = "192.0.2.1:9";
  const auto start = Clock::now();
  g = ConnectCollective(nullptr, r1);
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument) << g.status();
  EXPECT_TRUE(Has(g.status().message(), "context-parallel rank 1's connection to rank 0 on 192.0.2.1 without TLS"));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 1);
}

}  // namespace
}  // namespace penumbra
