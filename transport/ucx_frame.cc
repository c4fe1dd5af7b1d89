#include "transport/ucx_frame.h"

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>

#include <glog/logging.h>
#include <xxhash.h>

#include "common/crypto.h"
#include "common/hash.h"

namespace penumbra::transport::ucx_frame {
namespace {

constexpr uint16_t kFlagSealed = 1;
constexpr uint8_t kHelloVersion = 1;

void Put16(char* p, uint16_t v) { std::memcpy(p, &v, 2); }
void Put32(char* p, uint32_t v) { std::memcpy(p, &v, 4); }
void Put64(char* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint16_t Get16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
uint32_t Get32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t Get64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

std::string Bytes(const Sha256Digest& d, size_t n = 32) {
  return std::string(reinterpret_cast<const char*>(d.data()), n);
}

// The GCM nonce of frame `seq` of a direction: the direction, then seq.
std::array<unsigned char, 12> Nonce(uint32_t direction, uint64_t seq) {
  std::array<unsigned char, 12> n{};
  std::memcpy(n.data(), &direction, 4);
  std::memcpy(n.data() + 4, &seq, 8);
  return n;
}

}  // namespace

// One direction's keys made ready once (an HMAC context keyed, AES key
// schedules expanded); each frame copies them (thread-safe: the templates
// are only read).
class FrameCrypto {
 public:
  explicit FrameCrypto(const DirectionKeys& k) : direction_(k.direction) {
    CHECK_EQ(k.header_key.size(), 32u);
    CHECK_EQ(k.body_key.size(), 32u);
    EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    CHECK(mac != nullptr) << "OpenSSL has no HMAC";
    mac_ = EVP_MAC_CTX_new(mac);
    EVP_MAC_free(mac);
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0), OSSL_PARAM_construct_end()};
    CHECK(mac_ != nullptr && EVP_MAC_init(mac_, reinterpret_cast<const unsigned char*>(k.header_key.data()),
                                          k.header_key.size(), params) == 1);
    const auto* key = reinterpret_cast<const unsigned char*>(k.body_key.data());
    enc_ = EVP_CIPHER_CTX_new();
    dec_ = EVP_CIPHER_CTX_new();
    CHECK(enc_ != nullptr && EVP_EncryptInit_ex(enc_, EVP_aes_256_gcm(), nullptr, key, nullptr) == 1);
    CHECK(dec_ != nullptr && EVP_DecryptInit_ex(dec_, EVP_aes_256_gcm(), nullptr, key, nullptr) == 1);
  }
  ~FrameCrypto() {
    EVP_MAC_CTX_free(mac_);
    EVP_CIPHER_CTX_free(enc_);
    EVP_CIPHER_CTX_free(dec_);
  }
  FrameCrypto(const FrameCrypto&) = delete;
  FrameCrypto& operator=(const FrameCrypto&) = delete;

  // HMAC-SHA256 of the signed header bytes, its first kMacBytes.
  std::string Mac(std::string_view signed_bytes) const {
    EVP_MAC_CTX* ctx = EVP_MAC_CTX_dup(mac_);
    CHECK(ctx != nullptr);
    unsigned char d[32];
    size_t n = 0;
    CHECK(EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(signed_bytes.data()), signed_bytes.size()) == 1 &&
          EVP_MAC_final(ctx, d, &n, sizeof d) == 1 && n == sizeof d);
    EVP_MAC_CTX_free(ctx);
    return std::string(reinterpret_cast<const char*>(d), kMacBytes);
  }

  // Encrypts *data in place with AES-256-GCM and appends the tag.
  void Seal(uint64_t seq, std::string_view aad, std::string* data) const {
    Ctx c;
    const auto nonce = Nonce(direction_, seq);
    CHECK(c.ctx != nullptr && EVP_CIPHER_CTX_copy(c.ctx, enc_) == 1 &&
          EVP_EncryptInit_ex(c.ctx, nullptr, nullptr, nullptr, nonce.data()) == 1);
    int n = 0;
    CHECK(EVP_EncryptUpdate(c.ctx, nullptr, &n, reinterpret_cast<const unsigned char*>(aad.data()),
                            static_cast<int>(aad.size())) == 1);
    auto* p = reinterpret_cast<unsigned char*>(data->data());
    for (size_t at = 0; at < data->size();) {
      const int chunk = static_cast<int>(std::min<size_t>(data->size() - at, size_t{1} << 30));
      CHECK(EVP_EncryptUpdate(c.ctx, p + at, &n, p + at, chunk) == 1 && n == chunk);
      at += static_cast<size_t>(chunk);
    }
    unsigned char tail[16];
    CHECK(EVP_EncryptFinal_ex(c.ctx, tail, &n) == 1 && n == 0);
    unsigned char tag[kTagBytes];
    CHECK(EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag) == 1);
    data->append(reinterpret_cast<const char*>(tag), kTagBytes);
  }

  // Decrypts *data (ciphertext, then the tag) in place; false when the tag
  // does not verify (then *data holds nothing to use).
  bool Open(uint64_t seq, std::string_view aad, std::string* data) const {
    if (data->size() < kTagBytes) return false;
    const size_t n_text = data->size() - kTagBytes;
    const std::string tag = data->substr(n_text);
    const BodyPart text{data->data(), n_text};
    if (!OpenParts(seq, aad, std::span<const BodyPart>(&text, 1), tag)) return false;
    data->resize(n_text);
    return true;
  }

  // Decrypts `parts` (the ciphertext, in order) in place and verifies `tag`;
  // false when it does not verify.
  bool OpenParts(uint64_t seq, std::string_view aad, std::span<const BodyPart> parts, std::string_view tag) const {
    if (tag.size() != kTagBytes) return false;
    Ctx c;
    const auto nonce = Nonce(direction_, seq);
    if (c.ctx == nullptr || EVP_CIPHER_CTX_copy(c.ctx, dec_) != 1 ||
        EVP_DecryptInit_ex(c.ctx, nullptr, nullptr, nullptr, nonce.data()) != 1) {
      return false;
    }
    int n = 0;
    if (EVP_DecryptUpdate(c.ctx, nullptr, &n, reinterpret_cast<const unsigned char*>(aad.data()),
                          static_cast<int>(aad.size())) != 1) {
      return false;
    }
    for (const BodyPart& part : parts) {
      auto* p = reinterpret_cast<unsigned char*>(part.data);
      for (size_t at = 0; at < part.size;) {
        const int chunk = static_cast<int>(std::min<size_t>(part.size - at, size_t{1} << 30));
        if (EVP_DecryptUpdate(c.ctx, p + at, &n, p + at, chunk) != 1 || n != chunk) return false;
        at += static_cast<size_t>(chunk);
      }
    }
    unsigned char t[kTagBytes];
    std::memcpy(t, tag.data(), kTagBytes);
    if (EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_SET_TAG, kTagBytes, t) != 1) return false;
    unsigned char tail[16];
    return EVP_DecryptFinal_ex(c.ctx, tail, &n) == 1;
  }

 private:
  struct Ctx {
    EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
    ~Ctx() { EVP_CIPHER_CTX_free(ctx); }
  };
  uint32_t direction_;
  EVP_MAC_CTX* mac_ = nullptr;
  EVP_CIPHER_CTX *enc_ = nullptr, *dec_ = nullptr;
};

namespace {

Status Refuse(Refusal* why, Refusal r, const std::string& message) {
  if (why != nullptr) *why = r;
  switch (r) {
    case Refusal::kBadMac:
    case Refusal::kReplay:
      return Status::PermissionDenied("ucx frame: " + message);
    case Refusal::kTooLarge:
      return Status::ResourceExhausted("ucx frame: " + message);
    case Refusal::kStale:
      return Status::Unavailable("ucx frame: " + message);
    default:
      return Status::Corruption("ucx frame: " + message);
  }
}

// Printable ASCII of at most 160 bytes of a peer's text (for messages).
std::string Sanitized(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 160)) out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  return out;
}

}  // namespace

const char* FrameTypeName(FrameType t) {
  switch (t) {
    case FrameType::kHello:
      return "HELLO";
    case FrameType::kChallenge:
      return "CHALLENGE";
    case FrameType::kAuth:
      return "AUTH";
    case FrameType::kReady:
      return "READY";
    case FrameType::kRefused:
      return "REFUSED";
    case FrameType::kRequest:
      return "REQUEST";
    case FrameType::kReply:
      return "REPLY";
  }
  return "?";
}

bool IsHandshake(FrameType t) { return t >= FrameType::kHello && t <= FrameType::kRefused; }

const char* RefusalName(Refusal r) {
  switch (r) {
    case Refusal::kNone:
      return "none";
    case Refusal::kMalformed:
      return "malformed";
    case Refusal::kBadMac:
      return "bad MAC";
    case Refusal::kTooLarge:
      return "too large";
    case Refusal::kReplay:
      return "replay";
    case Refusal::kStale:
      return "stale";
  }
  return "?";
}

std::string EncodeHeader(const FrameHeader& h) {
  std::string s(kHeaderBytes, '\0');
  char* p = s.data();
  Put32(p, kMagic);
  p[4] = static_cast<char>(kVersion);
  p[5] = static_cast<char>(h.type);
  Put16(p + 6, h.sealed ? kFlagSealed : 0);
  Put64(p + 8, h.seq);
  Put64(p + 16, h.call_id);
  Put32(p + 24, static_cast<uint32_t>(h.code));
  Put32(p + 28, 0);
  Put64(p + 32, h.body_bytes);
  Put64(p + 40, h.checksum);
  return s;
}

Refusal ReplayWindow::Admit(uint64_t seq) {
  if (seq == 0) return Refusal::kReplay;
  if (seq > highest_) {
    const uint64_t shift = seq - highest_;
    if (shift >= kReplayWindow) {
      seen_.reset();
    } else {
      for (uint64_t s = highest_ + 1; s <= seq; ++s) seen_.reset(s % kReplayWindow);
    }
    highest_ = seq;
    seen_.set(seq % kReplayWindow);
    return Refusal::kNone;
  }
  if (highest_ - seq >= kReplayWindow) return Refusal::kStale;
  if (seen_.test(seq % kReplayWindow)) return Refusal::kReplay;
  seen_.set(seq % kReplayWindow);
  return Refusal::kNone;
}

FrameSealer::FrameSealer(std::shared_ptr<const DirectionKeys> keys)
    : crypto_(keys ? std::make_shared<const FrameCrypto>(*keys) : nullptr) {}

FrameOpener::FrameOpener(std::shared_ptr<const DirectionKeys> keys, size_t max_body)
    : crypto_(keys ? std::make_shared<const FrameCrypto>(*keys) : nullptr), max_body_(max_body) {}

std::string FrameSealer::Seal(FrameHeader h, std::string* body) {
  h.sealed = crypto_ != nullptr;
  if (!h.sealed) {
    h.seq = 0;
    h.body_bytes = body->size();
    h.checksum = Hash64(*body);
    return EncodeHeader(h);
  }
  h.seq = next_seq_.fetch_add(1);
  CHECK(h.seq != 0) << "ucx frame: a sealed direction's counter wrapped";
  h.checksum = 0;
  h.body_bytes = body->size() + kTagBytes;
  std::string header = EncodeHeader(h);
  const std::string_view signed_bytes(header.data(), kSignedHeaderBytes);
  crypto_->Seal(h.seq, signed_bytes, body);
  const std::string mac = crypto_->Mac(signed_bytes);
  std::memcpy(header.data() + kSignedHeaderBytes, mac.data(), kMacBytes);
  return header;
}

Result<FrameHeader> FrameOpener::Check(std::string_view header, size_t announced_body, Refusal* why) {
  if (why != nullptr) *why = Refusal::kNone;
  if (header.size() != kHeaderBytes) {
    return Refuse(why, Refusal::kMalformed,
                  "a header of " + std::to_string(header.size()) + " bytes, expected " + std::to_string(kHeaderBytes));
  }
  const char* p = header.data();
  const std::string_view signed_bytes(p, kSignedHeaderBytes);
  const std::string_view mac(p + kSignedHeaderBytes, kMacBytes);
  if (crypto_ != nullptr) {
    // Nothing in the header is read before its MAC verifies.
    if (!ConstantTimeEquals(mac, crypto_->Mac(signed_bytes))) {
      return Refuse(why, Refusal::kBadMac, "a header whose MAC does not verify");
    }
  } else if (mac.find_first_not_of('\0') != std::string_view::npos) {
    return Refuse(why, Refusal::kMalformed, "a plain header with a MAC");
  }
  if (Get32(p) != kMagic) return Refuse(why, Refusal::kMalformed, "bad magic");
  if (static_cast<uint8_t>(p[4]) != kVersion) {
    return Refuse(why, Refusal::kMalformed, "version " + std::to_string(static_cast<uint8_t>(p[4])));
  }
  const auto type = static_cast<uint8_t>(p[5]);
  if (type < static_cast<uint8_t>(FrameType::kHello) || type > static_cast<uint8_t>(FrameType::kReply)) {
    return Refuse(why, Refusal::kMalformed, "frame type " + std::to_string(type));
  }
  const uint16_t flags = Get16(p + 6);
  if ((flags & ~kFlagSealed) != 0 || Get32(p + 28) != 0) {
    return Refuse(why, Refusal::kMalformed, "unknown flags or reserved bits");
  }
  FrameHeader h;
  h.type = static_cast<FrameType>(type);
  h.sealed = (flags & kFlagSealed) != 0;
  h.seq = Get64(p + 8);
  h.call_id = Get64(p + 16);
  h.code = static_cast<int32_t>(Get32(p + 24));
  h.body_bytes = Get64(p + 32);
  h.checksum = Get64(p + 40);
  if (h.sealed != (crypto_ != nullptr)) {
    return Refuse(why, crypto_ ? Refusal::kBadMac : Refusal::kMalformed,
                  crypto_ ? "a plain frame on a sealed connection" : "a sealed frame on a plain connection");
  }
  if (h.body_bytes > max_body_) {
    return Refuse(why, Refusal::kTooLarge,
                  "a body of " + std::to_string(h.body_bytes) + " bytes (at most " + std::to_string(max_body_) + ")");
  }
  if (h.body_bytes != announced_body) {
    return Refuse(why, Refusal::kMalformed,
                  "the header says " + std::to_string(h.body_bytes) + " body bytes, the message holds " +
                      std::to_string(announced_body));
  }
  if (h.sealed) {
    if (h.body_bytes < kTagBytes || h.checksum != 0) {
      return Refuse(why, Refusal::kMalformed, "a sealed body without its tag");
    }
    const Refusal r = window_.Admit(h.seq);
    if (r == Refusal::kReplay) return Refuse(why, r, "seq " + std::to_string(h.seq) + " seen already");
    if (r == Refusal::kStale) {
      return Refuse(why, r,
                    "seq " + std::to_string(h.seq) + " is older than the replay window (highest " +
                        std::to_string(window_.highest()) + ")");
    }
  } else if (h.seq != 0) {
    return Refuse(why, Refusal::kMalformed, "a plain frame with a seq");
  }
  return h;
}

Result<std::string> FrameOpener::Open(const FrameHeader& h, std::string body) const {
  if (body.size() != h.body_bytes) {
    return Status::Corruption("ucx frame: a body of " + std::to_string(body.size()) + " bytes, its header says " +
                              std::to_string(h.body_bytes));
  }
  if (h.sealed != (crypto_ != nullptr)) return Status::Corruption("ucx frame: sealed and plain mixed");
  if (!h.sealed) {
    if (Hash64(body) != h.checksum) return Status::Corruption("ucx frame: a body's checksum does not match");
    return body;
  }
  const std::string header = EncodeHeader(h);
  if (!crypto_->Open(h.seq, std::string_view(header.data(), kSignedHeaderBytes), &body)) {
    return Status::Corruption("ucx frame: a sealed body does not verify (tampered, or not from the peer)");
  }
  return body;
}

Status FrameOpener::OpenInPlace(const FrameHeader& h, std::span<const BodyPart> parts, std::string_view tag) const {
  uint64_t total = tag.size();
  for (const BodyPart& p : parts) total += p.size;
  if (total != h.body_bytes) {
    return Status::Corruption("ucx frame: a body of " + std::to_string(total) + " bytes, its header says " +
                              std::to_string(h.body_bytes));
  }
  if (h.sealed != (crypto_ != nullptr)) return Status::Corruption("ucx frame: sealed and plain mixed");
  if (!h.sealed) {
    if (!tag.empty()) return Status::Corruption("ucx frame: a plain body with a tag");
    // XXH3-64 (seed 0) over the parts, as Hash64 over them together.
    XXH3_state_t* state = XXH3_createState();
    if (state == nullptr) return Status::ResourceExhausted("ucx frame: no memory for a checksum");
    XXH3_64bits_reset(state);
    for (const BodyPart& p : parts) XXH3_64bits_update(state, p.data, p.size);
    const uint64_t sum = XXH3_64bits_digest(state);
    XXH3_freeState(state);
    if (sum != h.checksum) return Status::Corruption("ucx frame: a body's checksum does not match");
    return Status::OK();
  }
  const std::string header = EncodeHeader(h);
  if (!crypto_->OpenParts(h.seq, std::string_view(header.data(), kSignedHeaderBytes), parts, tag)) {
    return Status::Corruption("ucx frame: a sealed body does not verify (tampered, or not from the peer)");
  }
  return Status::OK();
}

std::string HandshakeHeader(FrameType type, std::string_view body) {
  FrameHeader h;
  h.type = type;
  h.body_bytes = body.size();
  h.checksum = Hash64(body);
  return EncodeHeader(h);
}

Result<FrameHeader> CheckHandshake(std::string_view header, std::string_view body, size_t announced_body,
                                   Refusal* why) {
  FrameOpener plain(nullptr, kMaxHandshakeBody);
  PENUMBRA_ASSIGN_OR_RETURN(FrameHeader h, plain.Check(header, announced_body, why));
  if (!IsHandshake(h.type)) {
    return Refuse(why, Refusal::kMalformed, std::string("a ") + FrameTypeName(h.type) + " frame in a handshake");
  }
  if (h.call_id != 0 || h.code != 0 || body.size() != h.body_bytes || Hash64(body) != h.checksum) {
    return Refuse(why, Refusal::kMalformed, "a handshake frame's fields or checksum do not match");
  }
  return h;
}

std::string EncodeHello(const Hello& h) {
  std::string s;
  s.push_back(static_cast<char>(kHelloVersion));
  s.push_back(h.sealed ? 1 : 0);
  s += h.client_id;
  s += h.nonce;
  return s;
}

Result<Hello> ParseHello(std::string_view body) {
  if (body.size() < 2 || static_cast<uint8_t>(body[0]) != kHelloVersion) {
    return Status::InvalidArgument("ucx handshake: a HELLO of an unknown version");
  }
  const auto mode = static_cast<uint8_t>(body[1]);
  if (mode > 1) return Status::InvalidArgument("ucx handshake: a HELLO of mode " + std::to_string(mode));
  Hello h;
  h.sealed = mode == 1;
  const size_t want = 2 + kClientIdBytes + (h.sealed ? kNonceBytes : 0);
  if (body.size() != want) {
    return Status::InvalidArgument("ucx handshake: a HELLO of " + std::to_string(body.size()) + " bytes, expected " +
                                   std::to_string(want));
  }
  h.client_id = std::string(body.substr(2, kClientIdBytes));
  if (h.sealed) h.nonce = std::string(body.substr(2 + kClientIdBytes, kNonceBytes));
  return h;
}

std::string Transcript(const Hello& hello, std::string_view server_nonce) {
  std::string t = "penumbra-ucx-v1|";
  t += EncodeHello(hello);
  t += server_nonce;
  return t;
}

std::string ClientProof(std::string_view key, std::string_view transcript) {
  return Bytes(HmacSha256(key, "client-proof|" + std::string(transcript)));
}

std::string ServerProof(std::string_view key, std::string_view transcript) {
  return Bytes(HmacSha256(key, "server-proof|" + std::string(transcript)));
}

SessionKeys DeriveSessionKeys(std::string_view key, std::string_view transcript) {
  const std::string master = Bytes(HmacSha256(key, "session|" + std::string(transcript)));
  SessionKeys k;
  k.client_to_server.header_key = Bytes(HmacSha256(master, "c2s-header"));
  k.client_to_server.body_key = Bytes(HmacSha256(master, "c2s-body"));
  k.client_to_server.direction = 1;
  k.server_to_client.header_key = Bytes(HmacSha256(master, "s2c-header"));
  k.server_to_client.body_key = Bytes(HmacSha256(master, "s2c-body"));
  k.server_to_client.direction = 2;
  return k;
}

Result<HandshakeStep> ServerHandshake::OnFrame(FrameType type, std::string_view body) {
  if (established_) return Status::PermissionDenied("a handshake frame after the handshake");
  switch (type) {
    case FrameType::kHello: {
      if (have_hello_) return Status::PermissionDenied("a second HELLO");
      PENUMBRA_ASSIGN_OR_RETURN(hello_, ParseHello(body));
      if (hello_.sealed && !sealed()) {
        return Status::PermissionDenied("this server has no cluster secret (plain, loopback only)");
      }
      if (!hello_.sealed && sealed()) return Status::PermissionDenied("this server requires the cluster secret");
      have_hello_ = true;
      if (!sealed()) {
        established_ = true;
        return HandshakeStep{FrameType::kReady, ""};
      }
      server_nonce_ = RandomBytes(kNonceBytes);
      transcript_ = Transcript(hello_, server_nonce_);
      return HandshakeStep{FrameType::kChallenge, server_nonce_};
    }
    case FrameType::kAuth: {
      if (!have_hello_ || !sealed()) return Status::PermissionDenied("an AUTH out of turn");
      if (!ConstantTimeEquals(body, ClientProof(key_, transcript_))) {
        return Status::PermissionDenied("authentication failed");
      }
      keys_ = std::make_shared<const SessionKeys>(DeriveSessionKeys(key_, transcript_));
      established_ = true;
      return HandshakeStep{FrameType::kReady, ServerProof(key_, transcript_)};
    }
    default:
      return Status::PermissionDenied(std::string("a ") + FrameTypeName(type) + " frame from a client");
  }
}

HandshakeStep ClientHandshake::Start() {
  started_ = true;
  hello_.sealed = !key_.empty();
  hello_.client_id = client_id_;
  hello_.nonce = hello_.sealed ? RandomBytes(kNonceBytes) : "";
  return HandshakeStep{FrameType::kHello, EncodeHello(hello_)};
}

Result<std::optional<HandshakeStep>> ClientHandshake::OnFrame(FrameType type, std::string_view body) {
  if (!started_ || established_) return Status::PermissionDenied("a handshake frame out of turn");
  const bool sealed = !key_.empty();
  switch (type) {
    case FrameType::kChallenge:
      if (!sealed || challenged_ || body.size() != kNonceBytes) {
        return Status::PermissionDenied("an unexpected CHALLENGE");
      }
      challenged_ = true;
      transcript_ = Transcript(hello_, body);
      return std::optional<HandshakeStep>(HandshakeStep{FrameType::kAuth, ClientProof(key_, transcript_)});
    case FrameType::kReady:
      if (sealed) {
        if (!challenged_ || !ConstantTimeEquals(body, ServerProof(key_, transcript_))) {
          return Status::PermissionDenied("the server did not prove it holds the cluster secret");
        }
        keys_ = std::make_shared<const SessionKeys>(DeriveSessionKeys(key_, transcript_));
      } else if (!body.empty()) {
        return Status::PermissionDenied("an unexpected READY");
      }
      established_ = true;
      return std::optional<HandshakeStep>();
    case FrameType::kRefused:
      return Status::PermissionDenied("the server refused the connection: " + Sanitized(body));
    default:
      return Status::PermissionDenied(std::string("a ") + FrameTypeName(type) + " frame during the handshake");
  }
}

}  // namespace penumbra::transport::ucx_frame
