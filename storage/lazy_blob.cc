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

LazyBlob::LazyBlob(std::shared_ptr<BlobReader> reader, std::string blob, char* dst, uint64_t size, size_t block_bytes,
                   int threads, std::function<void()> on_complete, Place place)
    : reader_(std::move(reader)),
      blob_(std::move(blob)),
      dst_(dst),
      size_(size),
      block_bytes_(std::max<size_t>(block_bytes, 1)),
      threads_(std::max(threads, 1)),
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
  std::vector<uint32_t> batch;  // blocks claimed together (one ReadMany)
  std::vector<char> scratch;    // with place_: the blocks read before they are placed
  for (;;) {
    batch.clear();
    std::shared_ptr<BlobReader> reader;
    {
      std::unique_lock<std::mutex> l(mu_);
      for (;;) {
        if (stop_ || !error_.ok() || present_ == static_cast<int64_t>(state_.size())) return;
        const size_t want = static_cast<size_t>(std::max(1, reader_ ? reader_->batch_blocks() : 1));
        // Demand first (a reader waits for it), then the restore's next blocks.
        while (!demand_.empty() && batch.size() < want) {
          const uint32_t b = demand_.front();
          demand_.pop_front();
          if (state_[b] == kAbsent) {
            state_[b] = kLoading;
            ++on_demand_;
            batch.push_back(b);
          }
        }
        while (batch.size() < want && restoring_ && cursor_ < state_.size()) {
          const uint32_t b = cursor_++;
          if (state_[b] == kAbsent) {
            state_[b] = kLoading;
            batch.push_back(b);
          }
        }
        if (!batch.empty()) break;
        work_cv_.wait(l);
      }
      reader = reader_;
    }
    std::vector<BlobReader::Piece> pieces(batch.size());
    if (place_) scratch.resize(batch.size() * block_bytes_);
    for (size_t i = 0; i < batch.size(); ++i) {
      const uint64_t off = static_cast<uint64_t>(batch[i]) * block_bytes_;
      pieces[i] = {off, std::min<uint64_t>(block_bytes_, size_ - off),
                   place_ ? scratch.data() + i * block_bytes_ : dst_ + off};
    }
    Status st = reader ? reader->ReadMany(blob_, pieces) : Status::Cancelled("lazy blob: no reader");
    reader.reset();
    if (st.ok() && place_) {
      for (const BlobReader::Piece& p : pieces) place_(p.offset, p.dst, p.length);
    }
    bool last = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (uint32_t b : batch) state_[b] = st.ok() ? kPresent : kAbsent;
      if (st.ok()) {
        present_ += static_cast<int64_t>(batch.size());
        last = present_ == static_cast<int64_t>(state_.size());
        if (last) reader_.reset();  // detaches the segment
      } else {
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
