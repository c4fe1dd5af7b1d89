// The request journal (coordinator/server/request_journal.h) against a
// trivially correct model (maps), compared after every reopen; damaged
// records are skipped and dropped; the owner id survives reopening.
#include "coordinator/server/request_journal.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

namespace penumbra::coordinator {
namespace {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/penumbra-journal-test-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

JournalRecord RandomRecord(std::mt19937_64& rng, const std::string& id) {
  JournalRecord r;
  r.request_id = id;
  r.tenant = "t" + std::to_string(rng() % 3);
  r.worker = "w" + std::to_string(rng() % 4);
  r.handle = std::to_string(rng());
  r.job_item = rng() % 2;
  for (uint64_t i = 0, n = rng() % 4; i < n; ++i) r.document_ids.push_back("doc-" + std::to_string(rng() % 100));
  r.cache_namespace = r.tenant;
  for (uint64_t i = 0, n = 1 + rng() % 50; i < n; ++i) r.question.push_back(static_cast<int32_t>(rng() % 32000));
  r.max_new_tokens = static_cast<int32_t>(rng() % 5000);
  r.sampling = JournalSampling{0.5 + static_cast<double>(rng() % 10) / 10, 0.9, static_cast<int32_t>(rng() % 50),
                               static_cast<int64_t>(rng() % 1000000)};
  r.stop_ids = {1, static_cast<int32_t>(rng() % 100)};
  if (rng() % 2) r.stop = {"\n\n", "END"};
  r.kv_policy = rng() % 2 ? "full" : "";
  r.share_weight = 1.5;
  r.draws_done = static_cast<int64_t>(rng() % 7);
  for (uint64_t i = 0, n = rng() % 20; i < n; ++i) r.made_before.push_back(static_cast<int32_t>(rng() % 32000));
  r.resumes = static_cast<int32_t>(rng() % 3);
  r.created_unix_ms = 1700000000000 + static_cast<int64_t>(rng() % 1000000);
  r.deadline_unix_ms = rng() % 2 ? r.created_unix_ms + 60000 : 0;
  return r;
}

void ExpectSame(const JournalRecord& a, const JournalRecord& b) {
  EXPECT_EQ(RequestJournal::Encode(a), RequestJournal::Encode(b)) << a.request_id;
}

bool SameUsage(const TenantUsage& a, const TenantUsage& b) {
  return a.requests == b.requests && a.failed == b.failed && a.prompt == b.prompt && a.cached == b.cached &&
         a.generated == b.generated;
}

TEST(RequestJournal, MatchesAModelAcrossReopens) {
  TempDir dir;
  std::mt19937_64 rng(38);
  std::map<std::string, JournalRecord> records;
  std::map<std::string, TenantUsage> usage;
  std::string owner;
  for (int round = 0; round < 8; ++round) {
    auto j = RequestJournal::Open(dir.path());
    ASSERT_TRUE(j.ok()) << j.status();
    if (round == 0) {
      owner = (*j)->owner_id();
      EXPECT_EQ(owner.size(), 34u);
    }
    EXPECT_EQ((*j)->owner_id(), owner) << "the owner id changed across a reopen";
    EXPECT_EQ((*j)->corrupt_records(), 0);
    ASSERT_EQ((*j)->records().size(), records.size());
    for (const JournalRecord& r : (*j)->records()) {
      ASSERT_TRUE(records.count(r.request_id)) << r.request_id;
      ExpectSame(r, records.at(r.request_id));
    }
    ASSERT_EQ((*j)->usage().size(), usage.size());
    for (const auto& [t, u] : (*j)->usage()) {
      ASSERT_TRUE(usage.count(t));
      EXPECT_TRUE(SameUsage(u, usage.at(t))) << t;
    }
    for (int op = 0; op < 50; ++op) {
      const int kind = static_cast<int>(rng() % 4);
      if (kind == 0 || records.empty()) {
        JournalRecord r = RandomRecord(rng, "req-" + std::to_string(round) + "-" + std::to_string(op));
        TenantUsage u = usage[r.tenant];
        ++u.requests;
        ASSERT_TRUE((*j)->Start(r, u).ok());
        usage[r.tenant] = u;
        records[r.request_id] = r;
        continue;
      }
      auto it = records.begin();
      std::advance(it, static_cast<long>(rng() % records.size()));
      if (kind == 1) {
        JournalRecord moved = it->second;
        moved.worker = "w9";
        moved.handle = std::to_string(rng());
        moved.made_before.push_back(7);
        ++moved.resumes;
        ASSERT_TRUE((*j)->Put(moved).ok());
        it->second = moved;
      } else if (kind == 2) {
        TenantUsage u = usage[it->second.tenant];
        u.generated += static_cast<int64_t>(rng() % 1000);
        u.prompt += 10;
        u.failed += static_cast<int64_t>(rng() % 2);
        ASSERT_TRUE((*j)->Finish(it->first, it->second.tenant, u).ok());
        usage[it->second.tenant] = u;
        records.erase(it);
      } else {
        ASSERT_TRUE((*j)->Remove(it->first).ok());
        records.erase(it);
      }
    }
  }
}

TEST(RequestJournal, ADamagedRecordIsSkippedAndDropped) {
  TempDir dir;
  std::mt19937_64 rng(1);
  std::string owner;
  {
    auto j = RequestJournal::Open(dir.path());
    ASSERT_TRUE(j.ok()) << j.status();
    owner = (*j)->owner_id();
    ASSERT_TRUE((*j)->Start(RandomRecord(rng, "req-a"), TenantUsage{1, 0, 0, 0, 0}).ok());
    ASSERT_TRUE((*j)->Start(RandomRecord(rng, "req-b"), TenantUsage{2, 0, 0, 0, 0}).ok());
  }
  {
    // One value's byte flipped, and a record moved under another key.
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), dir.path(), &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::string v;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), "r/req-a", &v).ok());
    v[v.size() / 2] ^= 0x40;
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "r/req-a", v).ok());
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), "r/req-b", &v).ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), "r/req-c", v).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  for (int i = 0; i < 2; ++i) {
    auto j = RequestJournal::Open(dir.path());
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ((*j)->owner_id(), owner);
    ASSERT_EQ((*j)->records().size(), 1u);
    EXPECT_EQ((*j)->records()[0].request_id, "req-b");
    EXPECT_EQ((*j)->corrupt_records(), i == 0 ? 2 : 0) << "damaged records are dropped at the first open";
  }
}

}  // namespace
}  // namespace penumbra::coordinator
