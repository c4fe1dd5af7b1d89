// TombstoneSweeper (coordinator/server/tombstones.h) over an in-memory
// registry and fake workers: a tombstone stays until every worker confirmed
// (OK or INVALID_ARGUMENT), a worker that is down is asked again at the next
// sweep, and the sweep thread does it by itself.
#include "coordinator/server/tombstones.h"

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

namespace penumbra::coordinator {
namespace {

struct FakeWorkers {
  std::mutex mu;
  std::map<int, bool> down;
  std::map<int, int> asked;
  Status Forget(int w, const DocumentTombstone&) {
    std::lock_guard<std::mutex> lk(mu);
    ++asked[w];
    if (down[w]) return Status::Unavailable("worker " + std::to_string(w) + " is down");
    return w == 2 ? Status::InvalidArgument("a prompt it refuses") : Status::OK();
  }
};

TEST(TombstoneSweeper, KeepsATombstoneUntilEveryWorkerConfirmed) {
  DocumentRegistry reg(100);
  FakeWorkers fake;
  fake.down[1] = true;
  TombstoneSweeper sweeper(
      &reg, [] { return 3; }, [&](int w, const DocumentTombstone& t) { return fake.Forget(w, t); },
      std::chrono::hours(1));
  auto d = reg.Add("t", "doc", {1, 2, 3});
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(reg.Remove("t", d->id).ok());
  ASSERT_EQ(reg.tombstone_count(), 1);
  sweeper.SweepOnce();
  EXPECT_EQ(reg.tombstone_count(), 1) << "worker 1 is down";
  EXPECT_EQ(reg.Tombstones()[0].confirmed, (std::set<int>{0, 2}));
  sweeper.SweepOnce();
  EXPECT_EQ(fake.asked[0], 1) << "a confirmed worker is not asked again";
  EXPECT_EQ(fake.asked[1], 2);
  {
    std::lock_guard<std::mutex> lk(fake.mu);
    fake.down[1] = false;
  }
  sweeper.SweepOnce();
  EXPECT_EQ(reg.tombstone_count(), 0);
  auto again = reg.Add("t", "doc", {1});
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->id, d->id);
}

TEST(TombstoneSweeper, TheThreadSweepsByItselfAfterAKick) {
  DocumentRegistry reg(100);
  FakeWorkers fake;
  TombstoneSweeper sweeper(
      &reg, [] { return 2; }, [&](int w, const DocumentTombstone& t) { return fake.Forget(w, t); },
      std::chrono::hours(1));
  auto d = reg.Add("t", "doc", {1, 2, 3});
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(reg.Remove("t", d->id).ok());
  sweeper.Kick();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (reg.tombstone_count() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(reg.tombstone_count(), 0);
  EXPECT_GE(sweeper.sweeps(), 1);
}

}  // namespace
}  // namespace penumbra::coordinator
