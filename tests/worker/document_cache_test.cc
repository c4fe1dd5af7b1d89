// DocumentCache (worker/engine/document_cache.h) against a model: random
// sequences of captures, finds (read here, or prefetched as the scheduler
// does), evictions by capacity, forgets and damaged drops over the memory
// tier and a real persistent tier (a SegmentStore in a temporary directory),
// with fake captured states and a fake policy; after every step each tier
// holds exactly what the model says, and the counters agree. The segment
// store's own crash safety (SIGKILL mid-write) is
// tests/storage/segment_store_integration_test.cc; the writer only Puts.
#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "storage/segment_store.h"
#include "tests/storage/segment_store_test_util.h"
#include "worker/engine/document_cache.h"

namespace penumbra {
namespace {

// A captured state: `tokens` tokens, `bytes` device bytes; its one blob
// names both. A poisoned one exports a blob the fake policy refuses to
// import (a stored copy found damaged only when imported).
class FakeState final : public KvPrefix {
 public:
  FakeState(int64_t tokens, size_t bytes, bool poisoned = false)
      : tokens_(tokens), bytes_(bytes), poisoned_(poisoned) {}
  std::string policy() const override { return "fake"; }
  int64_t tokens() const override { return tokens_; }
  size_t device_bytes() const override { return bytes_; }
  Result<std::map<std::string, std::string>> Export() const override {
    return std::map<std::string, std::string>{
        {"state", (poisoned_ ? "bad " : "ok ") + std::to_string(tokens_) + " " + std::to_string(bytes_)}};
  }

 private:
  int64_t tokens_;
  size_t bytes_;
  bool poisoned_;
};

// Imports FakeState blobs; computes nothing.
class FakePolicy final : public KvPolicy {
 public:
  std::string name() const override { return "fake"; }
  Status AddSequence(int64_t, const SequenceSpec&) override { return Status::Unimplemented("fake"); }
  void RemoveSequence(int64_t) override {}
  Status PrefillAttention(int, int64_t, const float*, int, int64_t, const int32_t*, void*, void*, float*) override {
    return Status::Unimplemented("fake");
  }
  Status FinishPrefillLayer(int, int64_t, int64_t) override { return Status::Unimplemented("fake"); }
  Status BeginDecodeStep(const std::vector<int64_t>&, const std::vector<int64_t>&) override {
    return Status::Unimplemented("fake");
  }
  Status DecodeAttention(int, const float*, const int32_t*, void*, void*, float*) override {
    return Status::Unimplemented("fake");
  }
  Status FinishDecodeStep() override { return Status::Unimplemented("fake"); }
  Status SynthesizeContext(int64_t, int64_t, uint64_t) override { return Status::Unimplemented("fake"); }
  size_t DeviceBytes(int64_t) const override { return 0; }
  Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) override {
    auto it = blobs.find("state");
    if (it == blobs.end() || it->second.rfind("ok ", 0) != 0) return Status::Corruption("not a fake state");
    std::istringstream in(it->second.substr(3));
    int64_t tokens = 0;
    size_t bytes = 0;
    if (!(in >> tokens >> bytes)) return Status::Corruption("unparsed");
    return std::shared_ptr<const KvPrefix>(std::make_shared<FakeState>(tokens, bytes));
  }
};

// What each tier must hold: memory as an LRU list of keys (front: most
// recent) under a device-byte capacity (low watermark 1, no entry held by a
// sequence), the persistent tier as a set (poisoned ones marked).
struct Model {
  size_t capacity = 0;
  std::list<int> lru;  // document indices
  std::map<int, size_t> bytes;
  std::set<int> stored, poisoned;
  int64_t hits = 0, corruptions = 0, stores = 0;

  bool InMemory(int d) const { return std::find(lru.begin(), lru.end(), d) != lru.end(); }
  size_t MemoryBytes() const {
    size_t n = 0;
    for (int d : lru) n += bytes.at(d);
    return n;
  }
  void Touch(int d) {
    lru.remove(d);
    lru.push_front(d);
  }
  void Insert(int d) {
    if (InMemory(d) || bytes.at(d) > capacity) return;
    while (MemoryBytes() + bytes.at(d) > capacity) lru.pop_back();
    lru.push_front(d);
  }
  void EraseMemory(int d) { lru.remove(d); }
};

class DocumentCacheModelTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(DocumentCacheModelTest, RandomOperationsKeepEveryTierAsTheModelSays) {
  storage::testing::TempDir dir;
  storage::SegmentStoreOptions so;
  so.path = dir.path();
  so.sync_commit = false;
  auto store = storage::SegmentStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status();

  FakePolicy policy;
  DocumentCacheOptions o;
  o.memory_bytes = 1000;
  o.dtype = "f32";
  o.drain_ms = 60000;
  DocumentCache cache(o, &policy, nullptr);
  cache.SetPersistentTier(store->get(), "model");
  EXPECT_EQ(cache.Fence("ns"), "fake|dtype=f32|model=model|namespace=ns");

  // Four prompts of three documents each (ends 10, 20, 30); prompt 1 starts
  // with prompt 0's first document (the same key), the others differ from
  // their first document on. Document d = prompt * 3 + index (prompt 1's
  // first is document 0).
  const std::vector<int64_t> ends = {10, 20, 30};
  std::vector<std::vector<Hash128>> prompt_keys;
  std::vector<std::vector<int>> prompt_docs;
  std::map<int, Hash128> key_of;
  for (int p = 0; p < 4; ++p) {
    std::vector<Hash128> digests;
    std::vector<int> docs;
    for (int i = 0; i < 3; ++i) {
      const int content = p == 1 && i == 0 ? 0 : p * 3 + i;
      digests.push_back(Hash128{static_cast<uint64_t>(content) + 1, 7});
      docs.push_back(content);
    }
    prompt_keys.push_back(cache.Keys("ns", digests, ends));
    prompt_docs.push_back(docs);
    for (int i = 0; i < 3; ++i) key_of[docs[i]] = prompt_keys.back()[i];
  }
  ASSERT_EQ(prompt_keys[0][0], prompt_keys[1][0]);
  ASSERT_NE(prompt_keys[0][1], prompt_keys[1][1]);
  EXPECT_NE(cache.Keys("other", {Hash128{1, 7}}, {10})[0], prompt_keys[0][0]);

  Model m;
  m.capacity = o.memory_bytes;
  std::mt19937_64 rng(GetParam());
  for (const auto& [d, key] : key_of) m.bytes[d] = 100 + 50 * static_cast<size_t>(rng() % 8);
  const int kDocs = static_cast<int>(key_of.size());

  auto check = [&](int step, const std::string& op) {
    ASSERT_TRUE(cache.Drain(std::chrono::milliseconds(60000)));
    SCOPED_TRACE("step " + std::to_string(step) + " (" + op + ")");
    for (const auto& [d, key] : key_of) {
      EXPECT_EQ(cache.memory().Contains(key), m.InMemory(d)) << "document " << d << " in memory";
      EXPECT_EQ((*store)->Contains(key), m.stored.count(d) > 0) << "document " << d << " stored";
    }
    EXPECT_EQ(cache.memory().bytes(), m.MemoryBytes());
    const DocumentCacheStats s = cache.stats();
    EXPECT_EQ(s.store_hits, m.hits);
    EXPECT_EQ(s.store_corruptions, m.corruptions);
    EXPECT_EQ(s.stores, m.stores);
    EXPECT_EQ(s.store_errors, 0);
    ASSERT_FALSE(::testing::Test::HasFailure());
  };

  for (int step = 0; step < 400; ++step) {
    const int p = static_cast<int>(rng() % prompt_keys.size());
    const std::vector<Hash128>& keys = prompt_keys[p];
    const std::vector<int>& docs = prompt_docs[p];
    const int op = static_cast<int>(rng() % 10);
    std::string name;
    if (op < 4) {
      // A request: finds its longest held run, then captures what follows
      // (as the runtime does: only what memory does not hold).
      const bool prefetch = rng() % 2 == 0;
      name = prefetch ? "prefetched request" : "request";
      // The model's find: memory first at each length, then the store.
      int want = -1;
      if (prefetch) {
        // The scheduler's lookups: longer than the longest in memory; the
        // fetch reads the longest stored one (poisoned: read fine, refused
        // at import, erased through the writer's queue).
        std::vector<StoreLookup> lookups = cache.Lookups(keys, ends);
        size_t expect_lookups = 0;
        for (int i = 2; i >= 0 && !m.InMemory(docs[i]); --i) ++expect_lookups;
        ASSERT_EQ(lookups.size(), expect_lookups) << "step " << step;
        PrefetchedDocuments fetched = cache.Fetch(lookups);
        int fetched_doc = -1;
        for (int i = 2; i >= 3 - static_cast<int>(expect_lookups); --i) {
          if (m.stored.count(docs[i])) {
            fetched_doc = i;
            break;
          }
        }
        ASSERT_EQ(fetched.found.has_value(), fetched_doc >= 0) << "step " << step;
        for (int i = 2; i >= 0 && want < 0; --i) {
          if (m.InMemory(docs[i])) {
            m.Touch(docs[i]);
            want = i;
          } else if (i == fetched_doc) {
            if (m.poisoned.count(docs[i])) {
              ++m.corruptions;
              m.stored.erase(docs[i]);
              m.poisoned.erase(docs[i]);
            } else {
              ++m.hits;
              m.Insert(docs[i]);
              want = i;
            }
          }
        }
        cache.CountPrefetch(&fetched);
        DocumentCache::Found found = cache.FindLongest(keys, ends, &fetched);
        EXPECT_FALSE(fetched.found.has_value()) << "step " << step << ": the prefetched read is moved out";
        ASSERT_EQ(found.state != nullptr, want >= 0) << "step " << step;
        if (want >= 0) {
          EXPECT_EQ(static_cast<int>(found.index), want) << "step " << step;
        }
      } else {
        for (int i = 2; i >= 0 && want < 0; --i) {
          if (m.InMemory(docs[i])) {
            m.Touch(docs[i]);
            want = i;
          } else if (m.stored.count(docs[i])) {
            m.stored.erase(docs[i]);
            if (m.poisoned.erase(docs[i])) {
              ++m.corruptions;
            } else {
              ++m.hits;
              m.stored.insert(docs[i]);
              m.Insert(docs[i]);
              want = i;
            }
          }
        }
        DocumentCache::Found found = cache.FindLongest(keys, ends, nullptr);
        ASSERT_EQ(found.state != nullptr, want >= 0) << "step " << step;
        if (want >= 0) {
          EXPECT_EQ(static_cast<int>(found.index), want) << "step " << step;
        }
      }
      // Capture the documents after the found run; one in ten poisoned.
      for (int i = want + 1; i < 3; ++i) {
        if (cache.Holds(keys[i])) continue;
        ASSERT_FALSE(m.InMemory(docs[i]));
        const bool poisoned = rng() % 10 == 0;
        cache.Capture(keys[i], "ns", ends[i], std::make_shared<FakeState>(ends[i], m.bytes[docs[i]], poisoned));
        m.Insert(docs[i]);
        m.stored.insert(docs[i]);  // a rewrite replaces a stored copy
        if (poisoned) {
          m.poisoned.insert(docs[i]);
        } else {
          m.poisoned.erase(docs[i]);
        }
        ++m.stores;
      }
    } else if (op < 6) {
      name = "memory eviction";  // what only the persistent tier then holds
      const int d = static_cast<int>(rng() % kDocs);
      EXPECT_EQ(cache.memory().Erase(key_of[d]), m.InMemory(d));
      m.EraseMemory(d);
    } else if (op < 8) {
      name = "forget";
      int expect = 0;
      for (int d : docs) {
        expect += (m.InMemory(d) ? 1 : 0) + static_cast<int>(m.stored.count(d));
        m.EraseMemory(d);
        m.stored.erase(d);
        m.poisoned.erase(d);
      }
      Result<int> dropped = cache.Forget(keys);
      ASSERT_TRUE(dropped.ok()) << dropped.status();
      EXPECT_EQ(*dropped, expect) << "step " << step;
    } else {
      name = "damaged drop";
      const int d = docs[rng() % docs.size()];
      cache.DropDamaged(key_of[d], Status::Corruption("a block failed its check"));
      ++m.corruptions;
      m.EraseMemory(d);
      m.stored.erase(d);
      m.poisoned.erase(d);
    }
    check(step, name);
    if (::testing::Test::HasFailure()) return;
  }
  // Every path was taken.
  EXPECT_GT(m.hits, 0);
  EXPECT_GT(cache.memory().stats().evictions, 0);
}

INSTANTIATE_TEST_SUITE_P(Seeds, DocumentCacheModelTest, ::testing::Values(1, 2, 3, 4));

// Without a persistent tier the cache is memory only: no lookups, no fetch,
// nothing written, forget drops memory's entries.
TEST(DocumentCacheTest, WithoutAPersistentTierOnlyMemory) {
  FakePolicy policy;
  DocumentCacheOptions o;
  o.memory_bytes = 1000;
  DocumentCache cache(o, &policy, nullptr);
  const std::vector<Hash128> keys = cache.Keys("", {Hash128{1, 1}, Hash128{2, 2}}, {5, 9});
  EXPECT_TRUE(cache.Lookups(keys, {5, 9}).empty());
  EXPECT_FALSE(cache.Fetch({{keys[1], 9}}).found.has_value());
  cache.Capture(keys[0], "", 5, std::make_shared<FakeState>(5, 100));
  EXPECT_TRUE(cache.Holds(keys[0]));
  DocumentCache::Found f = cache.FindLongest(keys, {5, 9}, nullptr);
  ASSERT_NE(f.state, nullptr);
  EXPECT_EQ(f.index, 0u);
  f.state.reset();
  EXPECT_EQ(cache.stats().stores, 0);
  auto dropped = cache.Forget(keys);
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(*dropped, 1);
  EXPECT_FALSE(cache.Holds(keys[0]));
  EXPECT_TRUE(cache.Drain(std::chrono::milliseconds(0)));
}

}  // namespace
}  // namespace penumbra
