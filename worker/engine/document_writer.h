// DocumentWriter: the persistent tier's writer (DocumentCache,
// worker/engine/document_cache.h): stores captured documents' states in the
// persistent store (a storage::DocumentStore) on a background thread, so that
// the request that prefilled a document is not held up by writing it
// (gigabytes at disk speed). The cache exports a captured state (its blobs,
// host copies) and queues them; the thread Puts them in order. A queue over
// its byte bound refuses the state (counted as skipped: the document is
// still cached in memory and recomputed after a restart).
// Erases go through the same queue (in order with the writes), so a caller
// on the decode loop never waits on the store. A store that stops answering
// costs only this thread's time: each call has a deadline (and fails at once
// while its node's breaker is open), and Enqueue never blocks.
// The destructor finishes every queued write. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "common/hash.h"
#include "storage/segment_store.h"

namespace penumbra {

class DocumentWriter {
 public:
  // `store` must outlive the writer.
  // blob_block_bytes: block sizes of named blobs (SegmentStore::Put).
  DocumentWriter(storage::DocumentStore* store, size_t max_queued_bytes,
                 std::map<std::string, size_t> blob_block_bytes = {});
  ~DocumentWriter();
  DocumentWriter(const DocumentWriter&) = delete;
  DocumentWriter& operator=(const DocumentWriter&) = delete;

  // Queues a Put; false (and nothing queued) when the queue's bytes would
  // exceed the bound.
  bool Enqueue(const Hash128& key, std::string cache_namespace, int64_t tokens,
               std::map<std::string, std::string> blobs);
  // Queues an Erase of `key` (after the writes queued before it).
  void EnqueueErase(const Hash128& key);
  // Blocks until every queued write has finished, at most `max_wait`; true
  // when they all have.
  bool Drain(std::chrono::milliseconds max_wait = std::chrono::milliseconds::max());

  int64_t stored() const { return stored_; }
  int64_t errors() const { return errors_; }    // Puts that failed (logged)
  int64_t skipped() const { return skipped_; }  // refused by the queue bound
  double write_seconds() const;                 // time spent in Put

 private:
  struct Item {
    Hash128 key;
    std::string ns;
    int64_t tokens;
    std::map<std::string, std::string> blobs;
    size_t bytes;
    bool erase = false;  // an Erase of key, not a Put
  };
  void Run();

  storage::DocumentStore* const store_;
  const size_t max_queued_bytes_;
  const std::map<std::string, size_t> blob_block_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;    // guarded by mu_
  size_t queued_bytes_ = 0;   // guarded by mu_ (the item being written included)
  bool busy_ = false;         // guarded by mu_: an item is being written
  bool stop_ = false;         // guarded by mu_
  double write_seconds_ = 0;  // guarded by mu_
  std::atomic<int64_t> stored_{0}, errors_{0}, skipped_{0};
  std::thread thread_;
};

}  // namespace penumbra
