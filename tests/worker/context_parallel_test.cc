// Context parallel on the CPU backend (stories260K, f32), the ranks as
// threads (tests/worker/thread_group.h): a sequence split into contiguous
// shards over 2 or 3 runtimes gives the greedy tokens of the same sequence
// unsharded (full attention; ShadowKV configured to select every chunk at
// full rank, so that it is exact too); lossy ShadowKV with the global
// selection over the shards gives the unsharded lossy tokens; with the local
// selection the shards agree on every token across ranks and start with the
// unsharded first token (the prefill is exact); SpeContext's shards agree on
// the unsharded top-k of each step; what a shard cannot do is refused. A group under the scheduler's steps, with the
// document cache and led mode: tests/parallel/group_steps_test.cc. The same over real processes and TCP (plaintext and
// mutual TLS): tests/parallel/context_parallel_integration_test.cc.
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "tests/worker/stories_shadowkv.h"
#include "tests/worker/thread_group.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

class ContextParallelTest : public testing::StoriesTest {};

EngineOptions FullOptions() {
  EngineOptions o;
  o.backend.device = "cpu";
  o.backend.cpu_threads = 1;
  o.kv_policy = "full";
  o.runtime.prefill_chunk = 48;  // several chunks per shard
  return o;
}

// ShadowKV that loses nothing (stories_shadowkv.h).
EngineOptions ExactShadowKvOptions() {
  EngineOptions o = testing::ExactShadowKvOptions();
  o.backend.cpu_threads = 1;
  o.runtime.prefill_chunk = 48;
  return o;
}

std::vector<GenerationRequest> Requests(const std::vector<int>& lengths, int new_tokens) {
  std::vector<GenerationRequest> out;
  for (size_t i = 0; i < lengths.size(); ++i) {
    GenerationRequest r;
    r.prompt = testing::LcgTokens(lengths[i], 100 + i, true);
    r.max_new_tokens = new_tokens;
    out.push_back(r);
  }
  return out;
}

std::vector<std::vector<int32_t>> Unsharded(const EngineOptions& o, const std::vector<GenerationRequest>& reqs) {
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  auto r = (*e)->runtime().Generate(reqs);
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<std::vector<int32_t>> ids;
  if (r.ok()) {
    for (const auto& g : *r) ids.push_back(g.ids);
  }
  return ids;
}

// Every rank's tokens (ranks as threads, each with its own engine, rank r
// with options_of(r)); each rank's status into *status when given, else
// expected OK.
std::vector<std::vector<std::vector<int32_t>>> Sharded(const std::function<EngineOptions(int)>& options_of, int world,
                                                       const std::vector<GenerationRequest>& reqs,
                                                       std::vector<Status>* statuses = nullptr) {
  testing::ThreadGroup group(world);
  std::vector<std::vector<std::vector<int32_t>>> ids(static_cast<size_t>(world));
  std::vector<Status> status(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Collective> member = group.Member(r);
      auto e = Engine::Open(testing::StoriesDir(), options_of(r));
      if (!e.ok()) {
        status[r] = e.status();
        std::abort();  // the others would wait at the barrier forever
      }
      status[r] = (*e)->runtime().SetContextGroup(member.get());
      if (!status[r].ok()) std::abort();
      auto g = (*e)->runtime().Generate(reqs);
      status[r] = g.status();
      if (g.ok()) {
        for (const auto& x : *g) ids[r].push_back(x.ids);
      }
    });
  }
  for (auto& t : threads) t.join();
  if (statuses != nullptr) {
    *statuses = status;
  } else {
    for (int r = 0; r < world; ++r) EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  }
  return ids;
}

std::vector<std::vector<std::vector<int32_t>>> Sharded(const EngineOptions& o, int world,
                                                       const std::vector<GenerationRequest>& reqs) {
  return Sharded([&o](int) { return o; }, world, reqs);
}

TEST(ShardOfTest, SplitsIntoContiguousNonEmptyAlignedShards) {
  for (int world : {1, 2, 3, 5}) {
    for (int64_t tokens : {int64_t{5}, int64_t{64}, int64_t{300}, int64_t{2097152}, int64_t{2097153}}) {
      if (tokens < world) continue;
      int64_t at = 0;
      for (int r = 0; r < world; ++r) {
        const Runtime::Shard s = Runtime::ShardOf(tokens, r, world);
        EXPECT_EQ(s.begin, at) << tokens << " tokens, rank " << r << " of " << world;
        EXPECT_GT(s.end, s.begin) << tokens << " tokens, rank " << r << " of " << world;
        if (tokens >= 64 * world && r > 0) {
          EXPECT_EQ(s.begin % 64, 0);
        }
        at = s.end;
      }
      EXPECT_EQ(at, tokens);
    }
  }
  EXPECT_EQ(Runtime::ShardOf(2097152, 1, 2).begin, 1048576);
}

TEST_F(ContextParallelTest, FullAttentionShardedGivesTheUnshardedTokens) {
  const auto reqs = Requests({300, 190}, 24);
  const auto want = Unsharded(FullOptions(), reqs);
  ASSERT_EQ(want.size(), 2u);
  for (int world : {2, 3}) {
    const auto got = Sharded(FullOptions(), world, reqs);
    for (int r = 0; r < world; ++r) EXPECT_EQ(got[r], want) << "rank " << r << " of " << world;
  }
}

TEST_F(ContextParallelTest, ExactShadowKvShardedGivesTheUnshardedTokens) {
  const auto reqs = Requests({300}, 24);
  const auto want = Unsharded(ExactShadowKvOptions(), reqs);
  const auto full = Unsharded(FullOptions(), reqs);
  ASSERT_EQ(want.size(), 1u);
  EXPECT_EQ(want, full) << "the exact ShadowKV configuration is not exact";
  for (int world : {2, 3}) {
    const auto got = Sharded(ExactShadowKvOptions(), world, reqs);
    for (int r = 0; r < world; ++r) EXPECT_EQ(got[r], want) << "rank " << r << " of " << world;
  }
}

// The balanced prefill (RuntimeOptions::cp_prefill_balance: the later
// ranks hand half their rows' attention over the earlier keys to the
// earlier ranks), in several rounds, and the unbalanced one give the
// unsharded tokens.
TEST_F(ContextParallelTest, BalancedPrefillInRoundsAndUnbalancedGiveTheUnshardedTokens) {
  for (const EngineOptions& base : {FullOptions(), ExactShadowKvOptions()}) {
    // ExactShadowKvShardedGivesTheUnshardedTokens' request for ShadowKV.
    const auto reqs = base.kv_policy == "full" ? Requests({300, 190}, 16) : Requests({300}, 16);
    const auto want = Unsharded(base, reqs);
    ASSERT_EQ(want.size(), reqs.size());
    for (bool balance : {false, true}) {
      EngineOptions o = base;
      o.runtime.cp_prefill_balance = balance;
      o.runtime.cp_balance_round_rows = 40;  // rounds of 40 rows, prefill chunks of 48
      for (int world : {2, 3}) {
        const auto got = Sharded(o, world, reqs);
        for (int r = 0; r < world; ++r) {
          EXPECT_EQ(got[r], want) << base.kv_policy << ", balance " << balance << ", rank " << r << " of " << world;
        }
      }
    }
  }
}

TEST_F(ContextParallelTest, RanksThatWouldExchangeDifferentlyAreRefusedOnEveryRank) {
  const auto reqs = Requests({300}, 4);
  std::vector<Status> statuses;
  const auto got = Sharded(
      [](int r) {
        EngineOptions o = FullOptions();
        o.runtime.cp_balance_round_rows = r == 1 ? 64 : 8192;
        return o;
      },
      2, reqs, &statuses);
  ASSERT_EQ(statuses.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("cp_balance_round_rows"), std::string::npos) << statuses[r];
  }
}

EngineOptions GlobalSelectionOptions() {
  EngineOptions o = testing::GlobalSelectionShadowKvOptions();
  o.backend.cpu_threads = 1;
  return o;
}

TEST_F(ContextParallelTest, LossyShadowKvWithGlobalSelectionGivesTheUnshardedTokens) {
  // Two sequences of different geometry (two groups per step, each with its
  // own score workspace between the exchanges); shards at multiples of 64.
  const auto reqs = Requests({300, 260}, 24);
  const EngineOptions o = GlobalSelectionOptions();
  const auto want = Unsharded(o, reqs);
  ASSERT_EQ(want.size(), 2u);
  // The configuration is lossy: the selection matters.
  EXPECT_NE(want, Unsharded(FullOptions(), reqs));
  for (int world : {2, 3}) {
    const auto got = Sharded(o, world, reqs);
    for (int r = 0; r < world; ++r) EXPECT_EQ(got[r], want) << "rank " << r << " of " << world;
  }
}

// The same with two landmarks per chunk: the shards' statistics and
// proposals come from scoring landmark rows, the selection stays per chunk.
TEST_F(ContextParallelTest, GlobalSelectionWithTwoLandmarksPerChunkGivesTheUnshardedTokens) {
  const auto reqs = Requests({300, 260}, 24);
  EngineOptions o = GlobalSelectionOptions();
  o.shadowkv.landmarks_per_chunk = 2;
  const auto want = Unsharded(o, reqs);
  ASSERT_EQ(want.size(), 2u);
  EXPECT_NE(want, Unsharded(FullOptions(), reqs));
  const auto got = Sharded(o, 2, reqs);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(got[r], want) << "rank " << r;
}

TEST_F(ContextParallelTest, LossyShadowKvShardsAgreeAndStartWithTheExactToken) {
  EngineOptions o = testing::LossyShadowKvOptions();
  o.backend.cpu_threads = 1;
  o.shadowkv.shard_selection = "local";
  const auto reqs = Requests({300}, 30);  // the last shard makes chunks of its new tokens
  const auto want = Unsharded(o, reqs);
  ASSERT_EQ(want.size(), 1u);
  const auto got = Sharded(o, 2, reqs);
  ASSERT_EQ(got[0].size(), 1u);
  EXPECT_EQ(got[0], got[1]);
  ASSERT_EQ(got[0][0].size(), 30u);
  EXPECT_EQ(got[0][0][0], want[0][0]);  // from the prefill, exact under both
}

// SpeContext with a random retrieval head and a budget of 24 of ~300 tokens
// (lossy): the shards' global top-k per step is the unsharded selection.
EngineOptions SpeContextOptions(int successors) {
  EngineOptions o;
  o.backend.device = "cpu";
  o.backend.cpu_threads = 1;
  o.kv_policy = "specontext";
  o.specontext.head = "random";
  o.specontext.budget = 24;
  o.specontext.local = 16;
  o.specontext.successors = successors;
  o.runtime.prefill_chunk = 48;
  return o;
}

TEST_F(ContextParallelTest, SpeContextWithGlobalSelectionGivesTheUnshardedTokens) {
  // Two sequences of different capacities: two groups a step, each scoring
  // in its own workspace part between the exchanges.
  const auto reqs = Requests({300, 260}, 24);
  const EngineOptions o = SpeContextOptions(/*successors=*/0);
  const auto want = Unsharded(o, reqs);
  ASSERT_EQ(want.size(), 2u);
  EXPECT_NE(want, Unsharded(FullOptions(), reqs)) << "the configuration is not lossy";
  for (int world : {2, 3}) {
    const auto got = Sharded(o, world, reqs);
    for (int r = 0; r < world; ++r) EXPECT_EQ(got[r], want) << "rank " << r << " of " << world;
  }
}

// With successors, a shard's first tokens are not lifted by the previous
// shard's last ones: the ranks still agree on every token, and the first
// (the prefill's, exact) is the unsharded one.
TEST_F(ContextParallelTest, SpeContextShardsWithSuccessorsAgreeAndStartWithTheExactToken) {
  const auto reqs = Requests({300}, 24);
  const EngineOptions o = SpeContextOptions(/*successors=*/4);
  const auto want = Unsharded(o, reqs);
  ASSERT_EQ(want.size(), 1u);
  const auto got = Sharded(o, 2, reqs);
  ASSERT_EQ(got[0].size(), 1u);
  EXPECT_EQ(got[0], got[1]);
  ASSERT_EQ(got[0][0].size(), 24u);
  EXPECT_EQ(got[0][0][0], want[0][0]);
}

TEST_F(ContextParallelTest, WhatAShardCannotDoIsRefused) {
  testing::ThreadGroup group(2);
  auto member = group.Member(1);
  EngineOptions o = FullOptions();
  o.runtime.prefix_cache_bytes = 1 << 20;  // a shard's document cache (tests/parallel/group_steps_test.cc)
  auto e = Engine::Open(testing::StoriesDir(), o);
  ASSERT_TRUE(e.ok()) << e.status();
  Runtime& rt = (*e)->runtime();
  ASSERT_TRUE(rt.SetContextGroup(member.get()).ok());
  // Too short to split: refused before anything is held (every rank alike).
  EXPECT_EQ(rt.AddSequence(3, 1, 4).code(), StatusCode::kInvalidArgument);
  // Led mode is rank 0's; following is the other ranks'.
  EXPECT_EQ(rt.LeadGroup().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt.StopGroup().code(), StatusCode::kFailedPrecondition);
  // A shard attaches only a capture of exactly its own tokens.
  SequenceSpec spec;
  spec.prompt_len = 100;
  spec.shard.position_base = 100;
  spec.shard.closed = true;
  ASSERT_TRUE(rt.policy().AddSequence(7, spec).ok());
  ASSERT_TRUE(rt.policy().SynthesizeContext(7, 100, 1).ok());
  auto captured = rt.policy().CapturePrefix(7, 100);
  ASSERT_TRUE(captured.ok()) << captured.status();
  EXPECT_EQ((*captured)->tokens(), 100);
  spec.prefix = *captured;
  spec.prompt_len = 120;
  EXPECT_EQ(rt.policy().AddSequence(8, spec).code(), StatusCode::kInvalidArgument);
  rt.policy().RemoveSequence(7);
}

}  // namespace
}  // namespace penumbra
