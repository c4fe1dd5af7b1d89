// Signals and supervision with real processes (issue 38, label `faults`):
// SIGHUP rereads the configuration of every process and stops nothing;
// `penumbra serve` passes SIGHUP on, restarts a child that was SIGKILLed on
// its old port, and SIGTERM still stops everything.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/hash.h"
#include "coordinator/tenants/tenants.h"
#include "store_node/store_node.h"
#include "tests/service/service_cluster.h"
#include "tests/worker/stories_shadowkv.h"
#include "transport/certs.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;

class Signals : public StoriesTest {};

const std::string kKeyA = "signals-tenant-a-key-0001";
const std::string kKeyB = "signals-tenant-b-key-0002";

// A tenants.yaml with one tenant per key.
std::string TenantsYaml(const std::vector<std::string>& keys) {
  std::string y = "tenants:\n";
  for (size_t i = 0; i < keys.size(); ++i) {
    Result<std::string> h = tenants::HashApiKey(keys[i]);
    EXPECT_TRUE(h.ok()) << h.status();
    y += "  - name: t" + std::to_string(i) + "\n    api_keys: [" + (h.ok() ? *h : "") + "]\n";
  }
  return y;
}

rpc::GenerateRequest Ask(int max_new, uint64_t seed) {
  rpc::GenerateRequest r;
  r.__set_token_ids(LcgTokens(8, seed, true));
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  return r;
}

// A client of the public API on `port` (TLS checking `certs`/ca.pem when set).
Result<std::unique_ptr<client::Client>> Connect(int port, const std::string& key, const std::string& certs = "") {
  client::ClientOptions o;
  o.port = port;
  o.api_key = key;
  if (!certs.empty()) o.tls_ca = certs + "/ca.pem";
  return client::Client::Connect(o);
}

// One generation of 4 tokens answered through a new connection.
Status Answered(int port, const std::string& key, const std::string& certs = "") {
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> c, Connect(port, key, certs));
  PENUMBRA_ASSIGN_OR_RETURN(rpc::GenerateChunk ch, c->Complete(Ask(4, 7)));
  if (ch.usage.generated_tokens != 4) {
    return Status::Internal("generated " + std::to_string(ch.usage.generated_tokens) + " tokens, not 4");
  }
  return Status::OK();
}

// Retries `f` (returning Status) every 100 ms until it succeeds or `timeout`;
// the last Status (tests/test_util.h Eventually waits on a bool).
template <typename F>
Status RetryUntilOk(F f, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  Status s = f();
  while (!s.ok() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(100ms);
    s = f();
  }
  return s;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Waits until `p`'s log holds `what` at least `n` times.
bool LogReaches(Process& p, const std::string& what, size_t n, std::chrono::milliseconds timeout = 10s) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (Count(p.Log(), what) < n) {
    if (std::chrono::steady_clock::now() >= until) {
      ADD_FAILURE() << p.name() << "'s log has not said '" << what << "' " << n << " times:\n" << p.Log();
      return false;
    }
    std::this_thread::sleep_for(50ms);
  }
  return true;
}

// A lone coordinator, worker and store node under TLS (tenants, mutual TLS to
// the worker, the store plane keyed by the cluster secret): SIGHUP to each
// stops nothing; the coordinator takes a tenant added to its file, and the
// certificate files are reread for new connections (a broken one keeps the
// old; a new one is what the next connection sees, while open connections
// keep theirs).
TEST_F(Signals, SighupReloadsALoneCoordinatorWorkerAndStoreNodeAndStopsNothing) {
  ClusterOptions o;
  o.tls = true;
  o.tenants_yaml = TenantsYaml({kKeyA});
  Cluster cluster(o);
  const std::string certs = cluster.certs_dir();
  Served node;
  node.process = Process::Start({BinDir() + "/penumbra-store", "--path", cluster.dir() + "/store", "--port-file",
                                 cluster.dir() + "/store.port", "--cluster-secret-file", certs + "/cluster.secret"},
                                cluster.dir() + "/store.log");
  ASSERT_TRUE(WaitServing(node, cluster.dir() + "/store.port"));
  cluster.options().worker_flags = {"--store-node", "127.0.0.1:" + std::to_string(node.port)};
  ASSERT_TRUE(cluster.Start());
  const int port = cluster.coordinator().port;
  ASSERT_TRUE(Answered(port, kKeyA, certs).ok());
  {
    auto b = Connect(port, kKeyB, certs);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->ListDocuments().status().code(), StatusCode::kPermissionDenied) << "key B before the reload";
  }

  // Tenant B added; SIGHUP to all three.
  std::ofstream(cluster.tenants_path()) << TenantsYaml({kKeyA, kKeyB});
  Process& coordinator = *cluster.coordinator().process;
  Process& worker = *cluster.worker(0).process;
  coordinator.Signal(SIGHUP);
  worker.Signal(SIGHUP);
  node.process->Signal(SIGHUP);
  ASSERT_TRUE(LogReaches(coordinator, "SIGHUP: tenants reloaded", 1));
  ASSERT_TRUE(LogReaches(coordinator, "SIGHUP: the public API's TLS files reloaded", 1));
  ASSERT_TRUE(LogReaches(worker, "SIGHUP: the control API's TLS files reloaded", 1));
  ASSERT_TRUE(LogReaches(*node.process, "penumbra-store: SIGHUP: nothing to reload", 1));
  EXPECT_TRUE(coordinator.running() && worker.running() && node.process->running()) << "SIGHUP stopped a process";
  Status b = Answered(port, kKeyB, certs);
  EXPECT_TRUE(b.ok()) << "tenant B after the reload: " << b;
  // The store node after its SIGHUP: a new plane connection (with the
  // secret) stores and reads a value.
  {
    transport::UcxClientOptions plane;
    Result<ClusterSecret> secret = ClusterSecret::Load(certs + "/cluster.secret");
    ASSERT_TRUE(secret.ok()) << secret.status();
    plane.secret = *secret;
    auto ds = transport::ConnectStoreNodes("127.0.0.1:" + std::to_string(node.port), plane);
    ASSERT_TRUE(ds.ok()) << ds.status();
    const Hash128 key = Hasher128().Update("after-sighup").Digest();
    Status put = (*ds)->Put(key, "", 1, {{"b", "stored after SIGHUP"}});
    ASSERT_TRUE(put.ok()) << put;
    auto got = (*ds)->Get(key);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ((*got)["b"], "stored after SIGHUP");
  }
  // The worker after its reload: a new mutual-TLS connection is served.
  auto wc = cluster.WorkerClient(0);
  ASSERT_TRUE(wc);
  rpc::WorkerStats ws;
  EXPECT_TRUE(transport::CallRpc("Stats", [&] { (*wc)->Stats(ws); }).ok());

  // A broken certificate file: the reload fails, the old one stays.
  auto open = Connect(port, kKeyA, certs);  // kept open across the next reloads
  ASSERT_TRUE(open.ok()) << open.status();
  const std::string pem = certs + "/coordinator.pem", key = certs + "/coordinator.key";
  std::filesystem::copy_file(pem, cluster.dir() + "/coordinator.pem.good");
  std::filesystem::copy_file(key, cluster.dir() + "/coordinator.key.good");
  std::ofstream(pem, std::ios::trunc) << "not a certificate\n";
  coordinator.Signal(SIGHUP);
  ASSERT_TRUE(LogReaches(coordinator, "TLS files not reloaded, the old ones stay", 1));
  EXPECT_TRUE(coordinator.running());
  b = Answered(port, kKeyB, certs);
  EXPECT_TRUE(b.ok()) << "after a failed reload: " << b;

  // A certificate naming only "localhost": after the reload a client dialling
  // 127.0.0.1 refuses the new one; the connection opened before still works.
  transport::CertificateSpec spec;
  spec.role = transport::role::kCoordinator;
  spec.name = "coordinator";
  spec.hosts = {"localhost"};
  ASSERT_TRUE(transport::IssueCertificate(certs + "/ca.pem", certs + "/ca.key", spec, pem, key).ok());
  coordinator.Signal(SIGHUP);
  ASSERT_TRUE(LogReaches(coordinator, "SIGHUP: the public API's TLS files reloaded", 2));
  auto refused = Connect(port, kKeyA, certs);
  EXPECT_FALSE(refused.ok()) << "a new connection still got the old certificate";
  if (!refused.ok()) {
    EXPECT_NE(refused.status().message().find("does not name the host '127.0.0.1'"), std::string::npos)
        << "refused, but not for the new certificate's hosts: " << refused.status();
  }
  auto kept = (*open)->Complete(Ask(3, 9));
  EXPECT_TRUE(kept.ok()) << "the connection opened before the reload: " << kept.status();

  // The good files back: new connections are served again.
  std::filesystem::copy_file(cluster.dir() + "/coordinator.pem.good", pem,
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(cluster.dir() + "/coordinator.key.good", key,
                             std::filesystem::copy_options::overwrite_existing);
  coordinator.Signal(SIGHUP);
  ASSERT_TRUE(LogReaches(coordinator, "SIGHUP: the public API's TLS files reloaded", 3));
  b = Answered(port, kKeyA, certs);
  EXPECT_TRUE(b.ok()) << "after the good files came back: " << b;
  EXPECT_TRUE(coordinator.running() && worker.running() && node.process->running());
}

// A coordinator on plain --api-keys: SIGHUP rereads the file (a key added is
// taken, a key removed is refused); a file that does not load keeps the keys
// in use.
TEST_F(Signals, SighupRereadsThePlainApiKeys) {
  ClusterOptions o;
  o.api_keys_yaml = "keys:\n  " + kKeyA + ": ta\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  const int port = cluster.coordinator().port;
  Process& coordinator = *cluster.coordinator().process;
  ASSERT_TRUE(Answered(port, kKeyA).ok());
  EXPECT_EQ(Answered(port, kKeyB).code(), StatusCode::kPermissionDenied);

  const std::string keys = cluster.dir() + "/keys.yaml";
  std::ofstream(keys, std::ios::trunc) << "keys:\n  " << kKeyB << ": tb\n";
  coordinator.Signal(SIGHUP);
  ASSERT_TRUE(LogReaches(coordinator, "SIGHUP: API keys reloaded", 1));
  Status b = Answered(port, kKeyB);
  EXPECT_TRUE(b.ok()) << "the key added: " << b;
  EXPECT_EQ(Answered(port, kKeyA).code(), StatusCode::kPermissionDenied) << "the key removed";

  std::ofstream(keys, std::ios::trunc) << "keys:\n  short: tc\n";  // under 16 bytes: refused
  coordinator.Signal(SIGHUP);
  ASSERT_TRUE(LogReaches(coordinator, "SIGHUP: API keys not reloaded, the old ones stay", 1));
  b = Answered(port, kKeyB);
  EXPECT_TRUE(b.ok()) << "after a failed reload: " << b;
  EXPECT_TRUE(coordinator.running());
}

// `penumbra serve` with a store node, a worker and a coordinator.
class Serve {
 public:
  Serve() {
    char tmpl[] = "/tmp/penumbra-signals-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  ~Serve() {
    if (::testing::Test::HasFailure()) {
      if (process_) std::cerr << "---- serve's log:\n" << process_->Log() << "\n";
      for (const char* n : {"coordinator", "w0", "s0"}) {
        std::ifstream f(dir_ + "/run/" + n + ".log");
        std::stringstream s;
        s << f.rdbuf();
        std::cerr << "---- " << n << ".log:\n" << s.str() << "\n";
      }
    }
    // serve SIGKILLed (a failed test) leaves its children: they go by pid.
    process_.reset();
    for (pid_t pid : pids_) kill(pid, SIGKILL);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool Start() {
    std::ofstream(tenants_path()) << TenantsYaml({kKeyA});
    std::ofstream(dir_ + "/service.yaml")
        << "model: " << StoriesDir() << "\n"
        << "tenants: " << tenants_path() << "\n"
        << "data_dir: " << dir_ << "/data\n"
        << "coordinator:\n  port: 0\n  metrics_port: -1\n  args: [\"--health-interval-ms\", \"200\"]\n"
        << "workers:\n  - name: w0\n    port: 0\n    metrics_port: -1\n    args: [\"--device\", \"cpu\"]\n"
        << "store_nodes:\n  - name: s0\n    port: 0\n    path: " << dir_ << "/s0\n";
    process_ = Process::Start(
        {BinDir() + "/penumbra", "serve", "--config", dir_ + "/service.yaml", "--run-dir", dir_ + "/run", "--port-file",
         port_file(), "--start-timeout-s", "50", "--restart-backoff-ms", "200", "--restart-backoff-max-ms", "1000"},
        dir_ + "/serve.log");
    Served s;
    s.process = std::move(process_);
    const bool ok = WaitServing(s, port_file(), 50s);
    process_ = std::move(s.process);
    if (ok) Remember();
    return ok;
  }
  // serve's port file.
  nlohmann::json State() {
    std::ifstream f(port_file());
    try {
      return nlohmann::json::parse(f);
    } catch (const std::exception&) {
      return nlohmann::json();
    }
  }
  // Waits until child `name` is serving after `restarts` restarts.
  bool WaitRestarted(const std::string& name, int restarts, std::chrono::milliseconds timeout = 30s) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      nlohmann::json j = State();
      if (j.contains("children") && j["children"].contains(name) && j["children"][name]["restarts"] == restarts &&
          j["children"][name]["state"] == "serving") {
        Remember();
        return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    ADD_FAILURE() << name << " not serving after restart " << restarts << ": " << State().dump();
    return false;
  }
  pid_t Pid(const std::string& name) { return State()["children"][name]["pid"].get<pid_t>(); }
  int Port(const std::string& name) { return State()["children"][name]["port"].get<int>(); }
  int port() { return State()["port"].get<int>(); }
  Process& process() { return *process_; }
  std::string tenants_path() const { return dir_ + "/tenants.yaml"; }
  std::string port_file() const { return dir_ + "/serve.json"; }
  std::string ChildLog(const std::string& name) const {
    std::ifstream f(dir_ + "/run/" + name + ".log");
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  // Every child pid seen (none may be left at the end).
  const std::vector<pid_t>& pids() const { return pids_; }

 private:
  void Remember() {
    nlohmann::json j = State();
    if (!j.contains("children")) return;
    for (const auto& [name, c] : j["children"].items()) {
      const pid_t pid = c["pid"].get<pid_t>();
      if (pid > 0 && std::find(pids_.begin(), pids_.end(), pid) == pids_.end()) pids_.push_back(pid);
    }
  }
  std::string dir_;
  std::unique_ptr<Process> process_;
  std::vector<pid_t> pids_;
};

bool Alive(pid_t pid) { return kill(pid, 0) == 0; }

// SIGHUP to serve reaches every child and stops none (a tenant added to the
// file takes effect); a SIGKILLed worker, then the coordinator, come back on
// their ports and the service answers again (serve's log says so); SIGTERM
// then stops everything.
TEST_F(Signals, ServePassesSighupOnAndRestartsKilledChildrenOnTheirPorts) {
  Serve serve;
  ASSERT_TRUE(serve.Start());
  const int port = serve.port();
  ASSERT_TRUE(Answered(port, kKeyA).ok());
  const pid_t w0 = serve.Pid("w0"), coordinator = serve.Pid("coordinator"), s0 = serve.Pid("s0");
  const int w0_port = serve.Port("w0"), s0_port = serve.Port("s0");
  ASSERT_GT(w0, 0);
  ASSERT_GT(w0_port, 0);

  // SIGHUP: passed on, nothing stops, tenant B is taken.
  std::ofstream(serve.tenants_path()) << TenantsYaml({kKeyA, kKeyB});
  serve.process().Signal(SIGHUP);
  ASSERT_TRUE(LogReaches(serve.process(), "serve: SIGHUP: passed to coordinator", 1));
  Status b = RetryUntilOk([&] { return Answered(port, kKeyB); }, 10s);
  EXPECT_TRUE(b.ok()) << "tenant B after SIGHUP to serve: " << b;
  for (const char* child : {"w0", "s0"}) {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (serve.ChildLog(child).find("SIGHUP: nothing to reload") == std::string::npos &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(50ms);
    }
    EXPECT_NE(serve.ChildLog(child).find("SIGHUP: nothing to reload"), std::string::npos) << serve.ChildLog(child);
  }
  EXPECT_TRUE(serve.process().running());
  EXPECT_TRUE(Alive(w0) && Alive(coordinator) && Alive(s0)) << "SIGHUP stopped a child";
  EXPECT_EQ(serve.State()["restarts"], 0) << serve.State().dump();

  // The worker SIGKILLed: restarted on its port, the service answers again.
  ASSERT_EQ(kill(w0, SIGKILL), 0);
  ASSERT_TRUE(serve.WaitRestarted("w0", 1));
  EXPECT_EQ(serve.Port("w0"), w0_port);
  EXPECT_NE(serve.Pid("w0"), w0);
  b = RetryUntilOk([&] { return Answered(port, kKeyA); }, 20s);
  EXPECT_TRUE(b.ok()) << "after the worker's restart: " << b;
  const std::string log = serve.process().Log();
  EXPECT_NE(log.find("serve: worker w0 (pid " + std::to_string(w0) + ") died: killed by signal 9"), std::string::npos)
      << log;
  EXPECT_NE(log.find("serve: worker w0 serving again on 127.0.0.1:" + std::to_string(w0_port)), std::string::npos)
      << log;
  EXPECT_NE(serve.ChildLog("w0").find("---- penumbra serve: restart 1 of w0"), std::string::npos);

  // The coordinator SIGKILLed: restarted with the same arguments and port
  // (tenant B, from the reread file, still gets in).
  ASSERT_EQ(kill(coordinator, SIGKILL), 0);
  ASSERT_TRUE(serve.WaitRestarted("coordinator", 1));
  EXPECT_EQ(serve.port(), port);
  b = RetryUntilOk([&] { return Answered(port, kKeyB); }, 20s);
  EXPECT_TRUE(b.ok()) << "after the coordinator's restart: " << b;
  EXPECT_NE(serve.process().Log().find("serve: coordinator coordinator (pid " + std::to_string(coordinator) +
                                       ") died: killed by signal 9"),
            std::string::npos)
      << serve.process().Log();
  EXPECT_EQ(serve.Pid("s0"), s0);
  EXPECT_EQ(serve.Port("s0"), s0_port);
  EXPECT_EQ(serve.State()["restarts"], 2) << serve.State().dump();

  // SIGTERM: everything stops, nothing is left.
  serve.process().Signal(SIGTERM);
  const std::optional<int> code = serve.process().Wait(45s);
  ASSERT_TRUE(code.has_value()) << "serve still running 45 s after SIGTERM";
  EXPECT_EQ(*code, 0);
  for (pid_t pid : serve.pids()) EXPECT_FALSE(Alive(pid)) << "pid " << pid << " left running";
  EXPECT_NE(serve.process().Log().find("serve: stopped"), std::string::npos);
}

// A child that keeps dying: each death restarts it after a doubling delay
// capped at --restart-backoff-max-ms, the fifth in a row is called a crash
// loop, and it is still retried (and serves again on its port) with the
// counts in serve's port file.
TEST_F(Signals, ServeKeepsRestartingAChildThatKeepsDyingWithACappedBackoff) {
  Serve serve;
  ASSERT_TRUE(serve.Start());
  const int s0_port = serve.Port("s0");
  for (int i = 1; i <= 5; ++i) {
    const pid_t pid = serve.Pid("s0");
    ASSERT_GT(pid, 0);
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    ASSERT_TRUE(serve.WaitRestarted("s0", i));
    EXPECT_EQ(serve.Port("s0"), s0_port);
  }
  const std::string log = serve.process().Log();
  // 200 ms doubling, capped at 1 s.
  for (const char* delay :
       {"restart 1 in 0.2 s", "restart 2 in 0.4 s", "restart 3 in 0.8 s", "restart 4 in 1.0 s", "restart 5 in 1.0 s"}) {
    EXPECT_NE(log.find(delay), std::string::npos) << delay << " missing:\n" << log;
  }
  EXPECT_NE(log.find("serve: store node s0 keeps crashing (5 deaths in a row"), std::string::npos) << log;
  EXPECT_EQ(serve.State()["children"]["s0"]["deaths_in_row"], 5) << serve.State().dump();
  EXPECT_EQ(serve.State()["restarts"], 5) << serve.State().dump();
  Status a = RetryUntilOk([&] { return Answered(serve.port(), kKeyA); }, 10s);
  EXPECT_TRUE(a.ok()) << "the service with its store node restarted five times: " << a;
  serve.process().Signal(SIGTERM);
  const std::optional<int> code = serve.process().Wait(45s);
  ASSERT_TRUE(code.has_value()) << "serve still running 45 s after SIGTERM";
  EXPECT_EQ(*code, 0);
  for (pid_t pid : serve.pids()) EXPECT_FALSE(Alive(pid)) << "pid " << pid << " left running";
}

}  // namespace
}  // namespace penumbra::testing
