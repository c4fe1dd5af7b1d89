#include "transport/store_node.h"

#include <glog/logging.h>
#include <thrift/TConfiguration.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <sstream>
#include <tuple>

#include "storage/lazy_blob.h"
#include "store_types.h"

namespace penumbra::transport {
namespace {

namespace st = rpc::store;
using apache::thrift::TConfiguration;
using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TMemoryBuffer;

constexpr uint64_t kMaxPart = uint64_t{64} << 20;  // bytes of one PUT_PART or READV

template <typename T>
std::string Serialize(const T& t) {
  auto buf = std::make_shared<TMemoryBuffer>();
  TBinaryProtocol proto(buf);
  t.write(&proto);
  return buf->getBufferAsString();
}

template <typename T>
Status Deserialize(const std::string& bytes, T* out, const char* what) {
  try {
    auto config = std::make_shared<TConfiguration>(INT_MAX, INT_MAX, 64);
    auto buf = std::make_shared<TMemoryBuffer>(reinterpret_cast<uint8_t*>(const_cast<char*>(bytes.data())),
                                               static_cast<uint32_t>(bytes.size()), TMemoryBuffer::OBSERVE, config);
    TBinaryProtocol proto(buf);
    proto.setStringSizeLimit(static_cast<int32_t>(kMaxPart + 4096));
    proto.setContainerSizeLimit(1 << 22);
    out->read(&proto);
  } catch (const std::exception& e) {
    return Status::InvalidArgument(std::string("store node: a malformed ") + what + ": " + e.what());
  }
  return Status::OK();
}

st::StoreKey ToKey(const Hash128& h) {
  st::StoreKey k;
  k.hi = static_cast<int64_t>(h.hi);
  k.lo = static_cast<int64_t>(h.lo);
  return k;
}
Hash128 FromKey(const st::StoreKey& k) {
  Hash128 h;
  h.hi = static_cast<uint64_t>(k.hi);
  h.lo = static_cast<uint64_t>(k.lo);
  return h;
}

std::vector<st::StoreBlobLayout> ToLayout(const std::vector<storage::BlobLayout>& in) {
  std::vector<st::StoreBlobLayout> out;
  for (const auto& b : in) {
    st::StoreBlobLayout l;
    l.name = b.name;
    l.size = static_cast<int64_t>(b.size);
    l.block_bytes = static_cast<int64_t>(b.block_bytes);
    l.blocks = static_cast<int32_t>(b.blocks);
    out.push_back(l);
  }
  return out;
}
Result<std::vector<storage::BlobLayout>> FromLayout(const std::vector<st::StoreBlobLayout>& in) {
  std::vector<storage::BlobLayout> out;
  for (const auto& l : in) {
    if (l.size < 0 || l.block_bytes <= 0 || l.blocks < 0) {
      return Status::Corruption("store node: a blob layout with negative sizes ('" + l.name + "')");
    }
    out.push_back({l.name, static_cast<uint64_t>(l.size), static_cast<size_t>(l.block_bytes),
                   static_cast<uint32_t>(l.blocks)});
  }
  return out;
}

// A reader of one segment on a node (its blobs' layout from OPEN); closes
// the node's reader when it goes.
class RemoteReader final : public storage::BlobReader {
 public:
  RemoteReader(std::shared_ptr<const RemoteDocumentStore> store, int64_t id, std::vector<storage::BlobLayout> layout)
      : store_(std::move(store)), id_(id), layout_(std::move(layout)) {}
  ~RemoteReader() override {
    st::StoreRequest q;
    q.reader = id_;
    Result<std::string> r = store_->Call(st::StoreMethod::CLOSE, Serialize(q));
    if (!r.ok()) VLOG(1) << "store node: closing reader " << id_ << ": " << r.status();
  }
  // As READV pieces of at most 64 MiB (a whole blob comes back this way).
  Status Read(const std::string& blob, uint64_t offset, uint64_t length, void* dst) override {
    std::vector<Piece> pieces;
    for (uint64_t done = 0; done < length; done += kMaxPart) {
      pieces.push_back({offset + done, std::min(kMaxPart, length - done), static_cast<char*>(dst) + done});
    }
    return ReadMany(blob, pieces);
  }
  // One message per 64 MiB of pieces (a decode step's or a restore's blocks).
  Status ReadMany(const std::string& blob, std::span<const Piece> pieces) override {
    PENUMBRA_ASSIGN_OR_RETURN(uint64_t size, Size(blob));
    for (size_t i = 0; i < pieces.size();) {
      st::StoreRequest q;
      q.reader = id_;
      q.blob = blob;
      uint64_t total = 0;
      size_t j = i;
      for (; j < pieces.size() && (j == i || total + pieces[j].length <= kMaxPart); ++j) {
        const Piece& p = pieces[j];
        if (p.offset > size || p.length > size - p.offset || p.length > kMaxPart) {
          return Status::InvalidArgument("store node: a range past blob '" + blob + "'");
        }
        q.offsets.push_back(static_cast<int64_t>(p.offset));
        q.lengths.push_back(static_cast<int64_t>(p.length));
        total += p.length;
      }
      PENUMBRA_ASSIGN_OR_RETURN(std::string bytes, store_->Call(st::StoreMethod::READV, Serialize(q)));
      if (bytes.size() != total) {
        return Status::Corruption("store node: a read of " + std::to_string(total) + " bytes of '" + blob +
                                  "' returned " + std::to_string(bytes.size()));
      }
      for (size_t at = 0; i < j; ++i) {
        std::memcpy(pieces[i].dst, bytes.data() + at, pieces[i].length);
        at += pieces[i].length;
      }
    }
    return Status::OK();
  }
  // Across a network: many blocks per message.
  int batch_blocks() const override { return 64; }
  const std::vector<storage::BlobLayout>& layout() const { return layout_; }
  Result<uint64_t> Size(const std::string& blob) const override {
    for (const auto& b : layout_) {
      if (b.name == blob) return b.size;
    }
    return Status::NotFound("store node: the segment has no blob '" + blob + "'");
  }
  Result<size_t> BlockBytes(const std::string& blob) const override {
    for (const auto& b : layout_) {
      if (b.name == blob) return b.block_bytes;
    }
    return Status::NotFound("store node: the segment has no blob '" + blob + "'");
  }

 private:
  std::shared_ptr<const RemoteDocumentStore> store_;
  int64_t id_;
  std::vector<storage::BlobLayout> layout_;
};

}  // namespace

// ------------------------------------------------------------------- node

Result<std::unique_ptr<StoreNode>> StoreNode::Start(storage::SegmentStore* store, const StoreNodeOptions& options) {
  if (store == nullptr) return Status::InvalidArgument("store node: no store");
  auto node = std::unique_ptr<StoreNode>(new StoreNode(store, options));
  StoreNode* n = node.get();
  PENUMBRA_ASSIGN_OR_RETURN(
      node->server_, UcxServer::Start(options.host, options.port,
                                      [n](uint32_t m, std::string p) { return n->Handle(m, std::move(p)); },
                                      options.threads));
  return node;
}

StoreNode::~StoreNode() { Stop(); }

void StoreNode::Stop() {
  if (server_) server_->Stop();
  std::lock_guard<std::mutex> lk(mu_);
  readers_.clear();
  uploads_.clear();
}

int64_t StoreNode::open_readers() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(readers_.size());
}

void StoreNode::CloseIdleReaders() {
  const auto now = std::chrono::steady_clock::now();
  const auto idle = std::chrono::duration<double>(o_.reader_idle_seconds);
  std::vector<std::shared_ptr<storage::BlobReader>> closing;  // released outside the lock
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = readers_.begin(); it != readers_.end();) {
    if (now - it->second.used > idle) {
      LOG(INFO) << "store node: reader " << it->first << " idle, closed";
      closing.push_back(std::move(it->second.reader));
      it = readers_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = uploads_.begin(); it != uploads_.end();) {
    it = now - it->second.used > idle ? uploads_.erase(it) : std::next(it);
  }
}

Result<std::shared_ptr<storage::BlobReader>> StoreNode::UseReader(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = readers_.find(id);
  if (it == readers_.end()) return Status::NotFound("store node: no reader " + std::to_string(id));
  it->second.used = std::chrono::steady_clock::now();
  return it->second.reader;
}

Result<std::string> StoreNode::Handle(uint32_t method, std::string payload) {
  CloseIdleReaders();
  st::StoreRequest q;
  PENUMBRA_RETURN_IF_ERROR(Deserialize(payload, &q, "request"));
  const Hash128 key = FromKey(q.key);
  st::StoreReply reply;
  switch (static_cast<st::StoreMethod::type>(method)) {
    case st::StoreMethod::PUT_BEGIN: {
      Upload u;
      u.key = key;
      u.ns = q.cache_namespace;
      u.tokens = q.tokens;
      for (const auto& [name, size] : q.sizes) {
        if (size < 0 || size > (int64_t{1} << 40)) {
          return Status::InvalidArgument("store node: blob '" + name + "' of " + std::to_string(size) + " bytes");
        }
        u.blobs[name].resize(static_cast<size_t>(size));
        u.missing += static_cast<uint64_t>(size);
      }
      for (const auto& [name, b] : q.block_bytes) {
        if (b <= 0) return Status::InvalidArgument("store node: block_bytes of '" + name + "'");
        u.block_bytes[name] = static_cast<size_t>(b);
      }
      u.used = std::chrono::steady_clock::now();
      std::lock_guard<std::mutex> lk(mu_);
      reply.upload = next_reader_++;
      uploads_[reply.upload] = std::move(u);
      return Serialize(reply);
    }
    case st::StoreMethod::PUT_PART: {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = uploads_.find(q.upload);
      if (it == uploads_.end()) return Status::NotFound("store node: no upload " + std::to_string(q.upload));
      auto b = it->second.blobs.find(q.blob);
      if (b == it->second.blobs.end()) return Status::InvalidArgument("store node: the upload has no blob '" + q.blob + "'");
      if (q.offset < 0 || static_cast<uint64_t>(q.offset) > b->second.size() ||
          q.data.size() > b->second.size() - static_cast<size_t>(q.offset)) {
        return Status::InvalidArgument("store node: a part past blob '" + q.blob + "'");
      }
      std::memcpy(b->second.data() + q.offset, q.data.data(), q.data.size());
      it->second.missing -= std::min<uint64_t>(it->second.missing, q.data.size());
      it->second.used = std::chrono::steady_clock::now();
      return std::string();
    }
    case st::StoreMethod::PUT_COMMIT: {
      Upload u;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = uploads_.find(q.upload);
        if (it == uploads_.end()) return Status::NotFound("store node: no upload " + std::to_string(q.upload));
        u = std::move(it->second);
        uploads_.erase(it);
      }
      if (u.missing != 0) {
        return Status::FailedPrecondition("store node: the upload lacks " + std::to_string(u.missing) + " bytes");
      }
      PENUMBRA_RETURN_IF_ERROR(store_->Put(u.key, u.ns, u.tokens, u.blobs, u.block_bytes));
      return std::string();
    }
    case st::StoreMethod::LAYOUT: {
      PENUMBRA_ASSIGN_OR_RETURN(auto layout, store_->Layout(key));
      reply.layout = ToLayout(layout);
      return Serialize(reply);
    }
    case st::StoreMethod::INFO: {
      PENUMBRA_ASSIGN_OR_RETURN(storage::SegmentInfo info, store_->Info(key));
      reply.info.cache_namespace = info.cache_namespace;
      reply.info.tokens = info.tokens;
      reply.info.bytes = static_cast<int64_t>(info.bytes);
      reply.info.pinned = info.pinned;
      return Serialize(reply);
    }
    case st::StoreMethod::ERASE:
      PENUMBRA_RETURN_IF_ERROR(store_->Erase(key));
      return std::string();
    case st::StoreMethod::OPEN: {
      PENUMBRA_ASSIGN_OR_RETURN(auto layout, store_->Layout(key));
      PENUMBRA_ASSIGN_OR_RETURN(auto reader, store_->OpenReader(key));
      reply.layout = ToLayout(layout);
      std::lock_guard<std::mutex> lk(mu_);
      reply.reader = next_reader_++;
      readers_[reply.reader] = Reader{std::move(reader), std::chrono::steady_clock::now()};
      return Serialize(reply);
    }
    case st::StoreMethod::READV: {
      if (q.offsets.size() != q.lengths.size()) {
        return Status::InvalidArgument("store node: " + std::to_string(q.offsets.size()) + " offsets and " +
                                       std::to_string(q.lengths.size()) + " lengths");
      }
      uint64_t total = 0;
      for (size_t i = 0; i < q.offsets.size(); ++i) {
        if (q.offsets[i] < 0 || q.lengths[i] < 0) return Status::InvalidArgument("store node: a negative range");
        total += static_cast<uint64_t>(q.lengths[i]);
      }
      if (total > kMaxPart) return Status::InvalidArgument("store node: a read of " + std::to_string(total) + " bytes");
      PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<storage::BlobReader> reader, UseReader(q.reader));
      std::string bytes(static_cast<size_t>(total), '\0');
      // Adjacent ranges (a restore's consecutive blocks) read as one.
      std::vector<storage::BlobReader::Piece> pieces;
      uint64_t at = 0;
      for (size_t i = 0; i < q.offsets.size(); ++i) {
        const uint64_t off = static_cast<uint64_t>(q.offsets[i]), len = static_cast<uint64_t>(q.lengths[i]);
        if (!pieces.empty() && pieces.back().offset + pieces.back().length == off &&
            pieces.back().dst + pieces.back().length == bytes.data() + at) {
          pieces.back().length += len;
        } else {
          pieces.push_back({off, len, bytes.data() + at});
        }
        at += len;
      }
      PENUMBRA_RETURN_IF_ERROR(reader->ReadMany(q.blob, pieces));
      return bytes;
    }
    case st::StoreMethod::CLOSE: {
      std::shared_ptr<storage::BlobReader> closing;
      std::lock_guard<std::mutex> lk(mu_);
      auto it = readers_.find(q.reader);
      if (it == readers_.end()) return std::string();  // closed already (idle)
      closing = std::move(it->second.reader);
      readers_.erase(it);
      return std::string();
    }
  }
  return Status::InvalidArgument("store node: unknown method " + std::to_string(method));
}

// ----------------------------------------------------------------- client

Result<RemoteStoreOptions> RemoteDocumentStore::ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return Status::InvalidArgument("store node address '" + address + "': expected HOST:PORT");
  }
  RemoteStoreOptions o;
  o.host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5 || std::stoi(port) < 1 ||
      std::stoi(port) > 65535) {
    return Status::InvalidArgument("store node address '" + address + "': bad port '" + port + "'");
  }
  o.port = std::stoi(port);
  return o;
}

Result<std::shared_ptr<RemoteDocumentStore>> RemoteDocumentStore::Connect(const RemoteStoreOptions& options) {
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<UcxClient> c, UcxClient::Connect(options.host, options.port));
  return std::shared_ptr<RemoteDocumentStore>(new RemoteDocumentStore(options, std::move(c)));
}

Result<std::string> RemoteDocumentStore::Call(uint32_t method, const std::string& request) const {
  Result<std::string> r = client_->Call(method, request, o_.call_timeout);
  // The connection failed (the node restarted, a link broke): once more, on
  // a new one. Every method is safe to repeat (a repeated PUT_PART writes
  // the same bytes; OPEN may leave a reader the node closes when idle).
  if (r.status().code() == StatusCode::kUnavailable) r = client_->Call(method, request, o_.call_timeout);
  return r;
}

Status RemoteDocumentStore::Put(const Hash128& key, const std::string& cache_namespace, int64_t tokens,
                                const std::map<std::string, std::string>& blobs,
                                const std::map<std::string, size_t>& blob_block_bytes) {
  st::StoreRequest begin;
  begin.key = ToKey(key);
  begin.cache_namespace = cache_namespace;
  begin.tokens = tokens;
  for (const auto& [name, bytes] : blobs) begin.sizes[name] = static_cast<int64_t>(bytes.size());
  for (const auto& [name, b] : blob_block_bytes) begin.block_bytes[name] = static_cast<int64_t>(b);
  PENUMBRA_ASSIGN_OR_RETURN(std::string r, Call(st::StoreMethod::PUT_BEGIN, Serialize(begin)));
  st::StoreReply reply;
  PENUMBRA_RETURN_IF_ERROR(Deserialize(r, &reply, "reply"));
  for (const auto& [name, bytes] : blobs) {
    for (size_t at = 0; at < bytes.size(); at += kMaxPart) {
      st::StoreRequest part;
      part.upload = reply.upload;
      part.blob = name;
      part.offset = static_cast<int64_t>(at);
      part.data = bytes.substr(at, std::min<size_t>(kMaxPart, bytes.size() - at));
      PENUMBRA_RETURN_IF_ERROR(Call(st::StoreMethod::PUT_PART, Serialize(part)).status());
    }
  }
  st::StoreRequest commit;
  commit.upload = reply.upload;
  return Call(st::StoreMethod::PUT_COMMIT, Serialize(commit)).status();
}

Result<std::map<std::string, std::string>> RemoteDocumentStore::Get(const Hash128& key) {
  return ReadBlobs(key, nullptr);
}

Result<std::map<std::string, std::string>> RemoteDocumentStore::Get(const Hash128& key,
                                                                    const std::set<std::string>& only) {
  return ReadBlobs(key, &only);
}

Result<std::map<std::string, std::string>> RemoteDocumentStore::ReadBlobs(const Hash128& key,
                                                                          const std::set<std::string>* only) {
  PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<storage::BlobReader> reader, OpenReader(key));
  std::set<std::string> all;  // every blob: the names OPEN returned
  if (only == nullptr) {
    for (const auto& b : static_cast<const RemoteReader&>(*reader).layout()) all.insert(b.name);
  }
  std::map<std::string, std::string> out;
  for (const std::string& name : only ? *only : all) {
    auto size = reader->Size(name);
    if (!size.ok()) return Status::InvalidArgument("store node: the segment has no blob '" + name + "'");
    std::string bytes(*size, '\0');
    PENUMBRA_RETURN_IF_ERROR(reader->Read(name, 0, *size, bytes.data()));
    out[name] = std::move(bytes);
  }
  return out;
}

Result<std::vector<storage::BlobLayout>> RemoteDocumentStore::Layout(const Hash128& key) const {
  st::StoreRequest q;
  q.key = ToKey(key);
  PENUMBRA_ASSIGN_OR_RETURN(std::string r, Call(st::StoreMethod::LAYOUT, Serialize(q)));
  st::StoreReply reply;
  PENUMBRA_RETURN_IF_ERROR(Deserialize(r, &reply, "reply"));
  return FromLayout(reply.layout);
}

Result<storage::SegmentInfo> RemoteDocumentStore::Info(const Hash128& key) const {
  st::StoreRequest q;
  q.key = ToKey(key);
  PENUMBRA_ASSIGN_OR_RETURN(std::string r, Call(st::StoreMethod::INFO, Serialize(q)));
  st::StoreReply reply;
  PENUMBRA_RETURN_IF_ERROR(Deserialize(r, &reply, "reply"));
  storage::SegmentInfo info;
  info.cache_namespace = reply.info.cache_namespace;
  info.tokens = reply.info.tokens;
  info.bytes = static_cast<size_t>(std::max<int64_t>(0, reply.info.bytes));
  info.pinned = reply.info.pinned;
  return info;
}

Status RemoteDocumentStore::Erase(const Hash128& key) {
  st::StoreRequest q;
  q.key = ToKey(key);
  return Call(st::StoreMethod::ERASE, Serialize(q)).status();
}

Result<std::shared_ptr<storage::BlobReader>> RemoteDocumentStore::OpenReader(const Hash128& key) {
  st::StoreRequest q;
  q.key = ToKey(key);
  PENUMBRA_ASSIGN_OR_RETURN(std::string r, Call(st::StoreMethod::OPEN, Serialize(q)));
  st::StoreReply reply;
  PENUMBRA_RETURN_IF_ERROR(Deserialize(r, &reply, "reply"));
  PENUMBRA_ASSIGN_OR_RETURN(auto layout, FromLayout(reply.layout));
  return std::shared_ptr<storage::BlobReader>(new RemoteReader(shared_from_this(), reply.reader, std::move(layout)));
}

// ------------------------------------------------------------- sharding

Result<std::shared_ptr<ShardedDocumentStore>> ShardedDocumentStore::Create(
    std::vector<std::pair<std::string, std::shared_ptr<storage::DocumentStore>>> nodes) {
  if (nodes.empty()) return Status::InvalidArgument("sharded store: no nodes");
  std::set<std::string> names;
  for (const auto& [name, store] : nodes) {
    if (!store) return Status::InvalidArgument("sharded store: node '" + name + "' has no store");
    if (!names.insert(name).second) return Status::InvalidArgument("sharded store: node '" + name + "' given twice");
  }
  return std::shared_ptr<ShardedDocumentStore>(new ShardedDocumentStore(std::move(nodes)));
}

size_t ShardedDocumentStore::Pick(const Hash128& key) const {
  size_t best = 0;
  Hash128 best_h{};
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Hash128 h = Hasher128().Update(&key.hi, sizeof key.hi).Update(&key.lo, sizeof key.lo)
                          .Update(nodes_[i].first).Digest();
    if (i == 0 || std::tie(h.hi, h.lo) > std::tie(best_h.hi, best_h.lo)) {
      best = i;
      best_h = h;
    }
  }
  return best;
}

Result<std::shared_ptr<storage::DocumentStore>> ConnectStoreNodes(const std::string& addresses) {
  std::vector<std::pair<std::string, std::shared_ptr<storage::DocumentStore>>> nodes;
  std::stringstream list(addresses);
  std::string address;
  while (std::getline(list, address, ',')) {
    PENUMBRA_ASSIGN_OR_RETURN(RemoteStoreOptions o, RemoteDocumentStore::ParseAddress(address));
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<RemoteDocumentStore> c, RemoteDocumentStore::Connect(o));
    nodes.emplace_back(address, std::move(c));
  }
  if (nodes.empty()) return Status::InvalidArgument("store nodes: no address in '" + addresses + "'");
  if (nodes.size() == 1) return nodes[0].second;
  PENUMBRA_ASSIGN_OR_RETURN(auto sharded, ShardedDocumentStore::Create(std::move(nodes)));
  return std::shared_ptr<storage::DocumentStore>(std::move(sharded));
}

}  // namespace penumbra::transport
