#include "coordinator/server/worker_watch.h"

#include <algorithm>
#include <vector>

#include "transport/thrift_util.h"

namespace penumbra::coordinator {

WorkerWatch::WorkerWatch(WorkerPool* pool, int worker) : pool_(pool), worker_(worker) {
  thread_ = std::thread([this] { Loop(); });
}

WorkerWatch::~WorkerWatch() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    for (auto& w : waiting_) {
      w->done = true;
      w->status = Status::Unavailable("the coordinator is stopping");
    }
    waiting_.clear();
  }
  cv_.notify_all();
  done_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status WorkerWatch::Wait(const std::string& handle, int64_t offset, std::chrono::milliseconds wait,
                         rpc::TokenChunk* out) {
  auto w = std::make_shared<Waiter>();
  w->handle = handle;
  w->offset = offset;
  w->until = Clock::now() + wait;
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) return Status::Unavailable("the coordinator is stopping");
  waiting_.push_back(w);
  cv_.notify_all();
  done_cv_.wait(lk, [&] { return w->done; });
  if (!w->status.ok()) return w->status;
  *out = w->chunk;  // Thrift structs copy (no move assignment)
  return Status::OK();
}

void WorkerWatch::Loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !waiting_.empty(); });
    if (stop_) return;
    // One call for every open wait, as long as the nearest of them may wait
    // (at most kMaxCallWait, so waits added meanwhile start soon).
    std::vector<std::shared_ptr<Waiter>> batch(waiting_.begin(), waiting_.end());
    std::vector<rpc::WorkerPollTarget> targets(batch.size());
    Clock::time_point until = Clock::now() + kMaxCallWait;
    for (size_t i = 0; i < batch.size(); ++i) {
      targets[i].handle = batch[i]->handle;
      targets[i].offset = batch[i]->offset;
      until = std::min(until, batch[i]->until);
    }
    lk.unlock();
    const auto wait = std::max(std::chrono::milliseconds(0),
                               std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()));
    std::vector<rpc::TokenChunk> chunks;
    Status s = pool_->Call(
        worker_, "poll", [&](rpc::WorkerClient& c) { c.PollMany(chunks, targets, static_cast<int32_t>(wait.count())); },
        wait + std::chrono::milliseconds(3000));
    if (s.ok() && chunks.size() != batch.size()) {
      s = Status::Internal("the worker answered " + std::to_string(chunks.size()) + " chunks for " +
                           std::to_string(batch.size()) + " polls");
    }
    lk.lock();
    const Clock::time_point now = Clock::now();
    for (size_t i = 0; i < batch.size(); ++i) {
      Waiter& w = *batch[i];
      if (w.done) continue;  // ended by the destructor
      if (!s.ok()) {
        w.status = s;
      } else if (chunks[i].__isset.error_code && !chunks[i].done) {
        rpc::PenumbraError e;  // the target's own poll failed
        e.code = chunks[i].error_code;
        e.message = chunks[i].__isset.error_message ? chunks[i].error_message : "poll failed";
        w.status = transport::FromRpcError(e);
      } else if (chunks[i].ids.empty() && !chunks[i].done && now < w.until) {
        continue;  // nothing yet, and it may wait more: the next call
      } else {
        w.chunk = chunks[i];
      }
      w.done = true;
    }
    waiting_.remove_if([](const std::shared_ptr<Waiter>& w) { return w->done; });
    done_cv_.notify_all();
  }
}

}  // namespace penumbra::coordinator
