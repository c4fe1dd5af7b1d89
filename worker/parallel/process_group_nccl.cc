// The NCCL data plane (worker/parallel/process_group.h): a CUDA backend's AllGather
// and Broadcast as NCCL collectives on its main stream (asynchronous, in
// order with the backend's work); the host-memory calls go to the TCP group
// it was made over, which also carries the communicator's ncclUniqueId from
// rank 0.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): joining,
// and the connections NCCL sets up at a group's first calls, are waited for
// here with the group's timeout rather than inside NCCL with none, so a rank
// that never comes is DeadlineExceeded, not a hang. What runs on the device
// is NCCL's: a peer that dies while its partners' kernels wait for it
// would hold the caller's next synchronization forever, so a watchdog thread
// checks the communicator every 50 ms: NCCL's own async error, the control
// plane's connections (Collective::Probe: a peer's process gone closes
// them), and the last collective's completion (one still on the device
// after the group's timeout: a peer stopped). On any of them it aborts the
// communicator (ncclCommAbort), which ends the kernels waiting; the caller's
// next call fails with the reason, and so does its step.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "worker/parallel/process_group.h"

namespace penumbra {
namespace {

using Clock = std::chrono::steady_clock;

StatusCode CodeOf(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return StatusCode::kInvalidArgument;
    case ncclRemoteError:  // a peer failed
    case ncclSystemError:  // the network or the OS
      return StatusCode::kUnavailable;
    default:
      return StatusCode::kInternal;
  }
}

Status CudaError(cudaError_t e, const std::string& what) {
  return Status::Internal(what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

class NcclCollective final : public Collective {
 public:
  NcclCollective(std::unique_ptr<Collective> control, int device, cudaStream_t stream, Clock::duration timeout)
      : control_(std::move(control)),
        rank_(control_->rank()),
        world_(control_->world()),
        device_(device),
        stream_(stream),
        timeout_(timeout) {}
  ~NcclCollective() override;

  int rank() const override { return rank_; }
  int world() const override { return world_; }

  Status AllGather(const void* send, void* recv, size_t bytes) override {
    if (!broken_.ok()) return broken_;
    if (bytes == 0) return Status::OK();  // every rank of a correct program skips it alike
    return Launch([&] { return ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_); }, "ncclAllGather");
  }
  Status Broadcast(void* buf, size_t bytes, int root) override {
    if (!broken_.ok()) return broken_;
    if (root < 0 || root >= world_) {
      return Fail(Status::InvalidArgument("Broadcast: root " + std::to_string(root) + " is not a rank of world " +
                                          std::to_string(world_)));
    }
    if (bytes == 0) return Status::OK();
    return Launch([&] { return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_); }, "ncclBroadcast");
  }
  // (After the watchdog's abort these fail at once with its reason rather
  // than wait out the timeout again for the peer it gave up on.)
  Status BroadcastHost(void* buf, size_t bytes, int root) override {
    PENUMBRA_RETURN_IF_ERROR(Usable());
    return Control(control_->BroadcastHost(buf, bytes, root));
  }
  Status AllGatherHost(const void* send, void* recv, size_t bytes) override {
    PENUMBRA_RETURN_IF_ERROR(Usable());
    return Control(control_->AllGatherHost(send, recv, bytes));
  }
  Status Barrier() override {
    PENUMBRA_RETURN_IF_ERROR(Usable());
    return Control(control_->Barrier());
  }

  // Makes the communicator (every rank of the control group calls it) and
  // starts the watchdog.
  Status Init();

 private:
  void Watch();  // the watchdog thread
  // Waits while a call of the non-blocking communicator is in progress (its
  // host side: init's and connections' handshakes, a launch's enqueueing).
  Status Await(ncclResult_t r, const std::string& what);
  Status NcclError(ncclResult_t r, const std::string& what) const;
  template <typename Op>
  Status Launch(Op op, const char* what);
  Status Control(const Status& s) { return s.ok() ? s : Fail(s, /*prefix=*/false); }
  // OK unless the group is broken or the watchdog aborted the communicator
  // (then the group breaks with its reason).
  Status Usable() {
    if (!broken_.ok()) return broken_;
    Status aborted;
    {
      std::lock_guard<std::mutex> lk(watch_mu_);
      aborted = aborted_;
    }
    return aborted.ok() ? aborted : Fail(aborted, /*prefix=*/false);
  }
  // Breaks the group (the first failure wins): aborts the communicator, so
  // that device work waiting for a peer that is gone ends, and closes the
  // control group, so that the peers' next call fails too.
  Status Fail(const Status& s, bool prefix = true);

  std::unique_ptr<Collective> control_;
  const int rank_, world_, device_;
  const cudaStream_t stream_;
  const Clock::duration timeout_;
  ncclComm_t comm_ = nullptr;
  Status broken_;  // the caller's thread's
  // Between the caller's thread (its NCCL calls, Fail) and the watchdog:
  // comm_, control_'s lifetime, aborted_ and the last launch.
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;
  Status aborted_;  // why the watchdog aborted the communicator (OK: it did not)
  cudaEvent_t last_ev_ = nullptr;
  Clock::time_point last_launch_{};
  bool pending_ = false;  // last_ev_ recorded and not seen complete
  std::thread watchdog_;
};

NcclCollective::~NcclCollective() {
  {
    std::lock_guard<std::mutex> lk(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  (void)cudaSetDevice(device_);
  if (last_ev_ != nullptr) (void)cudaEventDestroy(last_ev_);
  if (comm_ == nullptr || !aborted_.ok()) return;  // aborted: nothing to finalize
  // Finalize lets the work already queued finish (bounded: a peer gone
  // would hold it forever), then Destroy frees without blocking.
  const Status s = Await(ncclCommFinalize(comm_), "ncclCommFinalize");
  if (s.ok()) {
    (void)ncclCommDestroy(comm_);
  } else {
    LOG(WARNING) << "collective: " << s << "; aborting the communicator";
    (void)ncclCommAbort(comm_);
  }
}

Status NcclCollective::Init() {
  cudaError_t e = cudaSetDevice(device_);
  if (e != cudaSuccess) return Fail(CudaError(e, "cudaSetDevice(" + std::to_string(device_) + ")"));
  // Rank 0's id, and whether it could make one: a rank 0 that cannot fails
  // every rank at once instead of leaving them waiting.
  struct {
    ncclUniqueId id;
    int32_t ok;
  } msg;
  std::memset(&msg, 0, sizeof msg);
  ncclResult_t r = ncclSuccess;
  if (rank_ == 0) {
    r = ncclGetUniqueId(&msg.id);
    msg.ok = r == ncclSuccess ? 1 : 0;
  }
  const Status sent = control_->BroadcastHost(&msg, sizeof msg, 0);
  if (!sent.ok()) return Fail(sent, /*prefix=*/false);
  if (msg.ok != 1) {
    return Fail(rank_ == 0 ? NcclError(r, "ncclGetUniqueId")
                           : Status::Unavailable("rank 0 could not make the NCCL group's id"));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  r = ncclCommInitRankConfig(&comm_, world_, msg.id, rank_, &config);
  const Status joined = Await(r, "ncclCommInitRankConfig");
  if (!joined.ok()) return Fail(joined);
  e = cudaEventCreateWithFlags(&last_ev_, cudaEventDisableTiming);
  if (e != cudaSuccess) return Fail(CudaError(e, "cudaEventCreateWithFlags"));
  watchdog_ = std::thread([this] { Watch(); });
  return Status::OK();
}

Status NcclCollective::Await(ncclResult_t r, const std::string& what) {
  const auto deadline = Clock::now() + timeout_;
  int polls = 0;
  while (r == ncclInProgress) {
    if (Clock::now() >= deadline) {
      return Status::DeadlineExceeded(what + " still in progress after " +
                                      std::to_string(std::chrono::duration<double>(timeout_).count()) +
                                      " s (a rank late, stopped, or gone)");
    }
    // Launches are enqueued in microseconds; joining takes milliseconds.
    if (++polls > 100) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    } else {
      std::this_thread::yield();
    }
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &r);
    if (q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess) return NcclError(r, what);
  return Status::OK();
}

Status NcclCollective::NcclError(ncclResult_t r, const std::string& what) const {
  std::string m = what + ": " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm_);
  if (last != nullptr && *last != '\0') m += std::string(" (") + last + ")";
  return Status(CodeOf(r), m);
}

template <typename Op>
Status NcclCollective::Launch(Op op, const char* what) {
  const cudaError_t e = cudaSetDevice(device_);
  if (e != cudaSuccess) return Fail(CudaError(e, "cudaSetDevice(" + std::to_string(device_) + ")"));
  Status s;
  bool watchdog = false;  // s is the watchdog's reason (already in context)
  {
    std::lock_guard<std::mutex> lk(watch_mu_);
    if (!aborted_.ok()) {
      s = aborted_;  // the watchdog's: the communicator is gone
      watchdog = true;
    } else {
      s = Await(op(), what);
      if (s.ok()) {
        // What NCCL found since the last call (a peer's failure on the network).
        ncclResult_t async = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(comm_, &async);
        if (q != ncclSuccess) async = q;
        if (async != ncclSuccess && async != ncclInProgress) {
          s = NcclError(async, std::string(what) + " (an earlier call)");
        }
      }
      if (s.ok() && cudaEventRecord(last_ev_, stream_) == cudaSuccess) {
        last_launch_ = Clock::now();
        pending_ = true;
      }
    }
  }
  if (!s.ok()) return Fail(s, /*prefix=*/!watchdog);
  return Status::OK();
}

void NcclCollective::Watch() {
  (void)cudaSetDevice(device_);
  std::unique_lock<std::mutex> lk(watch_mu_);
  while (!watch_stop_) {
    watch_cv_.wait_for(lk, std::chrono::milliseconds(50), [this] { return watch_stop_; });
    if (watch_stop_ || comm_ == nullptr || !aborted_.ok()) continue;
    Status why;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      why = NcclError(async, "NCCL");
    }
    if (why.ok() && control_ != nullptr) why = control_->Probe();
    if (why.ok() && pending_) {
      const cudaError_t q = cudaEventQuery(last_ev_);
      if (q == cudaSuccess) {
        pending_ = false;
      } else if (q == cudaErrorNotReady && Clock::now() - last_launch_ > timeout_) {
        why = Status::DeadlineExceeded("a collective still on the device after " +
                                       std::to_string(std::chrono::duration<double>(timeout_).count()) +
                                       " s (a rank stopped)");
      }
    }
    if (why.ok()) continue;
    aborted_ = why.WithContext("collective (rank " + std::to_string(rank_) + " of " + std::to_string(world_) +
                               ", NCCL watchdog)");
    LOG(WARNING) << aborted_ << "; aborting the communicator";
    (void)ncclCommAbort(comm_);  // the kernels waiting for the peer end
  }
}

Status NcclCollective::Fail(const Status& s, bool prefix) {
  if (!broken_.ok()) return broken_;
  broken_ =
      prefix ? s.WithContext("collective (rank " + std::to_string(rank_) + " of " + std::to_string(world_) + ", NCCL)")
             : s;
  std::lock_guard<std::mutex> lk(watch_mu_);
  if (comm_ != nullptr && aborted_.ok()) {  // (the watchdog's abort freed it already)
    (void)cudaSetDevice(device_);
    (void)ncclCommAbort(comm_);
  }
  comm_ = nullptr;
  control_.reset();
  return broken_;
}

}  // namespace

bool NcclCollectiveCompiled() { return true; }

Result<std::unique_ptr<Collective>> ConnectNcclCollective(Backend* backend, std::unique_ptr<Collective> control,
                                                          double timeout_s) {
  if (backend == nullptr || backend->device() != Device::kCUDA) {
    return Status::InvalidArgument("collective: the NCCL data plane needs a CUDA backend");
  }
  if (control == nullptr) return Status::InvalidArgument("collective: the NCCL data plane needs a control group");
  if (!(timeout_s > 0)) return Status::InvalidArgument("collective: timeout_s must be > 0");
  const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  auto c = std::make_unique<NcclCollective>(std::move(control), backend->device_index(),
                                            static_cast<cudaStream_t>(backend->native_stream()), timeout);
  PENUMBRA_RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<Collective>(std::move(c));
}

}  // namespace penumbra
