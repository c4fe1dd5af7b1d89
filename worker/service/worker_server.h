// The worker's control API (transport/worker.thrift) over a Scheduler: the
// Thrift handler and the server that fronts one engine lane. Every input is
// checked by the scheduler (Submit validates the request); errors leave as
// typed PenumbraErrors; one client's bad input never stops the others.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gen-cpp/Worker.h"
#include "transport/thrift_util.h"
#include "worker/service/group_member.h"
#include "worker/service/scheduler.h"

namespace penumbra::service {

struct WorkerIdentity {
  std::string model, backend, kv_policy;
  std::vector<std::string> kv_forms;  // the policies pins may name here (KvPolicy::Forms)
  int64_t max_context = 0;
  int32_t vocab_size = 0;
  std::vector<int32_t> eos_ids;
  int64_t device_bytes_per_token = 0;  // WorkerHealth's estimate; 0: not known
};

struct WorkerLeaseOptions {
  // An owner (WorkerGenerateRequest.owner_id) that has neither renewed
  // (Renew) nor submitted for this long has its generations cancelled and
  // forgotten (counted in WorkerStats.lease_expired, logged). Default: 30 s.
  std::chrono::milliseconds lease{30000};
  // InvalidArgument naming the field.
  Status Validate() const;
};

// An owner id: 1 to 64 characters of [0-9A-Za-z_-] ("" is no owner).
// InvalidArgument naming the field otherwise.
Status ValidateOwnerId(const std::string& owner_id);

// Requests are known to callers by handles (128 random bits, hex) bound to
// the caller that made them (its certificate's role/name under TLS): a
// handle is useless to anyone else (NOT_FOUND), and not guessable.
//
// Leases: a generation submitted with an owner id belongs to that owner
// (within the calling certificate); the owner keeps its generations alive by
// calling Renew at least once per lease. A thread of the handler cancels and
// forgets the generations of owners silent past the lease, so a coordinator
// that died (and was not restarted in time) leaves nothing running here.
class WorkerHandler : public rpc::WorkerIf {
 public:
  // `group`: this worker's place in a context group (null: a single
  // worker): only rank 0 of a formed group takes requests.
  WorkerHandler(Scheduler* scheduler, WorkerIdentity identity, WorkerLeaseOptions lease = {},
                GroupMember* group = nullptr);
  ~WorkerHandler() override;  // stops the lease thread
  void Generate(std::string& handle, const rpc::WorkerGenerateRequest& request) override;
  void Poll(rpc::TokenChunk& out, const std::string& handle, int64_t offset, int32_t wait_ms) override;
  void PollMany(std::vector<rpc::TokenChunk>& out, const std::vector<rpc::WorkerPollTarget>& targets,
                int32_t wait_ms) override;
  static constexpr size_t kMaxPollTargets = 4096;
  void Cancel(const std::string& handle) override;
  void Release(const std::string& handle) override;
  void PutDocument(std::string& handle, const rpc::WorkerPutRequest& request) override;
  void WaitPut(rpc::WorkerPutProgress& out, const std::string& handle, int64_t factored_tokens,
               int32_t wait_ms) override;
  int32_t ForgetDocuments(const std::vector<rpc::WorkerDocument>& documents,
                          const std::string& cache_namespace) override;
  void Health(rpc::WorkerHealth& out) override;
  void JoinGroup(std::string& rendezvous, const rpc::WorkerJoinGroup& join) override;
  void Stats(rpc::WorkerStats& out) override;
  void Renew(std::vector<std::string>& out, const std::string& owner_id) override;
  // Generations cancelled because their owner's lease expired.
  int64_t lease_expired() const { return lease_expired_.load(); }
  // Ends the generations of every owner whose lease has expired by `now`
  // (the lease thread calls it; public for tests).
  void ExpireLeases(std::chrono::steady_clock::time_point now);

  static constexpr int32_t kMaxWaitMs = 60000;
  static constexpr int64_t kMaxDeadlineMs = int64_t{7} * 24 * 3600 * 1000;  // a week

 private:
  struct Entry {
    uint64_t id = 0;    // the scheduler's
    std::string owner;  // CurrentPeer() of its Generate under TLS; "" without TLS
    std::string lease;  // LeaseKey(owner, owner_id); "" without an owner id
  };
  // An owner id within the certificate that used it.
  static std::string LeaseKey(const std::string& owner, const std::string& owner_id) {
    return owner_id.empty() ? std::string() : owner + "\n" + owner_id;
  }
  void RenewLocked(const std::string& lease);  // under mu_
  // Waits on `handle`'s request (the current caller's) with `wait`, at most
  // wait_ms (checked); throws the error a poll of it gives.
  RequestUpdate Await(const std::string& handle, int32_t wait_ms,
                      const std::function<Result<RequestUpdate>(uint64_t, std::chrono::milliseconds)>& wait);
  // Queues a converted request for the current caller and `owner_id`;
  // returns its handle (throws the first error).
  std::string Submit(Result<GenerationRequest> g, Result<SubmitOptions> o, const std::string& owner_id);
  void LeaseLoop();
  // The scheduler's id of `handle` when the current caller owns it.
  Result<uint64_t> Lookup(const std::string& handle) const;
  void Forget(const std::string& handle);
  // Drops handles whose requests the scheduler no longer has (expired answers).
  void Sweep();

  // Throws Unavailable unless this worker takes requests (a group's rank 0,
  // formed; or no group).
  void CheckServing() const;

  Scheduler* s_;
  WorkerIdentity id_;
  GroupMember* group_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> handles_;
  int64_t since_sweep_ = 0;
  WorkerLeaseOptions lease_;
  std::map<std::string, std::chrono::steady_clock::time_point> renewed_;  // lease key -> last renewal (mu_)
  std::atomic<int64_t> lease_expired_{0};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread lease_thread_;
};

// Serves `scheduler` on options.host:port (0: the OS picks; see port()).
// With options.tls, only clients with a certificate of role coordinator.
class WorkerServer {
 public:
  static Result<std::unique_ptr<WorkerServer>> Start(Scheduler* scheduler, WorkerIdentity identity,
                                                     const transport::ThriftServerOptions& options,
                                                     WorkerLeaseOptions lease = {}, GroupMember* group = nullptr);
  int port() const { return server_->port(); }
  // Generations cancelled because their owner's lease expired.
  int64_t lease_expired() const { return handler_->lease_expired(); }
  transport::ThriftServerStats stats() const { return server_->stats(); }
  // Rereads the control API's TLS files (SIGHUP): transport::ThriftServer::ReloadTls.
  Status ReloadTls() { return server_->ReloadTls(); }
  void Stop() { server_->Stop(); }

 private:
  std::shared_ptr<WorkerHandler> handler_;
  std::unique_ptr<transport::ThriftServer> server_;
};

// The request as the engine takes it: its documents first (their ids, or
// 0s for those named by digest alone: GenerationRequest::ids_from), then its
// prompt. Checks only what the conversion needs (the wire form's shape:
// 16-byte digests, ids matching the lengths, lengths within `max_context`
// before anything is allocated, the documents named by digest leading, floats
// that fit); everything about the request itself is one check,
// ValidateGenerationRequest (Scheduler::Submit). InvalidArgument naming the
// field.
Result<GenerationRequest> FromRpc(const rpc::WorkerGenerateRequest& r, int64_t max_context);
// A put: its documents, prefill only (max_new_tokens 0).
Result<GenerationRequest> FromRpc(const rpc::WorkerPutRequest& r, int64_t max_context);
// Appends `documents` to g's prompt, document_ends, document_digests and
// ids_from (the checks above).
Status AppendDocuments(const std::vector<rpc::WorkerDocument>& documents, int64_t max_context, GenerationRequest* g);
// The control API's own fields of a request: deadline_ms in [0, a week],
// share_weight in (0, 1e6], owner_id (ValidateOwnerId).
Result<SubmitOptions> SubmitOptionsFromRpc(int64_t deadline_ms, double share_weight, const std::string& tenant,
                                           const std::string& owner_id);
void ToRpc(const RequestUpdate& u, rpc::WorkerPutProgress* out);
void ToRpc(const RequestUpdate& u, rpc::TokenChunk* out);

}  // namespace penumbra::service
