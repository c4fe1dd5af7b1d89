// Value-store nodes with real processes (label distributed): penumbra-store
// serving a RocksDB directory over UCX on loopback, and CPU engines
// (stories260K, shadowkv, values read lazily) keeping their documents on it.
// A document stored through one engine answers another engine's question
// with the cold request's tokens; a node killed with SIGKILL costs the next
// request only its reuse (it is computed, with the cold tokens, in bounded
// time); the node restarted on its directory serves what it acknowledged.
// The node runs with a cluster secret (the plane authenticated and
// encrypted) except where a test says plain.
// Also: the client as a DocumentStore (put, layout, info, get, ranged
// reads, erase, errors) against a node in this process; handles bound to the
// client that made them (another client's, or a guessed one, is NotFound);
// uploads bounded before anything is allocated (sizes against capacity and
// quota, uploads and bytes in flight, part ranges, idle uploads dropped),
// the node serving on and nothing stored lost.
#include "store_node/store_node.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <thread>

#include <nlohmann/json.hpp>

#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "common/crypto.h"
#include "storage/lazy_blob.h"
#include "store_types.h"
#include "tests/storage/segment_store_test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

using namespace std::chrono_literals;
using testing::Eventually;
using testing::LcgTokens;

std::string BinDir() { return std::filesystem::read_symlink("/proc/self/exe").parent_path().string(); }

// A penumbra-store process on `dir` (with the secret in `secret_file`).
struct NodeProcess {
  pid_t pid = -1;
  int port = 0;
  bool Start(const std::string& dir, const std::string& secret_file = "") {
    const std::string port_file = dir + ".port.json";
    std::filesystem::remove(port_file);
    pid = fork();
    if (pid == 0) {
      const std::string bin = BinDir() + "/penumbra-store";
      if (secret_file.empty()) {
        execl(bin.c_str(), "penumbra-store", "--path", dir.c_str(), "--port-file", port_file.c_str(),
              static_cast<char*>(nullptr));
      } else {
        execl(bin.c_str(), "penumbra-store", "--path", dir.c_str(), "--port-file", port_file.c_str(),
              "--cluster-secret-file", secret_file.c_str(), static_cast<char*>(nullptr));
      }
      _exit(127);
    }
    for (int i = 0; i < 400; ++i) {
      std::ifstream f(port_file);
      if (f) {
        auto j = nlohmann::json::parse(f, nullptr, false);
        if (!j.is_discarded() && j.contains("port")) {
          port = j["port"].get<int>();
          return true;
        }
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
  void Kill() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
  ~NodeProcess() { Kill(); }
};

ClusterSecret TestSecret() { return ClusterSecret::FromBytes(std::string(32, 's')); }

std::shared_ptr<transport::RemoteDocumentStore> Client(int port, std::optional<ClusterSecret> secret = TestSecret()) {
  transport::RemoteStoreOptions o;
  o.port = port;
  o.call_timeout = 10s;
  o.plane.secret = secret;
  auto c = transport::RemoteDocumentStore::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : nullptr;
}

// A CPU engine whose documents live on `store` (null: no cache at all).
std::unique_ptr<Engine> OpenEngine(std::shared_ptr<storage::DocumentStore> store) {
  EngineOptions o = testing::LossyShadowKvOptions();
  if (store) {
    o.runtime.prefix_cache_bytes = 64 << 20;
    o.document_store = std::move(store);
    o.runtime.prefix_store_eager_blob_bytes = 4096;  // large blobs through the node's readers
    o.runtime.prefix_store_lazy_block_bytes = 4096;
  }
  auto e = Engine::Open(testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

const std::vector<int32_t> kDoc = LcgTokens(151, 7, true);

GenerationRequest Question(uint64_t q) {
  GenerationRequest r;
  r.prompt = kDoc;
  const std::vector<int32_t> question = LcgTokens(20, q, false);
  r.prompt.insert(r.prompt.end(), question.begin(), question.end());
  r.max_new_tokens = 16;
  r.document_ends = {151};
  return r;
}

std::vector<int32_t> Cold(uint64_t q) {
  auto e = OpenEngine(nullptr);
  auto r = e->runtime().Generate({Question(q)});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? (*r)[0].ids : std::vector<int32_t>{};
}

class StoreNodeTest : public testing::StoriesTest {};

TEST_F(StoreNodeTest, DocumentsLiveOnANodeThroughKillsAndRestarts) {
  storage::testing::TempDir tmp;
  const std::string dir = tmp.path() + "/node";
  const std::string secret_file = tmp.path() + "/cluster.secret";
  {
    std::ofstream f(secret_file);
    f << HexOf(std::string(32, 's')) << "\n";
  }
  std::filesystem::permissions(secret_file, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  NodeProcess node;
  ASSERT_TRUE(node.Start(dir, secret_file));

  // Engine A prefills the document; its capture goes to the node.
  {
    auto a = OpenEngine(Client(node.port));
    ASSERT_NE(a, nullptr);
    auto r = a->runtime().Generate({Question(11)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 0);
    EXPECT_EQ((*r)[0].ids, Cold(11));
    a->runtime().DrainPrefixStores();
    EXPECT_EQ(a->runtime().stats().prefix_stores, 1);
    EXPECT_EQ(a->runtime().stats().prefix_store_errors, 0);
  }
  // Engine B, another process's view: the document from the node, read lazily.
  {
    auto b = OpenEngine(Client(node.port));
    auto r = b->runtime().Generate({Question(12)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 151);
    EXPECT_EQ(b->runtime().stats().prefix_store_hits, 1);
    EXPECT_EQ((*r)[0].ids, Cold(12));
  }
  // The node is killed: the next request computes the document (cold tokens),
  // in bounded time, and the process keeps serving.
  node.Kill();
  {
    auto c = OpenEngine(Client(node.port));
    const auto t0 = std::chrono::steady_clock::now();
    auto r = c->runtime().Generate({Question(13)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 0);
    EXPECT_EQ((*r)[0].ids, Cold(13));
    c->runtime().DrainPrefixStores();
    EXPECT_EQ(c->runtime().stats().prefix_store_errors, 1);  // its own capture could not be stored
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 60s);
  }
  // Restarted on its directory: what it acknowledged before the kill is there.
  ASSERT_TRUE(node.Start(dir, secret_file));
  {
    auto d = OpenEngine(Client(node.port));
    auto r = d->runtime().Generate({Question(14)});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)[0].cached_prompt_tokens, 151);
    EXPECT_EQ((*r)[0].ids, Cold(14));
  }
}

TEST(StoreNodeClientTest, TheClientIsADocumentStore) {
  storage::testing::TempDir tmp;
  storage::SegmentStoreOptions so;
  so.path = tmp.path() + "/db";
  so.sync_commit = false;
  so.block_bytes = 4096;
  auto store = storage::SegmentStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status();
  transport::StoreNodeOptions no;
  no.service.reader_idle_seconds = 1;
  no.plane.secret = TestSecret();
  auto node = transport::StoreNode::Start(store->get(), no);
  ASSERT_TRUE(node.ok()) << node.status();
  auto c = Client((*node)->port());
  ASSERT_NE(c, nullptr);
  storage::DocumentStore& ds = *c;
  const Hash128 key = Hasher128().Update("doc").Digest();
  std::map<std::string, std::string> blobs = {{"meta", "v1"}, {"values", std::string(70000, 'v')}};
  for (size_t i = 0; i < blobs["values"].size(); ++i) blobs["values"][i] = static_cast<char>(i * 7);
  ASSERT_TRUE(ds.Put(key, "tenant", 151, blobs, {{"values", 8192}}).ok());
  auto info = ds.Info(key);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens, 151);
  EXPECT_EQ(info->cache_namespace, "tenant");
  auto layout = ds.Layout(key);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->size(), 2u);
  EXPECT_EQ((*layout)[1].name, "values");
  EXPECT_EQ((*layout)[1].block_bytes, 8192u);
  auto all = ds.Get(key);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(*all == blobs);
  auto some = ds.Get(key, {"meta"});
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(some->size(), 1u);
  EXPECT_EQ(ds.Get(key, {"nope"}).status().code(), StatusCode::kInvalidArgument);
  // A reader: ranged reads; the document stays while it is open.
  {
    auto reader = ds.OpenReader(key);
    ASSERT_TRUE(reader.ok()) << reader.status();
    std::string part(1000, '\0');
    ASSERT_TRUE((*reader)->Read("values", 12345, 1000, part.data()).ok());
    EXPECT_EQ(part, blobs["values"].substr(12345, 1000));
    EXPECT_FALSE((*reader)->Read("values", 69500, 1000, part.data()).ok());
    ASSERT_TRUE((*reader)->Size("values").ok());
    EXPECT_EQ(*(*reader)->Size("values"), 70000u);
    EXPECT_EQ(ds.Erase(key).code(), StatusCode::kFailedPrecondition);  // held by the reader
    EXPECT_EQ((*node)->open_readers(), 1);
  }
  EXPECT_EQ((*node)->open_readers(), 0);  // closed with the reader
  // A reader left open by a worker that died: closed when idle.
  {
    auto reader = ds.OpenReader(key);
    ASSERT_TRUE(reader.ok());
    EXPECT_EQ((*node)->open_readers(), 1);
    // Idle past reader_idle_seconds (1 s); any request sweeps idle readers.
    EXPECT_TRUE(Eventually([&] { return ds.Info(key).ok() && (*node)->open_readers() == 0; }, 20s,
                           "a request to sweep the idle reader"));
    std::string b(10, '\0');
    EXPECT_EQ((*reader)->Read("values", 0, 10, b.data()).code(), StatusCode::kNotFound);
  }
  ASSERT_TRUE(ds.Erase(key).ok());
  EXPECT_EQ(ds.Info(key).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(ds.OpenReader(key).status().code(), StatusCode::kNotFound);
  // Bad addresses.
  EXPECT_FALSE(transport::RemoteDocumentStore::ParseAddress("localhost").ok());
  EXPECT_FALSE(transport::RemoteDocumentStore::ParseAddress("h:0").ok());
  EXPECT_FALSE(transport::RemoteDocumentStore::ParseAddress("h:99999").ok());
  EXPECT_FALSE(transport::RemoteDocumentStore::ParseAddress("h:1x").ok());
  auto ok = transport::RemoteDocumentStore::ParseAddress("10.0.0.2:7800");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->host, "10.0.0.2");
  EXPECT_EQ(ok->port, 7800);
}

// A reader's blocks read through the node land in the caller's buffers
// (many pieces per message, scattered, from several threads over the
// client's connections); a damaged block on the node is detected there and
// named in the reader's error, and a read past the blob is refused.
TEST(StoreNodeClientTest, ReadsLandInTheCallersBuffersAndADamagedBlockIsNamed) {
  storage::testing::TempDir tmp;
  storage::SegmentStoreOptions so;
  so.path = tmp.path() + "/db";
  so.sync_commit = true;
  const size_t kBlock = 16384, kBlocks = 96;
  std::string values(kBlock * kBlocks - 1000, '\0');  // a short last block
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<char>((i * 2654435761u) >> 13);
  const Hash128 key = Hasher128().Update("scattered").Digest();
  {
    auto store = storage::SegmentStore::Open(so);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Put(key, "", 1, {{"values", values}}, {{"values", kBlock}}).ok());
    ASSERT_TRUE((*store)->Flush().ok());
    transport::StoreNodeOptions no;
    no.plane.secret = TestSecret();
    auto node = transport::StoreNode::Start(store->get(), no);
    ASSERT_TRUE(node.ok()) << node.status();
    transport::RemoteStoreOptions o;
    o.port = (*node)->port();
    o.call_timeout = 10s;
    o.plane.secret = TestSecret();
    o.plane.connections = 3;
    auto c = transport::RemoteDocumentStore::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    auto reader = (*c)->OpenReader(key);
    ASSERT_TRUE(reader.ok()) << reader.status();
    ASSERT_EQ((*reader)->batch_blocks(), 64);
    std::vector<char> dst(values.size(), 0);
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        // Thread t reads blocks t, t+4, ... (backwards), in pieces of 64.
        std::vector<storage::BlobReader::Piece> pieces;
        for (size_t b = kBlocks; b-- > 0;) {
          if (b % 4 != static_cast<size_t>(t)) continue;
          const uint64_t off = b * kBlock;
          pieces.push_back({off, std::min<uint64_t>(kBlock, values.size() - off), dst.data() + off});
        }
        if (!(*reader)->ReadMany("values", pieces).ok()) ++failures;
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(failures.load(), 0);
    EXPECT_TRUE(std::memcmp(dst.data(), values.data(), values.size()) == 0) << "wrong bytes";
    // A whole read (one message) into a fresh buffer.
    std::string whole(values.size(), '\0');
    ASSERT_TRUE((*reader)->Read("values", 0, whole.size(), whole.data()).ok());
    EXPECT_TRUE(whole == values);
    // A blob of several read chunks (16 MiB) comes back whole, its chunks
    // over the connections at once.
    std::string big(size_t{40} << 20, '\0');
    for (size_t i = 0; i < big.size(); i += 8) {
      const uint64_t v = i * 0x9E3779B97F4A7C15ull;
      std::memcpy(big.data() + i, &v, 8);
    }
    const Hash128 big_key = Hasher128().Update("big").Digest();
    ASSERT_TRUE((*c)->Put(big_key, "", 1, {{"big", big}}, {{"big", size_t{1} << 20}}).ok());
    auto got = (*c)->Get(big_key);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->at("big") == big);
    // Past the blob: refused before anything is sent.
    std::vector<storage::BlobReader::Piece> past = {{values.size() - 10, 20, whole.data()}};
    EXPECT_EQ((*reader)->ReadMany("values", past).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ((*node)->plane_stats().handshakes, 3);  // every connection of the client was used
    EXPECT_EQ((*node)->plane_stats().frames_rejected, 0);
  }
  // Damage the stored values, then read them through a node again.
  ASSERT_GT(storage::testing::FlipBytesInFiles(so.path, ".blob", 8), 0) << "no blob file to damage";
  auto store = storage::SegmentStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status();
  transport::StoreNodeOptions no;
  no.plane.secret = TestSecret();
  auto node = transport::StoreNode::Start(store->get(), no);
  ASSERT_TRUE(node.ok()) << node.status();
  auto c = Client((*node)->port());
  ASSERT_NE(c, nullptr);
  auto reader = c->OpenReader(key);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<char> dst(values.size());
  std::vector<storage::BlobReader::Piece> pieces;
  for (size_t b = 0; b < kBlocks; ++b) {
    const uint64_t off = b * kBlock;
    pieces.push_back({off, std::min<uint64_t>(kBlock, values.size() - off), dst.data() + off});
  }
  Status first;
  for (size_t i = 0; i < pieces.size() && first.ok(); i += 64) {
    first = (*reader)->ReadMany("values", std::span(pieces).subspan(i, std::min<size_t>(64, pieces.size() - i)));
  }
  ASSERT_EQ(first.code(), StatusCode::kCorruption) << first;
  EXPECT_NE(first.message().find("blob 'values'"), std::string::npos) << first;
  EXPECT_NE(first.message().find(key.Hex()), std::string::npos) << first;
  EXPECT_GT((*store)->stats().corruptions_detected, 0);
}

// Two nodes, documents spread by key: each on one node, all readable; one
// node stopped costs only its own documents.
TEST(StoreNodeClientTest, DocumentsAreSpreadOverNodesByKey) {
  storage::testing::TempDir tmp;
  std::vector<std::unique_ptr<storage::SegmentStore>> stores;
  std::vector<std::unique_ptr<transport::StoreNode>> nodes;
  std::string addresses;
  for (int i = 0; i < 2; ++i) {
    storage::SegmentStoreOptions so;
    so.path = tmp.path() + "/db" + std::to_string(i);
    so.sync_commit = false;
    auto st = storage::SegmentStore::Open(so);
    ASSERT_TRUE(st.ok()) << st.status();
    stores.push_back(std::move(*st));
    auto n = transport::StoreNode::Start(stores.back().get(), {});
    ASSERT_TRUE(n.ok()) << n.status();
    addresses += (i ? "," : "") + std::string("127.0.0.1:") + std::to_string((*n)->port());
    nodes.push_back(std::move(*n));
  }
  auto ds = transport::ConnectStoreNodes(addresses);  // plain: the nodes have no secret
  ASSERT_TRUE(ds.ok()) << ds.status();
  auto* sharded = dynamic_cast<transport::ShardedDocumentStore*>(ds->get());
  ASSERT_NE(sharded, nullptr);
  std::vector<Hash128> keys;
  for (int i = 0; i < 24; ++i) {
    keys.push_back(Hasher128().Update("doc" + std::to_string(i)).Digest());
    Status put = (*ds)->Put(keys.back(), "", i + 1, {{"b", std::string(100 + i, static_cast<char>(i))}});
    ASSERT_TRUE(put.ok()) << put;
  }
  EXPECT_GT(stores[0]->Keys().size(), 3u);
  EXPECT_GT(stores[1]->Keys().size(), 3u);
  EXPECT_EQ(stores[0]->Keys().size() + stores[1]->Keys().size(), keys.size());
  for (int i = 0; i < 24; ++i) {
    auto got = (*ds)->Get(keys[i]);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->at("b"), std::string(100 + i, static_cast<char>(i)));
    const int on = sharded->NodeOf(keys[i]) == addresses.substr(0, addresses.find(',')) ? 0 : 1;
    EXPECT_TRUE(stores[on]->Contains(keys[i]));
  }
  nodes[1]->Stop();
  for (int i = 0; i < 24; ++i) {
    auto info = (*ds)->Info(keys[i]);
    if (stores[0]->Contains(keys[i])) {
      EXPECT_TRUE(info.ok()) << info.status();
    } else {
      EXPECT_FALSE(info.ok());
    }
  }
  EXPECT_FALSE(transport::ConnectStoreNodes("127.0.0.1:1,127.0.0.1:1").ok());  // the same node twice
  EXPECT_FALSE(transport::ConnectStoreNodes("").ok());
  // A node off loopback needs the secret (or --insecure).
  auto remote = transport::ConnectStoreNodes("10.0.0.2:7800");
  EXPECT_EQ(remote.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(remote.status().message().find("cluster secret"), std::string::npos) << remote.status();
  transport::UcxClientOptions sealed;
  sealed.secret = TestSecret();
  EXPECT_TRUE(transport::ConnectStoreNodes("10.0.0.2:7800", sealed).ok());  // connects at its first call
  EXPECT_TRUE(transport::ConnectStoreNodes("10.0.0.2:7800", {}, /*allow_plaintext_remote=*/true).ok());
}

namespace st = rpc::store;

template <typename T>
std::string Ser(const T& t) {
  auto buf = std::make_shared<apache::thrift::transport::TMemoryBuffer>();
  apache::thrift::protocol::TBinaryProtocol proto(buf);
  t.write(&proto);
  return buf->getBufferAsString();
}
template <typename T>
T De(const std::string& bytes) {
  auto buf = std::make_shared<apache::thrift::transport::TMemoryBuffer>();
  buf->write(reinterpret_cast<const uint8_t*>(bytes.data()), static_cast<uint32_t>(bytes.size()));
  apache::thrift::protocol::TBinaryProtocol proto(buf);
  T t;
  t.read(&proto);
  return t;
}
st::StoreKey KeyOf(const Hash128& h) {
  st::StoreKey k;
  k.hi = static_cast<int64_t>(h.hi);
  k.lo = static_cast<int64_t>(h.lo);
  return k;
}

// A node in this process over a store in `dir`, sealed.
struct LocalNode {
  std::unique_ptr<storage::SegmentStore> store;
  std::unique_ptr<transport::StoreNode> node;
  LocalNode(const std::string& dir, transport::StoreServiceOptions service = {}, size_t capacity = size_t{64} << 20) {
    storage::SegmentStoreOptions so;
    so.path = dir;
    so.sync_commit = false;
    so.capacity_bytes = capacity;
    so.namespace_quota_bytes["small"] = 1 << 20;
    auto s = storage::SegmentStore::Open(so);
    EXPECT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
    transport::StoreNodeOptions no;
    no.plane.secret = TestSecret();
    no.service = service;
    auto n = transport::StoreNode::Start(store.get(), no);
    EXPECT_TRUE(n.ok()) << n.status();
    node = std::move(*n);
  }
};

TEST(StoreNodeClientTest, HandlesAreRandomAndBoundToTheirClient) {
  storage::testing::TempDir tmp;
  LocalNode n(tmp.path() + "/db");
  auto alice = Client(n.node->port()), mallory = Client(n.node->port());
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(mallory, nullptr);
  const Hash128 key = Hasher128().Update("alice's document").Digest();
  const std::string secret_bytes(5000, 'A');
  ASSERT_TRUE(alice->Put(key, "tenant-a", 10, {{"v", secret_bytes}}).ok());

  st::StoreRequest open;
  open.key = KeyOf(key);
  auto opened = alice->Call(st::StoreMethod::OPEN, Ser(open));
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string reader = De<st::StoreReply>(*opened).reader;
  EXPECT_EQ(reader.size(), 32u);  // 128 random bits, hex
  auto second = alice->Call(st::StoreMethod::OPEN, Ser(open));
  ASSERT_TRUE(second.ok());
  EXPECT_NE(De<st::StoreReply>(*second).reader, reader);
  st::StoreRequest read;
  read.reader = reader;
  read.blob = "v";
  read.offsets = {0};
  read.lengths = {100};
  // Alice reads through her reader.
  auto mine = alice->Call(st::StoreMethod::READV, Ser(read));
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(*mine, secret_bytes.substr(0, 100));
  // Mallory, another client with the secret, holds her handle: nothing.
  auto theirs = mallory->Call(st::StoreMethod::READV, Ser(read));
  EXPECT_EQ(theirs.status().code(), StatusCode::kNotFound) << theirs.status();
  st::StoreRequest close;
  close.reader = reader;
  EXPECT_EQ(mallory->Call(st::StoreMethod::CLOSE, Ser(close)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(n.node->open_readers(), 2);
  // Guessed handles: nothing, whoever guesses.
  for (int i = 0; i < 100; ++i) {
    read.reader = RandomHandle();
    ASSERT_EQ(mallory->Call(st::StoreMethod::READV, Ser(read)).status().code(), StatusCode::kNotFound);
    ASSERT_EQ(alice->Call(st::StoreMethod::READV, Ser(read)).status().code(), StatusCode::kNotFound);
  }
  for (const char* guess : {"1", "2", "0", ""}) {  // what sequential ids looked like
    read.reader = guess;
    EXPECT_EQ(mallory->Call(st::StoreMethod::READV, Ser(read)).status().code(), StatusCode::kNotFound);
  }
  ASSERT_TRUE(alice->Call(st::StoreMethod::CLOSE, Ser(close)).ok());
  EXPECT_EQ(n.node->open_readers(), 1);

  // An upload: another client can neither add to it nor commit it.
  st::StoreRequest begin;
  begin.key = KeyOf(Hasher128().Update("upload").Digest());
  begin.cache_namespace = "tenant-a";
  begin.tokens = 3;
  begin.sizes["v"] = 1000;
  auto begun = alice->Call(st::StoreMethod::PUT_BEGIN, Ser(begin));
  ASSERT_TRUE(begun.ok()) << begun.status();
  const std::string upload = De<st::StoreReply>(*begun).upload;
  EXPECT_EQ(upload.size(), 32u);
  st::StoreRequest part;
  part.upload = upload;
  part.blob = "v";
  part.offset = 0;
  part.data = std::string(1000, 'M');
  EXPECT_EQ(mallory->Call(st::StoreMethod::PUT_PART, Ser(part)).status().code(), StatusCode::kNotFound);
  st::StoreRequest commit;
  commit.upload = upload;
  EXPECT_EQ(mallory->Call(st::StoreMethod::PUT_COMMIT, Ser(commit)).status().code(), StatusCode::kNotFound);
  part.data = std::string(1000, 'a');
  ASSERT_TRUE(alice->Call(st::StoreMethod::PUT_PART, Ser(part)).ok());
  ASSERT_TRUE(alice->Call(st::StoreMethod::PUT_COMMIT, Ser(commit)).ok());
  auto stored = alice->Get(Hasher128().Update("upload").Digest());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->at("v"), std::string(1000, 'a'));
}

TEST(StoreNodeClientTest, UploadsAreBoundedBeforeAnythingIsAllocated) {
  storage::testing::TempDir tmp;
  transport::StoreServiceOptions so;
  so.max_uploads = 2;
  so.max_upload_bytes = 4 << 20;
  so.upload_idle_seconds = 1;
  so.max_blobs = 8;
  LocalNode n(tmp.path() + "/db", so, size_t{16} << 20);
  auto c = Client(n.node->port());
  ASSERT_NE(c, nullptr);
  const Hash128 kept = Hasher128().Update("kept").Digest();
  ASSERT_TRUE(c->Put(kept, "", 1, {{"v", std::string(3000, 'k')}}).ok());
  auto begin = [&](const std::string& ns, std::map<std::string, int64_t> sizes,
                   std::map<std::string, int64_t> bb = {}) {
    st::StoreRequest q;
    q.key = KeyOf(Hasher128().Update(ns).Update(std::to_string(sizes.size())).Digest());
    q.cache_namespace = ns;
    q.tokens = 1;
    q.sizes = std::move(sizes);
    q.block_bytes = std::move(bb);
    return c->Call(st::StoreMethod::PUT_BEGIN, Ser(q));
  };
  // 1 TiB, past the capacity; past a namespace's quota; sizes that make no sense.
  auto tib = begin("", {{"v", int64_t{1} << 40}});
  EXPECT_EQ(tib.status().code(), StatusCode::kResourceExhausted) << tib.status();
  EXPECT_NE(tib.status().message().find("capacity"), std::string::npos) << tib.status();
  EXPECT_EQ(begin("small", {{"v", 2 << 20}}).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(begin("", {{"v", -1}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(begin("", {{"", 10}}).status().code(), StatusCode::kInvalidArgument);
  std::map<std::string, int64_t> many;
  for (int i = 0; i < 9; ++i) many["b" + std::to_string(i)] = 1;
  EXPECT_EQ(begin("", many).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(begin("", {{"v", 10}}, {{"w", 4096}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(begin("", {{"v", 10}}, {{"v", 1}}).status().code(), StatusCode::kInvalidArgument);
  // Bytes in flight: 3 MiB fits, 2 MiB more does not (4 MiB); uploads in flight: 2.
  auto a = begin("a", {{"v", 3 << 20}});
  ASSERT_TRUE(a.ok()) << a.status();
  auto over = begin("b", {{"v", 2 << 20}});
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("max_upload_bytes"), std::string::npos) << over.status();
  auto b = begin("b", {{"v", 1000}});
  ASSERT_TRUE(b.ok()) << b.status();
  auto third = begin("c", {{"v", 10}});
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted) << third.status();
  EXPECT_NE(third.status().message().find("uploads in flight"), std::string::npos) << third.status();
  EXPECT_EQ(n.node->service().upload_bytes(), (3u << 20) + 1000u);
  // Parts: within the blob only; a repeated part does not count twice.
  st::StoreRequest part;
  part.upload = De<st::StoreReply>(*b).upload;
  part.blob = "v";
  part.offset = 900;
  part.data = std::string(200, 'x');
  EXPECT_EQ(c->Call(st::StoreMethod::PUT_PART, Ser(part)).status().code(), StatusCode::kInvalidArgument);
  part.offset = -1;
  part.data = "x";
  EXPECT_EQ(c->Call(st::StoreMethod::PUT_PART, Ser(part)).status().code(), StatusCode::kInvalidArgument);
  part.offset = int64_t{1} << 62;
  EXPECT_EQ(c->Call(st::StoreMethod::PUT_PART, Ser(part)).status().code(), StatusCode::kInvalidArgument);
  part.blob = "w";
  part.offset = 0;
  EXPECT_EQ(c->Call(st::StoreMethod::PUT_PART, Ser(part)).status().code(), StatusCode::kInvalidArgument);
  part.blob = "v";
  part.data = std::string(500, 'x');
  ASSERT_TRUE(c->Call(st::StoreMethod::PUT_PART, Ser(part)).ok());
  ASSERT_TRUE(c->Call(st::StoreMethod::PUT_PART, Ser(part)).ok());  // again: still 500 of 1000
  st::StoreRequest commit;
  commit.upload = part.upload;
  auto lacking = c->Call(st::StoreMethod::PUT_COMMIT, Ser(commit));
  EXPECT_EQ(lacking.status().code(), StatusCode::kFailedPrecondition) << lacking.status();
  EXPECT_NE(lacking.status().message().find("lacks 500"), std::string::npos) << lacking.status();
  // An upload left idle is dropped, and its bytes with it.
  const auto t0 = std::chrono::steady_clock::now();
  while (n.node->service().open_uploads() > 0 && std::chrono::steady_clock::now() - t0 < 10s) {
    std::this_thread::sleep_for(200ms);
    ASSERT_TRUE(c->Info(kept).ok());  // requests sweep
  }
  EXPECT_EQ(n.node->service().open_uploads(), 0);
  EXPECT_EQ(n.node->service().upload_bytes(), 0u);
  part.upload = De<st::StoreReply>(*a).upload;
  part.offset = 0;
  EXPECT_EQ(c->Call(st::StoreMethod::PUT_PART, Ser(part)).status().code(), StatusCode::kNotFound);
  // Nothing stored was lost, and the node serves on.
  auto got = c->Get(kept);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->at("v"), std::string(3000, 'k'));
  EXPECT_EQ(n.store->Keys().size(), 1u);
  // Unknown methods and bytes that are no request.
  EXPECT_EQ(c->Call(99, Ser(st::StoreRequest())).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Call(st::StoreMethod::INFO, std::string("\xff\xff\xff\xff garbage", 12)).status().code(),
            StatusCode::kInvalidArgument);
}

// Requests are walked as Thrift's generated reader would read them before
// Thrift reads them: truncated messages, type bytes Thrift does not define
// (which its reader casts to an enum first: undefined behaviour) and
// container elements of other types than the IDL's are refused with
// InvalidArgument, never read.
TEST(StoreNodeClientTest, MalformedMessagesAreRefusedBeforeThriftReadsThem) {
  using namespace std::string_literals;
  st::StoreRequest q;
  q.key = KeyOf(Hasher128().Update("k").Digest());
  q.cache_namespace = "ns";
  q.tokens = 3;
  q.sizes = {{"a", 1}, {"b", 2}};
  q.block_bytes = {{"a", 4096}};
  q.upload = RandomHandle();
  q.reader = RandomHandle();
  q.blob = "a";
  q.offset = 5;
  q.data = "bytes";
  q.offsets = {1, 2};
  q.lengths = {3, 4};
  const std::string whole = Ser(q);
  EXPECT_TRUE(transport::IsWellFormedStoreMessage(whole, true));
  for (size_t n = 0; n < whole.size(); ++n) {
    ASSERT_FALSE(transport::IsWellFormedStoreMessage(whole.substr(0, n), true)) << "truncated at " << n;
  }
  // A type byte Thrift does not define, at a field and inside a container.
  std::string bad = whole;
  bad[0] = 0x21;
  EXPECT_FALSE(transport::IsWellFormedStoreMessage(bad, true));
  // Field 4 (map<string, i64>) announcing bool values: Thrift reads i64s
  // anyway, so the bytes after are read as it would, and here they end early.
  const std::string mismatched = "\x0d\x00\x04\x0b\x02\x00\x00\x00\x01"s + "\x00\x00\x00\x01x"s + "\x01\x00"s;
  EXPECT_FALSE(transport::IsWellFormedStoreMessage(mismatched, true));
  // ... and where the bytes after decode, as a field of an undefined type.
  const std::string undefined =
      "\x0d\x00\x04\x0b\x02\x00\x00\x00\x01"s + "\x00\x00\x00\x01x"s + std::string(8, '\0') + "\x21\x00\x01\x00"s;
  EXPECT_FALSE(transport::IsWellFormedStoreMessage(undefined, true));
  EXPECT_TRUE(transport::IsWellFormedStoreMessage(undefined.substr(0, undefined.size() - 4) + '\0', true))
      << "the same bytes ending with a stop are a message (Thrift reads it)";
  // Negative sizes; unknown fields are walked as the wire says.
  EXPECT_FALSE(transport::IsWellFormedStoreMessage("\x0b\x00\x02\xff\xff\xff\xff\x00"s, true));
  EXPECT_TRUE(transport::IsWellFormedStoreMessage("\x0f\x00\x63\x08\x00\x00\x00\x01\x00\x00\x00\x07\x00"s, true));
  // Through the node: a typed error, and the node serves on.
  storage::testing::TempDir tmp;
  LocalNode n(tmp.path() + "/db");
  auto c = Client(n.node->port());
  ASSERT_NE(c, nullptr);
  for (const std::string& m : {bad, mismatched, undefined}) {
    EXPECT_EQ(c->Call(st::StoreMethod::PUT_BEGIN, m).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(c->Put(Hasher128().Update("fine").Digest(), "", 1, {{"v", "fine"}}).ok());
}

}  // namespace
}  // namespace penumbra
