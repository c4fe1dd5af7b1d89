// libFuzzer target: the value-store node's request handler (StoreService,
// store_node/store_node.h) over a real SegmentStore in a temporary
// directory, fed arbitrary (caller, method, payload). It must answer every
// input with a value or a typed error — never crash, throw, leak or hang —
// and keep its bounds (readers, uploads and upload bytes in flight). State
// carries over between inputs (stored documents, open readers and uploads),
// so sequences reach deep paths: a request whose upload or reader handle is
// "@uN" or "@rN" gets the Nth most recent handle the node gave out (handles
// are random: a fuzzer could not guess them, which is the point).
// Input: byte 0 the caller (one of three client ids), bytes 1..4 the method
// (little-endian), the rest the payload (a StoreRequest, or anything).
// Built and run by .ci/fuzz.sh; seeds written when PENUMBRA_FUZZ_SEEDS is set.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <thrift/TConfiguration.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "common/logging.h"
#include "storage/segment_store.h"
#include "store_node/store_node.h"
#include "store_types.h"

namespace {

namespace st = penumbra::rpc::store;
using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TMemoryBuffer;

struct State {
  std::string dir;
  std::unique_ptr<penumbra::storage::SegmentStore> store;
  std::unique_ptr<penumbra::transport::StoreService> service;
  std::deque<std::string> uploads, readers;  // most recent first
};
State* g = nullptr;

std::string Ser(const st::StoreRequest& q) {
  auto buf = std::make_shared<TMemoryBuffer>();
  TBinaryProtocol proto(buf);
  q.write(&proto);
  return buf->getBufferAsString();
}

bool De(const std::string& bytes, st::StoreRequest* q) {
  if (!penumbra::transport::IsWellFormedStoreMessage(bytes, /*request=*/true)) return false;
  try {
    auto config = std::make_shared<apache::thrift::TConfiguration>(1 << 20, 1 << 20, 16);
    auto buf = std::make_shared<TMemoryBuffer>(reinterpret_cast<uint8_t*>(const_cast<char*>(bytes.data())),
                                               static_cast<uint32_t>(bytes.size()), TMemoryBuffer::OBSERVE, config);
    TBinaryProtocol proto(buf);
    proto.setStringSizeLimit(1 << 20);
    proto.setContainerSizeLimit(1 << 12);
    q->read(&proto);
    return true;
  } catch (...) {
    return false;
  }
}

// "@uN" / "@rN": the Nth most recent upload / reader handle.
void Resolve(std::string* handle, const std::deque<std::string>& recent, char kind) {
  if (handle->size() != 3 || (*handle)[0] != '@' || (*handle)[1] != kind || recent.empty()) return;
  *handle = recent[static_cast<size_t>((*handle)[2] - '0') % recent.size()];
}

st::StoreReply ReplyOf(const std::string& bytes) {
  st::StoreReply r;
  if (!penumbra::transport::IsWellFormedStoreMessage(bytes, /*request=*/false)) std::abort();  // the node's own
  try {
    auto buf = std::make_shared<TMemoryBuffer>(reinterpret_cast<uint8_t*>(const_cast<char*>(bytes.data())),
                                               static_cast<uint32_t>(bytes.size()));
    TBinaryProtocol proto(buf);
    r.read(&proto);
  } catch (...) {
  }
  return r;
}

void Remember(std::deque<std::string>* recent, const std::string& handle) {
  if (handle.empty()) return;
  recent->push_front(handle);
  if (recent->size() > 10) recent->pop_back();
}

void WriteSeed(const std::string& dir, const std::string& name, uint8_t caller, uint32_t method,
               const st::StoreRequest& q) {
  std::string bytes(1, static_cast<char>(caller));
  bytes.append(reinterpret_cast<const char*>(&method), 4);
  bytes += Ser(q);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

void WriteSeeds(const std::string& dir) {
  st::StoreRequest begin;
  begin.key.hi = 1;
  begin.key.lo = 2;
  begin.cache_namespace = "ns";
  begin.tokens = 5;
  begin.sizes["v"] = 5000;
  begin.sizes["m"] = 10;
  begin.block_bytes["v"] = 4096;
  WriteSeed(dir, "put_begin", 0, st::StoreMethod::PUT_BEGIN, begin);
  st::StoreRequest part;
  part.upload = "@u0";
  part.blob = "v";
  part.offset = 0;
  part.data = std::string(5000, 'v');
  WriteSeed(dir, "put_part_v", 0, st::StoreMethod::PUT_PART, part);
  part.blob = "m";
  part.data = std::string(10, 'm');
  WriteSeed(dir, "put_part_m", 0, st::StoreMethod::PUT_PART, part);
  part.offset = 4990;
  WriteSeed(dir, "put_part_past", 0, st::StoreMethod::PUT_PART, part);
  st::StoreRequest commit;
  commit.upload = "@u0";
  WriteSeed(dir, "put_commit", 0, st::StoreMethod::PUT_COMMIT, commit);
  WriteSeed(dir, "put_commit_other_client", 1, st::StoreMethod::PUT_COMMIT, commit);
  st::StoreRequest key;
  key.key.hi = 1;
  key.key.lo = 2;
  WriteSeed(dir, "open", 0, st::StoreMethod::OPEN, key);
  WriteSeed(dir, "layout", 0, st::StoreMethod::LAYOUT, key);
  WriteSeed(dir, "info", 2, st::StoreMethod::INFO, key);
  WriteSeed(dir, "erase", 0, st::StoreMethod::ERASE, key);
  st::StoreRequest read;
  read.reader = "@r0";
  read.blob = "v";
  read.offsets = {0, 4096, 100};
  read.lengths = {4096, 904, 10};
  WriteSeed(dir, "readv", 0, st::StoreMethod::READV, read);
  WriteSeed(dir, "readv_other_client", 1, st::StoreMethod::READV, read);
  st::StoreRequest close;
  close.reader = "@r0";
  WriteSeed(dir, "close", 0, st::StoreMethod::CLOSE, close);
  st::StoreRequest huge = begin;
  huge.sizes["v"] = int64_t{1} << 40;
  WriteSeed(dir, "put_begin_1tib", 0, st::StoreMethod::PUT_BEGIN, huge);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  penumbra::InitLogging((*argv)[0]);
  FLAGS_minloglevel = 2;  // errors only: the handler logs idle readers and the like
  g = new State();
  char tmpl[] = "/tmp/store_node_fuzz-XXXXXX";
  g->dir = mkdtemp(tmpl);
  // At exit only the directory goes: the store is left open (still
  // reachable, so no leak), as closing RocksDB from an exit handler races
  // its own static destructors.
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(g->dir, ec);
  });
  penumbra::storage::SegmentStoreOptions so;
  so.path = g->dir + "/db";
  so.capacity_bytes = 32 << 20;
  so.block_bytes = 4096;
  so.sync_commit = false;
  so.read_threads = 2;
  so.namespace_quota_bytes["small"] = 1 << 16;
  auto store = penumbra::storage::SegmentStore::Open(so);
  if (!store.ok()) std::abort();
  g->store = std::move(*store);
  penumbra::transport::StoreServiceOptions o;
  o.max_readers = 16;
  o.max_uploads = 4;
  o.max_upload_bytes = 16 << 20;
  o.max_blobs = 64;
  g->service = std::make_unique<penumbra::transport::StoreService>(g->store.get(), o);
  if (const char* dir = std::getenv("PENUMBRA_FUZZ_SEEDS")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  static const char* kClients[] = {"00000000000000000000000000000000", "11111111111111111111111111111111",
                                   "22222222222222222222222222222222"};
  penumbra::transport::UcxCaller caller;
  caller.client_id = kClients[data[0] % 3];
  caller.authenticated = true;
  uint32_t method = 0;
  std::memcpy(&method, data + 1, 4);
  std::string payload(reinterpret_cast<const char*>(data + 5), size - 5);
  st::StoreRequest q;
  if (De(payload, &q)) {
    const std::string u = q.upload, r = q.reader;
    Resolve(&q.upload, g->uploads, 'u');
    Resolve(&q.reader, g->readers, 'r');
    if (q.upload != u || q.reader != r) payload = Ser(q);
  }
  penumbra::Result<std::string> reply = g->service->Handle(caller, method, std::move(payload));
  if (reply.ok()) {
    if (method == st::StoreMethod::PUT_BEGIN) Remember(&g->uploads, ReplyOf(*reply).upload);
    if (method == st::StoreMethod::OPEN) Remember(&g->readers, ReplyOf(*reply).reader);
  } else if (reply.status().code() == penumbra::StatusCode::kInternal) {
    // Nothing an outsider sends may surface as a bug.
    std::fprintf(stderr, "Internal: %s\n", reply.status().ToString().c_str());
    std::abort();
  }
  const auto& o = g->service->options();
  if (g->service->open_readers() > o.max_readers || g->service->open_uploads() > o.max_uploads ||
      g->service->upload_bytes() > o.max_upload_bytes) {
    std::abort();
  }
  return 0;
}
