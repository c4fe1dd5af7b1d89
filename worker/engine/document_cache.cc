#include "worker/engine/document_cache.h"

#include <algorithm>
#include <set>
#include <thread>
#include <utility>

#include <glog/logging.h>

#include "worker/engine/op_profiler.h"  // NowSeconds

namespace penumbra {

namespace {

// Small blocks for what is read lazily.
std::map<std::string, size_t> LazyBlockBytes(const DocumentCacheOptions& o, const std::vector<std::string>& lazy) {
  std::map<std::string, size_t> block_bytes;
  if (o.lazy_reads) {
    for (const std::string& b : lazy) block_bytes[b] = o.lazy_block_bytes;
  }
  return block_bytes;
}

}  // namespace

DocumentPersistentTier::DocumentPersistentTier(storage::DocumentStore* store, const DocumentCacheOptions& options,
                                               std::vector<std::string> lazy_blobs)
    : store_(store),
      options_(options),
      lazy_blobs_(std::move(lazy_blobs)),
      writer_(std::make_unique<DocumentWriter>(store, options.queue_bytes, LazyBlockBytes(options, lazy_blobs_))) {}

StoredDocumentRead DocumentPersistentTier::Read(const Hash128& key, int64_t tokens, bool whole) const {
  StoredDocumentRead out;
  out.key = key;
  out.tokens = tokens;
  auto info = store_->Info(key);
  if (!info.ok()) {
    out.status = info.status();
    return out;
  }
  if (info->tokens != tokens) {
    out.status = Status::NotFound("prefix store: segment " + key.Hex() + " holds " + std::to_string(info->tokens) +
                                  " tokens, not " + std::to_string(tokens));
    return out;
  }
  out.present = true;
  const double t0 = NowSeconds();
  // The blobs the policy reads lazily stay in the store for now: a reader of
  // the segment (which keeps it attached) goes with the state.
  const std::vector<std::string> lazy = options_.lazy_reads && !whole ? lazy_blobs_ : std::vector<std::string>{};
  Result<std::map<std::string, std::string>> blobs = Status::Internal("prefix store: not read");
  if (lazy.empty()) {
    blobs = store_->Get(key);
  } else {
    auto layout = store_->Layout(key);
    auto opened = layout.ok() ? store_->OpenReader(key) : Result<std::shared_ptr<storage::BlobReader>>(layout.status());
    if (opened.ok()) {
      out.reader = *opened;
      // Small blobs now; the policy reads large ones from the reader itself
      // (straight into their destination).
      std::set<std::string> eager;
      for (const storage::BlobLayout& b : *layout) {
        const bool is_lazy = std::find(lazy.begin(), lazy.end(), b.name) != lazy.end();
        if (b.size <= options_.eager_blob_bytes && !is_lazy) eager.insert(b.name);
      }
      blobs = store_->Get(key, eager);
    } else {
      blobs = opened.status();
    }
  }
  out.read_seconds = NowSeconds() - t0;
  if (!blobs.ok()) {
    out.status = blobs.status();
    out.reader.reset();
    return out;
  }
  out.blobs = std::move(*blobs);
  for (const auto& [name, b] : out.blobs) out.read_bytes += static_cast<int64_t>(b.size());
  return out;
}

Status DocumentPersistentTier::EraseIfHeld(const Hash128& key) {
  Status s = store_->Info(key).status();
  if (s.ok()) s = store_->Erase(key);
  return s;
}

void DocumentPersistentTier::EraseDamaged(const Hash128& key) {
  // A lazy reader of it lets go once its reads in flight end (a failed
  // block stops it): briefly retried, so that the next capture stores it anew.
  Status erased = store_->Erase(key);
  for (int i = 0; i < 200 && erased.code() == StatusCode::kFailedPrecondition; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    erased = store_->Erase(key);
  }
  if (!erased.ok() && erased.code() != StatusCode::kNotFound) {
    LOG(WARNING) << "prefix " << key.Hex() << " not erased from the store: " << erased;
  }
}

DocumentCache::DocumentCache(const DocumentCacheOptions& options, KvPolicy* policy, std::unique_ptr<ValueTiers> tier0)
    : options_(options),
      policy_(policy),
      memory_(options.memory_bytes, options.memory_host_bytes, options.memory_low_watermark),
      tier0_(std::move(tier0)) {}

DocumentCache::~DocumentCache() = default;

void DocumentCache::SetPersistentTier(storage::DocumentStore* store, std::string model_identity) {
  persistent_.reset();  // drains writes to the previous store
  model_identity_ = std::move(model_identity);
  if (store) persistent_ = std::make_unique<DocumentPersistentTier>(store, options_, policy_->LazyBlobs());
}

std::string DocumentCache::Fence(const std::string& cache_namespace) const {
  return policy_->StateFingerprint() + "|dtype=" + options_.dtype + "|model=" + model_identity_ +
         "|namespace=" + cache_namespace +
         (shard_world_ > 1 ? "|shard=" + std::to_string(shard_rank_) + "/" + std::to_string(shard_world_) : "");
}

std::vector<Hash128> DocumentCache::Keys(const std::string& cache_namespace, const std::vector<Hash128>& digests,
                                         const std::vector<int64_t>& document_ends) const {
  return DocumentKeys(Fence(cache_namespace), digests, document_ends, options_.key_secret);
}

DocumentCache::Found DocumentCache::FindLongest(const std::vector<Hash128>& keys, const std::vector<int64_t>& ends,
                                                PrefetchedDocuments* prefetched) {
  Found out;
  for (size_t i = keys.size(); i-- > 0 && !out.state;) {
    std::shared_ptr<const KvPrefix> hit = memory_.Find(keys[i], ends[i]);
    if (hit && !hit->health().ok()) {
      DropDamaged(keys[i], hit->health());
      hit = nullptr;
    }
    if (!hit && persistent_ && !prefetched) hit = Load(keys[i], ends[i]);
    if (!hit && prefetched && prefetched->found && prefetched->found->key == keys[i] &&
        prefetched->found->tokens == ends[i]) {
      // Read off the loop thread; imported here (once: it is moved out).
      StoredDocumentRead read = std::move(*prefetched->found);
      prefetched->found.reset();
      hit = Import(std::move(read), /*queue_erase=*/true);
    }
    if (hit) {
      out.state = std::move(hit);
      out.index = i;
    }
  }
  return out;
}

std::vector<StoreLookup> DocumentCache::Lookups(const std::vector<Hash128>& keys,
                                                const std::vector<int64_t>& ends) const {
  std::vector<StoreLookup> out;
  if (!persistent_) return out;
  for (size_t i = keys.size(); i-- > 0;) {
    if (memory_.Contains(keys[i])) break;  // held in memory: no shorter one is looked up
    out.push_back({keys[i], ends[i]});
  }
  return out;
}

PrefetchedDocuments DocumentCache::Fetch(const std::vector<StoreLookup>& lookups) const {
  PrefetchedDocuments out;
  if (!persistent_) return out;
  for (const StoreLookup& l : lookups) {
    StoredDocumentRead read = persistent_->Read(l.key, l.tokens, options_.fetch_whole);
    if (read.status.ok()) {
      out.found = std::move(read);
      return out;
    }
    if (read.damaged()) {
      ++out.corruptions;
      LOG(WARNING) << "prefix store: segment " << l.key.Hex() << " dropped: " << read.status;
      persistent_->EraseQueued(l.key);
    } else if (read.status.code() == StatusCode::kUnavailable || read.status.code() == StatusCode::kDeadlineExceeded) {
      ++out.failures;
      out.last_failure = read.status;
    }
  }
  return out;
}

void DocumentCache::CountPrefetch(PrefetchedDocuments* prefetched) {
  stats_.fetch_failures += std::exchange(prefetched->failures, 0);
  stats_.store_corruptions += std::exchange(prefetched->corruptions, 0);
}

std::shared_ptr<const KvPrefix> DocumentCache::Import(StoredDocumentRead read, bool queue_erase) {
  const double t1 = NowSeconds();
  Result<std::shared_ptr<const KvPrefix>> state =
      read.reader ? policy_->ImportPrefixLazy(read.blobs, std::move(read.reader), options_.lazy_threads)
                  : policy_->ImportPrefix(read.blobs);
  read.reader.reset();
  stats_.store_read_seconds += read.read_seconds;
  stats_.import_seconds += NowSeconds() - t1;
  stats_.store_read_bytes += read.read_bytes;
  if (!state.ok()) {
    // Damaged (or, impossibly under the key's fence, foreign): never
    // attached; dropped so that this request's capture stores it anew.
    ++stats_.store_corruptions;
    LOG(WARNING) << "prefix store: segment " << read.key.Hex() << " dropped: " << state.status();
    if (persistent_) {
      if (queue_erase) {
        persistent_->EraseQueued(read.key);
      } else {
        (void)persistent_->Erase(read.key);
      }
    }
    return nullptr;
  }
  ++stats_.store_hits;
  memory_.Insert(read.key, *state);
  return *state;
}

std::shared_ptr<const KvPrefix> DocumentCache::Load(const Hash128& key, int64_t tokens) {
  StoredDocumentRead read = persistent_->Read(key, tokens, /*whole=*/false);
  if (!read.present) return nullptr;  // absent (or the store did not say)
  if (!read.status.ok()) {
    stats_.store_read_seconds += read.read_seconds;
    if (!read.damaged()) {
      ++stats_.fetch_failures;
      LOG(WARNING) << "prefix store: segment " << key.Hex() << " not read (prefilled instead): " << read.status;
      return nullptr;
    }
    ++stats_.store_corruptions;
    LOG(WARNING) << "prefix store: segment " << key.Hex() << " dropped: " << read.status;
    (void)persistent_->Erase(key);
    return nullptr;
  }
  return Import(std::move(read), /*queue_erase=*/false);
}

void DocumentCache::Capture(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
                            std::shared_ptr<const KvPrefix> state, bool pinned) {
  if (persistent_) {
    // Written in the background; a store that fails costs this request
    // nothing but the reuse after a restart.
    auto blobs = state->Export();
    if (blobs.ok()) {
      persistent_->Write(key, cache_namespace, tokens, std::move(*blobs));
    } else {
      ++stats_.store_errors;
      LOG(WARNING) << "prefix store: not exported: " << blobs.status();
    }
  }
  memory_.Insert(key, std::move(state), pinned, cache_namespace);
}

Result<int> DocumentCache::Forget(const std::vector<Hash128>& keys) {
  int dropped = 0;
  Status failed;  // the first segment the store could not look up or erase
  // A write still queued would store it again (a store that stopped
  // answering holds this up at most drain_ms).
  if (!Drain(std::chrono::milliseconds(options_.drain_ms))) {
    LOG(WARNING) << "prefix store: writes still queued after " << options_.drain_ms
                 << " ms; forgetting a document's state anyway";
  }
  for (const Hash128& key : keys) {
    if (memory_.Erase(key)) ++dropped;
    if (!persistent_) continue;
    Status s = persistent_->EraseIfHeld(key);
    if (s.ok()) {
      ++dropped;
    } else if (s.code() != StatusCode::kNotFound) {
      // Not known to be gone (a store node down, a full disk): the caller
      // must not count the document as forgotten, and asks again later.
      LOG(WARNING) << "prefix store: segment " << key.Hex() << " not erased: " << s;
      if (failed.ok()) failed = s;
    }
  }
  if (!failed.ok()) {
    return Status(failed.code(), "forgetting a document: its stored state was not erased (" + failed.message() + "); " +
                                     std::to_string(dropped) + " entries dropped so far, ask again");
  }
  return dropped;
}

void DocumentCache::DropDamaged(const Hash128& key, const Status& why) {
  ++stats_.store_corruptions;
  LOG(WARNING) << "prefix " << key.Hex() << " dropped (recomputed): " << why;
  memory_.Erase(key);
  if (persistent_) persistent_->EraseDamaged(key);
}

void DocumentCache::Place() {
  MoveStep();
  if (tier0_ && tier0_->enabled()) tier0_->Step(memory_.Prefixes());
}

void DocumentCache::MoveStep() {
  const size_t budget = policy_->ExactBudgetBytes();
  if (budget == 0 && !move_) return;
  if (move_) {
    Result<bool> done = move_->Step();
    if (!done.ok() || (*done && !move_->result())) {
      ++stats_.move_failures;
      LOG(WARNING) << "document cache: a document's move to shadowkv failed (it stays exact): " << done.status();
      move_.reset();
      move_wait_ = kMoveRetrySteps;
      return;
    }
    if (!*done) return;
    std::shared_ptr<const KvPrefix> moved = move_->result();
    const KvPrefix* from = move_->from().get();
    stats_.move_seconds += move_->seconds();
    if (memory_.Replace(move_key_, from, moved)) {
      ++stats_.moves;
      LOG(INFO) << "document cache: moved a " << moved->tokens() << "-token document from full to " << moved->policy()
                << " in " << move_->seconds() << " s";
      if (persistent_) {
        auto blobs = moved->Export();
        if (blobs.ok()) {
          persistent_->Write(move_key_, move_namespace_, moved->tokens(), std::move(*blobs));
        } else {
          ++stats_.store_errors;
          LOG(WARNING) << "prefix store: moved document not exported: " << blobs.status();
        }
      }
    }
    move_.reset();
    return;
  }
  if (move_wait_ > 0) {
    --move_wait_;
    return;
  }
  const std::vector<DocumentMemoryTier::Held> held = memory_.Entries();
  size_t exact = 0;
  ExactKv kv;
  for (const auto& e : held) {
    if (e.prefix->exact_kv(&kv)) exact += e.prefix->device_bytes();
  }
  if (exact <= budget) return;
  for (auto it = held.rbegin(); it != held.rend(); ++it) {  // least recently used first
    if (it->pinned || !it->prefix->exact_kv(&kv)) continue;
    Result<std::unique_ptr<PrefixMove>> m = policy_->BeginMove(it->prefix);
    if (!m.ok()) {
      ++stats_.move_failures;
      LOG(WARNING) << "document cache: a document's move to shadowkv could not begin: " << m.status();
      move_wait_ = kMoveRetrySteps;
      return;
    }
    move_ = std::move(*m);
    move_key_ = it->key;
    move_namespace_ = it->cache_namespace;
    return;
  }
}

bool DocumentCache::FreeDeviceFor(const Status& s) {
  // Tier 0 holds only spare device memory: a sequence or a new document
  // comes first.
  return s.code() == StatusCode::kResourceExhausted && tier0_ && tier0_->Release(SIZE_MAX) > 0;
}

DocumentCacheStats DocumentCache::stats() const {
  DocumentCacheStats s = stats_;
  if (tier0_) s.tiers = tier0_->stats();
  s.by_policy = memory_.ByPolicy();
  if (persistent_) {
    const DocumentWriter& w = persistent_->writer();
    s.store_errors += w.errors();
    s.stores = w.stored();
    s.store_skipped = w.skipped();
    s.store_write_seconds = w.write_seconds();
  }
  return s;
}

}  // namespace penumbra
