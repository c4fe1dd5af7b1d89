// A context group under the scheduler's steps (label distributed): ranks as
// threads of this process, each with its own CPU engine (stories260K), joined
// over TCP on loopback (ConnectTcpCollective). A document and a question go
// through BeginPrefill/PrefillStep under groups of 2 and 3 (the document
// sharded, the question fed to the last rank as decode steps), uncached and
// then attached from every rank's document cache, and give the greedy tokens
// of Generate under the same group and of one process without a group, for
// full attention, exact ShadowKV and SpeContext at a budget above the
// context; a shard dropped on one rank makes every
// rank prefill (ids not sent: every rank FailedPrecondition); a step failing
// on one rank fails on every rank, naming it; led mode runs a Scheduler over
// rank 0 with the other ranks following (a put, questions, a request without
// documents, a forget), an idle led group outlives the collective's timeout,
// and a follower whose collective closes mid-run fails the leader's requests
// in bounded time (GroupHealth says why; a re-formed group attaches from the
// kept caches); each rank's persistent tier gives a fresh group its shards
// from disk.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <functional>
#include <thread>

#include "tests/test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/document_keys.h"
#include "worker/engine/engine.h"
#include "worker/parallel/process_group.h"
#include "worker/service/scheduler.h"

namespace penumbra {
namespace {

using namespace std::chrono_literals;

constexpr int kDocTokens = 300;
constexpr int kNewTokens = 12;

EngineOptions Options(const std::string& policy, const std::string& store = "") {
  EngineOptions o = policy == "shadowkv" ? testing::ExactShadowKvOptions() : EngineOptions{};
  if (policy == "specontext") {
    // Exact too: a budget above every sequence here selects all its tokens
    // (the lossy selection across shards: context_parallel_test.cc).
    o.specontext.head = "random";
    o.specontext.budget = 512;
    o.specontext.local = 16;
  }
  o.backend.device = "cpu";
  o.backend.cpu_threads = 1;
  o.kv_policy = policy;
  o.runtime.prefill_chunk = 48;
  o.runtime.prefix_cache_bytes = 64 << 20;
  if (!store.empty()) {
    o.prefix_store.path = store;
    o.prefix_store.sync_commit = false;
  }
  return o;
}

// A document (kDocTokens) and a question of `question` tokens (seed `q`).
GenerationRequest DocRequest(uint64_t q, int question = 8, const std::string& ns = "") {
  GenerationRequest r;
  r.prompt = testing::LcgTokens(kDocTokens, 21, true);
  const auto tail = testing::LcgTokens(question, q, false);
  r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
  r.document_ends = {kDocTokens};
  r.max_new_tokens = kNewTokens;
  r.cache_namespace = ns;
  return r;
}

// The document's put: prefilled and captured, nothing generated.
GenerationRequest PutRequest() {
  GenerationRequest r;
  r.prompt = testing::LcgTokens(kDocTokens, 21, true);
  r.document_ends = {kDocTokens};
  r.max_new_tokens = 0;
  return r;
}

// One process, no group.
std::vector<std::vector<int32_t>> Alone(const std::string& policy, const std::vector<GenerationRequest>& reqs) {
  auto e = Engine::Open(testing::StoriesDir(), Options(policy));
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  std::vector<std::vector<int32_t>> out;
  for (const auto& r : reqs) {
    auto g = (*e)->runtime().Generate({r});
    EXPECT_TRUE(g.ok()) << g.status();
    out.push_back(g.ok() ? (*g)[0].ids : std::vector<int32_t>{});
  }
  return out;
}

// A group of `world` ranks over TCP on loopback (member r is rank r's).
std::vector<std::unique_ptr<Collective>> Connect(int world, double timeout_s = 20) {
  auto listener = CollectiveListener::Bind("127.0.0.1", 0);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return {};
  const std::string at = "127.0.0.1:" + std::to_string((*listener)->port());
  std::vector<std::unique_ptr<Collective>> members(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CollectiveOptions o;
      o.rank = r;
      o.world = world;
      o.rendezvous = at;
      o.timeout_s = timeout_s;
      auto c = ConnectTcpCollective(o, r == 0 ? std::move(*listener) : nullptr);
      EXPECT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
      if (c.ok()) members[static_cast<size_t>(r)] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& m : members) {
    if (!m) return {};
  }
  return members;
}

// fn(rank) on a thread per rank.
void OnEveryRank(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { fn(r); });
  for (auto& t : threads) t.join();
}

// A group's engines (one per rank, in the group).
struct Group {
  std::vector<std::unique_ptr<Collective>> members;
  std::vector<std::unique_ptr<Engine>> engines;
  Runtime& rt(int r) { return engines[static_cast<size_t>(r)]->runtime(); }
  int world() const { return static_cast<int>(engines.size()); }
};

std::unique_ptr<Group> MakeGroup(int world, const std::string& policy, const std::vector<std::string>& stores = {}) {
  auto g = std::make_unique<Group>();
  g->members = Connect(world);
  if (g->members.empty()) return nullptr;
  for (int r = 0; r < world; ++r) {
    auto e = Engine::Open(testing::StoriesDir(),
                          Options(policy, stores.empty() ? std::string() : stores[static_cast<size_t>(r)]));
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    g->engines.push_back(std::move(*e));
    Status s = g->engines.back()->runtime().SetContextGroup(g->members[static_cast<size_t>(r)].get());
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return nullptr;
  }
  return g;
}

struct Outcome {
  Status status;
  std::vector<int32_t> ids;
  int64_t cached = -1;
};

// What the scheduler does, on one rank of an SPMD group: BeginPrefill, the
// prefill in steps of `step` tokens' work, then greedy decoding (every rank
// has the same logits).
Outcome Steps(Runtime& rt, int64_t seq, const GenerationRequest& q, int64_t step = 100) {
  Outcome out;
  Runtime::PrefillState st;
  GenerationResult res;
  out.status = rt.BeginPrefill(seq, q, &st, &res);
  if (!out.status.ok()) return out;
  out.cached = res.cached_prompt_tokens;
  const int V = rt.config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  auto argmax = [&](const float* dev) -> int32_t {
    Status s = rt.backend().CopyToHost(logits.data(), dev, logits.size() * sizeof(float));
    EXPECT_TRUE(s.ok()) << s;
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  };
  for (;;) {
    Result<bool> done = rt.PrefillStep(seq, q, &st, step);
    if (!done.ok()) {
      out.status = done.status();
      rt.RemoveSequence(seq);
      return out;
    }
    if (*done) break;
  }
  out.ids.push_back(argmax(rt.LastLogits()));
  while (static_cast<int>(out.ids.size()) < q.max_new_tokens) {
    const int64_t pos = static_cast<int64_t>(q.prompt.size() + out.ids.size()) - 1;
    Result<const float*> l = rt.DecodeStep({seq}, {out.ids.back()}, {pos});
    if (!l.ok()) {
      out.status = l.status();
      break;
    }
    out.ids.push_back(argmax(*l));
  }
  rt.RemoveSequence(seq);
  return out;
}

// Steps on every rank of the group.
std::vector<Outcome> GroupSteps(Group& g, int64_t seq, const GenerationRequest& q) {
  std::vector<Outcome> out(static_cast<size_t>(g.world()));
  OnEveryRank(g.world(), [&](int r) { out[static_cast<size_t>(r)] = Steps(g.rt(r), seq, q); });
  return out;
}

struct Case {
  std::string policy;
  int world;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.policy << " over " << c.world << " ranks"; }

class GroupStepsTest : public testing::StoriesTest, public ::testing::WithParamInterface<Case> {};

TEST_P(GroupStepsTest, DocumentAndQuestionGiveTheOneProcessTokensUncachedAndAttached) {
  const Case c = GetParam();
  const GenerationRequest q1 = DocRequest(31), q2 = DocRequest(32, 5);
  const auto want = Alone(c.policy, {q1, q2});
  ASSERT_EQ(want[0].size(), static_cast<size_t>(kNewTokens));
  auto g = MakeGroup(c.world, c.policy);
  ASSERT_NE(g, nullptr);
  for (int pass = 0; pass < 2; ++pass) {  // uncached, then attached on every rank
    const auto got = GroupSteps(*g, 10 + pass, q1);
    for (int r = 0; r < c.world; ++r) {
      ASSERT_TRUE(got[r].status.ok()) << "rank " << r << ": " << got[r].status;
      EXPECT_EQ(got[r].ids, want[0]) << "rank " << r << " pass " << pass;
      EXPECT_EQ(got[r].cached, pass == 0 ? 0 : kDocTokens) << "rank " << r;
    }
  }
  // Generate under the group takes the same steps (attached: another question).
  std::vector<Result<std::vector<GenerationResult>>> gen(static_cast<size_t>(c.world), Status::Internal("not run"));
  OnEveryRank(c.world, [&](int r) { gen[static_cast<size_t>(r)] = g->rt(r).Generate({q2}); });
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(gen[r].ok()) << "rank " << r << ": " << gen[r].status();
    EXPECT_EQ((*gen[r])[0].ids, want[1]) << "rank " << r;
    EXPECT_EQ((*gen[r])[0].cached_prompt_tokens, kDocTokens);
  }
}

TEST_P(GroupStepsTest, AShardDroppedOnOneRankIsPrefilledOnEveryRank) {
  const Case c = GetParam();
  const GenerationRequest q = DocRequest(33);
  const auto want = Alone(c.policy, {q});
  auto g = MakeGroup(c.world, c.policy);
  ASSERT_NE(g, nullptr);
  auto drop_last_rank_shard = [&] {
    Runtime& rt = g->rt(c.world - 1);
    DocumentCache* cache = rt.document_cache();
    auto keys = cache->Keys(q.cache_namespace, DocumentDigests(q.prompt, q.document_ends), q.document_ends);
    auto dropped = cache->Forget(keys);
    ASSERT_TRUE(dropped.ok()) << dropped.status();
    EXPECT_EQ(*dropped, 1);
  };
  ASSERT_TRUE(GroupSteps(*g, 1, q)[0].status.ok());
  drop_last_rank_shard();
  for (const Outcome& o : GroupSteps(*g, 2, q)) {  // not attached anywhere, captured again where missing
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.cached, 0);
    EXPECT_EQ(o.ids, want[0]);
  }
  for (const Outcome& o : GroupSteps(*g, 3, q)) {
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.cached, kDocTokens);
    EXPECT_EQ(o.ids, want[0]);
  }
  // The ids not sent: attached (every rank holds its shard), or, once one
  // rank has lost it, the same FailedPrecondition on every rank.
  GenerationRequest bare = q;
  bare.document_digests = DocumentDigests(q.prompt, q.document_ends);
  bare.ids_from = kDocTokens;
  std::fill(bare.prompt.begin(), bare.prompt.begin() + kDocTokens, 0);
  for (const Outcome& o : GroupSteps(*g, 4, bare)) {
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.ids, want[0]);
  }
  drop_last_rank_shard();
  const auto refused = GroupSteps(*g, 5, bare);
  for (const Outcome& o : refused) {
    EXPECT_EQ(o.status.code(), StatusCode::kFailedPrecondition) << o.status;
    EXPECT_EQ(o.status.message(), refused[0].status.message());
  }
}

class GroupAgreementTest : public testing::StoriesTest {};

TEST_F(GroupAgreementTest, AStepFailingOnOneRankFailsOnEveryRankAndLeavesNothing) {
  const int world = 2;
  auto g = MakeGroup(world, "full");
  ASSERT_NE(g, nullptr);
  // Sequence 50 exists on rank 1 only: adding its shard fails there.
  ASSERT_TRUE(g->rt(1).policy().AddSequence(50, 10, 4).ok());
  const GenerationRequest q = DocRequest(43);
  const auto got = GroupSteps(*g, 50, q);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(got[r].status.code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << got[r].status;
    EXPECT_NE(got[r].status.message().find("context group rank 1"), std::string::npos) << got[r].status;
    EXPECT_EQ(got[r].status.message(), got[0].status.message());
  }
  g->rt(1).policy().RemoveSequence(50);
  // Rank 0 kept nothing of it: the same sequence goes through now.
  const auto want = Alone("full", {q});
  for (const Outcome& o : GroupSteps(*g, 50, q)) {
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.ids, want[0]);
  }
}

TEST_P(GroupStepsTest, EachRanksPersistentTierGivesAFreshGroupItsShards) {
  const Case c = GetParam();
  const GenerationRequest q = DocRequest(34);
  const auto want = Alone(c.policy, {q});
  const std::filesystem::path base =
      std::filesystem::temp_directory_path() / ("penumbra-group-steps-" + std::to_string(getpid()));
  std::filesystem::remove_all(base);
  std::vector<std::string> stores;
  for (int r = 0; r < c.world; ++r) {
    stores.push_back((base / ("rank" + std::to_string(r))).string());
    std::filesystem::create_directories(stores.back());
  }
  {
    auto g = MakeGroup(c.world, c.policy, stores);
    ASSERT_NE(g, nullptr);
    for (const Outcome& o : GroupSteps(*g, 1, q)) {
      ASSERT_TRUE(o.status.ok()) << o.status;
      EXPECT_EQ(o.cached, 0);
    }
    for (int r = 0; r < c.world; ++r) EXPECT_TRUE(g->rt(r).DrainPrefixStores(10s));
  }
  {
    auto g = MakeGroup(c.world, c.policy, stores);
    ASSERT_NE(g, nullptr);
    for (const Outcome& o : GroupSteps(*g, 1, q)) {
      ASSERT_TRUE(o.status.ok()) << o.status;
      EXPECT_EQ(o.cached, kDocTokens);
      EXPECT_EQ(o.ids, want[0]);
    }
    for (int r = 0; r < c.world; ++r) EXPECT_EQ(g->rt(r).stats().prefix_store_hits, 1) << "rank " << r;
  }
  std::filesystem::remove_all(base);
}

INSTANTIATE_TEST_SUITE_P(Groups, GroupStepsTest,
                         ::testing::Values(Case{"full", 2}, Case{"full", 3}, Case{"shadowkv", 2}, Case{"shadowkv", 3},
                                           Case{"specontext", 2}, Case{"specontext", 3}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const std::string& p = info.param.policy;
                           return std::string(p == "full"       ? "Full"
                                              : p == "shadowkv" ? "ShadowKv"
                                                                : "SpeContext") +
                                  std::to_string(info.param.world);
                         });

// A follower's collective that the test closes: from then on every call
// fails (the follower stops), and once its FollowGroup has returned the
// connections themselves are closed (the leader reads their end).
class Closable final : public Collective {
 public:
  explicit Closable(std::unique_ptr<Collective> inner)
      : inner_(std::move(inner)), rank_(inner_->rank()), world_(inner_->world()) {}
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Status AllGather(const void* send, void* recv, size_t bytes) override {
    PENUMBRA_RETURN_IF_ERROR(Check());
    return inner_->AllGather(send, recv, bytes);
  }
  Status Broadcast(void* buf, size_t bytes, int root) override {
    PENUMBRA_RETURN_IF_ERROR(Check());
    return inner_->Broadcast(buf, bytes, root);
  }
  Status BroadcastHost(void* buf, size_t bytes, int root) override {
    PENUMBRA_RETURN_IF_ERROR(Check());
    return inner_->BroadcastHost(buf, bytes, root);
  }
  Status AllGatherHost(const void* send, void* recv, size_t bytes) override {
    PENUMBRA_RETURN_IF_ERROR(Check());
    return inner_->AllGatherHost(send, recv, bytes);
  }
  Status Barrier() override {
    PENUMBRA_RETURN_IF_ERROR(Check());
    return inner_->Barrier();
  }
  void Fail() { failed_ = true; }
  void CloseConnections() { inner_.reset(); }  // only once nothing uses it

 private:
  Status Check() const {
    return failed_ ? Status::Unavailable("test: this rank's collective was closed") : Status::OK();
  }
  std::unique_ptr<Collective> inner_;
  int rank_, world_;
  std::atomic<bool> failed_{false};
};

class LedGroupTest : public testing::StoriesTest {};

// Submits and waits for every request; their ids (or errors).
std::vector<Result<service::RequestUpdate>> SubmitAll(service::Scheduler& s,
                                                      const std::vector<GenerationRequest>& reqs) {
  std::vector<uint64_t> ids;
  for (const auto& r : reqs) {
    auto id = s.Submit(r);
    EXPECT_TRUE(id.ok()) << id.status();
    ids.push_back(id.ok() ? *id : 0);
  }
  std::vector<Result<service::RequestUpdate>> out;
  for (uint64_t id : ids) out.push_back(s.Wait(id));
  return out;
}

TEST_F(LedGroupTest, ASchedulerOverTheLeaderGivesTheOneProcessTokens) {
  for (const char* policy : {"full", "shadowkv"}) {
    GenerationRequest plain;  // no documents: the whole prompt sharded
    plain.prompt = testing::LcgTokens(140, 41, true);
    plain.max_new_tokens = kNewTokens;
    const std::vector<GenerationRequest> questions = {DocRequest(35), DocRequest(36, 4), DocRequest(37, 11), plain};
    const auto want = Alone(policy, questions);
    const int world = 3;
    auto g = MakeGroup(world, policy);
    ASSERT_NE(g, nullptr);
    std::vector<Status> followed(world);
    std::vector<std::thread> followers;
    for (int r = 1; r < world; ++r) followers.emplace_back([&, r] { followed[r] = g->rt(r).FollowGroup(); });
    ASSERT_TRUE(g->rt(0).LeadGroup().ok());
    {
      service::SchedulerOptions so;
      so.prefill_tokens_per_step = 96;  // the document in several steps, between decode steps
      auto sched = service::Scheduler::Create(&g->rt(0), so);
      ASSERT_TRUE(sched.ok()) << sched.status();
      auto put = SubmitAll(**sched, {PutRequest()});
      ASSERT_TRUE(put[0].ok()) << put[0].status();
      EXPECT_EQ(put[0]->finish_reason, "prefilled") << put[0]->error;
      auto got = SubmitAll(**sched, questions);
      for (size_t i = 0; i < questions.size(); ++i) {
        ASSERT_TRUE(got[i].ok()) << got[i].status();
        EXPECT_EQ(got[i]->ids, want[i]) << policy << " request " << i << ": " << got[i]->error;
        EXPECT_EQ(got[i]->cached_prompt_tokens, i < 3 ? kDocTokens : 0) << policy << " request " << i;
      }
      // Forgetting the document (as the worker server does, on the loop)
      // drops every rank's shard: the next question is prefilled.
      int forgotten = -1;
      ASSERT_TRUE((*sched)
                      ->RunOnLoop([&](Runtime& rt) -> Status {
                        PENUMBRA_ASSIGN_OR_RETURN(forgotten, rt.ForgetPrefixes(questions[0]));
                        return Status::OK();
                      })
                      .ok());
      EXPECT_EQ(forgotten, world);  // one shard in each rank's memory
      auto again = SubmitAll(**sched, {questions[0]});
      ASSERT_TRUE(again[0].ok()) << again[0].status();
      EXPECT_EQ(again[0]->cached_prompt_tokens, 0);
      EXPECT_EQ(again[0]->ids, want[0]);
    }
    EXPECT_TRUE(g->rt(0).GroupHealth().ok());
    ASSERT_TRUE(g->rt(0).StopGroup().ok());
    for (auto& t : followers) t.join();
    for (int r = 1; r < world; ++r) EXPECT_TRUE(followed[r].ok()) << "rank " << r << ": " << followed[r];
  }
}

TEST_F(LedGroupTest, AnIdleGroupOutlivesTheCollectivesTimeout) {
  const int world = 2;
  std::vector<std::unique_ptr<Collective>> members = Connect(world, /*timeout_s=*/0.5);
  ASSERT_EQ(members.size(), 2u);
  std::vector<std::unique_ptr<Engine>> engines;
  for (int r = 0; r < world; ++r) {
    EngineOptions o = Options("full");
    o.runtime.group_heartbeat_ms = 100;
    auto e = Engine::Open(testing::StoriesDir(), o);
    ASSERT_TRUE(e.ok()) << e.status();
    engines.push_back(std::move(*e));
    ASSERT_TRUE(engines.back()->runtime().SetContextGroup(members[r].get()).ok());
  }
  Runtime& leader = engines[0]->runtime();
  Status followed;
  std::thread follower([&] { followed = engines[1]->runtime().FollowGroup(); });
  ASSERT_TRUE(leader.LeadGroup().ok());
  // Idle for three of the collective's timeouts (the point of the test, not
  // a wait for something): the leader's empty ops keep the follower's wait
  // short of its deadline.
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(leader.GroupHealth().ok()) << leader.GroupHealth();
  const GenerationRequest q = DocRequest(42);
  const auto want = Alone("full", {q});
  {
    auto sched = service::Scheduler::Create(&leader, {});
    ASSERT_TRUE(sched.ok()) << sched.status();
    auto got = SubmitAll(**sched, {q});
    ASSERT_TRUE(got[0].ok()) << got[0].status();
    EXPECT_EQ(got[0]->ids, want[0]) << got[0]->error;
  }
  EXPECT_TRUE(leader.StopGroup().ok());
  follower.join();
  EXPECT_TRUE(followed.ok()) << followed;
}

TEST_F(LedGroupTest, AFollowerWhoseCollectiveClosesFailsTheLeadersRequests) {
  const int world = 2;
  const double timeout_s = 10;
  std::vector<std::unique_ptr<Collective>> members = Connect(world, timeout_s);
  ASSERT_EQ(members.size(), 2u);
  auto closable = std::make_unique<Closable>(std::move(members[1]));
  Closable* follower_link = closable.get();
  members[1] = std::move(closable);
  std::vector<std::unique_ptr<Engine>> engines;
  for (int r = 0; r < world; ++r) {
    auto e = Engine::Open(testing::StoriesDir(), Options("full"));
    ASSERT_TRUE(e.ok()) << e.status();
    engines.push_back(std::move(*e));
    ASSERT_TRUE(engines.back()->runtime().SetContextGroup(members[r].get()).ok());
  }
  Runtime& leader = engines[0]->runtime();
  Status followed;
  std::thread follower([&] {
    followed = engines[1]->runtime().FollowGroup();
    follower_link->CloseConnections();  // the rank's sockets close as its process would
  });
  ASSERT_TRUE(leader.LeadGroup().ok());
  auto sched = service::Scheduler::Create(&leader, {});
  ASSERT_TRUE(sched.ok()) << sched.status();
  auto put = SubmitAll(**sched, {PutRequest()});  // every rank holds its shard of the document
  ASSERT_TRUE(put[0].ok()) << put[0].status();
  ASSERT_EQ(put[0]->finish_reason, "prefilled") << put[0]->error;
  GenerationRequest long_run;  // decodes the model's whole context
  long_run.prompt = testing::LcgTokens(64, 38, true);
  long_run.max_new_tokens = leader.config().max_position_embeddings - 64;
  auto id = (*sched)->Submit(long_run);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(testing::Eventually(
      [&] {
        auto u = (*sched)->Poll(*id, 0, 10ms);
        return u.ok() && (!u->ids.empty() || u->done);
      },
      30s, "the request decodes"));
  follower_link->Fail();
  const auto t0 = std::chrono::steady_clock::now();
  auto done = (*sched)->Wait(*id);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->finish_reason, "error");
  EXPECT_FALSE(done->error.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(static_cast<int>(timeout_s) + 5));
  follower.join();
  EXPECT_FALSE(followed.ok());
  EXPECT_FALSE(leader.GroupHealth().ok());
  // Every later request fails at once with the group's failure.
  auto next = SubmitAll(**sched, {DocRequest(39)});
  ASSERT_TRUE(next[0].ok()) << next[0].status();
  EXPECT_EQ(next[0]->finish_reason, "error");
  EXPECT_EQ(next[0]->error.code(), leader.GroupHealth().code());
  (*sched)->Stop();
  EXPECT_FALSE(leader.StopGroup().ok());  // the group is gone; led mode ends anyway

  // A new group of the same runtimes: their document caches kept the shards.
  std::vector<std::unique_ptr<Collective>> again = Connect(world, timeout_s);
  ASSERT_EQ(again.size(), 2u);
  for (int r = 0; r < world; ++r) ASSERT_TRUE(engines[r]->runtime().SetContextGroup(again[r].get()).ok());
  const GenerationRequest q = DocRequest(40);
  const auto want = Alone("full", {q});
  std::vector<Outcome> got(world);
  OnEveryRank(world, [&](int r) { got[r] = Steps(engines[r]->runtime(), 100, q); });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(got[r].status.ok()) << "rank " << r << ": " << got[r].status;
    EXPECT_EQ(got[r].cached, kDocTokens) << "rank " << r;
    EXPECT_EQ(got[r].ids, want[0]) << "rank " << r;
  }
  for (int r = 0; r < world; ++r) ASSERT_TRUE(engines[r]->runtime().SetContextGroup(nullptr).ok());
}

}  // namespace
}  // namespace penumbra
