#include "storage/dram_value_store.h"

#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace penumbra::storage {
namespace {

SegmentLayout SmallLayout() {
  SegmentLayout l;
  l.layers = 2;
  l.kv_heads = 3;
  l.chunk_capacity = 5;
  l.chunk_tokens = 4;
  l.head_dim = 8;
  l.dtype = DType::kBF16;
  return l;
}

std::vector<char> RandomRows(std::mt19937_64& rng, size_t n, size_t row_bytes) {
  std::vector<char> v(n * row_bytes);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

// Fails every allocation after `budget` successful ones.
class FailingAllocator final : public HostAllocator {
 public:
  explicit FailingAllocator(int budget) : budget_(budget) {}
  Result<void*> Allocate(size_t bytes) override {
    if (budget_-- <= 0) return Status::ResourceExhausted("injected allocation failure");
    return real_.Allocate(bytes);
  }
  void Free(void* p) override { real_.Free(p); }

 private:
  int budget_;
  AlignedHostAllocator real_;
};

TEST(DramValueStoreTest, PutGatherRoundTripAndLayerBase) {
  AlignedHostAllocator alloc;
  DramValueStore store(&alloc, {});
  const SegmentLayout l = SmallLayout();
  auto id = store.CreateSegment(l);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(store.bytes_used(), l.total_bytes());
  std::mt19937_64 rng(1);
  auto rows = RandomRows(rng, 3, l.chunk_bytes());
  ASSERT_TRUE(store.PutChunks(*id, 1, 2, 1, 3, rows.data()).ok());
  const ChunkRef refs[] = {{2, 3}, {2, 1}, {2, 2}, {2, 3}};
  std::vector<char> out(4 * l.chunk_bytes());
  ASSERT_TRUE(store.GatherChunks(*id, 1, refs, out.data()).ok());
  const size_t rb = l.chunk_bytes();
  EXPECT_EQ(0, std::memcmp(out.data(), rows.data() + 2 * rb, rb));
  EXPECT_EQ(0, std::memcmp(out.data() + rb, rows.data(), rb));
  EXPECT_EQ(0, std::memcmp(out.data() + 2 * rb, rows.data() + rb, rb));
  EXPECT_EQ(0, std::memcmp(out.data() + 3 * rb, rows.data() + 2 * rb, rb));
  // Zero-copy view: row (head 2, chunk 1) of layer 1.
  auto base = store.LayerBase(*id, 1);
  ASSERT_TRUE(base.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*base) % AlignedHostAllocator::kAlignment, 0u);  // one allocation per layer
  EXPECT_EQ(0, std::memcmp(static_cast<const char*>(*base) + (2 * l.chunk_capacity + 1) * rb, rows.data(), rb));
  EXPECT_TRUE(store.Verify(*id).ok());
  ASSERT_TRUE(store.DropSegment(*id).ok());
  EXPECT_EQ(store.bytes_used(), 0u);
  EXPECT_EQ(store.DropSegment(*id).code(), StatusCode::kNotFound);
}

TEST(DramValueStoreTest, RejectsOutOfRangeWithoutWriting) {
  AlignedHostAllocator alloc;
  DramValueStore store(&alloc, {});
  const SegmentLayout l = SmallLayout();
  auto id = store.CreateSegment(l);
  ASSERT_TRUE(id.ok());
  std::mt19937_64 rng(2);
  auto rows = RandomRows(rng, 6, l.chunk_bytes());
  const auto bad = StatusCode::kInvalidArgument;
  EXPECT_EQ(store.PutChunks(*id, 2, 0, 0, 1, rows.data()).code(), bad);  // layer
  EXPECT_EQ(store.PutChunks(*id, -1, 0, 0, 1, rows.data()).code(), bad);
  EXPECT_EQ(store.PutChunks(*id, 0, 3, 0, 1, rows.data()).code(), bad);  // head
  EXPECT_EQ(store.PutChunks(*id, 0, 0, 5, 1, rows.data()).code(), bad);  // chunk
  EXPECT_EQ(store.PutChunks(*id, 0, 0, 0, 6, rows.data()).code(), bad);  // range end
  EXPECT_EQ(store.PutChunks(*id, 0, 0, -1, 2, rows.data()).code(), bad);
  EXPECT_EQ(store.PutChunks(*id + 7, 0, 0, 0, 1, rows.data()).code(), StatusCode::kNotFound);
  // Nothing was written: every chunk is still "never put".
  std::vector<char> out(l.chunk_bytes());
  for (int c = 0; c < l.chunk_capacity; ++c) {
    const ChunkRef r{0, c};
    EXPECT_EQ(store.GatherChunks(*id, 0, {&r, 1}, out.data()).code(), StatusCode::kNotFound);
  }
  const ChunkRef bad_refs[] = {{0, 5}, {3, 0}, {-1, 0}, {0, -1}};
  for (const ChunkRef& r : bad_refs) EXPECT_EQ(store.GatherChunks(*id, 0, {&r, 1}, out.data()).code(), bad);
  const ChunkRef ok_ref{0, 0};
  EXPECT_EQ(store.GatherChunks(*id, 2, {&ok_ref, 1}, out.data()).code(), bad);
  EXPECT_EQ(store.LayerBase(*id, 2).status().code(), bad);

  SegmentLayout z = l;
  z.head_dim = 0;
  EXPECT_EQ(store.CreateSegment(z).status().code(), bad);
  z = l;
  z.dtype = DType::kI32;
  EXPECT_EQ(store.CreateSegment(z).status().code(), bad);
  z = l;
  z.layers = z.kv_heads = z.chunk_capacity = z.chunk_tokens = z.head_dim = 1 << 30;
  EXPECT_EQ(store.CreateSegment(z).status().code(), bad);
}

TEST(DramValueStoreTest, CapacityAndAllocatorFailureReserveNothing) {
  const SegmentLayout l = SmallLayout();
  AlignedHostAllocator alloc;
  DramValueStore store(&alloc, {.capacity_bytes = 2 * l.total_bytes() + 10});
  auto a = store.CreateSegment(l);
  auto b = store.CreateSegment(l);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = store.CreateSegment(l);
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(c.status().retryable());
  EXPECT_EQ(store.bytes_used(), 2 * l.total_bytes());
  ASSERT_TRUE(store.DropSegment(*a).ok());
  EXPECT_TRUE(store.CreateSegment(l).ok());

  // 2 layers per segment: the second segment gets its first layer, fails on
  // its second, and gives the first back.
  FailingAllocator failing(3);
  DramValueStore store2(&failing, {});
  ASSERT_TRUE(store2.CreateSegment(l).ok());
  EXPECT_EQ(store2.CreateSegment(l).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(store2.bytes_used(), l.total_bytes());
}

// Counts live allocations, so a test can see what is pinned when.
class CountingAllocator final : public HostAllocator {
 public:
  Result<void*> Allocate(size_t bytes) override {
    ++live;
    return real_.Allocate(bytes);
  }
  void Free(void* p) override {
    --live;
    real_.Free(p);
  }
  int live = 0;

 private:
  AlignedHostAllocator real_;
};

TEST(DramValueStoreTest, ReservedSegmentAllocatesLayersAsTheyAreReached) {
  const SegmentLayout l = SmallLayout();
  CountingAllocator alloc;
  DramValueStore store(&alloc, {.capacity_bytes = l.total_bytes() + 10});
  auto id = store.ReserveSegment(l);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(alloc.live, 0);
  EXPECT_EQ(store.bytes_used(), l.total_bytes());  // counted from the start
  EXPECT_EQ(store.ReserveSegment(l).status().code(), StatusCode::kResourceExhausted);
  std::mt19937_64 rng(3);
  auto rows = RandomRows(rng, 2, l.chunk_bytes());
  const ChunkRef ref{0, 0};
  std::vector<char> out(l.chunk_bytes());
  // Layer 1 is not there yet: every access is refused, naming it.
  const Status put = store.PutChunks(*id, 1, 0, 0, 2, rows.data());
  EXPECT_EQ(put.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(put.message().find("layer 1"), std::string::npos) << put;
  EXPECT_EQ(store.GatherChunks(*id, 1, std::span(&ref, 1), out.data()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.LayerBase(*id, 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(store.Verify(*id).ok());
  auto base1 = store.AllocateLayer(*id, 1);
  ASSERT_TRUE(base1.ok()) << base1.status();
  EXPECT_EQ(alloc.live, 1);
  auto again = store.AllocateLayer(*id, 1);  // idempotent
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *base1);
  EXPECT_EQ(alloc.live, 1);
  EXPECT_EQ(store.AllocateLayer(*id, 2).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(store.PutChunks(*id, 1, 2, 3, 2, rows.data()).ok());
  const ChunkRef r{2, 4};
  ASSERT_TRUE(store.GatherChunks(*id, 1, std::span(&r, 1), out.data()).ok());
  EXPECT_EQ(0, std::memcmp(out.data(), rows.data() + l.chunk_bytes(), l.chunk_bytes()));
  EXPECT_EQ(store.LayerBase(*id, 0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(store.Verify(*id).ok());
  ASSERT_TRUE(store.DropSegment(*id).ok());
  EXPECT_EQ(alloc.live, 0);
  EXPECT_EQ(store.bytes_used(), 0u);
}

TEST(DramValueStoreTest, DetachHandsTheLayersOverUnfreed) {
  const SegmentLayout l = SmallLayout();
  CountingAllocator alloc;
  DramValueStore store(&alloc, {});
  auto id = store.ReserveSegment(l);
  ASSERT_TRUE(id.ok());
  auto base0 = store.AllocateLayer(*id, 0);
  ASSERT_TRUE(base0.ok());
  std::mt19937_64 rng(4);
  auto rows = RandomRows(rng, 1, l.chunk_bytes());
  ASSERT_TRUE(store.PutChunks(*id, 0, 1, 2, 1, rows.data()).ok());
  auto layers = store.DetachSegment(*id);
  ASSERT_TRUE(layers.ok()) << layers.status();
  ASSERT_EQ(layers->size(), 2u);
  EXPECT_EQ((*layers)[0], *base0);
  EXPECT_EQ((*layers)[1], nullptr);  // never allocated
  EXPECT_EQ(store.bytes_used(), 0u);
  EXPECT_EQ(alloc.live, 1);  // the caller owns it now
  EXPECT_EQ(0, std::memcmp(static_cast<const char*>((*layers)[0]) + (1 * l.chunk_capacity + 2) * l.chunk_bytes(),
                           rows.data(), l.chunk_bytes()));
  EXPECT_EQ(store.LayerBase(*id, 0).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store.DropSegment(*id).code(), StatusCode::kNotFound);
  alloc.Free((*layers)[0]);
  EXPECT_EQ(alloc.live, 0);
}

TEST(DramValueStoreTest, DetectsCorruption) {
  AlignedHostAllocator alloc;
  DramValueStore store(&alloc, {});
  const SegmentLayout l = SmallLayout();
  auto id = store.CreateSegment(l);
  ASSERT_TRUE(id.ok());
  std::mt19937_64 rng(3);
  auto rows = RandomRows(rng, l.chunk_capacity, l.chunk_bytes());
  ASSERT_TRUE(store.PutChunks(*id, 0, 1, 0, l.chunk_capacity, rows.data()).ok());
  ASSERT_TRUE(store.Verify(*id).ok());
  auto base = store.LayerBase(*id, 0);
  ASSERT_TRUE(base.ok());
  // Flip one byte of (head 1, chunk 3).
  char* p = const_cast<char*>(static_cast<const char*>(*base)) + (1 * l.chunk_capacity + 3) * l.chunk_bytes() + 5;
  *p ^= 0x10;
  const Status v = store.Verify(*id);
  EXPECT_EQ(v.code(), StatusCode::kCorruption);
  EXPECT_NE(v.message().find("kv_head 1 chunk 3"), std::string::npos) << v;
  std::vector<char> out(2 * l.chunk_bytes());
  const ChunkRef good[] = {{1, 2}, {1, 4}};
  EXPECT_TRUE(store.GatherChunks(*id, 0, good, out.data()).ok());
  const ChunkRef refs[] = {{1, 2}, {1, 3}};
  EXPECT_EQ(store.GatherChunks(*id, 0, refs, out.data()).code(), StatusCode::kCorruption);
  // Rewriting the row heals it.
  ASSERT_TRUE(store.PutChunks(*id, 0, 1, 3, 1, rows.data() + 3 * l.chunk_bytes()).ok());
  EXPECT_TRUE(store.Verify(*id).ok());
}

TEST(DramValueStoreTest, ConcurrentPutsAndGathersOfDistinctChunks) {
  AlignedHostAllocator alloc;
  DramValueStore store(&alloc, {});
  SegmentLayout l = SmallLayout();
  l.chunk_capacity = 64;
  auto id = store.CreateSegment(l);
  ASSERT_TRUE(id.ok());
  std::vector<std::thread> threads;
  std::vector<int> failures(l.kv_heads, 0);
  for (int h = 0; h < l.kv_heads; ++h) {
    threads.emplace_back([&, h] {
      std::mt19937_64 rng(100 + h);
      for (int iter = 0; iter < 200; ++iter) {
        const int layer = static_cast<int>(rng() % l.layers), c = static_cast<int>(rng() % l.chunk_capacity);
        auto row = RandomRows(rng, 1, l.chunk_bytes());
        if (!store.PutChunks(*id, layer, h, c, 1, row.data()).ok()) ++failures[h];
        std::vector<char> out(l.chunk_bytes());
        const ChunkRef r{h, c};
        if (!store.GatherChunks(*id, layer, {&r, 1}, out.data()).ok() || out != row) ++failures[h];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int h = 0; h < l.kv_heads; ++h) EXPECT_EQ(failures[h], 0) << "head " << h;
  EXPECT_TRUE(store.Verify(*id).ok());
}

// Model-based test: random operations against the store and a std::map model,
// compared after every step (status codes, bytes used, and every stored row).
struct ModelSegment {
  SegmentLayout layout;
  std::map<std::tuple<int, int, int>, std::vector<char>> rows;  // (layer, head, chunk)
};

class Model {
 public:
  explicit Model(size_t capacity) : capacity_(capacity) {}
  std::map<SegmentId, ModelSegment> segments;
  size_t used = 0;
  size_t capacity_;
};

TEST(DramValueStoreTest, ModelBasedRandomOperations) {
  AlignedHostAllocator alloc;
  const size_t capacity = 96 * 1024;
  DramValueStore store(&alloc, {.capacity_bytes = capacity});
  Model model(capacity);
  std::mt19937_64 rng(12345);
  auto uni = [&](int lo, int hi) { return static_cast<int>(lo + static_cast<int64_t>(rng() % (hi - lo + 1))); };
  std::vector<SegmentId> ever;  // includes dropped ids
  int exhausted = 0, puts_ok = 0, gathers_ok = 0;

  // Mostly live segments; sometimes a dropped or an unknown id.
  auto pick_id = [&]() -> SegmentId {
    const int roll = uni(0, 9);
    if (roll == 0 || ever.empty()) return 999999;
    if (roll == 1 || model.segments.empty()) return ever[uni(0, static_cast<int>(ever.size()) - 1)];
    auto it = model.segments.begin();
    std::advance(it, uni(0, static_cast<int>(model.segments.size()) - 1));
    return it->first;
  };

  for (int step = 0; step < 3000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const int op = uni(0, 99);
    if (op < 8) {  // create
      SegmentLayout l;
      l.layers = uni(1, 3);
      l.kv_heads = uni(1, 4);
      l.chunk_capacity = uni(1, 12);
      l.chunk_tokens = uni(1, 8);
      l.head_dim = uni(1, 16);
      l.dtype = uni(0, 1) ? DType::kBF16 : DType::kF32;
      auto r = store.CreateSegment(l);
      if (model.used + l.total_bytes() > capacity) {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
        ++exhausted;
      } else {
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(model.segments.count(*r), 0u);
        model.segments[*r] = {l, {}};
        model.used += l.total_bytes();
        ever.push_back(*r);
      }
    } else if (op < 12) {  // drop
      const SegmentId id = pick_id();
      const Status s = store.DropSegment(id);
      auto it = model.segments.find(id);
      if (it == model.segments.end()) {
        ASSERT_EQ(s.code(), StatusCode::kNotFound);
      } else {
        ASSERT_TRUE(s.ok()) << s;
        model.used -= it->second.layout.total_bytes();
        model.segments.erase(it);
      }
    } else if (op < 60) {  // put, sometimes out of range
      const SegmentId id = pick_id();
      auto it = model.segments.find(id);
      const SegmentLayout l = it != model.segments.end() ? it->second.layout : SmallLayout();
      const bool wild = uni(0, 4) == 0;  // arguments possibly out of range
      const int layer = wild ? uni(-1, l.layers) : uni(0, l.layers - 1);
      const int head = wild ? uni(-1, l.kv_heads) : uni(0, l.kv_heads - 1);
      const int n = wild ? uni(0, 4) : uni(1, std::min(4, l.chunk_capacity));
      const int first = wild ? uni(-1, l.chunk_capacity) : uni(0, l.chunk_capacity - n);
      auto rows = RandomRows(rng, std::max(n, 1), l.chunk_bytes());
      const Status s = store.PutChunks(id, layer, head, first, n, rows.data());
      if (it == model.segments.end()) {
        ASSERT_EQ(s.code(), StatusCode::kNotFound);
      } else if (layer < 0 || layer >= l.layers || head < 0 || head >= l.kv_heads || first < 0 ||
                 first + n > l.chunk_capacity) {
        ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
      } else {
        ASSERT_TRUE(s.ok()) << s;
        ++puts_ok;
        for (int i = 0; i < n; ++i)
          it->second.rows[{layer, head, first + i}] =
              std::vector<char>(rows.begin() + i * l.chunk_bytes(), rows.begin() + (i + 1) * l.chunk_bytes());
      }
    } else if (op < 95) {  // gather, sometimes out of range or never put
      const SegmentId id = pick_id();
      auto it = model.segments.find(id);
      const SegmentLayout l = it != model.segments.end() ? it->second.layout : SmallLayout();
      int layer = uni(0, 9) == 0 ? l.layers : uni(0, l.layers - 1);
      std::vector<ChunkRef> stored;  // rows of `layer` that were put
      if (it != model.segments.end() && !it->second.rows.empty()) {
        auto row = it->second.rows.begin();
        std::advance(row, uni(0, static_cast<int>(it->second.rows.size()) - 1));
        if (uni(0, 9) > 1) layer = std::get<0>(row->first);
        for (const auto& [key, bytes] : it->second.rows)
          if (std::get<0>(key) == layer) stored.push_back({std::get<1>(key), std::get<2>(key)});
      }
      std::vector<ChunkRef> refs(uni(0, 6));
      for (auto& r : refs) {
        const int roll = uni(0, 19);
        if (roll == 0) {
          r = {-1, 0};
        } else if (roll == 1) {
          r = {0, l.chunk_capacity};
        } else if (roll == 2 || stored.empty()) {
          r = {uni(0, l.kv_heads - 1), uni(0, l.chunk_capacity - 1)};  // maybe never put
        } else {
          r = stored[uni(0, static_cast<int>(stored.size()) - 1)];
        }
      }
      std::vector<char> out(refs.size() * l.chunk_bytes() + 1);
      const Status s = store.GatherChunks(id, layer, refs, out.data());
      if (it == model.segments.end()) {
        ASSERT_EQ(s.code(), StatusCode::kNotFound);
        continue;
      }
      if (layer >= l.layers) {
        ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
        continue;
      }
      // First failing ref decides the code (all refs are checked in order).
      StatusCode expect = StatusCode::kOk;
      for (const auto& r : refs) {
        if (r.kv_head < 0 || r.chunk >= l.chunk_capacity) {
          expect = StatusCode::kInvalidArgument;
          break;
        }
        if (!it->second.rows.count({layer, r.kv_head, r.chunk})) {
          expect = StatusCode::kNotFound;
          break;
        }
      }
      ASSERT_EQ(s.code(), expect) << s;
      if (expect == StatusCode::kOk) {
        gathers_ok += !refs.empty();
        for (size_t i = 0; i < refs.size(); ++i) {
          const auto& want = it->second.rows.at({layer, refs[i].kv_head, refs[i].chunk});
          ASSERT_EQ(0, std::memcmp(out.data() + i * l.chunk_bytes(), want.data(), want.size())) << "ref " << i;
        }
      }
    } else {  // verify
      const SegmentId id = pick_id();
      const Status s = store.Verify(id);
      ASSERT_EQ(s.code(), model.segments.count(id) ? StatusCode::kOk : StatusCode::kNotFound) << s;
    }

    // Full comparison after every step.
    ASSERT_EQ(store.bytes_used(), model.used);
    for (const auto& [id, seg] : model.segments) {
      auto layout = store.Layout(id);
      ASSERT_TRUE(layout.ok());
      ASSERT_EQ(layout->total_bytes(), seg.layout.total_bytes());
      for (const auto& [key, row] : seg.rows) {
        const auto [layer, head, chunk] = key;
        auto base = store.LayerBase(id, layer);
        ASSERT_TRUE(base.ok());
        const char* p = static_cast<const char*>(*base) +
                        (static_cast<size_t>(head) * seg.layout.chunk_capacity + chunk) * seg.layout.chunk_bytes();
        ASSERT_EQ(0, std::memcmp(p, row.data(), row.size()))
            << "segment " << id << " layer " << layer << " head " << head << " chunk " << chunk;
      }
    }
    for (SegmentId id : ever) {
      if (!model.segments.count(id)) {
        ASSERT_EQ(store.Layout(id).status().code(), StatusCode::kNotFound);
      }
    }
  }
  // The random mix must reach every outcome, not only the error paths.
  EXPECT_GT(exhausted, 5);
  EXPECT_GT(puts_ok, 300);
  EXPECT_GT(gathers_ok, 50);
  std::printf("model test: %d creates refused, %d puts, %d non-empty gathers ok\n", exhausted, puts_ok, gathers_ok);
}

}  // namespace
}  // namespace penumbra::storage
