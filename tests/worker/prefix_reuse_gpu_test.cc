// Prefix reuse on the CUDA backend (stories260K, full policy): a request whose
// document was captured by an earlier request attaches it (device 2-D copies
// of K and V) and returns the tokens of a cold run, in f32 and bf16.
#include <gtest/gtest.h>

#include "tests/gpu_test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

class PrefixReuseGpuTest : public testing::StoriesTest {};

using testing::LcgTokens;

TEST_F(PrefixReuseGpuTest, CachedDocumentGivesTheColdTokens) {
  PENUMBRA_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> doc = LcgTokens(151, 7, true);
  for (const char* dtype : {"f32", "bf16"}) {
    auto open = [&](size_t cache) {
      EngineOptions o;
      o.backend.device = "cuda";
      o.backend.dtype = dtype;
      o.runtime.prefix_cache_bytes = cache;
      auto e = Engine::Open(testing::StoriesDir(), o);
      EXPECT_TRUE(e.ok()) << e.status();
      return e.ok() ? std::move(*e) : nullptr;
    };
    auto warm = open(64 << 20), cold = open(0);
    ASSERT_TRUE(warm && cold);
    for (uint64_t q = 11; q < 14; ++q) {
      GenerationRequest r;
      r.prompt = doc;
      const std::vector<int32_t> question = LcgTokens(20, q, false);
      r.prompt.insert(r.prompt.end(), question.begin(), question.end());
      r.max_new_tokens = 24;
      auto c = cold->runtime().Generate({r});
      r.segment_ends = {151};
      auto w = warm->runtime().Generate({r});
      ASSERT_TRUE(c.ok() && w.ok()) << c.status() << " " << w.status();
      EXPECT_EQ((*w)[0].cached_prompt_tokens, q == 11 ? 0 : 151) << dtype;
      EXPECT_EQ((*w)[0].ids, (*c)[0].ids) << dtype << " question " << q;
    }
  }
}

}  // namespace
}  // namespace penumbra
