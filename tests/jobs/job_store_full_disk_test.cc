// The job store on a full disk (a small tmpfs, tests/small_disk.h; skipped
// where it cannot be mounted): a Submit whose write fails is
// RESOURCE_EXHAUSTED saying the disk is full and stores nothing (no job, no
// id used up in memory); a result whose write fails changes nothing and is
// recorded once it is written again after the disk is freed (no restart);
// a reopen holds exactly what was acknowledged.
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/jobs/job_store.h"
#include "tests/small_disk.h"

namespace penumbra::jobs {
namespace {

using penumbra::testing::SmallDisk;

JobSpec BigSpec(int items) {
  JobSpec s;
  for (int i = 0; i < items; ++i) {
    JobItem it;
    it.custom_id = "item-" + std::to_string(i);
    it.document_ids = {"doc-1"};
    it.question = std::string(3000, 'q');
    s.items.push_back(std::move(it));
  }
  return s;
}

ItemResult BigAnswer(int n) {
  ItemResult r;
  r.ok = true;
  r.answer = std::string(6000, static_cast<char>('a' + n % 26));
  return r;
}

void ExpectDiskFull(const Status& s) {
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("job store"), std::string::npos) << s;
  EXPECT_NE(s.message().find("disk is full"), std::string::npos) << s;
}

// Retries `write` (bounded) until it succeeds, as the JobService does.
template <class F>
::testing::AssertionResult Eventually(F write) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  Status s;
  while (!(s = write()).ok()) {
    if (s.code() != StatusCode::kResourceExhausted) return ::testing::AssertionFailure() << s;
    if (std::chrono::steady_clock::now() > deadline) return ::testing::AssertionFailure() << "still failing: " << s;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return ::testing::AssertionSuccess();
}

TEST(JobStoreFullDisk, FailedWritesStoreNothingAndResultsAreRecordedOnceSpaceReturns) {
  SmallDisk disk(16);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  JobStoreOptions o;
  o.path = disk.dir() + "/jobs";
  std::string job;
  std::vector<ItemLease> leases;
  {
    auto opened = JobStore::Open(o);
    ASSERT_TRUE(opened.ok()) << opened.status();
    JobStore& store = **opened;
    auto id = store.Submit("t", BigSpec(4));
    ASSERT_TRUE(id.ok()) << id.status();
    job = *id;
    auto claimed = store.Claim(4);
    ASSERT_TRUE(claimed.ok());
    leases = *claimed;
    ASSERT_EQ(leases.size(), 4u);
    ASSERT_TRUE(store.Complete(job, leases[0].item_index, leases[0].attempt, BigAnswer(0)).ok());

    disk.Fill();
    // A submit: refused whole.
    auto refused = store.Submit("t", BigSpec(8));
    ASSERT_FALSE(refused.ok());
    ExpectDiskFull(refused.status());
    auto page = store.List("t", "", 100);
    ASSERT_TRUE(page.ok());
    EXPECT_EQ(page->jobs.size(), 1u) << "a failed submit left a job behind";
    // A result: refused, nothing changes.
    const Status s = store.Complete(job, leases[1].item_index, leases[1].attempt, BigAnswer(1));
    ExpectDiskFull(s);
    auto info = store.Get("t", job);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->counts.completed, 1);
    EXPECT_EQ(info->counts.running, 3);
    EXPECT_TRUE(store.write_health().degraded);
    EXPECT_GE(store.write_health().write_errors, 2);
    // Reads go on.
    auto results = store.Results("t", job, "", 10);
    ASSERT_TRUE(results.ok()) << results.status();
    EXPECT_EQ(results->items.size(), 1u);

    disk.Free();
    // The runner keeps the result and writes it again: recorded once.
    ASSERT_TRUE(Eventually([&] { return store.Complete(job, leases[1].item_index, leases[1].attempt, BigAnswer(1)); }));
    EXPECT_FALSE(store.write_health().degraded);
    EXPECT_GE(store.write_health().recoveries, 1);
    ASSERT_TRUE(store.Complete(job, leases[1].item_index, leases[1].attempt, BigAnswer(9)).ok());  // a duplicate
    EXPECT_EQ(store.stats().duplicate_results_ignored, 1);
    auto second = store.Submit("t", BigSpec(2));
    ASSERT_TRUE(second.ok()) << second.status();
  }
  auto store = std::move(JobStore::Open(o)).value();
  auto info = store->Get("t", job);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->counts.completed, 2);
  EXPECT_EQ(info->counts.pending, 2);  // the two leased items not answered go back to pending
  auto results = store->Results("t", job, "", 10);
  ASSERT_TRUE(results.ok());
  ASSERT_EQ(results->items.size(), 2u);
  EXPECT_EQ(results->items[0].result, BigAnswer(0));
  EXPECT_EQ(results->items[1].result, BigAnswer(1)) << "the first result written wins";
  auto page = store->List("t", "", 100);
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->jobs.size(), 2u);
}

}  // namespace
}  // namespace penumbra::jobs
