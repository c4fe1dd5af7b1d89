// Context parallel on 2 GPUs (skips with fewer): stories260K's ranks as
// threads of this process, each with its own CUDA backend on its own GPU,
// their data plane NCCL (worker/parallel/process_group.h), give the greedy tokens of
// the same prompt on one GPU, for full attention and for ShadowKV configured
// to lose nothing, in f32 and bf16, and for lossy ShadowKV and SpeContext
// with the shards' global selection (f32).
#include <gtest/gtest.h>

#include <thread>

#include "tests/gpu_test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"
#include "worker/parallel/process_group.h"

namespace penumbra {
namespace {

class ContextParallelGpuTest : public testing::StoriesTest {
 protected:
  void SetUp() override {
    testing::StoriesTest::SetUp();
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "needs 2 CUDA devices, found " << n;
    }
  }
};

EngineOptions Options(const std::string& policy, const std::string& dtype) {
  EngineOptions o;
  if (policy == "shadowkv") o = testing::ExactShadowKvOptions();
  if (policy == "shadowkv-global") o = testing::GlobalSelectionShadowKvOptions();
  if (policy == "specontext-global") {
    // A random retrieval head, a budget of 24 of ~300 tokens: lossy.
    o.kv_policy = "specontext";
    o.specontext.head = "random";
    o.specontext.budget = 24;
    o.specontext.local = 16;
    o.specontext.successors = 0;
  }
  o.backend.device = "cuda";
  o.backend.dtype = dtype;
  o.runtime.prefill_chunk = 48;
  return o;
}

std::vector<GenerationRequest> Requests() {
  GenerationRequest r;
  r.prompt = testing::LcgTokens(300, 21, true);
  r.max_new_tokens = 24;
  return {r};
}

TEST_F(ContextParallelGpuTest, TwoGpusGiveTheOneGpuTokens) {
  ASSERT_TRUE(NcclCollectiveCompiled());
  // shadowkv-global and specontext-global: lossy, the shards agreeing on
  // one top-k (f32 only: in bf16 the two normalizations of a score may
  // round apart and flip a near tie).
  for (const std::string policy : {"full", "shadowkv", "shadowkv-global", "specontext-global"}) {
    for (const std::string dtype : {"f32", "bf16"}) {
      if (policy.ends_with("-global") && dtype == "bf16") continue;
      SCOPED_TRACE(policy + " " + dtype);
      auto one = Engine::Open(testing::StoriesDir(), Options(policy, dtype));
      ASSERT_TRUE(one.ok()) << one.status();
      auto want = (*one)->runtime().Generate(Requests());
      ASSERT_TRUE(want.ok()) << want.status();
      one->reset();

      auto listener = CollectiveListener::Bind("127.0.0.1", 0);
      ASSERT_TRUE(listener.ok()) << listener.status();
      const int port = (*listener)->port();
      std::vector<std::vector<int32_t>> got(2);
      std::vector<Status> status(2);
      std::vector<std::thread> ranks;
      for (int r = 0; r < 2; ++r) {
        std::unique_ptr<CollectiveListener> mine = r == 0 ? std::move(*listener) : nullptr;
        ranks.emplace_back([&, r, mine = std::move(mine)]() mutable {
          EngineOptions o = Options(policy, dtype);
          o.backend.cuda_device = r;
          auto e = Engine::Open(testing::StoriesDir(), o);
          if (!e.ok()) {
            status[r] = e.status();
            return;  // the other rank's join times out
          }
          CollectiveOptions co;
          co.rank = r;
          co.world = 2;
          co.rendezvous = "127.0.0.1:" + std::to_string(port);
          co.timeout_s = 60;
          auto group = ConnectCollective(&(*e)->backend(), co, std::move(mine));
          if (!group.ok()) {
            status[r] = group.status();
            return;
          }
          status[r] = (*e)->runtime().SetContextGroup(group->get());
          if (!status[r].ok()) return;
          auto g = (*e)->runtime().Generate(Requests());
          status[r] = g.status();
          if (g.ok()) got[r] = (*g)[0].ids;
        });
      }
      for (auto& t : ranks) t.join();
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
        EXPECT_EQ(got[r], (*want)[0].ids) << "rank " << r;
      }
    }
  }
}

}  // namespace
}  // namespace penumbra
