// The spindlekv KV policy on the CUDA backend (its state in device memory,
// worker/engine/spindlekv_device_policy.cc) on a small model of random
// weights with the kernels' head size (64): with every token kept and
// nothing shared it is full attention on the same weights (f32 and bf16);
// lossy settings hold less and still decode; a synthesized context decodes
// in a batch beside a prefilled sequence; documents are refused as
// Unimplemented. The kernels' own parity tests are
// tests/kernels/spindlekv_*_gpu_test.cc.
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

class SpindleKvGpuTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

EngineOptions Options(const std::string& dtype, const std::string& policy) {
  EngineOptions o;
  o.backend.device = "cuda";
  o.backend.dtype = dtype;
  o.kv_policy = policy;
  o.spindlekv.window = 16;
  return o;
}

std::unique_ptr<Engine> Open(const EngineOptions& o) {
  auto e = Engine::OpenRandom(testing::SmallGpuModel(), o, 2026);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// r = 1 and thresholds above 1: every token kept, every key and value an
// entry of its own (unit vector in the act dtype x an f32 magnitude).
TEST_P(SpindleKvGpuTest, EverythingKeptAndNothingSharedIsFullAttention) {
  const std::string dtype = GetParam();
  EngineOptions spindle = Options(dtype, "spindlekv");
  spindle.spindlekv.reserve_ratio = 1.0;
  spindle.spindlekv.key_threshold = spindle.spindlekv.value_threshold = 1.5;
  auto ef = Open(Options(dtype, "full")), es = Open(spindle);
  ASSERT_TRUE(ef && es);
  const std::vector<int32_t> prompt = testing::GpuPrompt(700);
  const testing::DeviceGreedyRun a = testing::DeviceGreedy(*ef, prompt, 10), b = testing::DeviceGreedy(*es, prompt, 10);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  ASSERT_FALSE(a.logits.empty());
  // bf16: the entries are rounded unit vectors times f32 magnitudes, the
  // exact cache's rounded vectors; the first step's logits agree to bf16's
  // precision, later ones follow their own tokens.
  const int V = es->config().vocab_size;
  const float tol = dtype == "f32" ? 2e-3f : 6e-2f;
  EXPECT_TRUE(testing::AllClose(std::vector<float>(b.logits.begin(), b.logits.begin() + V),
                                std::vector<float>(a.logits.begin(), a.logits.begin() + V), tol, tol));
  if (dtype == "f32") {
    EXPECT_EQ(a.ids, b.ids);
    EXPECT_TRUE(testing::AllClose(b.logits, a.logits, tol, tol));
  }
}

// Lossy settings: the pyramid keeps 30% of the context, similar keys and
// values share entries; the policy's measure of what it keeps is below half
// the exact cache's bytes, and decode goes on with finite logits.
TEST_P(SpindleKvGpuTest, LossySettingsHoldLessAndStillDecode) {
  EngineOptions o = Options(GetParam(), "spindlekv");
  o.spindlekv.reserve_ratio = 0.3;
  o.spindlekv.key_threshold = o.spindlekv.value_threshold = 0.2;
  auto e = Open(o);
  ASSERT_NE(e, nullptr);
  const testing::DeviceGreedyRun r = testing::DeviceGreedy(*e, testing::GpuPrompt(2000), 16);
  ASSERT_EQ(r.ids.size(), 17u);
  for (float x : r.logits) ASSERT_TRUE(std::isfinite(x));
  const PolicyStats s = e->runtime().policy().stats();
  EXPECT_GT(s.kv_exact_bytes, 0);
  EXPECT_LT(s.kv_kept_bytes * 2, s.kv_exact_bytes);
}

// A benchmark's synthesized context (random keys and values through the same
// compression) decodes in one batch with a prefilled sequence and one
// attached to the prefilled one's captured document (its question first).
TEST_P(SpindleKvGpuTest, ASynthesizedContextDecodesBesideAPrefilledOneAndADocumentsQuestion) {
  EngineOptions o = Options(GetParam(), "spindlekv");
  o.spindlekv.reserve_ratio = 0.2;
  auto e = Open(o);
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  const std::vector<int32_t> prompt = testing::GpuPrompt(900);
  ASSERT_TRUE(rt.AddSequence(0, 900, 8).ok());
  ASSERT_TRUE(rt.Prefill(0, prompt, nullptr).ok());
  auto doc = rt.policy().CapturePrefix(0, 900);
  ASSERT_TRUE(doc.ok()) << doc.status();
  ASSERT_TRUE(rt.AddSequence(1, 5000, 8).ok());
  ASSERT_TRUE(rt.policy().SynthesizeContext(1, 5000, 11).ok());
  SequenceSpec attached;
  attached.prompt_len = 940;
  attached.max_new_tokens = 8;
  attached.prefix = *doc;
  ASSERT_TRUE(rt.policy().AddSequence(2, attached).ok());
  std::vector<int32_t> asked = prompt;
  for (int i = 0; i < 40; ++i) asked.push_back(7 + i);
  std::vector<float> first;
  ASSERT_TRUE(rt.Prefill(2, asked, &first, 900).ok());
  for (float x : first) ASSERT_TRUE(std::isfinite(x));
  const int V = e->config().vocab_size;
  std::vector<float> host(3 * V);
  for (int i = 0; i < 8; ++i) {
    auto l = rt.DecodeStep({0, 1, 2}, {5, 6, 7}, {900 + i, 5000 + i, 940 + i});
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_TRUE(rt.backend().CopyToHost(host.data(), *l, host.size() * sizeof(float)).ok());
    for (float x : host) ASSERT_TRUE(std::isfinite(x));
  }
}

// A document held in device memory exports to the host policy's blobs
// (entries read back as f32) and imports from them: a question attached to
// the import decodes the tokens and logits of one attached to the original.
TEST_P(SpindleKvGpuTest, ADocumentExportsAndImportsThroughTheHostFormat) {
  EngineOptions o = Options(GetParam(), "spindlekv");
  o.spindlekv.reserve_ratio = 0.3;
  o.spindlekv.key_threshold = o.spindlekv.value_threshold = 0.5;
  auto e = Open(o);
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  const std::vector<int32_t> doc = testing::GpuPrompt(800);
  ASSERT_TRUE(rt.AddSequence(0, 800, 0).ok());
  ASSERT_TRUE(rt.Prefill(0, doc, nullptr).ok());
  auto put = rt.policy().TakePrefix(0, 800);
  ASSERT_TRUE(put.ok()) << put.status();
  rt.RemoveSequence(0);
  auto blobs = (*put)->Export();
  ASSERT_TRUE(blobs.ok()) << blobs.status();
  auto imported = rt.policy().ImportPrefix(*blobs);
  ASSERT_TRUE(imported.ok()) << imported.status();
  auto again = (*imported)->Export();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again == *blobs) << "export(import(x)) != x";
  std::vector<int32_t> prompt = doc;
  for (int i = 0; i < 20; ++i) prompt.push_back(7 + i);
  const int V = e->config().vocab_size;
  auto answer = [&](const std::shared_ptr<const KvPrefix>& p, int64_t seq) {
    SequenceSpec spec;
    spec.prompt_len = static_cast<int64_t>(prompt.size());
    spec.max_new_tokens = 6;
    spec.prefix = p;
    EXPECT_TRUE(rt.policy().AddSequence(seq, spec).ok());
    std::vector<float> first, all;
    EXPECT_TRUE(rt.Prefill(seq, prompt, &first, 800).ok());
    all.assign(first.end() - V, first.end());
    int32_t tok = static_cast<int32_t>(std::max_element(all.begin(), all.end()) - all.begin());
    std::vector<float> host(V);
    for (int i = 0; i < 6; ++i) {
      auto l = rt.DecodeStep({seq}, {tok}, {static_cast<int64_t>(prompt.size()) + i});
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      EXPECT_TRUE(rt.backend().CopyToHost(host.data(), *l, V * sizeof(float)).ok());
      all.insert(all.end(), host.begin(), host.end());
      tok = static_cast<int32_t>(std::max_element(host.begin(), host.end()) - host.begin());
    }
    rt.RemoveSequence(seq);
    return all;
  };
  const std::vector<float> a = answer(*put, 1), b = answer(*imported, 2);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(testing::AllClose(b, a, 1e-5f, 1e-5f));
}

INSTANTIATE_TEST_SUITE_P(Cuda, SpindleKvGpuTest, ::testing::Values("f32", "bf16"));

}  // namespace
}  // namespace penumbra
