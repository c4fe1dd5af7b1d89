#include "coordinator/server/job_service.h"

#include <algorithm>
#include <iterator>

#include <glog/logging.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "transport/thrift_util.h"

namespace penumbra::coordinator {
namespace {

using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TMemoryBuffer;

template <typename T>
std::string Serialize(const T& v) {
  auto buf = std::make_shared<TMemoryBuffer>();
  TBinaryProtocol p(buf);
  v.write(&p);
  return buf->getBufferAsString();
}

template <typename T>
Result<T> Deserialize(const std::string& bytes, const std::string& what) {
  try {
    auto buf = std::make_shared<TMemoryBuffer>(reinterpret_cast<uint8_t*>(const_cast<char*>(bytes.data())),
                                               static_cast<uint32_t>(bytes.size()), TMemoryBuffer::OBSERVE);
    TBinaryProtocol p(buf);
    T v;
    v.read(&p);
    return v;
  } catch (const std::exception& e) {
    return Status::Corruption(what + " cannot be read back: " + e.what());
  }
}

rpc::JobStatus::type ToRpc(jobs::JobStatus s) {
  switch (s) {
    case jobs::JobStatus::kValidating:
      return rpc::JobStatus::VALIDATING;
    case jobs::JobStatus::kInProgress:
      return rpc::JobStatus::IN_PROGRESS;
    case jobs::JobStatus::kFinalizing:
      return rpc::JobStatus::FINALIZING;
    case jobs::JobStatus::kCompleted:
      return rpc::JobStatus::COMPLETED;
    case jobs::JobStatus::kFailed:
      return rpc::JobStatus::FAILED;
    case jobs::JobStatus::kCancelling:
      return rpc::JobStatus::CANCELLING;
    case jobs::JobStatus::kCancelled:
      return rpc::JobStatus::CANCELLED;
    case jobs::JobStatus::kExpired:
      return rpc::JobStatus::EXPIRED;
  }
  return rpc::JobStatus::FAILED;
}

rpc::JobInfo ToRpc(const jobs::JobInfo& j) {
  rpc::JobInfo o;
  o.id = j.id;
  o.status = ToRpc(j.status);
  o.created_unix_s = j.created_at;
  o.expires_unix_s = j.expires_at;
  o.finished_unix_s = j.finished_at;
  o.total = j.counts.total;
  o.pending = j.counts.pending;
  o.running = j.counts.running;
  o.completed = j.counts.completed;
  o.failed = j.counts.failed;
  o.cancelled = j.counts.cancelled;
  o.metadata = j.metadata;
  return o;
}

// Worth another lease: no worker could take it now, or it lost its worker.
bool Retryable(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kResourceExhausted;
}

int64_t NowSeconds(const jobs::JobStoreOptions& o) {
  if (o.clock) return o.clock();
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

Result<std::unique_ptr<JobService>> JobService::Start(const JobServiceOptions& options, RunItem run) {
  if (options.max_running_items < 1) return Status::InvalidArgument("jobs: max_running_items must be >= 1");
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<jobs::JobStore> store, jobs::JobStore::Open(options.store));
  const jobs::JobStoreStats st = store->stats();
  if (st.recoveries > 0) LOG(INFO) << "jobs: " << st.recoveries << " items leased before a restart run again";
  std::unique_ptr<JobService> s(new JobService(options, std::move(store), std::move(run)));
  s->loop_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

JobService::JobService(const JobServiceOptions& options, std::unique_ptr<jobs::JobStore> store, RunItem run)
    : o_(options), store_(std::move(store)), run_(std::move(run)) {}

JobService::~JobService() { Stop(); }

void JobService::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ && !loop_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (loop_.joinable()) loop_.join();
  std::vector<ItemThread> items;
  {
    std::lock_guard<std::mutex> lk(mu_);
    items.swap(items_);
  }
  for (ItemThread& t : items) t.thread.join();
}

void JobService::Loop() {
  auto last_expiry = std::chrono::steady_clock::time_point();
  while (true) {
    std::vector<ItemThread> finished;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      auto done = std::partition(items_.begin(), items_.end(), [](const ItemThread& t) { return !t.done->load(); });
      std::move(done, items_.end(), std::back_inserter(finished));
      items_.erase(done, items_.end());
    }
    for (ItemThread& t : finished) t.thread.join();
    const auto now = std::chrono::steady_clock::now();
    if (now - last_expiry >= std::chrono::seconds(1)) {
      last_expiry = now;
      Status s = store_->ExpireDue(NowSeconds(o_.store));
      if (!s.ok()) LOG(ERROR) << "jobs: expiring: " << s;
    }
    bool claimed = false;
    const int64_t free = o_.max_running_items - running_.load();
    if (free > 0) {
      // Leased and listed under one lock, so that Cancel either finds the
      // item in items_ or its job already cancelling (then Claim skips it).
      std::lock_guard<std::mutex> lk(mu_);
      Result<std::vector<jobs::ItemLease>> leases = store_->Claim(static_cast<size_t>(free));
      if (!leases.ok()) {
        LOG(ERROR) << "jobs: leasing items: " << leases.status();
      } else {
        for (jobs::ItemLease& l : *leases) {
          claimed = true;
          ++running_;
          auto done = std::make_shared<std::atomic<bool>>(false);
          auto cancel = std::make_shared<std::atomic<bool>>(false);
          std::string job_id = l.job_id;
          items_.push_back({std::thread([this, lease = std::move(l), done, cancel]() mutable {
                              Run(std::move(lease), *cancel);
                              --running_;
                              done->store(true);
                              cv_.notify_all();
                            }),
                            done, std::move(job_id), cancel});
        }
      }
    }
    if (!claimed) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, o_.poll_interval, [&] { return stop_; });
    }
  }
}

void JobService::Run(jobs::ItemLease lease, const std::atomic<bool>& cancel) {
  const std::string where = lease.job_id + " item " + std::to_string(lease.item_index) + " ('" + lease.custom_id + "')";
  jobs::ItemResult r;
  Result<rpc::GenerateRequest> req = Deserialize<rpc::GenerateRequest>(lease.options, "the request of " + where);
  if (!req.ok()) {
    r.error = req.status().ToString();
  } else {
    ItemOutcome out = run_(lease.tenant, *req, cancel);
    if (cancel.load() && (!out.status.ok() || out.finish_reason == "cancelled")) {
      // Stopped by its job's cancel: the released lease of a cancelling
      // job's item ends as cancelled (JobStore::Release).
      Status s = store_->Release(lease.job_id, lease.item_index, lease.attempt);
      if (!s.ok()) LOG(ERROR) << "jobs: releasing cancelled " << where << ": " << s;
      return;
    }
    if (!out.status.ok() && Retryable(out.status)) {
      // Leased again after a pause (or, when the coordinator stops
      // meanwhile, by the next one: the store recovers running items).
      std::unique_lock<std::mutex> lk(mu_);
      if (cv_.wait_for(lk, o_.retry_delay, [&] { return stop_; })) return;
      lk.unlock();
      Status s = store_->Release(lease.job_id, lease.item_index, lease.attempt);
      if (!s.ok()) LOG(ERROR) << "jobs: releasing " << where << ": " << s;
      return;
    }
    rpc::JobItemResult jr;
    jr.ok = out.status.ok();
    if (jr.ok) {
      jr.text = out.text;
      jr.ids = out.ids;
      jr.finish_reason = out.finish_reason;
      jr.usage = out.usage;
    } else {
      jr.__set_error_code(transport::ToRpcError(out.status).code);
      jr.error = out.status.message();
      jr.finish_reason = "error";
    }
    r.ok = jr.ok;
    r.error = jr.error;
    r.prompt_tokens = out.usage.prompt_tokens;
    r.cached_tokens = out.usage.cached_prompt_tokens;
    r.generated_tokens = out.usage.generated_tokens;
    r.ttft_ms = out.usage.ttft_seconds * 1000;
    r.answer = Serialize(jr);
  }
  // A result whose write fails (a full disk) is kept and written again
  // every retry_delay until it is stored; a coordinator stopping meanwhile
  // leaves the item running in the store, so the next one runs it again.
  // Either way it is answered once: the first result stored wins.
  for (;;) {
    Status s = store_->Complete(lease.job_id, lease.item_index, lease.attempt, r);
    if (s.ok()) return;
    const bool again = s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kIOError ||
                       s.code() == StatusCode::kUnavailable;
    LOG(ERROR) << "jobs: recording the result of " << where << ": " << s << (again ? " (kept; retrying)" : "");
    if (!again) return;
    std::unique_lock<std::mutex> lk(mu_);
    if (cv_.wait_for(lk, o_.retry_delay, [&] { return stop_; })) return;
  }
}

Result<rpc::JobInfo> JobService::Submit(const std::string& tenant, const rpc::SubmitJobRequest& request,
                                        const std::function<Status(const rpc::GenerateRequest&)>& validate) {
  if (request.completion_window_s < 0) return Status::InvalidArgument("completion_window_s must be >= 0");
  jobs::JobSpec spec;
  spec.completion_window_s = request.completion_window_s;
  spec.metadata = request.metadata;
  spec.items.reserve(request.items.size());
  for (size_t i = 0; i < request.items.size(); ++i) {
    const rpc::JobItem& it = request.items[i];
    Status v = validate(it.request);
    if (!v.ok()) {
      return Status(v.code(), "items[" + std::to_string(i) + "] (custom_id '" + it.custom_id + "'): " + v.message());
    }
    jobs::JobItem ji;
    ji.custom_id = it.custom_id;
    ji.document_ids = it.request.document_ids;
    ji.question = it.request.__isset.text ? it.request.text : std::string();
    ji.options = Serialize(it.request);
    spec.items.push_back(std::move(ji));
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::string id, store_->Submit(tenant, spec));
  cv_.notify_all();
  return Get(tenant, id);
}

Result<rpc::JobInfo> JobService::Get(const std::string& tenant, const std::string& job_id) const {
  PENUMBRA_ASSIGN_OR_RETURN(jobs::JobInfo j, store_->Get(tenant, job_id));
  return ToRpc(j);
}

Result<rpc::JobList> JobService::List(const std::string& tenant, const std::string& page_token,
                                      int32_t page_size) const {
  if (page_size < 1) return Status::InvalidArgument("page_size must be >= 1, got " + std::to_string(page_size));
  PENUMBRA_ASSIGN_OR_RETURN(jobs::JobPage p, store_->List(tenant, page_token, static_cast<size_t>(page_size)));
  rpc::JobList out;
  for (const jobs::JobInfo& j : p.jobs) out.jobs.push_back(ToRpc(j));
  out.next_page_token = p.next_page_token;
  return out;
}

Result<rpc::JobResults> JobService::Results(const std::string& tenant, const std::string& job_id,
                                            const std::string& after_custom_id, int32_t page_size) {
  if (page_size < 1) return Status::InvalidArgument("page_size must be >= 1, got " + std::to_string(page_size));
  PENUMBRA_ASSIGN_OR_RETURN(jobs::ResultsPage p,
                            store_->Results(tenant, job_id, after_custom_id, static_cast<size_t>(page_size)));
  rpc::JobResults out;
  for (const jobs::ItemOutcome& o : p.items) {
    rpc::JobItemResult r;
    if (!o.result.answer.empty()) {
      PENUMBRA_ASSIGN_OR_RETURN(
          r, Deserialize<rpc::JobItemResult>(o.result.answer, "the result of '" + o.custom_id + "'"));
    } else {
      r.ok = o.result.ok;
      r.error = o.result.error;
      r.finish_reason = o.state == jobs::ItemState::kCancelled ? "cancelled" : "error";
    }
    r.custom_id = o.custom_id;
    r.state = std::string(jobs::ToString(o.state));
    out.results.push_back(std::move(r));
  }
  out.next_after = p.next_after_custom_id;
  return out;
}

Result<rpc::JobInfo> JobService::Cancel(const std::string& tenant, const std::string& job_id) {
  {
    std::lock_guard<std::mutex> lk(mu_);  // see Loop
    PENUMBRA_RETURN_IF_ERROR(store_->Cancel(tenant, job_id));
    for (ItemThread& t : items_) {
      if (t.job_id == job_id) t.cancel->store(true);
    }
  }
  return Get(tenant, job_id);
}

Status JobService::Delete(const std::string& tenant, const std::string& job_id) {
  return store_->Delete(tenant, job_id);
}

}  // namespace penumbra::coordinator
