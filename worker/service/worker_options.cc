#include "worker/service/worker_options.h"

namespace penumbra::service {

const OptionTable<WorkerProcessOptions>& WorkerOptionTable() {
  using O = WorkerProcessOptions;
  using T = OptionTable<O>;
  using std::chrono::milliseconds;
  static const auto* table =
      &(*new T("worker"))
           .String(&O::model, "model", "", "DIR", "the Hugging Face model directory to serve")
           .Unset("", "none (required)")
           .String(&O::name, "name", "", "NAME", "this worker's name in logs and metrics")
           .String(&O::host, "host", "", "HOST",
                   "address of the control API (any but loopback needs TLS, or --insecure)")
           .Int(&O::port, "port", "", 0, 65535, "control API port (0: one the OS picks)")
           .String(&O::port_file, "port-file", "", "FILE",
                   "write {\"port\": P, \"metrics_port\": M, \"pid\": N} here once serving")
           .Unset("", "none")
           .Int(&O::max_batch, "max-batch", "", 1, 4096, "sequences decoding together at most")
           .Unset("0", "the engine's max_batch")
           .Int(T::Field<int64_t>([](O* o) { return &o->scheduler.prefill_tokens_per_step; }),
                "prefill-tokens-per-step", "", int64_t{1}, int64_t{1} << 30,
                "prompt tokens prefilled between two decode steps")
           .Int(T::Field<int>([](O* o) { return &o->scheduler.max_queue; }), "max-queue", "", 1, 1 << 20,
                "requests waiting for admission at most")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->scheduler.share_window; }), "share-window-ms", "", 0,
                     int64_t{1} << 40,
                     "a tenant that sent a request this recently keeps its fair share of the batch free (0: no caps)")
           .Int(&O::prefix_cache_mb, "prefix-cache-mb", "", int64_t{1}, int64_t{1} << 30,
                "device MiB for cached documents")
           .Unset("0", "the storage config's memory.device_bytes, else 4096")
           .String(&O::prefix_store, "prefix-store", "", "DIR", "directory of the persistent document store (RocksDB)")
           .Unset("", "the storage config's disk.path")
           .String(&O::store_nodes, "store-node", "", "HOST:PORT[,HOST:PORT...]",
                   "value-store nodes (penumbra-store) to keep documents on instead of a local directory (each "
                   "document on one node, by its key)")
           .Unset("", "none")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->store_calls.call_timeout; }), "store-call-timeout-ms",
                     "", 1, 3600000,
                     "a call to a store node fails (DeadlineExceeded) when the node has not answered within this, "
                     "plus its bytes' time at --store-bulk-mb-per-s")
           .MiB(T::Field<double>([](O* o) { return &o->store_calls.bulk_bytes_per_second; }), "store-bulk-mb-per-s", "",
                1, 1 << 20, "the slowest transfer rate (MiB/s) a store node's call is given time for")
           .Int(T::Field<int>([](O* o) { return &o->store_calls.breaker.failures; }), "store-breaker-failures", "", 1,
                1000000,
                "consecutive calls a store node did not answer that open its circuit breaker: its calls then "
                "fail at once")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->store_calls.breaker.cool_down; }),
                     "store-breaker-cooldown-ms", "", 0, 3600000,
                     "how long an open breaker fails calls at once before one probe call")
           .Int(T::Field<int>([](O* o) { return &o->store_calls.plane.connections; }), "store-connections", "", 1, 64,
                "connections to each store node, each with its own UCX worker and progress thread (a document's "
                "parallel reads are spread over them)")
           .Int(T::Field<int>([](O* o) { return &o->scheduler.store_fetch_threads; }), "store-fetch-threads", "", 1,
                256, "threads reading stored documents for queued requests, off the decode loop")
           .Int(T::Field<int64_t>([](O* o) { return &o->scheduler.capacity_context_tokens; }), "capacity-context", "",
                int64_t{1}, int64_t{1} << 31,
                "the sequence length (prompt + new tokens) the stats count how many sequences fit at")
           .Unset("0", "the model's max_position_embeddings")
           .Int(&O::max_frame_mb, "max-frame-mb", "", 1, 1024, "largest request frame in MiB")
           .Int(&O::drain_seconds, "drain-seconds", "", 0, 86400, "on SIGTERM, how long running requests may finish")
           .Duration(T::Field<milliseconds>([](O* o) { return &o->lease.lease; }), "lease-ms", "", 100, 86400000,
                     "a coordinator that neither renews nor submits for this long has its generations cancelled")
           .Int(&O::random_weights, "random-weights", "", int64_t{0}, INT64_MAX,
                "benchmarks only: the model's shape from --model DIR/config.json, its weights random from this "
                "seed (generated on the device; no safetensors read)")
           .Unset("-1", "off")
           .String(T::Field<std::string>([](O* o) { return &o->group.name; }), "group", "", "NAME",
                   "the context group this worker is a rank of (formed by the coordinator; only rank 0 takes "
                   "requests)")
           .Unset("", "none: a single worker")
           .Int(T::Field<int>([](O* o) { return &o->group.rank; }), "group-rank", "", 0, 4095,
                "this worker's rank in its group")
           .Int(T::Field<int>([](O* o) { return &o->group.world; }), "group-world", "", 1, 4096,
                "the ranks of its group")
           .Double(T::Field<double>([](O* o) { return &o->group.timeout_s; }), "group-timeout-s", "", 1, 86400,
                   "the group's exchanges fail (the group breaks) when no byte moves for this long")
           .Check("group", [](const O& o) -> std::string {
             if (o.group.name.empty()) {
               return o.group.world > 1 || o.group.rank > 0 ? "--group-world and --group-rank need --group" : "";
             }
             if (o.group.world < 2) return "--group needs --group-world of 2 or more";
             if (o.group.rank >= o.group.world) return "--group-rank must be below --group-world";
             return "";
           });
  return *table;
}

}  // namespace penumbra::service
