#include "common/hash.h"

#include <cstdio>

#include <glog/logging.h>
#include <xxhash.h>

namespace penumbra {

uint64_t Hash64(const void* data, size_t n, uint64_t seed) { return XXH3_64bits_withSeed(data, n, seed); }

std::string Hash128::Hex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

Hash128 HashBytes128(const void* data, size_t n, uint64_t seed) {
  XXH128_hash_t h = XXH3_128bits_withSeed(data, n, seed);
  return {h.low64, h.high64};
}

Hasher128::Hasher128() : state_(XXH3_createState()) {
  CHECK(state_ != nullptr);
  XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_));
}
Hasher128::~Hasher128() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
Hasher128& Hasher128::Update(const void* data, size_t n) {
  XXH3_128bits_update(static_cast<XXH3_state_t*>(state_), data, n);
  return *this;
}
Hash128 Hasher128::Digest() const {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return {h.low64, h.high64};
}

}  // namespace penumbra
