// The worker's control API (transport/worker.thrift) over a Scheduler: the
// Thrift handler and the server that fronts one engine lane. Every input is
// checked by the scheduler (Submit validates the request); errors leave as
// typed PenumbraErrors; one client's bad input never stops the others.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>
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

// Requests are known to callers by handles (128 random bits, hex) bound to
// the caller that made them (its certificate's role/name under TLS): a
// handle is useless to anyone else (NOT_FOUND), and not guessable.
class WorkerHandler : public rpc::WorkerIf {
 public:
  WorkerHandler(Scheduler* scheduler, WorkerIdentity identity) : s_(scheduler), id_(std::move(identity)) {}
  void Generate(std::string& handle, const rpc::WorkerGenerateRequest& request) override;
  void Poll(rpc::TokenChunk& out, const std::string& handle, int64_t offset, int32_t wait_ms) override;
  void Cancel(const std::string& handle) override;
  void Release(const std::string& handle) override;
  int32_t ForgetPrefixes(const std::vector<int32_t>& prompt, const std::vector<int64_t>& segment_ends,
                         const std::string& cache_namespace) override;
  void Health(rpc::WorkerHealth& out) override;
  void Stats(rpc::WorkerStats& out) override;

  static constexpr int32_t kMaxWaitMs = 60000;
  static constexpr int64_t kMaxDeadlineMs = int64_t{7} * 24 * 3600 * 1000;  // a week

 private:
  struct Entry {
    uint64_t id = 0;    // the scheduler's
    std::string owner;  // CurrentPeer() of its Generate under TLS; "" without TLS
  };
  // The scheduler's id of `handle` when the current caller owns it.
  Result<uint64_t> Lookup(const std::string& handle) const;
  void Forget(const std::string& handle);
  // Drops handles whose requests the scheduler no longer has (expired answers).
  void Sweep();

  Scheduler* s_;
  WorkerIdentity id_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> handles_;
  int64_t since_sweep_ = 0;
};

// Serves `scheduler` on options.host:port (0: the OS picks; see port()).
// With options.tls, only clients with a certificate of role coordinator.
class WorkerServer {
 public:
  static Result<std::unique_ptr<WorkerServer>> Start(Scheduler* scheduler, WorkerIdentity identity,
                                                     const transport::ThriftServerOptions& options);
  int port() const { return server_->port(); }
  transport::ThriftServerStats stats() const { return server_->stats(); }
  // Rereads the control API's TLS files (SIGHUP): transport::ThriftServer::ReloadTls.
  Status ReloadTls() { return server_->ReloadTls(); }
  void Stop() { server_->Stop(); }

 private:
  std::unique_ptr<transport::ThriftServer> server_;
};

// The request as the engine takes it. Checks what is the control API's own
// (deadline_ms in [0, a week], share_weight in (0, 1e6], the stop ids' count,
// sampling ranges, draws_done >= 0); the request against the model
// (ValidateGenerationRequest: ids, lengths, segments) is Scheduler::Submit's.
// InvalidArgument naming the field.
Result<GenerationRequest> FromRpc(const rpc::WorkerGenerateRequest& r);
void ToRpc(const RequestUpdate& u, rpc::TokenChunk* out);

}  // namespace penumbra::service
