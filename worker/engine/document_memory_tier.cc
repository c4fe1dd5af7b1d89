#include "worker/engine/document_memory_tier.h"

#include <algorithm>

#include <glog/logging.h>

namespace penumbra {

std::shared_ptr<const KvPrefix> DocumentMemoryTier::Find(const Hash128& key, int64_t tokens) {
  auto it = index_.find(Key(key));
  if (it == index_.end() || it->second->prefix->tokens() != tokens) {
    ++stats_.misses;
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second);
  ++stats_.hits;
  return it->second->prefix;
}

void DocumentMemoryTier::MakeRoom(size_t need, size_t host_need, double fraction) {
  // What may be held after the insert: the scaled capacity, but at least the
  // new entry (a large one does not empty the cache below it).
  auto target = [fraction](size_t cap, size_t n) {
    return cap == SIZE_MAX ? cap : std::max(n, static_cast<size_t>(static_cast<double>(cap) * fraction));
  };
  const size_t cap = target(capacity_bytes_, need), host_cap = target(host_capacity_bytes_, host_need);
  for (auto it = lru_.end(); it != lru_.begin() && (bytes_ + need > cap || host_bytes_ + host_need > host_cap);) {
    --it;
    if (it->prefix.use_count() > 1) continue;  // a live sequence holds it
    bytes_ -= it->prefix->device_bytes();
    host_bytes_ -= it->prefix->host_bytes();
    index_.erase(it->key);
    it = lru_.erase(it);
    ++stats_.evictions;
  }
}

std::vector<std::shared_ptr<const KvPrefix>> DocumentMemoryTier::Prefixes() const {
  std::vector<std::shared_ptr<const KvPrefix>> out;
  for (const Entry& e : lru_) out.push_back(e.prefix);
  return out;
}

void DocumentMemoryTier::Clear() {
  for (auto it = lru_.begin(); it != lru_.end();) {
    if (it->prefix.use_count() > 1) {
      ++it;
      continue;
    }
    bytes_ -= it->prefix->device_bytes();
    host_bytes_ -= it->prefix->host_bytes();
    index_.erase(it->key);
    it = lru_.erase(it);
  }
}

bool DocumentMemoryTier::Insert(const Hash128& key, std::shared_ptr<const KvPrefix> prefix, bool pinned,
                                std::string cache_namespace) {
  if (index_.count(Key(key))) return true;
  const size_t need = prefix->device_bytes(), host_need = prefix->host_bytes();
  if (need > capacity_bytes_ || host_need > host_capacity_bytes_) return false;
  if (bytes_ + need > capacity_bytes_ || host_bytes_ + host_need > host_capacity_bytes_) {
    MakeRoom(need, host_need, low_watermark_);
  }
  if (bytes_ + need > capacity_bytes_ || host_bytes_ + host_need > host_capacity_bytes_) return false;
  lru_.push_front(Entry{Key(key), std::move(prefix), pinned, std::move(cache_namespace)});
  index_[Key(key)] = lru_.begin();
  bytes_ += need;
  host_bytes_ += host_need;
  ++stats_.inserts;
  return true;
}

bool DocumentMemoryTier::Replace(const Hash128& key, const KvPrefix* expected, std::shared_ptr<const KvPrefix> prefix) {
  auto it = index_.find(Key(key));
  if (it == index_.end() || it->second->prefix.get() != expected) return false;
  Entry& e = *it->second;
  bytes_ -= e.prefix->device_bytes();
  host_bytes_ -= e.prefix->host_bytes();
  e.prefix = prefix;  // `prefix` still held here: MakeRoom does not evict it
  bytes_ += e.prefix->device_bytes();
  host_bytes_ += e.prefix->host_bytes();
  if (bytes_ > capacity_bytes_ || host_bytes_ > host_capacity_bytes_) MakeRoom(0, 0, low_watermark_);
  return true;
}

std::vector<DocumentMemoryTier::Held> DocumentMemoryTier::Entries() const {
  std::vector<Held> out;
  for (const Entry& e : lru_)
    out.push_back(Held{Hash128{e.key.second, e.key.first}, e.prefix, e.pinned, e.cache_namespace});
  return out;
}

std::map<std::string, DocumentFormUsage> DocumentMemoryTier::ByPolicy() const {
  std::map<std::string, DocumentFormUsage> out;
  for (const Entry& e : lru_) {
    DocumentFormUsage& u = out[e.prefix->policy()];
    ++u.documents;
    u.device_bytes += e.prefix->device_bytes();
    u.host_bytes += e.prefix->host_bytes();
  }
  return out;
}

bool DocumentMemoryTier::Erase(const Hash128& key) {
  auto it = index_.find(Key(key));
  if (it == index_.end()) return false;
  bytes_ -= it->second->prefix->device_bytes();
  host_bytes_ -= it->second->prefix->host_bytes();
  lru_.erase(it->second);
  index_.erase(it);
  return true;
}

}  // namespace penumbra
