// Context groups inside the service, with real processes on loopback (CPU
// backend, stories260K; labels service and distributed): penumbra-worker
// ranks started with --group, formed by the coordinator, placed on by
// length, answering questions about documents put through the public API
// with the offline engine's tokens (full, and shadowkv and specontext in
// exact configurations); a rank killed with SIGKILL mid-decode
// (its requests resumed elsewhere with the same tokens, the group formed
// again once the rank is back); continuous batching with a cancel and a
// deadline; and a coordinator restart that finds its groups formed and its
// documents held.
#include <signal.h>

#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

#include "tests/service/service_calls.h"
#include "tests/service/service_cluster.h"
#include "tests/test_util.h"

namespace penumbra::testing {
namespace {

using namespace std::chrono_literals;

class Groups : public StoriesTest {};

// Whether every group the coordinator names is formed (its Stats).
bool GroupsFormed(client::Client& c, int groups) {
  auto s = c.Stats();
  if (!s.ok()) return false;
  std::set<std::string> formed;
  for (const rpc::WorkerStatus& w : s->workers) {
    if (w.__isset.group && w.group_state == "formed") formed.insert(w.group);
  }
  return static_cast<int>(formed.size()) == groups;
}

// Two groups (2 and 3 ranks) and a single worker: documents of 200 tokens or
// more go to the groups, shorter prompts to the worker; concurrent questions
// on both groups and the worker give the offline engine's greedy tokens,
// and a question about a put document attaches it on every rank.
TEST_F(Groups, TwoGroupsAndAWorkerAnswerAsTheOfflineEngine) {
  ClusterOptions o;
  o.workers = 1;
  o.groups = {2, 3};
  o.coordinator_flags = {"--group-min-tokens", "200"};
  o.worker_flags = {"--group-timeout-s", "20"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 2); }, 60s)) << "the groups never formed";
  const std::vector<int32_t> doc_a = LcgTokens(300, 21, true), doc_b = LcgTokens(260, 22, true);
  const std::string a = Put(*c, "a", doc_a).id, b = Put(*c, "b", doc_b).id;
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());

  struct Case {
    rpc::GenerateRequest req;
    GenerationRequest offline;
    rpc::GenerateChunk got;
  };
  std::vector<Case> cases;
  for (int i = 0; i < 9; ++i) {
    const int kind = i % 3;  // 0: about a, 1: about b, 2: no document (short)
    const std::vector<int32_t> q = LcgTokens(6 + 3 * i, 500 + i, kind == 2);
    const int max_new = 8 + i;
    const std::vector<int32_t>& doc = kind == 0 ? doc_a : kind == 1 ? doc_b : std::vector<int32_t>{};
    Case k;
    k.req = Ask(kind == 0   ? std::vector<std::string>{a}
                : kind == 1 ? std::vector<std::string>{b}
                            : std::vector<std::string>{},
                q, max_new);
    k.offline = Offline::Request(doc, q, max_new);
    cases.push_back(std::move(k));
  }
  std::vector<std::thread> threads;
  for (Case& k : cases) {
    threads.emplace_back([&cluster, &k] {
      auto cc = cluster.Client();
      if (!cc) return;
      auto r = cc->Complete(k.req);
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) k.got = *r;
    });
  }
  for (auto& t : threads) t.join();
  Offline offline;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& k = cases[i];
    EXPECT_EQ(k.got.finish_reason, "length")
        << "request " << i << (k.got.__isset.error_message ? ": " + k.got.error_message : "");
    EXPECT_EQ(k.got.ids, offline.Answer(k.offline)) << "request " << i;
    if (!k.offline.document_ends.empty()) {
      EXPECT_EQ(k.got.usage.cached_prompt_tokens, k.offline.document_ends[0]) << "request " << i;
    }
  }
  // Where they ran: the documents' questions on the groups' rank 0, the
  // short prompts on the single worker; the other ranks take no request.
  const rpc::WorkerStats single = cluster.WorkerStats(0), g0 = cluster.WorkerStats(1), g1 = cluster.WorkerStats(3);
  EXPECT_EQ(single.submitted, 3);
  EXPECT_EQ(g0.submitted + g1.submitted, 2 + 6);  // two puts, six questions
  EXPECT_GT(g0.submitted, 0);
  EXPECT_GT(g1.submitted, 0);
  for (int follower : {2, 4, 5}) EXPECT_EQ(cluster.WorkerStats(follower).submitted, 0) << "worker " << follower;
  // A follower refuses requests, naming rank 0.
  {
    auto w = cluster.WorkerClient(2);
    ASSERT_TRUE(w);
    rpc::WorkerGenerateRequest g;
    g.prompt = {1, 2, 3};
    g.max_new_tokens = 1;
    std::string handle;
    try {
      (*w)->Generate(handle, g);
      ADD_FAILURE() << "a follower took a request";
    } catch (const rpc::PenumbraError& e) {
      EXPECT_EQ(e.code, rpc::ErrorCode::UNAVAILABLE);
      EXPECT_NE(e.message.find("rank 0"), std::string::npos) << e.message;
    }
  }
  EXPECT_EQ(MetricValue(cluster.coordinator().metrics_port, "penumbra_coordinator_group_formed{group=\"g0\"}"), 1);
  EXPECT_EQ(MetricValue(cluster.coordinator().metrics_port, "penumbra_coordinator_group_formed{group=\"g1\"}"), 1);
}

// ShadowKV in its exact configuration (tests/worker/stories_shadowkv.h) on
// a group of two: a put document's questions give the one-process engine's
// tokens, the document attached on both ranks.
TEST_F(Groups, AShadowKvGroupAnswersAsTheOfflineEngine) {
  ClusterOptions o;
  o.workers = 0;
  o.groups = {2};
  o.worker_flags = {"--group-timeout-s",
                    "20",
                    "--kv-policy",
                    "shadowkv",
                    "--rank",
                    "32",
                    "--chunk-size",
                    "32",
                    "--budget",
                    "4096",
                    "--outliers",
                    "0",
                    "--local-window",
                    "8",
                    "--min-prompt",
                    "0",
                    "--landmarks-per-chunk",
                    "2"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 1); }, 60s)) << "the group never formed";
  const std::vector<int32_t> doc = LcgTokens(290, 51, true);
  const std::string a = Put(*c, "a", doc).id;
  ASSERT_FALSE(a.empty());
  Offline offline(ExactShadowKvOptions());
  for (int i = 0; i < 2; ++i) {
    const std::vector<int32_t> q = LcgTokens(8, 52 + i, false);
    auto r = c->Complete(Ask({a}, q, 12));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->ids, offline.About(doc, q, 12)) << "question " << i;
    EXPECT_EQ(r->usage.cached_prompt_tokens, static_cast<int64_t>(doc.size())) << "question " << i;
  }
}

// A specontext group (its retrieval head random, a budget above the
// context: exact) answers a put document's questions with the offline
// engine's tokens, each rank attaching its shard.
TEST_F(Groups, ASpeContextGroupAnswersAsTheOfflineEngine) {
  ClusterOptions o;
  o.workers = 0;
  o.groups = {2};
  o.worker_flags = {"--group-timeout-s",   "20",  "--kv-policy",        "specontext", "--specontext-head", "random",
                    "--specontext-budget", "512", "--specontext-local", "16"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 1); }, 60s)) << "the group never formed";
  const std::vector<int32_t> doc = LcgTokens(290, 53, true);
  const std::string a = Put(*c, "a", doc).id;
  ASSERT_FALSE(a.empty());
  EngineOptions eo;
  eo.backend.device = "cpu";
  eo.kv_policy = "specontext";
  eo.specontext.head = "random";
  eo.specontext.budget = 512;
  eo.specontext.local = 16;
  Offline offline(eo);
  for (int i = 0; i < 2; ++i) {
    const std::vector<int32_t> q = LcgTokens(8, 54 + i, false);
    auto r = c->Complete(Ask({a}, q, 12));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->ids, offline.About(doc, q, 12)) << "question " << i;
    EXPECT_EQ(r->usage.cached_prompt_tokens, static_cast<int64_t>(doc.size())) << "question " << i;
  }
}

// SIGKILL of a rank while its group decodes: the request goes on on the
// single worker from where it was, with the tokens of an uninterrupted run;
// the rank restarted, the coordinator forms the group again and a question
// about the document is answered there (the restarted rank lost its shard:
// the document is sent again with its ids).
TEST_F(Groups, ARankKilledMidDecodeFailsOverAndTheGroupFormsAgain) {
  ClusterOptions o;
  o.workers = 1;
  o.groups = {2};
  o.coordinator_flags = {"--group-min-tokens", "150"};
  o.worker_flags = {"--group-timeout-s", "10"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 1); }, 60s)) << "the group never formed";
  const std::vector<int32_t> doc = LcgTokens(160, 31, true);
  const std::string a = Put(*c, "a", doc).id;
  ASSERT_FALSE(a.empty());
  const std::vector<int32_t> q = LcgTokens(12, 32, false);
  auto id = c->Generate(Ask({a}, q, 330));
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<int32_t> ids;
  int64_t offset = 0;
  while (ids.size() < 10) {
    auto ch = c->Poll(*id, offset, 2000);
    ASSERT_TRUE(ch.ok()) << ch.status();
    ASSERT_FALSE(ch->done) << "finished before the kill: " << ch->finish_reason;
    ids.insert(ids.end(), ch->ids.begin(), ch->ids.end());
    offset += static_cast<int64_t>(ch->ids.size());
  }
  EXPECT_GT(cluster.WorkerStats(1).decoding, 0);  // on the group's rank 0
  const int port = cluster.worker(2).port;
  cluster.worker(2).process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.worker(2).process->Wait(10s).has_value());
  const auto t0 = std::chrono::steady_clock::now();
  rpc::GenerateChunk end = Follow(*c, *id, nullptr);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 60s) << "the request hung";
  auto whole = c->Poll(*id, 0, 0);
  ASSERT_TRUE(whole.ok()) << whole.status();
  Offline offline;
  const std::vector<int32_t> expect = offline.About(doc, q, 330);
  EXPECT_EQ(end.finish_reason, "length") << (end.__isset.error_message ? end.error_message : "");
  EXPECT_EQ(whole->ids, expect);
  EXPECT_GT(cluster.WorkerStats(0).submitted, 0) << "not resumed on the single worker";
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), whole->ids.begin()));  // what was streamed stays

  // The rank comes back (on its port, as `penumbra serve` restarts it): the
  // group is formed again and serves the document.
  ASSERT_TRUE(cluster.StartWorker(2, port));
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 1); }, 60s)) << "the group was not formed again";
  EXPECT_GE(MetricValue(cluster.coordinator().metrics_port, "penumbra_coordinator_group_formations{group=\"g0\"}"), 2);
  const std::vector<int32_t> q2 = LcgTokens(9, 33, false);
  const int64_t before = cluster.WorkerStats(1).submitted;
  auto r = c->Complete(Ask({a}, q2, 12));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ids, offline.About(doc, q2, 12));
  EXPECT_GT(cluster.WorkerStats(1).submitted, before) << "not answered by the group";
}

// Continuous batching on a group of two: requests join a running batch at
// step boundaries (three questions decode together), one is cancelled
// mid-decode (finish "cancelled", its slot freed), one has a deadline it
// cannot meet (DEADLINE_EXCEEDED, on time), and the others end with the
// offline engine's tokens; the group serves on. The follower's runtime runs
// every one of these steps (the ranks agree on every step, or the group
// would break).
TEST_F(Groups, AGroupBatchesCancelsAndKeepsDeadlines) {
  ClusterOptions o;
  o.workers = 0;
  o.groups = {2};
  o.worker_flags = {"--group-timeout-s", "20"};
  Cluster cluster(o);
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 1); }, 60s)) << "the group never formed";
  const std::vector<int32_t> doc = LcgTokens(220, 41, true);
  const std::string a = Put(*c, "a", doc).id;
  ASSERT_FALSE(a.empty());
  Offline offline;

  // A long request, then two more that join it while it decodes.
  const std::vector<int32_t> q_long = LcgTokens(7, 42, false), q1 = LcgTokens(5, 43, false),
                             q2 = LcgTokens(9, 44, false);
  auto long_id = c->Generate(Ask({a}, q_long, 250));
  ASSERT_TRUE(long_id.ok()) << long_id.status();
  ASSERT_TRUE(c->Poll(*long_id, 0, 5000).ok());
  auto id1 = c->Generate(Ask({a}, q1, 40));
  auto id2 = c->Generate(Ask({a}, q2, 60));
  ASSERT_TRUE(id1.ok()) << id1.status();
  ASSERT_TRUE(id2.ok()) << id2.status();
  EXPECT_TRUE(Eventually([&] { return cluster.WorkerStats(0).decoding >= 2; }, 30s))
      << "the requests never decoded together";
  // Cancel the long one mid-decode.
  ASSERT_TRUE(c->Cancel(*long_id).ok());
  const rpc::GenerateChunk cancelled = Follow(*c, *long_id);
  EXPECT_EQ(cancelled.finish_reason, "cancelled");
  EXPECT_LT(cancelled.usage.generated_tokens, 250);
  // The others end as the offline engine's.
  std::vector<int32_t> got1, got2;
  const rpc::GenerateChunk end1 = Follow(*c, *id1, &got1), end2 = Follow(*c, *id2, &got2);
  EXPECT_EQ(end1.finish_reason, "length");
  EXPECT_EQ(end2.finish_reason, "length");
  EXPECT_EQ(got1, offline.About(doc, q1, 40));
  EXPECT_EQ(got2, offline.About(doc, q2, 60));

  // A deadline the group cannot meet: typed, on time.
  {
    auto r = Ask({a}, LcgTokens(6, 45, false), 250);
    r.deadline_ms = 40;
    const auto t0 = std::chrono::steady_clock::now();
    auto late = c->Complete(r);
    EXPECT_EQ(late.status().code(), StatusCode::kDeadlineExceeded) << late.status();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  }
  // Nothing is left running, and the group still answers.
  EXPECT_TRUE(Eventually([&] { return cluster.WorkerStats(0).decoding == 0; }, 30s));
  EXPECT_TRUE(GroupsFormed(*c, 1));
  const std::vector<int32_t> q3 = LcgTokens(8, 46, false);
  auto r = c->Complete(Ask({a}, q3, 10));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ids, offline.About(doc, q3, 10));
  EXPECT_GE(cluster.WorkerStats(0).cancelled, 1);
}

// A coordinator killed and restarted on its data directory finds the group
// formed (it does not form it again) and the document the group holds.
TEST_F(Groups, PutsAndQuestionsOnAGroupSurviveACoordinatorRestart) {
  ClusterOptions o;
  o.workers = 0;
  o.groups = {2};
  o.worker_flags = {"--group-timeout-s", "20"};
  Cluster cluster(o);
  const std::string data = cluster.dir() + "/data";
  cluster.options().coordinator_flags = {"--data-dir", data};
  ASSERT_TRUE(cluster.Start());
  auto c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 1); }, 60s)) << "the group never formed";
  const std::vector<int32_t> doc = LcgTokens(280, 41, true);
  const std::string a = Put(*c, "a", doc).id;
  ASSERT_FALSE(a.empty());
  cluster.coordinator().process->Signal(SIGKILL);
  ASSERT_TRUE(cluster.coordinator().process->Wait(10s).has_value());
  ASSERT_TRUE(cluster.StartCoordinator());
  c = cluster.Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(Eventually([&] { return GroupsFormed(*c, 1); }, 60s));
  EXPECT_EQ(MetricValue(cluster.coordinator().metrics_port, "penumbra_coordinator_group_formations{group=\"g0\"}"), 0)
      << "a formed group was formed again";
  Offline offline;
  const std::vector<int32_t> q = LcgTokens(10, 42, false);
  auto r = c->Complete(Ask({a}, q, 10));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ids, offline.About(doc, q, 10));
  EXPECT_EQ(r->usage.cached_prompt_tokens, static_cast<int64_t>(doc.size()));
}

}  // namespace
}  // namespace penumbra::testing
