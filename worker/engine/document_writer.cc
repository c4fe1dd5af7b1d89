#include "worker/engine/document_writer.h"

#include <glog/logging.h>

#include "worker/engine/op_profiler.h"  // NowSeconds

namespace penumbra {

DocumentWriter::DocumentWriter(storage::DocumentStore* store, size_t max_queued_bytes,
                               std::map<std::string, size_t> blob_block_bytes)
    : store_(store),
      max_queued_bytes_(max_queued_bytes),
      blob_block_bytes_(std::move(blob_block_bytes)),
      thread_([this] { Run(); }) {}

DocumentWriter::~DocumentWriter() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool DocumentWriter::Enqueue(const Hash128& key, std::string cache_namespace, int64_t tokens,
                             std::map<std::string, std::string> blobs) {
  size_t bytes = 0;
  for (const auto& [name, b] : blobs) bytes += b.size();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (queued_bytes_ + bytes > max_queued_bytes_) {
      ++skipped_;
      return false;
    }
    queued_bytes_ += bytes;
    queue_.push_back(Item{key, std::move(cache_namespace), tokens, std::move(blobs), bytes});
  }
  cv_.notify_all();
  return true;
}

void DocumentWriter::EnqueueErase(const Hash128& key) {
  {
    std::lock_guard<std::mutex> l(mu_);
    Item item{key, "", 0, {}, 0};
    item.erase = true;
    queue_.push_back(std::move(item));
  }
  cv_.notify_all();
}

bool DocumentWriter::Drain(std::chrono::milliseconds max_wait) {
  std::unique_lock<std::mutex> l(mu_);
  auto idle = [&] { return queue_.empty() && !busy_; };
  if (max_wait == std::chrono::milliseconds::max()) {
    cv_.wait(l, idle);
    return true;
  }
  return cv_.wait_for(l, max_wait, idle);
}

double DocumentWriter::write_seconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return write_seconds_;
}

void DocumentWriter::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, everything written
    Item item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    l.unlock();
    if (item.erase) {
      Status s = store_->Erase(item.key);
      if (!s.ok() && s.code() != StatusCode::kNotFound) {
        LOG(WARNING) << "prefix store: segment " << item.key.Hex() << " not erased: " << s;
      }
      l.lock();
      busy_ = false;
      cv_.notify_all();
      continue;
    }
    const double t0 = NowSeconds();
    std::map<std::string, size_t> block_bytes;
    for (const auto& [name, bytes] : blob_block_bytes_) {
      if (item.blobs.count(name)) block_bytes[name] = bytes;
    }
    Status s = store_->Put(item.key, item.ns, item.tokens, item.blobs, block_bytes);
    const double dt = NowSeconds() - t0;
    if (s.ok()) {
      ++stored_;
    } else {
      ++errors_;
      LOG(WARNING) << "prefix store: not stored: " << s;
    }
    item.blobs.clear();
    l.lock();
    write_seconds_ += dt;
    queued_bytes_ -= item.bytes;
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace penumbra
