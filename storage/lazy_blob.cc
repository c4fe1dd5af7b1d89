#include "storage/lazy_blob.h"

#include <algorithm>

#include "storage/segment_store.h"

namespace penumbra::storage {
namespace {

class SegmentReader final : public BlobReader {
 public:
  SegmentReader(SegmentStore* store, const Hash128& key, std::vector<BlobLayout> layout)
      : store_(store), key_(key), layout_(std::move(layout)) {}
  ~SegmentReader() override { (void)store_->Detach(key_); }
  Status Read(const std::string& blob, uint64_t offset, uint64_t length, void* dst) override {
    return store_->ReadBlob(key_, blob, offset, length, dst);
  }
  Result<uint64_t> Size(const std::string& blob) const override {
    PENUMBRA_ASSIGN_OR_RETURN(const BlobLayout* b, Find(blob));
    return b->size;
  }
  Result<size_t> BlockBytes(const std::string& blob) const override {
    PENUMBRA_ASSIGN_OR_RETURN(const BlobLayout* b, Find(blob));
    return b->block_bytes;
  }

 private:
  Result<const BlobLayout*> Find(const std::string& blob) const {
    for (const BlobLayout& b : layout_) {
      if (b.name == blob) return &b;
    }
    return Status::NotFound("segment " + key_.Hex() + " has no blob '" + blob + "'");
  }
  SegmentStore* store_;
  Hash128 key_;
  std::vector<BlobLayout> layout_;
};

}  // namespace

Result<std::shared_ptr<BlobReader>> OpenSegmentReader(SegmentStore* store, const Hash128& key) {
  PENUMBRA_RETURN_IF_ERROR(store->Attach(key));
  auto layout = store->Layout(key);
  if (!layout.ok()) {
    (void)store->Detach(key);
    return layout.status();
  }
  return std::shared_ptr<BlobReader>(new SegmentReader(store, key, std::move(*layout)));
}

LazyBlob::LazyBlob(std::shared_ptr<BlobReader> reader, std::string blob, char* dst, uint64_t size,
                   size_t block_bytes, int threads, std::function<void()> on_complete, Place place)
    : reader_(std::move(reader)), blob_(std::move(blob)), dst_(dst), size_(size),
      block_bytes_(std::max<size_t>(block_bytes, 1)), threads_(std::max(threads, 1)),
      on_complete_(std::move(on_complete)),
      place_(std::move(place)),
      state_(static_cast<size_t>((size + block_bytes_ - 1) / block_bytes_), kAbsent) {
  if (state_.empty()) {
    reader_.reset();
    if (on_complete_) on_complete_();
    completed_ = true;
  }
}

LazyBlob::~LazyBlob() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : pool_) t.join();
}

void LazyBlob::StartThreadsLocked() {
  if (!pool_.empty() || present_ == static_cast<int64_t>(state_.size())) return;
  for (int i = 0; i < threads_; ++i) pool_.emplace_back([this] { Work(); });
}

void LazyBlob::Work() {
  std::vector<char> scratch(place_ ? block_bytes_ : 0);  // a block read before it is placed
  for (;;) {
    uint32_t b = 0;
    std::shared_ptr<BlobReader> reader;
    {
      std::unique_lock<std::mutex> l(mu_);
      for (;;) {
        if (stop_ || !error_.ok() || present_ == static_cast<int64_t>(state_.size())) return;
        bool found = false;
        while (!demand_.empty() && !found) {
          b = demand_.front();
          demand_.pop_front();
          found = state_[b] == kAbsent;
          if (found) ++on_demand_;
        }
        while (!found && restoring_ && cursor_ < state_.size()) {
          b = cursor_++;
          found = state_[b] == kAbsent;
        }
        if (found) break;
        work_cv_.wait(l);
      }
      state_[b] = kLoading;
      reader = reader_;
    }
    const uint64_t off = static_cast<uint64_t>(b) * block_bytes_;
    const uint64_t len = std::min<uint64_t>(block_bytes_, size_ - off);
    Status st = reader->Read(blob_, off, len, place_ ? scratch.data() : dst_ + off);
    reader.reset();
    if (st.ok() && place_) place_(off, scratch.data(), len);
    bool last = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (st.ok()) {
        state_[b] = kPresent;
        last = ++present_ == static_cast<int64_t>(state_.size());
        if (last) reader_.reset();  // detaches the segment
      } else {
        state_[b] = kAbsent;
        if (error_.ok()) error_ = st;
        reader_.reset();  // nothing more is read: the segment is detached (the caller may erase it)
      }
    }
    if (last) {
      if (on_complete_) on_complete_();
      std::lock_guard<std::mutex> l(mu_);
      completed_ = true;
    }
    done_cv_.notify_all();
    if (!st.ok()) work_cv_.notify_all();  // the others stop too
  }
}

Status LazyBlob::Ensure(std::span<const Range> ranges) {
  std::vector<uint32_t> need;
  for (const Range& r : ranges) {
    if (r.length == 0) continue;
    if (r.offset + r.length > size_) {
      return Status::InvalidArgument("lazy blob '" + blob_ + "': range [" + std::to_string(r.offset) + ", +" +
                                     std::to_string(r.length) + ") is past its " + std::to_string(size_) + " bytes");
    }
    for (uint64_t b = r.offset / block_bytes_; b <= (r.offset + r.length - 1) / block_bytes_; ++b) {
      need.push_back(static_cast<uint32_t>(b));
    }
  }
  std::unique_lock<std::mutex> l(mu_);
  if (!error_.ok()) return error_;
  bool queued = false;
  for (uint32_t b : need) {
    if (state_[b] == kAbsent) {
      demand_.push_back(b);
      queued = true;
    }
  }
  if (queued) {
    StartThreadsLocked();
    work_cv_.notify_all();
  }
  done_cv_.wait(l, [&] {
    if (!error_.ok()) return true;
    for (uint32_t b : need) {
      if (state_[b] != kPresent) return false;
    }
    return true;
  });
  return error_;
}

void LazyBlob::StartRestore() {
  std::lock_guard<std::mutex> l(mu_);
  if (restoring_) return;
  restoring_ = true;
  StartThreadsLocked();
  work_cv_.notify_all();
}

Status LazyBlob::EnsureAll() {
  StartRestore();
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return !error_.ok() || completed_; });
  return error_;
}

bool LazyBlob::complete() const {
  std::lock_guard<std::mutex> l(mu_);
  return completed_;
}

Status LazyBlob::error() const {
  std::lock_guard<std::mutex> l(mu_);
  return error_;
}

int64_t LazyBlob::blocks_read() const {
  std::lock_guard<std::mutex> l(mu_);
  return present_;
}

int64_t LazyBlob::blocks_on_demand() const {
  std::lock_guard<std::mutex> l(mu_);
  return on_demand_;
}

}  // namespace penumbra::storage
