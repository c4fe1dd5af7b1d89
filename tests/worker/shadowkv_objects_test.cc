// ShadowKV's objects (worker/engine/shadowkv/) on the CPU backend: the
// layout's geometry, the decode step's tables and ints (what every kernel
// argument points into), the shard exchange's rows and the compressor's
// asynchronous value puts.
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "storage/dram_value_store.h"
#include "tests/worker/thread_group.h"
#include "worker/engine/backend.h"
#include "worker/engine/backend_host_allocator.h"
#include "worker/engine/shadowkv/compressor.h"
#include "worker/engine/shadowkv/decode_step.h"
#include "worker/engine/shadowkv/layout.h"
#include "worker/engine/shadowkv/shard_exchange.h"

namespace penumbra {
namespace {

struct Fixture {
  std::unique_ptr<Backend> backend;
  PolicyContext ctx;
  ShadowKvOptions o;
};

Fixture Make() {
  Fixture f;
  BackendOptions bo;
  bo.device = "cpu";
  auto b = CreateBackend(bo);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  f.backend = std::move(*b);
  f.ctx.backend = f.backend.get();
  f.ctx.num_layers = 2;
  f.ctx.hq = 4;
  f.ctx.hkv = 2;
  f.ctx.head_dim = 16;
  f.ctx.scale = 0.25f;
  f.o.rank = 8;
  f.o.chunk_size = 8;
  f.o.budget_tokens = 32;
  f.o.outlier_chunks = 2;
  f.o.local_window = 16;
  f.o.min_prompt_tokens = 0;
  f.o.landmarks_per_chunk = 1;
  f.o.landmark_format = "model";
  return f;
}

TEST(ShadowKvLayoutTest, ShapeOfAWholeSequenceAndOfAClosedShard) {
  Fixture f = Make();
  const ShadowKvLayout lay(f.ctx, f.o);
  SequenceSpec spec;
  spec.prompt_len = 200;
  spec.max_new_tokens = 10;
  ShadowKvSeq s;
  lay.Shape(spec, &s);
  // (200 - 16) / 8 = 23 prompt chunks: 4 slots, 2 outliers.
  EXPECT_TRUE(s.sparse);
  EXPECT_EQ(s.token_cap, 210);
  EXPECT_EQ(s.window, 16);
  EXPECT_EQ(s.kslots, 4);
  EXPECT_EQ(s.outliers, 2);
  EXPECT_EQ(s.local_cap, 16 + 2 * 8);
  EXPECT_EQ(s.chunk_cap, (210 + 7) / 8);
  EXPECT_EQ(s.att_cap, (2 + 4) * 8 + s.local_cap);
  EXPECT_EQ(lay.LocalRow0(s), (2 + 4) * 8);
  EXPECT_EQ(lay.AttLayer(s), 2 * s.att_cap * 16);

  // A closed shard: one spare row, no local window.
  spec.shard.closed = true;
  spec.shard.position_base = 0;
  ShadowKvSeq c;
  lay.Shape(spec, &c);
  EXPECT_EQ(c.token_cap, 201);
  EXPECT_EQ(c.window, 0);
  EXPECT_EQ(c.kslots, 4);

  // Too short to select from: dense, every token in the local rows.
  spec = SequenceSpec{};
  spec.prompt_len = 20;
  spec.max_new_tokens = 4;
  ShadowKvSeq d;
  lay.Shape(spec, &d);
  EXPECT_FALSE(d.sparse);
  EXPECT_EQ(d.kslots, 0);
  EXPECT_EQ(d.local_cap, 24);
  EXPECT_EQ(d.att_cap, 24);
}

TEST(ShadowKvDecodeStepTest, TablesIntsAndArgumentsPointIntoTheSequence) {
  Fixture f = Make();
  const ShadowKvLayout lay(f.ctx, f.o);
  SequenceSpec spec;
  spec.prompt_len = 200;
  spec.max_new_tokens = 10;
  ShadowKvSeq s;
  lay.Shape(spec, &s);
  s.a_rows = s.token_cap;
  s.lm_cap = s.chunk_cap;
  s.n_chunks = 23;
  s.local_count = 200 - 23 * 8;
  const int L = f.ctx.num_layers, H = f.ctx.hkv, d = f.ctx.head_dim;
  Backend& b = *f.backend;
  auto alloc = [&](DeviceBuffer* buf, size_t bytes) {
    auto r = b.Allocate(bytes);
    ASSERT_TRUE(r.ok());
    *buf = std::move(*r);
  };
  alloc(&s.att_k, lay.AttLayer(s) * L * lay.es());
  alloc(&s.att_v, lay.AttLayer(s) * L * lay.es());
  alloc(&s.a, static_cast<size_t>(L) * s.a_rows * f.o.rank * lay.es());
  alloc(&s.b, static_cast<size_t>(L) * H * f.o.rank * d * lay.es());
  alloc(&s.lm, static_cast<size_t>(L) * H * s.lm_cap * lay.lm_rec_bytes());
  alloc(&s.excl, static_cast<size_t>(L) * H * s.chunk_cap);
  alloc(&s.slots, static_cast<size_t>(L) * H * s.kslots * sizeof(int32_t));
  alloc(&s.prek, static_cast<size_t>(L) * s.local_cap * H * d * sizeof(float));
  std::vector<char> store(64);
  s.store_dev.assign(static_cast<size_t>(L), store.data());

  ShadowKvDecodeStep step(lay, b);
  ASSERT_TRUE(step.Begin({&s}).ok());
  ASSERT_EQ(step.batch(), 1);
  ASSERT_EQ(step.groups().size(), 1u);
  EXPECT_EQ(step.max_k(), 4);
  EXPECT_FALSE(step.position_offsets());
  for (int l = 0; l < L; ++l) {
    void* const* t = step.Tables(l);
    EXPECT_EQ(t[ShadowKvDecodeStep::kNewK], lay.Row(s.att_k, s, l, lay.LocalRow0(s) + s.local_count));
    EXPECT_EQ(t[ShadowKvDecodeStep::kAttV], lay.Row(s.att_v, s, l, 0));
    EXPECT_EQ(t[ShadowKvDecodeStep::kLandmarks], lay.LmLayer(s, l));
    EXPECT_EQ(t[ShadowKvDecodeStep::kA], lay.ALayer(s, l));
    EXPECT_EQ(t[ShadowKvDecodeStep::kValues], store.data());
    EXPECT_EQ(t[ShadowKvDecodeStep::kSharedValues], nullptr);
  }
  const int32_t* ints = step.Ints();
  EXPECT_EQ(ints[ShadowKvDecodeStep::kLength], (2 + 4) * 8 + s.local_count + 1);
  EXPECT_EQ(ints[ShadowKvDecodeStep::kChunks], 23);
  EXPECT_EQ(ints[ShadowKvDecodeStep::kPosition0], 0);

  const kernels::ShadowkvScoreArgs sc = step.ScoreArgsOf(1, 0, 1, nullptr);
  EXPECT_EQ(sc.landmarks, reinterpret_cast<const void* const*>(step.Tables(1) + ShadowKvDecodeStep::kLandmarks));
  EXPECT_EQ(sc.select_k, 4);
  EXPECT_EQ(sc.chunk_cap, s.chunk_cap);
  EXPECT_EQ(sc.score_stride, 23 + 1);
  const kernels::ShadowkvSlotUpdateArgs su = step.SlotUpdateOf(1, 0, 1, sc.selection, sc.selection_stride);
  const kernels::ShadowkvFetchVArgs fv = step.FetchVOf(1, 0, 1);
  const kernels::ShadowkvRebuildKArgs rk = step.RebuildKOf(1, 0, 1);
  // The slot update's miss lists are what the fetch and the rebuild read.
  EXPECT_EQ(fv.miss_count, su.miss_count);
  EXPECT_EQ(rk.miss_slot, su.miss_slot);
  EXPECT_EQ(rk.miss_chunk, fv.miss_chunk);
  EXPECT_EQ(su.miss_count, step.MissCounts(1, 0));
  EXPECT_EQ(fv.outlier_rows, 2 * 8);
  EXPECT_EQ(rk.position_offset, nullptr);

  // A closed sequence's new row is not attended.
  s.closed = true;
  ASSERT_TRUE(step.Begin({&s}).ok());
  EXPECT_EQ(step.Ints()[ShadowKvDecodeStep::kLength], (2 + 4) * 8 + s.local_count);
}

// ShadowkvScoreArgs::one_prefix is a promise the GPU's one-pass scores rely
// on; the reference backend scores each entry on its own but refuses a call
// that breaks it, so the CPU tests of attached documents check that the
// decode step promises only what holds.
TEST(ShadowKvScoreTest, TheReferenceHoldsACallerToTheOnePrefixPromise) {
  Fixture f = Make();
  Backend& b = *f.backend;
  constexpr int kBatch = 3, kHkv = 2, kHq = 4, kD = 16, kShared = 5, kCap = 8;
  std::vector<float> q(static_cast<size_t>(kBatch) * kHq * kD, 0.5f);
  std::vector<float> shared(static_cast<size_t>(kHkv) * kShared * kD, 0.25f), other = shared;
  std::vector<std::vector<float>> own(kBatch, std::vector<float>(static_cast<size_t>(kHkv) * (kCap - kShared) * kD, 1));
  std::vector<std::vector<uint8_t>> excl(kBatch, std::vector<uint8_t>(static_cast<size_t>(kHkv) * kCap, 0));
  for (auto& e : excl) e[kCap + 2] = 1;  // head 1, chunk 2 of the prefix: the prefix's outlier
  std::vector<int32_t> n_chunks = {6, 7, 5};
  std::vector<const void*> lm, sh(kBatch, shared.data());
  std::vector<const uint8_t*> ex;
  for (int i = 0; i < kBatch; ++i) {
    lm.push_back(own[i].data());
    ex.push_back(excl[i].data());
  }
  std::vector<float> scores(static_cast<size_t>(kBatch) * kHkv * (kCap + 1));
  kernels::ShadowkvScoreArgs a;
  a.q = q.data();
  a.q_dtype = DType::kF32;
  a.dtype = DType::kF32;
  a.landmarks = lm.data();
  a.shared_landmarks = sh.data();
  a.excluded = ex.data();
  a.n_chunks = n_chunks.data();
  a.batch = kBatch;
  a.hq = kHq;
  a.hkv = kHkv;
  a.d = kD;
  a.chunk_cap = kCap;
  a.landmark_cap = kCap - kShared;
  a.shared_chunks = kShared;
  a.max_chunks = 7;
  a.scale = 0.25f;
  a.scores = scores.data();
  a.score_stride = kCap + 1;
  a.one_prefix = true;
  EXPECT_TRUE(b.ShadowkvScore(a).ok());
  excl[1][kCap + 6] = 1;  // an exclusion of entry 1's own chunk: its own business
  EXPECT_TRUE(b.ShadowkvScore(a).ok());

  excl[2][kCap + 3] = 1;  // entry 2's copy of the prefix's exclusions differs
  Status st = b.ShadowkvScore(a);
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
  EXPECT_NE(st.message().find("entry 2's exclusions"), std::string::npos) << st.ToString();
  excl[2][kCap + 3] = 0;

  sh[1] = other.data();  // entry 1 attached to another prefix (equal bytes, another array)
  st = b.ShadowkvScore(a);
  EXPECT_NE(st.message().find("entry 1 is attached to another prefix"), std::string::npos) << st.ToString();
  a.one_prefix = false;  // no promise: scored entry by entry
  EXPECT_TRUE(b.ShadowkvScore(a).ok());
  sh[1] = shared.data();
  a.one_prefix = true;

  n_chunks[2] = 4;  // fewer chunks than the prefix holds
  st = b.ShadowkvScore(a);
  EXPECT_NE(st.message().find("entry 2 has 4 chunks"), std::string::npos) << st.ToString();
}

TEST(ShadowKvShardExchangeTest, RowsOfAStepAndTheAllGathersOfTwoRanks) {
  Fixture f = Make();
  testing::ThreadGroup group(2);
  std::vector<std::unique_ptr<Collective>> ranks;
  ranks.push_back(group.Member(0));
  ranks.push_back(group.Member(1));
  ShadowKvSeq s;
  s.sparse = true;
  s.global_k = 3;
  s.group = ranks[0].get();
  ShadowKvShardExchange x(f.ctx, *f.backend);
  EXPECT_EQ(ShadowKvShardExchange::GroupOf({&s}), ranks[0].get());
  ASSERT_TRUE(x.Prepare(ranks[0].get(), {&s}).ok());
  EXPECT_EQ(x.width(), 3);
  EXPECT_EQ(x.stats(), 1u * 4 * 2);  // per sequence, hq (max, sum)
  EXPECT_EQ(x.cand(), 1u * 2 * 3);   // per sequence, hkv rows of width()
  EXPECT_EQ(x.stats_recv(), x.stats_send() + x.stats());
  EXPECT_EQ(x.cand_send(), x.stats_recv() + 2 * x.stats());
  EXPECT_EQ(x.stats_send()[0], -std::numeric_limits<float>::infinity());  // "no statistics"
  EXPECT_EQ(x.stats_send()[1], 0.0f);

  // Both ranks (threads) exchange: every rank receives every rank's rows.
  ShadowKvShardExchange x1(f.ctx, *f.backend);
  ShadowKvSeq s1;
  s1.sparse = true;
  s1.global_k = 3;
  s1.group = ranks[1].get();
  ASSERT_TRUE(x1.Prepare(ranks[1].get(), {&s1}).ok());
  x.stats_send()[1] = 10.0f;
  x1.stats_send()[1] = 11.0f;
  Status st1;
  std::thread t([&] { st1 = x1.AllGatherStats(); });
  const Status st0 = x.AllGatherStats();
  t.join();
  ASSERT_TRUE(st0.ok() && st1.ok());
  for (ShadowKvShardExchange* e : {&x, &x1}) {
    EXPECT_EQ(e->stats_recv()[1], 10.0f);
    EXPECT_EQ(e->stats_recv()[x.stats() + 1], 11.0f);
  }

  // A sequence of its own selection beside the group's shards is refused.
  ShadowKvSeq other;
  other.sparse = true;
  EXPECT_FALSE(x.Prepare(ranks[0].get(), {&s, &other}).ok());
}

// OffloadValuesAsync: the rows land in the store once DrainPuts returns,
// from two staging buffers reused in turn (four layers' puts in a row); a
// put that fails is its own segment's failure, reported once by that
// segment's drain and dropped by ForgetPuts, never another segment's.
TEST(ShadowKvCompressorTest, AsyncPutsLandInTheStoreAndTheirFailuresStayWithTheirSegment) {
  Fixture f = Make();
  f.ctx.num_layers = 4;
  const ShadowKvLayout lay(f.ctx, f.o);
  Backend& b = *f.backend;
  BackendHostAllocator alloc(&b);
  storage::DramValueStore store(&alloc, storage::DramValueStoreOptions{});
  ShadowKvCompressor comp(lay, b);
  const int L = f.ctx.num_layers, H = f.ctx.hkv, d = f.ctx.head_dim, C = f.o.chunk_size, n = 5;
  SequenceSpec spec;
  spec.prompt_len = 64;
  spec.max_new_tokens = 4;
  ShadowKvSeq s;
  lay.Shape(spec, &s);
  auto seg = store.ReserveSegment(lay.ValueSegment(s));
  ASSERT_TRUE(seg.ok()) << seg.status();
  s.segment = *seg;
  // Values [hkv][rows][d] f32 on the "device", distinct per layer, head and row.
  const int64_t rows = static_cast<int64_t>(n) * C;
  auto values = b.Allocate(static_cast<size_t>(H) * rows * d * sizeof(float));
  ASSERT_TRUE(values.ok());
  auto fill = [&](int layer) {
    std::vector<float> v(static_cast<size_t>(H) * rows * d);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(layer * 100000 + static_cast<int64_t>(i));
    ASSERT_TRUE(b.CopyToDevice(values->get(), v.data(), v.size() * sizeof(float)).ok());
  };
  for (int layer = 0; layer < L; ++layer) {
    ASSERT_TRUE(store.AllocateLayer(s.segment, layer).ok());
    fill(layer);
    ASSERT_TRUE(comp.OffloadValuesAsync(store, s, layer, values->get(), rows * d, 0, n, 0).ok());
  }
  ASSERT_TRUE(comp.DrainPuts(s.segment).ok());
  for (int layer = 0; layer < L; ++layer) {
    for (int h = 0; h < H; ++h) {
      std::vector<storage::ChunkRef> refs;
      for (int c = 0; c < n; ++c) refs.push_back({h, c});
      std::vector<float> got(static_cast<size_t>(n) * C * d);
      ASSERT_TRUE(store.GatherChunks(s.segment, layer, refs, got.data()).ok());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i],
                  static_cast<float>(layer * 100000 + static_cast<int64_t>(h) * rows * d + static_cast<int64_t>(i)))
            << "layer " << layer << " head " << h << " element " << i;
      }
    }
  }
  // A layer never allocated: its put fails on the helper thread.
  ShadowKvSeq other;
  lay.Shape(spec, &other);
  auto seg2 = store.ReserveSegment(lay.ValueSegment(other));
  ASSERT_TRUE(seg2.ok());
  other.segment = *seg2;
  ASSERT_TRUE(comp.OffloadValuesAsync(store, other, 0, values->get(), rows * d, 0, n, 0).ok());
  EXPECT_TRUE(comp.DrainPuts(s.segment).ok());  // not s's failure
  const Status failed = comp.DrainPuts(other.segment);
  EXPECT_EQ(failed.code(), StatusCode::kFailedPrecondition) << failed;
  EXPECT_TRUE(comp.DrainPuts(other.segment).ok());  // reported once
  // Another failing put of it; ForgetPuts (its sequence is gone) drops the failure.
  ASSERT_TRUE(comp.OffloadValuesAsync(store, other, 0, values->get(), rows * d, 0, n, 0).ok());
  comp.ForgetPuts(other.segment);
  EXPECT_TRUE(comp.DrainPuts(other.segment).ok());
}

}  // namespace
}  // namespace penumbra
