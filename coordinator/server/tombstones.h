// TombstoneSweeper: carries document deletes to the workers. A removed
// document leaves a tombstone in the registry (document_registry.h) until
// every worker has confirmed that it dropped the document's cached state
// (its document cache and its store node's copy: the worker's
// ForgetPrefixes). A background thread sweeps every `interval` while any
// tombstone is pending (and at once after Kick): it asks each worker that
// has not confirmed, and drops the tombstones all workers confirmed. A
// worker that is down is asked again at the next sweep; after a coordinator
// restart (tombstones are durable, confirmations are not) every worker is
// asked again, which is harmless (forgetting is idempotent).
//
// A worker's answer counts as a confirmation when it is OK or
// InvalidArgument (a prompt the worker refuses is one it cannot hold).
//
// Thread-safe; the destructor stops the thread (waiting for a sweep under way).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#include "common/status.h"
#include "coordinator/server/document_registry.h"

namespace penumbra::coordinator {

class TombstoneSweeper {
 public:
  // Asks worker `worker` to drop the state of `t`.
  using Forget = std::function<Status(int worker, const DocumentTombstone& t)>;

  // `docs` outlives the sweeper; `workers()` is how many workers there are
  // (indices 0..n-1). Starts the thread.
  TombstoneSweeper(DocumentRegistry* docs, std::function<int()> workers, Forget forget,
                   std::chrono::milliseconds interval);
  ~TombstoneSweeper();
  TombstoneSweeper(const TombstoneSweeper&) = delete;
  TombstoneSweeper& operator=(const TombstoneSweeper&) = delete;

  // Sweeps soon (after a delete) instead of at the next interval.
  void Kick();
  // One sweep, now, on the calling thread (tests; the thread does the same).
  void SweepOnce();
  int64_t sweeps() const;

 private:
  void Loop();

  DocumentRegistry* docs_;
  std::function<int()> workers_;
  Forget forget_;
  const std::chrono::milliseconds interval_;
  std::mutex sweep_mu_;  // one sweep at a time
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, kicked_ = false;
  int64_t sweeps_ = 0;
  std::thread thread_;
};

}  // namespace penumbra::coordinator
