// Content hashing (XXH3). Stable across processes and machines: used for
// content-addressed document keys and for checksums of stored bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace penumbra {

uint64_t Hash64(const void* data, size_t n, uint64_t seed = 0);
inline uint64_t Hash64(std::string_view s, uint64_t seed = 0) { return Hash64(s.data(), s.size(), seed); }

struct Hash128 {
  uint64_t lo = 0, hi = 0;
  bool operator==(const Hash128&) const = default;
  std::string Hex() const;  // 32 lowercase hex digits, hi first
};
Hash128 HashBytes128(const void* data, size_t n, uint64_t seed = 0);

// Incremental 128-bit hasher for keys built from several parts.
class Hasher128 {
 public:
  Hasher128();
  ~Hasher128();
  Hasher128(const Hasher128&) = delete;
  Hasher128& operator=(const Hasher128&) = delete;
  Hasher128& Update(const void* data, size_t n);
  Hasher128& Update(std::string_view s) { return Update(s.data(), s.size()); }
  Hash128 Digest() const;

 private:
  void* state_;
};

}  // namespace penumbra
