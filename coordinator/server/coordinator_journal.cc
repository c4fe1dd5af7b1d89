// Ownership (docs/architecture.md, "Ownership"): every generation in the
// request journal, and a restart's recovery from it.
#include "coordinator/server/coordinator.h"

#include <algorithm>
#include <optional>
#include <set>
#include <string>

#include <glog/logging.h>

#include "coordinator/server/coordinator_internal.h"

namespace penumbra::coordinator {
using internal::Clock;
using internal::milliseconds;
using internal::UnixMs;

JournalRecord Coordinator::ToRecord(const Request& q) const {
  JournalRecord r;
  r.request_id = q.id;
  r.tenant = q.tenant;
  r.worker = q.worker >= 0 ? workers_->state(q.worker).endpoint.name : "";
  r.handle = q.wid;
  r.job_item = q.job_item;
  for (const DocumentView& d : q.docs) r.document_ids.push_back(d.id);
  r.cache_namespace = q.gen.cache_namespace;
  r.question = q.gen.prompt;  // the prompt after the documents
  r.max_new_tokens = q.gen.max_new_tokens;
  r.sampling =
      JournalSampling{q.gen.sampling.temperature, q.gen.sampling.top_p, q.gen.sampling.top_k, q.gen.sampling.seed};
  r.stop_ids = q.gen.stop_ids;
  r.stop = q.stop;
  r.kv_policy = q.kv_policy;
  r.share_weight = q.gen.share_weight;
  r.draws_done = q.gen.draws_done;
  r.made_before.assign(q.ids.begin(), q.ids.begin() + std::min<int64_t>(q.base, static_cast<int64_t>(q.ids.size())));
  r.resumes = q.resumes;
  r.created_unix_ms = q.created_unix_ms;
  if (q.deadline)
    r.deadline_unix_ms = q.created_unix_ms + std::chrono::duration_cast<milliseconds>(*q.deadline - q.created).count();
  return r;
}

void Coordinator::JournalMove(const Request& q) {
  if (!journal_) return;
  std::lock_guard<std::mutex> jl(journal_mu_);
  Status s = journal_->Put(ToRecord(q));
  if (!s.ok()) {
    journal_errors_->Increment();
    LOG(ERROR) << "request " << q.id << ": its move to another worker is not journalled (a restart would look for it "
               << "on the old one and start it again): " << s;
  }
}

Status Coordinator::Recover(std::unique_ptr<RequestJournal> journal) {
  if (journal_) return Status::FailedPrecondition("the request journal is already taken");
  if (!journal) return Status::InvalidArgument("no request journal");
  if (journal->owner_id() != workers_->owner_id()) {
    return Status::InvalidArgument("the worker pool renews owner '" + workers_->owner_id() + "', the journal is '" +
                                   journal->owner_id() + "'s");
  }
  journal_ = std::move(journal);  // from here on every change is journalled
  // Usage counters first (Stats and /metrics go on from where they were).
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [tenant, u] : journal_->usage()) {
      counts_[tenant] = TenantCounts{u.requests, u.failed, u.prompt, u.cached, u.generated};
      prompt_tokens_->Add({{"tenant", tenant}}).Increment(static_cast<double>(u.prompt));
      cached_tokens_->Add({{"tenant", tenant}}).Increment(static_cast<double>(u.cached));
      generated_tokens_->Add({{"tenant", tenant}}).Increment(static_cast<double>(u.generated));
    }
  }
  // What each worker holds for this owner (nullopt: it did not answer; its
  // generations are looked at when polled, as for any worker lost later).
  std::vector<std::optional<std::set<std::string>>> held(static_cast<size_t>(workers_->size()));
  for (int i = 0; i < workers_->size(); ++i) {
    Result<std::vector<std::string>> h = workers_->Renew(i);
    if (h.ok()) {
      held[static_cast<size_t>(i)] = std::set<std::string>(h->begin(), h->end());
    } else {
      LOG(WARNING) << "recovery: worker " << workers_->state(i).endpoint.name << " did not answer: " << h.status();
    }
  }
  std::set<std::pair<int, std::string>> claimed;
  int64_t attached = 0, restarted = 0, dropped = 0, failed = 0;
  const ModelLimits model = model_limits();
  const Clock::time_point now = Clock::now();
  const int64_t now_unix = UnixMs();
  for (const JournalRecord& r : journal_->records()) {
    const int w = workers_->Find(r.worker);
    const bool has = w >= 0 && held[static_cast<size_t>(w)] && held[static_cast<size_t>(w)]->count(r.handle) > 0;
    if (r.job_item) {
      // A batch job's item: the job runs it again (its store says it is not
      // done), so this copy is cancelled -- one copy, one answer.
      if (has) {
        (void)CancelOnWorker(w, r.handle);
        (void)workers_->Call(w, "release", [&](rpc::WorkerClient& c) { c.Release(r.handle); });
        claimed.emplace(w, r.handle);
      }
      Status s = journal_->Remove(r.request_id);
      if (!s.ok()) LOG(ERROR) << "recovery: " << s;
      ++dropped;
      continue;
    }
    auto q = std::make_shared<Request>();
    q->id = r.request_id;
    q->tenant = r.tenant;
    q->stop = r.stop;
    q->kv_policy = r.kv_policy;
    q->recovered = true;
    q->created_unix_ms = r.created_unix_ms;
    q->created = now - milliseconds(std::max<int64_t>(0, now_unix - r.created_unix_ms));
    if (r.deadline_unix_ms > 0) q->deadline = q->created + milliseconds(r.deadline_unix_ms - r.created_unix_ms);
    q->last_poll = now;
    q->ids = r.made_before;
    q->base = static_cast<int64_t>(r.made_before.size());
    q->resumes = r.resumes;
    q->usage.queue_seconds = -1;
    q->usage.ttft_seconds = -1;
    q->usage.generated_tokens = q->base;
    if (codec_ && !q->ids.empty()) {
      if (q->detok.Append(*codec_, q->ids).ok()) q->text = q->detok.text();
    }
    // What was sent, rebuilt from the documents and the question (to start it
    // again if its worker lost it; a document deleted since: it cannot be).
    rpc::GenerateRequest g;
    g.document_ids = r.document_ids;
    g.__set_token_ids(r.question);
    g.max_new_tokens = r.max_new_tokens;
    Result<Checked> checked = CheckGenerate(r.tenant, g, model);
    if (checked.ok()) {
      q->gen = BuildGenerate(r.tenant, g, *checked);
      q->docs = std::move(checked->docs);
    } else {
      LOG(WARNING) << "recovery: request " << r.request_id
                   << " cannot be started again if its worker lost it: " << checked.status();
      q->gen.max_new_tokens = 0;  // Resume refuses
    }
    q->gen.cache_namespace = r.cache_namespace;
    q->gen.sampling.temperature = r.sampling.temperature;
    q->gen.sampling.top_p = r.sampling.top_p;
    q->gen.sampling.top_k = r.sampling.top_k;
    q->gen.sampling.seed = r.sampling.seed;
    q->gen.stop_ids = r.stop_ids;
    q->gen.share_weight = r.share_weight;
    q->gen.draws_done = r.draws_done;
    q->gen.kv_policy = r.kv_policy;
    q->gen.owner_id = workers_->owner_id();
    q->usage.prompt_tokens = static_cast<int64_t>(q->gen.prompt.size());
    std::lock_guard<std::mutex> ql(q->mu);
    if (has || (w >= 0 && !held[static_cast<size_t>(w)])) {
      // Still there (or its worker did not answer: the first poll tells).
      q->SetWhere(w, r.handle);
      claimed.emplace(w, r.handle);
      workers_->AddRouted(w, 1);
      for (const DocumentView& d : q->docs) docs_->AddWorker(d.id, w);
      reattached_->Increment();
      ++attached;
    } else {
      // Its worker lost it (restarted, or it outlived our lease there): it
      // starts again from the tokens journalled.
      q->SetWhere(w, "");
      if (w >= 0) workers_->AddRouted(w, 1);  // Resume moves it off
      if (!Resume(*q, "its worker no longer has it after the coordinator's restart")) {
        ++failed;
        {
          std::lock_guard<std::mutex> lk(mu_);
          ++running_;  // Finalize counts it down
        }
        Finalize(*q, "error",
                 Status::Unavailable("the request's worker lost it while the coordinator restarted, "
                                     "and it could not be started again"));
        std::lock_guard<std::mutex> lk(mu_);
        requests_[q->id] = q;
        continue;
      }
      ++restarted;
    }
    std::lock_guard<std::mutex> lk(mu_);
    requests_[q->id] = q;
    ++running_;
  }
  // Generations of this owner that no record claims (started by a
  // coordinator killed before it journalled them): nobody will read them.
  int64_t orphans = 0;
  for (int i = 0; i < workers_->size(); ++i) {
    if (!held[static_cast<size_t>(i)]) continue;
    for (const std::string& h : *held[static_cast<size_t>(i)]) {
      if (claimed.count({i, h})) continue;
      (void)workers_->Call(i, "release", [&](rpc::WorkerClient& c) { c.Release(h); });
      orphans_cancelled_->Increment();
      ++orphans;
    }
  }
  LOG(INFO) << "recovery (owner " << workers_->owner_id() << "): " << attached << " generations reattached, "
            << restarted << " started again, " << dropped << " job items left to their jobs, " << failed << " failed, "
            << orphans << " orphans cancelled";
  return Status::OK();
}

}  // namespace penumbra::coordinator
