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
#include "store_node/store_node_options.h"
#include "transport/tls.h"

namespace penumbra {
namespace {

constexpr const char* kUsage =
    "usage: penumbra-store --path DIR [--host 127.0.0.1] [--port 0] [--port-file F] "
    "[--storage-config FILE] [--threads 8] [--cluster-secret-file F]\n";

// Every flag: the node's table and the security flags.
Args Flags() {
  Args a;
  transport::StoreNodeOptionTable().AddFlags(a);
  transport::AddSecurityFlags(a);
  return a;
}

Status Run(int argc, char** argv) {
  Args a = Flags();
  Status ps = a.Parse(argc, argv, 1);
  if (!ps.ok()) return Status::InvalidArgument(ps.message() + "\n" + kUsage + "options:\n" + a.Help());
  transport::StoreNodeProcessOptions po;
  PENUMBRA_RETURN_IF_ERROR(transport::StoreNodeOptionTable().ApplyFlags(a, &po));
  storage::SegmentStoreOptions so;
  if (!po.storage_config.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(ConfigReader r, ConfigReader::FromFile(po.storage_config));
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
  if (a.Has("path")) so.path = po.path;
  if (so.path.empty()) return Status::InvalidArgument(std::string("--path is required\n") + kUsage);
  PENUMBRA_ASSIGN_OR_RETURN(transport::ProcessSecurity security, transport::SecurityFromFlags(a));
  transport::StoreNodeOptions& no = po.node;
  // The store plane is authenticated by the cluster secret (UCX has no TLS).
  PENUMBRA_RETURN_IF_ERROR(transport::CheckStorePlaneBind("the store plane", no.host,
                                                          !security.cluster_secret_file.empty(), security.insecure));
  if (!security.cluster_secret_file.empty()) {
    Result<ClusterSecret> secret = ClusterSecret::Load(security.cluster_secret_file);
    if (!secret.ok()) return secret.status().WithContext("--cluster-secret-file");
    no.plane.secret = *secret;
  }

  PENUMBRA_ASSIGN_OR_RETURN(auto store, storage::SegmentStore::Open(so));
  PENUMBRA_ASSIGN_OR_RETURN(auto node, transport::StoreNode::Start(store.get(), no));
  if (!po.port_file.empty()) {
    nlohmann::json j = {{"port", node->port()}, {"metrics_port", -1}, {"pid", static_cast<int64_t>(getpid())}};
    PENUMBRA_RETURN_IF_ERROR(WriteFileAtomically(po.port_file, j.dump() + "\n"));
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
  return penumbra::ServerMain("penumbra-store", penumbra::kUsage, argc, argv, penumbra::Run,
                              [] { return penumbra::Flags().Help(); });
}
