// The Thrift planes and the admin endpoint under attack (issue 37), with real
// penumbra-worker and penumbra-coordinator processes on loopback: every
// caller without the right certificate is refused during the handshake,
// clients refuse servers that are not who they should be, plaintext ports
// off loopback are refused, floods of idle connections do not delay
// authenticated calls, and the worker's handles are useless to anyone but
// their owner.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <prometheus/counter.h>

#include "common/crypto.h"
#include "common/process.h"
#include "tests/service/service_cluster.h"
#include "transport/certs.h"
#include "transport/metrics_http.h"
#include "transport/thrift_util.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

rpc::GenerateRequest Ask(const std::vector<int32_t>& question, int max_new) {
  rpc::GenerateRequest r;
  r.__set_token_ids(question);
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  return r;
}

// A TCP connection to 127.0.0.1:port from `source` (any loopback address)
// that sends nothing; -1 when it cannot connect.
int IdleConnection(int port, const std::string& source = "127.0.0.1") {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in src{};
  src.sin_family = AF_INET;
  inet_pton(AF_INET, source.c_str(), &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

struct Connections {
  std::vector<int> fds;
  ~Connections() {
    for (int fd : fds) ::close(fd);
  }
  void Open(int port, int n, const std::string& source = "127.0.0.1") {
    for (int i = 0; i < n; ++i) {
      const int fd = IdleConnection(port, source);
      ASSERT_GE(fd, 0) << "connection " << i << " to port " << port << ": " << std::strerror(errno);
      fds.push_back(fd);
    }
  }
  // How many the server has closed (read() sees the end) within `wait`.
  int ClosedByServer(std::chrono::milliseconds wait) const {
    const auto until = Clock::now() + wait;
    std::vector<bool> closed(fds.size(), false);
    int n = 0;
    while (Clock::now() < until) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (closed[i]) continue;
        pollfd p{fds[i], POLLIN, 0};
        if (::poll(&p, 1, 0) == 1) {
          char c;
          if (::recv(fds[i], &c, 1, MSG_DONTWAIT) <= 0) {
            closed[i] = true;
            ++n;
          }
        }
      }
      std::this_thread::sleep_for(20ms);
    }
    return n;
  }
};

// A control-API client of the worker at `port` with certificate `cert`
// (files in `dir`; "" presents none) trusting the CA in `ca_dir`; the
// status of a Stats call through it.
Status WorkerStatsAs(int port, const std::string& dir, const std::string& cert, const std::string& ca_dir = "") {
  transport::TlsClientOptions t;
  t.files.ca_file = (ca_dir.empty() ? dir : ca_dir) + "/ca.pem";
  if (!cert.empty()) {
    t.files.cert_file = dir + "/" + cert + ".pem";
    t.files.key_file = dir + "/" + cert + ".key";
  }
  t.server_roles = {transport::role::kWorker};
  PENUMBRA_ASSIGN_OR_RETURN(auto tls, transport::TlsClientContext::Create(t));
  PENUMBRA_ASSIGN_OR_RETURN(auto c,
                            transport::ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", port, 10s, {}, tls));
  rpc::WorkerStats st;
  return transport::CallRpc("stats", [&] { (*c)->Stats(st); });
}

Status Issue(const std::string& dir, const std::string& role, const std::string& name, long not_before_s = -300,
             int days = 30, std::vector<std::string> hosts = {"127.0.0.1", "localhost"}) {
  transport::CertificateSpec s;
  s.role = role;
  s.name = name;
  s.hosts = std::move(hosts);
  s.days = days;
  s.not_before_offset_s = not_before_s;
  return transport::IssueCertificate(dir + "/ca.pem", dir + "/ca.key", s, dir + "/" + name + ".pem",
                                     dir + "/" + name + ".key");
}

TEST(TlsPlanes, TheWorkerControlApiTakesOnlyCoordinatorCertificatesOfItsCa) {
  ClusterOptions o;
  o.tls = true;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  const std::string dir = cluster.certs_dir();
  const int port = cluster.worker(0).port;
  // Another CA's certificate of the right role; an expired one of ours.
  const std::string other = cluster.dir() + "/other-ca";
  ASSERT_TRUE(MakeCertificates(other, 1));
  ASSERT_TRUE(Issue(dir, transport::role::kCoordinator, "expired", -10 * 86400, 1).ok());

  EXPECT_TRUE(WorkerStatsAs(port, dir, "coordinator").ok());
  for (const auto& [who, status] : std::vector<std::pair<std::string, Status>>{
           {"no certificate", WorkerStatsAs(port, dir, "")},
           {"a client's certificate", WorkerStatsAs(port, dir, "client")},
           {"an admin's certificate", WorkerStatsAs(port, dir, "admin")},
           {"another worker's certificate", WorkerStatsAs(port, dir, "w1")},
           {"an expired coordinator certificate", WorkerStatsAs(port, dir, "expired")},
           {"another CA's coordinator certificate", WorkerStatsAs(port, other, "coordinator", dir)}}) {
    EXPECT_FALSE(status.ok()) << who << " was let in";
  }
  // Plaintext to the TLS port: nothing comes back.
  auto plain = transport::ThriftClient<rpc::WorkerClient>::Connect("127.0.0.1", port, 5s);
  if (plain.ok()) {
    rpc::WorkerStats st;
    EXPECT_FALSE(transport::CallRpc("stats", [&] { (**plain)->Stats(st); }).ok());
  }
  // Still serving its coordinator.
  EXPECT_TRUE(WorkerStatsAs(port, dir, "coordinator").ok());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto r = c->Complete(Ask({1, 5, 6, 7}, 4));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->usage.generated_tokens, 4);
}

TEST(TlsPlanes, ClientsRefuseServersThatAreNotWhoTheyShouldBe) {
  ClusterOptions o;
  o.tls = true;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  const std::string dir = cluster.certs_dir();
  // A client trusting another CA does not talk to the coordinator.
  const std::string other = cluster.dir() + "/other-ca";
  ASSERT_TRUE(MakeCertificates(other, 1));
  client::ClientOptions co;
  co.port = cluster.coordinator().port;
  co.tls_ca = other + "/ca.pem";
  auto wrong_ca = client::Client::Connect(co);
  EXPECT_FALSE(wrong_ca.ok());
  // A plaintext client gets nothing from the TLS port.
  co.tls_ca.clear();
  auto plain = client::Client::Connect(co);
  if (plain.ok()) {
    EXPECT_FALSE((*plain)->Health().ok());
  }
  // The coordinator's port does not pass for a worker's (role checked).
  EXPECT_FALSE(WorkerStatsAs(cluster.coordinator().port, dir, "coordinator").ok());

  // A worker whose certificate does not name the address the coordinator
  // dials is not used (and the coordinator says why).
  ASSERT_TRUE(Issue(dir, transport::role::kWorker, "elsewhere", -300, 30, {"worker.example.invalid"}).ok());
  const std::string pf = cluster.dir() + "/elsewhere.port";
  Served w;
  w.process = Process::Start({BinDir() + "/penumbra-worker", "--model", cluster.model(), "--device", "cpu", "--port",
                              "0", "--metrics-port", "-1", "--port-file", pf, "--tls-ca", dir + "/ca.pem", "--tls-cert",
                              dir + "/elsewhere.pem", "--tls-key", dir + "/elsewhere.key"},
                             cluster.dir() + "/elsewhere.log");
  ASSERT_TRUE(WaitServing(w, pf));
  Served coord;
  const std::string cpf = cluster.dir() + "/coord2.port";
  std::vector<std::string> argv = {BinDir() + "/penumbra-coordinator",
                                   "--model",
                                   cluster.model(),
                                   "--workers",
                                   "w=127.0.0.1:" + std::to_string(w.port),
                                   "--port",
                                   "0",
                                   "--metrics-port",
                                   "-1",
                                   "--port-file",
                                   cpf};
  for (const auto& f : TlsFlags(dir, "coordinator")) argv.push_back(f);
  coord.process = Process::Start(argv, cluster.dir() + "/coord2.log");
  ASSERT_TRUE(WaitServing(coord, cpf));
  co.port = coord.port;
  co.tls_ca = dir + "/ca.pem";
  auto c = client::Client::Connect(co);
  ASSERT_TRUE(c.ok()) << c.status();
  auto stats = (*c)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->workers.size(), 1u);
  EXPECT_FALSE(stats->workers[0].healthy);
  ASSERT_TRUE(stats->workers[0].__isset.error);
  EXPECT_NE(stats->workers[0].error.find("does not name the host"), std::string::npos) << stats->workers[0].error;
  EXPECT_FALSE((*c)->Complete(Ask({1, 5, 6}, 2)).ok());
}

// A process started with `argv` exits with 2 and says `why` on stderr.
void ExpectRefusedAtStart(const std::vector<std::string>& argv, const std::string& log, const std::string& why) {
  auto p = Process::Start(argv, log);
  const auto rc = p->Wait(60s);
  ASSERT_TRUE(rc.has_value()) << argv[0] << " did not exit:\n" << p->Log();
  EXPECT_EQ(*rc, 2) << p->Log();
  EXPECT_NE(p->Log().find(why), std::string::npos) << p->Log();
}

TEST(TlsPlanes, PlaintextPortsOffLoopbackAreRefusedUnlessInsecure) {
  char tmpl[] = "/tmp/penumbra-plaintext-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string model = StoriesDir();
  ExpectRefusedAtStart({BinDir() + "/penumbra-worker", "--model", model, "--device", "cpu", "--host", "0.0.0.0"},
                       dir + "/w.log", "without TLS: refused");
  ExpectRefusedAtStart({BinDir() + "/penumbra-worker", "--model", model, "--device", "cpu", "--admin-host", "0.0.0.0"},
                       dir + "/wa.log", "without TLS: refused");
  ExpectRefusedAtStart(
      {BinDir() + "/penumbra-coordinator", "--model", model, "--workers", "127.0.0.1:1", "--host", "0.0.0.0"},
      dir + "/c.log", "without TLS: refused");
  ExpectRefusedAtStart({BinDir() + "/penumbra-coordinator", "--model", model, "--workers", "10.1.2.3:7710"},
                       dir + "/cw.log", "without TLS: refused");
  ExpectRefusedAtStart({BinDir() + "/penumbra-store", "--path", dir + "/store", "--host", "0.0.0.0"}, dir + "/s.log",
                       "without the cluster secret: refused");
  // --insecure lets it start, and says so loudly.
  Served w;
  w.process = Process::Start({BinDir() + "/penumbra-worker", "--model", model, "--device", "cpu", "--host", "0.0.0.0",
                              "--insecure", "--port", "0", "--metrics-port", "-1", "--port-file", dir + "/w.port"},
                             dir + "/wi.log");
  ASSERT_TRUE(WaitServing(w, dir + "/w.port"));
  EXPECT_NE(w.process->Log().find("INSECURE"), std::string::npos) << w.process->Log();
  w.process.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// The time one call takes.
template <typename F>
std::chrono::milliseconds Timed(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

TEST(TlsPlanes, AThousandIdleConnectionsPerPortLeaveAuthenticatedCallsServedWithinASecond) {
  RaiseFileLimit();  // this test holds 4,000 sockets
  ClusterOptions o;
  o.tls = true;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Complete(Ask({1, 5, 6, 7}, 4)).ok());  // warm: the model is loaded and has answered

  Connections flood;
  for (int port : {cluster.coordinator().port, cluster.worker(0).port, cluster.coordinator().metrics_port,
                   cluster.worker(0).metrics_port}) {
    flood.Open(port, 1000);
  }
  ASSERT_EQ(flood.fds.size(), 4000u);
  std::this_thread::sleep_for(300ms);  // the servers have accepted them and wait on each

  // A new client: TLS handshake and a whole (short) answer.
  Result<rpc::GenerateChunk> answer = Status::Internal("not run");
  const auto public_ms = Timed([&] {
    auto fresh = cluster.Client();
    if (fresh) answer = fresh->Complete(Ask({1, 5, 6, 7}, 4));
  });
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_LT(public_ms, 1000ms) << "the public API under 1,000 idle connections";
  Status worker_stats = Status::Internal("not run");
  const auto worker_ms =
      Timed([&] { worker_stats = WorkerStatsAs(cluster.worker(0).port, cluster.certs_dir(), "coordinator"); });
  EXPECT_TRUE(worker_stats.ok()) << worker_stats;
  EXPECT_LT(worker_ms, 1000ms) << "the control API under 1,000 idle connections";
  for (int port : {cluster.coordinator().metrics_port, cluster.worker(0).metrics_port}) {
    httplib::Client h("127.0.0.1", port);
    h.set_connection_timeout(5, 0);
    int status = -1;
    const auto ms = Timed([&] {
      auto res = h.Get("/metrics");
      status = res ? res->status : -1;
    });
    EXPECT_EQ(status, 200) << "admin port " << port;
    EXPECT_LT(ms, 1000ms) << "the admin endpoint " << port << " under 1,000 idle connections";
  }
}

TEST(TlsPlanes, OneAddressHoldsAtMostItsShareOfConnections) {
  ClusterOptions o;
  o.tls = true;
  o.coordinator_flags = {"--max-connections-per-peer", "64"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  // 200 idle connections from one address: the server keeps 64 and closes
  // the rest at once.
  Connections flood;
  flood.Open(cluster.coordinator().port, 200, "127.0.0.2");
  EXPECT_EQ(flood.ClosedByServer(5s), 136);  // accepted late (TCP_DEFER_ACCEPT), then closed
  // Another address is served meanwhile.
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->Complete(Ask({1, 5, 6}, 2)).ok());
}

TEST(TlsPlanes, AWorkerHandleIsUselessToAnyoneButTheCallerThatMadeIt) {
  ClusterOptions o;
  o.tls = true;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  const std::string dir = cluster.certs_dir();
  ASSERT_TRUE(Issue(dir, transport::role::kCoordinator, "coordinator2").ok());
  auto owner = cluster.WorkerClient(0);
  auto other = cluster.WorkerClient(0, "coordinator2");
  ASSERT_TRUE(owner && other);
  rpc::WorkerGenerateRequest g;
  g.prompt = {1, 5, 6, 7};
  g.max_new_tokens = 4;
  std::string handle;
  ASSERT_TRUE(transport::CallRpc("generate", [&] { (*owner)->Generate(handle, g); }).ok());
  EXPECT_EQ(handle.size(), 32u);
  rpc::TokenChunk ch;
  EXPECT_EQ(transport::CallRpc("poll", [&] { (*other)->Poll(ch, handle, 0, 0); }).code(), StatusCode::kNotFound);
  EXPECT_EQ(transport::CallRpc("cancel", [&] { (*other)->Cancel(handle); }).code(), StatusCode::kNotFound);
  EXPECT_EQ(transport::CallRpc("release", [&] { (*other)->Release(handle); }).code(), StatusCode::kNotFound);
  // Guessed handles find nothing, whatever their shape.
  for (const std::string& guess : {RandomHandle(), std::string("1"), std::string(""), handle.substr(0, 31) + "0"}) {
    if (guess == handle) continue;
    EXPECT_EQ(transport::CallRpc("poll", [&] { (*owner)->Poll(ch, guess, 0, 0); }).code(), StatusCode::kNotFound);
  }
  // The owner's handle works, and its request was never disturbed.
  int64_t got = 0;
  for (int i = 0; i < 100 && !ch.done; ++i) {
    ASSERT_TRUE(transport::CallRpc("poll", [&] { (*owner)->Poll(ch, handle, got, 2000); }).ok());
    got += static_cast<int64_t>(ch.ids.size());
  }
  EXPECT_TRUE(ch.done);
  EXPECT_EQ(ch.finish_reason, "length");
  EXPECT_EQ(got, 4);
  EXPECT_TRUE(transport::CallRpc("release", [&] { (*owner)->Release(handle); }).ok());
}

TEST(TlsPlanes, AHugeDrawsDoneIsRefusedAtOnce) {
  ClusterOptions o;
  o.tls = true;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto w = cluster.WorkerClient(0);
  ASSERT_TRUE(w);
  rpc::WorkerGenerateRequest g;
  g.prompt = {1, 5, 6, 7};
  g.max_new_tokens = 2;
  g.sampling.temperature = 0.7;
  std::string handle;
  for (int64_t draws : {int64_t{1} << 30, int64_t{1} << 62, int64_t{5}, int64_t{-1}}) {
    g.draws_done = draws;
    Status s = Status::OK();
    const auto ms = Timed([&] { s = transport::CallRpc("generate", [&] { (*w)->Generate(handle, g); }); });
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << draws;
    EXPECT_NE(s.message().find("draws_done"), std::string::npos) << s;
    EXPECT_LT(ms, 1000ms) << draws;
  }
  g.draws_done = 4;  // at most the prompt's tokens: a resumed request's
  EXPECT_TRUE(transport::CallRpc("generate", [&] { (*w)->Generate(handle, g); }).ok());
}

TEST(TlsPlanes, TheAdminEndpointOverTlsTakesOnlyAdminCertificates) {
  char tmpl[] = "/tmp/penumbra-admin-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  ASSERT_TRUE(MakeCertificates(dir, 1));
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter().Name("penumbra_test_total").Help("a test counter").Register(*registry).Add({}).Increment();
  transport::AdminHttpOptions ao;
  transport::TlsServerOptions t;
  t.files = {dir + "/ca.pem", dir + "/w0.pem", dir + "/w0.key"};
  t.require_client_certificate = true;
  t.client_roles = {transport::role::kAdmin};
  ao.tls = t;
  auto server = transport::MetricsServer::Start(registry, ao);
  ASSERT_TRUE(server.ok()) << server.status();
  auto get = [&](const std::string& cert) {
    std::unique_ptr<httplib::SSLClient> h;
    if (cert.empty()) {
      h = std::make_unique<httplib::SSLClient>("127.0.0.1", (*server)->port());
    } else {
      h = std::make_unique<httplib::SSLClient>("127.0.0.1", (*server)->port(), dir + "/" + cert + ".pem",
                                               dir + "/" + cert + ".key");
    }
    h->set_ca_cert_path((dir + "/ca.pem").c_str());
    h->enable_server_certificate_verification(true);
    h->set_connection_timeout(5, 0);
    auto res = h->Get("/metrics");
    return res ? res->status : -1;
  };
  EXPECT_EQ(get("admin"), 200);
  EXPECT_EQ(get("client"), 403);
  EXPECT_EQ(get("coordinator"), 403);
  EXPECT_EQ(get(""), -1);  // no certificate: the handshake fails
  httplib::Client plain("127.0.0.1", (*server)->port());
  plain.set_connection_timeout(5, 0);
  auto res = plain.Get("/metrics");
  EXPECT_TRUE(!res || res->status != 200);
  EXPECT_EQ(get("admin"), 200);  // still serving
  (*server)->Stop();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace penumbra::testing
