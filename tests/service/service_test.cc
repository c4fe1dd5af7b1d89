// The service end to end with real processes on loopback (CPU backend,
// stories260K): penumbra-worker and penumbra-coordinator started by the test
// on ports the OS picks, driven through the C++ client (and raw sockets for
// bad frames). Each TEST is its own CTest (label `service`, see tests.cmake).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <httplib.h>

#include "tests/service/service_calls.h"
#include "tests/service/service_cluster.h"
#include "tests/worker/stories_shadowkv.h"
#include "transport/worker_documents.h"
#include "worker/engine/engine.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;

class Service : public StoriesTest {};

// 16 clients x 10 requests of mixed lengths, half of them about one of two
// documents put once: every answer equals the offline engine's for the same
// prompt (continuous batching, interleaved prefill and the document cache
// change no token).
TEST_F(Service, ConcurrentClientsGetTheOfflineAnswers) {
  Cluster cluster({});
  ASSERT_TRUE(cluster.Start());
  auto c0 = cluster.Client();
  ASSERT_TRUE(c0);
  const std::vector<int32_t> doc_a = LcgTokens(180, 11, true), doc_b = LcgTokens(97, 12, true);
  const std::string a = Put(*c0, "a", doc_a).id, b = Put(*c0, "b", doc_b).id;
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());

  struct Case {
    rpc::GenerateRequest req;
    GenerationRequest offline;
  };
  // Under a sanitizer fewer requests per client (their offline answers are
  // most of the instrumented cost); a multiple of 4, so every kind comes as
  // often.
  const int per_client = kUnderSanitizer ? 4 : 10;
  std::vector<std::vector<Case>> cases(16);
  for (int client = 0; client < 16; ++client) {
    for (int i = 0; i < per_client; ++i) {
      const uint64_t seed = 1000 + client * 10 + i;
      const int kind = (client + i) % 4;  // 0, 1: no document; 2: a; 3: b
      const int qlen = 5 + static_cast<int>(seed * 7 % 150);
      const int max_new = 3 + static_cast<int>(seed % 14);
      const std::vector<int32_t> q = LcgTokens(qlen, seed, kind < 2);
      Case c;
      c.req = Ask(kind == 2   ? std::vector<std::string>{a}
                  : kind == 3 ? std::vector<std::string>{b}
                              : std::vector<std::string>{},
                  q, max_new);
      if (kind == 1) {  // seeded sampling
        c.req.sampling.temperature = 0.8;
        c.req.sampling.top_k = 40;
        c.req.sampling.seed = static_cast<int64_t>(seed);
      }
      GenerationRequest& g = c.offline;
      if (kind >= 2) {
        g.prompt = kind == 2 ? doc_a : doc_b;
        g.document_ends = {static_cast<int64_t>(g.prompt.size())};
      }
      g.prompt.insert(g.prompt.end(), q.begin(), q.end());
      g.max_new_tokens = max_new;
      g.sampling.temperature = static_cast<float>(c.req.sampling.temperature);
      g.sampling.top_k = c.req.sampling.top_k;
      g.sampling.seed = static_cast<uint64_t>(c.req.sampling.seed);
      cases[client].push_back(std::move(c));
    }
  }
  std::vector<std::vector<rpc::GenerateChunk>> got(16);
  std::vector<std::thread> threads;
  for (int client = 0; client < 16; ++client) {
    threads.emplace_back([&, client] {
      auto c = cluster.Client();
      if (!c) return;
      for (auto& k : cases[client]) {
        // Streamed (Generate + Poll) and blocking (Complete), alternately.
        if (got[client].size() % 2 == 0) {
          auto id = c->Generate(k.req);
          EXPECT_TRUE(id.ok()) << id.status();
          if (!id.ok()) return;
          std::vector<int32_t> ids;
          rpc::GenerateChunk last = Follow(*c, *id, &ids);
          last.ids = ids;
          got[client].push_back(last);
        } else {
          auto r = c->Complete(k.req);
          EXPECT_TRUE(r.ok()) << r.status();
          got[client].push_back(r.ok() ? *r : rpc::GenerateChunk{});
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  Offline offline;
  int64_t cached = 0;
  for (int client = 0; client < 16; ++client) {
    ASSERT_EQ(got[client].size(), cases[client].size());
    for (size_t i = 0; i < cases[client].size(); ++i) {
      const Case& k = cases[client][i];
      const rpc::GenerateChunk& g = got[client][i];
      EXPECT_EQ(g.finish_reason, "length") << "client " << client << " request " << i;
      EXPECT_EQ(g.ids, offline.Answer(k.offline)) << "client " << client << " request " << i;
      EXPECT_EQ(g.usage.prompt_tokens, static_cast<int64_t>(k.offline.prompt.size()));
      EXPECT_EQ(g.usage.generated_tokens, k.offline.max_new_tokens);
      EXPECT_GE(g.usage.ttft_seconds, 0);
      if (!k.offline.document_ends.empty()) {
        EXPECT_EQ(g.usage.cached_prompt_tokens, k.offline.document_ends[0]) << "client " << client << " request " << i;
      }
      cached += g.usage.cached_prompt_tokens;
    }
  }
  EXPECT_EQ(cached, 16 * per_client / 4 * (180 + 97));
  const rpc::WorkerStats ws = cluster.WorkerStats(0);
  EXPECT_EQ(ws.failed, 0);
  EXPECT_GT(ws.decode_steps, 0);
}

// A request arriving while a long one decodes joins the running batch and
// finishes first.
TEST_F(Service, ARequestAdmittedMidDecodeFinishesBeforeAnEarlierLongOne) {
  Cluster cluster({});
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto long_id = c->Generate(Ask({}, LcgTokens(40, 1, true), 440));
  ASSERT_TRUE(long_id.ok()) << long_id.status();
  // Wait until it decodes.
  int64_t have = 0;
  while (have < 5) {
    auto ch = c->Poll(*long_id, have, 2000);
    ASSERT_TRUE(ch.ok()) << ch.status();
    ASSERT_FALSE(ch->done);
    have += static_cast<int64_t>(ch->ids.size());
  }
  auto c2 = cluster.Client();
  auto short_answer = c2->Complete(Ask({}, LcgTokens(30, 2, true), 4));
  ASSERT_TRUE(short_answer.ok()) << short_answer.status();
  EXPECT_EQ(short_answer->usage.generated_tokens, 4);
  auto still = c->Poll(*long_id, 0, 0);
  ASSERT_TRUE(still.ok());
  EXPECT_FALSE(still->done) << "the long request ended first (" << still->ids.size() << " tokens)";
  rpc::GenerateChunk last = Follow(*c, *long_id);
  EXPECT_EQ(last.usage.generated_tokens, 440);
  // They decoded together: fewer steps than one after the other.
  const rpc::WorkerStats ws = cluster.WorkerStats(0);
  EXPECT_LT(ws.decode_steps, 439 + 3);
}

// Two worker processes: documents spread over them, and the requests about a
// document go to the worker that holds it (its cached state attached there).
TEST_F(Service, RequestsAboutADocumentGoToTheWorkerHoldingIt) {
  ClusterOptions o;
  o.workers = 2;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  // Without authentication (this loopback setup) Stats shows the workers.
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->workers.size(), 2u);
  const std::vector<int32_t> doc_a = LcgTokens(200, 21, true), doc_b = LcgTokens(150, 22, true);
  const rpc::DocumentInfo a = Put(*c, "a", doc_a), b = Put(*c, "b", doc_b);
  ASSERT_NE(a.worker, b.worker) << "two documents on one worker while the other held none";
  const int wa = a.worker == "w0" ? 0 : 1, wb = 1 - wa;
  const rpc::WorkerStats before_a = cluster.WorkerStats(wa), before_b = cluster.WorkerStats(wb);
  for (int i = 0; i < 4; ++i) {
    auto r = c->Complete(Ask({a.id}, LcgTokens(12, 300 + i, false), 5));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->usage.cached_prompt_tokens, 200);
    auto s = c->Complete(Ask({b.id}, LcgTokens(12, 400 + i, false), 5));
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->usage.cached_prompt_tokens, 150);
  }
  const rpc::WorkerStats after_a = cluster.WorkerStats(wa), after_b = cluster.WorkerStats(wb);
  EXPECT_EQ(after_a.submitted - before_a.submitted, 4);
  EXPECT_EQ(after_b.submitted - before_b.submitted, 4);
  EXPECT_EQ(after_a.cached_prompt_tokens - before_a.cached_prompt_tokens, 4 * 200);
  EXPECT_EQ(after_b.cached_prompt_tokens - before_b.cached_prompt_tokens, 4 * 150);
  // Each worker says how many sequences of the model's longest context fit
  // and what stops the next one; the coordinator's Stats passes it on.
  for (int i = 0; i < 100; ++i) {
    auto s = c->Stats();
    ASSERT_TRUE(s.ok()) << s.status();
    if (s->workers[0].__isset.capacity_limit && s->workers[1].__isset.capacity_limit) break;
    std::this_thread::sleep_for(100ms);
  }
  auto with_capacity = c->Stats();
  ASSERT_TRUE(with_capacity.ok());
  for (const rpc::WorkerStatus& w : with_capacity->workers) {
    EXPECT_TRUE(w.__isset.capacity_limit) << w.name;
    EXPECT_GE(w.capacity_sequences, 1) << w.name;
    EXPECT_GT(w.capacity_context_tokens, 0) << w.name;
  }
  const rpc::WorkerStats capacity = cluster.WorkerStats(wa);
  EXPECT_FALSE(capacity.capacity_limit.empty());
  EXPECT_GT(capacity.sequence_device_bytes, 0);

  // The holder of a goes away: a's requests are served by the other worker
  // (prefilled there once, then cached there too).
  cluster.worker(wa).process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.worker(wa).process->Wait(10s).has_value());
  ASSERT_TRUE(
      Eventually([&] { return MarkedDown(*c, a.worker); }, 20s, "the health check to mark " + a.worker + " down"));
  for (int i = 0; i < 2; ++i) {
    auto r = c->Complete(Ask({a.id}, LcgTokens(12, 500 + i, false), 5));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->usage.cached_prompt_tokens, i == 0 ? 0 : 200);
  }
}

// Documents go to a worker that holds them by digest alone; a worker that
// lost one (restarted, its memory empty, no store) answers that it lacks it,
// and the coordinator sends the request again with the ids: the answer is
// the same, nothing fails.
TEST_F(Service, ARestartedWorkerIsSentTheDocumentsItLost) {
  ClusterOptions o;
  o.workers = 1;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  const std::vector<int32_t> doc = LcgTokens(180, 23, true);
  const rpc::DocumentInfo d = Put(*c, "d", doc);
  auto metric = [&](const std::string& series) { return MetricValue(cluster.coordinator().metrics_port, series); };
  const std::vector<int32_t> q = LcgTokens(12, 600, false);
  auto first = c->Complete(Ask({d.id}, q, 6));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->usage.cached_prompt_tokens, 180);
  EXPECT_EQ(metric("penumbra_coordinator_worker_documents_total{sent=\"digest\"}"), 1);
  EXPECT_EQ(metric("penumbra_coordinator_worker_documents_total{sent=\"ids\"}"), 0);

  const int port = cluster.worker(0).port;
  cluster.worker(0).process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.worker(0).process->Wait(10s).has_value());
  ASSERT_TRUE(Eventually([&] { return MarkedDown(*c, "w0"); }, 20s, "the health check to mark w0 down"));
  ASSERT_TRUE(cluster.StartWorker(0, port));
  ASSERT_TRUE(Eventually(
      [&] {
        auto s = c->Stats();
        return s.ok() && s->workers.size() == 1 && s->workers[0].healthy;
      },
      20s, "the coordinator to see the restarted worker"));
  auto again = c->Complete(Ask({d.id}, q, 6));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->ids, first->ids);
  EXPECT_EQ(again->usage.cached_prompt_tokens, 0);  // prefilled from the ids sent again
  EXPECT_EQ(metric("penumbra_coordinator_document_resends_total"), 1);
  EXPECT_EQ(metric("penumbra_coordinator_worker_documents_total{sent=\"ids\"}"), 1);
  // Captured again: by digest from now on.
  auto third = c->Complete(Ask({d.id}, LcgTokens(9, 601, false), 4));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->usage.cached_prompt_tokens, 180);
  EXPECT_EQ(metric("penumbra_coordinator_worker_documents_total{sent=\"digest\"}"), 3);
}

// Two workers keeping their documents on one value-store node (penumbra-store
// over UCX): the holder of a document is killed (SIGKILL), and the other
// worker answers about it from the node (attached, not prefilled) with the
// tokens the holder gave.
TEST_F(Service, ALostWorkersDocumentsComeBackFromTheStoreNode) {
  char tmpl[] = "/tmp/penumbra-store-node-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  Served node;
  node.process = Process::Start({BinDir() + "/penumbra-store", "--path", dir + "/db", "--port-file", dir + "/port"},
                                dir + "/store.log");
  ASSERT_TRUE(WaitServing(node, dir + "/port"));
  ClusterOptions o;
  o.workers = 2;
  o.worker_flags = {"--store-node", "127.0.0.1:" + std::to_string(node.port)};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  const std::vector<int32_t> doc = LcgTokens(200, 23, true);
  const rpc::DocumentInfo a = Put(*c, "a", doc);
  const int wa = a.worker == "w0" ? 0 : 1;
  auto before = c->Complete(Ask({a.id}, LcgTokens(12, 600, false), 8));
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->usage.cached_prompt_tokens, 200);
  // The holder's background write to the node has finished.
  ASSERT_TRUE(Eventually([&] { return cluster.WorkerStats(wa).documents_stored >= 1; }, 20s,
                         "the holder's write of the document to the node"));
  cluster.worker(wa).process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.worker(wa).process->Wait(10s).has_value());
  ASSERT_TRUE(
      Eventually([&] { return MarkedDown(*c, a.worker); }, 20s, "the health check to mark " + a.worker + " down"));
  auto after = c->Complete(Ask({a.id}, LcgTokens(12, 600, false), 8));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->usage.cached_prompt_tokens, 200);  // from the node, not prefilled
  EXPECT_EQ(after->ids, before->ids);
  const rpc::WorkerStats ws = cluster.WorkerStats(1 - wa);
  EXPECT_EQ(ws.cached_prompt_tokens, 200);
  node.process->Signal(SIGTERM);
  EXPECT_TRUE(node.process->Wait(20s).has_value());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// A coordinator, 2 workers and 2 value-store nodes over a sealed store plane
// (the cluster secret; documents spread over the nodes by rendezvous
// hashing): every answer equals the offline
// engine's; a store node killed (SIGKILL) while answers are being generated
// loses none of them; then the holder of every document is killed too, and
// questions about each document are answered by the other worker, from the
// surviving node (attached) or prefilled again (its node is gone), with the
// offline tokens every time.
TEST_F(Service, TwoStoreNodesAndTwoWorkersSurviveKills) {
  char tmpl[] = "/tmp/penumbra-store-nodes-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  // The store plane sealed with a cluster secret (nodes and workers hold it).
  const std::string secret = dir + "/cluster.secret";
  ASSERT_TRUE(ClusterSecret::Create(secret).ok());
  Served nodes[2];
  std::string list;
  for (int n = 0; n < 2; ++n) {
    const std::string d = dir + "/n" + std::to_string(n);
    std::filesystem::create_directories(d);
    nodes[n].process = Process::Start({BinDir() + "/penumbra-store", "--path", d + "/db", "--port-file", d + ".port",
                                       "--cluster-secret-file", secret},
                                      d + ".log");
    ASSERT_TRUE(WaitServing(nodes[n], d + ".port"));
    list += (n ? "," : "") + std::string("127.0.0.1:") + std::to_string(nodes[n].port);
  }
  ClusterOptions o;
  o.workers = 2;
  o.worker_flags = {"--store-node", list, "--cluster-secret-file", secret};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  Offline offline;
  struct Doc {
    std::vector<int32_t> ids;
    rpc::DocumentInfo info;
  };
  std::vector<Doc> docs(4);
  for (int i = 0; i < 4; ++i) {
    docs[i].ids = LcgTokens(150 + 10 * i, 40 + i, true);
    docs[i].info = Put(*c, "d" + std::to_string(i), docs[i].ids);
  }
  auto expected = [&](int i, const std::vector<int32_t>& q, int max_new) {
    GenerationRequest g;
    g.prompt = docs[i].ids;
    g.document_ends = {static_cast<int64_t>(g.prompt.size())};
    g.prompt.insert(g.prompt.end(), q.begin(), q.end());
    g.max_new_tokens = max_new;
    return offline.Answer(g);
  };
  // Long answers about every document; a node dies while they run.
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    auto id = c->Generate(Ask({docs[i].info.id}, LcgTokens(10, 700 + i, false), 300));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (const auto& id : ids) ASSERT_TRUE(c->Poll(id, 0, 5000).ok());
  nodes[0].process->Signal(SIGKILL);  // the puts' writes to it may be cut short too
  ASSERT_TRUE(nodes[0].process->Wait(10s).has_value());
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> got;
    rpc::GenerateChunk end = Follow(*c, ids[i], &got);
    EXPECT_EQ(end.finish_reason, "length") << "document " << i;
    EXPECT_EQ(got, expected(i, LcgTokens(10, 700 + i, false), 300)) << "document " << i;
  }
  // Every document's holder goes: the worker holding document 0, then the
  // questions (about all four) go to the survivor.
  const int lost = docs[0].info.worker == "w0" ? 0 : 1;
  cluster.worker(lost).process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.worker(lost).process->Wait(10s).has_value());
  ASSERT_TRUE(Eventually([&] { return MarkedDown(*c, docs[0].info.worker); }, 20s,
                         "the health check to mark " + docs[0].info.worker + " down"));
  for (int i = 0; i < 4; ++i) {
    const std::vector<int32_t> q = LcgTokens(8, 800 + i, false);
    auto r = c->Complete(Ask({docs[i].info.id}, q, 12));
    ASSERT_TRUE(r.ok()) << "document " << i << ": " << r.status();
    EXPECT_EQ(r->ids, expected(i, q, 12)) << "document " << i;
  }
  const rpc::WorkerStats survivor = cluster.WorkerStats(1 - lost);
  EXPECT_GE(survivor.finished, 4);
  nodes[1].process->Signal(SIGTERM);
  EXPECT_TRUE(nodes[1].process->Wait(20s).has_value());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// A worker killed (SIGKILL) in the middle of a generation: the coordinator
// moves the request to the other worker, which goes on from the tokens it
// had (its prompt then ends with them; its seeded random stream where it
// was). No request is lost and no token is wrong: the client's stream holds
// the first worker's tokens up to the move, then exactly what the engine
// generates from the prompt and those tokens.
TEST_F(Service, AWorkerLostMidGenerationIsResumedOnAnother) {
  ClusterOptions o;
  o.workers = 2;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  const std::vector<int32_t> prompt = LcgTokens(30, 88, true);
  rpc::GenerateRequest r = Ask({}, prompt, 480);
  r.sampling.temperature = 0.8;
  r.sampling.top_k = 40;
  r.sampling.seed = 4242;
  auto id = c->Generate(r);
  ASSERT_TRUE(id.ok()) << id.status();
  // Some tokens first, then the worker generating them goes.
  std::vector<int32_t> ids;
  int64_t offset = 0;
  while (ids.size() < 40) {
    auto ch = c->Poll(*id, offset, 2000);
    ASSERT_TRUE(ch.ok()) << ch.status();
    ASSERT_FALSE(ch->done) << "finished before the kill: " << ch->finish_reason;
    ids.insert(ids.end(), ch->ids.begin(), ch->ids.end());
    offset += static_cast<int64_t>(ch->ids.size());
  }
  int victim = -1;
  for (int w = 0; w < 2 && victim < 0; ++w) {
    if (cluster.WorkerStats(w).decoding > 0) victim = w;
  }
  ASSERT_GE(victim, 0);
  const int64_t before = cluster.WorkerStats(1 - victim).prompt_tokens;
  cluster.worker(victim).process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.worker(victim).process->Wait(10s).has_value());
  rpc::GenerateChunk end = Follow(*c, *id, nullptr);
  auto whole_stream = c->Poll(*id, 0, 0);
  ASSERT_TRUE(whole_stream.ok()) << whole_stream.status();
  const std::vector<int32_t> all = whole_stream->ids;  // the stream from 0
  EXPECT_EQ(end.finish_reason, "length") << (end.__isset.error_message ? end.error_message : "");
  ASSERT_EQ(all.size(), 480u);
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), all.begin()));  // what was streamed stays
  // Where it moved: the other worker's prompt was the prompt and j tokens.
  const int64_t j = cluster.WorkerStats(1 - victim).prompt_tokens - before - static_cast<int64_t>(prompt.size());
  ASSERT_GE(j, static_cast<int64_t>(ids.size()));
  ASSERT_LT(j, 480);
  Offline offline;
  GenerationRequest whole;
  whole.prompt = prompt;
  whole.max_new_tokens = 480;
  whole.sampling.temperature = 0.8f;
  whole.sampling.top_k = 40;
  whole.sampling.seed = 4242;
  const std::vector<int32_t> uninterrupted = offline.Answer(whole);
  EXPECT_TRUE(std::equal(all.begin(), all.begin() + j, uninterrupted.begin())) << "the first worker's tokens";
  GenerationRequest resumed = whole;
  resumed.prompt.insert(resumed.prompt.end(), all.begin(), all.begin() + j);
  resumed.max_new_tokens = 480 - static_cast<int>(j);
  resumed.draws_done = j;
  const std::vector<int32_t> rest = offline.Answer(resumed);
  EXPECT_TRUE(std::equal(all.begin() + j, all.end(), rest.begin(), rest.end())) << "moved after " << j << " tokens";
  auto cm = httplib::Client("127.0.0.1", cluster.coordinator().metrics_port).Get("/metrics");
  ASSERT_TRUE(cm);
  EXPECT_NE(cm->body.find("penumbra_coordinator_requests_resumed_total 1"), std::string::npos) << cm->body;
}

// Writes `bytes` to host:port and closes; true when the connection was made.
bool SendRaw(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return false;
  }
  (void)!write(fd, bytes.data(), bytes.size());
  // Read whatever comes back (nothing, or an exception frame) until closed.
  timeval tv{2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[4096];
  while (read(fd, buf, sizeof buf) > 0) {
  }
  close(fd);
  return true;
}

void ExpectCode(const Status& s, StatusCode code, const std::string& what) {
  EXPECT_EQ(s.code(), code) << what << ": " << s;
}

// Bad input on both ports: random bytes, truncated and oversized frames, and
// bad requests through the API: each refused (typed), the servers keep
// serving, and the stored document is intact.
TEST_F(Service, BadInputIsRefusedAndTheServersKeepServing) {
  ClusterOptions o;
  o.worker_flags = {"--max-frame-mb", "1"};
  o.coordinator_flags = {"--max-frame-mb", "1"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  const std::vector<int32_t> doc = LcgTokens(120, 31, true);
  const rpc::DocumentInfo d = Put(*c, "doc", doc);
  auto before = c->Complete(Ask({d.id}, LcgTokens(10, 32, false), 8));
  ASSERT_TRUE(before.ok()) << before.status();

  std::mt19937_64 rng(5);
  for (int port : {cluster.coordinator().port, cluster.worker(0).port}) {
    SCOPED_TRACE("port " + std::to_string(port));
    std::string junk(4096, '\0');
    for (char& ch : junk) ch = static_cast<char>(rng());
    EXPECT_TRUE(SendRaw(port, junk));                                                            // random bytes
    EXPECT_TRUE(SendRaw(port, std::string("\x00\x00\x01\x00", 4) + "abc"));                      // truncated frame
    EXPECT_TRUE(SendRaw(port, std::string("\x7f\xff\xff\xff", 4) + std::string(64, 'x')));       // 2 GiB frame
    EXPECT_TRUE(SendRaw(port, std::string("\x00\x20\x00\x00", 4) + std::string(1 << 16, 'x')));  // 2 MiB > limit
    // A well-framed message that is not a valid call.
    EXPECT_TRUE(SendRaw(port, std::string("\x00\x00\x00\x08", 4) + std::string("\x80\x01\x00\x01\x00\x00\x00\x05", 8)));
  }
  // A request over the frame limit through the client: refused, connection dropped.
  {
    auto big = cluster.Client();
    std::vector<int32_t> huge(400000, 5);
    auto r = big->Generate(Ask({}, huge, 4));
    EXPECT_FALSE(r.ok());
  }

  // Typed errors through the API.
  ExpectCode(c->Generate(Ask({"doc-0123456789abcdef"}, {5, 6}, 4)).status(), StatusCode::kNotFound, "unknown document");
  ExpectCode(c->Generate(Ask({"not-an-id"}, {5, 6}, 4)).status(), StatusCode::kNotFound, "malformed document id");
  ExpectCode(c->Generate(Ask({}, {}, 4)).status(), StatusCode::kInvalidArgument, "empty prompt");
  ExpectCode(c->Generate(Ask({}, LcgTokens(600, 3, true), 4)).status(), StatusCode::kInvalidArgument,
             "over-long prompt");
  ExpectCode(c->Generate(Ask({d.id}, LcgTokens(400, 3, false), 4)).status(), StatusCode::kInvalidArgument,
             "document + question over the context");
  ExpectCode(c->Generate(Ask({}, {5, 9999}, 4)).status(), StatusCode::kInvalidArgument, "id outside the vocabulary");
  ExpectCode(c->Generate(Ask({}, {5, -1}, 4)).status(), StatusCode::kInvalidArgument, "negative id");
  {
    auto r = Ask({}, {5, 6}, 4);
    r.sampling.temperature = -1;
    ExpectCode(c->Generate(r).status(), StatusCode::kInvalidArgument, "temperature -1");
    r.sampling.temperature = 0;
    r.sampling.top_p = 2;
    ExpectCode(c->Generate(r).status(), StatusCode::kInvalidArgument, "top_p 2");
    r.sampling.top_p = 1;
    r.max_new_tokens = 0;
    ExpectCode(c->Generate(r).status(), StatusCode::kInvalidArgument, "max_new_tokens 0");
    r.max_new_tokens = 4;
    r.kv_policy = "nonsense";
    ExpectCode(c->Generate(r).status(), StatusCode::kInvalidArgument, "kv_policy");
    r.kv_policy = "shadowkv";
    ExpectCode(c->Generate(r).status(), StatusCode::kUnavailable, "no worker of that policy");
    r.kv_policy = "";
    r.stop = {""};
    ExpectCode(c->Generate(r).status(), StatusCode::kInvalidArgument, "empty stop string");
    r.stop = {};
    r.__set_text("a question");
    ExpectCode(c->Generate(r).status(), StatusCode::kInvalidArgument, "both text and token ids");
    rpc::GenerateRequest empty_text;
    empty_text.__set_text("");
    ExpectCode(c->Generate(empty_text).status(), StatusCode::kInvalidArgument, "empty text");
  }
  ExpectCode(c->Poll("req-0000000000000000", 0, 10).status(), StatusCode::kNotFound, "unknown request");
  {
    auto id = c->Generate(Ask({}, {5, 6, 7}, 4));
    ASSERT_TRUE(id.ok());
    ExpectCode(c->Poll(*id, 99, 10).status(), StatusCode::kInvalidArgument, "offset past the tokens");
    ExpectCode(c->Poll(*id, 0, 600000).status(), StatusCode::kInvalidArgument, "wait_ms too long");
    Follow(*c, *id);
  }
  ExpectCode(c->PutDocument("", nullptr, &doc).status(), StatusCode::kInvalidArgument, "empty name");
  {
    const std::vector<int32_t> empty;
    ExpectCode(c->PutDocument("e", nullptr, &empty).status(), StatusCode::kInvalidArgument, "empty document");
    const std::vector<int32_t> too_long = LcgTokens(512, 3, true);
    ExpectCode(c->PutDocument("l", nullptr, &too_long).status(), StatusCode::kInvalidArgument, "document too long");
    const std::string text = "stories260K has no tokenizer.json";
    ExpectCode(c->PutDocument("t", &text, nullptr).status(), StatusCode::kInvalidArgument, "text without tokenizer");
  }
  {
    rpc::ListDocumentsRequest r;
    r.page_token = "garbage";
    rpc::DocumentList out;
    auto raw = transport::ThriftClient<rpc::PenumbraClient>::Connect("127.0.0.1", cluster.coordinator().port, 10s);
    ASSERT_TRUE(raw.ok());
    ExpectCode(transport::CallRpc("list", [&] { (**raw)->ListDocuments(out, r); }), StatusCode::kInvalidArgument,
               "bad page token");
    r.page_token = "";
    r.page_size = 0;
    ExpectCode(transport::CallRpc("list", [&] { (**raw)->ListDocuments(out, r); }), StatusCode::kInvalidArgument,
               "page size 0");
  }
  // The worker's own control API refuses bad requests too.
  {
    auto w = cluster.WorkerClient(0);
    ASSERT_TRUE(w);
    rpc::WorkerGenerateRequest g;
    transport::SetPrompt(&g, {5, 6}, {5});
    std::string handle;
    ExpectCode(transport::CallRpc("generate", [&] { (*w)->Generate(handle, g); }), StatusCode::kInvalidArgument,
               "document end past the prompt");
    rpc::TokenChunk ch;
    ExpectCode(transport::CallRpc("poll", [&] { (*w)->Poll(ch, "0123456789abcdef0123456789abcdef", 0, 0); }),
               StatusCode::kNotFound, "unknown worker request");
  }

  // Still serving, the document intact: the same answer as before.
  auto after = c->Complete(Ask({d.id}, LcgTokens(10, 32, false), 8));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->ids, before->ids);
  EXPECT_EQ(after->usage.cached_prompt_tokens, 120);
  auto docs = c->ListDocuments();
  ASSERT_TRUE(docs.ok());
  ASSERT_EQ(docs->size(), 1u);
  EXPECT_EQ((*docs)[0].state, rpc::DocumentState::READY);
  EXPECT_TRUE(cluster.coordinator().process->running());
  EXPECT_TRUE(cluster.worker(0).process->running());
}

// Documents: put, get, list in pages, delete; tenants see only their own;
// a bad API key is refused; streaming with stop strings; cancel.
TEST_F(Service, DocumentsTenantsStreamingAndCancel) {
  ClusterOptions o;
  o.api_keys_yaml = "keys:\n  key-alice-0123456789: alice\n  key-bob-00123456789: bob\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto alice = cluster.Client("key-alice-0123456789"), bob = cluster.Client("key-bob-00123456789");
  auto nobody = cluster.Client("wrong-key-0123456789");
  ASSERT_TRUE(alice && bob && nobody);
  ExpectCode(nobody->ListDocuments().status(), StatusCode::kPermissionDenied, "bad key");
  ExpectCode(nobody->Generate(Ask({}, {5, 6}, 2)).status(), StatusCode::kPermissionDenied, "bad key");

  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(Put(*alice, "doc" + std::to_string(i), LcgTokens(60 + i, 40 + i, true)).id);
  // A put that returns at once (FACTORING), then READY when polled.
  {
    const std::vector<int32_t> ids = LcgTokens(300, 45, true);
    auto d = alice->PutDocument("async", nullptr, &ids, /*wait=*/false);
    ASSERT_TRUE(d.ok()) << d.status();
    rpc::DocumentInfo info = *d;
    for (int i = 0; i < 500 && info.state == rpc::DocumentState::FACTORING; ++i) {
      std::this_thread::sleep_for(10ms);
      auto g = alice->GetDocument(d->id);
      ASSERT_TRUE(g.ok()) << g.status();
      info = *g;
    }
    EXPECT_EQ(info.state, rpc::DocumentState::READY);
    EXPECT_EQ(info.factored_tokens, 300);
    ASSERT_TRUE(alice->DeleteDocument(d->id).ok());
  }
  auto page = alice->ListDocuments(/*page_size=*/1);
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->size(), 3u);
  std::set<std::string> listed;
  for (const auto& d : *page) listed.insert(d.id);
  EXPECT_EQ(listed, std::set<std::string>(ids.begin(), ids.end()));
  auto bobs = bob->ListDocuments();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());
  ExpectCode(bob->GetDocument(ids[0]).status(), StatusCode::kNotFound, "another tenant's document");
  ExpectCode(bob->DeleteDocument(ids[0]), StatusCode::kNotFound, "another tenant's delete");
  ExpectCode(bob->Generate(Ask({ids[0]}, {5, 6}, 2)).status(), StatusCode::kNotFound, "another tenant's generate");

  // Streaming: text arrives in pieces that add up to the whole answer.
  std::string streamed;
  int pieces = 0;
  auto last = alice->Stream(Ask({ids[1]}, LcgTokens(8, 50, false), 24), [&](const std::string& delta) {
    streamed += delta;
    ++pieces;
  });
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(streamed, last->text);
  EXPECT_GT(pieces, 1);
  EXPECT_EQ(last->usage.cached_prompt_tokens, 61);
  // A stop string cuts the text before it and ends the request.
  ASSERT_GT(last->text.size(), 12u) << last->text;
  {
    const std::string stop = last->text.substr(8, 3);
    auto r = Ask({ids[1]}, LcgTokens(8, 50, false), 24);
    r.stop = {stop};
    auto cut = alice->Complete(r);
    ASSERT_TRUE(cut.ok()) << cut.status();
    EXPECT_EQ(cut->finish_reason, "stop");
    EXPECT_EQ(cut->text, last->text.substr(0, last->text.find(stop)));
  }

  // Cancel a long request.
  auto id = alice->Generate(Ask({}, LcgTokens(20, 60, true), 480));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(alice->Poll(*id, 0, 5000).ok());
  ExpectCode(bob->Cancel(*id), StatusCode::kNotFound, "another tenant's cancel");
  ASSERT_TRUE(alice->Cancel(*id).ok());
  rpc::GenerateChunk end = Follow(*alice, *id);
  EXPECT_EQ(end.finish_reason, "cancelled");
  EXPECT_LT(end.usage.generated_tokens, 480);

  // A deadline is kept by the coordinator too: typed, on time.
  {
    auto r = Ask({}, LcgTokens(20, 61, true), 480);
    r.deadline_ms = 30;
    const auto t0 = std::chrono::steady_clock::now();
    ExpectCode(alice->Complete(r).status(), StatusCode::kDeadlineExceeded, "deadline");
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  }

  // Delete: gone from the registry and from the worker's cache.
  ASSERT_TRUE(alice->DeleteDocument(ids[2]).ok());
  ExpectCode(alice->GetDocument(ids[2]).status(), StatusCode::kNotFound, "deleted");
  ExpectCode(alice->Generate(Ask({ids[2]}, {5}, 2)).status(), StatusCode::kNotFound, "deleted generate");
  auto stats = alice->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->documents, 2);
  EXPECT_GE(stats->requests, 3);

  // Both processes export Prometheus metrics.
  httplib::Client coord("127.0.0.1", cluster.coordinator().metrics_port),
      worker("127.0.0.1", cluster.worker(0).metrics_port);
  auto cm = coord.Get("/metrics");
  ASSERT_TRUE(cm);
  EXPECT_EQ(cm->status, 200);
  EXPECT_NE(cm->body.find("penumbra_coordinator_requests_total{reason=\"length\",tenant=\""), std::string::npos)
      << cm->body;
  EXPECT_NE(cm->body.find("penumbra_coordinator_ttft_seconds_bucket"), std::string::npos);
  EXPECT_NE(cm->body.find("penumbra_coordinator_worker_up{worker=\"w0\"} 1"), std::string::npos);
  auto wm = worker.Get("/metrics");
  ASSERT_TRUE(wm);
  EXPECT_NE(wm->body.find("penumbra_worker_generated_tokens_total"), std::string::npos);
  // The document cache's figures: the documents asked about are cached.
  const size_t at = wm->body.find("\npenumbra_worker_documents_cached ");
  ASSERT_NE(at, std::string::npos) << wm->body;
  EXPECT_GE(std::stod(wm->body.substr(at + std::string("\npenumbra_worker_documents_cached ").size())), 1.0);
  for (const char* m :
       {"penumbra_worker_documents_host_bytes", "penumbra_worker_documents_tier0_bytes",
        "penumbra_worker_documents_tier0_promotions_total", "penumbra_worker_documents_store_hits_total"}) {
    EXPECT_NE(wm->body.find(m), std::string::npos) << m;
  }
  auto hz = worker.Get("/healthz");
  ASSERT_TRUE(hz);
  EXPECT_EQ(hz->status, 200);
}

// A worker of kv_policy auto takes requests pinned to either policy (the
// coordinator routes them to it, the pin travels with them): a question
// pinned to shadowkv about a document held exact prefills its own copy
// (nothing attached) and answers as the shadowkv engine does; an unpinned or
// full one attaches the exact document and answers as full does. A document
// put pinned to shadowkv is held so, and its unpinned questions attach it.
// The worker's metrics count the documents by policy.
TEST_F(Service, AnAutoWorkerHoldsEachRequestUnderItsPin) {
  ClusterOptions o;
  // ShadowKV's options of LossyShadowKvOptions (the offline engine's).
  o.worker_flags = {"--kv-policy",
                    "auto",
                    "--rank",
                    "12",
                    "--chunk-size",
                    "4",
                    "--budget",
                    "24",
                    "--local-window",
                    "8",
                    "--outliers",
                    "2",
                    "--min-prompt",
                    "0",
                    "--landmarks-per-chunk",
                    "2",
                    "--continuation",
                    "dense",
                    "--prefix-cache-mb",
                    "64"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->workers.size(), 1u);
  EXPECT_EQ(stats->workers[0].kv_policy, "auto");
  const std::vector<int32_t> doc = LcgTokens(180, 31, true);
  const rpc::DocumentInfo d = Put(*c, "doc", doc);
  ASSERT_FALSE(d.id.empty());
  Offline full("full"), shadowkv("shadowkv");
  for (const char* pin : {"", "full", "shadowkv"}) {
    const std::vector<int32_t> q = LcgTokens(14, 500 + std::string(pin).size(), false);
    rpc::GenerateRequest r = Ask({d.id}, q, 6);
    r.kv_policy = pin;
    auto got = c->Complete(r);
    ASSERT_TRUE(got.ok()) << pin << ": " << got.status();
    const bool sparse = std::string(pin) == "shadowkv";
    EXPECT_EQ(got->usage.cached_prompt_tokens, sparse ? 0 : 180) << pin;
    EXPECT_EQ(got->ids, (sparse ? shadowkv : full).About(doc, q, 6)) << pin;
  }
  // A document pinned by its put.
  const std::vector<int32_t> doc2 = LcgTokens(150, 32, true);
  ExpectCode(c->PutDocument("bad", nullptr, &doc2, true, 0ms, {}, "sparse").status(), StatusCode::kInvalidArgument,
             "a put's kv_policy");
  auto d2 = c->PutDocument("doc2", nullptr, &doc2, true, 0ms, {}, "shadowkv");
  ASSERT_TRUE(d2.ok()) << d2.status();
  EXPECT_EQ(d2->kv_policy, "shadowkv");
  for (const char* pin : {"", "full"}) {
    const std::vector<int32_t> q = LcgTokens(11, 600 + std::string(pin).size(), false);
    rpc::GenerateRequest r = Ask({d2->id}, q, 6);
    r.kv_policy = pin;
    auto got = c->Complete(r);
    ASSERT_TRUE(got.ok()) << pin << ": " << got.status();
    const bool exact = std::string(pin) == "full";
    EXPECT_EQ(got->usage.cached_prompt_tokens, exact ? 0 : 150) << pin;
    EXPECT_EQ(got->ids, (exact ? full : shadowkv).About(doc2, q, 6)) << pin;
  }
  // spindlekv, a third form of a CPU auto worker (its WorkerHealth.kv_forms
  // say so, and the coordinator routes the pin to it), held by pins only: a
  // question pinned to it about the exact document prefills its own.
  {
    const std::vector<int32_t> q = LcgTokens(9, 650, false);
    rpc::GenerateRequest r = Ask({d.id}, q, 6);
    r.kv_policy = "spindlekv";
    auto got = c->Complete(r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->usage.cached_prompt_tokens, 0);
    EngineOptions so;
    so.kv_policy = "spindlekv";
    EXPECT_EQ(got->ids, Offline(so).About(doc, q, 6));
  }
  auto wm = httplib::Client("127.0.0.1", cluster.worker(0).metrics_port).Get("/metrics");
  ASSERT_TRUE(wm);
  EXPECT_NE(wm->body.find("penumbra_worker_documents_by_policy{policy=\"full\"} 1"), std::string::npos) << wm->body;
  EXPECT_NE(wm->body.find("penumbra_worker_documents_by_policy{policy=\"shadowkv\"} 1"), std::string::npos);
  EXPECT_NE(wm->body.find("penumbra_worker_document_moves_total 0"), std::string::npos);
}

// A spindlekv worker serves through the service: a document put pinned to
// spindlekv is compressed once and its questions attach it and answer as
// the offline engine does; a pin to another policy finds no worker.
TEST_F(Service, ASpindleKvWorkerAnswersQuestionsAboutAPutDocument) {
  ClusterOptions o;
  o.worker_flags = {"--kv-policy",        "spindlekv", "--spindlekv-ratio",           "0.3",
                    "--spindlekv-window", "16",        "--spindlekv-key-threshold",   "0.9",
                    "--prefix-cache-mb",  "64",        "--spindlekv-value-threshold", "0.9"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->workers.size(), 1u);
  EXPECT_EQ(stats->workers[0].kv_policy, "spindlekv");
  const std::vector<int32_t> doc = LcgTokens(180, 41, true);
  auto d = c->PutDocument("doc", nullptr, &doc, true, 0ms, {}, "spindlekv");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->kv_policy, "spindlekv");
  EngineOptions eo;
  eo.kv_policy = "spindlekv";
  eo.spindlekv.reserve_ratio = 0.3;
  eo.spindlekv.window = 16;
  eo.spindlekv.key_threshold = 0.9;
  eo.spindlekv.value_threshold = 0.9;
  Offline offline(eo);
  for (int i = 0; i < 2; ++i) {
    const std::vector<int32_t> q = LcgTokens(12 + i, 700 + i, false);
    auto got = c->Complete(Ask({d->id}, q, 6));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->usage.cached_prompt_tokens, 180);
    EXPECT_EQ(got->ids, offline.About(doc, q, 6));
  }
  rpc::GenerateRequest pinned = Ask({d->id}, {5, 6}, 2);
  pinned.kv_policy = "shadowkv";
  ExpectCode(c->Generate(pinned).status(), StatusCode::kUnavailable, "no worker of that policy");
  auto wm = httplib::Client("127.0.0.1", cluster.worker(0).metrics_port).Get("/metrics");
  ASSERT_TRUE(wm);
  EXPECT_NE(wm->body.find("penumbra_worker_documents_by_policy{policy=\"spindlekv\"} 1"), std::string::npos)
      << wm->body;
}

// A specontext worker serves through the service: a put document is held
// once (every layer's keys and values, the head's keys) and its questions
// attach it and answer as the offline engine does.
TEST_F(Service, ASpeContextWorkerAnswersQuestions) {
  ClusterOptions o;
  o.worker_flags = {"--kv-policy",         "specontext", "--specontext-head",          "random",
                    "--specontext-budget", "16",         "--specontext-local",         "4",
                    "--prefix-cache-mb",   "64",         "--specontext-device-layers", "2"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->workers.size(), 1u);
  EXPECT_EQ(stats->workers[0].kv_policy, "specontext");
  const std::vector<int32_t> doc = LcgTokens(180, 43, true);
  auto d = c->PutDocument("doc", nullptr, &doc, true, 0ms, {}, "");
  ASSERT_TRUE(d.ok()) << d.status();
  EngineOptions eo;
  eo.kv_policy = "specontext";
  eo.specontext.head = "random";
  eo.specontext.budget = 16;
  eo.specontext.local = 4;
  eo.specontext.device_layers = 2;
  Offline offline(eo);
  for (int i = 0; i < 2; ++i) {
    const std::vector<int32_t> q = LcgTokens(12 + i, 710 + i, false);
    auto got = c->Complete(Ask({d->id}, q, 8));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->usage.cached_prompt_tokens, 180);
    EXPECT_EQ(got->ids, offline.About(doc, q, 8));
  }
  rpc::GenerateRequest pinned = Ask({}, {5, 6, 7}, 4);
  pinned.kv_policy = "specontext";
  auto got = c->Complete(pinned);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->ids.size(), 4u);
}

// SIGTERM: the worker stops taking requests and lets the running ones finish;
// the coordinator then drains and both exit 0.
TEST_F(Service, SigtermDrainsRunningRequests) {
  Cluster cluster({});
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  auto id = c->Generate(Ask({}, LcgTokens(30, 70, true), 440));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(c->Poll(*id, 0, 5000).ok());
  cluster.worker(0).process->Signal(SIGTERM);
  // New requests are refused while it drains (typed, retryable).
  bool refused = false;
  for (int i = 0; i < 50 && !refused; ++i) {
    auto w = cluster.WorkerClient(0);
    rpc::WorkerGenerateRequest g;
    g.prompt = {1, 5, 6};
    g.max_new_tokens = 2;
    std::string wid;
    Status s = transport::CallRpc("generate", [&] { (*w)->Generate(wid, g); });
    refused = s.code() == StatusCode::kUnavailable;
    // Taken before the signal arrived: released, or the draining worker
    // would wait for its answer to be read.
    if (s.ok()) (void)transport::CallRpc("release", [&] { (*w)->Release(wid); });
    if (!refused) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(refused);
  rpc::GenerateChunk end = Follow(*c, *id);
  EXPECT_EQ(end.finish_reason, "length");
  EXPECT_EQ(end.usage.generated_tokens, 440);
  EXPECT_EQ(cluster.worker(0).process->Wait(30s), std::optional<int>(0));
  cluster.coordinator().process->Signal(SIGTERM);
  EXPECT_EQ(cluster.coordinator().process->Wait(30s), std::optional<int>(0));
}

// Maintenance of one of two workers: SIGTERM drains it (it finishes what it
// runs and refuses new work; the coordinator routes around it) while
// clients keep asking; no request fails, each gets all its tokens, the
// drained worker exits 0 and the other serves what comes after. Both
// workers report their free memory (what placement reads).
TEST_F(Service, DrainingAWorkerLosesNoRequest) {
  ClusterOptions o;
  o.workers = 2;
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  for (int w = 0; w < 2; ++w) {
    int64_t free = -1;
    for (int i = 0; i < 100 && free < 0; ++i) {
      free = cluster.WorkerStats(w).memory_free_bytes;
      if (free < 0) std::this_thread::sleep_for(50ms);
    }
    EXPECT_GT(free, 0) << "worker " << w;
  }
  // Long answers on both workers (placement spreads them by load).
  std::vector<std::string> before;
  for (int i = 0; i < 4; ++i) {
    auto id = c->Generate(Ask({}, LcgTokens(20, 900 + i, true), 300));
    ASSERT_TRUE(id.ok()) << id.status();
    before.push_back(*id);
  }
  for (const auto& id : before) ASSERT_TRUE(c->Poll(id, 0, 5000).ok());
  const int64_t w1_before = cluster.WorkerStats(1).submitted;
  EXPECT_GE(cluster.WorkerStats(0).submitted, 1);
  cluster.worker(0).process->Signal(SIGTERM);
  // Requests during and after the drain: every one is served (by worker 1
  // once the coordinator sees worker 0 draining, or passed on by it).
  std::vector<std::string> after;
  for (int i = 0; i < 6; ++i) {
    auto id = c->Generate(Ask({}, LcgTokens(12, 950 + i, true), 20));
    ASSERT_TRUE(id.ok()) << id.status();
    after.push_back(*id);
    std::this_thread::sleep_for(100ms);
  }
  for (const auto& id : before) {
    rpc::GenerateChunk end = Follow(*c, id);
    EXPECT_EQ(end.finish_reason, "length") << id;
    EXPECT_EQ(end.usage.generated_tokens, 300) << id;
  }
  for (const auto& id : after) {
    rpc::GenerateChunk end = Follow(*c, id);
    EXPECT_EQ(end.finish_reason, "length") << id;
    EXPECT_EQ(end.usage.generated_tokens, 20) << id;
  }
  EXPECT_EQ(cluster.worker(0).process->Wait(60s), std::optional<int>(0));
  // Some of those may have reached worker 0 before its drain began (it
  // served them); the rest went to worker 1, and so does what comes now.
  const int64_t w1_during = cluster.WorkerStats(1).submitted;
  EXPECT_GE(w1_during - w1_before, 1);
  for (int i = 0; i < 2; ++i) {
    auto id = c->Generate(Ask({}, LcgTokens(12, 970 + i, true), 8));
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(Follow(*c, *id).usage.generated_tokens, 8);
  }
  EXPECT_EQ(cluster.WorkerStats(1).submitted - w1_during, 2);
}

// Polls job `id` until it is no longer in progress (at most `tries` x 50 ms).
rpc::JobInfo WaitForJob(client::Client& c, const std::string& id, int tries) {
  rpc::JobInfo info;
  for (int i = 0; i < tries; ++i) {
    auto j = c.GetJob(id);
    EXPECT_TRUE(j.ok()) << j.status();
    if (!j.ok()) break;
    info = *j;
    if (info.status != rpc::JobStatus::IN_PROGRESS) break;
    std::this_thread::sleep_for(50ms);
  }
  return info;
}

// A batch job of 24 items over two documents: bad submissions are refused
// naming the item; the coordinator is killed (SIGKILL) twice while the job
// runs and restarted on the same data directory; the job completes, every
// custom_id has exactly one result, each equals the offline engine's answer
// for that item alone, and another tenant sees none of it.
TEST_F(Service, BatchJobsSurviveCoordinatorKillsAndAnswerEachItemOnce) {
  ClusterOptions o;
  o.api_keys_yaml = "keys:\n  alice-key-0123456789: alice\n  bob-key-00123456789: bob\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());  // no data directory: jobs are off
  {
    auto c = cluster.Client("alice-key-0123456789");
    ASSERT_TRUE(c);
    ExpectCode(c->ListJobs().status(), StatusCode::kFailedPrecondition, "jobs without --data-dir");
  }
  cluster.coordinator().process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.coordinator().process->Wait(10s).has_value());
  const std::vector<std::string> flags = {"--data-dir", cluster.dir() + "/data", "--job-concurrency", "4"};
  ASSERT_TRUE(cluster.StartCoordinator(flags));
  auto alice = cluster.Client("alice-key-0123456789");
  ASSERT_TRUE(alice);
  const std::vector<int32_t> doc_a = LcgTokens(160, 31, true), doc_b = LcgTokens(120, 32, true);
  const std::string a = Put(*alice, "a", doc_a).id, b = Put(*alice, "b", doc_b).id;
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());

  rpc::SubmitJobRequest job;
  std::map<std::string, GenerationRequest> offline;
  for (int i = 0; i < 24; ++i) {
    const bool on_a = i % 2 == 0;
    const std::vector<int32_t> q = LcgTokens(6 + i % 9, 700 + i, false);
    rpc::JobItem it;
    char name[32];
    std::snprintf(name, sizeof name, "item-%02d", i);
    it.custom_id = name;
    it.request = Ask({on_a ? a : b}, q, 4 + i % 5);
    job.items.push_back(it);
    GenerationRequest& g = offline[name];
    g.prompt = on_a ? doc_a : doc_b;
    g.document_ends = {static_cast<int64_t>(g.prompt.size())};
    g.prompt.insert(g.prompt.end(), q.begin(), q.end());
    g.max_new_tokens = it.request.max_new_tokens;
  }
  // Bad submissions store nothing and name the item.
  {
    rpc::SubmitJobRequest dup = job;
    dup.items[5].custom_id = dup.items[3].custom_id;
    const Status s = alice->SubmitJob(dup).status();
    ExpectCode(s, StatusCode::kInvalidArgument, "duplicate custom_id");
    EXPECT_NE(s.message().find("item-03"), std::string::npos) << s;
    rpc::SubmitJobRequest unknown = job;
    unknown.items[7].request.document_ids = {"doc-nope"};
    const Status u = alice->SubmitJob(unknown).status();
    ExpectCode(u, StatusCode::kNotFound, "unknown document");
    EXPECT_NE(u.message().find("items[7]"), std::string::npos) << u;
    rpc::SubmitJobRequest empty;
    ExpectCode(alice->SubmitJob(empty).status(), StatusCode::kInvalidArgument, "no items");
    auto none = alice->ListJobs();
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_TRUE(none->empty());
  }
  auto submitted = alice->SubmitJob(job);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string id = submitted->id;
  EXPECT_EQ(submitted->total, 24);

  // Two kills while it runs, each after some progress.
  for (int kill = 0; kill < 2; ++kill) {
    const int64_t want = 4 + 8 * kill;
    for (int i = 0; i < 3000; ++i) {
      auto j = alice->GetJob(id);
      if (j.ok() && (j->completed >= want || j->status != rpc::JobStatus::IN_PROGRESS)) break;
      std::this_thread::sleep_for(20ms);
    }
    cluster.coordinator().process->Signal(SIGKILL);
    ASSERT_TRUE(cluster.coordinator().process->Wait(10s).has_value());
    ASSERT_TRUE(cluster.StartCoordinator(flags));
    alice = cluster.Client("alice-key-0123456789");
    ASSERT_TRUE(alice);
  }
  const rpc::JobInfo done = WaitForJob(*alice, id, 6000);
  ASSERT_EQ(done.status, rpc::JobStatus::COMPLETED);
  EXPECT_EQ(done.completed, 24);
  EXPECT_EQ(done.failed, 0);
  auto results = alice->JobResults(id, 5);  // paged
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 24u);
  Offline engine;
  std::set<std::string> seen;
  for (const rpc::JobItemResult& r : *results) {
    EXPECT_TRUE(seen.insert(r.custom_id).second) << "two results for " << r.custom_id;
    ASSERT_TRUE(offline.count(r.custom_id)) << r.custom_id;
    EXPECT_TRUE(r.ok) << r.custom_id << ": " << r.error;
    EXPECT_EQ(r.state, "succeeded");
    EXPECT_EQ(r.finish_reason, "length");
    EXPECT_EQ(r.ids, engine.Answer(offline[r.custom_id])) << r.custom_id;
    EXPECT_EQ(r.usage.prompt_tokens, static_cast<int64_t>(offline[r.custom_id].prompt.size()));
  }
  // Another tenant sees nothing of it.
  auto bob = cluster.Client("bob-key-00123456789");
  ASSERT_TRUE(bob);
  ExpectCode(bob->GetJob(id).status(), StatusCode::kNotFound, "bob gets alice's job");
  ExpectCode(bob->JobResults(id).status(), StatusCode::kNotFound, "bob reads alice's results");
  ExpectCode(bob->CancelJob(id).status(), StatusCode::kNotFound, "bob cancels alice's job");
  ExpectCode(bob->DeleteJob(id), StatusCode::kNotFound, "bob deletes alice's job");
  auto bobs = bob->ListJobs();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());
  // Alice lists it, and deletes it once it is done.
  auto mine = alice->ListJobs();
  ASSERT_TRUE(mine.ok());
  ASSERT_EQ(mine->size(), 1u);
  EXPECT_EQ((*mine)[0].id, id);
  EXPECT_TRUE(alice->DeleteJob(id).ok());
  ExpectCode(alice->GetJob(id).status(), StatusCode::kNotFound, "a deleted job");
}

// Cancelling a batch job stops the item that is running, not only the
// pending ones: its generation is cancelled on the worker and the item ends
// as cancelled, with no answer recorded (before, it ran to its end and
// counted as succeeded).
TEST_F(Service, CancellingABatchJobStopsItsRunningItem) {
  ClusterOptions o;
  o.api_keys_yaml = "keys:\n  alice-key-0123456789: alice\n";
  Cluster cluster(o);
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", cluster.dir() + "/data", "--job-concurrency", "1"}));
  auto alice = cluster.Client("alice-key-0123456789");
  ASSERT_TRUE(alice);
  rpc::SubmitJobRequest job;
  for (int i = 0; i < 3; ++i) {
    rpc::JobItem it;
    it.custom_id = "long-" + std::to_string(i);
    it.request = Ask({}, LcgTokens(20, 80 + i, true), 480);
    job.items.push_back(it);
  }
  auto submitted = alice->SubmitJob(job);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string id = submitted->id;
  bool running = false;
  for (int i = 0; i < 500 && !running; ++i) {
    auto j = alice->GetJob(id);
    ASSERT_TRUE(j.ok()) << j.status();
    running = j->running == 1;
    if (!running) std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(running) << "no item started";
  auto cancelling = alice->CancelJob(id);
  ASSERT_TRUE(cancelling.ok()) << cancelling.status();
  EXPECT_EQ(cancelling->cancelled, 2);  // the pending ones, at once
  rpc::JobInfo end;
  for (int i = 0; i < 500; ++i) {
    auto j = alice->GetJob(id);
    ASSERT_TRUE(j.ok()) << j.status();
    end = *j;
    if (end.status == rpc::JobStatus::CANCELLED) break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_EQ(end.status, rpc::JobStatus::CANCELLED);
  EXPECT_EQ(end.completed, 0);
  EXPECT_EQ(end.cancelled, 3);
  EXPECT_EQ(end.running, 0);
  auto results = alice->JobResults(id);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 3u);
  for (const rpc::JobItemResult& r : *results) {
    EXPECT_EQ(r.state, "cancelled") << r.custom_id;
    EXPECT_FALSE(r.ok) << r.custom_id;
    EXPECT_TRUE(r.ids.empty()) << r.custom_id;
  }
  // The worker is free again: a request completes.
  auto after = alice->Complete(Ask({}, LcgTokens(8, 90, true), 4));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->finish_reason, "length");
}

// Tenants from a tenants.yaml (hashed keys, quotas): a wrong or missing key
// is refused; each quota, when exceeded, is RESOURCE_EXHAUSTED with a
// retry-after while the other tenant's requests keep completing; neither
// tenant sees the other's documents or jobs; SIGHUP rereads the file.
TEST_F(Service, TenantQuotasRefuseWithRetryAfterAndIsolate) {
  const std::string small_key = "small-tenant-key-0001", big_key = "big-tenant-key-00001";
  auto config = [](int jobs) {
    return "tenants:\n"
           "  - name: small\n"
           "    api_keys: [sha256:3ae968478f62aa810eea089d1cdca70d9749f63405bb63aa8aac8b8e1c08082b]\n"
           "    quotas:\n"
           "      max_concurrent_sequences: 1\n"
           "      generated_tokens_per_minute: 30\n"
           "      stored_document_bytes: 2000\n"
           "      max_jobs_in_flight: " +
           std::to_string(jobs) +
           "\n"
           "    publishes_to: [big]\n"
           "  - name: big\n"
           "    api_keys: [sha256:b8d61951ce9d4d9248b758d49f453e276bec66de821d81943f0e1e8d84cbe4aa]\n";
  };
  ClusterOptions o;
  o.tenants_yaml = config(1);
  Cluster cluster(o);
  ASSERT_TRUE(cluster.StartWorker(0));
  ASSERT_TRUE(cluster.StartCoordinator({"--data-dir", cluster.dir() + "/data"}));
  for (const std::string& bad : {std::string(), std::string("nope-nope-nope-nope"), std::string("small")}) {
    auto c = cluster.Client(bad);
    ASSERT_TRUE(c);
    const Status s = c->ListDocuments().status();
    ExpectCode(s, StatusCode::kPermissionDenied, "key '" + bad + "'");
    if (!bad.empty()) {
      EXPECT_EQ(s.message().find(bad), std::string::npos) << "the key echoed: " << s;
    }
  }
  auto small = cluster.Client(small_key);
  auto big = cluster.Client(big_key);
  ASSERT_TRUE(small && big);

  // Stored document bytes: 300 tokens (1200 bytes) fit, 300 more do not.
  const std::vector<int32_t> doc = LcgTokens(300, 41, true);
  const std::string d = Put(*small, "d", doc).id;
  ASSERT_FALSE(d.empty());
  const Status full = small->PutDocument("d2", nullptr, &doc).status();
  ExpectCode(full, StatusCode::kResourceExhausted, "document bytes over the quota");
  EXPECT_GT(full.retry_after_ms(), 0);
  const std::string bd = Put(*big, "bd", doc).id;  // the other tenant is unaffected
  ASSERT_FALSE(bd.empty());

  // Concurrent sequences: one running (nobody polls it yet), a second refused.
  // The first reserves 20 of small's 30 tokens a minute as it is admitted.
  auto first = small->Generate(Ask({d}, LcgTokens(8, 42, false), 20));
  ASSERT_TRUE(first.ok()) << first.status();
  const Status second = small->Generate(Ask({d}, LcgTokens(8, 43, false), 5)).status();
  ExpectCode(second, StatusCode::kResourceExhausted, "a second sequence");
  EXPECT_NE(second.message().find("max_concurrent_sequences"), std::string::npos) << second;
  EXPECT_GT(second.retry_after_ms(), 0);
  auto bigs = big->Complete(Ask({bd}, LcgTokens(8, 44, false), 5));
  ASSERT_TRUE(bigs.ok()) << bigs.status();
  EXPECT_EQ(bigs->usage.generated_tokens, 5);
  // The first ends (20 tokens): a request that may generate 30 must wait
  // for the bucket to refill (at 0.5 a second from about 10), and one
  // asking for more than the bucket ever holds is refused as such.
  rpc::GenerateChunk ended = Follow(*small, *first);
  EXPECT_EQ(ended.usage.generated_tokens, 20);
  const Status rate = small->Generate(Ask({d}, LcgTokens(8, 45, false), 30)).status();
  ExpectCode(rate, StatusCode::kResourceExhausted, "generated tokens per minute");
  EXPECT_NE(rate.message().find("generated_tokens_per_minute"), std::string::npos) << rate;
  EXPECT_GE(rate.retry_after_ms(), 15 * 1000) << "20 of 30 tokens refill at 0.5 a second";
  const Status never = small->Generate(Ask({d}, LcgTokens(8, 45, false), 31)).status();
  ExpectCode(never, StatusCode::kInvalidArgument, "more tokens than the quota ever holds");
  EXPECT_NE(never.message().find("generated_tokens_per_minute quota of 30"), std::string::npos) << never;
  auto bigs2 = big->Complete(Ask({bd}, LcgTokens(8, 46, false), 5));
  ASSERT_TRUE(bigs2.ok()) << bigs2.status();

  // Jobs in flight: small's first job cannot run yet (its item reserves 30
  // tokens, the whole bucket, which holds about 10), so a second is refused; the file is
  // reread on SIGHUP with room for two. An item that could never fit the
  // quota refuses its job at submission.
  rpc::SubmitJobRequest job;
  rpc::JobItem it;
  it.custom_id = "only";
  it.request = Ask({d}, LcgTokens(8, 47, false), 31);
  job.items = {it};
  const Status never_job = small->SubmitJob(job).status();
  ExpectCode(never_job, StatusCode::kInvalidArgument, "a job item over the quota");
  EXPECT_NE(never_job.message().find("items[0] (custom_id 'only')"), std::string::npos) << never_job;
  it.request = Ask({d}, LcgTokens(8, 47, false), 30);
  job.items = {it};
  auto j1 = small->SubmitJob(job);
  ASSERT_TRUE(j1.ok()) << j1.status();
  const Status j2 = small->SubmitJob(job).status();
  ExpectCode(j2, StatusCode::kResourceExhausted, "a second job in flight");
  EXPECT_GT(j2.retry_after_ms(), 0);
  auto bj = big->SubmitJob(job);  // small's document is published to big; the job is big's
  ASSERT_TRUE(bj.ok()) << bj.status();
  std::ofstream(cluster.tenants_path()) << config(2);
  cluster.coordinator().process->Signal(SIGHUP);
  Status again = Status::Internal("not tried");
  for (int i = 0; i < 100 && !again.ok(); ++i) {
    std::this_thread::sleep_for(50ms);
    again = small->SubmitJob(job).status();
  }
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_TRUE(cluster.coordinator().process->running()) << "SIGHUP stopped the coordinator";

  // Isolation: neither sees the other's documents or jobs.
  ExpectCode(big->GetDocument(d).status(), StatusCode::kNotFound, "big reads small's document");
  ExpectCode(big->GetJob(j1->id).status(), StatusCode::kNotFound, "big reads small's job");
  auto big_docs = big->ListDocuments();
  ASSERT_TRUE(big_docs.ok());
  ASSERT_EQ(big_docs->size(), 1u);
  EXPECT_EQ((*big_docs)[0].id, bd);
  auto big_jobs = big->ListJobs();
  ASSERT_TRUE(big_jobs.ok());
  ASSERT_EQ(big_jobs->size(), 1u);
  EXPECT_EQ((*big_jobs)[0].id, bj->id);
  ExpectCode(small->GetJob(bj->id).status(), StatusCode::kNotFound, "small reads big's job");
  // small publishes its corpus to big: big may ask about small's document
  // (read in small's cache namespace: attached, not prefilled again), never
  // delete it, and never mix it with its own documents in one request; the
  // other way round nothing is published.
  {
    auto r = big->Complete(Ask({d}, LcgTokens(8, 48, false), 2));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->usage.cached_prompt_tokens, 300);
    ExpectCode(big->Complete(Ask({bd, d}, LcgTokens(8, 50, false), 2)).status(), StatusCode::kInvalidArgument,
               "documents of two owners in one request");
    ExpectCode(small->Complete(Ask({bd}, LcgTokens(8, 51, false), 2)).status(), StatusCode::kNotFound,
               "small asks about big's unpublished document");
  }
  // Every other call on the other tenant's ids is NOT_FOUND.
  ExpectCode(big->DeleteDocument(d), StatusCode::kNotFound, "big deletes small's document");
  ExpectCode(big->Poll(*first, 0, 0).status(), StatusCode::kNotFound, "big polls small's request");
  ExpectCode(big->Cancel(*first), StatusCode::kNotFound, "big cancels small's request");
  ExpectCode(big->CancelJob(j1->id).status(), StatusCode::kNotFound, "big cancels small's job");
  ExpectCode(big->DeleteJob(j1->id), StatusCode::kNotFound, "big deletes small's job");
  ExpectCode(big->JobResults(j1->id).status(), StatusCode::kNotFound, "big reads small's job results");
  // The cache is per tenant: big's prompt made of small's document's tokens
  // attaches nothing of small's (so its timing cannot tell whether small put it).
  {
    rpc::GenerateRequest raw;
    std::vector<int32_t> prompt = doc;
    const std::vector<int32_t> q = LcgTokens(8, 49, false);
    prompt.insert(prompt.end(), q.begin(), q.end());
    raw.__set_token_ids(prompt);
    raw.max_new_tokens = 2;
    raw.ignore_eos = true;
    auto r = big->Complete(raw);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->usage.cached_prompt_tokens, 0);
  }
  // Per-tenant metrics, refusals included.
  {
    httplib::Client m("127.0.0.1", cluster.coordinator().metrics_port);
    auto body = m.Get("/metrics");
    ASSERT_TRUE(body);
    EXPECT_NE(body->body.find("penumbra_coordinator_generated_tokens_total{tenant=\"small\"} 20"), std::string::npos)
        << body->body;
    EXPECT_NE(body->body.find("penumbra_coordinator_quota_refusals_total{tenant=\"small\"}"), std::string::npos);
    EXPECT_NE(body->body.find("penumbra_coordinator_documents_put_total{tenant=\"big\"} 1"), std::string::npos);
  }
  // Deleting gives the bytes back.
  ASSERT_TRUE(small->DeleteDocument(d).ok());
  EXPECT_TRUE(small->PutDocument("d3", nullptr, &doc).ok());
}

// Chaos: a 60-item job over three documents on two workers, while the
// coordinator is killed (SIGKILL) 5 times and a worker 2 times, at random
// moments (seeded), each restarted on the same data directory or port. The
// job completes, every custom_id has exactly one result, and each equals
// the offline engine's answer for that item alone.
TEST_F(Service, BatchJobChaosKillsCoordinatorAndWorkers) {
  ClusterOptions o;
  o.workers = 2;
  Cluster cluster(o);
  const std::vector<std::string> flags = {"--data-dir", cluster.dir() + "/data", "--job-concurrency", "4"};
  for (int w = 0; w < 2; ++w) ASSERT_TRUE(cluster.StartWorker(w));
  ASSERT_TRUE(cluster.StartCoordinator(flags));
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  std::vector<std::vector<int32_t>> docs;
  std::vector<std::string> ids;
  for (int d = 0; d < 3; ++d) {
    docs.push_back(LcgTokens(100 + 40 * d, 51 + d, true));
    ids.push_back(Put(*c, "doc" + std::to_string(d), docs.back()).id);
    ASSERT_FALSE(ids.back().empty());
  }
  rpc::SubmitJobRequest job;
  std::map<std::string, GenerationRequest> offline;
  for (int i = 0; i < 60; ++i) {
    const int d = i % 3;
    const std::vector<int32_t> q = LcgTokens(5 + i % 11, 900 + i, false);
    char name[16];
    std::snprintf(name, sizeof name, "c%02d", i);
    rpc::JobItem it;
    it.custom_id = name;
    it.request = Ask({ids[d]}, q, 16 + i % 17);
    job.items.push_back(it);
    GenerationRequest& g = offline[name];
    g.prompt = docs[d];
    g.document_ends = {static_cast<int64_t>(g.prompt.size())};
    g.prompt.insert(g.prompt.end(), q.begin(), q.end());
    g.max_new_tokens = it.request.max_new_tokens;
  }
  auto submitted = c->SubmitJob(job);
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  const std::string id = submitted->id;

  // 5 coordinator kills and 2 worker kills in a seeded random order, each
  // after a random pause, while the job has items left.
  std::vector<int> events = {-1, -1, -1, -1, -1, 0, 1};  // -1: the coordinator; w: worker w
  std::mt19937 rng(20261125);
  std::shuffle(events.begin(), events.end(), rng);
  int kills = 0, during = 0;
  for (int e : events) {
    // The k-th kill once about 7k items are done, after a random pause: all
    // of them while the job runs.
    for (int i = 0; i < 2000; ++i) {
      auto j = c->GetJob(id);
      if (j.ok() && j->completed + j->failed >= 2 + 7 * kills) break;
      std::this_thread::sleep_for(10ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 60)(rng)));
    {
      auto j = c->GetJob(id);
      ASSERT_TRUE(j.ok()) << j.status();
      during += j->status == rpc::JobStatus::IN_PROGRESS;
    }
    if (e < 0) {
      cluster.coordinator().process->Signal(SIGKILL);
      ASSERT_TRUE(cluster.coordinator().process->Wait(10s).has_value());
      ASSERT_TRUE(cluster.StartCoordinator(flags));
      c = cluster.Client();
      ASSERT_TRUE(c);
    } else {
      const int port = cluster.worker(e).port;
      cluster.worker(e).process->Signal(SIGKILL);
      ASSERT_TRUE(cluster.worker(e).process->Wait(10s).has_value());
      ASSERT_TRUE(cluster.StartWorker(e, port));
    }
    ++kills;
    auto j = c->GetJob(id);
    ASSERT_TRUE(j.ok()) << j.status();
    LOG(INFO) << "chaos: after kill " << kills << " (" << (e < 0 ? "coordinator" : "worker") << "): " << j->completed
              << " of 60 done";
  }
  const rpc::JobInfo done = WaitForJob(*c, id, 2400);
  ASSERT_EQ(done.status, rpc::JobStatus::COMPLETED);
  EXPECT_EQ(done.completed, 60);
  EXPECT_EQ(done.failed, 0);
  EXPECT_EQ(during, 7) << "kills that came after the job had finished";
  auto results = c->JobResults(id, 7);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 60u);
  Offline engine;
  std::set<std::string> seen;
  for (const rpc::JobItemResult& r : *results) {
    EXPECT_TRUE(seen.insert(r.custom_id).second) << "two results for " << r.custom_id;
    ASSERT_TRUE(offline.count(r.custom_id)) << r.custom_id;
    EXPECT_TRUE(r.ok) << r.custom_id << ": " << r.error;
    EXPECT_EQ(r.ids, engine.Answer(offline[r.custom_id])) << r.custom_id;
  }
  EXPECT_EQ(seen.size(), 60u);
}

}  // namespace
}  // namespace penumbra::testing
