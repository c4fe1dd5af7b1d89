// penumbra-worker's own command-line options (beside the engine's,
// worker/engine/engine_flags.h, and the security and admin flags of
// transport/), declared once (common/option_table.h): each flag with its
// default (the structs' own), range and help, from which the worker's
// parsing, validation, --help and docs/operations.md's table come.
#pragma once

#include <cstdint>
#include <string>

#include "common/option_table.h"
#include "store_node/store_node.h"
#include "worker/service/group_member.h"
#include "worker/service/scheduler.h"
#include "worker/service/worker_server.h"

namespace penumbra::service {

struct WorkerProcessOptions {
  std::string model;               // the model directory (--model); required
  std::string name = "worker";     // in logs and metrics. Default: worker.
  std::string host = "127.0.0.1";  // the control API's address. Default: 127.0.0.1.
  int port = 0;                    // the control API's port; 0: one the OS picks. Default: 0.
  std::string port_file;           // written once serving; "": none. Default: "".
  int max_batch = 0;               // scheduler.max_batch; 0: the engine's max_batch. Default: 0.
  int64_t prefix_cache_mb = 0;     // 0: the storage config's memory.device_bytes, else 4096 MiB. Default: 0.
  std::string prefix_store;        // a local document store's directory; "": the config's. Default: "".
  std::string store_nodes;         // HOST:PORT,... of value-store nodes; "": none. Default: "".
  int max_frame_mb = 64;           // the largest request frame. Default: 64.
  int drain_seconds = 30;          // on SIGTERM, how long running requests may finish. Default: 30.
  int64_t random_weights = -1;     // benchmarks: random weights from this seed; -1: off. Default: -1.
  SchedulerOptions scheduler;      // but max_batch (above)
  WorkerLeaseOptions lease;
  transport::RemoteStoreOptions store_calls;  // with store nodes: the calls' deadlines and breakers
  // A member of a context group (--group NAME, --group-rank, --group-world,
  // --group-timeout-s; the group's host is --host): formed by the
  // coordinator (JoinGroup). name "": a single worker. Its TLS files and
  // insecure come from the security flags.
  GroupMemberOptions group;
};

const OptionTable<WorkerProcessOptions>& WorkerOptionTable();

}  // namespace penumbra::service
