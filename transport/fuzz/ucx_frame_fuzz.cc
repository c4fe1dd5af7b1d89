// libFuzzer target: the UCX plane's frame checks (transport/ucx_frame.h),
// which see every byte a peer sends before anything else does. On any input
// they must answer (accept or refuse) without crashing, reading out of
// bounds or undefined behaviour; and what they accept must be consistent:
// a header accepted has the sizes it was checked for, a body opened is the
// one sealed, a replay window admits each seq once (against a std::set
// model). Inputs (the first byte picks):
//   0: raw bytes as a plain header (+ announced length) and body;
//   1: raw bytes as a header for a sealed opener (the fixed test key);
//   2: fuzzed header fields MAC'd with the test key (a valid MAC around
//      fuzzed contents, so the checks past the MAC are reached), and a
//      body sealed with the test key, then maybe altered;
//   3: a handshake: fuzzed frames fed to a server and to a client;
//   4: a sequence of seqs for the replay window;
//   5: a body sealed (or plain) then maybe altered, opened in place over
//      parts whose sizes come from the input (OpenInPlace: the bytes as
//      sealed when nothing was altered and the parts cover them exactly,
//      refused otherwise).
// Built and run by .ci/fuzz.sh; seeds written when PENUMBRA_FUZZ_SEEDS is set.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/crypto.h"
#include "transport/ucx_frame.h"

namespace uf = penumbra::transport::ucx_frame;

namespace {

constexpr size_t kMaxBody = 1 << 16;

std::shared_ptr<const uf::DirectionKeys> TestKeys() {
  static const auto keys = [] {
    auto k = std::make_shared<uf::DirectionKeys>();
    k->header_key = std::string(32, 'h');
    k->body_key = std::string(32, 'b');
    k->direction = 1;
    return std::shared_ptr<const uf::DirectionKeys>(k);
  }();
  return keys;
}

// Reads from the input, zero when it runs out.
struct In {
  const uint8_t* p;
  size_t n;
  uint8_t U8() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  uint64_t U64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(U8()) << (8 * i);
    return v;
  }
  std::string Bytes(size_t want) {
    const size_t k = std::min(want, n);
    std::string s(reinterpret_cast<const char*>(p), k);
    p += k;
    n -= k;
    return s;
  }
  std::string Rest() { return Bytes(n); }
};

void Check(bool ok) {
  if (!ok) std::abort();
}

// A header the opener accepted states the body it was given.
void OpenChecked(uf::FrameOpener& opener, const std::string& header, const std::string& body) {
  auto h = opener.Check(header, body.size());
  if (!h.ok()) return;
  Check(h->body_bytes == body.size() && h->body_bytes <= kMaxBody);
  (void)opener.Open(*h, body);
}

void Plain(In in) {
  uf::FrameOpener opener(nullptr, kMaxBody);
  const std::string header = in.Bytes(in.U8() == 0 ? 63 : uf::kHeaderBytes);
  OpenChecked(opener, header, in.Rest());
}

void SealedRaw(In in) {
  uf::FrameOpener opener(TestKeys(), kMaxBody);
  const std::string header = in.Bytes(uf::kHeaderBytes);
  OpenChecked(opener, header, in.Rest());
}

void SealedValidMac(In in) {
  // The signed part from the input, the MAC computed as a peer with the key would.
  std::string header = in.Bytes(uf::kSignedHeaderBytes);
  header.resize(uf::kSignedHeaderBytes, '\0');
  const bool well_formed = in.U8() & 1;
  std::string body = in.Bytes(in.U8() * 4);
  if (well_formed) {
    // Make the fields the sealer would, so the AEAD path is reached.
    uf::FrameHeader h;
    h.type = static_cast<uf::FrameType>(1 + static_cast<uint8_t>(header[5]) % 7);
    h.call_id = 0;
    std::memcpy(&h.call_id, header.data() + 16, 8);
    std::memcpy(&h.code, header.data() + 24, 4);
    uf::FrameSealer sealer(TestKeys());
    std::string sealed = body;
    std::string wire = sealer.Seal(h, &sealed);
    const uint8_t alter = in.U8();
    if (alter & 1 && !sealed.empty()) sealed[alter % sealed.size()] ^= static_cast<char>(1 + (alter >> 1));
    uf::FrameOpener opener(TestKeys(), kMaxBody);
    auto got = opener.Check(wire, sealed.size());
    Check(got.ok());  // a header the sealer made always passes
    auto opened = opener.Open(*got, sealed);
    if (!(alter & 1) || sealed.empty()) Check(opened.ok() && *opened == body);
    if ((alter & 1) && !sealed.empty()) Check(!opened.ok());  // any altered byte is caught
    // The same frame again is a replay.
    Check(!opener.Check(wire, sealed.size()).ok());
    return;
  }
  const penumbra::Sha256Digest mac = penumbra::HmacSha256(TestKeys()->header_key, header);
  header.append(reinterpret_cast<const char*>(mac.data()), uf::kMacBytes);
  uf::FrameOpener opener(TestKeys(), kMaxBody);
  OpenChecked(opener, header, body);
}

void Handshake(In in) {
  const std::string key(32, 'k');
  uf::ServerHandshake server(in.U8() & 1 ? key : "");
  uf::ClientHandshake client(in.U8() & 1 ? key : "", std::string(16, 'c'));
  (void)client.Start();
  while (in.n > 0) {
    const auto type = static_cast<uf::FrameType>(in.U8() % 9);
    const std::string body = in.Bytes(in.U8());
    const std::string header = uf::HandshakeHeader(type, body);
    auto checked = uf::CheckHandshake(header, body, body.size());
    if (in.U8() & 1) {
      auto step = server.OnFrame(type, body);
      if (step.ok() && server.established()) Check(server.client_id().size() == uf::kClientIdBytes);
    } else {
      auto step = client.OnFrame(type, body);
      (void)step;
    }
    (void)checked;
    (void)uf::ParseHello(body);
  }
}

void Window(In in) {
  uf::ReplayWindow w;
  std::set<uint64_t> seen;
  uint64_t highest = 0;
  while (in.n > 0) {
    const uint64_t seq =
        (in.U8() & 1) ? highest + in.U8() * 37 : highest - std::min<uint64_t>(highest, in.U64() % 10000);
    uf::Refusal want = uf::Refusal::kNone;
    if (seq == 0 || seen.count(seq)) {
      want = uf::Refusal::kReplay;
    } else if (seq <= highest && highest - seq >= uf::kReplayWindow) {
      want = uf::Refusal::kStale;
    }
    Check(w.Admit(seq) == want);
    if (want == uf::Refusal::kNone) {
      seen.insert(seq);
      highest = std::max(highest, seq);
    }
    while (!seen.empty() && highest - *seen.begin() >= uf::kReplayWindow) seen.erase(seen.begin());
  }
}

void InPlace(In in) {
  const bool sealed = in.U8() & 1;
  const auto keys = sealed ? TestKeys() : nullptr;
  const size_t high = in.U8();
  const std::string plain = in.Bytes(high * 16 + in.U8());
  uf::FrameSealer sealer(keys);
  uf::FrameHeader h;
  h.type = uf::FrameType::kReply;
  h.call_id = 9;
  std::string body = plain;
  const std::string header = sealer.Seal(h, &body);
  uf::FrameOpener opener(keys, kMaxBody);
  auto got = opener.Check(header, body.size());
  Check(got.ok());
  std::string tag = sealed ? body.substr(plain.size()) : std::string();
  std::string wire = body.substr(0, plain.size());
  const uint8_t alter = in.U8();
  const bool altered = (alter & 1) && !wire.empty();
  if (altered) wire[alter % wire.size()] ^= static_cast<char>(1 + (alter >> 1));
  // Parts of sizes from the input over the wire bytes (maybe short or long).
  std::vector<uf::BodyPart> parts;
  size_t at = 0;
  while (in.n > 0 && at < wire.size()) {
    const size_t k = std::min<size_t>(in.U8(), wire.size() - at);
    parts.push_back({wire.data() + at, k});
    at += k;
  }
  const bool covered = at == wire.size();
  const penumbra::Status st = opener.OpenInPlace(*got, parts, tag);
  if (!altered && covered) Check(st.ok() && wire == plain);
  if (altered || !covered) Check(!st.ok());
}

void WriteSeed(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("PENUMBRA_FUZZ_SEEDS");
  if (dir == nullptr) return 0;
  uf::FrameSealer plain(nullptr), sealed(TestKeys());
  uf::FrameHeader h;
  h.type = uf::FrameType::kRequest;
  h.call_id = 7;
  h.code = 10;
  std::string body = "a request body";
  std::string header = plain.Seal(h, &body);
  WriteSeed(dir, "plain_request", std::string(1, '\0') + "\x01" + header + body);
  std::string sbody = "sealed";
  std::string sheader = sealed.Seal(h, &sbody);
  WriteSeed(dir, "sealed_request", std::string(1, '\x01') + sheader + sbody);
  WriteSeed(dir, "valid_mac", std::string(1, '\x02') + sheader.substr(0, 48) + "\x01\x04" + "body" + "\x00");
  WriteSeed(dir, "valid_mac_altered", std::string(1, '\x02') + sheader.substr(0, 48) + "\x01\x04" + "body" + "\x03");
  WriteSeed(dir, "forged_mac", std::string(1, '\x02') + sheader.substr(0, 48) + "\x00\x04" + "body");
  uf::ClientHandshake c(std::string(32, 'k'), std::string(16, 'c'));
  const uf::HandshakeStep hello = c.Start();
  WriteSeed(dir, "handshake",
            std::string(1, '\x03') + "\x01\x01" + static_cast<char>(uf::FrameType::kHello) +
                static_cast<char>(hello.body.size()) + hello.body + "\x01" + static_cast<char>(uf::FrameType::kAuth) +
                "\x20" + std::string(32, 'p') + "\x01");
  WriteSeed(dir, "in_place_sealed",
            std::string(1, '\x05') + "\x01\x02\x05" + std::string(37, 'x') + "\x00" + "\x10\x07\xff");
  WriteSeed(dir, "in_place_plain",
            std::string(1, '\x05') + "\x00\x01\x00" + std::string(16, 'y') + "\x03" + "\x08\x08");
  WriteSeed(dir, "window", std::string(1, '\x04') + "\x01\x05\x01\x07\x00\x02\x00\x00\x00\x00\x00\x00\x00\x01\x03");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  In in{data + 1, size - 1};
  switch (data[0] % 6) {
    case 0:
      Plain(in);
      break;
    case 1:
      SealedRaw(in);
      break;
    case 2:
      SealedValidMac(in);
      break;
    case 3:
      Handshake(in);
      break;
    case 4:
      Window(in);
      break;
    default:
      InPlace(in);
      break;
  }
  return 0;
}
