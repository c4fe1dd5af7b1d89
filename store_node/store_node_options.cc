#include "store_node/store_node_options.h"

#include <limits>

namespace penumbra::transport {

const OptionTable<StoreNodeProcessOptions>& StoreNodeOptionTable() {
  using O = StoreNodeProcessOptions;
  using T = OptionTable<O>;
  using std::chrono::milliseconds;
  constexpr double kForever = std::numeric_limits<double>::infinity();
  static const auto* table =
      &(*new T("store node"))
           .String(&O::path, "path", "", "DIR", "the store's RocksDB directory (created when missing)")
           .Unset("", "the storage config's disk.path (one of them is required)")
           .String(T::Field<std::string>([](O* o) { return &o->node.host; }), "host", "", "HOST",
                   "address to listen on (any but loopback needs --cluster-secret-file, or --insecure)")
           .Int(T::Field<int>([](O* o) { return &o->node.port; }), "port", "", 0, 65535, "port (0: one the OS picks)")
           .String(&O::port_file, "port-file", "", "FILE",
                   "write {\"port\": P, \"metrics_port\": -1, \"pid\": N} here once serving")
           .Unset("", "none")
           .String(&O::storage_config, "storage-config", "", "FILE",
                   "the store's options: the disk: section of a storage YAML (configs/storage.yaml)")
           .Unset("", "none")
           .Int(T::Field<int>([](O* o) { return &o->node.plane.threads; }), "threads", "", 1, 256,
                "requests served at once")
           .Int(T::Field<int>([](O* o) { return &o->node.plane.workers; }), "ucx-workers", "", 1, 64,
                "UCX workers (each a progress thread) the connections are spread over")
           .Double(T::Field<double>([](O* o) { return &o->node.service.reader_idle_seconds; }), "reader-idle-seconds",
                   "", 0, kForever, "a reader a worker left idle this long is closed",
                   /*min_open=*/true)
           .Double(T::Field<double>([](O* o) { return &o->node.service.upload_idle_seconds; }), "upload-idle-seconds",
                   "", 0, kForever, "an upload left without a part this long is dropped",
                   /*min_open=*/true)
           .Int(T::Field<int>([](O* o) { return &o->node.service.max_readers; }), "max-readers", "", 1, 1 << 24,
                "readers open at once")
           .Int(T::Field<int>([](O* o) { return &o->node.service.max_uploads; }), "max-uploads", "", 1, 1 << 20,
                "uploads in flight at once")
           .MiB(T::Field<uint64_t>([](O* o) { return &o->node.service.max_upload_bytes; }), "max-upload-mb", "", 1,
                int64_t{1} << 30, "MiB the uploads in flight may declare together (held in memory until committed)")
           .Unset("0", "half the machine's memory")
           .Int(T::Field<int>([](O* o) { return &o->node.plane.max_endpoints; }), "max-endpoints", "", 1, 1 << 20,
                "connections at once")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->node.plane.handshake_timeout; }),
                     "handshake-timeout-ms", "", 1, 3600000,
                     "a connection that has not authenticated by then is closed");
  return *table;
}

}  // namespace penumbra::transport
