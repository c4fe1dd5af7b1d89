// Value-store nodes (issue 21): a process holding stored documents (the
// document cache's persistent tier: storage::SegmentStore, RocksDB on local
// disk) serves them to workers over the UCX plane (transport/ucx_rpc.h), and
// workers reach it through RemoteDocumentStore, a storage::DocumentStore:
// the worker's runtime reads a document from a node as it reads one from its
// own disk (whole, the blobs it names, or lazily block by block through a
// reader), with its memory tiers in front.
//
// Integrity: blocks are checked where they are stored (SegmentStore) and
// every message is checked on arrival (ucx_rpc). Failure: a call that
// cannot reach the node is Unavailable after its deadline at most, and
// idempotent calls are tried once more on a new connection first; a worker
// whose node is gone computes what it cannot read. A reader a worker opens
// keeps the document in place on the node; one left idle (its worker died)
// is closed after reader_idle_seconds.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "storage/document_store.h"
#include "storage/segment_store.h"
#include "transport/ucx_rpc.h"

namespace penumbra::transport {

struct StoreNodeOptions {
  std::string host = "127.0.0.1";
  int port = 0;                     // 0: one the OS picks
  int threads = 8;                  // requests served at once (disk reads)
  double reader_idle_seconds = 120;  // an idle reader is closed (its document released)
};

// Serves `store` (not owned; outlives the node).
class StoreNode {
 public:
  static Result<std::unique_ptr<StoreNode>> Start(storage::SegmentStore* store, const StoreNodeOptions& options);
  ~StoreNode();
  int port() const { return server_->port(); }
  int64_t open_readers() const;
  // Stops serving (the UCX server) and releases every reader.
  void Stop();

 private:
  StoreNode(storage::SegmentStore* store, const StoreNodeOptions& options) : store_(store), o_(options) {}
  Result<std::string> Handle(uint32_t method, std::string payload);
  void CloseIdleReaders();
  // Reader `id`, marked used; NotFound when closed (or idle too long).
  Result<std::shared_ptr<storage::BlobReader>> UseReader(int64_t id);

  storage::SegmentStore* store_;
  StoreNodeOptions o_;
  std::unique_ptr<UcxServer> server_;
  struct Reader {
    std::shared_ptr<storage::BlobReader> reader;
    std::chrono::steady_clock::time_point used;
  };
  // A document coming in parts (PUT_BEGIN, PUT_PART..., PUT_COMMIT).
  struct Upload {
    Hash128 key;
    std::string ns;
    int64_t tokens = 0;
    std::map<std::string, std::string> blobs;
    std::map<std::string, size_t> block_bytes;
    uint64_t missing = 0;  // bytes not received yet
    std::chrono::steady_clock::time_point used;
  };
  mutable std::mutex mu_;
  std::map<int64_t, Reader> readers_;
  std::map<int64_t, Upload> uploads_;
  int64_t next_reader_ = 1;  // reader and upload ids
};

struct RemoteStoreOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::chrono::milliseconds call_timeout{30000};
};

class RemoteDocumentStore final : public storage::DocumentStore,
                                  public std::enable_shared_from_this<RemoteDocumentStore> {
 public:
  // Connects lazily (the first call); InvalidArgument for a bad address.
  static Result<std::shared_ptr<RemoteDocumentStore>> Connect(const RemoteStoreOptions& options);
  // "host:port" -> options (InvalidArgument naming what is wrong).
  static Result<RemoteStoreOptions> ParseAddress(const std::string& address);

  Status Put(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
             const std::map<std::string, std::string>& blobs,
             const std::map<std::string, size_t>& blob_block_bytes = {}) override;
  Result<std::map<std::string, std::string>> Get(const Hash128& key) override;
  Result<std::map<std::string, std::string>> Get(const Hash128& key, const std::set<std::string>& only) override;
  Result<std::vector<storage::BlobLayout>> Layout(const Hash128& key) const override;
  Result<storage::SegmentInfo> Info(const Hash128& key) const override;
  Status Erase(const Hash128& key) override;
  Result<std::shared_ptr<storage::BlobReader>> OpenReader(const Hash128& key) override;

  // One call: the request (serialized), retried once on Unavailable.
  Result<std::string> Call(uint32_t method, const std::string& request) const;

 private:
  explicit RemoteDocumentStore(const RemoteStoreOptions& o, std::unique_ptr<UcxClient> c)
      : o_(o), client_(std::move(c)) {}
  // The blobs named in *only, or all (null), through one reader.
  Result<std::map<std::string, std::string>> ReadBlobs(const Hash128& key, const std::set<std::string>* only);
  RemoteStoreOptions o_;
  std::unique_ptr<UcxClient> client_;
};

// Documents spread over several nodes: each key lives on one node, the one
// whose name (its address) hashes highest with the key (rendezvous hashing:
// adding or removing a node moves only that node's documents). A node that
// is down costs only its documents' reuse.
class ShardedDocumentStore final : public storage::DocumentStore {
 public:
  // nodes: (name, store), at least one, names distinct.
  static Result<std::shared_ptr<ShardedDocumentStore>> Create(
      std::vector<std::pair<std::string, std::shared_ptr<storage::DocumentStore>>> nodes);
  // The name of the node holding `key`.
  const std::string& NodeOf(const Hash128& key) const { return nodes_[Pick(key)].first; }

  Status Put(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
             const std::map<std::string, std::string>& blobs,
             const std::map<std::string, size_t>& blob_block_bytes = {}) override {
    return At(key).Put(key, cache_namespace, tokens, blobs, blob_block_bytes);
  }
  Result<std::map<std::string, std::string>> Get(const Hash128& key) override { return At(key).Get(key); }
  Result<std::map<std::string, std::string>> Get(const Hash128& key, const std::set<std::string>& only) override {
    return At(key).Get(key, only);
  }
  Result<std::vector<storage::BlobLayout>> Layout(const Hash128& key) const override { return At(key).Layout(key); }
  Result<storage::SegmentInfo> Info(const Hash128& key) const override { return At(key).Info(key); }
  Status Erase(const Hash128& key) override { return At(key).Erase(key); }
  Result<std::shared_ptr<storage::BlobReader>> OpenReader(const Hash128& key) override {
    return At(key).OpenReader(key);
  }

 private:
  explicit ShardedDocumentStore(std::vector<std::pair<std::string, std::shared_ptr<storage::DocumentStore>>> n)
      : nodes_(std::move(n)) {}
  size_t Pick(const Hash128& key) const;
  storage::DocumentStore& At(const Hash128& key) const { return *nodes_[Pick(key)].second; }
  std::vector<std::pair<std::string, std::shared_ptr<storage::DocumentStore>>> nodes_;
};

// "HOST:PORT[,HOST:PORT...]" -> one node's client, or a sharded store over
// several (InvalidArgument naming a bad address or a repeated one).
Result<std::shared_ptr<storage::DocumentStore>> ConnectStoreNodes(const std::string& addresses);

}  // namespace penumbra::transport
