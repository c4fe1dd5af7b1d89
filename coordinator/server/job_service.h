// JobService: the coordinator's batch jobs (transport/penumbra.thrift,
// SubmitJob ... DeleteJob) over the durable JobStore (coordinator/jobs/).
//
// A job's items are stored with their whole generate request (serialized
// Thrift). A runner thread leases pending items (oldest job first, a job's
// items in order) up to `max_running_items` at once and runs each as one
// generation through the coordinator (`RunItem`): items over one document
// go to the worker that holds it and batch there with everything else it
// runs. An item whose generation fails for a reason worth retrying (no
// worker healthy or free, a worker lost mid-answer: UNAVAILABLE or
// RESOURCE_EXHAUSTED) is released and leased again after `retry_delay`;
// any other failure is the item's result. Results are recorded exactly once
// by the store, so an item re-run after a coordinator crash (its lease
// recovered at Open) never counts twice.
//
// Thread-safety: every public method may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "coordinator/jobs/job_store.h"
#include "gen-cpp/Penumbra.h"

namespace penumbra::coordinator {

struct JobServiceOptions {
  jobs::JobStoreOptions store;                   // store.path is required
  int max_running_items = 16;                    // items generating at once, all jobs. Default: 16.
  std::chrono::milliseconds retry_delay{1000};   // before a released item is leased again. Default: 1 s.
  std::chrono::milliseconds poll_interval{200};  // the runner's idle wait for new items. Default: 200 ms.
};

// One finished generation, as a job item's result.
struct ItemOutcome {
  Status status;  // not ok: the generation failed (nothing else below is set)
  std::string text, finish_reason;
  std::vector<int32_t> ids;
  rpc::Usage usage;
};

class JobService {
 public:
  // Runs one generation for `tenant` to its end (blocking). `cancel` turns
  // true when the item's job is cancelled while it runs: the generation
  // should then stop (finish reason "cancelled") and return soon.
  using RunItem = std::function<ItemOutcome(const std::string& tenant, const rpc::GenerateRequest& request,
                                            const std::atomic<bool>& cancel)>;

  // Opens the store (recovering what a crash left leased) and starts the
  // runner.
  static Result<std::unique_ptr<JobService>> Start(const JobServiceOptions& options, RunItem run);
  ~JobService();  // Stop()

  // Stops leasing and waits for the running items (they end as their
  // generations do: the coordinator's drain bounds that).
  void Stop();

  // `validate` checks each item's request as Generate would, without
  // running it (so a bad item refuses the whole job, naming it).
  Result<rpc::JobInfo> Submit(const std::string& tenant, const rpc::SubmitJobRequest& request,
                              const std::function<Status(const rpc::GenerateRequest&)>& validate);
  Result<rpc::JobInfo> Get(const std::string& tenant, const std::string& job_id) const;
  Result<rpc::JobList> List(const std::string& tenant, const std::string& page_token, int32_t page_size) const;
  Result<rpc::JobResults> Results(const std::string& tenant, const std::string& job_id,
                                  const std::string& after_custom_id, int32_t page_size);
  // Cancels the pending items at once and stops the job's running items
  // (their generations are cancelled; their leases end as cancelled).
  Result<rpc::JobInfo> Cancel(const std::string& tenant, const std::string& job_id);
  Status Delete(const std::string& tenant, const std::string& job_id);
  // The tenant's jobs not final yet (in progress or cancelling).
  int64_t Unfinished(const std::string& tenant) const { return store_->Unfinished(tenant); }

  jobs::JobStoreStats stats() const { return store_->stats(); }
  storage::WriteHealth write_health() const { return store_->write_health(); }
  int64_t running_items() const { return running_.load(); }

 private:
  JobService(const JobServiceOptions& options, std::unique_ptr<jobs::JobStore> store, RunItem run);
  void Loop();
  void Run(jobs::ItemLease lease, const std::atomic<bool>& cancel);

  JobServiceOptions o_;
  std::unique_ptr<jobs::JobStore> store_;
  RunItem run_;
  std::atomic<int64_t> running_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  struct ItemThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
    std::string job_id;
    std::shared_ptr<std::atomic<bool>> cancel;  // set by Cancel of its job
  };
  std::vector<ItemThread> items_;  // guarded by mu_: item threads (joined when done or at Stop)
  std::thread loop_;
};

}  // namespace penumbra::coordinator
