// The specontext KV policy on the CUDA backend, on a small model of random
// weights with a random retrieval head: with a budget above the context it
// is full attention (f32 and bf16), wherever its layers live (device memory,
// pinned host memory read over the link, split); with a budget of 64 of 3000
// tokens it decodes a batch of a prefilled and a synthesized sequence, the
// host and device placements agreeing; the scores, slot update and row
// copies are ShadowKV's kernels with one-token chunks (their parity tests:
// tests/kernels/shadowkv_*_gpu_test.cc); a question attached to a put
// document answers as the whole prompt does.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/gpu_test_util.h"
#include "tests/test_util.h"
#include "tests/worker/small_gpu_model.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

class SpeContextGpuTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { PENUMBRA_SKIP_WITHOUT_GPU(); }
};

EngineOptions Options(const std::string& dtype, const std::string& policy, int budget = 4096, int device_layers = 0) {
  EngineOptions o;
  o.backend.device = "cuda";
  o.backend.dtype = dtype;
  o.kv_policy = policy;
  o.specontext.head = "random";
  o.specontext.budget = budget;
  o.specontext.local = 16;
  o.specontext.device_layers = device_layers;
  return o;
}

std::unique_ptr<Engine> Open(const EngineOptions& o) {
  auto e = Engine::OpenRandom(testing::SmallGpuModel(), o, 2026);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

TEST_P(SpeContextGpuTest, ABudgetAboveTheContextIsFullAttention) {
  const std::string dtype = GetParam();
  auto ef = Open(Options(dtype, "full"));
  ASSERT_TRUE(ef);
  const std::vector<int32_t> prompt = testing::GpuPrompt(1500);
  const testing::DeviceGreedyRun a = testing::DeviceGreedy(*ef, prompt, 12);
  for (int device_layers : {0, 1, 3}) {
    SCOPED_TRACE("device_layers " + std::to_string(device_layers));
    auto es = Open(Options(dtype, "specontext", 4096, device_layers));
    ASSERT_TRUE(es);
    const testing::DeviceGreedyRun b = testing::DeviceGreedy(*es, prompt, 12);
    ASSERT_EQ(a.logits.size(), b.logits.size());
    ASSERT_FALSE(a.logits.empty());
    // The same keys and values in another order: sums differ in rounding.
    const int V = es->config().vocab_size;
    const float tol = dtype == "f32" ? 2e-3f : 6e-2f;
    EXPECT_TRUE(testing::AllClose(std::vector<float>(b.logits.begin(), b.logits.begin() + V),
                                  std::vector<float>(a.logits.begin(), a.logits.begin() + V), tol, tol));
    if (dtype == "f32") {
      EXPECT_EQ(a.ids, b.ids);
      EXPECT_TRUE(testing::AllClose(b.logits, a.logits, tol, tol));
    }
    const PolicyStats s = es->runtime().policy().stats();
    EXPECT_GT(s.hit_rate(), 0.9) << "every selectable token stays selected";
  }
}

TEST_P(SpeContextGpuTest, ASmallBudgetDecodesAPrefilledAndASynthesizedSequence) {
  const std::vector<int32_t> prompt = testing::GpuPrompt(3000);
  std::vector<std::vector<float>> runs;
  for (int device_layers : {0, 3}) {
    auto e = Open(Options(GetParam(), "specontext", 64, device_layers));
    ASSERT_NE(e, nullptr);
    Runtime& rt = e->runtime();
    ASSERT_TRUE(rt.AddSequence(0, 3000, 10).ok());
    ASSERT_TRUE(rt.Prefill(0, prompt, nullptr).ok());
    ASSERT_TRUE(rt.AddSequence(1, 5000, 10).ok());
    ASSERT_TRUE(rt.policy().SynthesizeContext(1, 5000, 11).ok());
    const int V = e->config().vocab_size;
    std::vector<float> host(2 * V), all;
    for (int i = 0; i < 10; ++i) {
      auto l = rt.DecodeStep({0, 1}, {5 + i, 6}, {3000 + i, 5000 + i});
      ASSERT_TRUE(l.ok()) << l.status();
      ASSERT_TRUE(rt.backend().CopyToHost(host.data(), *l, host.size() * sizeof(float)).ok());
      for (float x : host) ASSERT_TRUE(std::isfinite(x));
      all.insert(all.end(), host.begin(), host.begin() + V);  // the prefilled sequence's
    }
    const PolicyStats s = rt.policy().stats();
    EXPECT_EQ(s.selected_chunks, 10 * 2 * 64 * 2);
    EXPECT_GT(s.hit_chunks, 0);
    runs.push_back(all);
  }
  // Host and device stores: the same rows copied, the same logits.
  EXPECT_TRUE(testing::AllClose(runs[0], runs[1], 1e-5f, 1e-5f));
}

// A document put (its sequence's buffers moved into it, the head's keys
// compacted) and a question attached to it read its rows in place (the
// scores as ShadowKV's shared landmarks, the copies as its shared values):
// the same tokens as the whole prompt run at once, exactly in f32 at a
// budget above the context and with finite logits at a small one.
TEST_P(SpeContextGpuTest, AQuestionAttachedToADocumentAnswersAsTheWholePrompt) {
  const std::string dtype = GetParam();
  for (int budget : {4096, 64}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    auto e = Open(Options(dtype, "specontext", budget, 1));
    ASSERT_NE(e, nullptr);
    Runtime& rt = e->runtime();
    const std::vector<int32_t> doc = testing::GpuPrompt(1200);
    ASSERT_TRUE(rt.AddSequence(0, 1200, 0).ok());
    ASSERT_TRUE(rt.Prefill(0, doc, nullptr).ok());
    auto put = rt.policy().TakePrefix(0, 1200);
    ASSERT_TRUE(put.ok()) << put.status();
    rt.RemoveSequence(0);
    std::vector<int32_t> prompt = doc;
    for (int i = 0; i < 30; ++i) prompt.push_back(9 + i);
    SequenceSpec attached;
    attached.prompt_len = static_cast<int64_t>(prompt.size());
    attached.max_new_tokens = 10;
    attached.prefix = *put;
    ASSERT_TRUE(rt.policy().AddSequence(1, attached).ok());
    std::vector<float> first;
    ASSERT_TRUE(rt.Prefill(1, prompt, &first, 1200).ok());
    const int V = e->config().vocab_size;
    std::vector<float> a(first.end() - V, first.end()), host(V);
    int32_t tok = static_cast<int32_t>(std::max_element(a.begin(), a.end()) - a.begin());
    std::vector<int32_t> ids = {tok};
    for (int i = 0; i < 10; ++i) {
      auto l = rt.DecodeStep({1}, {tok}, {static_cast<int64_t>(prompt.size()) + i});
      ASSERT_TRUE(l.ok()) << l.status();
      ASSERT_TRUE(rt.backend().CopyToHost(host.data(), *l, V * sizeof(float)).ok());
      for (float x : host) ASSERT_TRUE(std::isfinite(x));
      a.insert(a.end(), host.begin(), host.end());
      tok = static_cast<int32_t>(std::max_element(host.begin(), host.end()) - host.begin());
      ids.push_back(tok);
    }
    rt.RemoveSequence(1);
    if (budget < 4096) continue;
    auto ef = Open(Options(dtype, "full"));
    ASSERT_NE(ef, nullptr);
    const testing::DeviceGreedyRun b = testing::DeviceGreedy(*ef, prompt, 10);
    const float tol = dtype == "f32" ? 2e-3f : 6e-2f;
    EXPECT_TRUE(testing::AllClose(std::vector<float>(a.begin() + V, a.begin() + 2 * V),
                                  std::vector<float>(b.logits.begin(), b.logits.begin() + V), tol, tol));
    if (dtype == "f32") {
      EXPECT_EQ(ids, b.ids);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, SpeContextGpuTest, ::testing::Values("f32", "bf16"));

}  // namespace
}  // namespace penumbra
