// Batch jobs: the job calls over JobService, and each item run as a
// generation to its end.
#include "coordinator/server/coordinator.h"

#include <optional>
#include <string>

#include <glog/logging.h>

#include "coordinator/server/coordinator_internal.h"

namespace penumbra::coordinator {
using internal::Check;
using internal::milliseconds;
using internal::OrThrow;
using internal::Throw;

Status Coordinator::StartJobs(JobServiceOptions options) {
  if (jobs_) return Status::FailedPrecondition("jobs are already started");
  PENUMBRA_ASSIGN_OR_RETURN(
      jobs_,
      JobService::Start(options, [this](const std::string& tenant, const rpc::GenerateRequest& r,
                                        const std::atomic<bool>& cancel) { return RunItem(tenant, r, cancel); }));
  return Status::OK();
}

Result<JobService*> Coordinator::Jobs() const {
  if (!jobs_) {
    return Status::FailedPrecondition("batch jobs need a coordinator with a data directory (--data-dir)");
  }
  return jobs_.get();
}

ItemOutcome Coordinator::RunItem(const std::string& tenant, const rpc::GenerateRequest& request,
                                 const std::atomic<bool>& cancel) {
  ItemOutcome out;
  rpc::GenerateRequest r = request;
  r.deadline_ms = 0;  // the job's window applies
  Result<std::shared_ptr<Request>> started = DoGenerateAs(tenant, r, /*job_item=*/true);
  if (!started.ok()) {
    out.status = started.status();
    return out;
  }
  Request& q = **started;
  std::lock_guard<std::mutex> lk(q.mu);
  bool cancel_sent = false;
  while (!q.done) {
    if (stopping_) {
      out.status = Status::Unavailable("the coordinator is stopping");
      return out;
    }
    if (cancel.load() && !cancel_sent) {
      // Its job was cancelled: the worker stops it as a client's Cancel
      // would, and the generation ends as "cancelled".
      cancel_sent = true;
      Status c = CancelOnWorker(q.worker, q.wid);
      if (!c.ok()) LOG(WARNING) << "jobs: cancelling a job's item: " << c;
    }
    // Short waits: a cancel of the job is noticed within one.
    Status s = Advance(q, static_cast<int64_t>(q.ids.size()), milliseconds(200));
    if (!s.ok()) {
      out.status = s;
      return out;
    }
  }
  if (drain_expired_ && (q.finish_reason == "cancelled" || q.finish_reason == "drained")) {
    // Stopped by an expired drain, not by its job: the item stays for the
    // next start (worth retrying), not answered "cancelled".
    out.status = Status::Unavailable("the coordinator stopped (its drain expired) before the item ended");
    return out;
  }
  rpc::GenerateChunk c;
  ToChunk(q, 0, &c);
  if (q.finish_reason == "error" || q.finish_reason == "deadline") {
    out.status = q.error.ok() ? Status::Internal("the generation failed") : q.error;
    return out;
  }
  out.text = c.text;
  out.ids = c.ids;
  out.finish_reason = c.finish_reason;
  out.usage = c.usage;
  return out;
}

std::optional<int64_t> Coordinator::JobQuota(const std::string& tenant) const {
  if (!o_.tenants) return std::nullopt;
  Result<tenants::TenantConfig> t = o_.tenants->Tenant(tenant);
  return t.ok() ? t->quotas.max_jobs_in_flight : std::nullopt;
}

void Coordinator::SubmitJob(rpc::JobInfo& out, const rpc::SubmitJobRequest& request) {
  const std::string tenant = OrThrow(Tenant(request.api_key));
  JobService* jobs = OrThrow(Jobs());
  // Every item's shape (as Generate checks it) and the job's own bounds,
  // before any item is looked at further.
  const ModelLimits model = model_limits();
  Check(ValidateSubmitJobRequest(request, o_.limits, model));
  if (std::optional<int64_t> quota = JobQuota(tenant)) {
    // Counted from the store (unfinished jobs survive restarts; a lease in
    // memory would not).
    const int64_t unfinished = jobs->Unfinished(tenant);
    if (unfinished >= *quota) {
      quota_refusals_->Add({{"tenant", tenant}}).Increment();
      Throw(Status::ResourceExhausted("tenant '" + tenant + "' has " + std::to_string(unfinished) +
                                      " jobs in flight, its quota (max_jobs_in_flight " + std::to_string(*quota) +
                                      "); retry when one finishes")
                .WithRetryAfter(5000));
    }
  }
  out = OrThrow(jobs->Submit(tenant, request, [&](const rpc::GenerateRequest& r) -> Status {
    // Its documents, its prompt's length and whether its tokens can ever fit
    // the tenant's rate; nothing is concatenated or reserved here (each item
    // reserves when it runs).
    PENUMBRA_ASSIGN_OR_RETURN(Checked c, CheckGenerate(tenant, r, model));
    if (o_.tenants) return o_.tenants->CheckTokensFit(tenant, c.generated_bound).status;
    return Status::OK();
  }));
}

void Coordinator::GetJob(rpc::JobInfo& out, const std::string& api_key, const std::string& job_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  out = OrThrow(OrThrow(Jobs())->Get(tenant, job_id));
}

void Coordinator::ListJobs(rpc::JobList& out, const std::string& api_key, const std::string& page_token,
                           int32_t page_size) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidatePageSize(page_size, o_.limits));
  Check(ValidateId("page_token", page_token, o_.limits));
  out = OrThrow(OrThrow(Jobs())->List(tenant, page_token, page_size));
}

void Coordinator::GetJobResults(rpc::JobResults& out, const std::string& api_key, const std::string& job_id,
                                const std::string& after_custom_id, int32_t page_size) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  Check(ValidatePageSize(page_size, o_.limits));
  Check(ValidateId("after_custom_id", after_custom_id, o_.limits));
  out = OrThrow(OrThrow(Jobs())->Results(tenant, job_id, after_custom_id, page_size));
}

void Coordinator::CancelJob(rpc::JobInfo& out, const std::string& api_key, const std::string& job_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  out = OrThrow(OrThrow(Jobs())->Cancel(tenant, job_id));
}

void Coordinator::DeleteJob(const std::string& api_key, const std::string& job_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("job_id", job_id, o_.limits));
  Status s = OrThrow(Jobs())->Delete(tenant, job_id);
  if (!s.ok()) Throw(s);
}

}  // namespace penumbra::coordinator
