// The segment store on a full disk (a small tmpfs, tests/small_disk.h;
// skipped where it cannot be mounted): a Put whose write fails is
// RESOURCE_EXHAUSTED saying the disk is full and leaves nothing visible
// (Keys, Info, Get unchanged; a replaced version stays); reads of what is
// stored go on; when the disk is freed Puts work again without a reopen;
// a reopen holds exactly the segments acknowledged, byte for byte, and
// cleans up what the failed Puts left.
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "storage/segment_store.h"
#include "tests/small_disk.h"
#include "tests/storage/segment_store_test_util.h"

namespace penumbra::storage {
namespace {

using penumbra::testing::SmallDisk;
using testing::BlobsFor;

Hash128 Key(uint64_t i) { return HashBytes128(&i, sizeof(i), 38); }

SegmentStoreOptions Options(const std::string& path) {
  SegmentStoreOptions o;
  o.path = path;
  o.block_bytes = 64 << 10;
  o.block_cache_bytes = 1 << 20;
  return o;
}

TEST(SegmentStoreFullDisk, FailedPutsLeaveNothingVisibleAndPutsResumeWhenSpaceReturns) {
  SmallDisk disk(24);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  const SegmentStoreOptions o = Options(disk.dir() + "/segments");
  std::map<uint64_t, size_t> stored;  // key -> bytes, acknowledged
  int failed = 0;
  {
    auto opened = SegmentStore::Open(o);
    ASSERT_TRUE(opened.ok()) << opened.status();
    SegmentStore& s = **opened;
    for (uint64_t k = 0; k < 4; ++k) {
      ASSERT_TRUE(s.Put(Key(k), "ns", 10, BlobsFor(k, 300000)).ok());
      stored[k] = 300000;
    }
    disk.Fill();
    for (uint64_t k = 10; k < 14; ++k) {
      const Status p = s.Put(Key(k), "ns", 10, BlobsFor(k, 300000));
      if (p.ok()) {
        stored[k] = 300000;
        continue;
      }
      ++failed;
      EXPECT_EQ(p.code(), StatusCode::kResourceExhausted) << p;
      EXPECT_NE(p.message().find("segment store"), std::string::npos) << p;
      EXPECT_NE(p.message().find("disk is full"), std::string::npos) << p;
      EXPECT_FALSE(s.Contains(Key(k)));
      EXPECT_EQ(s.Get(Key(k)).status().code(), StatusCode::kNotFound);
    }
    // Replacing a stored segment with other content: refused, the old one stays.
    EXPECT_EQ(s.Put(Key(0), "ns", 10, BlobsFor(100, 300000)).code(), StatusCode::kResourceExhausted);
    EXPECT_GT(failed, 0);
    EXPECT_TRUE(s.write_health().degraded);
    // Reads go on, byte for byte.
    for (const auto& [k, bytes] : stored) {
      auto got = s.Get(Key(k));
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == BlobsFor(k, bytes)) << "segment " << k;
    }
    EXPECT_EQ(s.Keys().size(), stored.size());

    disk.Free();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    Status p;
    while (!(p = s.Put(Key(20), "ns", 10, BlobsFor(20, 300000))).ok()) {
      ASSERT_EQ(p.code(), StatusCode::kResourceExhausted) << p;
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "still refused 10 s after the disk was freed: " << p;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    stored[20] = 300000;
    ASSERT_TRUE(s.Put(Key(21), "ns", 10, BlobsFor(21, 300000)).ok());
    stored[21] = 300000;
    EXPECT_FALSE(s.write_health().degraded);
    EXPECT_GE(s.write_health().recoveries, 1);
  }
  auto s = std::move(SegmentStore::Open(o)).value();
  std::set<uint64_t> want, seen;
  for (const auto& [k, bytes] : stored) {
    want.insert(k);
    auto got = s->Get(Key(k));
    ASSERT_TRUE(got.ok()) << "segment " << k << ": " << got.status();
    EXPECT_TRUE(*got == BlobsFor(k, bytes)) << "segment " << k;
  }
  EXPECT_EQ(s->Keys().size(), stored.size());
  EXPECT_TRUE(*s->Get(Key(0)) == BlobsFor(0, 300000)) << "the replacement that failed shows";
}

}  // namespace
}  // namespace penumbra::storage
