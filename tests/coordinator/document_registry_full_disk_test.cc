// The durable document registry on a full disk (a small tmpfs, tests/
// small_disk.h; skipped where it cannot be mounted): model-based, with
// rounds of a full and a freed disk. A write that fails fails its call with
// RESOURCE_EXHAUSTED naming the registry and saying the disk is full, and
// changes nothing: a failed SetReady leaves the document FAILED (not_stored),
// a failed Remove leaves it READY. When the disk is freed the registry
// writes again without a restart (by Resume and by reopen, both exercised),
// and a reopen holds exactly what the model acknowledged: the READY
// documents with their tokens, and a tombstone per acknowledged removal.
#include <chrono>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/server/document_registry.h"
#include "tests/small_disk.h"

namespace penumbra::coordinator {
namespace {

using penumbra::testing::SmallDisk;

void ExpectDiskFull(const Status& s) {
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("document registry"), std::string::npos) << s;
  EXPECT_NE(s.message().find("disk is full"), std::string::npos) << s;
}

// Waits (bounded) until the registry takes writes again.
::testing::AssertionResult Writable(DocumentRegistry& reg) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  Status s;
  while (!(s = reg.CheckWritable()).ok()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return ::testing::AssertionFailure() << "not writable 10 s after the disk was freed: " << s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return ::testing::AssertionSuccess();
}

TEST(DocumentRegistryFullDisk, FailedWritesChangeNothingAndRecoverWithoutRestart) {
  SmallDisk disk(16);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  const std::string path = disk.dir() + "/registry";
  std::map<std::string, std::vector<int32_t>> ready;  // acknowledged READY
  std::set<std::string> removed;                      // acknowledged removals
  std::set<std::string> not_stored;                   // SetReady failed
  int failed_puts = 0, failed_removes = 0;
  std::mt19937 rng(38);
  {
    auto opened = DocumentRegistry::Open(path, 100000);
    ASSERT_TRUE(opened.ok()) << opened.status();
    DocumentRegistry& reg = **opened;
    for (int round = 0; round < 6; ++round) {
      const bool full = round % 2 == 1;
      if (full) {
        disk.Fill();
      } else {
        disk.Free();
        ASSERT_TRUE(Writable(reg));
      }
      for (int step = 0; step < 30; ++step) {
        if (ready.empty() || rng() % 3 != 0) {
          // 2..8 KiB of token ids: more than what is left of a page.
          std::vector<int32_t> ids(512 + rng() % 1536);
          for (auto& t : ids) t = static_cast<int32_t>(rng() % 50000);
          auto d = reg.Add("t", "doc", ids);
          ASSERT_TRUE(d.ok()) << d.status();
          const Status s = reg.SetReady(d->id, 0, 1.0);
          auto now = reg.Get("t", d->id);
          ASSERT_TRUE(now.ok());
          if (s.ok()) {
            ready[d->id] = ids;
            EXPECT_EQ(now->state, DocumentState::kReady);
          } else {
            ++failed_puts;
            ExpectDiskFull(s);
            EXPECT_EQ(now->state, DocumentState::kFailed);
            EXPECT_TRUE(now->not_stored);
            EXPECT_EQ(now->error_code, StatusCode::kResourceExhausted);
            not_stored.insert(d->id);
            EXPECT_TRUE(full) << "a put failed on a disk with room: " << s;
          }
        } else {
          auto it = ready.begin();
          std::advance(it, rng() % ready.size());
          const std::string id = it->first;
          auto r = reg.Remove("t", id);
          if (r.ok()) {
            ready.erase(id);
            removed.insert(id);
          } else {
            ++failed_removes;
            ExpectDiskFull(r.status());
            auto still = reg.Get("t", id);
            ASSERT_TRUE(still.ok()) << "a failed remove removed it";
            EXPECT_EQ(still->state, DocumentState::kReady);
            EXPECT_TRUE(full) << "a remove failed on a disk with room: " << r.status();
          }
        }
      }
      EXPECT_EQ(reg.write_health().degraded, full && (failed_puts + failed_removes) > 0);
    }
    EXPECT_GT(failed_puts, 0);
    EXPECT_GT(failed_removes, 0);
    const storage::WriteHealth h = reg.write_health();
    EXPECT_GE(h.write_errors, failed_puts + failed_removes);
    EXPECT_GE(h.recoveries, 2);
  }
  disk.Free();
  // After a restart: exactly what was acknowledged.
  auto opened = DocumentRegistry::Open(path, 100000);
  ASSERT_TRUE(opened.ok()) << opened.status();
  DocumentRegistry& reg = **opened;
  auto page = reg.List("t", "", 100000);
  ASSERT_TRUE(page.ok());
  std::map<std::string, std::vector<int32_t>> seen;
  for (const DocumentView& d : page->documents) {
    EXPECT_EQ(d.state, DocumentState::kReady);
    seen[d.id] = *d.ids;
  }
  EXPECT_EQ(seen.size(), ready.size());
  EXPECT_TRUE(seen == ready) << "the READY documents after a restart differ from those acknowledged";
  for (const std::string& id : not_stored) EXPECT_FALSE(reg.Get("t", id).ok()) << id << " failed, yet is back";
  std::set<std::string> tombstones;
  for (const DocumentTombstone& t : reg.Tombstones()) {
    tombstones.insert(t.id);
    EXPECT_EQ(t.tenant, "t");
    EXPECT_EQ(static_cast<int64_t>(t.ids->size()), t.tokens);
  }
  EXPECT_TRUE(tombstones == removed) << tombstones.size() << " tombstones, " << removed.size() << " removals";
}

// RocksDB 7.8 does not switch to a new WAL on Resume when no memtable holds
// anything (facebook/rocksdb#11643): a write that failed right after an Open
// or a recovery must be recovered from by reopening (storage/rocksdb_writer.h).
TEST(DocumentRegistryFullDisk, FailureWithAnEmptyMemtableRecoversByReopen) {
  SmallDisk disk(16);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  const std::string path = disk.dir() + "/registry";
  std::set<std::string> ready;
  auto put = [&](DocumentRegistry& reg) {
    auto d = reg.Add("t", "doc", std::vector<int32_t>(3000, 5));
    EXPECT_TRUE(d.ok());
    Status s = reg.SetReady(d->id, 0, 1.0);
    if (s.ok()) ready.insert(d->id);
    return s;
  };
  {
    auto reg = std::move(DocumentRegistry::Open(path, 1000)).value();
    // Fresh: the memtable is empty.
    disk.Fill();
    ExpectDiskFull(put(*reg));
    disk.Free();
    ASSERT_TRUE(Writable(*reg));
    ASSERT_TRUE(put(*reg).ok());
    EXPECT_EQ(reg->write_health().reopens, 1);
    // A failure with entries in the memtable: Resume (which flushes them,
    // leaving the memtable empty again)...
    disk.Fill();
    ExpectDiskFull(put(*reg));
    disk.Free();
    ASSERT_TRUE(Writable(*reg));
    EXPECT_EQ(reg->write_health().recoveries, 2);
    EXPECT_EQ(reg->write_health().reopens, 1);
    // ... so a failure now is one with an empty memtable again.
    disk.Fill();
    ExpectDiskFull(put(*reg));
    disk.Free();
    ASSERT_TRUE(Writable(*reg));
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(put(*reg).ok());
    EXPECT_EQ(reg->write_health().recoveries, 3);
    EXPECT_EQ(reg->write_health().reopens, 2);
    EXPECT_FALSE(reg->write_health().degraded);
  }
  auto reg = std::move(DocumentRegistry::Open(path, 1000)).value();
  auto page = reg->List("t", "", 1000);
  ASSERT_TRUE(page.ok());
  std::set<std::string> seen;
  for (const DocumentView& d : page->documents) seen.insert(d.id);
  EXPECT_TRUE(seen == ready);
  EXPECT_EQ(ready.size(), 4u);
}

TEST(DocumentRegistryTombstones, KeptUntilEveryWorkerConfirmsAndSurviveRestarts) {
  SmallDisk disk(16);
  if (!disk.ok()) GTEST_SKIP() << disk.why();
  const std::string path = disk.dir() + "/registry";
  std::string a, b;
  {
    auto reg = std::move(DocumentRegistry::Open(path, 100)).value();
    for (std::string* id : {&a, &b}) {
      auto d = reg->Add("t", "doc", {1, 2, 3});
      ASSERT_TRUE(d.ok());
      ASSERT_TRUE(reg->SetReady(d->id, 1, 1.0).ok());
      *id = d->id;
      ASSERT_TRUE(reg->Remove("t", *id).ok());
    }
    EXPECT_EQ(reg->tombstone_count(), 2);
    reg->ConfirmForgotten(a, 0);
    reg->ConfirmForgotten(a, 1);
    reg->ConfirmForgotten(b, 1);
    // Dropping a tombstone is a write too: refused while the registry is
    // degraded (a put failed on the full disk), kept.
    disk.Fill();
    auto big = reg->Add("t", "big", std::vector<int32_t>(4096, 7));
    ASSERT_TRUE(big.ok());
    ASSERT_EQ(reg->SetReady(big->id, 0, 1.0).code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(reg->DropConfirmed(2).code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(reg->tombstone_count(), 2);
    disk.Free();
    ASSERT_TRUE(Writable(*reg));
    ASSERT_TRUE(reg->DropConfirmed(2).ok());
    ASSERT_EQ(reg->tombstone_count(), 1);
    EXPECT_EQ(reg->Tombstones()[0].id, b);
    EXPECT_EQ(reg->Tombstones()[0].confirmed, std::set<int>{1});
  }
  auto reg = std::move(DocumentRegistry::Open(path, 100)).value();
  ASSERT_EQ(reg->tombstone_count(), 1);
  const DocumentTombstone t = reg->Tombstones()[0];
  EXPECT_EQ(t.id, b);
  EXPECT_TRUE(t.confirmed.empty()) << "confirmations are not stored: every worker is asked again";
  EXPECT_EQ(*t.ids, (std::vector<int32_t>{1, 2, 3}));
  reg->ConfirmForgotten(b, 0);
  reg->ConfirmForgotten(b, 1);
  ASSERT_TRUE(reg->DropConfirmed(2).ok());
  EXPECT_EQ(reg->tombstone_count(), 0);
}

}  // namespace
}  // namespace penumbra::coordinator
