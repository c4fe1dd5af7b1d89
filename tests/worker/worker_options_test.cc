// penumbra-worker's options and the storage YAML's keys: one declaration
// each (worker/service/worker_options.h, worker/engine/storage_options.h),
// the same defaults as the structs they fill, and docs/operations.md's
// tables generated from them.
#include "worker/service/worker_options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "storage/segment_store.h"
#include "tests/docs_util.h"
#include "worker/engine/engine.h"
#include "worker/engine/storage_options.h"

namespace penumbra {
namespace {

using service::WorkerOptionTable;
using service::WorkerProcessOptions;

Status Parse(std::vector<std::string> flags, WorkerProcessOptions* o) {
  Args a;
  WorkerOptionTable().AddFlags(a);
  flags.insert(flags.begin(), "penumbra-worker");
  std::vector<char*> p;
  for (std::string& s : flags) p.push_back(s.data());
  PENUMBRA_RETURN_IF_ERROR(a.Parse(static_cast<int>(p.size()), p.data(), 1));
  return WorkerOptionTable().ApplyFlags(a, o);
}

TEST(WorkerOptions, DefaultsAreTheStructsAndFlagsFillThem) {
  WorkerProcessOptions o;
  ASSERT_TRUE(Parse({}, &o).ok());
  EXPECT_EQ(o.scheduler.max_queue, service::SchedulerOptions{}.max_queue);
  EXPECT_EQ(o.lease.lease, service::WorkerLeaseOptions{}.lease);
  EXPECT_EQ(o.store_calls.call_timeout, transport::RemoteStoreOptions{}.call_timeout);
  EXPECT_EQ(o.max_batch, 0) << "the engine's";
  EXPECT_EQ(o.random_weights, -1) << "off";
  Status s = Parse({"--model",
                    "m",
                    "--max-batch",
                    "8",
                    "--prefill-tokens-per-step",
                    "512",
                    "--share-window-ms",
                    "0",
                    "--store-bulk-mb-per-s",
                    "2",
                    "--store-breaker-cooldown-ms",
                    "70",
                    "--lease-ms",
                    "100",
                    "--random-weights",
                    "0",
                    "--prefix-cache-mb",
                    "16",
                    "--store-connections",
                    "2"},
                   &o);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(o.model, "m");
  EXPECT_EQ(o.max_batch, 8);
  EXPECT_EQ(o.scheduler.prefill_tokens_per_step, 512);
  EXPECT_EQ(o.scheduler.share_window.count(), 0);
  EXPECT_DOUBLE_EQ(o.store_calls.bulk_bytes_per_second, 2.0 * (1 << 20));
  EXPECT_EQ(o.store_calls.breaker.cool_down.count(), 70);
  EXPECT_EQ(o.lease.lease.count(), 100);
  EXPECT_EQ(o.random_weights, 0);
  EXPECT_EQ(o.prefix_cache_mb, 16);
  EXPECT_EQ(o.store_calls.plane.connections, 2);
  EXPECT_EQ(WorkerProcessOptions{}.store_calls.plane.connections, transport::UcxClientOptions{}.connections);
}

TEST(WorkerOptions, TheSameRangesAsBefore) {
  for (const auto& [flags, want] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--max-batch", "0"}, "--max-batch must be in [1, 4096], got 0"},
           {{"--max-batch", "4097"}, "--max-batch must be in [1, 4096]"},
           {{"--store-connections", "65"}, "--store-connections must be in [1, 64]"},
           {{"--lease-ms", "99"}, "--lease-ms must be in [100, 86400000], got 99"},
           {{"--port", "65536"}, "--port must be in [0, 65535]"},
           {{"--prefix-cache-mb", "0"}, "--prefix-cache-mb must be in [1, 1073741824], got 0"},
           {{"--random-weights", "-1"}, "--random-weights must be in [0, "},
           {{"--store-fetch-threads", "257"}, "--store-fetch-threads must be in [1, 256]"},
           {{"--drain-seconds", "x"}, "--drain-seconds"}}) {
    WorkerProcessOptions o;
    Status s = Parse(flags, &o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << flags[0];
    EXPECT_NE(s.message().find(want), std::string::npos) << s;
  }
}

TEST(WorkerOptions, DocsComeFromTheTables) {
  EXPECT_TRUE(testing::GeneratedDocSectionIs("docs/operations.md", "worker options", WorkerOptionTable().Markdown()));
  EXPECT_TRUE(testing::GeneratedDocSectionIs("docs/operations.md", "storage options", StorageOptionsMarkdown()));
}

TEST(StorageOptions, TheTablesDefaultsAreTheStructs) {
  // An empty storage YAML changes nothing and passes every check.
  auto r = ConfigReader::FromString("{}", "s.yaml");
  ASSERT_TRUE(r.ok());
  EngineOptions o;
  ASSERT_TRUE(LoadStorageOptions(*r, &o).ok());
  EXPECT_EQ(o.runtime.tiers.gpu_capacity_bytes, TierOptions{}.gpu_capacity_bytes);
  EXPECT_EQ(o.runtime.prefix_store_lazy_threads, RuntimeOptions{}.prefix_store_lazy_threads);
  EXPECT_EQ(o.prefix_store.block_bytes, storage::SegmentStoreOptions{}.block_bytes);
  EXPECT_TRUE(StorageGpuOptionTable().Validate(TierOptions{}).ok());
  EXPECT_TRUE(storage::SegmentStoreOptionTable().Validate(storage::SegmentStoreOptions{}).ok());
}

TEST(StorageOptions, ChecksRunOnOptionsFilledInCode) {
  TierOptions t;
  t.gpu_low_watermark = 0.9;
  t.gpu_high_watermark = 0.5;
  Status s = StorageGpuOptionTable().Validate(t);
  EXPECT_NE(s.message().find("storage.gpu.low_watermark must be at most high_watermark"), std::string::npos) << s;
  storage::SegmentStoreOptions d;
  d.read_threads = 0;
  EXPECT_NE(storage::SegmentStoreOptionTable().Validate(d).message().find("storage.disk.read_threads"),
            std::string::npos);
  // The former name of `memory` in a storage file of its own.
  auto both = ConfigReader::FromString("memory: {}\ndram: {}\n", "s.yaml");
  ASSERT_TRUE(both.ok());
  EngineOptions o;
  EXPECT_NE(LoadStorageOptions(*both, &o).message().find("s.yaml: dram: is the former name of `memory`"),
            std::string::npos);
}

}  // namespace
}  // namespace penumbra
