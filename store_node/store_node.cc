#include "store_node/store_node.h"

#include <glog/logging.h>
#include <thrift/TConfiguration.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include <unistd.h>
#include <algorithm>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>
#include <tuple>
#include <type_traits>

#include "common/crypto.h"
#include "storage/lazy_blob.h"
#include "store_types.h"
#include "transport/tls.h"

namespace penumbra::transport {
namespace {

namespace st = rpc::store;
using apache::thrift::TConfiguration;
using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TMemoryBuffer;

constexpr uint64_t kMaxPart = uint64_t{64} << 20;  // bytes of one PUT_PART or READV
// A long read's READVs (a whole blob): small enough that a blob's chunks
// spread over the client's connections, large enough to amortize a message.
constexpr uint64_t kReadChunk = uint64_t{16} << 20;

template <typename T>
std::string Serialize(const T& t) {
  auto buf = std::make_shared<TMemoryBuffer>();
  TBinaryProtocol proto(buf);
  t.write(&proto);
  return buf->getBufferAsString();
}

// Thrift's binary protocol, walked without building anything, as the
// generated readers will read it. Thrift's reader casts every type byte to
// its TType enum before checking it (undefined behaviour outside the enum),
// and a generated reader reads a container field's elements as the IDL's
// types whatever types the wire names; so peers' bytes are walked here first,
// with the messages' schema: every type byte one Thrift defines, every size
// non-negative and within the bytes left, known fields' elements as their
// IDL types, unknown fields as the wire says (Thrift skips those the same
// way), nesting bounded.
enum : uint8_t {
  kStop = 0,
  kBool = 2,
  kByte = 3,
  kDouble = 4,
  kI16 = 6,
  kI32 = 8,
  kI64 = 10,
  kString = 11,
  kStruct = 12,
  kMap = 13,
  kSet = 14,
  kList = 15,
};
struct FieldSpec;
// A type of the IDL: its wire type, and for containers and structs what is
// inside.
struct TypeSpec {
  uint8_t type;
  const TypeSpec* key = nullptr;                   // map key; list or set element
  const TypeSpec* value = nullptr;                 // map value
  const std::vector<FieldSpec>* fields = nullptr;  // struct
};
struct FieldSpec {
  int16_t id;
  TypeSpec type;
};

// store_node/store.thrift, field by field (kept in step with it: the fuzzer,
// store_node_fuzz, finds a divergence as undefined behaviour in Thrift).
const TypeSpec kI64Type{kI64}, kStringType{kString};
const std::vector<FieldSpec> kStoreKeyFields = {{1, {kI64}}, {2, {kI64}}};
const std::vector<FieldSpec> kStoreBlobLayoutFields = {{1, {kString}}, {2, {kI64}}, {3, {kI64}}, {4, {kI32}}};
const std::vector<FieldSpec> kStoreInfoFields = {{1, {kString}}, {2, {kI64}}, {3, {kI64}}, {4, {kBool}}};
const TypeSpec kLayoutType{kStruct, nullptr, nullptr, &kStoreBlobLayoutFields};
const std::vector<FieldSpec> kStoreRequestFields = {
    {1, {kStruct, nullptr, nullptr, &kStoreKeyFields}},
    {2, {kString}},
    {3, {kI64}},
    {4, {kMap, &kStringType, &kI64Type}},
    {5, {kMap, &kStringType, &kI64Type}},
    {8, {kString}},
    {9, {kI64}},
    {11, {kString}},
    {12, {kList, &kI64Type}},
    {13, {kList, &kI64Type}},
    {14, {kString}},
    {15, {kString}},
};
const std::vector<FieldSpec> kStoreReplyFields = {
    {1, {kStruct, nullptr, nullptr, &kStoreInfoFields}},
    {2, {kList, &kLayoutType}},
    {5, {kString}},
    {6, {kString}},
};

class ThriftWalker {
 public:
  explicit ThriftWalker(std::string_view b) : b_(b) {}
  // A struct of `fields` (null: unknown, walked as the wire says).
  bool Struct(const std::vector<FieldSpec>* fields, int depth) {
    if (depth <= 0) return false;
    for (;;) {
      uint8_t type = 0;
      if (!U8(&type)) return false;
      if (type == kStop) return true;
      if (!Known(type) || b_.size() - at_ < 2) return false;
      const auto* p = reinterpret_cast<const unsigned char*>(b_.data() + at_);
      const auto id = static_cast<int16_t>((uint16_t{p[0]} << 8) | p[1]);
      at_ += 2;
      const TypeSpec* spec = nullptr;
      if (fields != nullptr) {
        for (const FieldSpec& f : *fields) {
          if (f.id == id && f.type.type == type) spec = &f.type;
        }
      }
      if (!(spec ? Typed(*spec, depth) : Wire(type, depth))) return false;
    }
  }

 private:
  bool U8(uint8_t* v) {
    if (at_ >= b_.size()) return false;
    *v = static_cast<uint8_t>(b_[at_++]);
    return true;
  }
  bool Size(uint32_t* n) {
    if (b_.size() - at_ < 4) return false;
    const auto* p = reinterpret_cast<const unsigned char*>(b_.data() + at_);
    const auto v = static_cast<int32_t>((uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3]);
    at_ += 4;
    if (v < 0) return false;
    *n = static_cast<uint32_t>(v);
    return true;
  }
  bool Skip(size_t n) {
    if (b_.size() - at_ < n) return false;
    at_ += n;
    return true;
  }
  static bool Known(uint8_t t) {
    return t == kBool || t == kByte || t == kDouble || t == kI16 || t == kI32 || t == kI64 || t == kString ||
           t == kStruct || t == kMap || t == kSet || t == kList;
  }
  bool Scalar(uint8_t type) {
    switch (type) {
      case kBool:
      case kByte:
        return Skip(1);
      case kI16:
        return Skip(2);
      case kI32:
        return Skip(4);
      case kDouble:
      case kI64:
        return Skip(8);
      case kString: {
        uint32_t n = 0;
        return Size(&n) && Skip(n);
      }
      default:
        return false;
    }
  }
  // A value read as the IDL says (a known field's).
  bool Typed(const TypeSpec& t, int depth) {
    switch (t.type) {
      case kStruct:
        return Struct(t.fields, depth - 1);
      case kMap: {
        uint8_t k = 0, v = 0;
        uint32_t n = 0;
        if (!U8(&k) || !U8(&v) || !Known(k) || !Known(v) || !Size(&n)) return false;
        for (uint32_t i = 0; i < n; ++i) {
          if (!Typed(*t.key, depth - 1) || !Typed(*t.value, depth - 1)) return false;
        }
        return true;
      }
      case kSet:
      case kList: {
        uint8_t e = 0;
        uint32_t n = 0;
        if (!U8(&e) || !Known(e) || !Size(&n)) return false;
        for (uint32_t i = 0; i < n; ++i) {
          if (!Typed(*t.key, depth - 1)) return false;
        }
        return true;
      }
      default:
        return Scalar(t.type);
    }
  }
  // A value read as the wire says (an unknown field's, as Thrift skips it).
  bool Wire(uint8_t type, int depth) {
    switch (type) {
      case kStruct:
        return Struct(nullptr, depth - 1);
      case kMap: {
        uint8_t k = 0, v = 0;
        uint32_t n = 0;
        if (!U8(&k) || !U8(&v) || !Known(k) || !Known(v) || !Size(&n)) return false;
        for (uint32_t i = 0; i < n; ++i) {
          if (!Wire(k, depth - 1) || !Wire(v, depth - 1)) return false;
        }
        return true;
      }
      case kSet:
      case kList: {
        uint8_t e = 0;
        uint32_t n = 0;
        if (!U8(&e) || !Known(e) || !Size(&n)) return false;
        for (uint32_t i = 0; i < n; ++i) {
          if (!Wire(e, depth - 1)) return false;
        }
        return true;
      }
      default:
        return Scalar(type);
    }
  }
  std::string_view b_;
  size_t at_ = 0;
};

template <typename T>
Status Deserialize(const std::string& bytes, T* out, const char* what) {
  const bool request = std::is_same_v<T, st::StoreRequest>;
  if (!IsWellFormedStoreMessage(bytes, request)) {
    return Status::InvalidArgument(std::string("store node: a malformed ") + what +
                                   " (not a struct in Thrift's binary protocol)");
  }
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
    out.push_back(
        {l.name, static_cast<uint64_t>(l.size), static_cast<size_t>(l.block_bytes), static_cast<uint32_t>(l.blocks)});
  }
  return out;
}

// A reader of one segment on a node (its blobs' layout from OPEN); closes
// the node's reader when it goes.
class RemoteReader final : public storage::BlobReader {
 public:
  RemoteReader(std::shared_ptr<const RemoteDocumentStore> store, std::string id,
               std::vector<storage::BlobLayout> layout)
      : store_(std::move(store)), id_(id), layout_(std::move(layout)) {}
  ~RemoteReader() override {
    st::StoreRequest q;
    q.reader = id_;
    Result<std::string> r = store_->Call(st::StoreMethod::CLOSE, Serialize(q));
    if (!r.ok()) VLOG(1) << "store node: closing a reader: " << r.status();
  }
  // As READVs of at most kReadChunk, up to one per connection at once (a
  // whole blob comes back this way: its chunks move in parallel).
  Status Read(const std::string& blob, uint64_t offset, uint64_t length, void* dst) override {
    std::vector<Piece> chunks;
    for (uint64_t done = 0; done < length; done += kReadChunk) {
      chunks.push_back({offset + done, std::min(kReadChunk, length - done), static_cast<char*>(dst) + done});
    }
    const size_t parallel = std::min<size_t>(chunks.size(), static_cast<size_t>(std::max(1, store_->connections())));
    if (parallel <= 1) return ReadMany(blob, chunks);
    std::atomic<size_t> next{0};
    std::mutex mu;
    Status first;
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < chunks.size();) {
        Status s = ReadMany(blob, std::span<const Piece>(&chunks[i], 1));
        if (!s.ok()) {
          std::lock_guard<std::mutex> lk(mu);
          if (first.ok()) first = std::move(s);
          next = chunks.size();  // the others stop early
        }
      }
    };
    std::vector<std::thread> threads;
    for (size_t t = 1; t < parallel; ++t) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
    return first;
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
      // The reply's bytes land in the pieces' destinations (in place: no
      // intermediate buffer); a reply of another size is refused.
      std::vector<ucx_frame::BodyPart> into;
      into.reserve(j - i);
      for (; i < j; ++i) into.push_back({pieces[i].dst, static_cast<size_t>(pieces[i].length)});
      Status read = store_->CallInto(st::StoreMethod::READV, Serialize(q), total, into);
      if (!read.ok())
        return read.WithContext("store node: reading " + std::to_string(total) + " bytes of '" + blob + "'");
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
  std::string id_;
  std::vector<storage::BlobLayout> layout_;
};

}  // namespace

bool IsWellFormedStoreMessage(std::string_view bytes, bool request) {
  return ThriftWalker(bytes).Struct(request ? &kStoreRequestFields : &kStoreReplyFields, 16);
}

// ------------------------------------------------------------------- node

namespace {

using Clock = std::chrono::steady_clock;

// A peer's string in a message: printable, at most 40 characters.
std::string Shown(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 40)) out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  return s.size() > 40 ? out + "..." : out;
}

// Adds [begin, end) to disjoint merged ranges; returns the bytes it added
// that were not there before.
uint64_t AddRange(std::map<uint64_t, uint64_t>& ranges, uint64_t begin, uint64_t end) {
  if (begin >= end) return 0;
  uint64_t added = end - begin, lo = begin, hi = end;
  auto it = ranges.upper_bound(begin);
  if (it != ranges.begin() && std::prev(it)->second >= begin) --it;
  while (it != ranges.end() && it->first <= hi) {
    const uint64_t ob = std::max(it->first, begin), oe = std::min(it->second, end);
    if (oe > ob) added -= oe - ob;
    lo = std::min(lo, it->first);
    hi = std::max(hi, it->second);
    it = ranges.erase(it);
  }
  ranges[lo] = hi;
  return added;
}

uint64_t HalfThePhysicalMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return uint64_t{8} << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2;
}

constexpr uint64_t kMaxBlobBytes = uint64_t{1} << 50;

}  // namespace

StoreService::StoreService(storage::SegmentStore* store, const StoreServiceOptions& options)
    : store_(store), o_(options) {
  if (o_.max_upload_bytes == 0) o_.max_upload_bytes = HalfThePhysicalMemory();
}

int64_t StoreService::open_readers() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(readers_.size());
}

int64_t StoreService::open_uploads() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(uploads_.size());
}

uint64_t StoreService::upload_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return upload_bytes_;
}

void StoreService::Clear() {
  std::map<std::string, Reader> readers;  // released outside the lock
  std::map<std::string, std::shared_ptr<Upload>> uploads;
  std::lock_guard<std::mutex> lk(mu_);
  readers.swap(readers_);
  uploads.swap(uploads_);
  upload_bytes_ = 0;
}

void StoreService::Sweep() {
  const auto now = Clock::now();
  const auto reader_idle = std::chrono::duration<double>(o_.reader_idle_seconds);
  const auto upload_idle = std::chrono::duration<double>(o_.upload_idle_seconds);
  for (auto it = readers_.begin(); it != readers_.end();) {
    if (now - it->second.used > reader_idle) {
      LOG(INFO) << "store node: a reader of client " << it->second.owner << " idle, closed";
      it = readers_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = uploads_.begin(); it != uploads_.end();) {
    if (now - it->second->used > upload_idle) {
      LOG(INFO) << "store node: an upload of client " << it->second->owner << " (" << it->second->total
                << " bytes) idle, dropped";
      upload_bytes_ -= it->second->total;
      it = uploads_.erase(it);
    } else {
      ++it;
    }
  }
}

Result<std::shared_ptr<storage::BlobReader>> StoreService::UseReader(const std::string& handle,
                                                                     const UcxCaller& caller) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = readers_.find(handle);
  if (it == readers_.end() || it->second.owner != caller.client_id) {
    return Status::NotFound("store node: no reader " + Shown(handle));
  }
  it->second.used = Clock::now();
  return it->second.reader;
}

Result<std::shared_ptr<StoreService::Upload>> StoreService::UseUpload(const std::string& handle,
                                                                      const UcxCaller& caller) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = uploads_.find(handle);
  if (it == uploads_.end() || it->second->owner != caller.client_id) {
    return Status::NotFound("store node: no upload " + Shown(handle));
  }
  it->second->used = Clock::now();
  return it->second;
}

Result<std::string> StoreService::Handle(const UcxCaller& caller, uint32_t method, std::string payload) {
  try {
    return HandleRequest(caller, method, std::move(payload));
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("store node: out of memory serving method " + std::to_string(method));
  } catch (const std::exception& e) {
    return Status::Internal("store node: method " + std::to_string(method) + " failed: " + e.what());
  } catch (...) {
    return Status::Internal("store node: method " + std::to_string(method) + " failed");
  }
}

Result<std::string> StoreService::HandleRequest(const UcxCaller& caller, uint32_t method, std::string payload) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    Sweep();
  }
  st::StoreRequest q;
  PENUMBRA_RETURN_IF_ERROR(Deserialize(payload, &q, "request"));
  payload.clear();
  const Hash128 key = FromKey(q.key);
  st::StoreReply reply;
  switch (static_cast<st::StoreMethod::type>(method)) {
    case st::StoreMethod::PUT_BEGIN: {
      // Every size is checked, and the upload admitted, before anything is
      // allocated for it.
      if (q.tokens < 1)
        return Status::InvalidArgument("store node: an upload of " + std::to_string(q.tokens) + " tokens");
      if (q.sizes.size() > static_cast<size_t>(o_.max_blobs)) {
        return Status::InvalidArgument("store node: an upload of " + std::to_string(q.sizes.size()) +
                                       " blobs (at most " + std::to_string(o_.max_blobs) + ")");
      }
      auto u = std::make_shared<Upload>();
      u->owner = caller.client_id;
      u->key = key;
      u->ns = q.cache_namespace;
      u->tokens = q.tokens;
      for (const auto& [name, size] : q.sizes) {
        if (name.empty()) return Status::InvalidArgument("store node: a blob with an empty name");
        if (size < 0 || static_cast<uint64_t>(size) > kMaxBlobBytes) {
          return Status::InvalidArgument("store node: blob '" + Shown(name) + "' of " + std::to_string(size) +
                                         " bytes");
        }
        u->sizes[name] = static_cast<uint64_t>(size);
        u->total += static_cast<uint64_t>(size);  // at most 4096 x 2^50: no overflow
      }
      for (const auto& [name, b] : q.block_bytes) {
        if (!u->sizes.count(name)) {
          return Status::InvalidArgument("store node: block_bytes names '" + Shown(name) + "', not a blob");
        }
        if (b < static_cast<int64_t>(storage::SegmentStore::kMinBlockBytes) ||
            b > static_cast<int64_t>(storage::SegmentStore::kMaxBlockBytes)) {
          return Status::InvalidArgument("store node: block_bytes of '" + Shown(name) + "' is " + std::to_string(b));
        }
        u->block_bytes[name] = static_cast<size_t>(b);
      }
      PENUMBRA_RETURN_IF_ERROR(store_->CheckRoom(u->ns, u->total));
      u->used = Clock::now();
      std::lock_guard<std::mutex> lk(mu_);
      if (uploads_.size() >= static_cast<size_t>(o_.max_uploads)) {
        return Status::ResourceExhausted("store node: " + std::to_string(uploads_.size()) +
                                         " uploads in flight (at most " + std::to_string(o_.max_uploads) + ")")
            .WithRetryAfter(1000);
      }
      if (u->total > o_.max_upload_bytes - std::min(upload_bytes_, o_.max_upload_bytes)) {
        return Status::ResourceExhausted("store node: an upload of " + std::to_string(u->total) + " bytes beside " +
                                         std::to_string(upload_bytes_) + " in flight exceeds max_upload_bytes (" +
                                         std::to_string(o_.max_upload_bytes) + ")")
            .WithRetryAfter(1000);
      }
      reply.upload = RandomHandle();
      upload_bytes_ += u->total;
      uploads_[reply.upload] = std::move(u);
      return Serialize(reply);
    }
    case st::StoreMethod::PUT_PART: {
      PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<Upload> u, UseUpload(q.upload, caller));
      auto size = u->sizes.find(q.blob);
      if (size == u->sizes.end()) {
        return Status::InvalidArgument("store node: the upload has no blob '" + Shown(q.blob) + "'");
      }
      if (q.offset < 0 || static_cast<uint64_t>(q.offset) > size->second ||
          q.data.size() > size->second - static_cast<uint64_t>(q.offset)) {
        return Status::InvalidArgument("store node: a part of " + std::to_string(q.data.size()) + " bytes at " +
                                       std::to_string(q.offset) + " ends past blob '" + Shown(q.blob) + "' (" +
                                       std::to_string(size->second) + " bytes)");
      }
      std::lock_guard<std::mutex> lk(u->mu);
      std::string& buf = u->blobs[q.blob];
      if (buf.size() != size->second) buf.resize(size->second);  // its first part (bad_alloc: Handle answers)
      std::memcpy(buf.data() + q.offset, q.data.data(), q.data.size());
      u->received_bytes += AddRange(u->received[q.blob], static_cast<uint64_t>(q.offset),
                                    static_cast<uint64_t>(q.offset) + q.data.size());
      return std::string();
    }
    case st::StoreMethod::PUT_COMMIT: {
      PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<Upload> u, UseUpload(q.upload, caller));
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (uploads_.erase(q.upload) == 0) return Status::NotFound("store node: no upload " + Shown(q.upload));
      }
      // Its bytes stay counted until the store has them.
      Status put;
      {
        std::lock_guard<std::mutex> lk(u->mu);  // parts still being copied finish first
        if (u->received_bytes != u->total) {
          put = Status::FailedPrecondition("store node: the upload lacks " +
                                           std::to_string(u->total - u->received_bytes) + " of its " +
                                           std::to_string(u->total) + " bytes");
        } else {
          for (const auto& [name, size] : u->sizes) u->blobs[name].resize(size);  // empty blobs
          put = store_->Put(u->key, u->ns, u->tokens, u->blobs, u->block_bytes);
        }
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        upload_bytes_ -= u->total;
      }
      PENUMBRA_RETURN_IF_ERROR(put);
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
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (readers_.size() >= static_cast<size_t>(o_.max_readers)) {
          return Status::ResourceExhausted("store node: " + std::to_string(readers_.size()) +
                                           " readers open (at most " + std::to_string(o_.max_readers) + ")")
              .WithRetryAfter(1000);
        }
      }
      PENUMBRA_ASSIGN_OR_RETURN(auto layout, store_->Layout(key));
      PENUMBRA_ASSIGN_OR_RETURN(auto reader, store_->OpenReader(key));
      reply.layout = ToLayout(layout);
      reply.reader = RandomHandle();
      std::lock_guard<std::mutex> lk(mu_);
      readers_[reply.reader] = Reader{caller.client_id, std::move(reader), Clock::now()};
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
        if (total > kMaxPart) {
          return Status::InvalidArgument("store node: a read of more than " + std::to_string(kMaxPart) + " bytes");
        }
      }
      PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<storage::BlobReader> reader, UseReader(q.reader, caller));
      // The reply's one buffer: the blocks are read into it (once, from
      // RocksDB's pinned values) and sent from it; room for the tag a sealed
      // plane appends, so sealing it in place does not copy it again.
      std::string bytes;
      bytes.reserve(static_cast<size_t>(total) + ucx_frame::kTagBytes);
      bytes.resize(static_cast<size_t>(total));
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
      std::shared_ptr<storage::BlobReader> closing;  // released outside the lock
      std::lock_guard<std::mutex> lk(mu_);
      auto it = readers_.find(q.reader);
      if (it == readers_.end() || it->second.owner != caller.client_id) {
        return Status::NotFound("store node: no reader " + Shown(q.reader));
      }
      closing = std::move(it->second.reader);
      readers_.erase(it);
      return std::string();
    }
  }
  return Status::InvalidArgument("store node: unknown method " + std::to_string(method));
}

Result<std::unique_ptr<StoreNode>> StoreNode::Start(storage::SegmentStore* store, const StoreNodeOptions& options) {
  if (store == nullptr) return Status::InvalidArgument("store node: no store");
  auto node = std::unique_ptr<StoreNode>(new StoreNode());
  node->service_ = std::make_unique<StoreService>(store, options.service);
  StoreService* s = node->service_.get();
  PENUMBRA_ASSIGN_OR_RETURN(node->server_, UcxServer::Start(
                                               options.host, options.port,
                                               [s](const UcxCaller& caller, uint32_t m, std::string p) {
                                                 return s->Handle(caller, m, std::move(p));
                                               },
                                               options.plane));
  return node;
}

StoreNode::~StoreNode() { Stop(); }

void StoreNode::Stop() {
  if (server_) server_->Stop();
  if (service_) service_->Clear();
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
  const std::string where = options.host + ":" + std::to_string(options.port);
  if (!options.plane.secret && !IsLoopbackHost(options.host)) {
    if (!options.allow_plaintext_remote) {
      return Status::InvalidArgument("store node " + where +
                                     " is not on loopback: the store plane needs the "
                                     "cluster secret (--cluster-secret-file), or --insecure on a network you trust");
    }
    LOG(ERROR) << "INSECURE: store node " << where << " without the cluster secret (--insecure): anyone on the "
               << "network can read, forge and replay its traffic";
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<UcxClient> c,
                            UcxClient::Connect(options.host, options.port, options.plane));
  return std::shared_ptr<RemoteDocumentStore>(new RemoteDocumentStore(options, std::move(c)));
}

Result<std::string> RemoteDocumentStore::Try(uint32_t method, const std::string& request,
                                             std::chrono::milliseconds timeout,
                                             const std::span<const ucx_frame::BodyPart>* into) const {
  const auto now = CircuitBreaker::Clock::now();
  if (!breaker_.Allow(now)) {
    return Status::Unavailable("store node " + name_ + ": circuit breaker open after " +
                               std::to_string(breaker_.options().failures) +
                               " consecutive calls it did not answer; calls fail at once for another " +
                               std::to_string(breaker_.open_for(now).count()) + " ms");
  }
  ++calls_;
  Result<std::string> r = std::string();
  if (into != nullptr) {
    Status s = client_->CallInto(method, request, timeout, *into);
    if (!s.ok()) r = std::move(s);
  } else {
    r = client_->Call(method, request, timeout);
  }
  const StatusCode code = r.status().code();
  const bool failed = code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded;
  if (failed) {
    ++failures_;
    if (code == StatusCode::kDeadlineExceeded) ++timeouts_;
  }
  breaker_.Record(failed, CircuitBreaker::Clock::now());
  if (failed) return r.status().WithContext("store node " + name_);
  return r;
}

Result<std::string> RemoteDocumentStore::Call(uint32_t method, const std::string& request, uint64_t bulk_bytes) const {
  return CallMaybeInto(method, request, bulk_bytes, nullptr);
}

Status RemoteDocumentStore::CallInto(uint32_t method, const std::string& request, uint64_t bulk_bytes,
                                     std::span<const ucx_frame::BodyPart> into) const {
  return CallMaybeInto(method, request, bulk_bytes, &into).status();
}

Result<std::string> RemoteDocumentStore::CallMaybeInto(uint32_t method, const std::string& request, uint64_t bulk_bytes,
                                                       const std::span<const ucx_frame::BodyPart>* into) const {
  const double bytes = static_cast<double>(bulk_bytes) + static_cast<double>(request.size());
  const double rate = o_.bulk_bytes_per_second > 0 ? o_.bulk_bytes_per_second : 64.0 * (1 << 20);
  const auto timeout = o_.call_timeout + std::chrono::milliseconds(static_cast<int64_t>(bytes / rate * 1000.0));
  Result<std::string> r = Try(method, request, timeout, into);
  // The connection failed (the node restarted, a link broke): once more, on
  // a new one, unless the breaker is open now. Every method is safe to
  // repeat (a repeated PUT_PART writes the same bytes; OPEN may leave a
  // reader the node closes when idle). A call past its deadline is not
  // repeated: the node is slow or stopped, not gone.
  if (r.status().code() == StatusCode::kUnavailable && breaker_.state() == CircuitBreaker::State::kClosed) {
    r = Try(method, request, timeout, into);
  }
  return r;
}

StoreNodeCallStats RemoteDocumentStore::call_stats() const {
  StoreNodeCallStats s;
  s.node = name_;
  s.breaker = breaker_.state();
  s.calls = calls_.load();
  s.failures = failures_.load();
  s.timeouts = timeouts_.load();
  s.rejected = breaker_.rejected();
  s.opens = breaker_.opens();
  return s;
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
  uint64_t total = 0;  // the commit writes them all on the node
  for (const auto& [name, bytes] : blobs) total += bytes.size();
  return Call(st::StoreMethod::PUT_COMMIT, Serialize(commit), total).status();
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
    const Hash128 h =
        Hasher128().Update(&key.hi, sizeof key.hi).Update(&key.lo, sizeof key.lo).Update(nodes_[i].first).Digest();
    if (i == 0 || std::tie(h.hi, h.lo) > std::tie(best_h.hi, best_h.lo)) {
      best = i;
      best_h = h;
    }
  }
  return best;
}

Result<std::shared_ptr<storage::DocumentStore>> ConnectStoreNodes(const std::string& addresses,
                                                                  const UcxClientOptions& plane,
                                                                  bool allow_plaintext_remote) {
  RemoteStoreOptions calls;
  calls.plane = plane;
  calls.allow_plaintext_remote = allow_plaintext_remote;
  return ConnectStoreNodes(addresses, calls, nullptr);
}

Result<std::shared_ptr<storage::DocumentStore>> ConnectStoreNodes(
    const std::string& addresses, const RemoteStoreOptions& calls,
    std::vector<std::shared_ptr<RemoteDocumentStore>>* clients) {
  if (calls.call_timeout.count() < 1) {
    return Status::InvalidArgument("store nodes: the call timeout must be >= 1 ms, got " +
                                   std::to_string(calls.call_timeout.count()));
  }
  if (!(calls.bulk_bytes_per_second > 0)) {
    return Status::InvalidArgument("store nodes: bulk_bytes_per_second must be > 0");
  }
  if (calls.breaker.failures < 1 || calls.breaker.cool_down.count() < 0) {
    return Status::InvalidArgument("store nodes: the breaker needs failures >= 1 and a cool-down >= 0, got " +
                                   std::to_string(calls.breaker.failures) + " and " +
                                   std::to_string(calls.breaker.cool_down.count()) + " ms");
  }
  std::vector<std::pair<std::string, std::shared_ptr<storage::DocumentStore>>> nodes;
  std::stringstream list(addresses);
  std::string address;
  while (std::getline(list, address, ',')) {
    PENUMBRA_ASSIGN_OR_RETURN(RemoteStoreOptions at, RemoteDocumentStore::ParseAddress(address));
    RemoteStoreOptions o = calls;
    o.host = at.host;
    o.port = at.port;
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<RemoteDocumentStore> c, RemoteDocumentStore::Connect(o));
    if (clients) clients->push_back(c);
    nodes.emplace_back(address, std::move(c));
  }
  if (nodes.empty()) return Status::InvalidArgument("store nodes: no address in '" + addresses + "'");
  if (nodes.size() == 1) return nodes[0].second;
  PENUMBRA_ASSIGN_OR_RETURN(auto sharded, ShardedDocumentStore::Create(std::move(nodes)));
  return std::shared_ptr<storage::DocumentStore>(std::move(sharded));
}

}  // namespace penumbra::transport
