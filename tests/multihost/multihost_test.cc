// The service across hosts (issue 37), CTest label `multihost`: a
// coordinator, two workers and two value-store nodes, each in a network
// namespace of its own with its own address on one bridge
// (tests/multihost/netns_topology.h), and a client in a sixth. Mutual TLS
// between the coordinator and the workers, the cluster secret on the store
// plane, the public API over TLS with a tenant's key, the admin endpoints
// on each host's address over TLS (role admin); certificates made by
// `penumbra cert init` from a topology naming each host's address, as an
// operator makes them.
//
// It proves, in order: answers about documents equal the offline engine's
// (the C++ client and the `penumbra doc put`/`ask` CLI); every process runs
// in its own namespace and listens on its own address only, none in the
// namespace the test started in; a worker whose link goes down while it
// generates has its request resumed on the other, whose tokens are the
// engine's; a store node whose link goes down costs only the reuse of its
// documents (they are prefilled again, the other node's are attached) and
// no answer changes; both links back up, the worker serves again.
//
// A GoogleTest rather than a script: answers are compared with the offline
// engine token by token and the resumed request's split point is read from
// the worker's counters, as the loopback service tests do
// (tests/service/service_test.cc), with the same process helpers; the
// namespaces' cleanup runs in a watchdog process (netns_topology.h) that
// outlives even a SIGKILL of the test.
//
// Skipped, with a one-line reason, where namespaces cannot be made (not
// root, no iproute2, a kernel or container that refuses them).
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "tests/multihost/netns_topology.h"
#include "tests/service/service_calls.h"
#include "tests/service/service_cluster.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kSubnet = "10.77.37";
constexpr const char* kCachedDocuments = "penumbra_worker_documents_cached";

// UCX on the store plane, kept to each host's interface. Without
// UCX_NET_DEVICES, UCX opens a TCP listener of its own on every interface,
// loopback included (the listener check below fails). UCX_TLS=tcp pins the
// transport: UCX 1.13 chose TCP between these namespaces anyway (its
// shared-memory transports are opened but were not used for a peer reached
// by address), but UCX decides that shared memory reaches a peer by the
// machine and the IPC and PID namespaces, never the network one: a UCX that
// used it would carry the store plane past the namespaces, and a store
// node's link going down would prove nothing.
const std::vector<std::string> kUcxEnv = {"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0"};

rpc::GenerateRequest Ask(const std::string& doc, const std::vector<int32_t>& question, int max_new) {
  rpc::GenerateRequest r;
  r.document_ids = {doc};
  r.__set_token_ids(question);
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  r.deadline_ms = 180000;  // bounds Complete too (the client waits for the deadline and a margin)
  return r;
}

std::string Csv(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

// Data bytes a store node holds: RocksDB's write-ahead logs and tables in
// its directory (the info LOG excluded). Grows when a document is stored.
int64_t StoredBytes(const std::string& dir) {
  int64_t n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string ext = e.path().extension();
    if (ext != ".log" && ext != ".sst") continue;
    std::error_code sec;
    const auto size = e.file_size(sec);
    if (!sec) n += static_cast<int64_t>(size);
  }
  return n;
}

// GET `path` from an admin endpoint over TLS with the admin certificate.
Result<std::string> AdminGet(const std::string& host, int port, const std::string& certs, const std::string& path) {
  httplib::SSLClient cli(host, port, certs + "/admin.pem", certs + "/admin.key");
  cli.set_ca_cert_path((certs + "/ca.pem").c_str());
  cli.enable_server_certificate_verification(true);
  cli.set_connection_timeout(5, 0);
  cli.set_read_timeout(10, 0);
  auto r = cli.Get(path);
  if (!r) return Status::Unavailable(host + ":" + std::to_string(port) + path + ": " + httplib::to_string(r.error()));
  if (r->status != 200) return Status::Internal(path + ": HTTP " + std::to_string(r->status) + ": " + r->body);
  return r->body;
}

// The value of metric `name` (with its labels, as the page writes them:
// name{label="value"}) in a Prometheus text page; -1 if absent.
double Metric(const std::string& page, const std::string& name) {
  std::stringstream ss(page);
  std::string line;
  while (std::getline(ss, line)) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  return -1;
}

class Multihost : public StoriesTest {
 protected:
  void SetUp() override {
    StoriesTest::SetUp();
    if (HasFatalFailure()) return;
    const std::string why = NetnsTopology::CannotCreate();
    if (!why.empty()) GTEST_SKIP() << why;
    const int left = NetnsTopology::RemoveLeftovers();
    if (left > 0) std::cerr << "removed " << left << " network namespaces left by an earlier run\n";
  }
};

TEST_F(Multihost, FiveHostsWithMutualTlsAnswerAndSurviveLinksGoingDown) {
  const auto test_start = Clock::now();
  char tmpl[] = "/tmp/penumbra-multihost-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  // co: coordinator; w0, w1: workers; s0, s1: store nodes; cl: the client.
  auto made =
      NetnsTopology::Create(kSubnet, {{"co", 1}, {"w0", 11}, {"w1", 12}, {"s0", 21}, {"s1", 22}, {"cl", 100}}, dir);
  ASSERT_TRUE(made.ok()) << made.status();
  NetnsTopology& net = **made;
  const std::string bin = BinDir(), model = StoriesDir(), certs = dir + "/certs";

  // Certificates as an operator makes them: each names its host's address.
  {
    std::ofstream t(dir + "/topology.yaml");
    t << "model: " << model << "\ncoordinator:\n  host: " << net.Address("co") << "\n  port: 0\nworkers:\n";
    for (const char* w : {"w0", "w1"}) t << "  - name: " << w << "\n    host: " << net.Address(w) << "\n";
    t << "store_nodes:\n";
    for (const char* s : {"s0", "s1"}) {
      t << "  - name: " << s << "\n    host: " << net.Address(s) << "\n    path: " << dir << "/" << s << "\n";
    }
  }
  const CommandResult init =
      RunCommand({bin + "/penumbra", "cert", "init", certs, "--topology", dir + "/topology.yaml"});
  ASSERT_EQ(init.code, 0) << init.output;
  // One tenant, its key in a file only the test reads, its hash in the
  // tenants file.
  const std::string key = "multihost-" + RandomHandle();
  const Sha256Digest digest = Sha256(key);
  {
    std::ofstream(dir + "/tenants.yaml") << "tenants:\n  - name: acme\n    api_keys:\n      - sha256:"
                                         << HexOf({reinterpret_cast<const char*>(digest.data()), digest.size()})
                                         << "\n";
    std::ofstream(dir + "/api.key") << key;
    ::chmod((dir + "/api.key").c_str(), 0600);
  }

  std::map<std::string, Served> procs;  // by host
  struct LogsOnFailure {
    std::map<std::string, Served>& procs;
    ~LogsOnFailure() {
      if (!::testing::Test::HasFailure()) return;
      for (auto& [host, s] : procs) {
        if (s.process) std::cerr << "---- " << host << " log:\n" << s.process->Log() << "\n";
      }
    }
  } logs_on_failure{procs};
  auto start = [&](const std::string& host, std::vector<std::string> argv, const std::string& cert,
                   const std::vector<std::string>& env) {
    const std::string pf = dir + "/" + host + ".port";
    for (const auto& f : TlsFlags(certs, cert)) argv.push_back(f);
    argv.insert(argv.end(), {"--host", net.Address(host), "--port", "0", "--port-file", pf});
    procs[host].process = Process::Start(net.Exec(host, argv, env), dir + "/" + host + ".log");
    return WaitServing(procs[host], pf);
  };
  auto hostport = [&](const std::string& host) { return net.Address(host) + ":" + std::to_string(procs[host].port); };

  for (const char* s : {"s0", "s1"}) {
    ASSERT_TRUE(start(s, {bin + "/penumbra-store", "--path", dir + "/" + s}, s, kUcxEnv));
  }
  for (const char* w : {"w0", "w1"}) {
    ASSERT_TRUE(start(w,
                      {bin + "/penumbra-worker", "--model", model, "--device", "cpu", "--name", w, "--admin-host",
                       net.Address(w), "--metrics-port", "0", "--store-node", hostport("s0") + "," + hostport("s1")},
                      w, kUcxEnv));
  }
  ASSERT_TRUE(start("co",
                    {bin + "/penumbra-coordinator", "--model", model, "--workers",
                     "w0=" + hostport("w0") + ",w1=" + hostport("w1"), "--tenants", dir + "/tenants.yaml",
                     "--admin-host", net.Address("co"), "--metrics-port", "0", "--health-interval-ms", "200"},
                    "coordinator", {}));

  // From here on this thread is the client host: every connection it opens
  // (the C++ client's, the admin scrapes) starts there.
  auto in_client = ScopedNetns::Enter(net.NetnsFile("cl"));
  ASSERT_TRUE(in_client.ok()) << in_client.status();
  client::ClientOptions copt;
  copt.host = net.Address("co");
  copt.port = procs["co"].port;
  copt.api_key = key;
  copt.tls_ca = certs + "/ca.pem";
  auto connected = client::Client::Connect(copt);
  ASSERT_TRUE(connected.ok()) << connected.status();
  client::Client& c = **connected;
  auto worker_metric = [&](const std::string& w, const std::string& name) {
    Result<std::string> page = AdminGet(net.Address(w), procs[w].metrics_port, certs, "/metrics");
    EXPECT_TRUE(page.ok()) << page.status();
    return page.ok() ? Metric(*page, name) : -1.0;
  };
  Offline offline;

  // ---- Documents, spread over the workers and the store nodes ------------------
  // Put one at a time; the node that stores each is the one whose data
  // grows. Enough documents that the worker holding the first one (it will
  // lose its link) holds others on each node.
  struct Doc {
    std::vector<int32_t> ids;
    rpc::DocumentInfo info;
    std::string holder;  // the worker holding it (w0 or w1)
    int node = -1;       // the store node holding it (0 or 1)
  };
  std::vector<Doc> docs;
  auto covered = [&] {
    if (docs.size() < 4) return false;
    bool on[2] = {false, false};
    for (size_t i = 1; i < docs.size(); ++i) {
      if (docs[i].holder == docs[0].holder) on[docs[i].node] = true;
    }
    return on[0] && on[1];
  };
  for (int i = 0; i < 24 && !covered(); ++i) {
    Doc d;
    d.ids = LcgTokens(100, 500 + i, true);
    const int64_t before[2] = {StoredBytes(dir + "/s0"), StoredBytes(dir + "/s1")};
    const double cached[2] = {worker_metric("w0", kCachedDocuments), worker_metric("w1", kCachedDocuments)};
    auto put = c.PutDocument("d" + std::to_string(i), nullptr, &d.ids);
    ASSERT_TRUE(put.ok()) << put.status();
    ASSERT_EQ(put->state, rpc::DocumentState::READY) << (put->__isset.error ? put->error : "");
    d.info = *put;
    // The worker that factored it holds one more (its admin endpoint says).
    const double grown[2] = {worker_metric("w0", kCachedDocuments) - cached[0],
                             worker_metric("w1", kCachedDocuments) - cached[1]};
    ASSERT_EQ(grown[0] + grown[1], 1) << "document " << i;
    d.holder = grown[0] == 1 ? "w0" : "w1";
    // Its holder writes it to its node in the background: wait until one
    // node has grown and nothing has changed for a second.
    int64_t last[2] = {before[0], before[1]};
    auto quiet_since = Clock::now();
    for (const auto until = Clock::now() + 60s; Clock::now() < until;) {
      const int64_t now[2] = {StoredBytes(dir + "/s0"), StoredBytes(dir + "/s1")};
      if (now[0] != last[0] || now[1] != last[1]) quiet_since = Clock::now();
      last[0] = now[0];
      last[1] = now[1];
      const int64_t grew[2] = {now[0] - before[0], now[1] - before[1]};
      if ((grew[0] > 0 || grew[1] > 0) && Clock::now() - quiet_since >= 1s) {
        // A previous document's last bytes may land late: the node that grew
        // by far the most holds this one.
        const int big = grew[0] >= grew[1] ? 0 : 1;
        if (grew[1 - big] * 4 < grew[big]) d.node = big;
        break;
      }
      std::this_thread::sleep_for(100ms);
    }
    ASSERT_GE(d.node, 0) << "document " << i << " (on " << d.holder << "): no store node took it";
    docs.push_back(std::move(d));
  }
  ASSERT_TRUE(covered()) << docs.size() << " documents put and the first one's worker, " << docs[0].holder
                         << ", holds none of the others on one of the store nodes";
  std::cerr << "documents (worker/node):";
  for (const Doc& d : docs) std::cerr << " " << d.holder << "/s" << d.node;
  std::cerr << "\n";

  // Every answer is the engine's; the holder attaches its document.
  for (size_t i = 0; i < docs.size(); ++i) {
    const std::vector<int32_t> q = LcgTokens(8, 600 + i, false);
    auto r = c.Complete(Ask(docs[i].info.id, q, 8));
    ASSERT_TRUE(r.ok()) << "document " << i << ": " << r.status();
    EXPECT_EQ(r->ids, offline.About(docs[i].ids, q, 8)) << "document " << i;
    EXPECT_EQ(r->usage.cached_prompt_tokens, 100) << "document " << i;
  }

  // The operator's commands from the client host: `penumbra doc put` and
  // `penumbra ask`, over TLS with the key from a file.
  {
    const std::vector<std::string> conn = {"--address",       hostport("co"),   "--tls-ca",
                                           certs + "/ca.pem", "--api-key-file", dir + "/api.key"};
    auto json_of = [](const CommandResult& r) {
      const size_t at = r.output.rfind("\n{") == std::string::npos ? r.output.find('{') : r.output.rfind("\n{") + 1;
      return nlohmann::json::parse(r.output.substr(at == std::string::npos ? 0 : at), nullptr, false);
    };
    const std::vector<int32_t> doc = LcgTokens(90, 777, true), q = LcgTokens(6, 778, false);
    std::vector<std::string> put = {bin + "/penumbra", "doc", "put", "--ids", Csv(doc), "--name", "cli", "--json"};
    put.insert(put.end(), conn.begin(), conn.end());
    const CommandResult p = net.Run("cl", put);
    ASSERT_EQ(p.code, 0) << p.output;
    const nlohmann::json pj = json_of(p);
    ASSERT_TRUE(pj.is_object() && pj.contains("id")) << p.output;
    EXPECT_EQ(pj.value("state", ""), "ready") << p.output;
    std::vector<std::string> ask = {bin + "/penumbra", "ask",   "--docs",           pj["id"].get<std::string>(),
                                    "--question-ids",  Csv(q),  "--max-new-tokens", "10",
                                    "--ignore-eos",    "--json"};
    ask.insert(ask.end(), conn.begin(), conn.end());
    const CommandResult a = net.Run("cl", ask);
    ASSERT_EQ(a.code, 0) << a.output;
    const nlohmann::json aj = json_of(a);
    ASSERT_TRUE(aj.is_object() && aj.contains("text")) << a.output;
    // The same question through the C++ client: the engine's tokens, and
    // the CLI printed their text.
    auto r = c.Complete(Ask(pj["id"].get<std::string>(), q, 10));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->ids, offline.About(doc, q, 10));
    EXPECT_EQ(aj["text"].get<std::string>(), r->text);
    EXPECT_EQ(aj["usage"].value("cached_prompt_tokens", -1), 90) << a.output;
  }

  // ---- Traffic stays inside the namespaces the test made -----------------------
  {
    std::set<pid_t> ours;
    for (auto& [host, s] : procs) ours.insert(s.process->pid());
    for (auto& [host, s] : procs) {
      SCOPED_TRACE(host);
      const pid_t pid = s.process->pid();
      EXPECT_EQ(net.NamespaceOf(pid), net.Namespace(host));  // its own namespace...
      auto inside = net.Pids(host);
      ASSERT_TRUE(inside.ok()) << inside.status();
      EXPECT_EQ(*inside, std::set<pid_t>{pid});  // ...alone there
      auto ls = net.Listeners(host);
      ASSERT_TRUE(ls.ok()) << ls.status();
      bool serving_port = false;
      for (const Listener& l : *ls) {
        EXPECT_EQ(l.address, net.Address(host)) << "listens off its address: " << l.line;
        EXPECT_EQ(l.pids, std::set<pid_t>{pid}) << l.line;
        serving_port = serving_port || (l.port == s.port && l.protocol == "tcp");
      }
      EXPECT_TRUE(serving_port) << "its port " << s.port << " is not among its listeners";
    }
    auto root = net.Listeners("");
    ASSERT_TRUE(root.ok()) << root.status();
    for (const Listener& l : *root) {
      for (pid_t p : l.pids) EXPECT_EQ(ours.count(p), 0u) << "listens in the test's own namespace: " << l.line;
    }
    auto sockets = net.RootSockets();
    ASSERT_TRUE(sockets.ok()) << sockets.status();
    std::stringstream ss(*sockets);
    std::string line;
    const std::regex pid_re("pid=([0-9]+)");
    while (std::getline(ss, line)) {
      EXPECT_EQ(line.find(std::string(kSubnet) + "."), std::string::npos) << "the test's subnet outside: " << line;
      for (auto it = std::sregex_iterator(line.begin(), line.end(), pid_re); it != std::sregex_iterator(); ++it) {
        EXPECT_EQ(ours.count(static_cast<pid_t>(std::stol((*it)[1]))), 0u) << "a socket outside: " << line;
      }
    }
  }

  // ---- A worker's link goes down while it generates ------------------------------
  // A long seeded answer about the first document, on its holder; after 40
  // tokens the holder's cable is pulled. Nothing answers for it any more (no
  // reset, no error): the coordinator's call to it times out, it is marked
  // down, and the request goes on on the other worker from the tokens the
  // client has, its random stream where it was.
  const std::string lost = docs[0].holder, survivor = lost == "w0" ? "w1" : "w0";
  {
    const std::vector<int32_t> q = LcgTokens(8, 900, false);
    constexpr int kMaxNew = 380;  // 101 + 8 + 380 <= 512, the model's context
    rpc::GenerateRequest r = Ask(docs[0].info.id, q, kMaxNew);
    r.sampling.temperature = 0.8;
    r.sampling.top_k = 40;
    r.sampling.seed = 4242;
    const double submitted = worker_metric(lost, "penumbra_worker_requests_submitted_total");
    const double survivor_prompt = worker_metric(survivor, "penumbra_worker_prompt_tokens_total");
    auto id = c.Generate(r);
    ASSERT_TRUE(id.ok()) << id.status();
    std::vector<int32_t> seen;
    while (seen.size() < 40) {
      auto ch = c.Poll(*id, static_cast<int64_t>(seen.size()), 2000);
      ASSERT_TRUE(ch.ok()) << ch.status();
      ASSERT_FALSE(ch->done) << "finished before the link went down: " << ch->finish_reason;
      seen.insert(seen.end(), ch->ids.begin(), ch->ids.end());
    }
    auto lost_page = AdminGet(net.Address(lost), procs[lost].metrics_port, certs, "/metrics");
    ASSERT_TRUE(lost_page.ok()) << lost_page.status();
    EXPECT_EQ(Metric(*lost_page, "penumbra_worker_requests_submitted_total"), submitted + 1)
        << "the request is not on " << lost << ", the document's holder";
    const auto down = Clock::now();
    ASSERT_TRUE(net.SetLink(lost, false).ok());
    // (It may finish there meanwhile, unread: the coordinator knows only the
    // tokens the client polled, and resumes from those.)
    std::cerr << lost << "'s requests decoding just before its link went down: "
              << Metric(*lost_page, "penumbra_worker_requests_decoding") << "\n";
    rpc::GenerateChunk end;
    std::vector<int32_t> all = seen;
    int client_timeouts = 0;
    while (!end.done && Clock::now() - down < 180s) {
      auto ch = c.Poll(*id, static_cast<int64_t>(all.size()), 2000);
      // The coordinator forwards a poll to the request's worker with its
      // own timeout (the wait and 10 s, the client's margin too): a poll
      // that meets the unreachable worker may time out here first. A client
      // polls again (a poll names its offset: nothing is lost or repeated).
      if (!ch.ok() && ch.status().code() == StatusCode::kDeadlineExceeded && ++client_timeouts <= 3) continue;
      ASSERT_TRUE(ch.ok()) << ch.status();
      ASSERT_EQ(ch->offset, static_cast<int64_t>(all.size()));
      all.insert(all.end(), ch->ids.begin(), ch->ids.end());
      end = *ch;
    }
    ASSERT_TRUE(end.done) << "not finished 180 s after " << lost << "'s link went down";
    std::cerr << lost << "'s link down: the request finished on " << survivor << " after "
              << std::chrono::duration<double>(Clock::now() - down).count() << " s (" << client_timeouts
              << " polls timed out at the client meanwhile)\n";
    EXPECT_EQ(end.finish_reason, "length") << (end.__isset.error_message ? end.error_message : "");
    ASSERT_EQ(all.size(), static_cast<size_t>(kMaxNew));
    // Where it moved: the survivor's prompt was the document, the question
    // and the j tokens generated before.
    const int64_t j =
        static_cast<int64_t>(worker_metric(survivor, "penumbra_worker_prompt_tokens_total") - survivor_prompt) -
        static_cast<int64_t>(docs[0].ids.size() + q.size());
    ASSERT_GE(j, static_cast<int64_t>(seen.size()));
    ASSERT_LT(j, kMaxNew);
    SamplingOptions sampling;
    sampling.temperature = 0.8f;
    sampling.top_k = 40;
    sampling.seed = 4242;
    const std::vector<int32_t> uninterrupted = offline.About(docs[0].ids, q, kMaxNew, sampling);
    EXPECT_TRUE(std::equal(all.begin(), all.begin() + j, uninterrupted.begin())) << "the first worker's tokens";
    GenerationRequest resumed;
    resumed.prompt = docs[0].ids;
    resumed.document_ends = {static_cast<int64_t>(docs[0].ids.size())};
    resumed.prompt.insert(resumed.prompt.end(), q.begin(), q.end());
    resumed.prompt.insert(resumed.prompt.end(), all.begin(), all.begin() + j);
    resumed.max_new_tokens = kMaxNew - static_cast<int>(j);
    resumed.sampling = sampling;
    resumed.draws_done = j;
    const std::vector<int32_t> rest = offline.Answer(resumed);
    EXPECT_TRUE(std::equal(all.begin() + j, all.end(), rest.begin(), rest.end())) << "moved after " << j << " tokens";
    auto page = AdminGet(net.Address("co"), procs["co"].metrics_port, certs, "/metrics");
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_EQ(Metric(*page, "penumbra_coordinator_requests_resumed_total"), 1) << *page;
  }

  // ---- A store node's link goes down ---------------------------------------------
  // The lost worker's documents are now asked of the survivor, which has
  // never held them: one on the node still reachable is attached from it,
  // one on the node whose link is down is prefilled again; both answers are
  // the engine's.
  const Doc* on_down = nullptr;
  const Doc* on_up = nullptr;
  for (size_t i = 1; i < docs.size(); ++i) {
    if (docs[i].holder != lost) continue;
    if (!on_down) {
      on_down = &docs[i];
    } else if (!on_up && docs[i].node != on_down->node) {
      on_up = &docs[i];
    }
  }
  ASSERT_TRUE(on_down && on_up);
  const std::string down_node = "s" + std::to_string(on_down->node);
  ASSERT_TRUE(net.SetLink(down_node, false).ok());
  {
    const std::vector<int32_t> q = LcgTokens(8, 1000, false);
    auto r = c.Complete(Ask(on_up->info.id, q, 8));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->ids, offline.About(on_up->ids, q, 8));
    EXPECT_EQ(r->usage.cached_prompt_tokens, 100) << "not attached from the store node still reachable";
  }
  {
    const std::vector<int32_t> q = LcgTokens(8, 1001, false);
    const auto asked = Clock::now();
    auto r = c.Complete(Ask(on_down->info.id, q, 8));
    ASSERT_TRUE(r.ok()) << r.status();
    std::cerr << down_node << "'s link down: a question about a document on it answered (prefilled) after "
              << std::chrono::duration<double>(Clock::now() - asked).count() << " s\n";
    EXPECT_EQ(r->ids, offline.About(on_down->ids, q, 8));
    EXPECT_EQ(r->usage.cached_prompt_tokens, 0) << "attached from a store node whose link is down?";
  }

  // ---- Both links back up: the worker serves again --------------------------------
  ASSERT_TRUE(net.SetLink(lost, true).ok());
  ASSERT_TRUE(net.SetLink(down_node, true).ok());
  // (The coordinator's admin endpoint says which workers are up.)
  const std::string up = "penumbra_coordinator_worker_up{worker=\"" + lost + "\"}";
  bool back = false;
  for (const auto until = Clock::now() + 90s; !back && Clock::now() < until;) {
    auto page = AdminGet(net.Address("co"), procs["co"].metrics_port, certs, "/metrics");
    ASSERT_TRUE(page.ok()) << page.status();
    back = Metric(*page, up) == 1;
    if (!back) std::this_thread::sleep_for(250ms);
  }
  EXPECT_TRUE(back) << lost << " not up 90 s after its link came back";
  {
    const std::vector<int32_t> q = LcgTokens(8, 1100, false);
    auto r = c.Complete(Ask(docs[0].info.id, q, 8));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->ids, offline.About(docs[0].ids, q, 8));
  }
  std::cerr << "whole test: " << std::chrono::duration<double>(Clock::now() - test_start).count() << " s\n";
}

}  // namespace
}  // namespace penumbra::testing
