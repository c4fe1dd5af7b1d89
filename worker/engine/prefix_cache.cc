#include "worker/engine/prefix_cache.h"

#include <algorithm>

#include <glog/logging.h>

#include "common/crypto.h"

namespace penumbra {

namespace {

// The keyed chain: the same structure as the XXH3 one, each link an
// HMAC-SHA256 under the secret.
std::vector<Hash128> KeyedPrefixKeys(const std::string& fence, const std::vector<int32_t>& prompt,
                                     const std::vector<int64_t>& document_ends, std::string_view secret) {
  std::vector<Hash128> keys;
  keys.reserve(document_ends.size());
  Hash128 prev = TruncatedKey(HmacSha256Stream(secret).Update("penumbra-prefix-keyed-v1\n").Update(fence).Final());
  int64_t begin = 0;
  for (int64_t end : document_ends) {
    CHECK(end > begin && end <= static_cast<int64_t>(prompt.size())) << "document ends must ascend within the prompt";
    const int64_t n = end - begin;
    HmacSha256Stream h(secret);
    h.Update(&prev, sizeof(prev)).Update(&n, sizeof(n)).Update(prompt.data() + begin, n * sizeof(int32_t));
    prev = TruncatedKey(h.Final());
    keys.push_back(prev);
    begin = end;
  }
  return keys;
}

}  // namespace

std::vector<Hash128> PrefixKeys(const std::string& fence, const std::vector<int32_t>& prompt,
                                const std::vector<int64_t>& document_ends, std::string_view secret) {
  if (!secret.empty()) return KeyedPrefixKeys(fence, prompt, document_ends, secret);
  std::vector<Hash128> keys;
  keys.reserve(document_ends.size());
  Hash128 prev;
  {
    Hasher128 h;
    h.Update("penumbra-prefix-v1\n").Update(fence);
    prev = h.Digest();
  }
  int64_t begin = 0;
  for (int64_t end : document_ends) {
    CHECK(end > begin && end <= static_cast<int64_t>(prompt.size())) << "document ends must ascend within the prompt";
    Hasher128 h;
    const int64_t n = end - begin;
    h.Update(&prev, sizeof(prev)).Update(&n, sizeof(n)).Update(prompt.data() + begin, n * sizeof(int32_t));
    prev = h.Digest();
    keys.push_back(prev);
    begin = end;
  }
  return keys;
}

std::shared_ptr<const KvPrefix> PrefixCache::Find(const Hash128& key, int64_t tokens) {
  auto it = index_.find(Key(key));
  if (it == index_.end() || it->second->prefix->tokens() != tokens) {
    ++stats_.misses;
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second);
  ++stats_.hits;
  return it->second->prefix;
}

void PrefixCache::MakeRoom(size_t need, size_t host_need, double fraction) {
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

std::vector<std::shared_ptr<const KvPrefix>> PrefixCache::Prefixes() const {
  std::vector<std::shared_ptr<const KvPrefix>> out;
  for (const Entry& e : lru_) out.push_back(e.prefix);
  return out;
}

void PrefixCache::Clear() {
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

bool PrefixCache::Insert(const Hash128& key, std::shared_ptr<const KvPrefix> prefix) {
  if (index_.count(Key(key))) return true;
  const size_t need = prefix->device_bytes(), host_need = prefix->host_bytes();
  if (need > capacity_bytes_ || host_need > host_capacity_bytes_) return false;
  if (bytes_ + need > capacity_bytes_ || host_bytes_ + host_need > host_capacity_bytes_) {
    MakeRoom(need, host_need, low_watermark_);
  }
  if (bytes_ + need > capacity_bytes_ || host_bytes_ + host_need > host_capacity_bytes_) return false;
  lru_.push_front(Entry{Key(key), std::move(prefix)});
  index_[Key(key)] = lru_.begin();
  bytes_ += need;
  host_bytes_ += host_need;
  ++stats_.inserts;
  return true;
}

bool PrefixCache::Erase(const Hash128& key) {
  auto it = index_.find(Key(key));
  if (it == index_.end()) return false;
  bytes_ -= it->second->prefix->device_bytes();
  host_bytes_ -= it->second->prefix->host_bytes();
  lru_.erase(it->second);
  index_.erase(it);
  return true;
}

}  // namespace penumbra
