// WorkerWatch: one long poll of a worker for all of the coordinator's
// generations waiting there. A client's poll of a generation (Advance) asks
// the watch of the generation's worker for the tokens past its offset; the
// watch's thread gathers every such wait into one PollMany call, returns
// each generation's chunk to its waiter as soon as the worker answers (when
// any of them has progressed, or ended), and starts the next call with the
// waits still open and those added meanwhile. So streams cost the worker one
// call per decode step, not one per stream, and the coordinator no thread
// per stream blocked on the worker.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"
#include "coordinator/server/worker_pool.h"

namespace penumbra::coordinator {

class WorkerWatch {
 public:
  // Starts the thread; `pool` outlives the watch.
  WorkerWatch(WorkerPool* pool, int worker);
  ~WorkerWatch();  // ends open waits with Unavailable and joins
  WorkerWatch(const WorkerWatch&) = delete;
  WorkerWatch& operator=(const WorkerWatch&) = delete;

  // Waits up to `wait` for the tokens of generation `handle` past `offset`,
  // or its end. OK with the chunk (no ids when nothing came in time); the
  // worker call's error (Unavailable, DeadlineExceeded), or the target's own
  // (NotFound: the worker does not know it) otherwise.
  Status Wait(const std::string& handle, int64_t offset, std::chrono::milliseconds wait, rpc::TokenChunk* out);

  // The longest one call waits: a wait added while a call is out starts at
  // the latest this much later (when no waited-on generation progresses
  // sooner). Default: 250 ms.
  static constexpr std::chrono::milliseconds kMaxCallWait{250};

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiter {
    std::string handle;
    int64_t offset = 0;
    Clock::time_point until;
    bool done = false;
    Status status;
    rpc::TokenChunk chunk;
  };
  void Loop();

  WorkerPool* pool_;
  int worker_;
  std::mutex mu_;
  std::condition_variable cv_;       // the thread: a wait was added, or stop
  std::condition_variable done_cv_;  // waiters: theirs was answered
  std::list<std::shared_ptr<Waiter>> waiting_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace penumbra::coordinator
