// Documents: put (factored on a worker, in the background or waited for),
// get, list and delete (its cached state forgotten on the workers).
#include "coordinator/server/coordinator.h"

#include <algorithm>
#include <string>

#include <glog/logging.h>

#include "common/crypto.h"
#include "coordinator/server/coordinator_internal.h"
#include "transport/thrift_util.h"
#include "transport/worker_documents.h"

namespace penumbra::coordinator {
using internal::Check;
using internal::Clock;
using internal::Left;
using internal::milliseconds;
using internal::OrThrow;
using internal::QuotaStatus;
using internal::Seconds;

namespace {

// The time left before `deadline_ms` from now (0: `fallback`).
Clock::time_point DeadlineOf(int64_t deadline_ms, milliseconds fallback) {
  return Clock::now() + (deadline_ms > 0 ? milliseconds(deadline_ms) : fallback);
}

}  // namespace

rpc::DocumentInfo Coordinator::ToInfo(const DocumentView& d) const {
  rpc::DocumentInfo i;
  i.id = d.id;
  i.name = d.name;
  i.tokens = d.tokens;
  i.state = d.state == DocumentState::kReady    ? rpc::DocumentState::READY
            : d.state == DocumentState::kFailed ? rpc::DocumentState::FAILED
                                                : rpc::DocumentState::FACTORING;
  i.created_unix_ms = d.created_unix_ms;
  if (!d.workers.empty()) i.worker = workers_->state(*d.workers.begin()).endpoint.name;
  if (d.state == DocumentState::kFailed) i.__set_error(d.error);
  i.factor_seconds = d.factor_seconds;
  i.factored_tokens = d.factored_tokens;
  i.kv_policy = d.kv_policy;
  return i;
}

Result<rpc::DocumentInfo> Coordinator::DoPut(const rpc::PutDocumentRequest& r) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string tenant, Tenant(r.api_key));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (draining_) return Status::Unavailable("the coordinator is draining: not accepting documents");
  }
  const ModelLimits model = model_limits();
  PENUMBRA_RETURN_IF_ERROR(ValidatePutDocumentRequest(r, o_.limits, model));
  const int64_t context = model.max_context;
  if (context == 0) return Status::Unavailable("no healthy worker");
  if (!r.wait) {
    std::lock_guard<std::mutex> lk(mu_);
    int in_flight = 0;
    for (const BackgroundPut& p : puts_) in_flight += p.tenant == tenant && !*p.done;
    if (in_flight >= o_.max_background_puts_per_tenant) {
      return Status::ResourceExhausted("tenant '" + tenant + "' has " + std::to_string(in_flight) +
                                       " documents being factored in the background, the most at once "
                                       "(max_background_puts_per_tenant); retry when one is READY")
          .WithRetryAfter(1000);
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                            TextOrIds("document", r.__isset.text ? &r.text : nullptr,
                                      r.__isset.token_ids ? &r.token_ids : nullptr, /*starts_prompt=*/true, model));
  // A text document starts with the template's special tokens (a BOS); where
  // it follows another document they are left out.
  const int leading_special = r.__isset.text && codec_ ? codec_->LeadingSpecialTokens(ids) : 0;
  if (static_cast<int64_t>(ids.size()) >= context) {
    return Status::InvalidArgument("document of " + std::to_string(ids.size()) +
                                   " tokens leaves no room for a question in the model's " + std::to_string(context) +
                                   "-token context");
  }
  // Stored document bytes: its token ids, as the coordinator keeps them.
  const int64_t doc_bytes = static_cast<int64_t>(ids.size() * sizeof(int32_t));
  // A registry that cannot store (a full disk) refuses the put before a worker factors it.
  PENUMBRA_RETURN_IF_ERROR(docs_->CheckWritable());
  if (o_.tenants)
    PENUMBRA_RETURN_IF_ERROR(QuotaStatus(o_.tenants->ReserveDocumentBytes(tenant, doc_bytes), quota_refusals_, tenant));
  Result<DocumentView> added = docs_->Add(tenant, r.name, std::move(ids), leading_special, r.kv_policy);
  if (!added.ok()) {
    if (o_.tenants) o_.tenants->ReleaseDocumentBytes(tenant, doc_bytes);
    return added.status();
  }
  DocumentView d = std::move(*added);
  documents_put_->Add({{"tenant", tenant}}).Increment();
  const Clock::time_point deadline = DeadlineOf(r.deadline_ms, o_.put_timeout);
  if (!r.wait) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = puts_.begin(); it != puts_.end();) {
      if (*it->done) {
        it->thread.join();
        it = puts_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    puts_.push_back({std::thread([this, d, deadline, done] {
                       Factor(d, deadline);
                       *done = true;
                     }),
                     done, tenant});
    return ToInfo(d);
  }
  Factor(d, deadline);
  PENUMBRA_ASSIGN_OR_RETURN(DocumentView now, docs_->Get(tenant, d.id));
  if (now.state == DocumentState::kFailed && now.error_code == StatusCode::kInvalidArgument) {
    // Refused by the worker as input (not a failure of the service): not kept.
    (void)docs_->Remove(tenant, d.id);
    return Status::InvalidArgument(now.error);
  }
  // Factored but not stored (the registry's write failed): the put fails, typed.
  if (now.state == DocumentState::kFailed && now.not_stored) return Status(now.error_code, now.error);
  return ToInfo(now);
}

void Coordinator::Factor(DocumentView d, Clock::time_point deadline) {
  const Clock::time_point t0 = Clock::now();
  Status last = Status::Unavailable("no healthy worker");
  for (int w : Route(d.kv_policy, {}, d.tokens)) {
    rpc::WorkerPutRequest p;
    p.kv_policy = d.kv_policy;
    p.documents = {transport::DocumentWithIds(*d.ids, d.digest)};
    p.cache_namespace = d.tenant;
    p.tenant = d.tenant;
    p.deadline_ms = std::max<int64_t>(1, Left(deadline).count());
    std::string wid;
    Status s = workers_->Call(w, "put " + d.id, [&](rpc::WorkerClient& c) { c.PutDocument(wid, p); });
    if (!s.ok()) {
      last = s;
      if (s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kUnavailable) continue;
      break;
    }
    workers_->AddRouted(w, 1);
    rpc::WorkerPutProgress ch;
    while (!ch.done) {
      // One long poll per step of progress (the tokens factored, for
      // GetDocument), returning at the latest a little after the deadline.
      const milliseconds wait = std::clamp(Left(deadline) + milliseconds(1000), milliseconds(1), milliseconds(30000));
      const int64_t known = ch.factored_tokens;
      s = workers_->Call(
          w, "put " + d.id,
          [&](rpc::WorkerClient& c) { c.WaitPut(ch, wid, known, static_cast<int32_t>(wait.count())); },
          wait + milliseconds(10000));
      if (!s.ok() && s.code() != StatusCode::kDeadlineExceeded) break;
      if (s.ok()) docs_->SetProgress(d.id, ch.factored_tokens);
      if (!s.ok() && Clock::now() > deadline + std::chrono::seconds(30)) {
        (void)CancelOnWorker(w, wid);
        break;  // the worker does not answer past the deadline
      }
    }
    workers_->AddRouted(w, -1);
    if (!s.ok()) {
      last = s;
      continue;  // the worker went away: the next one
    }
    (void)workers_->Call(w, "release", [&](rpc::WorkerClient& c) { c.Release(wid); });
    if (ch.finish_reason == "prefilled") {
      const double secs = Seconds(Clock::now() - t0);
      factor_->Observe(secs);
      if (Status stored = docs_->SetReady(d.id, w, secs); !stored.ok()) {
        LOG(WARNING) << "document " << d.id << " factored, not stored: " << stored;
        return;
      }
      LOG(INFO) << "document " << d.id << " (" << d.tokens << " tokens) factored on worker "
                << workers_->state(w).endpoint.name << " in " << secs << " s";
      return;
    }
    last = ch.__isset.error_code ? transport::FromRpcError([&] {
      rpc::PenumbraError e;
      e.code = ch.error_code;
      e.message = ch.__isset.error_message ? ch.error_message : ch.finish_reason;
      return e;
    }())
                                 : Status::Internal("the worker ended the put: " + ch.finish_reason);
    if (last.code() != StatusCode::kResourceExhausted) break;
  }
  LOG(WARNING) << "document " << d.id << " not factored: " << last;
  if (Status s = docs_->SetFailed(d.id, last); !s.ok()) LOG(WARNING) << "document " << d.id << ": " << s;
}

void Coordinator::PutDocument(rpc::DocumentInfo& out, const rpc::PutDocumentRequest& request) {
  out = OrThrow(DoPut(request));
}

void Coordinator::GetDocument(rpc::DocumentInfo& out, const std::string& api_key, const std::string& document_id,
                              int64_t deadline_ms) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("document_id", document_id, o_.limits));
  Check(ValidateDeadline("deadline_ms", deadline_ms, o_.limits));
  out = ToInfo(OrThrow(docs_->Get(tenant, document_id)));
}

void Coordinator::ListDocuments(rpc::DocumentList& out, const rpc::ListDocumentsRequest& request) {
  const std::string tenant = OrThrow(Tenant(request.api_key));
  Check(ValidatePageSize(request.page_size, o_.limits));
  Check(ValidateId("page_token", request.page_token, o_.limits));
  Check(ValidateDeadline("deadline_ms", request.deadline_ms, o_.limits));
  DocumentPage p = OrThrow(docs_->List(tenant, request.page_token, request.page_size));
  out.documents.clear();
  for (const auto& d : p.documents) out.documents.push_back(ToInfo(d));
  out.next_page_token = p.next_page_token;
}

void Coordinator::DeleteDocument(const std::string& api_key, const std::string& document_id, int64_t deadline_ms) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("document_id", document_id, o_.limits));
  Check(ValidateDeadline("deadline_ms", deadline_ms, o_.limits));
  DocumentView d = OrThrow(docs_->Remove(tenant, document_id));
  if (o_.tenants) o_.tenants->ReleaseDocumentBytes(tenant, d.tokens * static_cast<int64_t>(sizeof(int32_t)));
  // Its cached state goes too (requests attached now keep theirs until they
  // end): at once on the workers known to hold it, on the others (and those
  // that did not answer) by the tombstone sweep.
  for (int w : d.workers) {
    Status s = ForgetOn(w, d.id, d.tenant, d.ids);
    if (s.ok()) {
      docs_->ConfirmForgotten(d.id, w);
    } else {
      LOG(WARNING) << "document " << d.id << ": cached state not dropped yet: " << s;
    }
  }
  tombstones_->Kick();
}

Status Coordinator::ForgetOn(int w, const std::string& id, const std::string& tenant,
                             const std::shared_ptr<const std::vector<int32_t>>& ids) {
  const std::vector<rpc::WorkerDocument> refs = {
      transport::DocumentRef(DocumentDigest(ids->data(), ids->size()), static_cast<int64_t>(ids->size()))};
  return workers_->Call(w, "forget " + id, [&](rpc::WorkerClient& c) { (void)c.ForgetDocuments(refs, tenant); });
}

}  // namespace penumbra::coordinator
