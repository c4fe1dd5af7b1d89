// The UCX plane's frames without UCX (transport/ucx_frame.h): headers and
// bodies round trip plain and sealed; every byte of a sealed header is
// covered by its MAC and every byte of a sealed body by its tag; sizes are
// refused before anything is trusted; the replay window against a plain
// model (a set of seqs seen); seqs (GCM nonces) never repeat across threads;
// the handshake establishes the same keys on both sides only when both hold
// the key, and refuses mode mismatches, wrong proofs and out-of-turn frames.
#include "transport/ucx_frame.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "common/crypto.h"

namespace penumbra::transport::ucx_frame {
namespace {

std::shared_ptr<const DirectionKeys> Keys(char fill, uint32_t direction) {
  auto k = std::make_shared<DirectionKeys>();
  k->header_key = std::string(32, fill);
  k->body_key = std::string(32, static_cast<char>(fill + 1));
  k->direction = direction;
  return k;
}

FrameHeader Request(uint64_t call, int32_t method) {
  FrameHeader h;
  h.type = FrameType::kRequest;
  h.call_id = call;
  h.code = method;
  return h;
}

TEST(UcxFrameTest, PlainAndSealedFramesRoundTrip) {
  for (bool sealed : {false, true}) {
    SCOPED_TRACE(sealed ? "sealed" : "plain");
    auto keys = sealed ? Keys('k', 1) : nullptr;
    FrameSealer sealer(keys);
    FrameOpener opener(keys, 1 << 20);
    for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{4097}, size_t{300000}}) {
      std::string body(n, '\0');
      for (size_t i = 0; i < n; ++i) body[i] = static_cast<char>(i * 7 + n);
      const std::string plain = body;
      const std::string header = sealer.Seal(Request(n, 5), &body);
      ASSERT_EQ(header.size(), kHeaderBytes);
      EXPECT_EQ(body.size(), n + (sealed ? kTagBytes : 0));
      if (sealed && n >= 16) {
        EXPECT_EQ(body.find(plain.substr(0, 16)), std::string::npos) << "not encrypted";
      }
      auto h = opener.Check(header, body.size());
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_EQ(h->call_id, n);
      EXPECT_EQ(h->code, 5);
      EXPECT_EQ(h->sealed, sealed);
      auto opened = opener.Open(*h, body);
      ASSERT_TRUE(opened.ok()) << opened.status();
      EXPECT_EQ(*opened, plain);
    }
  }
}

// A body opened in place over the caller's parts (UcxClient::CallInto):
// the same bytes as Open, any altered byte (or a tag or size that does not
// match) refused.
TEST(UcxFrameTest, BodiesOpenInPlaceOverScatteredParts) {
  for (bool sealed : {false, true}) {
    SCOPED_TRACE(sealed ? "sealed" : "plain");
    auto keys = sealed ? Keys('k', 1) : nullptr;
    FrameSealer sealer(keys);
    for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{4096}, size_t{300001}}) {
      SCOPED_TRACE(n);
      std::string plain(n, '\0');
      for (size_t i = 0; i < n; ++i) plain[i] = static_cast<char>(i * 13 + n);
      std::string body = plain;
      const std::string header = sealer.Seal(Request(n, 10), &body);
      const size_t text = n;  // the body's bytes before the tag
      for (int alter = 0; alter < 4; ++alter) {
        FrameOpener opener(keys, 1 << 20);
        auto h = opener.Check(header, body.size());
        ASSERT_TRUE(h.ok()) << h.status();
        // The received bytes in three parts of uneven sizes, the tag apart.
        std::string wire = body.substr(0, text);
        std::string tag = body.substr(text);
        if (alter == 1 && !wire.empty()) wire[wire.size() / 2] ^= 0x10;  // a damaged byte
        if (alter == 2 && sealed) tag[3] ^= 1;                           // a damaged tag
        const size_t a = text / 3, b = text / 2;
        std::vector<BodyPart> parts = {{wire.data(), a}, {wire.data() + a, b - a}, {wire.data() + b, text - b}};
        if (alter == 3) parts.back().size = text - b > 0 ? text - b - 1 : 0;  // a short destination
        const Status st = opener.OpenInPlace(*h, parts, tag);
        const bool damaged = (alter == 1 && !wire.empty()) || (alter == 2 && sealed) || (alter == 3 && text > b);
        if (!damaged) {
          ASSERT_TRUE(st.ok()) << alter << ": " << st;
          EXPECT_EQ(wire, plain);
        } else {
          EXPECT_EQ(st.code(), StatusCode::kCorruption) << alter << ": " << st;
        }
      }
    }
    // A plain body with a tag, or a sealed one without, is refused.
    std::string body = "abc";
    const std::string header = sealer.Seal(Request(1, 10), &body);
    FrameOpener opener(keys, 1 << 20);
    auto h = opener.Check(header, body.size());
    ASSERT_TRUE(h.ok());
    std::string wire = body;
    std::vector<BodyPart> whole = {{wire.data(), wire.size()}};
    EXPECT_EQ(opener.OpenInPlace(*h, whole, sealed ? "" : std::string(kTagBytes, 't')).code(), StatusCode::kCorruption);
  }
}

TEST(UcxFrameTest, EveryByteOfASealedFrameIsAuthenticated) {
  auto keys = Keys('k', 1);
  FrameSealer sealer(keys);
  std::string body = "the payload of a sealed frame";
  const std::string header = sealer.Seal(Request(1, 7), &body);
  for (size_t i = 0; i < kHeaderBytes; ++i) {
    std::string bad = header;
    bad[i] ^= 0x01;
    FrameOpener opener(keys, 1 << 20);
    Refusal why = Refusal::kNone;
    auto h = opener.Check(bad, body.size(), &why);
    ASSERT_FALSE(h.ok()) << "header byte " << i;
    EXPECT_EQ(why, Refusal::kBadMac) << "header byte " << i;
    EXPECT_EQ(h.status().code(), StatusCode::kPermissionDenied);
  }
  for (size_t i = 0; i < body.size(); ++i) {
    std::string bad = body;
    bad[i] ^= 0x80;
    FrameOpener opener(keys, 1 << 20);
    auto h = opener.Check(header, bad.size());
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(opener.Open(*h, bad).status().code(), StatusCode::kCorruption) << "body byte " << i;
  }
  // Another connection's or direction's keys verify nothing.
  for (const auto& other : {Keys('j', 1), Keys('k', 2)}) {
    FrameOpener opener(other, 1 << 20);
    auto h = opener.Check(header, body.size());
    if (h.ok()) {
      EXPECT_FALSE(opener.Open(*h, body).ok());  // same header key, other direction: the body fails
    } else {
      EXPECT_EQ(h.status().code(), StatusCode::kPermissionDenied);
    }
  }
  // A plain frame on a sealed connection, and a sealed one on a plain connection.
  FrameSealer plain(nullptr);
  std::string pb = "x";
  const std::string ph = plain.Seal(Request(2, 1), &pb);
  FrameOpener sealed_opener(keys, 1 << 20);
  Refusal why = Refusal::kNone;
  EXPECT_FALSE(sealed_opener.Check(ph, pb.size(), &why).ok());
  EXPECT_EQ(why, Refusal::kBadMac);
  FrameOpener plain_opener(nullptr, 1 << 20);
  EXPECT_FALSE(plain_opener.Check(header, body.size(), &why).ok());
  EXPECT_EQ(why, Refusal::kMalformed);
}

TEST(UcxFrameTest, SizesAreRefusedBeforeTheBodyIsTrusted) {
  FrameOpener opener(nullptr, 1000);
  Refusal why = Refusal::kNone;
  EXPECT_FALSE(opener.Check(std::string(63, '\0'), 0, &why).ok());
  EXPECT_EQ(why, Refusal::kMalformed);
  EXPECT_FALSE(opener.Check(std::string(65, '\0'), 0, &why).ok());
  EXPECT_EQ(why, Refusal::kMalformed);
  FrameHeader h = Request(1, 1);
  h.body_bytes = 1001;
  EXPECT_EQ(opener.Check(EncodeHeader(h), 1001, &why).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(why, Refusal::kTooLarge);
  h.body_bytes = uint64_t{1} << 40;
  EXPECT_FALSE(opener.Check(EncodeHeader(h), 10, &why).ok());
  EXPECT_EQ(why, Refusal::kTooLarge);
  h.body_bytes = 10;
  EXPECT_FALSE(opener.Check(EncodeHeader(h), 11, &why).ok());  // not what UCX announced
  EXPECT_EQ(why, Refusal::kMalformed);
  // Unknown type, version, flags, reserved bits, a seq on a plain frame, a MAC on a plain frame.
  for (int field : {4, 5, 6, 28, 8, 50}) {
    std::string bytes = EncodeHeader(h);
    bytes[field] = static_cast<char>(field == 5 ? 99 : 1 + bytes[field]);
    EXPECT_FALSE(opener.Check(bytes, 10, &why).ok()) << "byte " << field;
    EXPECT_EQ(why, Refusal::kMalformed) << "byte " << field;
  }
  // A sealed body shorter than its tag.
  auto keys = Keys('k', 1);
  FrameOpener sealed(keys, 1000);
  FrameSealer sealer(keys);
  std::string body;
  std::string header = sealer.Seal(Request(1, 1), &body);
  EXPECT_TRUE(sealed.Check(header, kTagBytes).ok());
}

TEST(UcxFrameTest, TheReplayWindowAdmitsEachSeqOnceAgainstAModel) {
  std::mt19937_64 rng(37);
  ReplayWindow w;
  std::set<uint64_t> seen;
  uint64_t highest = 0;
  int admitted = 0, replays = 0, stale = 0;
  for (int step = 0; step < 200000; ++step) {
    uint64_t seq;
    switch (rng() % 4) {
      case 0:
        seq = highest + 1 + rng() % 3;
        break;  // ahead
      case 1:
        seq = highest > 0 ? highest - rng() % std::min<uint64_t>(highest, 5000) : 1;
        break;  // behind
      case 2:
        seq = seen.empty() ? 1 : *std::next(seen.begin(), static_cast<long>(rng() % seen.size()));
        break;
      default:
        seq = highest + 1 + rng() % 9000;
        break;  // a jump
    }
    Refusal want;
    if (seq == 0 || seen.count(seq)) {
      want = Refusal::kReplay;
    } else if (seq <= highest && highest - seq >= kReplayWindow) {
      want = Refusal::kStale;
    } else {
      want = Refusal::kNone;
    }
    const Refusal got = w.Admit(seq);
    ASSERT_EQ(got, want) << "step " << step << " seq " << seq << " highest " << highest;
    if (got == Refusal::kNone) {
      seen.insert(seq);
      highest = std::max(highest, seq);
      ++admitted;
    }
    replays += got == Refusal::kReplay;
    stale += got == Refusal::kStale;
    // The model keeps only what the window can remember.
    while (!seen.empty() && highest - *seen.begin() >= kReplayWindow) seen.erase(seen.begin());
  }
  EXPECT_EQ(w.Admit(0), Refusal::kReplay);
  EXPECT_GT(admitted, 1000);
  EXPECT_GT(replays, 1000);
  EXPECT_GT(stale, 100);
}

TEST(UcxFrameTest, SeqsNeverRepeatAcrossThreads) {
  FrameSealer sealer(Keys('k', 1));
  std::vector<std::vector<uint64_t>> seqs(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        std::string body = "x";
        const std::string header = sealer.Seal(Request(i, 1), &body);
        uint64_t seq;
        std::memcpy(&seq, header.data() + 8, 8);
        seqs[t].push_back(seq);
      }
    });
  }
  for (auto& th : threads) th.join();
  std::set<uint64_t> all;
  for (const auto& v : seqs) all.insert(v.begin(), v.end());
  EXPECT_EQ(all.size(), 16000u);
  EXPECT_EQ(*all.begin(), 1u);
  EXPECT_EQ(*all.rbegin(), 16000u);
}

// Runs a handshake between a client and a server; the client's error, the
// server's, or both sides' keys.
struct Outcome {
  Status client, server;
  std::shared_ptr<const SessionKeys> client_keys, server_keys;
  std::string server_client_id;
};
Outcome Shake(const std::string& client_key, const std::string& server_key, const std::string& id) {
  Outcome o;
  ClientHandshake c(client_key, id);
  ServerHandshake s(server_key);
  HandshakeStep step = c.Start();
  for (int round = 0; round < 4; ++round) {
    auto answer = s.OnFrame(step.type, step.body);
    if (!answer.ok()) {
      o.server = answer.status();
      auto told = c.OnFrame(FrameType::kRefused, answer.status().message());
      o.client = told.status();
      return o;
    }
    auto next = c.OnFrame(answer->type, answer->body);
    if (!next.ok()) {
      o.client = next.status();
      return o;
    }
    if (c.established()) {
      EXPECT_TRUE(s.established());
      o.client_keys = c.keys();
      o.server_keys = s.keys();
      o.server_client_id = s.client_id();
      return o;
    }
    step = **next;
  }
  o.client = Status::Internal("no end");
  return o;
}

TEST(UcxFrameTest, TheHandshakeEstablishesKeysOnlyWhenBothHoldTheKey) {
  const std::string k(32, 'a'), other(32, 'b'), id(16, 'i');
  Outcome ok = Shake(k, k, id);
  ASSERT_TRUE(ok.client.ok()) << ok.client;
  ASSERT_NE(ok.client_keys, nullptr);
  EXPECT_EQ(ok.client_keys->client_to_server.header_key, ok.server_keys->client_to_server.header_key);
  EXPECT_EQ(ok.client_keys->server_to_client.body_key, ok.server_keys->server_to_client.body_key);
  EXPECT_NE(ok.client_keys->client_to_server.body_key, ok.client_keys->server_to_client.body_key);
  EXPECT_EQ(ok.server_client_id, id);
  // Fresh nonces: another handshake of the same pair, other keys.
  Outcome again = Shake(k, k, id);
  ASSERT_TRUE(again.client.ok());
  EXPECT_NE(again.client_keys->client_to_server.header_key, ok.client_keys->client_to_server.header_key);
  // A wrong key: the server refuses the client's proof.
  Outcome wrong = Shake(other, k, id);
  EXPECT_EQ(wrong.server.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(wrong.server.message().find("authentication failed"), std::string::npos) << wrong.server;
  EXPECT_EQ(wrong.client.code(), StatusCode::kPermissionDenied);
  // No key, or a client with a key and a server without one: refused both ways.
  EXPECT_EQ(Shake("", k, id).server.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(Shake(k, "", id).server.code(), StatusCode::kPermissionDenied);
  // Plain on both sides: established, no keys.
  Outcome plain = Shake("", "", id);
  ASSERT_TRUE(plain.client.ok()) << plain.client;
  EXPECT_EQ(plain.client_keys, nullptr);
  EXPECT_EQ(plain.server_client_id, id);
}

TEST(UcxFrameTest, AServerWithoutTheKeyCannotPassAndOutOfTurnFramesAreRefused) {
  const std::string k(32, 'a'), id(16, 'i');
  // A server that does not know the key answers the challenge with a guess.
  ClientHandshake c(k, id);
  HandshakeStep hello = c.Start();
  auto parsed = ParseHello(hello.body);
  ASSERT_TRUE(parsed.ok());
  auto auth = c.OnFrame(FrameType::kChallenge, std::string(kNonceBytes, 'n'));
  ASSERT_TRUE(auth.ok());
  ASSERT_TRUE(auth->has_value());
  auto ready = c.OnFrame(FrameType::kReady, std::string(kProofBytes, 'p'));
  EXPECT_EQ(ready.status().code(), StatusCode::kPermissionDenied);
  EXPECT_FALSE(c.established());
  // A proof from another session (other server nonce) does not pass.
  ServerHandshake s1(k), s2(k);
  ClientHandshake c1(k, id);
  HandshakeStep h1 = c1.Start();
  auto ch1 = s1.OnFrame(h1.type, h1.body);
  ASSERT_TRUE(ch1.ok());
  auto a1 = c1.OnFrame(ch1->type, ch1->body);
  ASSERT_TRUE(a1.ok());
  ASSERT_TRUE(s2.OnFrame(h1.type, h1.body).ok());
  EXPECT_EQ(s2.OnFrame((*a1)->type, (*a1)->body).status().code(), StatusCode::kPermissionDenied);
  // Out of turn: an AUTH first, a second HELLO, a request during the handshake.
  ServerHandshake s3(k);
  EXPECT_FALSE(s3.OnFrame(FrameType::kAuth, std::string(kProofBytes, 'p')).ok());
  ServerHandshake s4(k);
  ASSERT_TRUE(s4.OnFrame(h1.type, h1.body).ok());
  EXPECT_FALSE(s4.OnFrame(h1.type, h1.body).ok());
  EXPECT_FALSE(ServerHandshake(k).OnFrame(FrameType::kRequest, "").ok());
  // Malformed hellos.
  EXPECT_FALSE(ParseHello("").ok());
  EXPECT_FALSE(ParseHello(std::string(1, '\1')).ok());
  EXPECT_FALSE(ParseHello(hello.body + "x").ok());
  std::string bad_mode = hello.body;
  bad_mode[1] = 7;
  EXPECT_FALSE(ParseHello(bad_mode).ok());
  // A handshake frame's header: plain, a handshake type, its checksum.
  const std::string hh = HandshakeHeader(FrameType::kHello, hello.body);
  EXPECT_TRUE(CheckHandshake(hh, hello.body, hello.body.size()).ok());
  EXPECT_FALSE(CheckHandshake(hh, hello.body.substr(1) + "?", hello.body.size()).ok());
  FrameSealer plain(nullptr);
  std::string body = "q";
  EXPECT_FALSE(CheckHandshake(plain.Seal(Request(1, 1), &body), body, body.size()).ok());
  EXPECT_FALSE(
      CheckHandshake(HandshakeHeader(FrameType::kHello, std::string(300, 'x')), std::string(300, 'x'), 300).ok());
}

}  // namespace
}  // namespace penumbra::transport::ucx_frame
