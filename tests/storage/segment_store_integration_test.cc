// SegmentStore under crashes and disk corruption, with real processes and
// real files:
//  - Crash: a child process (this binary, re-executed) stores segments with
//    synced commits and reports each acknowledged key on a pipe; the parent
//    kills it with SIGKILL at a random moment after its first
//    acknowledgement, 50 times (more, up to 200, until a kill has interrupted
//    a write), and after every kill reopens the store: every acknowledged
//    segment reads back exactly, every visible segment is complete and valid
//    (none half-written), and the blocks of interrupted writes are removed;
//    and a key replaced again and again reads back as one whole version
//    after every kill, never a mix of two.
//  - Corruption: bytes flipped in RocksDB's blob and table files after a
//    flush are reported as Corruption (or make Open refuse the store, naming
//    it); no read, whole (Get) or ranged (ReadBlob), ever returns bytes that
//    were not stored.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

#include "storage/segment_store.h"
#include "tests/crash_child.h"
#include "tests/storage/segment_store_test_util.h"
#include "tests/test_util.h"

namespace penumbra::storage {
namespace {

using testing::BlobsFor;
using testing::FlipBytesInFiles;
using testing::TempDir;

Hash128 Key(uint64_t i) { return HashBytes128(&i, sizeof(i), 7); }
size_t SizeOf(uint64_t i) { return 1 + (i * 7919) % 12000; }
// The corruption tests' block sizes: blob "k" of every other segment in 8 KiB
// blocks, the rest in the store's 4 KiB.
std::map<std::string, size_t> BlockBytesOf(uint64_t i) {
  return i % 2 ? std::map<std::string, size_t>{{"k", 8192}} : std::map<std::string, size_t>{};
}
// The crash test's segments: up to 24 blocks of 4 KiB, so that a good share
// of each write is spent between its intent and its synced commit (where a
// kill leaves a half-written segment to clean up).
size_t CrashSizeOf(uint64_t i) { return 1 + (i * 7919) % 98304; }

SegmentStoreOptions Durable(const std::string& path) {
  SegmentStoreOptions o;
  o.path = path;
  o.block_bytes = 4096;
  o.sync_commit = true;
  return o;
}

// The child: runs only when re-executed by the crash test (environment
// PENUMBRA_CRASH_DIR, PENUMBRA_CRASH_FD, PENUMBRA_CRASH_START). Stores
// segments START, START+1, ... until killed; writes each index to the pipe
// once Put has returned.
TEST(SegmentStoreCrashChild, Run) {
  const char* dir = std::getenv("PENUMBRA_CRASH_DIR");
  if (dir == nullptr) GTEST_SKIP() << "only run by SegmentStoreCrashTest";
  const int fd = std::atoi(std::getenv("PENUMBRA_CRASH_FD"));
  uint64_t i = std::strtoull(std::getenv("PENUMBRA_CRASH_START"), nullptr, 10);
  auto st = SegmentStore::Open(Durable(dir));
  if (!st.ok()) _exit(3);
  for (;; ++i) {
    if (!(*st)->Put(Key(i), "ns", static_cast<int64_t>(i), BlobsFor(i, CrashSizeOf(i))).ok()) _exit(4);
    if (write(fd, &i, sizeof(i)) != sizeof(i)) _exit(5);
  }
}

TEST(SegmentStoreCrashTest, AcknowledgedSegmentsSurviveSigkillAndNoneIsHalfWritten) {
  TempDir dir;
  std::mt19937_64 rng(4242);
  std::set<uint64_t> acked;
  uint64_t next = 1;
  int64_t orphans = 0;
  const auto t0 = std::chrono::steady_clock::now();
  // (Fewer under a sanitizer, where each child's start and each reopen cost
  // most of the time.)
  constexpr int kKills = ::penumbra::testing::kUnderSanitizer ? 20 : 50;
  // At least kKills kills, and more (up to kMaxKills) until one has landed
  // inside a write: the half-written case must be exercised, not hoped for.
  constexpr int kMaxKills = 200;
  int kills = 0;
  for (int kill_no = 0; kill_no < kKills || (orphans == 0 && kill_no < kMaxKills); ++kill_no) {
    kills = kill_no + 1;
    int p[2] = {-1, -1};
    const pid_t pid = ::penumbra::testing::SpawnCrashChild(
        "SegmentStoreCrashChild.Run",
        {{"PENUMBRA_CRASH_DIR", dir.path()}, {"PENUMBRA_CRASH_START", std::to_string(next)}}, "PENUMBRA_CRASH_FD",
        &p[0]);
    ASSERT_GE(pid, 0);
    // Kill inside the write loop, not during the child's start-up (which a
    // loaded machine can stretch past any fixed sleep): wait for its first
    // acknowledgement, then a random moment.
    uint64_t first = 0;
    ASSERT_EQ(read(p[0], &first, sizeof(first)), static_cast<ssize_t>(sizeof(first)))
        << "kill " << kill_no << ": the child stopped before storing anything";
    acked.insert(first);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 60000));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "kill " << kill_no << ": the child ended by itself (status " << status << ")";
    uint64_t i = 0;
    while (read(p[0], &i, sizeof(i)) == sizeof(i)) acked.insert(i);
    close(p[0]);

    auto st = SegmentStore::Open(Durable(dir.path()));
    ASSERT_TRUE(st.ok()) << "kill " << kill_no << ": " << st.status();
    SegmentStore& s = **st;
    orphans += s.stats().orphans_removed;
    for (uint64_t a : acked) {
      auto got = s.Get(Key(a));
      ASSERT_TRUE(got.ok()) << "kill " << kill_no << ": acknowledged segment " << a << ": " << got.status();
      ASSERT_EQ(*got, BlobsFor(a, CrashSizeOf(a))) << "kill " << kill_no << ": segment " << a;
    }
    // Whatever is visible is whole: keys the child attempted, exact bytes.
    std::set<Hash128, bool (*)(const Hash128&, const Hash128&)> visible(
        [](const Hash128& a, const Hash128& b) { return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo; });
    for (const Hash128& k : s.Keys()) visible.insert(k);
    uint64_t max_seen = next - 1;
    // The child attempted at most one index past its last acknowledged one.
    const uint64_t upper = std::max(next, acked.empty() ? uint64_t{0} : *acked.rbegin()) + 2;
    for (uint64_t c = 1; c <= upper && !visible.empty(); ++c) {
      auto it = visible.find(Key(c));
      if (it == visible.end()) continue;
      auto got = s.Get(Key(c));
      ASSERT_TRUE(got.ok()) << "kill " << kill_no << ": visible segment " << c << ": " << got.status();
      ASSERT_EQ(*got, BlobsFor(c, CrashSizeOf(c)))
          << "kill " << kill_no << ": visible segment " << c << " is not whole";
      visible.erase(it);
      max_seen = std::max(max_seen, c);
    }
    ASSERT_TRUE(visible.empty()) << visible.size() << " visible segments were never written by the child";
    EXPECT_EQ(s.stats().corruptions_detected, 0);
    if (!acked.empty()) max_seen = std::max(max_seen, *acked.rbegin());
    next = max_seen + 2;  // skip the index a kill may have interrupted
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("acknowledged", static_cast<int>(acked.size()));
  RecordProperty("orphans_removed", static_cast<int>(orphans));
  std::printf("%d kills, %zu acknowledged segments, %lld interrupted writes cleaned, %.1f s\n", kills, acked.size(),
              static_cast<long long>(orphans), seconds);
  EXPECT_GT(acked.size(), static_cast<size_t>(kKills));
  EXPECT_GT(orphans, 0) << "no kill landed inside a write: the test did not exercise a half-written segment";
}

// The replacement crash test's child: stores versions START, START+1, ... of
// one key (each other content), writing each version to the pipe once Put
// has returned.
const Hash128 kReplacedKey = Key(999999);
std::map<std::string, std::string> Version(uint64_t v) { return BlobsFor(1000000 + v, CrashSizeOf(v)); }

TEST(SegmentStoreReplaceChild, Run) {
  const char* dir = std::getenv("PENUMBRA_REPLACE_DIR");
  if (dir == nullptr) GTEST_SKIP() << "only run by SegmentStoreCrashTest";
  const int fd = std::atoi(std::getenv("PENUMBRA_REPLACE_FD"));
  uint64_t v = std::strtoull(std::getenv("PENUMBRA_REPLACE_START"), nullptr, 10);
  auto st = SegmentStore::Open(Durable(dir));
  if (!st.ok()) _exit(3);
  for (;; ++v) {
    if (!(*st)->Put(kReplacedKey, "ns", 1, Version(v)).ok()) _exit(4);
    if (write(fd, &v, sizeof(v)) != sizeof(v)) _exit(5);
  }
}

// A key replaced again and again, killed with SIGKILL at random moments:
// after every kill it reads back whole as the last acknowledged version or
// the one being written, never a mix, and the blocks of interrupted
// versions (the new one before its commit, the old one after) are removed
// at Open.
TEST(SegmentStoreCrashTest, AReplacedKeyIsOneVersionAfterSigkill) {
  TempDir dir;
  std::mt19937_64 rng(777);
  uint64_t last = 0, next = 1;
  int64_t orphans = 0;
  int kills = 0;
  for (int kill_no = 0; kill_no < 30 || (orphans == 0 && kill_no < 120); ++kill_no) {
    kills = kill_no + 1;
    int rfd = -1;
    const pid_t pid = ::penumbra::testing::SpawnCrashChild(
        "SegmentStoreReplaceChild.Run",
        {{"PENUMBRA_REPLACE_DIR", dir.path()}, {"PENUMBRA_REPLACE_START", std::to_string(next)}}, "PENUMBRA_REPLACE_FD",
        &rfd);
    ASSERT_GE(pid, 0);
    uint64_t v = 0;
    ASSERT_EQ(read(rfd, &v, sizeof(v)), static_cast<ssize_t>(sizeof(v))) << "kill " << kill_no;
    last = v;
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 40000));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    ASSERT_EQ(waitpid(pid, nullptr, 0), pid);
    while (read(rfd, &v, sizeof(v)) == sizeof(v)) last = v;
    close(rfd);
    auto st = SegmentStore::Open(Durable(dir.path()));
    ASSERT_TRUE(st.ok()) << "kill " << kill_no << ": " << st.status();
    orphans += (*st)->stats().orphans_removed;
    auto got = (*st)->Get(kReplacedKey);
    ASSERT_TRUE(got.ok()) << "kill " << kill_no << ": " << got.status();
    const bool acked = *got == Version(last), in_flight = *got == Version(last + 1);
    ASSERT_TRUE(acked || in_flight) << "kill " << kill_no << ": the key is neither version " << last << " nor "
                                    << last + 1;
    EXPECT_EQ((*st)->Keys().size(), 1u);
    EXPECT_EQ((*st)->bytes(), Version(in_flight ? last + 1 : last).at("k").size() +
                                  Version(in_flight ? last + 1 : last).at("meta").size());
    next = (in_flight ? last + 1 : last) + 1;
  }
  std::printf("%d kills, last version %llu, %lld interrupted versions cleaned\n", kills,
              static_cast<unsigned long long>(last), static_cast<long long>(orphans));
  EXPECT_GT(orphans, 0) << "no kill landed inside a replacement";
}

void FillAndClose(const std::string& path, int n) {
  auto st = SegmentStore::Open(Durable(path));
  ASSERT_TRUE(st.ok()) << st.status();
  for (int i = 1; i <= n; ++i) ASSERT_TRUE((*st)->Put(Key(i), "ns", i, BlobsFor(i, SizeOf(i)), BlockBytesOf(i)).ok());
  ASSERT_TRUE((*st)->Flush().ok());
}

TEST(SegmentStoreCorruptionTest, FlippedBytesInBlobFilesAreDetectedNeverReturned) {
  TempDir dir;
  FillAndClose(dir.path(), 40);
  ASSERT_GT(FlipBytesInFiles(dir.path(), ".blob", 25), 0) << "no blob file to damage";
  auto st = SegmentStore::Open(Durable(dir.path()));
  ASSERT_TRUE(st.ok()) << st.status();
  int exact = 0, corrupt = 0;
  std::set<int> damaged;
  for (int i = 1; i <= 40; ++i) {
    auto got = (*st)->Get(Key(i));
    if (got.ok()) {
      ASSERT_EQ(*got, BlobsFor(i, SizeOf(i))) << "segment " << i << ": wrong bytes returned as valid";
      ++exact;
    } else {
      ASSERT_EQ(got.status().code(), StatusCode::kCorruption) << got.status();
      ++corrupt;
      damaged.insert(i);
    }
  }
  EXPECT_GT(corrupt, 0);
  EXPECT_EQ((*st)->stats().corruptions_detected, corrupt);
  // Ranged reads of the same blocks: each exact or Corruption, and they agree
  // with Get (the files do not change between the reads): a segment Get read
  // whole reads whole by ranges, and a damaged one has a range refused.
  std::mt19937_64 rng(99);
  int ranges_exact = 0, ranges_corrupt = 0;
  for (int i = 1; i <= 40; ++i) {
    const auto blobs = BlobsFor(i, SizeOf(i));
    auto layout = (*st)->Layout(Key(i));
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<std::tuple<std::string, uint64_t, uint64_t>> ranges;  // blob, offset, length
    for (const BlobLayout& b : *layout) {
      ranges.emplace_back(b.name, 0, b.size);
      for (int r = 0; r < 4; ++r) {
        const uint64_t offset = rng() % (b.size + 1);
        ranges.emplace_back(b.name, offset, rng() % (b.size - offset + 1));
      }
    }
    int refused = 0;
    for (const auto& [name, offset, length] : ranges) {
      std::string buf(length, '\0');
      const Status r = (*st)->ReadBlob(Key(i), name, offset, length, buf.data());
      if (r.ok()) {
        ASSERT_EQ(buf, blobs.at(name).substr(offset, length))
            << "segment " << i << ", blob '" << name << "' [" << offset << ", +" << length
            << "): wrong bytes returned as valid";
        ++ranges_exact;
      } else {
        ASSERT_EQ(r.code(), StatusCode::kCorruption) << r;
        ++ranges_corrupt;
        ++refused;
      }
    }
    EXPECT_EQ(refused > 0, damaged.count(i) > 0) << "segment " << i << ": Get and ReadBlob disagree";
  }
  EXPECT_GT(ranges_corrupt, 0);
  EXPECT_EQ((*st)->stats().corruptions_detected, corrupt + ranges_corrupt);
  // A corrupt segment can be erased (the caller recomputes and stores it again).
  for (int i = 1; i <= 40; ++i) {
    if (!(*st)->Get(Key(i)).ok()) {
      ASSERT_TRUE((*st)->Erase(Key(i)).ok());
      ASSERT_TRUE((*st)->Put(Key(i), "ns", i, BlobsFor(i, SizeOf(i)), BlockBytesOf(i)).ok());
      auto again = (*st)->Get(Key(i));
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(*again, BlobsFor(i, SizeOf(i)));
    }
  }
  std::printf("blob files damaged: %d segments exact, %d reported corrupt; %d ranged reads exact, %d corrupt\n", exact,
              corrupt, ranges_exact, ranges_corrupt);
}

TEST(SegmentStoreCorruptionTest, FlippedBytesInTableFilesAreDetectedNeverReturned) {
  TempDir dir;
  FillAndClose(dir.path(), 40);
  ASSERT_GT(FlipBytesInFiles(dir.path(), ".sst", 8), 0) << "no table file to damage";
  auto st = SegmentStore::Open(Durable(dir.path()));
  if (!st.ok()) {  // refusing the whole store is allowed, if it says so
    EXPECT_EQ(st.status().code(), StatusCode::kCorruption) << st.status();
    EXPECT_NE(st.status().message().find(dir.path()), std::string::npos) << st.status();
    return;
  }
  for (int i = 1; i <= 40; ++i) {
    auto got = (*st)->Get(Key(i));
    if (got.ok()) {
      ASSERT_EQ(*got, BlobsFor(i, SizeOf(i))) << "segment " << i << ": wrong bytes returned as valid";
    } else {
      EXPECT_TRUE(got.status().code() == StatusCode::kCorruption || got.status().code() == StatusCode::kNotFound)
          << got.status();
    }
    const std::string want = BlobsFor(i, SizeOf(i)).at("k");
    std::string buf(want.size() - 1, '\0');
    const Status r = (*st)->ReadBlob(Key(i), "k", 1, buf.size(), buf.data());
    if (r.ok()) {
      ASSERT_EQ(buf, want.substr(1)) << "segment " << i << ": wrong bytes returned as valid";
    } else {
      EXPECT_TRUE(r.code() == StatusCode::kCorruption || r.code() == StatusCode::kNotFound) << r;
    }
  }
}

}  // namespace
}  // namespace penumbra::storage
