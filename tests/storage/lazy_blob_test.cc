// LazyBlob against an in-memory reader (random ranges, concurrency, a block
// that fails its check, the background restore) and against a real
// SegmentStore (the segment stays attached while it is read, detached after).
#include "storage/lazy_blob.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "storage/segment_store.h"
#include "tests/storage/segment_store_test_util.h"

namespace penumbra::storage {
namespace {

// Serves `data`; block reads of `bad_block` (at block_bytes) fail with Corruption.
class MemoryReader final : public BlobReader {
 public:
  MemoryReader(std::string data, size_t block_bytes, int64_t bad_block = -1, int batch = 1)
      : data_(std::move(data)), block_bytes_(block_bytes), bad_block_(bad_block), batch_(batch) {}
  Status ReadMany(const std::string& blob, std::span<const Piece> pieces) override {
    EXPECT_LE(pieces.size(), static_cast<size_t>(batch_));
    calls_.fetch_add(1);
    return BlobReader::ReadMany(blob, pieces);
  }
  int batch_blocks() const override { return batch_; }
  int64_t calls() const { return calls_.load(); }
  Status Read(const std::string& blob, uint64_t offset, uint64_t length, void* dst) override {
    EXPECT_EQ(blob, "values");
    EXPECT_EQ(offset % block_bytes_, 0u);
    EXPECT_LE(offset + length, data_.size());
    reads_.fetch_add(1);
    if (bad_block_ >= 0 && offset / block_bytes_ == static_cast<uint64_t>(bad_block_)) {
      return Status::Corruption("block " + std::to_string(bad_block_) + " failed its checksum");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));  // reads take time: threads overlap
    std::memcpy(dst, data_.data() + offset, length);
    return Status::OK();
  }
  Result<uint64_t> Size(const std::string&) const override { return data_.size(); }
  Result<size_t> BlockBytes(const std::string&) const override { return block_bytes_; }
  int64_t reads() const { return reads_.load(); }

 private:
  std::string data_;
  size_t block_bytes_;
  int64_t bad_block_;
  int batch_;
  std::atomic<int64_t> reads_{0}, calls_{0};
};

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

TEST(LazyBlobTest, EnsureReadsOnlyTheCoveringBlocksThenTheRestoreReadsTheRest) {
  const size_t bb = 4096, size = 100 * bb + 123;  // a short last block
  const std::string data = RandomBytes(size, 1);
  auto reader = std::make_shared<MemoryReader>(data, bb);
  std::string dst(size, '\0');
  LazyBlob lb(reader, "values", dst.data(), size, bb, 4);
  EXPECT_EQ(lb.blocks(), 101u);
  EXPECT_FALSE(lb.complete());
  const LazyBlob::Range ranges[] = {{10, 5}, {3 * bb - 1, 2}, {size - 7, 7}, {50 * bb, 0}};
  ASSERT_TRUE(lb.Ensure(ranges).ok());
  // Blocks 0, 2, 3 and 100: exact; nothing else read.
  EXPECT_EQ(reader->reads(), 4);
  EXPECT_EQ(lb.blocks_read(), 4);
  EXPECT_EQ(lb.blocks_on_demand(), 4);
  for (uint64_t b : {0u, 2u, 3u}) EXPECT_EQ(dst.substr(b * bb, bb), data.substr(b * bb, bb)) << b;
  EXPECT_EQ(dst.substr(100 * bb), data.substr(100 * bb));
  EXPECT_EQ(dst.substr(bb, bb), std::string(bb, '\0'));  // block 1: not read
  const LazyBlob::Range past[] = {{size - 1, 2}};
  EXPECT_EQ(lb.Ensure(past).code(), StatusCode::kInvalidArgument);
  // The restore reads every other block once.
  ASSERT_TRUE(lb.EnsureAll().ok());
  EXPECT_TRUE(lb.complete());
  EXPECT_EQ(dst, data);
  EXPECT_EQ(reader->reads(), 101);
  EXPECT_EQ(reader.use_count(), 1);  // released once complete
}

TEST(LazyBlobTest, ConcurrentEnsuresDuringTheRestoreAllSeeTheirBytes) {
  const size_t bb = 4096, size = 512 * bb;
  const std::string data = RandomBytes(size, 2);
  auto reader = std::make_shared<MemoryReader>(data, bb);
  std::string dst(size, '\0');
  LazyBlob lb(reader, "values", dst.data(), size, bb, 8);
  std::vector<std::thread> users;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    users.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int i = 0; i < 200; ++i) {
        if (t == 0 && i == 50) lb.StartRestore();
        const uint64_t off = rng() % size, len = 1 + rng() % std::min<uint64_t>(3 * bb, size - off);
        const LazyBlob::Range r[] = {{off, len}};
        if (!lb.Ensure(r).ok() || std::memcmp(dst.data() + off, data.data() + off, len) != 0) ++wrong;
      }
    });
  }
  for (auto& u : users) u.join();
  EXPECT_EQ(wrong.load(), 0);
  ASSERT_TRUE(lb.EnsureAll().ok());
  EXPECT_EQ(dst, data);
  EXPECT_EQ(reader->reads(), 512);  // each block read once
}

// A reader across a network asks for several blocks per call
// (BlobReader::batch_blocks): demand first, then the restore's, each block
// once; a failing block fails its whole batch and everything after.
TEST(LazyBlobTest, ABatchingReaderGetsSeveralBlocksPerCall) {
  const size_t bb = 4096, size = 256 * bb;
  const std::string data = RandomBytes(size, 6);
  auto reader = std::make_shared<MemoryReader>(data, bb, -1, /*batch=*/8);
  std::string dst(size, '\0');
  LazyBlob lb(reader, "values", dst.data(), size, bb, 4);
  std::vector<LazyBlob::Range> scattered;
  for (uint64_t b = 3; b < 256; b += 17) scattered.push_back({b * bb + 5, 10});
  ASSERT_TRUE(lb.Ensure(scattered).ok());
  for (const auto& r : scattered) EXPECT_EQ(dst.substr(r.offset, r.length), data.substr(r.offset, r.length));
  EXPECT_EQ(lb.blocks_on_demand(), static_cast<int64_t>(scattered.size()));
  ASSERT_TRUE(lb.EnsureAll().ok());
  EXPECT_EQ(dst, data);
  EXPECT_EQ(reader->reads(), 256);              // each block once
  EXPECT_LE(reader->calls(), 256 / 8 + 8 * 2);  // batched (a few part-filled batches at the seams)
  auto bad = std::make_shared<MemoryReader>(data, bb, /*bad_block=*/100, 8);
  std::string dst2(size, '\0');
  LazyBlob lb2(bad, "values", dst2.data(), size, bb, 2);
  EXPECT_EQ(lb2.EnsureAll().code(), StatusCode::kCorruption);
  EXPECT_FALSE(lb2.complete());
  EXPECT_EQ(dst2.substr(100 * bb, bb), std::string(bb, '\0'));
}

TEST(LazyBlobTest, ABlockThatFailsItsCheckFailsEveryLaterCallAndIsNeverPresent) {
  const size_t bb = 4096, size = 64 * bb;
  const std::string data = RandomBytes(size, 3);
  auto reader = std::make_shared<MemoryReader>(data, bb, /*bad_block=*/9);
  std::string dst(size, '\0');
  LazyBlob lb(reader, "values", dst.data(), size, bb, 4);
  const LazyBlob::Range good[] = {{0, bb}};
  ASSERT_TRUE(lb.Ensure(good).ok());
  const LazyBlob::Range bad[] = {{9 * bb + 10, 10}};
  EXPECT_EQ(lb.Ensure(bad).code(), StatusCode::kCorruption);
  EXPECT_EQ(lb.error().code(), StatusCode::kCorruption);
  EXPECT_EQ(lb.Ensure(good).code(), StatusCode::kCorruption);  // sticky: the prefix is dropped
  EXPECT_EQ(lb.EnsureAll().code(), StatusCode::kCorruption);
  EXPECT_FALSE(lb.complete());
  EXPECT_EQ(dst.substr(9 * bb, bb), std::string(bb, '\0'));
}

TEST(LazyBlobTest, APlaceFunctionPutsEachBlockWhereItBelongs) {
  // The blob is the buffer reversed in 1000-byte rows; place undoes it.
  const size_t bb = 4096, row = 1000, rows = 37, size = row * rows;
  const std::string want = RandomBytes(size, 5);
  std::string blob(size, '\0');
  for (size_t r = 0; r < rows; ++r) std::memcpy(blob.data() + r * row, want.data() + (rows - 1 - r) * row, row);
  auto reader = std::make_shared<MemoryReader>(blob, bb);
  std::string dst(size, '\0');
  std::atomic<int> placed{0};
  LazyBlob lb(reader, "values", nullptr, size, bb, 3, nullptr, [&](uint64_t off, const char* data, size_t len) {
    ++placed;
    for (uint64_t pos = off; pos < off + len;) {
      const uint64_t r = pos / row, in = pos % row, take = std::min<uint64_t>(row - in, off + len - pos);
      std::memcpy(dst.data() + (rows - 1 - r) * row + in, data + (pos - off), take);
      pos += take;
    }
  });
  const LazyBlob::Range r[] = {{5 * row, row}};
  ASSERT_TRUE(lb.Ensure(r).ok());
  EXPECT_EQ(dst.substr((rows - 6) * row, row), want.substr((rows - 6) * row, row));
  ASSERT_TRUE(lb.EnsureAll().ok());
  EXPECT_EQ(dst, want);
  EXPECT_EQ(placed.load(), static_cast<int>(lb.blocks()));
}

TEST(LazyBlobTest, OnCompleteRunsOnceBeforeCompleteTurnsTrue) {
  const size_t bb = 4096, size = 10 * bb;
  auto reader = std::make_shared<MemoryReader>(RandomBytes(size, 6), bb);
  std::string dst(size, '\0');
  std::atomic<int> calls{0};
  LazyBlob* self = nullptr;
  bool complete_inside = true;
  LazyBlob lb(reader, "values", dst.data(), size, bb, 4, [&] {
    ++calls;
    complete_inside = self->complete();
  });
  self = &lb;
  ASSERT_TRUE(lb.EnsureAll().ok());
  EXPECT_TRUE(lb.complete());
  EXPECT_EQ(calls.load(), 1);
  EXPECT_FALSE(complete_inside);  // the hook runs first (e.g. pins the buffer), then readers see it whole
}

TEST(LazyBlobTest, ASegmentIsAttachedWhileItIsReadAndReadsBackExactly) {
  testing::TempDir dir;
  SegmentStoreOptions o;
  o.path = dir.path();
  o.sync_commit = false;
  auto store = SegmentStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  const Hash128 key{1, 2};
  const std::string values = RandomBytes(300000, 4), meta = "m";
  ASSERT_TRUE((*store)->Put(key, "", 10, {{"meta", meta}, {"values", values}}, {{"values", 16384}}).ok());
  EXPECT_EQ(OpenSegmentReader(store->get(), Hash128{9, 9}).status().code(), StatusCode::kNotFound);
  auto reader = OpenSegmentReader(store->get(), key);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(*(*reader)->BlockBytes("values"), 16384u);
  EXPECT_EQ(*(*reader)->Size("values"), values.size());
  EXPECT_EQ((*reader)->Size("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*store)->Erase(key).code(), StatusCode::kFailedPrecondition);  // attached
  std::string dst(values.size(), '\0');
  {
    LazyBlob lb(std::move(*reader), "values", dst.data(), values.size(), 16384, 4);
    const LazyBlob::Range r[] = {{123456, 1000}};
    ASSERT_TRUE(lb.Ensure(r).ok());
    EXPECT_EQ(dst.substr(123456, 1000), values.substr(123456, 1000));
    ASSERT_TRUE(lb.EnsureAll().ok());
    EXPECT_EQ(dst, values);
  }
  EXPECT_TRUE((*store)->Erase(key).ok());  // detached once read
}

}  // namespace
}  // namespace penumbra::storage
