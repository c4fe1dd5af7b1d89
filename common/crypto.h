// Cryptographic primitives the service planes share, over OpenSSL's libcrypto
// (no OpenSSL type appears here): a CSPRNG for handles and secrets, HMAC-SHA256
// for keyed hashes and handshakes, constant-time comparison, and the cluster
// secret (a file of random bytes every internal process of a deployment holds).
//
// Handles (request ids, store readers and uploads) are 128 random bits from
// RandomHandle(): unguessable, so finding another caller's handle costs 2^127
// guesses on average. Contrast Hash128 (common/hash.h), which is XXH3: fast
// and stable, but not keyed and not collision resistant; it is a checksum,
// never a MAC.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/hash.h"
#include "common/status.h"

namespace penumbra {

// n bytes from the operating system's CSPRNG (OpenSSL RAND_bytes). CHECK-fails
// when the generator cannot be seeded (nothing is safe to hand out then).
std::string RandomBytes(size_t n);
// 128 random bits as 32 lowercase hex digits: an unguessable handle.
std::string RandomHandle();
// Lowercase hex of `bytes`.
std::string HexOf(std::string_view bytes);

using Sha256Digest = std::array<uint8_t, 32>;
Sha256Digest Sha256(std::string_view data);
// HMAC-SHA256(key, data).
Sha256Digest HmacSha256(std::string_view key, std::string_view data);
// Equal without leaking where they differ (sizes may leak).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// An incremental HMAC-SHA256 (several parts without concatenating them).
class HmacSha256Stream {
 public:
  explicit HmacSha256Stream(std::string_view key);
  ~HmacSha256Stream();
  HmacSha256Stream(const HmacSha256Stream&) = delete;
  HmacSha256Stream& operator=(const HmacSha256Stream&) = delete;
  HmacSha256Stream& Update(const void* data, size_t n);
  HmacSha256Stream& Update(std::string_view s) { return Update(s.data(), s.size()); }
  Sha256Digest Final();

 private:
  void* ctx_;
};

// The first 128 bits of an HMAC-SHA256, as a Hash128 (a keyed content key).
Hash128 TruncatedKey(const Sha256Digest& d);

// A document's content digest: the first 128 bits of the SHA-256 of its
// token ids (little-endian int32) as they stand in a prompt. The coordinator
// computes it once per document and sends it instead of the ids (a worker
// that holds the document's state needs nothing more); a worker given the
// ids too checks them against it. Collision-resistant, unkeyed: it names
// content, it grants nothing (the document cache's keys chain these digests
// with the namespace under the cluster's secret).
Hash128 DocumentDigest(const int32_t* ids, size_t n);
// A Hash128 as 16 bytes (hi big-endian, then lo) and back: the wire form.
std::string Hash128Bytes(const Hash128& h);
// InvalidArgument unless `bytes` is exactly 16 bytes.
Result<Hash128> Hash128FromBytes(std::string_view bytes);

// A deployment's shared secret: at least 32 random bytes, read from a file
// that only the service's user may read. Keys for separate purposes are
// derived from it (Derive), so one secret serves the store plane's handshake
// and the document store's keyed hashes without one use weakening another.
class ClusterSecret {
 public:
  // The file holds the secret as hex (64+ digits) or raw bytes (32+), with
  // optional surrounding whitespace. InvalidArgument naming the file when it
  // is missing, too short, or readable by group or others (mode & 077).
  static Result<ClusterSecret> Load(const std::string& path);
  // A new random secret written as hex to `path` with mode 0600 (atomically;
  // an existing file is an error unless overwrite).
  static Status Create(const std::string& path, bool overwrite = false);
  static ClusterSecret FromBytes(std::string bytes) { return ClusterSecret(std::move(bytes)); }

  // HMAC-SHA256(secret, "penumbra/" + purpose): a 32-byte key for one use.
  std::string Derive(std::string_view purpose) const;
  bool empty() const { return secret_.empty(); }

 private:
  explicit ClusterSecret(std::string s) : secret_(std::move(s)) {}
  std::string secret_;
};

}  // namespace penumbra
