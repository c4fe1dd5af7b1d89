// Value-store nodes with real processes (label distributed): penumbra-store
// serving a RocksDB directory over UCX on loopback, and CPU engines
// (stories260K, shadowkv, values read lazily) keeping their documents on it.
// A document stored through one engine answers another engine's question
// with the cold request's tokens; a node killed with SIGKILL costs the next
// request only its reuse (it is computed, with the cold tokens, in bounded
// time); the node restarted on its directory serves what it acknowledged.
// Also: the client as a DocumentStore (put, layout, info, get, ranged
// reads, erase, errors) against a node in this process.
#include "transport/store_node.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "storage/lazy_blob.h"
#include "tests/storage/segment_store_test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

using namespace std::chrono_literals;
using testing::LcgTokens;

std::string BinDir() { return std::filesystem::read_symlink("/proc/self/exe").parent_path().string(); }

// A penumbra-store process on `dir`.
struct NodeProcess {
  pid_t pid = -1;
  int port = 0;
  bool Start(const std::string& dir) {
    const std::string port_file = dir + ".port.json";
    std::filesystem::remove(port_file);
    pid = fork();
    if (pid == 0) {
      const std::string bin = BinDir() + "/penumbra-store";
      execl(bin.c_str(), "penumbra-store", "--path", dir.c_str(), "--port-file", port_file.c_str(),
            static_cast<char*>(nullptr));
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

std::shared_ptr<transport::RemoteDocumentStore> Client(int port) {
  transport::RemoteStoreOptions o;
  o.port = port;
  o.call_timeout = 10s;
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
  r.segment_ends = {151};
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
  NodeProcess node;
  ASSERT_TRUE(node.Start(dir));

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
  ASSERT_TRUE(node.Start(dir));
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
  no.reader_idle_seconds = 1;
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
    std::this_thread::sleep_for(1200ms);
    EXPECT_TRUE(ds.Info(key).ok());  // any request sweeps idle readers
    EXPECT_EQ((*node)->open_readers(), 0);
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
  auto ds = transport::ConnectStoreNodes(addresses);
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
}

}  // namespace
}  // namespace penumbra
