// The context-parallel rendezvous under attack (issue 37), with real
// `penumbra generate` ranks on the CPU backend (stories260K) on loopback:
// processes without a certificate, with another CA's, or with a
// certificate of another role are refused at the rendezvous, and so are
// raw sockets sending garbage or silence; the real ranks then join, and the
// group answers with the tokens one process gives. In a plaintext
// (loopback) group, malformed hellos (garbage, a wrong magic, an oversized
// or out-of-range hello), a rank of another world size and a duplicate
// rank do not abort the group either. A group secret keeps out even a
// process holding a worker certificate of the cluster. A plaintext
// rendezvous off loopback is refused unless --insecure. (The same at the
// library level, with every outcome checked byte by byte:
// tests/parallel/collective_test.cc.)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "tests/service/service_cluster.h"
#include "tests/worker/stories_shadowkv.h"
#include "transport/certs.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x50434f32;  // the group's frames (worker/parallel/process_group.cc)

// A 28-byte frame of the group's protocol: big-endian magic, op, code, pad,
// arg, seq, bytes.
std::string FrameBytes(uint8_t op, int32_t arg, uint64_t seq, uint64_t bytes, uint32_t magic = kMagic) {
  std::string f(28, '\0');
  const uint32_t m = htobe32(magic), a = htobe32(static_cast<uint32_t>(arg));
  const uint64_t q = htobe64(seq), b = htobe64(bytes);
  std::memcpy(&f[0], &m, 4);
  f[4] = static_cast<char>(op);
  std::memcpy(&f[8], &a, 4);
  std::memcpy(&f[12], &q, 8);
  std::memcpy(&f[20], &b, 8);
  return f;
}

// A TCP connection to 127.0.0.1:port (blocking, 1 s receive timeout); -1
// when it cannot connect.
int Dial(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  timeval tv{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the other end closes (or resets) `fd` within `wait`, reading and
// dropping whatever it sends first.
bool ClosedWithin(int fd, std::chrono::milliseconds wait) {
  const auto until = Clock::now() + wait;
  char buf[256];
  while (Clock::now() < until) {
    const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k == 0 || (k < 0 && errno == ECONNRESET)) return true;
    if (k < 0 && errno != EAGAIN && errno != EINTR) return true;
  }
  return false;
}

// Connects, says `bytes` (nothing: stays silent), and reports whether rank
// 0 closed the connection within `wait`.
bool SayAndBeClosed(int port, const std::string& bytes, std::chrono::milliseconds wait) {
  const int fd = Dial(port);
  if (fd < 0) return false;
  if (!bytes.empty()) (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  const bool closed = ClosedWithin(fd, wait);
  ::close(fd);
  return closed;
}

class ContextGroupSecurityTest : public StoriesTest {
 protected:
  void SetUp() override {
    StoriesTest::SetUp();
    dir_ = (std::filesystem::temp_directory_path() / ("penumbra-cpsec-" + std::to_string(getpid()) + "-" +
                                                      ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    // Ours: w0..w3 (role worker), client, coordinator...; another CA's: x/w0.
    ASSERT_TRUE(MakeCertificates(certs(), 4));
    ASSERT_TRUE(MakeCertificates(dir_ + "/x", 1));
    prompt_ = LcgTokens(120, 21, true);
  }
  void TearDown() override {
    if (HasFailure()) {
      for (const auto& [name, p] : procs_) std::cerr << "---- " << name << ":\n" << p->Log() << "\n";
    }
    procs_.clear();
    std::filesystem::remove_all(dir_);
  }
  std::string certs() const { return dir_ + "/certs"; }

  // `penumbra generate` of the prompt, its log in dir_/<name>.log.
  Process& Generate(const std::string& name, const std::vector<std::string>& flags) {
    std::ostringstream ids;
    for (size_t i = 0; i < prompt_.size(); ++i) ids << (i ? "," : "") << prompt_[i];
    std::vector<std::string> argv = {BinDir() + "/penumbra", "generate", "--model",          StoriesDir(),
                                     "--prompt-ids",         ids.str(),  "--max-new-tokens", "12",
                                     "--ignore-eos",         "--json",   "--device",         "cpu",
                                     "--prefill-chunk",      "32"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    procs_.emplace_back(name, Process::Start(argv, dir_ + "/" + name + ".log"));
    return *procs_.back().second;
  }
  // Rank `rank` of `world` at 127.0.0.1:port (port 0 for rank 0: it writes
  // its port to dir_/port.json), with `flags`.
  Process& Rank(const std::string& name, int rank, int world, int port, std::vector<std::string> flags,
                double timeout_s = 60) {
    std::vector<std::string> f = {"--cp-world",         std::to_string(world),    "--cp-rank",
                                  std::to_string(rank), "--cp-rendezvous",        "127.0.0.1:" + std::to_string(port),
                                  "--cp-timeout-s",     std::to_string(timeout_s)};
    if (rank == 0) {
      f.push_back("--cp-port-file");
      f.push_back(dir_ + "/port.json");
    }
    f.insert(f.end(), flags.begin(), flags.end());
    return Generate(name, f);
  }
  // The port rank 0 wrote (0 when it did not within 60 s, or exited).
  int PortOf(Process& rank0) {
    for (const auto until = Clock::now() + 60s; Clock::now() < until;) {
      std::ifstream f(dir_ + "/port.json");
      if (f) {
        auto j = nlohmann::json::parse(f, nullptr, false);
        if (!j.is_discarded() && j.contains("port")) return j["port"].get<int>();
      }
      if (!rank0.running()) return 0;
      std::this_thread::sleep_for(20ms);
    }
    return 0;
  }
  // The ids of the JSON line in a process's log.
  static std::vector<int32_t> Ids(const Process& p) {
    std::istringstream in(p.Log());
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] != '{') continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("ids")) return j["ids"].get<std::vector<int32_t>>();
    }
    return {};
  }
  // The tokens of the prompt from one process (no group).
  std::vector<int32_t> Reference() {
    Process& p = Generate("reference", {});
    EXPECT_EQ(p.Wait(120s), 0) << p.Log();
    return Ids(p);
  }
  // Waits until `p`'s log holds `text` (at most 60 s, and not after it exited).
  static bool LogSays(Process& p, const std::string& text) {
    for (const auto until = Clock::now() + 60s; Clock::now() < until;) {
      if (p.Log().find(text) != std::string::npos) return true;
      if (!p.running()) return p.Log().find(text) != std::string::npos;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }
  std::vector<std::string> Tls(const std::string& name, const std::string& dir = "") const {
    const std::string d = dir.empty() ? certs() : dir;
    return {"--tls-ca", d + "/ca.pem", "--tls-cert", d + "/" + name + ".pem", "--tls-key", d + "/" + name + ".key"};
  }
  static std::vector<std::string> Plus(std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  // A group secret file (mode `mode`) holding a new 128-bit secret.
  std::string SecretFile(const std::string& name, mode_t mode = 0600) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << RandomHandle() << "\n";
    ::chmod(path.c_str(), mode);
    return path;
  }

  std::string dir_;
  std::vector<int32_t> prompt_;
  std::vector<std::pair<std::string, std::unique_ptr<Process>>> procs_;
};

TEST_F(ContextGroupSecurityTest, StrangersWithoutTheRightCertificateAreRefusedAndTheGroupAnswers) {
  const auto want = Reference();
  ASSERT_EQ(want.size(), 12u);
  Process& r0 = Rank("rank0", 0, 2, 0, Tls("w0"));
  const int port = PortOf(r0);
  ASSERT_GT(port, 0);
  // An idle connection held open all along: it holds one pending slot, no more.
  const int idle = Dial(port);
  ASSERT_GE(idle, 0);
  struct Attempt {
    std::string name;
    std::vector<std::string> flags;
    std::string says;  // in its error
  };
  for (const Attempt& a : std::vector<Attempt>{
           {"no-certificate", {}, "sent no challenge"},
           {"another-ca", Tls("w0", dir_ + "/x"), "TLS handshake with rank 0 at 127.0.0.1:"},
           {"client-role", Tls("client"), "has role 'client'; this plane accepts worker"},
           {"coordinator-role", Tls("coordinator"), "has role 'coordinator'; this plane accepts worker"}}) {
    SCOPED_TRACE(a.name);
    Process& p = Rank(a.name, 1, 2, port, a.flags, /*timeout_s=*/3);
    const auto rc = p.Wait(60s);
    ASSERT_TRUE(rc.has_value()) << "still running";
    EXPECT_EQ(*rc, 1) << p.Log();
    EXPECT_NE(p.Log().find(a.says), std::string::npos) << p.Log();
    EXPECT_EQ(p.Log().find("joined"), std::string::npos) << p.Log();
  }
  // Bytes that are not TLS.
  EXPECT_TRUE(SayAndBeClosed(port, std::string(300, 'G'), 5s));
  EXPECT_TRUE(SayAndBeClosed(port, FrameBytes(1, 1, 2, 48) + std::string(48, '\0'), 5s));
  ASSERT_TRUE(r0.running()) << r0.Log();

  Process& r1 = Rank("rank1", 1, 2, port, Tls("w1"));
  ASSERT_EQ(r1.Wait(120s), 0);
  ASSERT_EQ(r0.Wait(120s), 0);
  EXPECT_EQ(Ids(r0), want);
  EXPECT_EQ(Ids(r1), want);
  EXPECT_NE(r0.Log().find("rank 1 joined from worker/w1 at 127.0.0.1:"), std::string::npos);
  EXPECT_NE(r0.Log().find("joined (data plane: TCP, mutual TLS)"), std::string::npos);
  // Rank 0 logged each refusal, naming the certificate where there was one.
  for (const char* why : {"has role 'client'", "has role 'coordinator'", "TLS handshake failed"}) {
    EXPECT_NE(r0.Log().find(why), std::string::npos) << why;
  }
  // The idle connection was closed when the group formed, at the latest.
  EXPECT_TRUE(ClosedWithin(idle, 5s));
  ::close(idle);
}

TEST_F(ContextGroupSecurityTest, MalformedHellosDoNotAbortTheGroup) {
  // A plaintext group on loopback (where the hello parser is what a
  // stranger reaches), world 3.
  const auto want = Reference();
  ASSERT_EQ(want.size(), 12u);
  Process& r0 = Rank("rank0", 0, 3, 0, {});
  const int port = PortOf(r0);
  ASSERT_GT(port, 0);
  const std::string body(48, '\0');
  EXPECT_TRUE(SayAndBeClosed(port, std::string(300, '\x17'), 5s)) << "garbage";
  EXPECT_TRUE(SayAndBeClosed(port, FrameBytes(1, 1, 3, 48, 0x48545450) + body, 5s)) << "wrong magic";
  EXPECT_TRUE(SayAndBeClosed(port, FrameBytes(1, 1, 3, uint64_t{1} << 40), 5s)) << "oversized hello";
  EXPECT_TRUE(SayAndBeClosed(port, FrameBytes(1, -5, 3, 48) + body, 5s)) << "rank out of range";
  EXPECT_TRUE(SayAndBeClosed(port, FrameBytes(2, 1, 3, 32) + body, 5s)) << "a welcome, not a hello";
  // A rank of another world size hears why and exits (usage error).
  Process& other_world = Rank("other-world", 1, 2, port, {});
  EXPECT_EQ(other_world.Wait(60s), 2);
  EXPECT_NE(other_world.Log().find("but rank 0's world is 3 (world mismatch)"), std::string::npos);
  // Rank 1 joins; a second rank 1 is refused (duplicate), then rank 2 joins.
  Process& r1 = Rank("rank1", 1, 3, port, {});
  ASSERT_TRUE(LogSays(r0, "rank 1 joined from"));
  Process& dup = Rank("duplicate", 1, 3, port, {});
  EXPECT_EQ(dup.Wait(60s), 2);
  EXPECT_NE(dup.Log().find("rank 1 has joined already (duplicate rank)"), std::string::npos);
  ASSERT_TRUE(r0.running()) << r0.Log();
  Process& r2 = Rank("rank2", 2, 3, port, {});
  for (Process* p : {&r0, &r1, &r2}) {
    ASSERT_EQ(p->Wait(120s), 0) << p->Log();
    EXPECT_EQ(Ids(*p), want);
  }
  EXPECT_NE(r0.Log().find("refused a connection"), std::string::npos);
}

TEST_F(ContextGroupSecurityTest, TheGroupSecretKeepsOutAWorkerOfAnotherGroup) {
  // Every rank holds the group's secret; a process with a worker
  // certificate of the cluster, but no secret or another group's, is
  // refused (it cannot take a rank), and the group answers.
  const auto want = Reference();
  ASSERT_EQ(want.size(), 12u);
  const std::string secret = SecretFile("group.secret"), other = SecretFile("other.secret");
  Process& r0 = Rank("rank0", 0, 2, 0, Plus(Tls("w0"), {"--cp-secret-file", secret}));
  const int port = PortOf(r0);
  ASSERT_GT(port, 0);
  Process& none = Rank("no-secret", 1, 2, port, Tls("w2"));
  EXPECT_EQ(none.Wait(60s), 1);
  EXPECT_NE(none.Log().find("requires a group secret, and this rank has none"), std::string::npos);
  Process& wrong = Rank("other-secret", 1, 2, port, Plus(Tls("w3"), {"--cp-secret-file", other}));
  EXPECT_EQ(wrong.Wait(60s), 1);
  EXPECT_NE(wrong.Log().find("proof of the group secret is wrong"), std::string::npos);
  ASSERT_TRUE(r0.running()) << r0.Log();
  Process& r1 = Rank("rank1", 1, 2, port, Plus(Tls("w1"), {"--cp-secret-file", secret}));
  ASSERT_EQ(r1.Wait(120s), 0);
  ASSERT_EQ(r0.Wait(120s), 0);
  EXPECT_EQ(Ids(r0), want);
  EXPECT_EQ(Ids(r1), want);
  EXPECT_NE(r0.Log().find("joined (data plane: TCP, mutual TLS, group secret)"), std::string::npos);
  // A secret others may read is refused before anything starts.
  Process& open = Rank("open-secret", 1, 2, port, Plus(Tls("w1"), {"--cp-secret-file", SecretFile("open", 0644)}));
  EXPECT_EQ(open.Wait(60s), 2);
  EXPECT_NE(open.Log().find("readable by group or others; chmod 600 it"), std::string::npos);
}

TEST_F(ContextGroupSecurityTest, APlaintextRendezvousOffLoopbackIsRefusedUnlessInsecure) {
  auto rank0 = [&](const std::string& name, const std::vector<std::string>& flags) -> Process& {
    std::filesystem::remove(dir_ + "/port.json");
    return Generate(name, Plus({"--cp-world", "2", "--cp-rank", "0", "--cp-rendezvous", "0.0.0.0:0", "--cp-port-file",
                                dir_ + "/port.json", "--cp-timeout-s", "60"},
                               flags));
  };
  Process& plain = rank0("plain", {});
  EXPECT_EQ(plain.Wait(60s), 2);
  EXPECT_NE(plain.Log().find("--cp-rendezvous on 0.0.0.0 without TLS: refused"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/port.json")) << "it listened";
  // --insecure: it listens, and says so loudly.
  Process& insecure = rank0("insecure", {"--insecure"});
  EXPECT_GT(PortOf(insecure), 0);
  EXPECT_TRUE(LogSays(insecure, "INSECURE: context-parallel rendezvous (rank 0) on 0.0.0.0 without TLS"));
  insecure.Signal(SIGKILL);
  // With TLS it listens there.
  Process& tls = rank0("tls", Tls("w0"));
  EXPECT_GT(PortOf(tls), 0);
  tls.Signal(SIGKILL);
  // A rank > 0 does not dial a rank 0 off loopback in plaintext either.
  Process& dial = Generate("dial", {"--cp-world", "2", "--cp-rank", "1", "--cp-rendezvous", "192.0.2.1:9"});
  EXPECT_EQ(dial.Wait(60s), 2);
  EXPECT_NE(dial.Log().find("--cp-rendezvous on 192.0.2.1 without TLS: refused"), std::string::npos);
}

}  // namespace
}  // namespace penumbra::testing
