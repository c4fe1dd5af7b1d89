#include "storage/segment_store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>

#include <glog/logging.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/snapshot.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>

#include "common/crypto.h"
#include "common/record.h"
#include "storage/lazy_blob.h"
#include "storage/rocksdb_status.h"
#include "storage/rocksdb_writer.h"

namespace penumbra::storage {
namespace {

constexpr uint32_t kRecordMagic = 0x47455350;  // "PSEG"
constexpr uint32_t kBlockMagic = 0x4b4c4250;   // "PBLK"
constexpr size_t kKeyBytes = 16;
constexpr size_t kDigestBytes = 32;

// ---- byte encodings (little-endian values, big-endian keys) ----------------
void PutU32(std::string* s, uint32_t v) { s->append(reinterpret_cast<const char*>(&v), 4); }
void PutU64(std::string* s, uint64_t v) { s->append(reinterpret_cast<const char*>(&v), 8); }
void PutStr(std::string* s, const std::string& v) {
  PutU32(s, static_cast<uint32_t>(v.size()));
  s->append(v);
}
using Reader = RecordReader;

std::string KeyBytes(const Hash128& k) {
  std::string s;
  PutBigEndian64(&s, k.hi);
  PutBigEndian64(&s, k.lo);
  return s;
}
Hash128 KeyFrom(const char* p) { return Hash128{GetBigEndian64(p + 8), GetBigEndian64(p)}; }
// A version of a segment: its blocks' keys carry it, so two versions'
// blocks never share a key. The top bit is set so that no format-2 block key
// (segment key, blob index < 2^16, block) falls in a format-3 version's key
// range.
constexpr uint64_t kGenerationBit = uint64_t{1} << 63;
std::string VersionKey(const Hash128& k, uint64_t generation) {
  std::string s = KeyBytes(k);
  PutBigEndian64(&s, generation);
  return s;
}
std::string BlockKey(const Hash128& k, uint64_t generation, uint32_t blob, uint32_t block) {
  std::string s = VersionKey(k, generation);
  PutBigEndian32(&s, blob);
  PutBigEndian32(&s, block);
  return s;
}
// The first key after every key that starts with `prefix`.
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(prefix.back());
    if (c != 0xff) {
      ++c;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(kKeyBytes + 8, '\xff');
}

constexpr size_t kMinBlockBytes = SegmentStore::kMinBlockBytes;
constexpr size_t kMaxBlockBytes = SegmentStore::kMaxBlockBytes;

uint64_t BlocksFor(uint64_t size, size_t block_bytes) { return (size + block_bytes - 1) / block_bytes; }

struct Record {
  std::string cache_namespace;
  int64_t tokens = 0;
  bool pinned = false;
  uint64_t last_used = 0;
  uint64_t generation = 0;         // the version whose blocks this record names
  std::string digest;              // kDigestBytes: ContentDigest of what was stored
  bool last_used_unsaved = false;  // in memory only: a ReadBlob marked it used since the record was written
  std::vector<BlobLayout> blobs;
  size_t bytes() const {
    size_t b = 0;
    for (const auto& m : blobs) b += m.size;
    return b;
  }
};

std::string EncodeRecord(const Record& r) {
  std::string s;
  PutU32(&s, kRecordMagic);
  PutU32(&s, SegmentStore::kFormatVersion);
  PutStr(&s, r.cache_namespace);
  PutU64(&s, static_cast<uint64_t>(r.tokens));
  s.push_back(r.pinned ? 1 : 0);
  PutU64(&s, r.last_used);
  PutU64(&s, r.generation);
  s.append(r.digest);
  PutU32(&s, static_cast<uint32_t>(r.blobs.size()));
  for (const auto& b : r.blobs) {
    PutStr(&s, b.name);
    PutU64(&s, b.size);
    PutU32(&s, static_cast<uint32_t>(b.block_bytes));
    PutU32(&s, b.blocks);
  }
  PutU64(&s, Hash64(s.data(), s.size(), /*seed=*/kRecordMagic));
  return s;
}

// kOk, kCorruption (bad bytes) or kUnimplemented (another format version).
Status DecodeRecord(std::string_view v, Record* r) {
  Reader in(v);
  uint32_t magic = 0, version = 0, n = 0;
  uint8_t pinned = 0;
  if (!in.U32(&magic) || magic != kRecordMagic) return Status::Corruption("bad record magic");
  if (!in.U32(&version)) return Status::Corruption("truncated record");
  if (version != SegmentStore::kFormatVersion) {
    return Status::Unimplemented("record format version " + std::to_string(version));
  }
  uint64_t digest[kDigestBytes / 8] = {};
  if (!in.Str(&r->cache_namespace) || !in.I64(&r->tokens) || !in.U8(&pinned) || !in.U64(&r->last_used) ||
      !in.U64(&r->generation) || !in.U64(&digest[0]) || !in.U64(&digest[1]) || !in.U64(&digest[2]) ||
      !in.U64(&digest[3]) || !in.U32(&n) || n > (1u << 16)) {
    return Status::Corruption("truncated record");
  }
  r->digest.assign(reinterpret_cast<const char*>(digest), kDigestBytes);
  if ((r->generation & kGenerationBit) == 0) return Status::Corruption("record: a generation without its top bit");
  r->pinned = pinned != 0;
  r->blobs.resize(n);
  for (auto& b : r->blobs) {
    uint32_t block_bytes = 0;
    if (!in.Str(&b.name) || !in.U64(&b.size) || !in.U32(&block_bytes) || !in.U32(&b.blocks)) {
      return Status::Corruption("truncated record");
    }
    b.block_bytes = block_bytes;
  }
  const size_t body = in.pos();
  uint64_t sum = 0;
  if (!in.U64(&sum) || !in.done()) return Status::Corruption("truncated record");
  if (sum != Hash64(v.data(), body, kRecordMagic)) return Status::Corruption("record checksum mismatch");
  // Reads place blocks by these fields: they must agree.
  for (const auto& b : r->blobs) {
    if (b.block_bytes < kMinBlockBytes || b.block_bytes > kMaxBlockBytes ||
        b.blocks != BlocksFor(b.size, b.block_bytes)) {
      return Status::Corruption("record: blob '" + b.name + "' of " + std::to_string(b.size) + " bytes has " +
                                std::to_string(b.blocks) + " blocks of " + std::to_string(b.block_bytes) + " bytes");
    }
  }
  return Status::OK();
}

// Block value: magic, version, segment key, generation, blob, block, payload
// size, checksum of everything before it and the payload; then the payload.
std::string BlockHeaderFields(const Hash128& key, uint64_t generation, uint32_t blob, uint32_t block,
                              size_t payload_bytes) {
  std::string s;
  PutU32(&s, kBlockMagic);
  PutU32(&s, SegmentStore::kFormatVersion);
  s += KeyBytes(key);
  PutU64(&s, generation);
  PutU32(&s, blob);
  PutU32(&s, block);
  PutU32(&s, static_cast<uint32_t>(payload_bytes));
  return s;
}
uint64_t BlockChecksum(std::string_view fields, std::string_view payload) {
  Hasher128 h;
  h.Update(fields).Update(payload);
  const Hash128 d = h.Digest();
  return d.lo ^ d.hi;
}
std::string EncodeBlock(const Hash128& key, uint64_t generation, uint32_t blob, uint32_t block,
                        std::string_view payload) {
  std::string s = BlockHeaderFields(key, generation, blob, block, payload.size());
  PutU64(&s, BlockChecksum(s, payload));
  s.append(payload);
  return s;
}
constexpr size_t kBlockHeader = 4 + 4 + kKeyBytes + 8 + 4 + 4 + 4 + 8;

// Checks a block read back (its fields and checksum; its payload want bytes)
// and copies payload bytes [from, from + n) to `out`.
Status CheckBlock(std::string_view v, const Hash128& key, uint64_t generation, uint32_t blob, uint32_t block,
                  size_t want, size_t from, size_t n, char* out) {
  if (v.size() != kBlockHeader + want) {
    return Status::Corruption("block " + std::to_string(block) + " of blob " + std::to_string(blob) + " holds " +
                              std::to_string(v.size()) + " bytes, expected " + std::to_string(kBlockHeader + want));
  }
  std::string expect = BlockHeaderFields(key, generation, blob, block, want);
  PutU64(&expect, BlockChecksum(std::string_view(expect), v.substr(kBlockHeader)));
  if (std::memcmp(expect.data(), v.data(), kBlockHeader) != 0) {
    return Status::Corruption("block " + std::to_string(block) + " of blob " + std::to_string(blob) +
                              ": header or checksum mismatch");
  }
  std::memcpy(out, v.data() + kBlockHeader + from, n);
  return Status::OK();
}

// What a segment holds, for Put over an existing key: a keyed SHA-256 (the
// key is public: this is collision resistance, not secrecy) of the
// namespace, token count and every blob's name and bytes. Block sizes are
// not content.
std::string ContentDigest(const std::string& ns, int64_t tokens, const std::map<std::string, std::string>& blobs) {
  HmacSha256Stream h("penumbra/segment-content-v1");
  auto u64 = [&](uint64_t v) { h.Update(&v, sizeof v); };
  u64(ns.size());
  h.Update(ns);
  u64(static_cast<uint64_t>(tokens));
  u64(blobs.size());
  for (const auto& [name, bytes] : blobs) {
    u64(name.size());
    h.Update(name);
    u64(bytes.size());
    h.Update(bytes);
  }
  const Sha256Digest d = h.Final();
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

// One block to read: payload bytes [from, from + n) of block `block` of blob
// `blob` (named *name; the block's payload is want bytes) go to dst.
struct BlockRead {
  uint32_t blob, block;
  size_t want, from, n;
  char* dst;
  const std::string* name;
};

}  // namespace

struct SegmentStore::Impl {
  SegmentStoreOptions options;
  rocksdb::DBOptions db_options;
  std::vector<rocksdb::ColumnFamilyDescriptor> cf_descriptors;
  std::unique_ptr<storage::RocksWriter> writer;  // every write goes through it
  // Held shared by block reads outside `mu` (Get, ReadBlob: their snapshot
  // and reads), exclusively by a reopen (from a write, under `mu`).
  std::shared_mutex db_mu;
  std::unique_ptr<rocksdb::DB> db;  // null only after a reopen that failed
  rocksdb::ColumnFamilyHandle* meta = nullptr;
  rocksdb::ColumnFamilyHandle* blocks = nullptr;
  rocksdb::ColumnFamilyHandle* pending = nullptr;  // intents: segments whose blocks may be partly written
  rocksdb::ColumnFamilyHandle* default_cf = nullptr;
  mutable std::mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, Record> records;  // committed segments
  std::map<std::pair<uint64_t, uint64_t>, int> attached;
  std::map<std::string, size_t> ns_bytes;
  size_t total_bytes = 0;
  uint64_t clock = 1;
  SegmentStoreStats stats;

  static std::pair<uint64_t, uint64_t> K(const Hash128& h) { return {h.hi, h.lo}; }

  ~Impl() {
    if (db) {
      // Recency that ReadBlob marked in memory only (unsynced, as every
      // recency write).
      rocksdb::WriteBatch recency;
      for (const auto& [k, r] : records) {
        if (r.last_used_unsaved) recency.Put(meta, KeyBytes(Hash128{k.second, k.first}), EncodeRecord(r));
      }
      if (recency.Count() > 0)
        (void)Write("saving recency", [&] { return db->Write(rocksdb::WriteOptions(), &recency); });
      CloseDb();
    }
  }

  void CloseDb() {
    for (auto** h : {&meta, &blocks, &pending, &default_cf}) {
      if (*h) (void)db->DestroyColumnFamilyHandle(*h);
      *h = nullptr;
    }
    (void)db->Close();
    db.reset();
  }

  // RocksWriter's reopen (from a write, under mu): waits for the block
  // reads under way, then closes and opens the database again.
  Result<rocksdb::DB*> Reopen() {
    std::unique_lock<std::shared_mutex> excl(db_mu);
    if (db) CloseDb();
    return OpenDb();
  }

  Result<rocksdb::DB*> OpenDb() {
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* fresh = nullptr;
    PENUMBRA_RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(db_options, options.path, cf_descriptors, &handles, &fresh),
                                       "segment store " + options.path));
    db.reset(fresh);
    default_cf = handles[0];
    meta = handles[1];
    blocks = handles[2];
    pending = handles[3];
    return fresh;
  }

  Status Readable() const {
    return db ? Status::OK()
              : Status::Unavailable("segment store " + options.path + ": closed (reopening after a failed write)");
  }

  // Every write (storage/rocksdb_writer.h): typed, counted, recovered from.
  Status Write(const std::string& what, const std::function<rocksdb::Status()>& write) {
    return writer->Write(what, write);
  }

  rocksdb::WriteOptions CommitOptions() const {
    rocksdb::WriteOptions w;
    w.sync = options.sync_commit;
    return w;
  }

  void Account(const Record& r, bool add) {
    const size_t b = r.bytes();
    if (add) {
      total_bytes += b;
      ns_bytes[r.cache_namespace] += b;
    } else {
      total_bytes -= b;
      ns_bytes[r.cache_namespace] -= b;
    }
  }

  // Drops a segment: an intent and the record's deletion in one synced
  // batch, then its blocks, then the intent. A crash in between leaves the
  // intent, and Open finishes the removal.
  Status Remove(const Hash128& key) {
    auto it = records.find(K(key));
    const uint64_t generation = it->second.generation;
    rocksdb::WriteBatch batch;
    batch.Put(pending, VersionKey(key, generation), "");
    batch.Delete(meta, KeyBytes(key));
    PENUMBRA_RETURN_IF_ERROR(
        Write("deleting segment " + key.Hex(), [&] { return db->Write(CommitOptions(), &batch); }));
    Account(it->second, false);
    records.erase(it);
    // The segment is gone (its record); a failure here leaves the blocks and
    // the intent, which Open finishes.
    if (Status d = DropVersion(key, generation); !d.ok()) {
      LOG(WARNING) << "segment store: the blocks of " << key.Hex() << " stay until reopened: " << d;
    }
    return Status::OK();
  }

  // Deletes every block of one version of `key`, then its intent.
  Status DropVersion(const Hash128& key, uint64_t generation) {
    const std::string prefix = VersionKey(key, generation);
    PENUMBRA_RETURN_IF_ERROR(Write("deleting the blocks of " + key.Hex(), [&] {
      return db->DeleteRange(rocksdb::WriteOptions(), blocks, prefix, PrefixEnd(prefix));
    }));
    return Write("deleting an intent", [&] { return db->Delete(rocksdb::WriteOptions(), pending, prefix); });
  }

  // Reads, checks and copies `jobs`, up to read_threads at once, all as of
  // `snapshot`; the first failure, as Corruption naming the segment and blob.
  // Takes no lock: the caller holds the snapshot taken with the record's
  // lookup, so the blocks are the ones that record describes.
  Status ReadBlocks(const Hash128& key, uint64_t generation, const rocksdb::Snapshot* snapshot,
                    const std::vector<BlockRead>& jobs) const {
    std::atomic<size_t> next{0};
    std::mutex err_mu;
    Status first_error;
    auto worker = [&] {
      rocksdb::ReadOptions ro;
      ro.verify_checksums = true;
      ro.snapshot = snapshot;
      rocksdb::PinnableSlice value;
      for (size_t j; (j = next.fetch_add(1)) < jobs.size();) {
        const BlockRead& job = jobs[j];
        value.Reset();
        rocksdb::Status s = db->Get(ro, blocks, BlockKey(key, generation, job.blob, job.block), &value);
        Status st = s.IsNotFound() ? Status::Corruption("a block of a committed segment is missing")
                                   : FromRocks(s, "segment store: reading a block");
        if (st.ok()) {
          st = CheckBlock(value.ToStringView(), key, generation, job.blob, job.block, job.want, job.from, job.n,
                          job.dst);
        }
        if (!st.ok()) {
          std::lock_guard<std::mutex> l(err_mu);
          if (first_error.ok()) {
            first_error = Status::Corruption("segment " + key.Hex() + ", blob '" + *job.name + "': " + st.message());
          }
          next = jobs.size();  // stop the others early
        }
      }
    };
    const size_t threads = std::min<size_t>(options.read_threads, jobs.size());
    std::vector<std::thread> pool;
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
    return first_error;
  }

  // Get and Get(key, only): the blobs named in *only, or all.
  Result<std::map<std::string, std::string>> Get(const Hash128& key, const std::set<std::string>* only) {
    // Under the lock: the record's blobs to read and a snapshot of the
    // blocks it describes. The reads go without it.
    std::vector<std::pair<uint32_t, BlobLayout>> want;  // blob index, layout
    std::shared_lock<std::shared_mutex> reading;
    std::unique_ptr<rocksdb::ManagedSnapshot> snapshot;
    uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      PENUMBRA_RETURN_IF_ERROR(Readable());
      ++stats.gets;
      auto it = records.find(K(key));
      if (it == records.end()) {
        ++stats.misses;
        return Status::NotFound("segment " + key.Hex() + " is not stored");
      }
      const Record& r = it->second;
      generation = r.generation;
      if (only) {
        for (const std::string& name : *only) {
          if (std::none_of(r.blobs.begin(), r.blobs.end(), [&](const BlobLayout& b) { return b.name == name; })) {
            return Status::InvalidArgument("segment " + key.Hex() + " has no blob '" + name + "'");
          }
        }
      }
      for (uint32_t bi = 0; bi < r.blobs.size(); ++bi) {
        if (!only || only->count(r.blobs[bi].name)) want.emplace_back(bi, r.blobs[bi]);
      }
      reading = std::shared_lock<std::shared_mutex>(db_mu);
      snapshot = std::make_unique<rocksdb::ManagedSnapshot>(db.get());
    }
    // Every block of every blob, read and checked by up to read_threads
    // threads at once (large reads in flight: what NVMe needs), each written
    // in place into its blob.
    std::map<std::string, std::string> out;
    std::vector<BlockRead> jobs;
    for (const auto& [bi, b] : want) {
      std::string& d = out[b.name];
      d.resize(b.size);
      for (uint32_t block = 0; block < b.blocks; ++block) {
        const uint64_t off = static_cast<uint64_t>(block) * b.block_bytes;
        const size_t n = static_cast<size_t>(std::min<uint64_t>(b.block_bytes, b.size - off));
        jobs.push_back({bi, block, n, 0, n, d.data() + off, &b.name});
      }
    }
    const Status read = ReadBlocks(key, generation, snapshot->snapshot(), jobs);
    snapshot.reset();
    reading.unlock();
    std::lock_guard<std::mutex> lock(mu);
    if (!read.ok()) {
      ++stats.corruptions_detected;
      return read;
    }
    ++stats.hits;
    // Recency is persisted without a sync: after a crash it may be older.
    // Not for a record erased since the lookup (that would bring it back).
    if (auto it = records.find(K(key)); it != records.end()) {
      it->second.last_used = clock++;
      it->second.last_used_unsaved = false;
      (void)Write("saving recency",
                  [&] { return db->Put(rocksdb::WriteOptions(), meta, KeyBytes(key), EncodeRecord(it->second)); });
    }
    return out;
  }

  bool Evictable(const std::pair<uint64_t, uint64_t>& k, const Record& r) const {
    auto a = attached.find(k);
    return !r.pinned && (a == attached.end() || a->second == 0);
  }

  // Evicts least-recently-used evictable segments (of `ns` only when
  // `same_ns`; never `keep`, a segment being replaced) until `fits()`; false
  // when it cannot.
  template <class Fits>
  Result<bool> MakeRoom(const std::string& ns, bool same_ns, const Hash128& keep, Fits fits) {
    std::vector<std::pair<uint64_t, std::pair<uint64_t, uint64_t>>> order;
    for (const auto& [k, r] : records) {
      if (Evictable(k, r) && (!same_ns || r.cache_namespace == ns) && k != K(keep)) {
        order.push_back({r.last_used, k});
      }
    }
    std::sort(order.begin(), order.end());
    for (const auto& [used, k] : order) {
      if (fits()) break;
      PENUMBRA_RETURN_IF_ERROR(Remove(Hash128{k.second, k.first}));
      ++stats.evictions;
    }
    return fits();
  }

  Status Load() {
    // Committed records.
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), meta));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->key().size() != kKeyBytes) {
        ++stats.corruptions_detected;
        continue;
      }
      Record r;
      Status s = DecodeRecord(std::string_view(it->value().data(), it->value().size()), &r);
      if (s.code() == StatusCode::kUnimplemented) {
        ++stats.unknown_versions;
        continue;
      }
      if (!s.ok()) {
        ++stats.corruptions_detected;
        continue;
      }
      const Hash128 key = KeyFrom(it->key().data());
      clock = std::max({clock, r.last_used + 1, (r.generation & ~kGenerationBit) + 1});
      Account(r, true);
      records.emplace(K(key), std::move(r));
    }
    PENUMBRA_RETURN_IF_ERROR(FromRocks(it->status(), "segment store: reading records"));
    // Intents: a write or removal of one version that did not finish.
    // Without a committed record of that version, its blocks are deleted
    // (an interrupted write, or the old version of a replacement or a
    // removal); with one (a write whose record was committed after its
    // intent), the intent alone goes. A 16-byte intent is format 2's (not
    // this binary's to act on); anything else is dropped.
    std::unique_ptr<rocksdb::Iterator> p(db->NewIterator(rocksdb::ReadOptions(), pending));
    std::vector<std::string> intents;
    for (p->SeekToFirst(); p->Valid(); p->Next()) intents.push_back(p->key().ToString());
    PENUMBRA_RETURN_IF_ERROR(FromRocks(p->status(), "segment store: reading intents"));
    p.reset();
    for (const std::string& k : intents) {
      if (k.size() == kKeyBytes) continue;
      if (k.size() != kKeyBytes + 8) {
        PENUMBRA_RETURN_IF_ERROR(
            Write("deleting an intent", [&] { return db->Delete(rocksdb::WriteOptions(), pending, k); }));
        continue;
      }
      const Hash128 key = KeyFrom(k.data());
      const uint64_t generation = GetBigEndian64(k.data() + kKeyBytes);
      auto it = records.find(K(key));
      if (it != records.end() && it->second.generation == generation) {
        PENUMBRA_RETURN_IF_ERROR(
            Write("deleting an intent", [&] { return db->Delete(rocksdb::WriteOptions(), pending, k); }));
      } else {
        PENUMBRA_RETURN_IF_ERROR(DropVersion(key, generation));
        ++stats.orphans_removed;
      }
    }
    return Status::OK();
  }
};

const OptionTable<SegmentStoreOptions>& SegmentStoreOptionTable() {
  using O = SegmentStoreOptions;
  static const auto* table =
      &(*new OptionTable<O>("storage.disk"))
           .String(&O::path, "", "path", "DIR",
                   "the store's RocksDB directory (created when missing); \"\": no disk tier")
           .Int(&O::capacity_bytes, "", "capacity_bytes", size_t{1}, size_t{1} << 55,
                "stored document bytes at most (least recently used unpinned documents evicted)")
           .Int(&O::block_bytes, "", "block_bytes", SegmentStore::kMinBlockBytes, SegmentStore::kMaxBlockBytes,
                "bytes per stored block (each checksummed) of blobs given no block size")
           .Int(&O::read_threads, "", "read_threads", size_t{1}, size_t{256},
                "blocks read at once when a document is read back")
           .Int(&O::block_cache_bytes, "", "block_cache_bytes", size_t{0}, size_t{1} << 45, "RocksDB's block cache")
           .Bool(&O::sync_commit, "", "sync_commit",
                 "fsync the WAL when a document is committed (what was acknowledged survives kill -9)")
           .Bool(&O::direct_reads, "", "direct_reads", "read with O_DIRECT (bypassing the page cache)");
  return *table;
}

Status LoadSegmentStoreOptions(ConfigReader& r, SegmentStoreOptions* o) { return SegmentStoreOptionTable().Load(r, o); }

SegmentStore::SegmentStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SegmentStore::~SegmentStore() = default;

Result<std::unique_ptr<SegmentStore>> SegmentStore::Open(const SegmentStoreOptions& o) {
  if (o.path.empty()) return Status::InvalidArgument("segment store: path is empty");
  if (o.block_bytes < kMinBlockBytes || o.block_bytes > kMaxBlockBytes) {
    return Status::InvalidArgument("segment store: block_bytes must be in [" + std::to_string(kMinBlockBytes) + ", " +
                                   std::to_string(kMaxBlockBytes) + "], got " + std::to_string(o.block_bytes));
  }
  if (o.read_threads < 1 || o.read_threads > 256) {
    return Status::InvalidArgument("segment store: read_threads must be in [1, 256], got " +
                                   std::to_string(o.read_threads));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  impl->writer = std::make_unique<storage::RocksWriter>("segment store", o.path);
  rocksdb::DBOptions& dbo = impl->db_options;
  impl->writer->Configure(&dbo);
  dbo.create_if_missing = true;
  dbo.create_missing_column_families = true;
  dbo.paranoid_checks = true;  // refuse to open over detected corruption rather than drop data silently
  dbo.max_open_files = 256;
  dbo.use_direct_reads = o.direct_reads;
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = rocksdb::NewLRUCache(o.block_cache_bytes);
  rocksdb::ColumnFamilyOptions meta_cf;
  meta_cf.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::ColumnFamilyOptions blocks_cf = meta_cf;
  blocks_cf.compression = rocksdb::kNoCompression;  // bf16/f32 values barely compress
  blocks_cf.enable_blob_files = true;               // large values in blob files, not through compactions
  blocks_cf.min_blob_size = 4096;
  blocks_cf.blob_compression_type = rocksdb::kNoCompression;
  blocks_cf.enable_blob_garbage_collection = true;
  impl->cf_descriptors = {
      {rocksdb::kDefaultColumnFamilyName, meta_cf}, {"meta", meta_cf}, {"blocks", blocks_cf}, {"pending", meta_cf}};
  PENUMBRA_ASSIGN_OR_RETURN(rocksdb::DB * db, impl->OpenDb());
  impl->writer->Attach(db, [m = impl.get()] { return m->Reopen(); });
  PENUMBRA_RETURN_IF_ERROR(impl->Load());
  return std::unique_ptr<SegmentStore>(new SegmentStore(std::move(impl)));
}

Status SegmentStore::Put(const Hash128& key, const std::string& ns, int64_t tokens,
                         const std::map<std::string, std::string>& blobs,
                         const std::map<std::string, size_t>& blob_block_bytes) {
  Impl& m = *impl_;
  if (tokens < 1) return Status::InvalidArgument("segment store: token count must be >= 1");
  for (const auto& [name, block_bytes] : blob_block_bytes) {
    if (!blobs.count(name)) {
      return Status::InvalidArgument("segment store: blob_block_bytes names '" + name +
                                     "', which is not a blob of the segment");
    }
    if (block_bytes < kMinBlockBytes || block_bytes > kMaxBlockBytes) {
      return Status::InvalidArgument("segment store: block bytes of blob '" + name + "' must be in [" +
                                     std::to_string(kMinBlockBytes) + ", " + std::to_string(kMaxBlockBytes) +
                                     "], got " + std::to_string(block_bytes));
    }
  }
  Record r;
  r.cache_namespace = ns;
  r.tokens = tokens;
  size_t bytes = 0;
  for (const auto& [name, data] : blobs) {
    if (name.empty()) return Status::InvalidArgument("segment store: a blob has an empty name");
    auto given = blob_block_bytes.find(name);
    const size_t block_bytes = given == blob_block_bytes.end() ? m.options.block_bytes : given->second;
    r.blobs.push_back({name, data.size(), block_bytes, static_cast<uint32_t>(BlocksFor(data.size(), block_bytes))});
    bytes += data.size();
  }
  r.digest = ContentDigest(ns, tokens, blobs);  // outside the lock: it reads every byte
  std::lock_guard<std::mutex> lock(m.mu);
  // A key present already: the same content is stored (a no-op); other
  // content replaces it, unless a reader holds it.
  std::optional<Record> old;
  if (auto it = m.records.find(Impl::K(key)); it != m.records.end()) {
    if (it->second.digest == r.digest) return Status::OK();
    if (auto a = m.attached.find(Impl::K(key)); a != m.attached.end() && a->second > 0) {
      return Status::FailedPrecondition("segment store: segment " + key.Hex() + " is stored with other content and " +
                                        "is attached (" + std::to_string(a->second) +
                                        " users): it cannot be replaced now");
    }
    old = it->second;
    r.pinned = old->pinned;  // a pin is the key's, not the version's
  }
  // Room: the namespace's quota first, then the capacity; the version being
  // replaced is neither evicted nor counted (it goes with this Put).
  const size_t old_ns_bytes = old && old->cache_namespace == ns ? old->bytes() : 0;
  const size_t old_bytes = old ? old->bytes() : 0;
  if (auto q = m.options.namespace_quota_bytes.find(ns); q != m.options.namespace_quota_bytes.end()) {
    if (bytes > q->second) {
      return Status::ResourceExhausted("segment store: " + std::to_string(bytes) + " bytes exceed namespace '" + ns +
                                       "' quota of " + std::to_string(q->second));
    }
    PENUMBRA_ASSIGN_OR_RETURN(
        bool ok, m.MakeRoom(ns, true, key, [&] { return m.ns_bytes[ns] - old_ns_bytes + bytes <= q->second; }));
    if (!ok) {
      return Status::ResourceExhausted("segment store: namespace '" + ns +
                                       "' is at its quota and its segments are pinned or in use");
    }
  }
  if (bytes > m.options.capacity_bytes) {
    return Status::ResourceExhausted("segment store: " + std::to_string(bytes) + " bytes exceed the capacity");
  }
  PENUMBRA_ASSIGN_OR_RETURN(bool ok, m.MakeRoom(ns, false, key, [&] {
    return m.total_bytes - old_bytes + bytes <= m.options.capacity_bytes;
  }));
  if (!ok) return Status::ResourceExhausted("segment store: full, and its segments are pinned or in use");
  // The intent, then the blocks of a new version (no sync: the commit's
  // synced write covers them, the WAL being one ordered log), then the
  // record with the intent's removal in one synced batch (and, replacing,
  // an intent to drop the old version's blocks, dropped next).
  r.generation = kGenerationBit | m.clock++;
  const std::string version = VersionKey(key, r.generation);
  PENUMBRA_RETURN_IF_ERROR(m.Write("writing the intent of " + key.Hex(),
                                   [&] { return m.db->Put(rocksdb::WriteOptions(), m.pending, version, ""); }));
  Status written;
  uint32_t blob_index = 0;
  for (const auto& [name, data] : blobs) {
    const size_t block_bytes = r.blobs[blob_index].block_bytes;
    for (size_t off = 0, block = 0; written.ok() && off < data.size(); off += block_bytes, ++block) {
      const size_t n = std::min(block_bytes, data.size() - off);
      const std::string v = EncodeBlock(key, r.generation, blob_index, static_cast<uint32_t>(block),
                                        std::string_view(data).substr(off, n));
      written = m.Write("writing a block of " + key.Hex(), [&] {
        return m.db->Put(rocksdb::WriteOptions(), m.blocks,
                         BlockKey(key, r.generation, blob_index, static_cast<uint32_t>(block)), v);
      });
    }
    ++blob_index;
  }
  r.last_used = m.clock++;
  if (written.ok()) {
    rocksdb::WriteBatch commit;
    commit.Put(m.meta, KeyBytes(key), EncodeRecord(r));
    commit.Delete(m.pending, version);
    if (old) commit.Put(m.pending, VersionKey(key, old->generation), "");
    written = m.Write("committing segment " + key.Hex(), [&] { return m.db->Write(m.CommitOptions(), &commit); });
  }
  if (!written.ok()) {
    // Nothing new is visible; the blocks written go now (or at the next Open,
    // which finds the intent).
    (void)m.DropVersion(key, r.generation);
    return written;
  }
  if (old) {
    m.Account(*old, false);
    ++m.stats.replacements;
  }
  m.Account(r, true);
  m.records[Impl::K(key)] = std::move(r);
  ++m.stats.puts;
  if (old) {
    // The old version's blocks; a failure leaves its intent for Open.
    if (Status d = m.DropVersion(key, old->generation); !d.ok()) {
      LOG(WARNING) << "segment store: the replaced version of " << key.Hex() << " stays until reopened: " << d;
    }
  }
  return Status::OK();
}

Status SegmentStore::CheckRoom(const std::string& ns, uint64_t bytes) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (bytes > impl_->options.capacity_bytes) {
    return Status::ResourceExhausted("segment store: " + std::to_string(bytes) + " bytes exceed the capacity of " +
                                     std::to_string(impl_->options.capacity_bytes));
  }
  if (auto q = impl_->options.namespace_quota_bytes.find(ns);
      q != impl_->options.namespace_quota_bytes.end() && bytes > q->second) {
    return Status::ResourceExhausted("segment store: " + std::to_string(bytes) + " bytes exceed namespace '" + ns +
                                     "' quota of " + std::to_string(q->second));
  }
  return Status::OK();
}

Result<std::map<std::string, std::string>> SegmentStore::Get(const Hash128& key) { return impl_->Get(key, nullptr); }

Result<std::map<std::string, std::string>> SegmentStore::Get(const Hash128& key, const std::set<std::string>& only) {
  return impl_->Get(key, &only);
}

Status SegmentStore::ReadBlob(const Hash128& key, const std::string& blob, uint64_t offset, uint64_t length,
                              void* dst) {
  Impl& m = *impl_;
  // Under the lock: the blob's layout and a snapshot of its blocks.
  uint32_t index = 0;
  BlobLayout b;
  uint64_t generation = 0;
  std::shared_lock<std::shared_mutex> reading;
  std::unique_ptr<rocksdb::ManagedSnapshot> snapshot;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    PENUMBRA_RETURN_IF_ERROR(m.Readable());
    auto it = m.records.find(Impl::K(key));
    if (it == m.records.end()) return Status::NotFound("segment " + key.Hex() + " is not stored");
    const std::vector<BlobLayout>& blobs = it->second.blobs;
    while (index < blobs.size() && blobs[index].name != blob) ++index;
    if (index == blobs.size()) return Status::InvalidArgument("segment " + key.Hex() + " has no blob '" + blob + "'");
    b = blobs[index];
    generation = it->second.generation;
    if (offset > b.size || length > b.size - offset) {
      return Status::InvalidArgument("segment " + key.Hex() + ", blob '" + blob + "': " + std::to_string(length) +
                                     " bytes at offset " + std::to_string(offset) + " end past its " +
                                     std::to_string(b.size) + " bytes");
    }
    if (length > 0) {
      reading = std::shared_lock<std::shared_mutex>(m.db_mu);
      snapshot = std::make_unique<rocksdb::ManagedSnapshot>(m.db.get());
    }
  }
  // The blocks covering [offset, end), each read whole (its checksum covers
  // it) and the covered part copied straight to dst.
  std::vector<BlockRead> jobs;
  const uint64_t end = offset + length;
  for (uint64_t block = offset / b.block_bytes; length > 0 && block * b.block_bytes < end; ++block) {
    const uint64_t start = block * b.block_bytes;
    const size_t want = static_cast<size_t>(std::min<uint64_t>(b.block_bytes, b.size - start));
    const uint64_t from = std::max(offset, start) - start;
    const uint64_t to = std::min<uint64_t>(end, start + want) - start;
    jobs.push_back({index, static_cast<uint32_t>(block), want, static_cast<size_t>(from),
                    static_cast<size_t>(to - from), static_cast<char*>(dst) + (start + from - offset), &b.name});
  }
  const Status read = jobs.empty() ? Status::OK() : m.ReadBlocks(key, generation, snapshot->snapshot(), jobs);
  snapshot.reset();
  if (reading.owns_lock()) reading.unlock();
  std::lock_guard<std::mutex> lock(m.mu);
  if (!read.ok()) {
    ++m.stats.corruptions_detected;
    return read;
  }
  ++m.stats.blob_reads;
  // Recency in memory only (a write per small read would cost more than the
  // read); persisted by the next Get, Pin, or at close.
  if (auto it = m.records.find(Impl::K(key)); it != m.records.end()) {
    it->second.last_used = m.clock++;
    it->second.last_used_unsaved = true;
  }
  return Status::OK();
}

Result<std::vector<BlobLayout>> SegmentStore::Layout(const Hash128& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->records.find(Impl::K(key));
  if (it == impl_->records.end()) return Status::NotFound("segment " + key.Hex() + " is not stored");
  return it->second.blobs;
}

Result<SegmentInfo> SegmentStore::Info(const Hash128& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->records.find(Impl::K(key));
  if (it == impl_->records.end()) return Status::NotFound("segment " + key.Hex() + " is not stored");
  SegmentInfo i;
  i.cache_namespace = it->second.cache_namespace;
  i.tokens = it->second.tokens;
  i.bytes = it->second.bytes();
  i.pinned = it->second.pinned;
  auto a = impl_->attached.find(Impl::K(key));
  i.attached = a == impl_->attached.end() ? 0 : a->second;
  i.last_used = it->second.last_used;
  return i;
}

bool SegmentStore::Contains(const Hash128& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->records.count(Impl::K(key)) > 0;
}

Status SegmentStore::Attach(const Hash128& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->records.count(Impl::K(key))) return Status::NotFound("segment " + key.Hex() + " is not stored");
  ++impl_->attached[Impl::K(key)];
  return Status::OK();
}

Status SegmentStore::Detach(const Hash128& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto a = impl_->attached.find(Impl::K(key));
  if (a == impl_->attached.end() || a->second == 0) {
    return Status::FailedPrecondition("segment " + key.Hex() + " is not attached");
  }
  if (--a->second == 0) impl_->attached.erase(a);
  return Status::OK();
}

Status SegmentStore::Pin(const Hash128& key, bool pinned) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.records.find(Impl::K(key));
  if (it == m.records.end()) return Status::NotFound("segment " + key.Hex() + " is not stored");
  Record r = it->second;
  r.pinned = pinned;
  r.last_used_unsaved = false;
  PENUMBRA_RETURN_IF_ERROR(m.Write("pinning segment " + key.Hex(), [&] {
    return m.db->Put(m.CommitOptions(), m.meta, KeyBytes(key), EncodeRecord(r));
  }));
  it->second = std::move(r);
  return Status::OK();
}

Result<std::shared_ptr<BlobReader>> SegmentStore::OpenReader(const Hash128& key) {
  return OpenSegmentReader(this, key);
}

Status SegmentStore::Erase(const Hash128& key) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.records.find(Impl::K(key));
  if (it == m.records.end()) return Status::NotFound("segment " + key.Hex() + " is not stored");
  if (auto a = m.attached.find(Impl::K(key)); a != m.attached.end() && a->second > 0) {
    return Status::FailedPrecondition("segment " + key.Hex() + " is attached (" + std::to_string(a->second) +
                                      " users)");
  }
  return m.Remove(key);
}

Status SegmentStore::Flush() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->Write("flushing", [&] {
    rocksdb::FlushOptions f;
    f.wait = true;
    return impl_->db->Flush(f, {impl_->meta, impl_->blocks});
  });
}

size_t SegmentStore::bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->total_bytes;
}

size_t SegmentStore::NamespaceBytes(const std::string& ns) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->ns_bytes.find(ns);
  return it == impl_->ns_bytes.end() ? 0 : it->second;
}

std::vector<Hash128> SegmentStore::Keys() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<Hash128> out;
  for (const auto& [k, r] : impl_->records) out.push_back(Hash128{k.second, k.first});
  return out;
}

WriteHealth SegmentStore::write_health() const { return impl_->writer->health(); }

SegmentStoreStats SegmentStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace penumbra::storage
