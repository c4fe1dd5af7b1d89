#include "common/crypto.h"

#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cctype>
#include <cstring>

#include <glog/logging.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include "common/file.h"
#include "common/process.h"

namespace penumbra {

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (n > 0) {
    CHECK_EQ(RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)), 1)
        << "the operating system's random generator failed";
  }
  return out;
}

std::string HexOf(std::string_view bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::string RandomHandle() { return HexOf(RandomBytes(16)); }

Sha256Digest Sha256(std::string_view data) {
  Sha256Digest d;
  CHECK(EVP_Digest(data.data(), data.size(), d.data(), nullptr, EVP_sha256(), nullptr) == 1);
  return d;
}

Sha256Digest HmacSha256(std::string_view key, std::string_view data) {
  HmacSha256Stream h(key);
  h.Update(data);
  return h.Final();
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  return a.empty() || CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// HMAC through the EVP_MAC interface (OpenSSL 3).
HmacSha256Stream::HmacSha256Stream(std::string_view key) {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  CHECK(mac != nullptr) << "OpenSSL has no HMAC";
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(mac);
  EVP_MAC_free(mac);
  CHECK(ctx != nullptr);
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0), OSSL_PARAM_construct_end()};
  // An empty key is valid HMAC; OpenSSL wants a non-null pointer for it.
  static const unsigned char kEmpty = 0;
  CHECK(EVP_MAC_init(ctx, key.empty() ? &kEmpty : reinterpret_cast<const unsigned char*>(key.data()), key.size(),
                     params) == 1);
  ctx_ = ctx;
}

HmacSha256Stream::~HmacSha256Stream() { EVP_MAC_CTX_free(static_cast<EVP_MAC_CTX*>(ctx_)); }

HmacSha256Stream& HmacSha256Stream::Update(const void* data, size_t n) {
  if (n > 0) CHECK(EVP_MAC_update(static_cast<EVP_MAC_CTX*>(ctx_), static_cast<const unsigned char*>(data), n) == 1);
  return *this;
}

Sha256Digest HmacSha256Stream::Final() {
  Sha256Digest d;
  size_t len = 0;
  CHECK(EVP_MAC_final(static_cast<EVP_MAC_CTX*>(ctx_), d.data(), &len, d.size()) == 1 && len == d.size());
  return d;
}

Hash128 TruncatedKey(const Sha256Digest& d) {
  Hash128 h;
  std::memcpy(&h.hi, d.data(), 8);
  std::memcpy(&h.lo, d.data() + 8, 8);
  return h;
}

Hash128 DocumentDigest(const int32_t* ids, size_t n) {
  static_assert(std::endian::native == std::endian::little, "token ids are hashed as little-endian int32");
  return TruncatedKey(Sha256(std::string_view(reinterpret_cast<const char*>(ids), n * sizeof(int32_t))));
}

std::string Hash128Bytes(const Hash128& h) {
  std::string out(16, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(h.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(h.lo >> (56 - 8 * i));
  }
  return out;
}

Result<Hash128> Hash128FromBytes(std::string_view bytes) {
  if (bytes.size() != 16) {
    return Status::InvalidArgument("a digest is 16 bytes, got " + std::to_string(bytes.size()));
  }
  Hash128 h;
  for (int i = 0; i < 8; ++i) {
    h.hi = (h.hi << 8) | static_cast<uint8_t>(bytes[i]);
    h.lo = (h.lo << 8) | static_cast<uint8_t>(bytes[8 + i]);
  }
  return h;
}

namespace {

bool IsHex(std::string_view s) {
  if (s.empty() || s.size() % 2 != 0) return false;
  for (char c : s) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

std::string FromHex(std::string_view s) {
  std::string out(s.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>(std::stoi(std::string(s.substr(2 * i, 2)), nullptr, 16));
  }
  return out;
}

}  // namespace

Result<ClusterSecret> ClusterSecret::Load(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::InvalidArgument("cluster secret " + path + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 077) != 0) {
    return Status::InvalidArgument("cluster secret " + path + " is readable by group or others (mode " + [&] {
      char b[8];
      std::snprintf(b, sizeof b, "%03o", st.st_mode & 0777);
      return std::string(b);
    }() + "): chmod 600 it");
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::string raw, ReadFileToString(path));
  std::string_view s = raw;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  std::string bytes = IsHex(s) ? FromHex(s) : std::string(raw);
  if (bytes.size() < 32) {
    return Status::InvalidArgument("cluster secret " + path + " holds " + std::to_string(bytes.size()) +
                                   " bytes; at least 32 random bytes are needed (penumbra cert init makes one)");
  }
  return ClusterSecret(std::move(bytes));
}

Status ClusterSecret::Create(const std::string& path, bool overwrite) {
  if (!overwrite && FileExists(path)) return Status::InvalidArgument(path + " exists; not overwritten");
  return WriteFileAtomically(path, HexOf(RandomBytes(32)) + "\n", 0600);
}

std::string ClusterSecret::Derive(std::string_view purpose) const {
  const Sha256Digest d = HmacSha256(secret_, "penumbra/" + std::string(purpose));
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace penumbra
