// SegmentStore on real RocksDB: exact round trips of multi-block blobs, a
// model-based test (random put / get / ranged read / erase / pin / attach /
// detach / eviction / reopen with another block size against a std::map
// model, compared after every step and every reopen), per-blob block sizes,
// ranged reads (exact, in parallel with puts and evictions), quotas and
// eviction order, bad input, records of another format version (format 1
// included) or with damaged bytes never taken for valid ones, and Put over a
// key already stored (the same content a no-op, other content replacing it
// whole, readers seeing one version or the other).
#include "storage/segment_store.h"

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

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

// Bytes that follow from (seed, n).
std::string Bytes(uint64_t seed, size_t n) {
  std::string b(n, '\0');
  std::mt19937_64 r(seed);
  for (auto& c : b) c = static_cast<char>(r());
  return b;
}

TEST(SegmentStoreTest, PerBlobBlockSizesAreRecordedAndReadBackUnderAnotherBlockBytes) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  o.block_bytes = 8192;
  const std::map<std::string, std::string> one = {{"k", Bytes(1, 30000)}, {"v", Bytes(2, 20000)}, {"e", ""}};
  const std::map<std::string, std::string> two = {{"k", Bytes(3, 16384)}};
  const std::map<std::string, std::string> three = {{"k", Bytes(4, 100000)}, {"v", Bytes(5, 4095)}};
  const std::vector<BlobLayout> one_layout = {{"e", 0, 4096, 0}, {"k", 30000, 4096, 8}, {"v", 20000, 8192, 3}};
  auto layout_is = [](SegmentStore& s, uint64_t k, const std::vector<BlobLayout>& want) {
    auto got = s.Layout(Key(k));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ((*got)[i].name, want[i].name) << "segment " << k << " blob " << i;
      EXPECT_EQ((*got)[i].size, want[i].size) << want[i].name;
      EXPECT_EQ((*got)[i].block_bytes, want[i].block_bytes) << want[i].name;
      EXPECT_EQ((*got)[i].blocks, want[i].blocks) << want[i].name;
    }
  };
  {
    auto st = SegmentStore::Open(o);
    ASSERT_TRUE(st.ok()) << st.status();
    auto& s = **st;
    // Bad block sizes: refused, naming the blob, and nothing stored.
    auto refused = [&](const std::map<std::string, size_t>& sizes, const std::string& name) {
      const Status r = s.Put(Key(1), "ns", 1, one, sizes);
      EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << r;
      EXPECT_NE(r.message().find("'" + name + "'"), std::string::npos) << r;
    };
    refused({{"x", 4096}}, "x");
    refused({{"k", 4095}}, "k");
    refused({{"k", 4096}, {"v", SegmentStore::kMaxBlockBytes + 1}}, "v");
    refused({{"v", 0}}, "v");
    EXPECT_FALSE(s.Contains(Key(1)));
    EXPECT_EQ(s.bytes(), 0u);
    // "e" (empty) and "k" at 4 KiB, "v" at the store's 8 KiB.
    ASSERT_TRUE(s.Put(Key(1), "ns", 1, one, {{"k", 4096}, {"e", 4096}}).ok());
    ASSERT_TRUE(s.Put(Key(2), "ns", 1, two, {{"k", SegmentStore::kMaxBlockBytes}}).ok());
    layout_is(s, 1, one_layout);
    layout_is(s, 2, {{"k", 16384, SegmentStore::kMaxBlockBytes, 1}});
    EXPECT_EQ(s.Layout(Key(9)).status().code(), StatusCode::kNotFound);
    auto got = s.Get(Key(1));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, one);
  }
  // Another store-wide block size: what is stored reads back as it was cut;
  // new segments take the new size.
  o.block_bytes = 65536;
  {
    auto st = SegmentStore::Open(o);
    ASSERT_TRUE(st.ok()) << st.status();
    auto& s = **st;
    layout_is(s, 1, one_layout);
    auto got1 = s.Get(Key(1));
    ASSERT_TRUE(got1.ok()) << got1.status();
    EXPECT_EQ(*got1, one);
    auto got2 = s.Get(Key(2));
    ASSERT_TRUE(got2.ok()) << got2.status();
    EXPECT_EQ(*got2, two);
    std::string part(10000, '\0');
    ASSERT_TRUE(s.ReadBlob(Key(1), "k", 12345, part.size(), part.data()).ok());
    EXPECT_EQ(part, one.at("k").substr(12345, part.size()));
    ASSERT_TRUE(s.Put(Key(3), "ns", 1, three).ok());
    layout_is(s, 3, {{"k", 100000, 65536, 2}, {"v", 4095, 65536, 1}});
  }
  o.block_bytes = 4096;
  auto st = SegmentStore::Open(o);
  ASSERT_TRUE(st.ok()) << st.status();
  for (const auto& [k, blobs] :
       std::map<uint64_t, const std::map<std::string, std::string>*>{{1, &one}, {2, &two}, {3, &three}}) {
    auto got = (*st)->Get(Key(k));
    ASSERT_TRUE(got.ok()) << "segment " << k << ": " << got.status();
    EXPECT_EQ(*got, *blobs) << "segment " << k;
  }
  EXPECT_EQ((*st)->stats().corruptions_detected, 0);
}

TEST(SegmentStoreTest, GetOnlyReadsTheNamedBlobs) {
  TempDir dir;
  auto st = SegmentStore::Open(Small(dir.path()));
  ASSERT_TRUE(st.ok()) << st.status();
  auto& s = **st;
  const std::map<std::string, std::string> blobs = {{"a", Bytes(1, 9000)}, {"b", Bytes(2, 100)}, {"c", ""}};
  ASSERT_TRUE(s.Put(Key(1), "ns", 1, blobs, {{"a", 8192}}).ok());
  auto a = s.Get(Key(1), {"a"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, (std::map<std::string, std::string>{{"a", blobs.at("a")}}));
  auto bc = s.Get(Key(1), {"b", "c"});
  ASSERT_TRUE(bc.ok()) << bc.status();
  EXPECT_EQ(*bc, (std::map<std::string, std::string>{{"b", blobs.at("b")}, {"c", ""}}));
  auto none = s.Get(Key(1), {});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  auto all = s.Get(Key(1), {"a", "b", "c"});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, blobs);
  auto bad = s.Get(Key(1), {"a", "zz"});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'zz'"), std::string::npos) << bad.status();
  EXPECT_EQ(s.Get(Key(2), {"a"}).status().code(), StatusCode::kNotFound);
}

TEST(SegmentStoreTest, ReadBlobCopiesExactlyTheRangeAskedFor) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  o.read_threads = 3;
  auto st = SegmentStore::Open(o);
  ASSERT_TRUE(st.ok()) << st.status();
  auto& s = **st;
  // "k": 5 full blocks of 4 KiB and a last one of 123 bytes; "v": 8 KiB
  // blocks; "one": a single partial block; "e": empty.
  const std::map<std::string, std::string> blobs = {
      {"k", Bytes(1, 5 * 4096 + 123)}, {"v", Bytes(2, 50000)}, {"one", Bytes(3, 777)}, {"e", ""}};
  ASSERT_TRUE(s.Put(Key(1), "ns", 1, blobs, {{"v", 8192}}).ok());
  int64_t reads = 0;
  // Reads [offset, offset + length) into a buffer with guard bytes on both
  // sides, and checks the range and the guards.
  auto check = [&](const std::string& name, uint64_t offset, uint64_t length) {
    const std::string& want = blobs.at(name);
    constexpr size_t kGuard = 64;
    std::string buf(length + 2 * kGuard, '\x5c');
    const Status r = s.ReadBlob(Key(1), name, offset, length, buf.data() + kGuard);
    ASSERT_TRUE(r.ok()) << name << " [" << offset << ", +" << length << "): " << r;
    ++reads;
    ASSERT_EQ(buf.substr(kGuard, length), want.substr(offset, length))
        << name << " [" << offset << ", +" << length << ")";
    ASSERT_EQ(buf.substr(0, kGuard), std::string(kGuard, '\x5c')) << "wrote before dst";
    ASSERT_EQ(buf.substr(kGuard + length), std::string(kGuard, '\x5c')) << "wrote past dst + length";
  };
  const uint64_t k = blobs.at("k").size();
  check("k", 100, 200);            // inside one block
  check("k", 0, 4096);             // exactly one block
  check("k", 4000, 200);           // across a block boundary
  check("k", 4095, 4096 * 3 + 2);  // four blocks, partly covered at both ends
  check("k", 5 * 4096, 123);       // the last, partial block
  check("k", 5 * 4096 - 10, 133);  // into the last block
  check("k", 0, k);                // the whole blob
  check("k", 0, 0);                // nothing, at the start, inside, at the end
  check("k", 5000, 0);
  check("k", k, 0);
  check("one", 0, 777);
  check("one", 776, 1);
  check("e", 0, 0);
  check("v", 8191, 8194);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 500; ++i) {
    const std::string& name = i % 2 ? "k" : "v";
    const uint64_t size = blobs.at(name).size();
    const uint64_t offset = rng() % (size + 1);
    // Mostly small ranges (what a chunk read is), some long.
    const uint64_t length = rng() % (i % 5 == 0 ? size - offset + 1 : std::min<uint64_t>(size - offset, 9000) + 1);
    check(name, offset, length);
  }
  // Bad ranges and names: refused, naming what was wrong.
  char c = 0;
  auto refused = [&](const std::string& name, uint64_t offset, uint64_t length, const std::string& says) {
    const Status r = s.ReadBlob(Key(1), name, offset, length, &c);
    EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << r;
    EXPECT_NE(r.message().find(says), std::string::npos) << r;
  };
  refused("k", k, 1, "'k'");
  refused("k", k + 1, 0, "'k'");
  refused("k", 1, k, "'k'");
  refused("k", 1, UINT64_MAX, "'k'");
  refused("k", UINT64_MAX, 2, "'k'");
  refused("e", 0, 1, "'e'");
  refused("nope", 0, 0, "'nope'");
  EXPECT_EQ(s.ReadBlob(Key(2), "k", 0, 1, &c).code(), StatusCode::kNotFound);
  EXPECT_EQ(s.stats().blob_reads, reads);
  EXPECT_EQ(s.stats().corruptions_detected, 0);
}

TEST(SegmentStoreTest, ReadBlobMarksTheSegmentUsedAcrossAReopen) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  o.capacity_bytes = 3000;
  const std::string kb(1000, 'x');
  {
    auto st = SegmentStore::Open(o);
    ASSERT_TRUE(st.ok());
    for (uint64_t k = 1; k <= 3; ++k) ASSERT_TRUE((*st)->Put(Key(k), "a", 1, {{"b", kb}}).ok());
    char c = 0;
    ASSERT_TRUE((*st)->ReadBlob(Key(1), "b", 10, 1, &c).ok());  // 1 is now the most recent
  }
  auto st = SegmentStore::Open(o);
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE((*st)->Put(Key(4), "a", 1, {{"b", kb}}).ok());
  EXPECT_TRUE((*st)->Contains(Key(1)));
  EXPECT_FALSE((*st)->Contains(Key(2)));  // the oldest went
}

// 16 threads read random ranges of attached segments (and, now and then, of
// segments being evicted) while another thread puts, gets and erases:
// every read of an attached segment is exact, and a read of an unattached
// one is exact or NotFound, never other bytes.
TEST(SegmentStoreTest, ReadBlobsRunInParallelWithPutsAndEvictions) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  o.capacity_bytes = 600000;
  o.read_threads = 4;
  auto st = SegmentStore::Open(o);
  ASSERT_TRUE(st.ok()) << st.status();
  SegmentStore& s = **st;
  auto size_of = [](uint64_t k) { return 20000 + (k * 7919) % 30000; };
  auto block_bytes_of = [](uint64_t k) -> std::map<std::string, size_t> {
    if (k % 3 == 0) return {};
    return {{"k", k % 3 == 1 ? 4096 : 12288}};
  };
  constexpr uint64_t kAttached = 8;
  for (uint64_t k = 1; k <= kAttached; ++k) {
    ASSERT_TRUE(s.Put(Key(k), "ns", 1, BlobsFor(k, size_of(k)), block_bytes_of(k)).ok());
    ASSERT_TRUE(s.Attach(Key(k)).ok());
  }
  std::atomic<bool> done{false};
  std::atomic<int> writer_puts{0};
  std::thread writer([&] {
    std::mt19937_64 rng(1);
    // At least 40 puts (about 1.4 MB through 320 kB of room): evictions.
    for (uint64_t k = 100; !done || writer_puts < 40; ++k) {
      const Status p = s.Put(Key(k), "ns", 1, BlobsFor(k, size_of(k)), block_bytes_of(k));
      ASSERT_TRUE(p.ok()) << p;
      ++writer_puts;
      const uint64_t other = 100 + rng() % (k - 99);
      if (rng() % 4 == 0) {
        const Status e = s.Erase(Key(other));
        ASSERT_TRUE(e.ok() || e.code() == StatusCode::kNotFound) << e;
      } else if (auto got = s.Get(Key(other)); got.ok()) {
        ASSERT_EQ(*got, BlobsFor(other, size_of(other))) << "segment " << other;
      } else {
        ASSERT_EQ(got.status().code(), StatusCode::kNotFound) << got.status();
      }
    }
  });
  constexpr int kReaders = 16, kReadsEach = 300;
  std::atomic<int> exact{0}, exact_unattached{0}, gone{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < kReaders; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      std::string buf;
      for (int i = 0; i < kReadsEach; ++i) {
        const bool attached = rng() % 4 != 0;
        // Unattached: one of the last dozen the writer put, the ones its
        // next puts evict.
        const uint64_t puts = static_cast<uint64_t>(writer_puts.load());
        const uint64_t k = attached ? 1 + rng() % kAttached : 100 + puts - rng() % std::min<uint64_t>(puts + 1, 12);
        const auto blobs = BlobsFor(k, size_of(k));
        const std::string& want = blobs.at("k");
        const uint64_t offset = rng() % want.size();
        const uint64_t length = 1 + rng() % std::min<uint64_t>(want.size() - offset, 16384);
        buf.assign(length, '\0');
        const Status r = s.ReadBlob(Key(k), "k", offset, length, buf.data());
        if (r.ok()) {
          ASSERT_EQ(buf, want.substr(offset, length)) << "segment " << k << " [" << offset << ", +" << length << ")";
          ++exact;
          if (!attached) ++exact_unattached;
        } else {
          ASSERT_FALSE(attached) << "attached segment " << k << ": " << r;
          ASSERT_EQ(r.code(), StatusCode::kNotFound) << "segment " << k << ": " << r;
          ++gone;
        }
      }
    });
  }
  for (auto& r : readers) r.join();
  done = true;
  writer.join();
  for (uint64_t k = 1; k <= kAttached; ++k) {
    ASSERT_TRUE(s.Contains(Key(k)));
    ASSERT_TRUE(s.Detach(Key(k)).ok());
  }
  EXPECT_GT(exact, kReaders * kReadsEach / 2);
  EXPECT_GT(s.stats().evictions, 0) << "the writer never evicted: the test did not read beside evictions";
  EXPECT_EQ(s.stats().corruptions_detected, 0);
  std::printf("%d exact reads (%d of unattached segments), %d of evicted ones, %d puts beside them, %lld evictions\n",
              exact.load(), exact_unattached.load(), gone.load(), writer_puts.load(),
              static_cast<long long>(s.stats().evictions));
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
  EXPECT_FALSE(s.Contains(Key(3)));  // the oldest unpinned went
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
  ASSERT_TRUE(s.Get(Key(5)).ok());                       // 6 is now older than 5
  ASSERT_TRUE(s.Put(Key(7), "q", 1, {{"b", kb}}).ok());  // over capacity: the oldest evictable, 6, goes
  EXPECT_FALSE(s.Contains(Key(6)));
  EXPECT_TRUE(s.Contains(Key(5)) && s.Contains(Key(7)));
  ASSERT_TRUE(s.Put(Key(8), "q", 1, {{"b", kb}}).ok());  // over capacity again: 5 (a) is the oldest evictable
  EXPECT_FALSE(s.Contains(Key(5)));
  ASSERT_TRUE(s.Get(Key(7)).ok());
  ASSERT_TRUE(s.Pin(Key(2), false).ok());
  ASSERT_TRUE(s.Erase(Key(2)).ok());                     // 1000 bytes free: capacity no longer binds
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
    std::map<std::string, size_t> block_bytes;  // every blob's
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
  // Evicts oldest evictable (in ns when given; never `keep`) until fits();
  // false if not.
  template <class F>
  bool Room(const std::string* ns, uint64_t keep, F fits) {
    while (!fits()) {
      uint64_t victim = 0, oldest = UINT64_MAX;
      for (const auto& [k, s] : segs) {
        if (!s.pinned && s.attached == 0 && (!ns || s.ns == *ns) && k != keep && s.used < oldest) {
          oldest = s.used;
          victim = k;
        }
      }
      if (oldest == UINT64_MAX) return false;
      segs.erase(victim);
    }
    return true;
  }
  enum class PutResult { kStored, kNoRoom, kAttached };
  // A key present with the same content (namespace and blobs; the tokens
  // follow from the key here) is left as it is; other content replaces it,
  // pin kept, unless attached; room is made without evicting or counting
  // the version replaced.
  PutResult Put(uint64_t k, const std::string& ns, const std::map<std::string, std::string>& blobs,
                const std::map<std::string, size_t>& block_bytes) {
    const Seg* old = nullptr;
    if (auto it = segs.find(k); it != segs.end()) {
      if (it->second.ns == ns && it->second.blobs == blobs) return PutResult::kStored;
      if (it->second.attached > 0) return PutResult::kAttached;
      old = &it->second;
    }
    Seg s{ns, blobs, block_bytes, 0, old ? old->pinned : false, 0, 0};
    for (const auto& [n, b] : blobs) s.bytes += b.size();
    const size_t old_ns = old && old->ns == ns ? old->bytes : 0, old_all = old ? old->bytes : 0;
    if (auto q = quota.find(ns); q != quota.end()) {
      if (s.bytes > q->second || !Room(&ns, k, [&] { return Bytes(&ns) - old_ns + s.bytes <= q->second; })) {
        return PutResult::kNoRoom;
      }
    }
    if (s.bytes > capacity || !Room(nullptr, k, [&] { return Bytes(nullptr) - old_all + s.bytes <= capacity; })) {
      return PutResult::kNoRoom;
    }
    s.used = clock++;
    segs[k] = std::move(s);
    return PutResult::kStored;
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
  int refused = 0, reopens = 0, refused_attached = 0, replaced_or_same = 0;
  int64_t evictions = 0, corruptions = 0;  // over every open (stats are per open)
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
    for (const auto& [k, seg] : m.segs) {
      auto layout = s->Layout(Key(k));
      ASSERT_TRUE(layout.ok()) << "step " << step << " key " << k << ": " << layout.status();
      ASSERT_EQ(layout->size(), seg.blobs.size()) << "step " << step;
      auto blob = seg.blobs.begin();
      for (const BlobLayout& l : *layout) {
        const size_t block_bytes = seg.block_bytes.at(blob->first);
        EXPECT_EQ(l.name, blob->first) << "step " << step << " key " << k;
        EXPECT_EQ(l.size, blob->second.size()) << "step " << step << " key " << k << " " << l.name;
        EXPECT_EQ(l.block_bytes, block_bytes) << "step " << step << " key " << k << " " << l.name;
        EXPECT_EQ(l.blocks, (blob->second.size() + block_bytes - 1) / block_bytes) << "step " << step << " key " << k;
        ++blob;
      }
    }
  };
  for (int step = 0; step < 2000; ++step) {
    const uint64_t k = rng() % 40;
    const int op = static_cast<int>(rng() % 100);
    if (op < 33) {  // put, some blobs with their own block size
      const std::string& ns = namespaces[rng() % 3];
      const auto blobs = BlobsFor(k, rng() % 12000);
      const std::vector<std::map<std::string, size_t>> choices = {
          {}, {{"k", 4096}}, {{"k", 16384}}, {{"k", 8192}, {"meta", 4096}}};
      const std::map<std::string, size_t>& given = choices[rng() % choices.size()];
      std::map<std::string, size_t> block_bytes;
      for (const auto& [name, b] : blobs) block_bytes[name] = given.count(name) ? given.at(name) : o.block_bytes;
      const bool present = m.segs.count(k) > 0;
      const Model::PutResult want = m.Put(k, ns, blobs, block_bytes);
      const Status st = s->Put(Key(k), ns, 10 + static_cast<int64_t>(k), blobs, given);
      switch (want) {
        case Model::PutResult::kStored:
          ASSERT_TRUE(st.ok()) << "step " << step << ": " << st;
          if (present) ++replaced_or_same;
          break;
        case Model::PutResult::kNoRoom:
          ASSERT_EQ(st.code(), StatusCode::kResourceExhausted) << "step " << step << ": " << st;
          ++refused;
          break;
        case Model::PutResult::kAttached:
          ASSERT_EQ(st.code(), StatusCode::kFailedPrecondition) << "step " << step << ": " << st;
          ASSERT_NE(st.message().find(Key(k).Hex()), std::string::npos) << st;
          ++refused_attached;
          break;
      }
    } else if (op < 47) {  // get
      auto got = s->Get(Key(k));
      auto it = m.segs.find(k);
      if (it == m.segs.end()) {
        ASSERT_EQ(got.status().code(), StatusCode::kNotFound) << "step " << step;
      } else {
        ASSERT_TRUE(got.ok()) << "step " << step << ": " << got.status();
        ASSERT_EQ(*got, it->second.blobs) << "step " << step;
        it->second.used = m.clock++;
      }
    } else if (op < 52) {  // get some blobs
      const std::set<std::string> only = rng() % 2 ? std::set<std::string>{"k"} : std::set<std::string>{"meta"};
      auto got = s->Get(Key(k), only);
      auto it = m.segs.find(k);
      if (it == m.segs.end()) {
        ASSERT_EQ(got.status().code(), StatusCode::kNotFound) << "step " << step;
      } else {
        ASSERT_TRUE(got.ok()) << "step " << step << ": " << got.status();
        std::map<std::string, std::string> want;
        for (const std::string& name : only) want[name] = it->second.blobs.at(name);
        ASSERT_EQ(*got, want) << "step " << step;
        it->second.used = m.clock++;
      }
    } else if (op < 62) {  // read a range of one blob
      const std::string name = rng() % 4 ? "k" : "meta";
      auto it = m.segs.find(k);
      const std::string* want = it == m.segs.end() ? nullptr : &it->second.blobs.at(name);
      const uint64_t size = want ? want->size() : 1;
      const uint64_t offset = rng() % (size + 1);
      const uint64_t length = rng() % (size - offset + 1);
      std::string buf(length, '\0');
      const Status st = s->ReadBlob(Key(k), name, offset, length, buf.data());
      if (!want) {
        ASSERT_EQ(st.code(), StatusCode::kNotFound) << "step " << step << ": " << st;
      } else {
        ASSERT_TRUE(st.ok()) << "step " << step << ": " << st;
        ASSERT_EQ(buf, want->substr(offset, length)) << "step " << step << " [" << offset << ", +" << length << ")";
        it->second.used = m.clock++;
      }
    } else if (op < 69) {  // erase
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
    } else {  // close and reopen (another block size): attachments are in memory only
      ++reopens;
      evictions += s->stats().evictions;
      corruptions += s->stats().corruptions_detected;
      s.reset();
      o.block_bytes = 4096 * static_cast<size_t>(1 + reopens % 3);
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
  evictions += s->stats().evictions;
  corruptions += s->stats().corruptions_detected;
  EXPECT_EQ(corruptions, 0);
  // The run exercised what it is meant to: eviction, refusals and reopens.
  EXPECT_GT(evictions, 0);
  EXPECT_GT(refused, 0);
  EXPECT_GT(reopens, 10);
  EXPECT_GT(replaced_or_same, 0);
  EXPECT_GT(refused_attached, 0);
  RecordProperty("refused", refused);
  RecordProperty("evictions", static_cast<int>(evictions));
}

// The raw RocksDB under a closed store: its column families, in Open's order.
struct RawDb {
  explicit RawDb(const std::string& path) {
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}, {"blocks", {}}, {"pending", {}}};
    rocksdb::DB* d = nullptr;
    const rocksdb::Status s = rocksdb::DB::Open(rocksdb::DBOptions(), path, cfs, &h, &d);
    CHECK(s.ok()) << s.ToString();
    db.reset(d);
  }
  ~RawDb() {
    for (auto* x : h) CHECK(db->DestroyColumnFamilyHandle(x).ok());
  }
  rocksdb::ColumnFamilyHandle* meta() const { return h[1]; }
  rocksdb::ColumnFamilyHandle* blocks() const { return h[2]; }
  rocksdb::ColumnFamilyHandle* pending() const { return h[3]; }
  std::vector<rocksdb::ColumnFamilyHandle*> h;
  std::unique_ptr<rocksdb::DB> db;
};

// The 16-byte segment key: hi, lo big-endian.
std::string KeyBytes(const Hash128& k) {
  std::string s;
  for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>(k.hi >> (8 * i)));
  for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>(k.lo >> (8 * i)));
  return s;
}

// A record as format 1 wrote it (per blob: name, size, block count; no block
// size): what a store written by the previous binary holds.
std::string FormatOneRecord(const std::string& ns, int64_t tokens, const std::map<std::string, std::string>& blobs,
                            size_t block_bytes) {
  std::string s;
  auto u32 = [&](uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [&](uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); };
  auto str = [&](const std::string& v) {
    u32(static_cast<uint32_t>(v.size()));
    s += v;
  };
  constexpr uint32_t kRecordMagic = 0x47455350;  // "PSEG"
  u32(kRecordMagic);
  u32(1);
  str(ns);
  u64(static_cast<uint64_t>(tokens));
  s.push_back(0);  // pinned
  u64(1);          // last use
  u32(static_cast<uint32_t>(blobs.size()));
  for (const auto& [name, b] : blobs) {
    str(name);
    u64(b.size());
    u32(static_cast<uint32_t>((b.size() + block_bytes - 1) / block_bytes));
  }
  u64(Hash64(s.data(), s.size(), kRecordMagic));
  return s;
}

TEST(SegmentStoreTest, RecordsOfAnotherVersionOrDamagedAreNotTakenForValid) {
  TempDir dir;
  {
    auto st = SegmentStore::Open(Small(dir.path()));
    ASSERT_TRUE(st.ok());
    for (uint64_t k = 1; k <= 3; ++k) ASSERT_TRUE((*st)->Put(Key(k), "ns", 5, BlobsFor(k, 5000)).ok());
  }
  {  // Record 1 becomes format version 4 (a newer binary's), record 2 gets a
     // flipped byte, record 3 is written as format 1 wrote it.
    RawDb raw(dir.path());
    std::unique_ptr<rocksdb::Iterator> it(raw.db->NewIterator(rocksdb::ReadOptions(), raw.meta()));
    std::vector<std::pair<std::string, std::string>> recs;
    for (it->SeekToFirst(); it->Valid(); it->Next()) recs.push_back({it->key().ToString(), it->value().ToString()});
    it.reset();
    ASSERT_EQ(recs.size(), 3u);
    for (auto& [k, v] : recs) {
      if (k == KeyBytes(Key(1))) {
        v[4] = 4;  // version field
      } else if (k == KeyBytes(Key(2))) {
        v[v.size() / 2] ^= 0x40;
      } else {
        v = FormatOneRecord("ns", 5, BlobsFor(3, 5000), 4096);
      }
      ASSERT_TRUE(raw.db->Put(rocksdb::WriteOptions(), raw.meta(), k, v).ok());
    }
  }
  {
    auto st = SegmentStore::Open(Small(dir.path()));
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ((*st)->Keys().size(), 0u);
    for (uint64_t k = 1; k <= 3; ++k) {
      EXPECT_EQ((*st)->Get(Key(k)).status().code(), StatusCode::kNotFound) << k;
      EXPECT_EQ((*st)->Layout(Key(k)).status().code(), StatusCode::kNotFound) << k;
      char c = 0;
      EXPECT_EQ((*st)->ReadBlob(Key(k), "k", 0, 1, &c).code(), StatusCode::kNotFound) << k;
    }
    const SegmentStoreStats stats = (*st)->stats();
    EXPECT_EQ(stats.unknown_versions, 2);
    EXPECT_EQ(stats.corruptions_detected, 1);
    // Their blocks are left alone: another version's data is not this
    // binary's to delete, and a damaged record's blocks are unreachable.
    EXPECT_EQ(stats.orphans_removed, 0);
  }
  RawDb raw(dir.path());
  for (uint64_t k = 1; k <= 3; ++k) {
    std::unique_ptr<rocksdb::Iterator> it(raw.db->NewIterator(rocksdb::ReadOptions(), raw.blocks()));
    int blocks = 0;
    for (it->Seek(KeyBytes(Key(k))); it->Valid() && it->key().starts_with(KeyBytes(Key(k))); it->Next()) ++blocks;
    EXPECT_EQ(blocks, 3) << "segment " << k << ": blocks of 'k' (5000 bytes) and 'meta'";
  }
}

// Put over a key already stored: the same content is a no-op, other content
// a new version that replaces the old one whole (its pin kept, its blocks
// deleted), refused while attached; the quota does not count the version
// being replaced.
TEST(SegmentStoreTest, PutOverAnExistingKeyComparesContent) {
  TempDir dir;
  SegmentStoreOptions o = Small(dir.path());
  o.namespace_quota_bytes["q"] = 20000;
  const std::map<std::string, std::string> a = BlobsFor(1, 9000), b = BlobsFor(2, 15000), c = BlobsFor(3, 5000);
  {
    auto st = SegmentStore::Open(o);
    ASSERT_TRUE(st.ok()) << st.status();
    SegmentStore& s = **st;
    ASSERT_TRUE(s.Put(Key(1), "q", 7, a).ok());
    auto layout = s.Layout(Key(1));
    ASSERT_TRUE(layout.ok());
    // The same content, other block sizes: nothing changes.
    ASSERT_TRUE(s.Put(Key(1), "q", 7, a, {{"k", 8192}}).ok());
    EXPECT_EQ(s.stats().replacements, 0);
    EXPECT_EQ(s.stats().puts, 1);
    auto same = s.Layout(Key(1));
    ASSERT_TRUE(same.ok());
    EXPECT_EQ((*same)[0].block_bytes, (*layout)[0].block_bytes);
    // Other content (9000 + 15000 bytes would exceed q's 20000 if both counted).
    ASSERT_TRUE(s.Pin(Key(1), true).ok());
    ASSERT_TRUE(s.Put(Key(1), "q", 7, b).ok());
    EXPECT_EQ(s.stats().replacements, 1);
    EXPECT_EQ(s.stats().evictions, 0);
    auto got = s.Get(Key(1));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, b);
    auto info = s.Info(Key(1));
    ASSERT_TRUE(info.ok());
    EXPECT_TRUE(info->pinned);
    EXPECT_EQ(s.NamespaceBytes("q"), 15000u + b.at("meta").size());
    EXPECT_EQ(s.bytes(), s.NamespaceBytes("q"));
    // Other token count alone is other content too.
    ASSERT_TRUE(s.Put(Key(1), "q", 8, b).ok());
    EXPECT_EQ(s.stats().replacements, 2);
    EXPECT_EQ(s.Info(Key(1))->tokens, 8);
    // Attached: refused, naming the key; the stored version stays.
    ASSERT_TRUE(s.Attach(Key(1)).ok());
    const Status held = s.Put(Key(1), "q", 8, c);
    EXPECT_EQ(held.code(), StatusCode::kFailedPrecondition) << held;
    EXPECT_NE(held.message().find(Key(1).Hex()), std::string::npos) << held;
    EXPECT_TRUE(s.Put(Key(1), "q", 8, b).ok());  // the same content still is a no-op
    ASSERT_TRUE(s.Detach(Key(1)).ok());
    ASSERT_TRUE(s.Put(Key(1), "q", 8, c).ok());
    // A replacement too large for the quota is refused and leaves the old one.
    EXPECT_EQ(s.Put(Key(1), "q", 8, BlobsFor(4, 30000)).code(), StatusCode::kResourceExhausted);
    got = s.Get(Key(1));
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(*got, c);
  }
  {
    auto st = SegmentStore::Open(o);
    ASSERT_TRUE(st.ok()) << st.status();
    auto got = (*st)->Get(Key(1));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, c);
    EXPECT_EQ((*st)->stats().orphans_removed, 0);
  }
  // On disk: only the last version's blocks, and no intent left.
  RawDb raw(dir.path());
  std::unique_ptr<rocksdb::Iterator> it(raw.db->NewIterator(rocksdb::ReadOptions(), raw.blocks()));
  int blocks = 0;
  for (it->Seek(KeyBytes(Key(1))); it->Valid() && it->key().starts_with(KeyBytes(Key(1))); it->Next()) ++blocks;
  EXPECT_EQ(blocks, 2 + 1) << "'k' of 5000 bytes in 4096-byte blocks, and 'meta'";
  std::unique_ptr<rocksdb::Iterator> p(raw.db->NewIterator(rocksdb::ReadOptions(), raw.pending()));
  p->SeekToFirst();
  EXPECT_FALSE(p->Valid());
}

// Readers of a key that a writer keeps replacing see one version or the
// other, whole, never blocks of both.
TEST(SegmentStoreTest, ReadersSeeOneVersionWhileItIsReplaced) {
  TempDir dir;
  auto st = SegmentStore::Open(Small(dir.path()));
  ASSERT_TRUE(st.ok()) << st.status();
  SegmentStore& s = **st;
  const std::map<std::string, std::string> v[2] = {BlobsFor(10, 40000), BlobsFor(11, 40000)};
  ASSERT_TRUE(s.Put(Key(1), "ns", 1, v[0]).ok());
  std::atomic<bool> done{false};
  std::atomic<int> reads{0}, mixed{0}, failed{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&, t] {
      std::string buf(40000, '\0');
      while (!done) {
        if (t == 0) {
          auto got = s.Get(Key(1));
          if (!got.ok()) {
            ++failed;
          } else if (*got != v[0] && *got != v[1]) {
            ++mixed;
          }
        } else {
          const Status r = s.ReadBlob(Key(1), "k", 0, buf.size(), buf.data());
          if (!r.ok()) {
            ++failed;
          } else if (buf != v[0].at("k") && buf != v[1].at("k")) {
            ++mixed;
          }
        }
        ++reads;
      }
    });
  }
  for (int i = 1; i <= 60; ++i) ASSERT_TRUE(s.Put(Key(1), "ns", 1, v[i % 2]).ok());
  done = true;
  for (auto& t : readers) t.join();
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(mixed.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(s.stats().replacements, 60);
  EXPECT_EQ(s.stats().corruptions_detected, 0);
}

}  // namespace
}  // namespace penumbra::storage
