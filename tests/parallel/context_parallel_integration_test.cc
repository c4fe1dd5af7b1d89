// Context parallel with real processes (label distributed): two `penumbra
// generate` ranks on the CPU backend, joined over TCP on loopback (rank 0
// binds port 0 and writes it to --cp-port-file), in plaintext and over
// mutual TLS (worker certificates from a CA the test makes), give the
// greedy tokens of the same prompt generated in one process, for full
// attention and for ShadowKV configured to lose nothing; a rank killed with
// SIGKILL ends the other with an error in bounded time, never a hang; a
// rank whose partner never comes gives up after --cp-timeout-s. (The group
// under attack: tests/security/context_group_test.cc.)
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "common/process.h"
#include "tests/worker/stories_shadowkv.h"
#include "transport/certs.h"
#include "transport/tls.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

using namespace std::chrono_literals;

std::string BinDir() { return std::filesystem::read_symlink("/proc/self/exe").parent_path().string(); }

class ContextParallelProcessTest : public testing::StoriesTest {
 protected:
  void SetUp() override {
    testing::StoriesTest::SetUp();
    dir_ = std::filesystem::temp_directory_path() / ("penumbra-cp-" + std::to_string(getpid()) + "-" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    for (pid_t p : pids_) {
      kill(p, SIGKILL);
      waitpid(p, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }

  // `penumbra generate` of `prompt` with `extra` flags, its output to log.
  pid_t Start(const std::vector<int32_t>& prompt, const std::vector<std::string>& extra, const std::string& log,
              int new_tokens = 24) {
    std::ostringstream ids;
    for (size_t i = 0; i < prompt.size(); ++i) ids << (i ? "," : "") << prompt[i];
    std::vector<std::string> argv = {BinDir() + "/penumbra", "generate", "--model",          testing::StoriesDir(),
                                     "--prompt-ids",         ids.str(),  "--max-new-tokens", std::to_string(new_tokens),
                                     "--ignore-eos",         "--json",   "--device",         "cpu",
                                     "--prefill-chunk",      "48"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto pid = SpawnProcess(argv, (dir_ / log).string());
    EXPECT_TRUE(pid.ok()) << pid.status();
    if (!pid.ok()) return -1;
    pids_.push_back(*pid);
    return *pid;
  }
  // Waits (bounded) for pid; its exit code, or -1 when it did not end in time.
  int Wait(pid_t pid, std::chrono::seconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      int st = 0;
      if (waitpid(pid, &st, WNOHANG) == pid) {
        pids_.erase(std::remove(pids_.begin(), pids_.end(), pid), pids_.end());
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(20ms);
    }
    return -1;
  }
  int PortOf(const std::string& file) {
    for (int i = 0; i < 1000; ++i) {
      std::ifstream f(dir_ / file);
      if (f) {
        auto j = nlohmann::json::parse(f, nullptr, false);
        if (!j.is_discarded() && j.contains("port")) return j["port"].get<int>();
      }
      std::this_thread::sleep_for(20ms);
    }
    return 0;
  }
  std::string Log(const std::string& log) {
    auto s = ReadFileToString((dir_ / log).string());
    return s.ok() ? *s : "";
  }
  // The ids of the JSON line in a rank's log.
  std::vector<int32_t> Ids(const std::string& log) {
    std::istringstream in(Log(log));
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] != '{') continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("ids")) return j["ids"].get<std::vector<int32_t>>();
    }
    return {};
  }
  // Both ranks of a 2-rank group (with `tls`, certificates w0 and w1);
  // their exit codes.
  std::pair<int, int> RunPair(const std::vector<int32_t>& prompt, const std::vector<std::string>& flags,
                              bool tls = false) {
    std::vector<std::string> r0 = {"--cp-world",      "2",           "--cp-rank",      "0",
                                   "--cp-rendezvous", "127.0.0.1:0", "--cp-port-file", (dir_ / "port.json").string()};
    r0.insert(r0.end(), flags.begin(), flags.end());
    if (tls) Append(&r0, TlsFlags("w0"));
    const pid_t p0 = Start(prompt, r0, "rank0.log");
    const int port = PortOf("port.json");
    EXPECT_GT(port, 0) << Log("rank0.log");
    std::vector<std::string> r1 = {
        "--cp-world", "2", "--cp-rank", "1", "--cp-rendezvous", "127.0.0.1:" + std::to_string(port)};
    r1.insert(r1.end(), flags.begin(), flags.end());
    if (tls) Append(&r1, TlsFlags("w1"));
    const pid_t p1 = Start(prompt, r1, "rank1.log");
    return {Wait(p0, 120s), Wait(p1, 120s)};
  }
  static void Append(std::vector<std::string>* to, const std::vector<std::string>& more) {
    to->insert(to->end(), more.begin(), more.end());
  }
  // A CA and worker certificates w0, w1 (for 127.0.0.1) in dir_/certs, made
  // once per test; the flags naming `name`'s.
  std::vector<std::string> TlsFlags(const std::string& name) {
    const std::string d = (dir_ / "certs").string();
    if (!std::filesystem::exists(d + "/ca.pem")) {
      std::filesystem::create_directories(d);
      Status s = transport::CreateCertificateAuthority(d + "/ca.pem", d + "/ca.key", "penumbra-test");
      for (const char* w : {"w0", "w1"}) {
        transport::CertificateSpec spec;
        spec.role = transport::role::kWorker;
        spec.name = w;
        spec.hosts = {"127.0.0.1", "localhost"};
        if (s.ok())
          s = transport::IssueCertificate(d + "/ca.pem", d + "/ca.key", spec, d + "/" + w + ".pem",
                                          d + "/" + w + ".key");
      }
      EXPECT_TRUE(s.ok()) << s;
    }
    return {"--tls-ca", d + "/ca.pem", "--tls-cert", d + "/" + name + ".pem", "--tls-key", d + "/" + name + ".key"};
  }

  std::filesystem::path dir_;
  std::vector<pid_t> pids_;
};

std::vector<int32_t> InProcess(const std::vector<int32_t>& prompt, const std::vector<std::string>& policy) {
  EngineOptions o;
  o.backend.device = "cpu";
  o.runtime.prefill_chunk = 48;
  if (policy[1] == "shadowkv") {  // the exact ShadowKV flags below
    o = testing::ExactShadowKvOptions();
    o.runtime.prefill_chunk = 48;
  }
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = 24;
  auto g = (*e)->runtime().Generate({r});
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? (*g)[0].ids : std::vector<int32_t>{};
}

// testing::ExactShadowKvOptions as flags.
const std::vector<std::string> kExactShadowKv = {
    "--kv-policy", "shadowkv",   "--rank", "32",       "--chunk-size", "32",           "--local-window",
    "8",           "--outliers", "0",      "--budget", "4096",         "--min-prompt", "0"};

// Plaintext or mutual TLS.
class ContextParallelTransportTest : public ContextParallelProcessTest, public ::testing::WithParamInterface<bool> {};

TEST_P(ContextParallelTransportTest, TwoRanksGiveTheOneProcessTokens) {
  const bool tls = GetParam();
  const auto prompt = testing::LcgTokens(300, 11, true);
  for (const auto& policy : {std::vector<std::string>{"--kv-policy", "full"}, kExactShadowKv}) {
    const auto want = InProcess(prompt, policy);
    ASSERT_EQ(want.size(), 24u);
    const auto [rc0, rc1] = RunPair(prompt, policy, tls);
    ASSERT_EQ(rc0, 0) << Log("rank0.log");
    ASSERT_EQ(rc1, 0) << Log("rank1.log");
    EXPECT_EQ(Ids("rank0.log"), want) << policy[1] << "\n" << Log("rank0.log");
    EXPECT_EQ(Ids("rank1.log"), want) << policy[1] << "\n" << Log("rank1.log");
    for (const char* log : {"rank0.log", "rank1.log"}) {
      EXPECT_NE(Log(log).find(tls ? "joined (data plane: TCP, mutual TLS)" : "joined (data plane: TCP, plaintext)"),
                std::string::npos)
          << Log(log);
    }
    std::filesystem::remove(dir_ / "port.json");
  }
}

TEST_P(ContextParallelTransportTest, AKilledRankEndsTheOtherWithAnError) {
  // Rank 1 is killed as soon as it has joined (its log says so), while the
  // ranks prefill and decode the model's whole context together. On a fast
  // machine the pair may finish first: then the attempt is repeated.
  const bool tls = GetParam();
  const auto prompt = testing::LcgTokens(300, 12, true);
  bool killed_mid_run = false;
  for (int attempt = 0; attempt < 3 && !killed_mid_run; ++attempt) {
    std::filesystem::remove(dir_ / "port.json");
    std::vector<std::string> r0 = {"--cp-world",      "2",           "--cp-rank",      "0",
                                   "--cp-rendezvous", "127.0.0.1:0", "--cp-port-file", (dir_ / "port.json").string(),
                                   "--cp-timeout-s",  "10"};
    if (tls) Append(&r0, TlsFlags("w0"));
    const pid_t p0 = Start(prompt, r0, "rank0.log", 200);
    const int port = PortOf("port.json");
    ASSERT_GT(port, 0) << Log("rank0.log");
    std::vector<std::string> r1 = {
        "--cp-world",     "2", "--cp-rank", "1", "--cp-rendezvous", "127.0.0.1:" + std::to_string(port),
        "--cp-timeout-s", "10"};
    if (tls) Append(&r1, TlsFlags("w1"));
    const pid_t p1 = Start(prompt, r1, "rank1.log", 200);
    for (int i = 0; i < 6000 && Log("rank1.log").find("joined") == std::string::npos; ++i) {
      std::this_thread::sleep_for(1ms);
    }
    kill(p1, SIGKILL);
    (void)Wait(p1, 10s);
    const int rc = Wait(p0, 30s);
    ASSERT_NE(rc, -1) << "rank 0 hung after its partner was killed";
    if (rc == 0) continue;  // the pair had finished
    killed_mid_run = true;
    EXPECT_NE(Log("rank0.log").find("rank 1"), std::string::npos) << Log("rank0.log");
  }
  EXPECT_TRUE(killed_mid_run) << "the kill never landed before the pair finished";
}

INSTANTIATE_TEST_SUITE_P(Transport, ContextParallelTransportTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Tls" : "Plain"; });

TEST_F(ContextParallelProcessTest, ARankAloneGivesUpAfterItsTimeout) {
  const auto prompt = testing::LcgTokens(100, 13, true);
  const pid_t p0 =
      Start(prompt, {"--cp-world", "2", "--cp-rank", "0", "--cp-rendezvous", "127.0.0.1:0", "--cp-timeout-s", "2"},
            "rank0.log");
  const int rc = Wait(p0, 30s);
  EXPECT_NE(rc, -1) << "rank 0 waited forever for rank 1";
  EXPECT_NE(rc, 0) << Log("rank0.log");
}

TEST_F(ContextParallelProcessTest, InconsistentFlagsAreRefused) {
  const auto prompt = testing::LcgTokens(100, 14, true);
  for (const auto& flags :
       std::vector<std::vector<std::string>>{{"--cp-world", "2", "--cp-rank", "2", "--cp-rendezvous", "127.0.0.1:1"},
                                             {"--cp-world", "2", "--cp-rank", "1"},
                                             {"--cp-world", "0", "--cp-rank", "0", "--cp-rendezvous", "127.0.0.1:1"},
                                             {"--cp-world", "2", "--cp-rank", "1", "--cp-rendezvous", "nohostport"}}) {
    const pid_t p = Start(prompt, flags, "bad.log");
    EXPECT_EQ(Wait(p, 30s), 2) << Log("bad.log");
    EXPECT_NE(Log("bad.log").find("--cp-"), std::string::npos) << Log("bad.log");
  }
}

}  // namespace
}  // namespace penumbra
