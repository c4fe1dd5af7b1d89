// penumbra-coordinator's command-line options (beside the security and
// admin flags of transport/), declared once (common/option_table.h): each
// flag with its default (the structs' own), range and help, from which the
// coordinator's parsing, validation, --help and docs/operations.md's table
// come.
#pragma once

#include <cstdint>
#include <string>

#include "common/option_table.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/job_service.h"
#include "coordinator/server/openai_gateway.h"
#include "coordinator/server/worker_pool.h"
#include "transport/thrift_util.h"

namespace penumbra::coordinator {

struct CoordinatorProcessOptions {
  std::string model;    // the workers' model directory (its tokenizer); required
  std::string workers;  // [NAME=]HOST:PORT,... of the workers' control API; required (or groups)
  // Context groups: NAME=[NAME=]HOST:PORT,...;NAME=... (each group's ranks
  // in rank order); "": none. Default: "".
  std::string groups;
  std::string host = "127.0.0.1";  // the public API's address. Default: 127.0.0.1.
  int port = 0;                    // the public API's port; 0: one the OS picks. Default: 0.
  std::string port_file;           // written once serving; "": none. Default: "".
  std::string tenants;             // tenants YAML; "": none. Default: "".
  std::string api_keys;            // plain-text API keys YAML (development); "": none. Default: "".
  std::string data_dir;            // what survives a restart; "": documents in memory, jobs off. Default: "".
  int drain_seconds = 30;          // on SIGTERM, how long running generations may finish. Default: 30.
  // The public API's frame and connection limits (max_frame_bytes also the
  // workers' calls').
  transport::ThriftLimits limits;
  CoordinatorOptions coordinator;  // the request limits, quotas and timeouts
  WorkerPoolOptions pool;          // health_interval
  JobServiceOptions jobs;          // max_running_items
  // The OpenAI-compatible HTTP API: its port (-1: off; 0: one the OS picks)
  // and address (""; the public API's). Default: -1, "".
  int openai_port = -1;
  std::string openai_host;
  OpenAiGatewayOptions openai;  // chat template, threads, body limit (its address and TLS set from the above)
};

const OptionTable<CoordinatorProcessOptions>& CoordinatorOptionTable();

}  // namespace penumbra::coordinator
