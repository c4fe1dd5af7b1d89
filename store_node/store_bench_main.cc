// penumbra-store-bench: the bandwidth of reading a stored document's values
// from a value-store node (another process, over UCX) beside reading them
// from the local disk store and beside a gather from local DRAM (what a
// worker does when the values are in its own memory). Two JSON lines: the
// "store-gather" row (every figure), then the "store-node-read" row (the
// node read as a LazyBlob reads it: gb_per_s, blob_bytes, block_bytes,
// blocks_per_message, and the transports UCX chose for each connection).
//
//   penumbra-store-bench [--mb 1024] [--block-bytes 16384] [--threads 32] [--dir /tmp/...]
//                        [--cluster-secret-file F] [--connections 4] [--node-workers 4]
//
// With --cluster-secret-file the node and this client hold the secret: the
// plane is authenticated and encrypted (AES-256-GCM bodies, MAC'd headers);
// without it, plaintext with checksums. Run both on the same --dir (the
// document is then stored once: a second Put of the same content is a no-op)
// to compare them on the same blob.
//
// The document is one blob of --mb MiB stored in --block-bytes blocks (the
// lazy values' layout); reads are block-sized, --threads at once, in a
// random order (a question's chunks): one block per message, then as many
// per message as a LazyBlob asks for (BlobReader::batch_blocks); then the
// whole blob (64 MiB reads, one thread).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/crypto.h"
#include "common/hash.h"
#include "common/logging.h"
#include "common/option_table.h"
#include "common/process.h"
#include "storage/lazy_blob.h"
#include "storage/segment_store.h"
#include "store_node/store_node.h"

namespace penumbra {
namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Reads blocks `order` of `reader`'s blob with `threads` threads, `batch`
// blocks per ReadMany; seconds.
Result<double> ReadBlocks(storage::BlobReader& reader, uint64_t size, size_t block, const std::vector<uint32_t>& order,
                          int threads, size_t batch, char* dst) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  Status first;
  std::mutex mu;
  const double t0 = Now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      std::vector<storage::BlobReader::Piece> pieces;
      for (size_t i = next.fetch_add(batch); i < order.size() && !failed; i = next.fetch_add(batch)) {
        pieces.clear();
        for (size_t k = i; k < std::min(order.size(), i + batch); ++k) {
          const uint64_t off = static_cast<uint64_t>(order[k]) * block;
          pieces.push_back({off, std::min<uint64_t>(block, size - off), dst + off});
        }
        Status s = reader.ReadMany("values", pieces);
        if (!s.ok()) {
          std::lock_guard<std::mutex> lk(mu);
          if (!failed.exchange(true)) first = s;
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  if (failed) return first;
  return Now() - t0;
}

struct StoreBenchOptions {
  int64_t mb = 1024;                // MiB of values. Default: 1024.
  int64_t block_bytes = 16384;      // bytes per block. Default: 16384.
  int64_t threads = 32;             // reads in flight. Default: 32.
  std::string dir;                  // a scratch directory; "": a new one in /tmp. Default: "".
  std::string cluster_secret_file;  // seals the store plane (node and client); "": plaintext. Default: "".
  int64_t connections = 4;          // the client's connections to the node (UcxClientOptions). Default: 4.
  int64_t node_workers = 4;         // the node's UCX workers (--ucx-workers). Default: 4.
};

const OptionTable<StoreBenchOptions>& StoreBenchOptionTable() {
  using O = StoreBenchOptions;
  static const auto* table =
      &(*new OptionTable<O>("store bench"))
           .Int(&O::mb, "mb", "", int64_t{1}, int64_t{1} << 20, "MiB of values")
           .Int(&O::block_bytes, "block-bytes", "", int64_t{4096}, int64_t{64} << 20, "bytes per block")
           .Int(&O::threads, "threads", "", int64_t{1}, int64_t{1024}, "reads in flight")
           .String(&O::dir, "dir", "", "DIR", "a scratch directory")
           .Unset("", "a new one in /tmp")
           .String(&O::cluster_secret_file, "cluster-secret-file", "", "FILE",
                   "seal the store plane with this secret (node and client)")
           .Unset("", "none: plaintext")
           .Int(&O::connections, "connections", "", int64_t{1}, int64_t{64}, "the client's connections to the node")
           .Int(&O::node_workers, "node-workers", "", int64_t{1}, int64_t{64}, "the node's UCX workers");
  return *table;
}

Args Flags() {
  Args a;
  StoreBenchOptionTable().AddFlags(a);
  return a;
}

Status Run(int argc, char** argv) {
  Args a = Flags();
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 1));
  StoreBenchOptions bo;
  PENUMBRA_RETURN_IF_ERROR(StoreBenchOptionTable().ApplyFlags(a, &bo));
  const int64_t mb = bo.mb, block = bo.block_bytes, threads = bo.threads;
  std::string dir = bo.dir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/penumbra-store-bench-XXXXXX";
    dir = mkdtemp(tmpl);
  }
  std::error_code mk;
  std::filesystem::create_directories(dir, mk);
  if (mk) return Status::IOError("cannot create " + dir + ": " + mk.message());
  const uint64_t size = static_cast<uint64_t>(mb) << 20;
  const size_t B = static_cast<size_t>(block);
  std::string values(size, '\0');
  for (uint64_t i = 0; i < size; i += 8) {
    const uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(values.data() + i, &v, std::min<uint64_t>(8, size - i));
  }
  const Hash128 key = Hasher128().Update("store-bench").Digest();
  storage::SegmentStoreOptions so;
  so.path = dir + "/db";
  so.capacity_bytes = size * 2 + (size_t{1} << 30);
  so.read_threads = static_cast<size_t>(threads);
  std::optional<ClusterSecret> secret;
  const std::string& secret_file = bo.cluster_secret_file;
  if (!secret_file.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(ClusterSecret s, ClusterSecret::Load(secret_file));
    secret = s;
  }
  nlohmann::json j = {{"bench", "store-gather"},
                      {"bytes", size},
                      {"block_bytes", B},
                      {"threads", threads},
                      {"sealed", secret.has_value()}};
  const uint32_t blocks = static_cast<uint32_t>((size + B - 1) / B);
  std::vector<uint32_t> order(blocks);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  std::vector<char> dst(size);
  {
    // Local DRAM: the same blocks gathered from memory (memcpy), one thread per stream.
    const double t0 = Now();
    std::vector<std::thread> pool;
    std::atomic<size_t> next{0};
    for (int t = 0; t < std::min<int64_t>(threads, std::thread::hardware_concurrency()); ++t) {
      pool.emplace_back([&] {
        for (size_t i = next++; i < order.size(); i = next++) {
          const uint64_t off = static_cast<uint64_t>(order[i]) * B;
          std::memcpy(dst.data() + off, values.data() + off, std::min<uint64_t>(B, size - off));
        }
      });
    }
    for (auto& t : pool) t.join();
    j["dram_gather_gb_per_s"] = static_cast<double>(size) / (Now() - t0) / 1e9;
  }
  {
    // Local disk: the store in this process.
    PENUMBRA_ASSIGN_OR_RETURN(auto store, storage::SegmentStore::Open(so));
    const double t0 = Now();
    PENUMBRA_RETURN_IF_ERROR(store->Put(key, "", 1, {{"values", values}}, {{"values", B}}));
    PENUMBRA_RETURN_IF_ERROR(store->Flush());
    j["put_gb_per_s"] = static_cast<double>(size) / (Now() - t0) / 1e9;
    PENUMBRA_ASSIGN_OR_RETURN(auto reader, store->OpenReader(key));
    std::fill(dst.begin(), dst.end(), 0);
    PENUMBRA_ASSIGN_OR_RETURN(double s, ReadBlocks(*reader, size, B, order, static_cast<int>(threads), 1, dst.data()));
    if (std::memcmp(dst.data(), values.data(), size) != 0) return Status::Internal("local read: wrong bytes");
    j["local_blocks_gb_per_s"] = static_cast<double>(size) / s / 1e9;
  }
  // The node: another process on the same directory.
  const std::string port_file = dir + "/port.json";
  std::filesystem::remove(port_file);
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string bin = std::filesystem::read_symlink("/proc/self/exe").parent_path().string() + "/penumbra-store";
    const std::string th = std::to_string(std::max<int64_t>(8, threads));
    const std::string workers = std::to_string(bo.node_workers);
    if (secret_file.empty()) {
      execl(bin.c_str(), "penumbra-store", "--path", so.path.c_str(), "--port-file", port_file.c_str(), "--threads",
            th.c_str(), "--ucx-workers", workers.c_str(), static_cast<char*>(nullptr));
    } else {
      execl(bin.c_str(), "penumbra-store", "--path", so.path.c_str(), "--port-file", port_file.c_str(), "--threads",
            th.c_str(), "--ucx-workers", workers.c_str(), "--cluster-secret-file", secret_file.c_str(),
            static_cast<char*>(nullptr));
    }
    _exit(127);
  }
  int port = 0;
  for (int i = 0; i < 600 && port == 0; ++i) {
    std::ifstream f(port_file);
    auto pj = nlohmann::json::parse(f, nullptr, false);
    if (!pj.is_discarded() && pj.contains("port")) port = pj["port"].get<int>();
    if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Status result = Status::OK();
  nlohmann::json read_row;
  if (port == 0) {
    result = Status::Unavailable("penumbra-store did not start");
  } else {
    transport::RemoteStoreOptions ro;
    ro.port = port;
    ro.plane.secret = secret;
    ro.plane.connections = static_cast<int>(bo.connections);
    auto remote = transport::RemoteDocumentStore::Connect(ro);
    auto reader =
        remote.ok() ? (*remote)->OpenReader(key) : Result<std::shared_ptr<storage::BlobReader>>(remote.status());
    if (!reader.ok()) {
      result = reader.status();
    } else {
      std::fill(dst.begin(), dst.end(), 0);
      auto s = ReadBlocks(**reader, size, B, order, static_cast<int>(threads), 1, dst.data());
      std::fill(dst.begin(), dst.end(), 0);
      // As a LazyBlob asks: batch_blocks() blocks per message.
      const size_t per = static_cast<size_t>((*reader)->batch_blocks());
      auto sb = s.ok() ? ReadBlocks(**reader, size, B, order, static_cast<int>(threads), per, dst.data()) : s;
      if (!sb.ok() || std::memcmp(dst.data(), values.data(), size) != 0) {
        result = sb.ok() ? Status::Internal("node read: wrong bytes") : sb.status();
      } else {
        j["node_blocks_gb_per_s"] = static_cast<double>(size) / *s / 1e9;
        j["node_batched_gb_per_s"] = static_cast<double>(size) / *sb / 1e9;
        j["node_batch_blocks"] = per;
        // The row issue 40 asks for: the blob read through the node, as a
        // LazyBlob reads it (batch_blocks blocks per message, random order).
        read_row = {{"bench", "store-node-read"},
                    {"gb_per_s", static_cast<double>(size) / *sb / 1e9},
                    {"blob_bytes", size},
                    {"block_bytes", B},
                    {"blocks_per_message", per},
                    {"threads", threads},
                    {"connections", bo.connections},
                    {"node_workers", bo.node_workers},
                    {"sealed", secret.has_value()},
                    {"local_gb_per_s", j["local_blocks_gb_per_s"]},
                    {"dram_gather_gb_per_s", j["dram_gather_gb_per_s"]},
                    {"transports", (*remote)->Transports()}};
        std::fill(dst.begin(), dst.end(), 0);
        const double t0 = Now();
        Status w = (*reader)->Read("values", 0, size, dst.data());
        if (!w.ok() || std::memcmp(dst.data(), values.data(), size) != 0) {
          result = w.ok() ? Status::Internal("node read: wrong bytes") : w;
        } else {
          j["node_whole_gb_per_s"] = static_cast<double>(size) / (Now() - t0) / 1e9;
        }
      }
    }
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  std::error_code ec;
  if (!a.Has("dir")) std::filesystem::remove_all(dir, ec);
  PENUMBRA_RETURN_IF_ERROR(result);
  std::printf("%s\n", j.dump().c_str());
  if (!read_row.is_null()) std::printf("%s\n", read_row.dump().c_str());
  return Status::OK();
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  return penumbra::ServerMain(
      "penumbra-store-bench",
      "usage: penumbra-store-bench [--mb N] [--block-bytes B] "
      "[--threads T] [--dir D] [--cluster-secret-file F] [--connections N] [--node-workers W]\n",
      argc, argv, penumbra::Run, [] { return penumbra::Flags().Help(); });
}
