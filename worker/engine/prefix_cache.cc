#include "worker/engine/prefix_cache.h"

#include <algorithm>

#include <glog/logging.h>

#include "common/crypto.h"

namespace penumbra {

std::vector<Hash128> DocumentKeys(const std::string& fence, const std::vector<Hash128>& digests,
                                  const std::vector<int64_t>& document_ends, std::string_view secret) {
  CHECK_EQ(digests.size(), document_ends.size()) << "one digest per document";
  std::vector<Hash128> keys;
  keys.reserve(document_ends.size());
  Hash128 prev = TruncatedKey(HmacSha256Stream(secret).Update("penumbra-document-keys-v2\n").Update(fence).Final());
  int64_t begin = 0;
  for (size_t i = 0; i < document_ends.size(); ++i) {
    const int64_t end = document_ends[i];
    CHECK(end > begin) << "document ends must ascend";
    const int64_t n = end - begin;
    HmacSha256Stream h(secret);
    h.Update(&prev, sizeof(prev)).Update(&n, sizeof(n)).Update(&digests[i], sizeof(Hash128));
    prev = TruncatedKey(h.Final());
    keys.push_back(prev);
    begin = end;
  }
  return keys;
}

std::vector<Hash128> PrefixKeys(const std::string& fence, const std::vector<int32_t>& prompt,
                                const std::vector<int64_t>& document_ends, std::string_view secret) {
  return DocumentKeys(fence, DocumentDigests(prompt, document_ends), document_ends, secret);
}

std::vector<Hash128> DocumentDigests(const std::vector<int32_t>& prompt, const std::vector<int64_t>& document_ends) {
  std::vector<Hash128> out;
  out.reserve(document_ends.size());
  int64_t begin = 0;
  for (int64_t end : document_ends) {
    CHECK(end > begin && end <= static_cast<int64_t>(prompt.size())) << "document ends must ascend within the prompt";
    out.push_back(DocumentDigest(prompt.data() + begin, static_cast<size_t>(end - begin)));
    begin = end;
  }
  return out;
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
