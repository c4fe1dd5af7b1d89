// Value-store nodes (issue 21): a process holding stored documents (the
// document cache's persistent tier: storage::SegmentStore, RocksDB on local
// disk) serves them to workers over the UCX plane (transport/ucx_rpc.h), and
// workers reach it through RemoteDocumentStore, a storage::DocumentStore:
// the worker's runtime reads a document from a node as it reads one from its
// own disk (whole, the blobs it names, or lazily block by block through a
// reader), with its memory tiers in front.
//
// Integrity and security: blocks are checked where they are stored
// (SegmentStore); every message is authenticated and encrypted with the
// cluster secret, or checksummed without one (ucx_rpc.h; plain only on
// loopback). Readers and uploads are 128-bit random handles bound to the
// client that opened them (its plane client id: proved with the secret;
// without one, claimed in the handshake): another client's handle, or a
// guessed one, is NotFound. Every request is bounded before anything is
// allocated for it (an upload's sizes against the store's capacity and
// namespace quota, the uploads and upload bytes in flight, a part's range
// against its blob) and answered with a typed error on bad input, never an
// exception: the node keeps serving and nothing stored is lost. What the
// plane does not do: tell tenants apart (any client holding the secret may
// read or erase any document; tenants are kept apart by keys they cannot
// compute, worker/engine/document_keys.h).
//
// Failure: every call has a deadline (call_timeout, plus the time its bytes
// take at bulk_bytes_per_second): a node that does not answer by then fails
// it DeadlineExceeded (the endpoint stays usable: a late reply is dropped); a
// call that cannot reach the node is Unavailable, and is tried once more on a
// new connection first. Each node has a circuit breaker (circuit_breaker.h):
// after a few consecutive calls it did not answer, its calls fail at once
// (Unavailable, naming the node) for a cool-down, then one probe decides. A
// worker whose node is gone or slow computes what it cannot read. A reader a worker opens keeps the document in place
// on the node; one left idle (its worker died) is closed after reader_idle_seconds, and an upload left idle is dropped
// after upload_idle_seconds.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "storage/document_store.h"
#include "storage/segment_store.h"
#include "transport/circuit_breaker.h"
#include "transport/ucx_rpc.h"

namespace penumbra::transport {

struct StoreServiceOptions {
  double reader_idle_seconds = 120;  // an idle reader is closed (its document released). Default: 120.
  double upload_idle_seconds = 120;  // an upload without a part for this long is dropped. Default: 120.
  int max_readers = 4096;            // readers open at once, node-wide. Default: 4096.
  int max_uploads = 64;              // uploads open at once, node-wide. Default: 64.
  // Bytes the open uploads declared, together (an upload's blobs are held
  // in memory until its commit); 0: half the machine's physical memory.
  // Default: 0.
  uint64_t max_upload_bytes = 0;
  int max_blobs = 4096;  // blobs of one upload. Default: 4096.
};

// The node's request handling without the network: StoreNode serves it over
// the UCX plane, the fuzzer (store_node/fuzz/store_node_fuzz.cc) calls it
// directly. Thread-safe.
class StoreService {
 public:
  // Serves `store` (not owned; outlives the service).
  StoreService(storage::SegmentStore* store, const StoreServiceOptions& options);
  // Answers one request (a StoreMethod, a serialized StoreRequest) from
  // `caller`. Never throws: bad input is InvalidArgument, a handle that is
  // unknown or another client's NotFound, what does not fit
  // ResourceExhausted naming the limit (out of memory included), anything
  // unexpected Internal.
  Result<std::string> Handle(const UcxCaller& caller, uint32_t method, std::string payload);
  int64_t open_readers() const;
  int64_t open_uploads() const;
  uint64_t upload_bytes() const;  // declared by the open uploads
  const StoreServiceOptions& options() const { return o_; }
  // Releases every reader and upload.
  void Clear();

 private:
  struct Reader {
    std::string owner;  // the client id that opened it
    std::shared_ptr<storage::BlobReader> reader;
    std::chrono::steady_clock::time_point used;
  };
  // A document coming in parts (PUT_BEGIN, PUT_PART..., PUT_COMMIT).
  struct Upload {
    std::string owner;
    Hash128 key;
    std::string ns;
    int64_t tokens = 0;
    std::map<std::string, uint64_t> sizes;
    std::map<std::string, size_t> block_bytes;
    uint64_t total = 0;                                            // declared bytes
    std::chrono::steady_clock::time_point used;                    // under mu_
    std::mutex mu;                                                 // the fields below
    std::map<std::string, std::string> blobs;                      // a blob's buffer, made at its first part
    std::map<std::string, std::map<uint64_t, uint64_t>> received;  // per blob: the ranges received, merged
    uint64_t received_bytes = 0;
  };
  Result<std::string> HandleRequest(const UcxCaller& caller, uint32_t method, std::string payload);
  // Closes idle readers and drops idle uploads (under mu_).
  void Sweep();
  // Reader `handle` of `caller`, marked used; NotFound when unknown,
  // another client's, or closed (idle too long).
  Result<std::shared_ptr<storage::BlobReader>> UseReader(const std::string& handle, const UcxCaller& caller);
  Result<std::shared_ptr<Upload>> UseUpload(const std::string& handle, const UcxCaller& caller);

  storage::SegmentStore* store_;
  StoreServiceOptions o_;
  mutable std::mutex mu_;
  std::map<std::string, Reader> readers_;
  std::map<std::string, std::shared_ptr<Upload>> uploads_;
  uint64_t upload_bytes_ = 0;
};

// Whether `bytes` begin with a well-formed StoreRequest (request) or
// StoreReply in Thrift's binary protocol, as the generated reader would read
// it: every type byte one Thrift defines, every size non-negative and within
// the bytes, known fields' elements of their IDL types, nesting bounded. The
// node walks every request (and the client every reply) with it before
// Thrift reads them: Thrift's reader casts type bytes to its enum before
// checking them (undefined behaviour on hostile bytes).
bool IsWellFormedStoreMessage(std::string_view bytes, bool request);

// The store plane's defaults for a node: 8 handler threads (disk reads),
// 4 UCX workers (UcxServerOptions's).
inline UcxServerOptions StorePlaneDefaults() {
  UcxServerOptions o;
  o.threads = 8;
  return o;
}

struct StoreNodeOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: one the OS picks
  // The UCX plane: its secret (none: plain, loopback only), handler threads
  // (requests served at once: disk reads), UCX workers, connection caps.
  // Default: 8 threads, 4 workers, no secret.
  UcxServerOptions plane = StorePlaneDefaults();
  StoreServiceOptions service;
};

// Serves `store` (not owned; outlives the node).
class StoreNode {
 public:
  static Result<std::unique_ptr<StoreNode>> Start(storage::SegmentStore* store, const StoreNodeOptions& options);
  ~StoreNode();
  int port() const { return server_->port(); }
  int64_t open_readers() const { return service_->open_readers(); }
  const StoreService& service() const { return *service_; }
  UcxServerStats plane_stats() const { return server_->stats(); }
  // Stops serving (the UCX server) and releases every reader.
  void Stop();

 private:
  StoreNode() = default;
  std::unique_ptr<StoreService> service_;
  std::unique_ptr<UcxServer> server_;
};

struct RemoteStoreOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  // A call's deadline (connecting included): past it the call fails
  // DeadlineExceeded. Default: 5 s.
  std::chrono::milliseconds call_timeout{5000};
  // Calls that move bytes (a part of an upload, a read) get bytes / this
  // much more time. Default: 64 MiB/s (a 64 MiB part: 1 s more).
  double bulk_bytes_per_second = 64.0 * (1 << 20);
  // When calls fail fast instead of waiting for a node that stopped
  // answering. Default: 3 failures, 5 s cool-down.
  CircuitBreakerOptions breaker;
  UcxClientOptions plane;  // the cluster secret (none: plain) and the plane's limits
  // A node off loopback without a secret is refused (its traffic would be
  // readable and forgeable) unless this is set (--insecure). Default: false.
  bool allow_plaintext_remote = false;
};

// A node's calls as its client saw them (monotonic counts, and the breaker now).
struct StoreNodeCallStats {
  std::string node;  // host:port
  CircuitBreaker::State breaker = CircuitBreaker::State::kClosed;
  int64_t calls = 0;     // sent to the node (tries, a retry counts again)
  int64_t failures = 0;  // ... of which it did not answer (Unavailable, DeadlineExceeded)
  int64_t timeouts = 0;  // ... of those, past their deadline
  int64_t rejected = 0;  // failed at once by the open breaker (never sent)
  int64_t opens = 0;     // times the breaker opened
};

class RemoteDocumentStore final : public storage::DocumentStore,
                                  public std::enable_shared_from_this<RemoteDocumentStore> {
 public:
  // Connects lazily (the first call); InvalidArgument for a bad address, or
  // a node off loopback without a secret (unless allow_plaintext_remote).
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

  // One call: the request (serialized), retried once on Unavailable; its
  // deadline is call_timeout plus `bulk_bytes` (what it moves besides the
  // request) and the request's size at bulk_bytes_per_second. Unavailable
  // at once while the node's breaker is open.
  Result<std::string> Call(uint32_t method, const std::string& request, uint64_t bulk_bytes = 0) const;
  // The same, the reply's body received in place into `into` (a READV's
  // blocks straight into the reader's destinations: UcxClient::CallInto);
  // a reply of another size than the parts' total is Corruption.
  Status CallInto(uint32_t method, const std::string& request, uint64_t bulk_bytes,
                  std::span<const ucx_frame::BodyPart> into) const;
  // The transports UCX chose for this client's connections (UcxClient::Transports).
  std::vector<std::string> Transports() const { return client_->Transports(); }
  int connections() const { return client_->connections(); }  // UcxClientOptions::connections
  StoreNodeCallStats call_stats() const;
  const std::string& name() const { return name_; }

 private:
  explicit RemoteDocumentStore(const RemoteStoreOptions& o, std::unique_ptr<UcxClient> c)
      : o_(o), name_(o.host + ":" + std::to_string(o.port)), client_(std::move(c)), breaker_(o.breaker) {}
  // One try through the breaker.
  Result<std::string> Try(uint32_t method, const std::string& request, std::chrono::milliseconds timeout,
                          const std::span<const ucx_frame::BodyPart>* into) const;
  Result<std::string> CallMaybeInto(uint32_t method, const std::string& request, uint64_t bulk_bytes,
                                    const std::span<const ucx_frame::BodyPart>* into) const;
  // The blobs named in *only, or all (null), through one reader.
  Result<std::map<std::string, std::string>> ReadBlobs(const Hash128& key, const std::set<std::string>* only);
  RemoteStoreOptions o_;
  std::string name_;
  std::unique_ptr<UcxClient> client_;
  mutable CircuitBreaker breaker_;
  mutable std::atomic<int64_t> calls_{0}, failures_{0}, timeouts_{0};
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
// several (InvalidArgument naming a bad address or a repeated one), each
// speaking the plane with `plane` (its cluster secret). A node off
// loopback without a secret is refused unless allow_plaintext_remote.
Result<std::shared_ptr<storage::DocumentStore>> ConnectStoreNodes(const std::string& addresses,
                                                                  const UcxClientOptions& plane = {},
                                                                  bool allow_plaintext_remote = false);
// The same, each node's client made with `calls` (its deadlines and breaker;
// host and port are the addresses'), the clients also in *nodes when given
// (their call_stats: the worker's metrics).
Result<std::shared_ptr<storage::DocumentStore>> ConnectStoreNodes(
    const std::string& addresses, const RemoteStoreOptions& calls,
    std::vector<std::shared_ptr<RemoteDocumentStore>>* nodes);

}  // namespace penumbra::transport
