// SegmentStore on real RocksDB: exact round trips of multi-block blobs, a
// model-based test (random put / get / erase / pin / attach / detach /
// eviction / reopen against a std::map model, compared after every step and
// every reopen), quotas and eviction order, bad input, and records of another
// format version or with damaged bytes never taken for valid ones.
#include "storage/segment_store.h"

#include <filesystem>
#include <random>
#include <set>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "tests/storage/segment_store_test_util.h"

namespace penumbra::storage {
namespace {

using testing::BlobsFor;
using testing::TempDir;

SegmentStoreOptions Small(const std::string& path) {
  SegmentStoreOptions o;
  o.path = path;
  o.block_bytes = 4096;
  o.sync_commit = false;  // the crash test checks durability with syncs on
  return o;
}

Hash128 Key(uint64_t i) { return HashBytes128(&i, sizeof(i), 99); }

TEST(SegmentStoreTest, RoundTripsMultiBlockBlobsExactly) {
  TempDir dir;
  auto st = SegmentStore::Open(Small(dir.path()));
  ASSERT_TRUE(st.ok()) << st.status();
  auto& s = **st;
  std::map<std::string, std::string> blobs = {{"k", std::string(10000, 'x')}, {"v", ""}, {"meta", "abc"}};
  for (size_t i = 0; i < blobs["k"].size(); ++i) blobs["k"][i] = static_cast<char>(i * 7);
  ASSERT_TRUE(s.Put(Key(1), "ns", 151, blobs).ok());
  auto got = s.Get(Key(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, blobs);
  auto info = s.Info(Key(1));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens, 151);
  EXPECT_EQ(info->bytes, 10003u);
  EXPECT_EQ(s.NamespaceBytes("ns"), 10003u);
  EXPECT_EQ(s.Get(Key(2)).status().code(), StatusCode::kNotFound);
  st->reset();
  auto again = SegmentStore::Open(Small(dir.path()));
  ASSERT_TRUE(again.ok()) << again.status();
  auto reread = (*again)->Get(Key(1));
  ASSERT_TRUE(reread.ok()) << reread.status();
  EXPECT_EQ(*reread, blobs);
}

TEST(SegmentStoreTest, BadInputIsRefusedAndStoresNothing) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  EXPECT_EQ(SegmentStore::Open(SegmentStoreOptions{}).status().code(), StatusCode::kInvalidArgument);
  o.block_bytes = 10;
  EXPECT_EQ(SegmentStore::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Small(dir.path());
  o.read_threads = 0;
  auto no_threads = SegmentStore::Open(o);
  EXPECT_EQ(no_threads.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_threads.status().message().find("read_threads"), std::string::npos) << no_threads.status();
  o = Small(dir.path());
  o.capacity_bytes = 1000;
  o.namespace_quota_bytes["small"] = 100;
  auto st = SegmentStore::Open(o);
  ASSERT_TRUE(st.ok());
  auto& s = **st;
  EXPECT_EQ(s.Put(Key(1), "ns", 0, {{"a", "x"}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Put(Key(1), "ns", 1, {{"", "x"}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Put(Key(1), "ns", 1, {{"a", std::string(1001, 'x')}}).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Put(Key(1), "small", 1, {{"a", std::string(101, 'x')}}).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Keys().size(), 0u);
  EXPECT_EQ(s.bytes(), 0u);
  EXPECT_EQ(s.Detach(Key(1)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.Attach(Key(1)).code(), StatusCode::kNotFound);
  EXPECT_EQ(s.Erase(Key(1)).code(), StatusCode::kNotFound);
}

TEST(SegmentStoreTest, EvictsLeastRecentlyUsedThatIsNeitherPinnedNorAttached) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  o.capacity_bytes = 3000;
  o.namespace_quota_bytes["q"] = 2000;
  auto st = SegmentStore::Open(o);
  ASSERT_TRUE(st.ok());
  auto& s = **st;
  const std::string kb(1000, 'x');
  ASSERT_TRUE(s.Put(Key(1), "a", 1, {{"b", kb}}).ok());
  ASSERT_TRUE(s.Put(Key(2), "a", 1, {{"b", kb}}).ok());
  ASSERT_TRUE(s.Put(Key(3), "a", 1, {{"b", kb}}).ok());
  ASSERT_TRUE(s.Get(Key(1)).ok());        // 1 is now the most recent
  ASSERT_TRUE(s.Pin(Key(2), true).ok());  // 2 is pinned
  ASSERT_TRUE(s.Put(Key(4), "a", 1, {{"b", kb}}).ok());
  EXPECT_FALSE(s.Contains(Key(3)));       // the oldest unpinned went
  EXPECT_TRUE(s.Contains(Key(1)) && s.Contains(Key(2)) && s.Contains(Key(4)));
  ASSERT_TRUE(s.Attach(Key(1)).ok());
  ASSERT_TRUE(s.Attach(Key(4)).ok());
  // Everything pinned or attached: no room, nothing stored.
  EXPECT_EQ(s.Put(Key(5), "a", 1, {{"b", kb}}).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Erase(Key(1)).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.Detach(Key(4)).ok());
  ASSERT_TRUE(s.Put(Key(5), "a", 1, {{"b", kb}}).ok());
  EXPECT_FALSE(s.Contains(Key(4)));
  // A namespace quota evicts only inside the namespace.
  ASSERT_TRUE(s.Detach(Key(1)).ok());
  ASSERT_TRUE(s.Erase(Key(1)).ok());
  ASSERT_TRUE(s.Put(Key(6), "q", 1, {{"b", kb}}).ok());
  // Stored now: 2 (a, pinned), 5 (a), 6 (q): 3000 bytes, the capacity.
  ASSERT_TRUE(s.Get(Key(5)).ok());  // 6 is now older than 5
  ASSERT_TRUE(s.Put(Key(7), "q", 1, {{"b", kb}}).ok());  // over capacity: the oldest evictable, 6, goes
  EXPECT_FALSE(s.Contains(Key(6)));
  EXPECT_TRUE(s.Contains(Key(5)) && s.Contains(Key(7)));
  ASSERT_TRUE(s.Put(Key(8), "q", 1, {{"b", kb}}).ok());  // over capacity again: 5 (a) is the oldest evictable
  EXPECT_FALSE(s.Contains(Key(5)));
  ASSERT_TRUE(s.Get(Key(7)).ok());
  ASSERT_TRUE(s.Pin(Key(2), false).ok());
  ASSERT_TRUE(s.Erase(Key(2)).ok());  // 1000 bytes free: capacity no longer binds
  ASSERT_TRUE(s.Put(Key(9), "q", 1, {{"b", kb}}).ok());  // q's quota (2000): q's oldest, 8, goes
  EXPECT_FALSE(s.Contains(Key(8)));
  EXPECT_TRUE(s.Contains(Key(7)) && s.Contains(Key(9)));
  EXPECT_EQ(s.NamespaceBytes("q"), 2000u);
  EXPECT_EQ(s.NamespaceBytes("q") + s.NamespaceBytes("a"), s.bytes());
}

// The model: what is stored, with the same eviction rule written plainly.
struct Model {
  struct Seg {
    std::string ns;
    std::map<std::string, std::string> blobs;
    size_t bytes = 0;
    bool pinned = false;
    int attached = 0;
    uint64_t used = 0;
  };
  std::map<uint64_t, Seg> segs;
  uint64_t clock = 1;
  size_t capacity = 0;
  std::map<std::string, size_t> quota;

  size_t Bytes(const std::string* ns) const {
    size_t b = 0;
    for (const auto& [k, s] : segs) {
      if (!ns || s.ns == *ns) b += s.bytes;
    }
    return b;
  }
  // Evicts oldest evictable (in ns when given) until fits(); false if not.
  template <class F>
  bool Room(const std::string* ns, F fits) {
    while (!fits()) {
      uint64_t victim = 0, oldest = UINT64_MAX;
      for (const auto& [k, s] : segs) {
        if (!s.pinned && s.attached == 0 && (!ns || s.ns == *ns) && s.used < oldest) {
          oldest = s.used;
          victim = k;
        }
      }
      if (oldest == UINT64_MAX) return false;
      segs.erase(victim);
    }
    return true;
  }
  bool Put(uint64_t k, const std::string& ns, const std::map<std::string, std::string>& blobs) {
    if (segs.count(k)) return true;
    Seg s{ns, blobs, 0, false, 0, 0};
    for (const auto& [n, b] : blobs) s.bytes += b.size();
    if (auto q = quota.find(ns); q != quota.end()) {
      if (s.bytes > q->second || !Room(&ns, [&] { return Bytes(&ns) + s.bytes <= q->second; })) return false;
    }
    if (s.bytes > capacity || !Room(nullptr, [&] { return Bytes(nullptr) + s.bytes <= capacity; })) return false;
    s.used = clock++;
    segs[k] = std::move(s);
    return true;
  }
};

TEST(SegmentStoreTest, ModelBasedRandomOperationsAndReopens) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  o.capacity_bytes = 60000;
  o.namespace_quota_bytes["t1"] = 25000;
  Model m;
  m.capacity = o.capacity_bytes;
  m.quota = o.namespace_quota_bytes;
  auto opened = SegmentStore::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<SegmentStore> s = std::move(*opened);
  std::mt19937_64 rng(20261124);
  const std::vector<std::string> namespaces = {"t0", "t1", "t2"};
  int refused = 0, reopens = 0;
  auto compare = [&](int step) {
    ASSERT_EQ(s->Keys().size(), m.segs.size()) << "step " << step;
    for (const auto& [k, seg] : m.segs) {
      auto info = s->Info(Key(k));
      ASSERT_TRUE(info.ok()) << "step " << step << " key " << k << ": " << info.status();
      EXPECT_EQ(info->cache_namespace, seg.ns);
      EXPECT_EQ(info->pinned, seg.pinned);
      EXPECT_EQ(info->attached, seg.attached);
      EXPECT_EQ(info->bytes, seg.bytes);
    }
    for (const auto& ns : namespaces) EXPECT_EQ(s->NamespaceBytes(ns), m.Bytes(&ns)) << "step " << step;
  };
  for (int step = 0; step < 1500; ++step) {
    const uint64_t k = rng() % 40;
    const int op = static_cast<int>(rng() % 100);
    if (op < 35) {  // put
      const std::string& ns = namespaces[rng() % 3];
      const auto blobs = BlobsFor(k, rng() % 12000);
      const bool stored = m.Put(k, ns, blobs);
      const Status st = s->Put(Key(k), ns, 10 + static_cast<int64_t>(k), blobs);
      ASSERT_EQ(st.ok(), stored) << "step " << step << ": " << st;
      if (!st.ok()) {
        ASSERT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
        ++refused;
      }
    } else if (op < 60) {  // get
      auto got = s->Get(Key(k));
      auto it = m.segs.find(k);
      if (it == m.segs.end()) {
        ASSERT_EQ(got.status().code(), StatusCode::kNotFound) << "step " << step;
      } else {
        ASSERT_TRUE(got.ok()) << "step " << step << ": " << got.status();
        ASSERT_EQ(*got, it->second.blobs) << "step " << step;
        it->second.used = m.clock++;
      }
    } else if (op < 68) {  // erase
      auto it = m.segs.find(k);
      const Status st = s->Erase(Key(k));
      if (it == m.segs.end()) {
        ASSERT_EQ(st.code(), StatusCode::kNotFound);
      } else if (it->second.attached > 0) {
        ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition);
      } else {
        ASSERT_TRUE(st.ok()) << st;
        m.segs.erase(it);
      }
    } else if (op < 78) {  // pin / unpin
      const bool pin = rng() % 3 != 0;
      auto it = m.segs.find(k);
      const Status st = s->Pin(Key(k), pin);
      ASSERT_EQ(st.ok(), it != m.segs.end());
      if (it != m.segs.end()) it->second.pinned = pin;
    } else if (op < 88) {  // attach
      auto it = m.segs.find(k);
      ASSERT_EQ(s->Attach(Key(k)).ok(), it != m.segs.end());
      if (it != m.segs.end()) ++it->second.attached;
    } else if (op < 97) {  // detach
      auto it = m.segs.find(k);
      const bool can = it != m.segs.end() && it->second.attached > 0;
      ASSERT_EQ(s->Detach(Key(k)).ok(), can);
      if (can) --it->second.attached;
    } else {  // close and reopen: attachments are in memory only
      ++reopens;
      s.reset();
      auto re = SegmentStore::Open(o);
      ASSERT_TRUE(re.ok()) << re.status();
      s = std::move(*re);
      for (auto& [key, seg] : m.segs) seg.attached = 0;
      for (const auto& [key, seg] : m.segs) {
        auto got = s->Get(Key(key));
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(*got, seg.blobs);
      }
      // The reads above made every segment recent, in key order.
      for (auto& [key, seg] : m.segs) seg.used = m.clock++;
    }
    compare(step);
  }
  EXPECT_EQ(s->stats().corruptions_detected, 0);
  // The run exercised what it is meant to: eviction, refusals and reopens.
  EXPECT_GT(s->stats().evictions, 0);
  EXPECT_GT(refused, 0);
  EXPECT_GT(reopens, 10);
  RecordProperty("refused", refused);
}

TEST(SegmentStoreTest, RecordsOfAnotherVersionOrDamagedAreNotTakenForValid) {
  TempDir dir;
  {
    auto st = SegmentStore::Open(Small(dir.path()));
    ASSERT_TRUE(st.ok());
    ASSERT_TRUE((*st)->Put(Key(1), "ns", 5, BlobsFor(1, 5000)).ok());
    ASSERT_TRUE((*st)->Put(Key(2), "ns", 5, BlobsFor(2, 5000)).ok());
  }
  {  // Rewrite record 1 as format version 2 and record 2 with a flipped byte.
    rocksdb::DBOptions dbo;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}, {"blocks", {}}, {"pending", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(dbo, dir.path(), cfs, &h, &db).ok());
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), h[1]));
    std::vector<std::pair<std::string, std::string>> recs;
    for (it->SeekToFirst(); it->Valid(); it->Next()) recs.push_back({it->key().ToString(), it->value().ToString()});
    it.reset();
    ASSERT_EQ(recs.size(), 2u);
    auto key_of = [](const Hash128& k) {
      std::string s;
      for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>(k.hi >> (8 * i)));
      for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>(k.lo >> (8 * i)));
      return s;
    };
    for (auto& [k, v] : recs) {
      if (k == key_of(Key(1))) {
        v[4] = 2;  // version field
      } else {
        v[v.size() / 2] ^= 0x40;
      }
      ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), h[1], k, v).ok());
    }
    for (auto* x : h) ASSERT_TRUE(db->DestroyColumnFamilyHandle(x).ok());
    delete db;
  }
  auto st = SegmentStore::Open(Small(dir.path()));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ((*st)->Keys().size(), 0u);
  EXPECT_EQ((*st)->Get(Key(1)).status().code(), StatusCode::kNotFound);
  const SegmentStoreStats stats = (*st)->stats();
  EXPECT_EQ(stats.unknown_versions, 1);
  EXPECT_EQ(stats.corruptions_detected, 1);
  // Their blocks are left alone: a newer version's data is not this
  // binary's to delete, and a damaged record's blocks are unreachable.
  EXPECT_EQ(stats.orphans_removed, 0);
}

}  // namespace
}  // namespace penumbra::storage
