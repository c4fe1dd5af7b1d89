// How many sequences fit and why (KvPolicy::EstimateSequenceBytes,
// Runtime::Capacity, SchedulerStats::capacity) on the CPU backend
// (stories260K, f32): the estimate is exactly what AddSequence then takes
// (device state; the value store's host rows), fp8 values count their own
// row size, the count is bounded by max_batch and by memory with the reason
// named, and the scheduler samples it and says why an admission waited.
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "kernels/value_format.h"
#include "storage/dram_value_store.h"
#include "tests/test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"
#include "worker/service/scheduler.h"

namespace penumbra {
namespace {

using namespace std::chrono_literals;

class CapacityTest : public testing::StoriesTest, public ::testing::WithParamInterface<std::string> {};

std::unique_ptr<Engine> OpenEngine(const std::string& policy, int max_batch = 256) {
  EngineOptions o = policy == "full" ? EngineOptions{} : testing::LossyShadowKvOptions();
  o.backend.device = "cpu";
  o.kv_policy = policy == "full" ? "full" : "shadowkv";
  if (policy == "shadowkv-fp8") o.shadowkv.value_format = "fp8";
  o.runtime.max_batch = max_batch;
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

TEST_P(CapacityTest, TheEstimateIsWhatASequenceTakes) {
  auto e = OpenEngine(GetParam());
  ASSERT_NE(e, nullptr);
  KvPolicy& policy = e->runtime().policy();
  const ModelConfig& c = e->config();
  for (const int64_t prompt : {40, 301}) {
    SequenceSpec spec;
    spec.prompt_len = prompt;
    spec.max_new_tokens = 24;
    const SequenceBytes est = policy.EstimateSequenceBytes(spec);
    ASSERT_TRUE(policy.AddSequence(7, spec).ok());
    EXPECT_EQ(est.device, policy.DeviceBytes(7)) << "prompt " << prompt;
    policy.RemoveSequence(7);
    const int64_t chunks = (prompt + 24 + 3) / 4;  // chunks of 4 (LossyShadowKvOptions)
    if (GetParam() == "full") {
      EXPECT_EQ(est.host, 0u);
      EXPECT_EQ(est.device, 2u * c.num_layers * c.num_kv_heads * (prompt + 24) * c.head_dim * sizeof(float));
    } else {
      // The value store's rows: one per (layer, head, chunk), f32 on the
      // CPU backend or an fp8 row, each with the store's checksum and mark.
      const size_t row = GetParam() == "shadowkv-fp8" ? static_cast<size_t>(kernels::ValueRowBytesFp8(4, c.head_dim))
                                                      : 4 * c.head_dim * sizeof(float);
      EXPECT_EQ(est.host, static_cast<size_t>(c.num_layers) * c.num_kv_heads * chunks *
                              (row + storage::DramValueStore::kRowOverheadBytes))
          << "prompt " << prompt;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, CapacityTest, ::testing::Values("full", "shadowkv", "shadowkv-fp8"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

TEST_F(CapacityTest, TheCountStopsAtMaxBatchOrMemoryAndSaysWhich) {
  auto e = OpenEngine("full", /*max_batch=*/4);
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  BatchCapacity small = rt.Capacity(100, 10, /*held=*/1);
  EXPECT_EQ(small.context_tokens, 110);
  EXPECT_EQ(small.held, 1);
  EXPECT_EQ(small.more, 3);
  EXPECT_EQ(small.sequences(), 4);
  EXPECT_EQ(small.limit, "max_batch");
  EXPECT_GT(small.per_sequence.device, 0u);
  EXPECT_EQ(rt.Capacity(100, 10, 4).more, 0);
  // A sequence larger than the machine's memory: none fits, for memory (on
  // the CPU backend device memory is host memory: one pool).
  BatchCapacity huge = rt.Capacity(int64_t{1} << 32, 1, 0);
  EXPECT_EQ(huge.more, 0);
  EXPECT_EQ(huge.limit, "host memory");
  EXPECT_GT(huge.per_sequence.device, huge.host_available_bytes);
}

TEST_F(CapacityTest, TheSchedulerReportsItAndWhyAnAdmissionWaited) {
  auto e = OpenEngine("shadowkv-fp8");
  ASSERT_NE(e, nullptr);
  service::SchedulerOptions so;
  so.max_batch = 2;
  so.capacity_context_tokens = 200;
  so.share_window = 0ms;
  auto s = service::Scheduler::Create(&e->runtime(), so);
  ASSERT_TRUE(s.ok()) << s.status();
  auto sampled = [&] {
    for (int i = 0; i < 100; ++i) {
      service::SchedulerStats st = (*s)->stats();
      if (!st.capacity.limit.empty()) return st;
      std::this_thread::sleep_for(50ms);
    }
    return (*s)->stats();
  };
  service::SchedulerStats st = sampled();
  EXPECT_EQ(st.capacity.context_tokens, 200);
  EXPECT_EQ(st.capacity.held, 0);
  EXPECT_EQ(st.capacity.more, 2);  // max_batch 2: memory is plenty for stories
  EXPECT_EQ(st.capacity.limit, "max_batch");
  EXPECT_GT(st.capacity.per_sequence.host, 0u);  // the value store's rows
  EXPECT_TRUE(st.last_wait_reason.empty());
  // Three long answers: two decode, the third waits for max_batch.
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    GenerationRequest r;
    r.prompt = testing::LcgTokens(60, 300 + i, true);
    r.max_new_tokens = 200;
    auto id = (*s)->Submit(r);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (int i = 0; i < 200 && (*s)->stats().last_wait_reason.empty(); ++i) std::this_thread::sleep_for(20ms);
  st = (*s)->stats();
  EXPECT_EQ(st.last_wait_reason, "max_batch 2");
  EXPECT_EQ(st.last_wait_batch, 2);
  for (uint64_t id : ids) (void)(*s)->Cancel(id);
}

}  // namespace
}  // namespace penumbra
