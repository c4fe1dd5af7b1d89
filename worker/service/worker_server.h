// The worker's control API (transport/worker.thrift) over a Scheduler: the
// Thrift handler and the server that fronts one engine lane. Every input is
// checked by the scheduler (Submit validates the request); errors leave as
// typed PenumbraErrors; one client's bad input never stops the others.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gen-cpp/Worker.h"
#include "transport/thrift_util.h"
#include "worker/service/scheduler.h"

namespace penumbra::service {

struct WorkerIdentity {
  std::string model, backend, kv_policy;
  int64_t max_context = 0;
  int32_t vocab_size = 0;
  std::vector<int32_t> eos_ids;
};

class WorkerHandler : public rpc::WorkerIf {
 public:
  WorkerHandler(Scheduler* scheduler, WorkerIdentity identity) : s_(scheduler), id_(std::move(identity)) {}
  int64_t Generate(const rpc::WorkerGenerateRequest& request) override;
  void Poll(rpc::TokenChunk& out, int64_t request_id, int64_t offset, int32_t wait_ms) override;
  void Cancel(int64_t request_id) override;
  void Release(int64_t request_id) override;
  int32_t ForgetPrefixes(const std::vector<int32_t>& prompt, const std::vector<int64_t>& segment_ends,
                         const std::string& cache_namespace) override;
  void Health(rpc::WorkerHealth& out) override;
  void Stats(rpc::WorkerStats& out) override;

  static constexpr int32_t kMaxWaitMs = 60000;

 private:
  Scheduler* s_;
  WorkerIdentity id_;
};

// Serves `scheduler` on host:port (0: the OS picks; see port()).
class WorkerServer {
 public:
  static Result<std::unique_ptr<WorkerServer>> Start(Scheduler* scheduler, WorkerIdentity identity,
                                                     const std::string& host, int port,
                                                     const transport::ThriftLimits& limits = {});
  int port() const { return server_->port(); }
  void Stop() { server_->Stop(); }

 private:
  std::unique_ptr<transport::ThriftServer> server_;
};

// The request as the engine takes it (ids, lengths and options are validated
// by Scheduler::Submit).
Result<GenerationRequest> FromRpc(const rpc::WorkerGenerateRequest& r);
void ToRpc(const RequestUpdate& u, rpc::TokenChunk* out);

}  // namespace penumbra::service
