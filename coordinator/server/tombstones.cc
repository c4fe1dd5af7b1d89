#include "coordinator/server/tombstones.h"

#include <glog/logging.h>

namespace penumbra::coordinator {

TombstoneSweeper::TombstoneSweeper(DocumentRegistry* docs, std::function<int()> workers, Forget forget,
                                   std::chrono::milliseconds interval)
    : docs_(docs), workers_(std::move(workers)), forget_(std::move(forget)), interval_(interval) {
  thread_ = std::thread([this] { Loop(); });
}

TombstoneSweeper::~TombstoneSweeper() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void TombstoneSweeper::Kick() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    kicked_ = true;
  }
  cv_.notify_all();
}

int64_t TombstoneSweeper::sweeps() const {
  std::lock_guard<std::mutex> lk(mu_);
  return sweeps_;
}

void TombstoneSweeper::Loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, interval_, [&] { return stop_ || kicked_; });
    if (stop_) break;
    kicked_ = false;
    lk.unlock();
    if (docs_->tombstone_count() > 0) SweepOnce();
    lk.lock();
  }
}

void TombstoneSweeper::SweepOnce() {
  std::lock_guard<std::mutex> one(sweep_mu_);
  const int n = workers_();
  for (const DocumentTombstone& t : docs_->Tombstones()) {
    for (int w = 0; w < n; ++w) {
      if (t.confirmed.count(w)) continue;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_) return;
      }
      const Status s = forget_(w, t);
      if (s.ok() || s.code() == StatusCode::kInvalidArgument) {
        docs_->ConfirmForgotten(t.id, w);
      } else {
        VLOG(1) << "document " << t.id << ": worker " << w << " did not confirm the forget yet: " << s;
      }
    }
  }
  if (Status s = docs_->DropConfirmed(n); !s.ok()) LOG(WARNING) << "tombstones kept for the next sweep: " << s;
  std::lock_guard<std::mutex> lk(mu_);
  ++sweeps_;
}

}  // namespace penumbra::coordinator
