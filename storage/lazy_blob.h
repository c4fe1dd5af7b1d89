// LazyBlob: one blob of a stored segment read into caller memory block by
// block: on demand first (Ensure: the blocks a reader needs now, e.g. the
// value chunks a question selects), then, once StartRestore is called,
// every other block in order in the background, by a few threads. A cached
// document restored from disk answers before its values are read back
// (docs/storage.md, "Lazy reads").
//
// Integrity: the reader checks every block (SegmentStore::ReadBlob); a block
// that fails is never marked present, and every later Ensure returns the
// first error (the caller drops the segment and recomputes it).
//
// Thread-safe. The destructor stops the threads (reads in flight finish).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/hash.h"
#include "common/status.h"

namespace penumbra::storage {

class SegmentStore;

// Reads byte ranges of one stored segment's blobs.
class BlobReader {
 public:
  virtual ~BlobReader() = default;
  virtual Status Read(const std::string& blob, uint64_t offset, uint64_t length, void* dst) = 0;
  // Several ranges of one blob, each into its dst. Default: one Read each;
  // a reader of a remote store asks for them in one message.
  struct Piece {
    uint64_t offset = 0, length = 0;
    char* dst = nullptr;
  };
  virtual Status ReadMany(const std::string& blob, std::span<const Piece> pieces) {
    for (const Piece& p : pieces) {
      Status s = Read(blob, p.offset, p.length, p.dst);
      if (!s.ok()) return s;
    }
    return Status::OK();
  }
  // Blocks worth asking for in one ReadMany (a LazyBlob's reading threads
  // take this many at once): 1 for a local disk, more across a network.
  virtual int batch_blocks() const { return 1; }
  // The blob's size and block size; NotFound when the segment has no such blob.
  virtual Result<uint64_t> Size(const std::string& blob) const = 0;
  virtual Result<size_t> BlockBytes(const std::string& blob) const = 0;
};

// A reader of `key` in `store`, which keeps the segment attached (neither
// evicted nor erased) while it lives. NotFound when absent.
Result<std::shared_ptr<BlobReader>> OpenSegmentReader(SegmentStore* store, const Hash128& key);

class LazyBlob {
 public:
  // `dst` holds `size` bytes (the blob's); block b is bytes [b * block_bytes,
  // min((b + 1) * block_bytes, size)). `threads` read at once (>= 1).
  // on_complete (optional) runs once, on a reading thread, when every block
  // is present (e.g. pins the buffer); complete() turns true after it.
  // place (optional): where a block's bytes go, when the blob is not laid
  // out as dst (called with the blob offset, the bytes and their length, on
  // a reading thread; dst is then unused).
  using Place = std::function<void(uint64_t offset, const char* data, size_t length)>;
  LazyBlob(std::shared_ptr<BlobReader> reader, std::string blob, char* dst, uint64_t size, size_t block_bytes,
           int threads, std::function<void()> on_complete = nullptr, Place place = nullptr);
  ~LazyBlob();
  LazyBlob(const LazyBlob&) = delete;
  LazyBlob& operator=(const LazyBlob&) = delete;

  // Returns when every block covering [offset, offset + length) of each
  // range is in dst (read now, ahead of the background restore), or with the
  // first read error.
  struct Range {
    uint64_t offset = 0, length = 0;
  };
  Status Ensure(std::span<const Range> ranges);
  // Reads every block not yet read, in order, in the background.
  void StartRestore();
  // StartRestore, then waits for every block.
  Status EnsureAll();

  bool complete() const;
  Status error() const;
  uint64_t size() const { return size_; }
  size_t block_bytes() const { return block_bytes_; }
  uint32_t blocks() const { return static_cast<uint32_t>(state_.size()); }
  int64_t blocks_read() const;       // present blocks
  int64_t blocks_on_demand() const;  // of them, read for an Ensure

 private:
  enum : uint8_t { kAbsent = 0, kLoading = 1, kPresent = 2 };
  void StartThreadsLocked();
  void Work();

  std::shared_ptr<BlobReader> reader_;  // released once every block is present
  const std::string blob_;
  char* const dst_;
  const uint64_t size_;
  const size_t block_bytes_;
  const int threads_;
  std::function<void()> on_complete_;
  Place place_;
  bool completed_ = false;  // every block present and on_complete_ run
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<uint8_t> state_;
  std::deque<uint32_t> demand_;
  uint32_t cursor_ = 0;  // the background restore's next block
  bool restoring_ = false, stop_ = false;
  int64_t present_ = 0, on_demand_ = 0;
  Status error_;
  std::vector<std::thread> pool_;
};

}  // namespace penumbra::storage
