// ShadowKV micro-batches (shadowkv.micro_batches > 1): each decode batch of
// same-geometry sequences is split into micro-batches whose selection, value
// fetch and attention are pipelined per layer. The result must not change:
// every logit of every step equals the single-batch run, on the CPU backend
// (where the side stream is the main one, so this checks the reordered
// bookkeeping: per-group miss lists, scores, pointer tables and attention
// arguments), with the sparse path active and generated tokens compressed.
#include <gtest/gtest.h>

#include <algorithm>

#include "tests/test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

class ShadowkvMicroBatchTest : public testing::StoriesTest {};

EngineOptions Options(int micro_batches) {
  EngineOptions o = testing::LossyShadowKvOptions();
  o.shadowkv.micro_batches = micro_batches;
  return o;
}

// Prefills `n` sequences of equal length (one geometry group) with different
// tokens, then decodes them together greedily; returns every step's logits.
std::vector<float> DecodeAll(int micro_batches, int n, int steps, int64_t* misses) {
  auto e = Engine::Open(testing::StoriesDir(), Options(micro_batches));
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  Runtime& rt = (*e)->runtime();
  const int V = rt.config().vocab_size;
  std::vector<int64_t> ids, positions;
  std::vector<int32_t> tokens;
  uint64_t x = 99;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> prompt = {1};
    for (int t = 1; t < 150; ++t) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      prompt.push_back(static_cast<int32_t>(3 + (x >> 33) % (V - 3)));
    }
    EXPECT_TRUE(rt.AddSequence(i, static_cast<int64_t>(prompt.size()), steps + 1).ok());
    std::vector<float> logits;
    EXPECT_TRUE(rt.Prefill(i, prompt, &logits).ok());
    ids.push_back(i);
    tokens.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    positions.push_back(static_cast<int64_t>(prompt.size()));
  }
  std::vector<float> all, host(static_cast<size_t>(n) * V);
  for (int s = 0; s < steps; ++s) {
    auto dev = rt.DecodeStep(ids, tokens, positions);
    EXPECT_TRUE(dev.ok()) << dev.status();
    if (!dev.ok()) return {};
    EXPECT_TRUE(rt.backend().CopyToHost(host.data(), *dev, host.size() * sizeof(float)).ok());
    all.insert(all.end(), host.begin(), host.end());
    for (int i = 0; i < n; ++i) {
      const float* row = host.data() + static_cast<size_t>(i) * V;
      tokens[i] = static_cast<int32_t>(std::max_element(row, row + V) - row);
      ++positions[i];
    }
  }
  const PolicyStats st = rt.policy().stats();
  *misses = st.selected_chunks - st.hit_chunks;
  return all;
}

TEST_F(ShadowkvMicroBatchTest, SameLogitsAsOneBatch) {
  constexpr int kSeqs = 5, kSteps = 10;
  int64_t misses1 = 0;
  const std::vector<float> one = DecodeAll(1, kSeqs, kSteps, &misses1);
  ASSERT_FALSE(one.empty());
  ASSERT_GT(misses1, 0) << "the sparse path must fetch values";
  for (int mb : {2, 3, 5}) {
    SCOPED_TRACE(::testing::Message() << "micro_batches " << mb);
    int64_t misses = 0;
    const std::vector<float> got = DecodeAll(mb, kSeqs, kSteps, &misses);
    ASSERT_EQ(got.size(), one.size());
    EXPECT_EQ(misses, misses1);
    EXPECT_TRUE(testing::AllClose(got, one, 0.0, 0.0));
  }
}

TEST_F(ShadowkvMicroBatchTest, OutOfRangeIsRefused) {
  for (int mb : {0, 17}) {
    auto e = Engine::Open(testing::StoriesDir(), Options(mb));
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().ToString().find("micro_batches"), std::string::npos) << e.status();
  }
}

}  // namespace
}  // namespace penumbra
