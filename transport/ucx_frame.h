// The UCX plane's wire format and its checks (transport/ucx_rpc.h), as pure
// functions and small classes without UCX: unit-tested in
// tests/transport/ucx_frame_test.cc and fuzzed in
// transport/fuzz/ucx_frame_fuzz.cc.
//
// A frame is one UCX active message: its UCX header is a FrameHeader
// (kHeaderBytes, fixed), its UCX payload the frame's body.
//
//   bytes  0..3   magic "PUCX"            4      version (1)
//          5      type (FrameType)        6..7   flags (bit 0: sealed)
//          8..15  seq                     16..23 call id
//          24..27 code (method, status)   28..31 reserved (0)
//          32..39 body bytes              40..47 checksum (plain: XXH3-64 of the body)
//          48..63 MAC (sealed: HMAC-SHA256 of bytes 0..47 under the
//                 direction's header key, first 16 bytes; plain: 0)
//
// Two modes, fixed per connection at its handshake:
//   - plain (no cluster secret; loopback only): bodies in clear with an XXH3
//     checksum (integrity against bugs, not attackers);
//   - sealed (a cluster secret): after a mutual challenge-response
//     (ClientHandshake/ServerHandshake: HELLO with the client's nonce,
//     CHALLENGE with the server's, AUTH with the client's proof, READY with
//     the server's; both proofs are HMACs of the whole transcript under the
//     plane key), every frame's header carries a MAC under a key of this
//     connection and direction, and its body is encrypted with AES-256-GCM
//     (the header's first 48 bytes as associated data, the direction and
//     seq as the nonce) with the 16-byte tag appended. seq counts each
//     direction's frames from 1, so a nonce is never used twice under one
//     key, and a receiver refuses a seq it has seen (ReplayWindow).
// A receiver checks a header (FrameOpener::Check: its MAC first, then its
// fields, then that the body UCX announces is the size the header states
// and at most the limit) before it receives or allocates the body.
#pragma once

#include <atomic>
#include <bitset>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

namespace penumbra::transport::ucx_frame {

// The UCX active-message ids: every frame to a server, every frame to a
// client (sent with UCP_AM_SEND_FLAG_REPLY: the receiver knows the
// connection by its reply endpoint).
constexpr uint16_t kAmToServer = 1, kAmToClient = 2;
constexpr uint32_t kMagic = 0x58435550;  // "PUCX" little-endian
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;
constexpr size_t kSignedHeaderBytes = 48;  // the bytes the MAC (and a sealed body's AEAD) cover
constexpr size_t kMacBytes = 16;
constexpr size_t kTagBytes = 16;    // the AES-256-GCM tag after a sealed body
constexpr size_t kNonceBytes = 32;  // handshake nonces
constexpr size_t kClientIdBytes = 16;
constexpr size_t kProofBytes = 32;
constexpr size_t kMaxHandshakeBody = 256;  // a handshake frame's body at most
// The largest body by default: a 64 MiB part or read and its request's
// fields, plus the tag.
constexpr size_t kDefaultMaxBody = (size_t{64} << 20) + (size_t{1} << 20);
// How far behind the highest seq seen a frame may arrive (frames of one
// direction may be reordered: callers seal on their own threads).
constexpr uint64_t kReplayWindow = 4096;

enum class FrameType : uint8_t {
  kHello = 1,      // client -> server: mode, client id, nonce
  kChallenge = 2,  // server -> client: the server's nonce (sealed mode)
  kAuth = 3,       // client -> server: the client's proof
  kReady = 4,      // server -> client: the server's proof (sealed) or nothing (plain)
  kRefused = 5,    // server -> client: the handshake failed (the connection closes)
  kRequest = 6,    // client -> server: code = method
  kReply = 7,      // server -> client: code = StatusCode; body = the message when not OK
};
const char* FrameTypeName(FrameType t);
bool IsHandshake(FrameType t);

struct FrameHeader {
  FrameType type = FrameType::kRequest;
  bool sealed = false;
  uint64_t seq = 0;  // sealed frames: the sender's counter in this direction (from 1)
  uint64_t call_id = 0;
  int32_t code = 0;         // requests: the method; replies: a StatusCode
  uint64_t body_bytes = 0;  // the UCX payload's length (sealed: ciphertext and tag)
  uint64_t checksum = 0;    // plain frames: XXH3-64 of the body
};

// The header's 64 bytes, MAC field zero (plain frames carry no MAC).
std::string EncodeHeader(const FrameHeader& h);

// One direction's keys of a sealed connection (32 bytes each).
struct DirectionKeys {
  std::string header_key;  // HMAC-SHA256 of headers
  std::string body_key;    // AES-256-GCM of bodies
  uint32_t direction = 0;  // part of the nonce: 1 client -> server, 2 server -> client
};
struct SessionKeys {
  DirectionKeys client_to_server, server_to_client;
};

// Why a frame was refused (FrameOpener::Check), for counters.
enum class Refusal : uint8_t {
  kNone = 0,
  kMalformed,  // a header of the wrong size, magic, version, type, flags or reserved bits
  kBadMac,     // a sealed connection's frame whose MAC does not verify (or that is not sealed)
  kTooLarge,   // a body larger than the limit, or not the size UCX announced
  kReplay,     // a seq seen already, or 0
  kStale,      // a seq older than the replay window (may be honest: a very late frame)
};
const char* RefusalName(Refusal r);

// A sealed direction's seqs seen: admits each seq once, and none more than
// kReplayWindow behind the highest admitted. Not thread-safe.
class ReplayWindow {
 public:
  // kNone (admitted, now seen), kReplay (seen, or 0) or kStale (too old).
  Refusal Admit(uint64_t seq);
  uint64_t highest() const { return highest_; }

 private:
  uint64_t highest_ = 0;
  std::bitset<kReplayWindow> seen_;  // bit (s % kReplayWindow) for s in (highest_ - kReplayWindow, highest_]
};

class FrameCrypto;  // one direction's keys, made ready (ucx_frame.cc)

// Consecutive pieces of one received body, in place: a reply received
// straight into its caller's buffers (UcxClient::CallInto), piece after
// piece (a sealed body's tag apart).
struct BodyPart {
  char* data = nullptr;
  size_t size = 0;
};

// Makes the frames of one direction of a connection: plain (no keys: the
// body's checksum in the header) or sealed (header MAC; body encrypted).
// Thread-safe: many threads seal at once, each frame with its own seq.
class FrameSealer {
 public:
  explicit FrameSealer(std::shared_ptr<const DirectionKeys> keys);
  // Fills h's seq, body_bytes, checksum and sealed; *body (plaintext in)
  // becomes the wire body. Returns the header's bytes.
  std::string Seal(FrameHeader h, std::string* body);
  bool sealed() const { return crypto_ != nullptr; }

 private:
  std::shared_ptr<const FrameCrypto> crypto_;
  std::atomic<uint64_t> next_seq_{1};
};

// Checks the frames of one direction of a connection.
class FrameOpener {
 public:
  // keys null: plain frames only; else sealed frames only. max_body: the
  // largest body accepted.
  FrameOpener(std::shared_ptr<const DirectionKeys> keys, size_t max_body);
  // Checks a received header before anything else is trusted: its size, then
  // (sealed) its MAC, then magic, version, type, flags and reserved bits,
  // then that announced_body (what UCX says the body holds) is what the
  // header states and at most max_body, then (sealed) its seq against the
  // replay window. On failure *why says which check failed (may be null).
  // Not thread-safe (the receiving thread).
  Result<FrameHeader> Check(std::string_view header, size_t announced_body, Refusal* why = nullptr);
  // The plaintext of a body whose header Check accepted: its checksum
  // verified (plain) or decrypted and its tag verified (sealed).
  // Corruption when it does not verify. Thread-safe (keys only).
  Result<std::string> Open(const FrameHeader& h, std::string body) const;
  // The same for a body received in place over `parts` (its bytes in
  // order) and, sealed, its tag (the body's last kTagBytes; plain: empty):
  // the parts' sizes (and the tag's) must add up to the header's body_bytes,
  // then the checksum is verified over them (plain) or they are decrypted
  // in place and the tag verified (sealed). Corruption when it does not
  // verify (then the parts hold nothing to use). Thread-safe (keys only).
  Status OpenInPlace(const FrameHeader& h, std::span<const BodyPart> parts, std::string_view tag) const;
  bool sealed() const { return crypto_ != nullptr; }

 private:
  std::shared_ptr<const FrameCrypto> crypto_;
  size_t max_body_;
  ReplayWindow window_;
};

// A handshake frame's header: plain, seq 0, the body's checksum.
std::string HandshakeHeader(FrameType type, std::string_view body);
// Checks a handshake frame's header (plain, a handshake type, body at most
// kMaxHandshakeBody and as announced) and its body's checksum.
Result<FrameHeader> CheckHandshake(std::string_view header, std::string_view body, size_t announced_body,
                                   Refusal* why = nullptr);

struct Hello {
  bool sealed = false;    // the client has the secret and wants a sealed connection
  std::string client_id;  // kClientIdBytes: the client's identity, stable across its reconnects
  std::string nonce;      // kNonceBytes (sealed) or empty (plain)
};
std::string EncodeHello(const Hello& h);
Result<Hello> ParseHello(std::string_view body);

// Both sides' proofs and the session keys come from the plane key and the
// transcript: the hello's fields and the server's nonce.
std::string Transcript(const Hello& hello, std::string_view server_nonce);
std::string ClientProof(std::string_view plane_key, std::string_view transcript);
std::string ServerProof(std::string_view plane_key, std::string_view transcript);
SessionKeys DeriveSessionKeys(std::string_view plane_key, std::string_view transcript);

// A handshake frame to send.
struct HandshakeStep {
  FrameType type = FrameType::kRefused;
  std::string body;
};

// The server's side of one connection's handshake. plane_key empty: plain.
// Feed it the client's handshake frames (type and checked body); each
// answer is sent back. An error means refuse (send kRefused) and close.
class ServerHandshake {
 public:
  explicit ServerHandshake(std::string plane_key) : key_(std::move(plane_key)) {}
  Result<HandshakeStep> OnFrame(FrameType type, std::string_view body);
  bool established() const { return established_; }
  bool sealed() const { return !key_.empty(); }
  // After establishment: the client's id (kClientIdBytes) and the keys
  // (null in plain mode).
  const std::string& client_id() const { return hello_.client_id; }
  std::shared_ptr<const SessionKeys> keys() const { return keys_; }

 private:
  std::string key_;
  bool have_hello_ = false, established_ = false;
  Hello hello_;
  std::string server_nonce_, transcript_;
  std::shared_ptr<const SessionKeys> keys_;
};

// The client's side. plane_key empty: plain.
class ClientHandshake {
 public:
  ClientHandshake(std::string plane_key, std::string client_id)
      : key_(std::move(plane_key)), client_id_(std::move(client_id)) {}
  // The HELLO to send first.
  HandshakeStep Start();
  // The server's frame: the AUTH to send (after a CHALLENGE), or nothing
  // once established (after a READY). PermissionDenied when the server
  // refused or failed its proof; then the connection is closed.
  Result<std::optional<HandshakeStep>> OnFrame(FrameType type, std::string_view body);
  bool established() const { return established_; }
  std::shared_ptr<const SessionKeys> keys() const { return keys_; }

 private:
  std::string key_, client_id_;
  bool started_ = false, challenged_ = false, established_ = false;
  Hello hello_;
  std::string transcript_;
  std::shared_ptr<const SessionKeys> keys_;
};

}  // namespace penumbra::transport::ucx_frame
