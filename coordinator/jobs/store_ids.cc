#include "coordinator/jobs/store_ids.h"

#include <chrono>

namespace penumbra::jobs {
namespace {

constexpr uint64_t kMix1 = 0xff51afd7ed558ccdULL;
constexpr uint64_t kMix2 = 0xc4ceb9fe1a85ec53ULL;
constexpr uint64_t InverseOdd(uint64_t c) {
  uint64_t x = c;  // Newton's iteration mod 2^64: correct bits double each step
  for (int i = 0; i < 6; ++i) x *= 2 - c * x;
  return x;
}
static_assert(kMix1 * InverseOdd(kMix1) == 1 && kMix2 * InverseOdd(kMix2) == 1);
uint64_t Mix(uint64_t k) {
  k ^= k >> 33;
  k *= kMix1;
  k ^= k >> 33;
  k *= kMix2;
  k ^= k >> 33;
  return k;
}
uint64_t Unmix(uint64_t k) {
  k ^= k >> 33;  // x ^= x >> 33 is its own inverse on 64 bits
  k *= InverseOdd(kMix2);
  k ^= k >> 33;
  k *= InverseOdd(kMix1);
  k ^= k >> 33;
  return k;
}

}  // namespace

std::string MakeStoreId(std::string_view prefix, uint64_t seq, uint64_t salt) {
  static const char kHex[] = "0123456789abcdef";
  const uint64_t x = Mix(seq ^ salt);
  std::string id(prefix);
  for (int i = static_cast<int>(kStoreIdHexDigits) - 1; i >= 0; --i) id.push_back(kHex[(x >> (4 * i)) & 0xf]);
  return id;
}

bool StoreIdSeq(std::string_view prefix, std::string_view id, uint64_t salt, uint64_t* seq) {
  if (id.size() != prefix.size() + kStoreIdHexDigits || id.substr(0, prefix.size()) != prefix) return false;
  uint64_t x = 0;
  for (char c : id.substr(prefix.size())) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    x = (x << 4) | static_cast<uint64_t>(d);
  }
  *seq = Unmix(x) ^ salt;
  return true;
}

std::string Quoted(std::string_view name) {
  return "'" + std::string(name.substr(0, 64)) + (name.size() > 64 ? "...'" : "'");
}

int64_t WallClockSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace penumbra::jobs
