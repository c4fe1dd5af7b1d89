// penumbra-store: a value-store node. Holds stored documents in a RocksDB
// directory (storage::SegmentStore) and serves them to workers over UCX
// (store_node/store_node.h); workers reach it with --store-node HOST:PORT.
//
//   penumbra-store --path DIR [--host 127.0.0.1] [--port 0] [--port-file F]
//                  [--storage-config configs/storage.yaml] [--threads 8]
//                  [--cluster-secret-file F] [limits: --max-endpoints, --max-uploads,
//                  --max-upload-mb, --max-readers, --upload-idle-seconds, ...]
//
// With --cluster-secret-file the store plane is authenticated and encrypted
// (transport/ucx_rpc.h): only processes holding the same secret connect.
// Without it the node serves plaintext, only on loopback (or --insecure).
//
// With --port-file it writes {"port": P, "metrics_port": -1, "pid": N} there
// (atomically) once
// serving. SIGTERM or SIGINT stops it (what was acknowledged is on disk);
// SIGHUP is logged and stops nothing.
#include <unistd.h>

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/config.h"
#include "common/crypto.h"
#include "common/logging.h"
#include "common/process.h"
#include "storage/segment_store.h"
#include "store_node/store_node.h"
#include "transport/tls.h"

namespace penumbra {
namespace {

constexpr const char* kUsage =
    "usage: penumbra-store --path DIR [--host 127.0.0.1] [--port 0] [--port-file F] "
    "[--storage-config FILE] [--threads 8] [--cluster-secret-file F]\n";

Status Run(int argc, char** argv) {
  Args a;
  a.Flag("path", "the store's RocksDB directory (created when missing)")
      .Flag("host", "address to listen on (default 127.0.0.1)")
      .Flag("port", "port (default 0: one the OS picks)")
      .Flag("port-file", "write {\"port\": P, \"pid\": N} here once serving")
      .Flag("storage-config", "the store's options: the disk: section of a storage YAML (configs/storage.yaml)")
      .Flag("threads", "requests served at once (default 8)")
      .Flag("reader-idle-seconds", "a reader a worker left idle this long is closed (default 120)")
      .Flag("upload-idle-seconds", "an upload left without a part this long is dropped (default 120)")
      .Flag("max-readers", "readers open at once (default 4096)")
      .Flag("max-uploads", "uploads in flight at once (default 64)")
      .Flag("max-upload-mb",
            "MiB the uploads in flight may declare together (held in memory until committed; "
            "default: half the machine's memory)")
      .Flag("max-endpoints", "connections at once (default 1024)")
      .Flag("handshake-timeout-ms", "a connection that has not authenticated by then is closed (default 10000)");
  transport::AddSecurityFlags(a);
  Status ps = a.Parse(argc, argv, 1);
  if (!ps.ok()) return Status::InvalidArgument(ps.message() + "\n" + kUsage + "options:\n" + a.Help());
  storage::SegmentStoreOptions so;
  if (a.Has("storage-config")) {
    PENUMBRA_ASSIGN_OR_RETURN(ConfigReader r, ConfigReader::FromFile(a.Get("storage-config")));
    ConfigReader disk = r.Child("disk");
    // The node stores; the worker-side keys of the section are the workers'.
    bool ignored_b = false;
    int64_t ignored_i = 0;
    disk.Read("queue_bytes", &ignored_i, 0, int64_t{1} << 55);
    disk.Read("lazy_reads", &ignored_b);
    disk.Read("lazy_block_bytes", &ignored_i, 0, int64_t{1} << 55);
    disk.Read("lazy_threads", &ignored_i, 0, 1 << 20);
    PENUMBRA_RETURN_IF_ERROR(storage::LoadSegmentStoreOptions(disk, &so));
    (void)r.Child("gpu");
    (void)r.Child("memory");
    (void)r.Child("dram");  // the former name of `memory`
    PENUMBRA_RETURN_IF_ERROR(r.Finish());
  }
  if (a.Has("path")) so.path = a.Get("path");
  if (so.path.empty()) return Status::InvalidArgument(std::string("--path is required\n") + kUsage);
  PENUMBRA_ASSIGN_OR_RETURN(transport::ProcessSecurity security, transport::SecurityFromFlags(a));
  transport::StoreNodeOptions no;
  no.host = a.Get("host", "127.0.0.1");
  // The store plane is authenticated by the cluster secret (UCX has no TLS).
  PENUMBRA_RETURN_IF_ERROR(transport::CheckStorePlaneBind("the store plane", no.host,
                                                          !security.cluster_secret_file.empty(), security.insecure));
  if (!security.cluster_secret_file.empty()) {
    Result<ClusterSecret> secret = ClusterSecret::Load(security.cluster_secret_file);
    if (!secret.ok()) return secret.status().WithContext("--cluster-secret-file");
    no.plane.secret = *secret;
  }
  PENUMBRA_ASSIGN_OR_RETURN(int64_t port, a.GetIntIn("port", 0, 0, 65535));
  no.port = static_cast<int>(port);
  PENUMBRA_ASSIGN_OR_RETURN(int64_t threads, a.GetIntIn("threads", no.plane.threads, 1, 256));
  no.plane.threads = static_cast<int>(threads);
  PENUMBRA_ASSIGN_OR_RETURN(int64_t endpoints, a.GetIntIn("max-endpoints", no.plane.max_endpoints, 1, 1 << 20));
  no.plane.max_endpoints = static_cast<int>(endpoints);
  PENUMBRA_ASSIGN_OR_RETURN(int64_t handshake_ms,
                            a.GetIntIn("handshake-timeout-ms", no.plane.handshake_timeout.count(), 1, 3600000));
  no.plane.handshake_timeout = std::chrono::milliseconds(handshake_ms);
  transport::StoreServiceOptions& sv = no.service;
  PENUMBRA_ASSIGN_OR_RETURN(sv.reader_idle_seconds, a.GetDouble("reader-idle-seconds", sv.reader_idle_seconds));
  if (!(sv.reader_idle_seconds > 0)) return Status::InvalidArgument("--reader-idle-seconds must be > 0");
  PENUMBRA_ASSIGN_OR_RETURN(sv.upload_idle_seconds, a.GetDouble("upload-idle-seconds", sv.upload_idle_seconds));
  if (!(sv.upload_idle_seconds > 0)) return Status::InvalidArgument("--upload-idle-seconds must be > 0");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t readers, a.GetIntIn("max-readers", sv.max_readers, 1, 1 << 24));
  sv.max_readers = static_cast<int>(readers);
  PENUMBRA_ASSIGN_OR_RETURN(int64_t uploads, a.GetIntIn("max-uploads", sv.max_uploads, 1, 1 << 20));
  sv.max_uploads = static_cast<int>(uploads);
  if (a.Has("max-upload-mb")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t mb, a.GetIntIn("max-upload-mb", 0, 1, int64_t{1} << 30));
    sv.max_upload_bytes = static_cast<uint64_t>(mb) << 20;
  }

  PENUMBRA_ASSIGN_OR_RETURN(auto store, storage::SegmentStore::Open(so));
  PENUMBRA_ASSIGN_OR_RETURN(auto node, transport::StoreNode::Start(store.get(), no));
  if (a.Has("port-file")) {
    nlohmann::json j = {{"port", node->port()}, {"metrics_port", -1}, {"pid", static_cast<int64_t>(getpid())}};
    PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(a.Get("port-file"), j.dump() + "\n"));
  }
  std::printf("penumbra-store: serving %s (%zu documents) on %s:%d (%s)\n", so.path.c_str(), store->Keys().size(),
              no.host.c_str(), node->port(),
              no.plane.secret ? "authenticated and encrypted" : "plaintext: no cluster secret");
  std::fflush(stdout);
  // SIGHUP stops nothing. The store plane has no TLS (the cluster secret
  // keys it, and every worker holds the same one), so there is nothing to
  // reread: a new secret takes a restart of the whole service.
  const int sig = WaitForStopSignal([] {
    LOG(INFO) << "penumbra-store: SIGHUP: nothing to reload (the cluster secret and options are read at start); "
                 "serving on";
  });
  LOG(INFO) << "penumbra-store: signal " << sig << ", stopping";
  node->Stop();
  PENUMBRA_RETURN_IF_ERROR(store->Flush());
  std::printf("penumbra-store: stopped\n");
  return Status::OK();
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  return penumbra::ServerMain("penumbra-store", penumbra::kUsage, argc, argv, penumbra::Run);
}
