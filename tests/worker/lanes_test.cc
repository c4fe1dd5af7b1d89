// Engine lanes on the CPU backend: several decode pipelines sharing one copy
// of the weights, each with its own backend, KV policy and runtime.
//  - Sequences split over 2 lanes and decoded by 2 threads at once produce,
//    step by step, exactly the logits that one lane produces decoding the
//    same groups one after the other (full and ShadowKV policies; ShadowKV
//    with the sparse path active: selection, rebuild, value fetch, and
//    compression of generated tokens).
//  - Lanes are added, serve requests like lane 0, and are destroyed cleanly,
//    also with sequences still live.
#include <gtest/gtest.h>

#include <algorithm>
#include <latch>
#include <map>
#include <thread>

#include "common/file.h"
#include "tests/test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

class LanesTest : public testing::StoriesTest {};

// The lossy ShadowKV settings (tests/worker/stories_shadowkv.h) under `policy`.
EngineOptions Options(const std::string& policy) {
  EngineOptions o = testing::LossyShadowKvOptions();
  o.kv_policy = policy;
  return o;
}

std::unique_ptr<Engine> Open(const EngineOptions& o) {
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

struct SeqSpec {
  int64_t id = 0;
  std::vector<int32_t> prompt;
};

// Distinct prompts of different lengths (ids from a fixed LCG).
std::vector<SeqSpec> MakeSeqs(int n, int vocab) {
  std::vector<SeqSpec> seqs(n);
  uint64_t x = 12345;
  for (int i = 0; i < n; ++i) {
    seqs[i].id = i;
    seqs[i].prompt = {1};
    const int len = 140 + 9 * i;
    for (int t = 1; t < len; ++t) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      seqs[i].prompt.push_back(static_cast<int32_t>(3 + (x >> 33) % (vocab - 3)));
    }
  }
  return seqs;
}

int32_t Argmax(const float* row, int n) { return static_cast<int32_t>(std::max_element(row, row + n) - row); }

// Prefills every sequence of `group` on `rt`, then decodes them together for
// `steps` greedy steps. out[id] receives the prefill's last logits followed by
// each step's logits (host copies), vocab floats each.
Status DecodeGroup(Runtime& rt, const std::vector<SeqSpec>& group, int steps,
                   std::map<int64_t, std::vector<float>>* out) {
  const int V = rt.config().vocab_size;
  std::vector<int64_t> ids;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
  for (const SeqSpec& s : group) {
    PENUMBRA_RETURN_IF_ERROR(rt.AddSequence(s.id, static_cast<int64_t>(s.prompt.size()), steps + 1));
    std::vector<float> logits;
    PENUMBRA_RETURN_IF_ERROR(rt.Prefill(s.id, s.prompt, &logits));
    (*out)[s.id] = logits;
    ids.push_back(s.id);
    tokens.push_back(Argmax(logits.data(), V));
    positions.push_back(static_cast<int64_t>(s.prompt.size()));
  }
  std::vector<float> host(group.size() * static_cast<size_t>(V));
  for (int step = 0; step < steps; ++step) {
    PENUMBRA_ASSIGN_OR_RETURN(const float* dev, rt.DecodeStep(ids, tokens, positions));
    PENUMBRA_RETURN_IF_ERROR(rt.backend().CopyToHost(host.data(), dev, host.size() * sizeof(float)));
    for (size_t i = 0; i < group.size(); ++i) {
      const float* row = host.data() + i * V;
      std::vector<float>& o = (*out)[ids[i]];
      o.insert(o.end(), row, row + V);
      tokens[i] = Argmax(row, V);
      ++positions[i];
    }
  }
  for (int64_t id : ids) rt.RemoveSequence(id);
  return rt.backend().Synchronize();
}

// 4 sequences, sequence i on lane i % 2; both lanes prefill and decode at the
// same time from their own threads. The reference decodes the same two groups
// (same batch composition, so the same GEMM shapes) one after the other on a
// single-lane engine: every logit must be identical.
void CheckLanesMatchOneLane(const std::string& policy) {
  const EngineOptions o = Options(policy);
  constexpr int kSeqs = 4, kLanes = 2, kSteps = 10;
  auto lanes = Open(o);
  auto ref = Open(o);
  ASSERT_TRUE(lanes && ref);
  auto added = lanes->AddLane();
  ASSERT_TRUE(added.ok()) << added.status();
  ASSERT_EQ(*added, 1);
  ASSERT_EQ(lanes->lanes(), kLanes);
  const int V = lanes->config().vocab_size;
  const std::vector<SeqSpec> seqs = MakeSeqs(kSeqs, V);
  std::vector<std::vector<SeqSpec>> groups(kLanes);
  for (int i = 0; i < kSeqs; ++i) groups[i % kLanes].push_back(seqs[i]);

  std::vector<std::map<int64_t, std::vector<float>>> got(kLanes);
  std::vector<Status> status(kLanes);
  std::latch go(kLanes);
  std::vector<std::thread> threads;
  for (int l = 0; l < kLanes; ++l) {
    threads.emplace_back([&, l] {
      go.arrive_and_wait();
      status[l] = DecodeGroup(lanes->runtime(l), groups[l], kSteps, &got[l]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int l = 0; l < kLanes; ++l) ASSERT_TRUE(status[l].ok()) << "lane " << l << ": " << status[l];

  std::map<int64_t, std::vector<float>> want;
  for (int l = 0; l < kLanes; ++l) {
    const Status s = DecodeGroup(ref->runtime(), groups[l], kSteps, &want);
    ASSERT_TRUE(s.ok()) << s;
  }
  const size_t per_seq = static_cast<size_t>(kSteps + 1) * V;
  for (int i = 0; i < kSeqs; ++i) {
    const std::vector<float>& g = got[i % kLanes][i];
    ASSERT_EQ(g.size(), per_seq) << "sequence " << i;
    ASSERT_EQ(want[i].size(), per_seq) << "sequence " << i;
    // Exact: same ops, same shapes, same inputs; element index / V = step
    // (0 = prefill).
    EXPECT_TRUE(testing::AllClose(g, want[i], 0.0f, 0.0f)) << policy << " sequence " << i;
  }
  // The comparison can tell sequences apart: their logits differ.
  EXPECT_FALSE(testing::AllClose(got[0][0], got[1][1], 1e-3f, 1e-3f));
  EXPECT_FALSE(testing::AllClose(got[0][0], got[0][2], 1e-3f, 1e-3f));
  if (policy == "shadowkv") {
    // The sparse path ran on both lanes (selection with misses and hits).
    for (int l = 0; l < kLanes; ++l) {
      const PolicyStats st = lanes->runtime(l).policy().stats();
      EXPECT_EQ(st.decode_steps, kSteps) << "lane " << l;
      EXPECT_GT(st.selected_chunks, 0) << "lane " << l;
      EXPECT_LT(st.hit_chunks, st.selected_chunks) << "lane " << l;
    }
    const PolicyStats a = ref->runtime().policy().stats(), b0 = lanes->runtime(0).policy().stats(),
                      b1 = lanes->runtime(1).policy().stats();
    EXPECT_EQ(a.selected_chunks, b0.selected_chunks + b1.selected_chunks);
    EXPECT_EQ(a.hit_chunks, b0.hit_chunks + b1.hit_chunks);
  }
}

TEST_F(LanesTest, FullPolicyTwoThreadsMatchOneLane) { CheckLanesMatchOneLane("full"); }

TEST_F(LanesTest, ShadowKvTwoThreadsMatchOneLane) { CheckLanesMatchOneLane("shadowkv"); }

TEST_F(LanesTest, AddLaneServesLikeLaneZeroAndDestroysCleanly) {
  for (const std::string policy : {"full", "shadowkv"}) {
    auto e = Open(Options(policy));
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e);
    EXPECT_EQ(e->lanes(), 1);
    EXPECT_EQ(&e->runtime(0), &e->runtime());
    EXPECT_EQ(&e->backend(0), &e->backend());
    for (int want = 1; want <= 2; ++want) {
      auto l = e->AddLane();
      ASSERT_TRUE(l.ok()) << l.status();
      EXPECT_EQ(*l, want);
    }
    ASSERT_EQ(e->lanes(), 3);
    EXPECT_NE(&e->runtime(2), &e->runtime(0));
    EXPECT_NE(&e->backend(2), &e->backend(0));
    EXPECT_NE(&e->runtime(2).policy(), &e->runtime(1).policy());
    EXPECT_EQ(&e->runtime(2).backend(), &e->backend(2));
    EXPECT_EQ(e->runtime(2).policy().name(), policy);
    // Same request, same answer on lane 0 and lane 2 (shared weights).
    GenerationRequest r;
    r.prompt = MakeSeqs(1, e->config().vocab_size)[0].prompt;
    r.max_new_tokens = 12;
    auto a = e->runtime(0).Generate({r});
    auto b = e->runtime(2).Generate({r});
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*a)[0].ids, (*b)[0].ids);
    // The same sequence id lives independently in two lanes, and the engine
    // is destroyed with sequences still live on lanes 0 and 1.
    for (int lane = 0; lane < 2; ++lane) {
      Runtime& rt = e->runtime(lane);
      ASSERT_TRUE(rt.AddSequence(7, static_cast<int64_t>(r.prompt.size()), 4).ok());
      ASSERT_TRUE(rt.Prefill(7, r.prompt, nullptr).ok());
    }
    e.reset();
  }
}

}  // namespace
}  // namespace penumbra
