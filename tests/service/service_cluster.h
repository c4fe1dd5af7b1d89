// Real Penumbra processes on loopback for the service integration tests:
// penumbra-worker and penumbra-coordinator started from the build's bin/
// ($PENUMBRA_BIN_DIR) on ports the OS picks, read back from their port
// files. Every process is killed (SIGKILL) when its handle goes, so a failing
// test leaves nothing running; logs stay in the cluster's temporary folder
// and are printed when a test fails. Under the sanitizer jobs
// (ops/sanitize.sh) a process's sanitizer report fails the test that started
// it (SanitizerReport), even when the test itself would pass.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "common/process.h"
#include "coordinator/client/client.h"
#include "gen-cpp/Worker.h"
#include "tests/test_util.h"
#include "transport/certs.h"
#include "transport/thrift_util.h"

namespace penumbra::testing {

// The sanitizer report in a process's log, or "" when none: ThreadSanitizer,
// AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer write theirs
// to stderr, which Process sends to the log.
inline std::string SanitizerReport(const std::string& log) {
  for (const char* marker : {"WARNING: ThreadSanitizer:", "ERROR: ThreadSanitizer:", "ERROR: AddressSanitizer:",
                             "ERROR: LeakSanitizer:", ": runtime error: "}) {
    const size_t at = log.find(marker);
    if (at == std::string::npos) continue;
    const size_t line = log.rfind('\n', at);
    return log.substr(line == std::string::npos ? 0 : line + 1);
  }
  return "";
}

// A metric's value from the /metrics page on loopback port `port` (the line
// starting with `series` and a space); -1 when absent or not served.
inline double MetricValue(int port, const std::string& series) {
  auto r = httplib::Client("127.0.0.1", port).Get("/metrics");
  if (!r || r->status != 200) return -1;
  std::istringstream in(r->body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

inline std::string BinDir() {
  const char* s = std::getenv("PENUMBRA_BIN_DIR");
  return s ? s : SourceDir() + "/build/bin";
}

class Process {
 public:
  // Starts argv[0] with its output to `log`.
  static std::unique_ptr<Process> Start(const std::vector<std::string>& argv, const std::string& log) {
    // A restarted process writes over its predecessor's log: check that first.
    ExpectNoSanitizerReport(std::filesystem::path(argv[0]).filename(), ReadFile(log));
    auto p = std::unique_ptr<Process>(new Process());
    p->log_ = log;
    p->name_ = std::filesystem::path(argv[0]).filename();
    auto pid = SpawnProcess(argv, log);
    EXPECT_TRUE(pid.ok()) << pid.status();
    p->pid_ = pid.ok() ? *pid : -1;
    p->exited_ = !pid.ok();
    return p;
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    ExpectNoSanitizerReport(name_, Log());
  }
  pid_t pid() const { return pid_; }
  void Signal(int sig) { kill(pid_, sig); }
  // The exit status (or -signal), or nullopt when still running after `timeout`.
  std::optional<int> Wait(std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int st = 0;
      const pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
      }
      if (std::chrono::steady_clock::now() >= until) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  bool running() {
    if (exited_) return false;
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) exited_ = true;
    return !exited_;
  }
  std::string Log() const { return ReadFile(log_); }
  const std::string& name() const { return name_; }

 private:
  static std::string ReadFile(const std::string& path) {
    std::ifstream f(path);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  static void ExpectNoSanitizerReport(const std::string& name, const std::string& log) {
    const std::string report = SanitizerReport(log);
    if (!report.empty()) ADD_FAILURE() << name << " made a sanitizer report:\n" << report;
  }
  Process() = default;
  pid_t pid_ = -1;
  bool exited_ = false;
  std::string log_, name_;
};

struct Served {
  std::unique_ptr<Process> process;
  int port = 0, metrics_port = 0;
};

// Waits for `port_file` (written once serving); fails the test with the
// process's log when it exits first or the wait times out.
inline bool WaitServing(Served& s, const std::string& port_file,
                        std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream f(port_file);
    if (f) {
      try {
        nlohmann::json j = nlohmann::json::parse(f);
        s.port = j.at("port").get<int>();
        s.metrics_port = j.at("metrics_port").get<int>();
        return true;
      } catch (const std::exception&) {
      }
    }
    if (!s.process->running()) {
      ADD_FAILURE() << s.process->name() << " exited before serving:\n" << s.process->Log();
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << s.process->name() << " not serving after " << timeout.count() << " ms:\n" << s.process->Log();
  return false;
}

struct ClusterOptions {
  int workers = 1;
  std::string model;                      // default: stories260K
  std::vector<std::string> worker_flags;  // extra flags of every worker
  std::vector<std::string> coordinator_flags;
  std::string api_keys_yaml;  // non-empty: --api-keys with this file
  std::string tenants_yaml;   // non-empty: --tenants with this file (tenants_path())
  // TLS everywhere: a CA and a certificate per process in dir()/certs
  // (MakeCertificates), mutual TLS to the workers, clients checking the CA.
  bool tls = false;
  // Context groups: each one's number of ranks. Their workers come after
  // the single ones (indices workers, workers + 1, ...; named w<index>),
  // rank 0 first; group g is "g<g>" (--groups of the coordinator).
  std::vector<int> groups;
};

// A CA and certificates as `penumbra cert init` makes them, in `dir`: ca.pem,
// coordinator, w0..w(workers-1), s0..s(store_nodes-1), client, admin (each
// .pem and .key, naming 127.0.0.1 and localhost), and cluster.secret.
inline bool MakeCertificates(const std::string& dir, int workers, int store_nodes = 0) {
  std::filesystem::create_directories(dir);
  Status s = transport::CreateCertificateAuthority(dir + "/ca.pem", dir + "/ca.key", "penumbra-test");
  auto issue = [&](const char* role, const std::string& name) {
    if (!s.ok()) return;
    transport::CertificateSpec spec;
    spec.role = role;
    spec.name = name;
    spec.hosts = {"127.0.0.1", "localhost"};
    s = transport::IssueCertificate(dir + "/ca.pem", dir + "/ca.key", spec, dir + "/" + name + ".pem",
                                    dir + "/" + name + ".key");
  };
  issue(transport::role::kCoordinator, "coordinator");
  for (int i = 0; i < workers; ++i) issue(transport::role::kWorker, "w" + std::to_string(i));
  for (int i = 0; i < store_nodes; ++i) issue(transport::role::kStore, "s" + std::to_string(i));
  issue(transport::role::kClient, "client");
  issue(transport::role::kAdmin, "admin");
  if (s.ok()) s = ClusterSecret::Create(dir + "/cluster.secret", true);
  EXPECT_TRUE(s.ok()) << s;
  return s.ok();
}

// The security flags of process `name` with the certificates in `dir`.
inline std::vector<std::string> TlsFlags(const std::string& dir, const std::string& name) {
  return {"--tls-ca",
          dir + "/ca.pem",
          "--tls-cert",
          dir + "/" + name + ".pem",
          "--tls-key",
          dir + "/" + name + ".key",
          "--cluster-secret-file",
          dir + "/cluster.secret"};
}

// N workers and a coordinator.
class Cluster {
 public:
  explicit Cluster(ClusterOptions o) : o_(std::move(o)) {
    if (o_.model.empty()) o_.model = StoriesDir();
    char tmpl[] = "/tmp/penumbra-service-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
    if (o_.tls) MakeCertificates(certs_dir(), std::max(o_.workers, 8), 4);
  }
  ~Cluster() {
    if (::testing::Test::HasFailure()) {
      for (auto* s : all()) {
        if (s->process) std::cerr << "---- " << s->process->name() << " log:\n" << s->process->Log() << "\n";
      }
    }
    workers_.clear();
    coordinator_ = Served{};
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  int processes() const {
    int n = o_.workers;
    for (int g : o_.groups) n += g;
    return n;
  }
  // Worker i's group, rank and world (group -1: a single worker).
  void GroupOf(int i, int* group, int* rank, int* world) const {
    *group = -1;
    *rank = 0;
    *world = 1;
    int at = o_.workers;
    for (size_t g = 0; g < o_.groups.size(); ++g) {
      if (i >= at && i < at + o_.groups[g]) {
        *group = static_cast<int>(g);
        *rank = i - at;
        *world = o_.groups[g];
      }
      at += o_.groups[g];
    }
  }
  bool Start() {
    for (int i = 0; i < processes(); ++i) {
      if (!StartWorker(i)) return false;
    }
    return StartCoordinator();
  }
  // `port` 0: one the OS picks (a restarted worker takes its old one, which
  // the coordinator's worker list names).
  bool StartWorker(int i, int port = 0) {
    const std::string pf = dir_ + "/worker" + std::to_string(i) + ".port";
    std::remove(pf.c_str());
    std::vector<std::string> argv = {BinDir() + "/penumbra-worker",
                                     "--model",
                                     o_.model,
                                     "--device",
                                     "cpu",
                                     "--name",
                                     "w" + std::to_string(i),
                                     "--port",
                                     std::to_string(port),
                                     "--metrics-port",
                                     "0",
                                     "--port-file",
                                     pf};
    if (o_.tls) {
      for (const auto& f : TlsFlags(certs_dir(), "w" + std::to_string(i))) argv.push_back(f);
    }
    int group = 0, rank = 0, world = 1;
    GroupOf(i, &group, &rank, &world);
    if (group >= 0) {
      argv.insert(argv.end(), {"--group", "g" + std::to_string(group), "--group-rank", std::to_string(rank),
                               "--group-world", std::to_string(world)});
    }
    argv.insert(argv.end(), o_.worker_flags.begin(), o_.worker_flags.end());
    if (static_cast<int>(workers_.size()) <= i) workers_.resize(i + 1);
    workers_[i].process = Process::Start(argv, dir_ + "/worker" + std::to_string(i) + ".log");
    return WaitServing(workers_[i], pf);
  }
  // `flags`: besides ClusterOptions::coordinator_flags (e.g. a data directory
  // for a restarted coordinator). `port` 0: one the OS picks (a restarted
  // coordinator may take its old one, where its clients reconnect).
  bool StartCoordinator(const std::vector<std::string>& flags = {}, int port = 0) {
    const std::string pf = dir_ + "/coordinator.port";
    std::remove(pf.c_str());  // a restart waits for the new process's file
    std::string list, groups;
    for (size_t i = 0; i < workers_.size(); ++i) {
      const std::string member = "w" + std::to_string(i) + "=127.0.0.1:" + std::to_string(workers_[i].port);
      int group = 0, rank = 0, world = 1;
      GroupOf(static_cast<int>(i), &group, &rank, &world);
      if (group < 0) {
        list += (list.empty() ? "" : ",") + member;
      } else {
        groups += rank == 0 ? (groups.empty() ? "" : ";") + ("g" + std::to_string(group)) + "=" + member : "," + member;
      }
    }
    std::vector<std::string> argv = {BinDir() + "/penumbra-coordinator",
                                     "--model",
                                     o_.model,
                                     "--workers",
                                     list,
                                     "--port",
                                     std::to_string(port),
                                     "--metrics-port",
                                     "0",
                                     "--port-file",
                                     pf,
                                     "--health-interval-ms",
                                     "200"};
    if (!groups.empty()) argv.insert(argv.end(), {"--groups", groups});
    if (!o_.api_keys_yaml.empty()) {
      std::ofstream(dir_ + "/keys.yaml") << o_.api_keys_yaml;
      argv.insert(argv.end(), {"--api-keys", dir_ + "/keys.yaml"});
    }
    if (!o_.tenants_yaml.empty()) {
      if (!std::filesystem::exists(tenants_path())) std::ofstream(tenants_path()) << o_.tenants_yaml;
      argv.insert(argv.end(), {"--tenants", tenants_path()});
    }
    if (o_.tls) {
      for (const auto& f : TlsFlags(certs_dir(), "coordinator")) argv.push_back(f);
    }
    argv.insert(argv.end(), o_.coordinator_flags.begin(), o_.coordinator_flags.end());
    argv.insert(argv.end(), flags.begin(), flags.end());
    coordinator_.process = Process::Start(argv, dir_ + "/coordinator.log");
    return WaitServing(coordinator_, pf);
  }

  // A client of the public API (under TLS: checking the CA; `cert` names a
  // client certificate of certs_dir() to present, "" none).
  std::unique_ptr<client::Client> Client(const std::string& api_key = "", const std::string& cert = "") {
    client::ClientOptions o;
    o.port = coordinator_.port;
    o.api_key = api_key;
    if (o_.tls) {
      o.tls_ca = certs_dir() + "/ca.pem";
      if (!cert.empty()) {
        o.tls_cert = certs_dir() + "/" + cert + ".pem";
        o.tls_key = certs_dir() + "/" + cert + ".key";
      }
    }
    auto c = client::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // A direct control-API connection to worker i (under TLS with the
  // certificate `cert` of certs_dir(): the coordinator's by default).
  std::unique_ptr<transport::ThriftClient<rpc::WorkerClient>> WorkerClient(int i,
                                                                           const std::string& cert = "coordinator") {
    std::shared_ptr<const transport::TlsClientContext> tls;
    if (o_.tls) {
      transport::TlsClientOptions t;
      t.files = {certs_dir() + "/ca.pem", certs_dir() + "/" + cert + ".pem", certs_dir() + "/" + cert + ".key"};
      t.server_roles = {transport::role::kWorker};
      auto ctx = transport::TlsClientContext::Create(t);
      EXPECT_TRUE(ctx.ok()) << ctx.status();
      if (!ctx.ok()) return nullptr;
      tls = *ctx;
    }
    auto c = transport::ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", workers_[i].port,
                                                                 std::chrono::seconds(30), {}, tls);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  rpc::WorkerStats WorkerStats(int i) {
    rpc::WorkerStats s;
    auto c = WorkerClient(i);
    if (c) (*c)->Stats(s);
    return s;
  }
  Served& worker(int i) { return workers_[i]; }
  Served& coordinator() { return coordinator_; }
  const std::string& dir() const { return dir_; }
  std::string certs_dir() const { return dir_ + "/certs"; }
  std::string tenants_path() const { return dir_ + "/tenants.yaml"; }
  const std::string& model() const { return o_.model; }
  // The options of the processes started from now on (e.g. worker flags
  // naming a store node started after the certificates were made).
  ClusterOptions& options() { return o_; }

 private:
  std::vector<Served*> all() {
    std::vector<Served*> v;
    for (auto& w : workers_) v.push_back(&w);
    v.push_back(&coordinator_);
    return v;
  }
  ClusterOptions o_;
  std::string dir_;
  std::vector<Served> workers_;
  Served coordinator_;
};

}  // namespace penumbra::testing
