// Generations: admission (validation, documents, quotas), placement on a
// worker, streaming by long polls (stop strings applied here), resuming on
// another worker when one is lost, the end (usage counted) and the sweep of
// expired and abandoned ones.
#include "coordinator/server/coordinator.h"

#include <algorithm>
#include <string>

#include <glog/logging.h>

#include "common/crypto.h"
#include "common/kv_policies.h"
#include "coordinator/server/coordinator_internal.h"
#include "coordinator/server/placement.h"
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
using internal::Throw;
using internal::UnixMs;

namespace {

// 128 bits from the CSPRNG: a request id is not guessable (and is scoped to
// its tenant besides).
std::string NewRequestId() { return "req-" + RandomHandle(); }

}  // namespace

std::vector<int> Coordinator::Route(const std::string& kv_policy, const std::vector<DocumentView>& docs,
                                    int64_t tokens) const {
  std::vector<WorkerState> s = workers_->states();
  const std::map<int, int64_t> held = docs_->held_per_worker();
  // A group's free memory is its ranks' (each holds a shard).
  std::map<std::string, int64_t> group_free;
  for (const WorkerState& w : s) {
    if (w.endpoint.group.empty()) continue;
    int64_t& f = group_free[w.endpoint.group];
    f = (f < 0 || w.stats.memory_free_bytes < 0) ? -1 : f + w.stats.memory_free_bytes;
  }
  auto fits = [&](const WorkerState& w, int64_t free) {
    const int64_t per = w.health.device_bytes_per_token;
    return tokens <= 0 || per <= 0 || free < 0 || tokens <= free / per;
  };
  const bool long_prompt = o_.group_min_tokens > 0 && tokens >= o_.group_min_tokens;
  std::vector<PlacementCandidate> holders, first, then;
  for (int i = 0; i < static_cast<int>(s.size()); ++i) {
    // An "auto" worker holds a request under any of its forms (the pin goes with it).
    if (!s[i].healthy || !KvPolicyServes(s[i].health.kv_policy, s[i].health.kv_forms, kv_policy)) continue;
    const bool group = !s[i].endpoint.group.empty();
    if (group && (s[i].endpoint.rank != 0 || !s[i].group_formed)) continue;  // rank 0 of a formed group only
    const int64_t free = group ? group_free[s[i].endpoint.group] : s[i].stats.memory_free_bytes;
    if (!fits(s[i], free)) continue;
    PlacementCandidate w;
    w.worker = i;
    w.holds_document = !docs.empty() && docs.front().workers.count(i) > 0;
    w.routed = s[i].routed;
    auto it = held.find(i);
    w.documents_held = it == held.end() ? 0 : it->second;
    w.memory_free_bytes = free;
    if (w.holds_document) {
      holders.push_back(w);
    } else if (group == long_prompt) {
      first.push_back(w);
    } else {
      then.push_back(w);
    }
  }
  std::vector<int> order = OrderWorkers(std::move(holders), o_.min_free_memory_bytes);
  for (auto* part : {&first, &then}) {
    for (int w : OrderWorkers(std::move(*part), o_.min_free_memory_bytes)) order.push_back(w);
  }
  return order;
}

Result<std::shared_ptr<Coordinator::Request>> Coordinator::DoGenerate(const rpc::GenerateRequest& r) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string tenant, Tenant(r.api_key));
  return DoGenerateAs(tenant, r);
}

Result<std::shared_ptr<Coordinator::Request>> Coordinator::DoGenerateAs(const std::string& tenant,
                                                                        const rpc::GenerateRequest& r, bool job_item) {
  // The request's own bounds first: nothing below (a lookup, tokenizing,
  // concatenating, a worker) runs for a request past them.
  const ModelLimits model = model_limits();
  PENUMBRA_RETURN_IF_ERROR(ValidateGenerateRequest(r, o_.limits, model));
  DropExpired();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (draining_) return Status::Unavailable("the coordinator is draining: not accepting requests");
    if (running_ >= o_.max_running_requests) {
      return Status::ResourceExhausted(std::to_string(running_) +
                                       " requests are running, the most this coordinator "
                                       "takes; retry later");
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(Checked checked, CheckGenerate(tenant, r, model));
  // Quotas: the tokens it may generate are reserved now (the unused part
  // comes back when it ends), then one concurrent sequence.
  tenants::TokenReservation tokens;
  tenants::Lease sequence;
  if (o_.tenants) {
    PENUMBRA_RETURN_IF_ERROR(
        QuotaStatus(o_.tenants->ReserveTokens(tenant, checked.generated_bound, &tokens), quota_refusals_, tenant));
    PENUMBRA_RETURN_IF_ERROR(QuotaStatus(o_.tenants->AcquireSequence(tenant, &sequence), quota_refusals_, tenant));
  }
  rpc::WorkerGenerateRequest g = BuildGenerate(tenant, r, checked);
  g.owner_id = workers_->owner_id();

  Status last =
      Status::Unavailable(g.kv_policy.empty() ? "no healthy worker" : "no healthy worker of kv policy " + g.kv_policy);
  auto q = std::make_shared<Request>();
  for (int w : Route(g.kv_policy, checked.docs, checked.prompt_tokens)) {
    g.stop_ids = r.stop_ids;
    if (!r.ignore_eos) {
      for (int32_t eos : workers_->state(w).health.eos_ids) {
        if (std::find(g.stop_ids.begin(), g.stop_ids.end(), eos) == g.stop_ids.end()) g.stop_ids.push_back(eos);
      }
    }
    std::string wid;
    bool by_digest = false;
    Status s = SendGenerate(w, g, checked.docs, &wid, &by_digest);
    if (s.ok()) {
      q->SetWhere(w, wid);
      q->by_digest = by_digest;
      break;
    }
    last = s;
    // Full or gone: the next worker; anything else is about the request.
    if (s.code() != StatusCode::kResourceExhausted && s.code() != StatusCode::kUnavailable) return s;
  }
  if (q->worker < 0) return last;
  std::vector<DocumentView> docs = std::move(checked.docs);
  workers_->AddRouted(q->worker, 1);
  for (const DocumentView& d : docs) docs_->AddWorker(d.id, q->worker);
  q->id = NewRequestId();
  q->tenant = tenant;
  q->stop = r.stop;
  q->created = Clock::now();
  if (r.deadline_ms > 0) q->deadline = q->created + milliseconds(r.deadline_ms);
  q->usage.prompt_tokens = checked.prompt_tokens;
  q->usage.queue_seconds = -1;
  q->usage.ttft_seconds = -1;
  q->sequence = std::move(sequence);
  q->tokens = std::move(tokens);
  q->gen = g;  // Thrift structs copy (no move assignment)
  q->docs = std::move(docs);
  q->kv_policy = g.kv_policy;
  q->job_item = job_item;
  q->created_unix_ms = UnixMs();
  q->last_poll = q->created;
  // Journalled before anyone learns of it: a failed write fails the call
  // and leaves nothing running.
  std::unique_lock<std::mutex> jl(journal_mu_, std::defer_lock);
  if (journal_) {
    jl.lock();
    TenantUsage u;
    {
      std::lock_guard<std::mutex> lk(mu_);
      const TenantCounts& c = counts_[tenant];
      u = TenantUsage{c.requests + 1, c.failed, c.prompt, c.cached, c.generated};
    }
    Status js = journal_->Start(ToRecord(*q), u);
    if (!js.ok()) {
      journal_errors_->Increment();
      LOG(ERROR) << "request journal: " << js << "; the generation is refused";
      (void)workers_->Call(q->worker, "release", [&](rpc::WorkerClient& c) { c.Release(q->wid); });
      workers_->AddRouted(q->worker, -1);
      return Status::Unavailable("the coordinator cannot journal the request (" + js.message() + "); retry later")
          .WithRetryAfter(1000);
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  requests_[q->id] = q;
  ++running_;
  ++counts_[tenant].requests;
  return q;
}

Result<Coordinator::Checked> Coordinator::CheckGenerate(const std::string& tenant, const rpc::GenerateRequest& r,
                                                        const ModelLimits& model) const {
  Checked c;
  // Documents are the tenant's own, or a corpus another tenant publishes to
  // it (publishes_to), read in the owner's cache namespace; one request's
  // documents all have one owner, so nothing of one tenant is cached under
  // another's namespace. (At most max_document_ids of them, each once.)
  auto may_read = [&](const std::string& owner) { return o_.tenants && o_.tenants->CanRead(tenant, owner); };
  int64_t document_tokens = 0;
  for (const std::string& id : r.document_ids) {
    PENUMBRA_ASSIGN_OR_RETURN(DocumentView d, docs_->GetReadable(tenant, id, may_read));
    if (!c.docs.empty() && d.tenant != c.docs.front().tenant) {
      return Status::InvalidArgument("documents of one request must have one owner: '" + c.docs.front().id + "' and '" +
                                     id + "' do not");
    }
    if (d.state == DocumentState::kFactoring) {
      return Status::FailedPrecondition("document '" + id + "' is still being factored; retry when it is READY");
    }
    if (d.state == DocumentState::kFailed) {
      return Status::FailedPrecondition("document '" + id + "' failed to factor: " + d.error);
    }
    // As BuildGenerate concatenates them: a document after the first
    // without its leading special tokens.
    document_tokens += d.tokens - (c.docs.empty() ? 0 : d.leading_special);
    c.docs.push_back(std::move(d));
  }
  // The documents alone must leave room: checked before the question is
  // tokenized and before anything is concatenated.
  // (With fit_context, a question and one generated token.)
  const int64_t wanted = r.fit_context ? 1 : r.max_new_tokens;
  if (model.max_context > 0 && document_tokens + wanted >= model.max_context) {
    return Status::InvalidArgument("the documents (" + std::to_string(document_tokens) + " tokens) + max_new_tokens (" +
                                   std::to_string(wanted) + ") leave no room for a question in the model's " +
                                   std::to_string(model.max_context) + "-token context");
  }
  PENUMBRA_ASSIGN_OR_RETURN(c.question, TextOrIds("question", r.__isset.text ? &r.text : nullptr,
                                                  r.__isset.token_ids ? &r.token_ids : nullptr,
                                                  /*starts_prompt=*/c.docs.empty() && r.add_special_tokens, model));
  if (r.reuse_documents && c.docs.empty()) {
    // Automatic reuse: the tenant's documents the prompt starts with.
    int64_t consumed = 0;
    c.docs = docs_->MatchPrefix(tenant, c.question, static_cast<size_t>(o_.limits.max_document_ids), &consumed);
    if (!c.docs.empty()) {
      c.question.erase(c.question.begin(), c.question.begin() + consumed);
      document_tokens = consumed;
    }
  }
  c.prompt_tokens = document_tokens + static_cast<int64_t>(c.question.size());
  c.max_new_tokens = r.max_new_tokens;
  if (r.fit_context && model.max_context > 0) {
    c.max_new_tokens = static_cast<int32_t>(std::min<int64_t>(r.max_new_tokens, model.max_context - c.prompt_tokens));
    if (c.max_new_tokens < 1) {
      return Status::InvalidArgument("the prompt (" + std::to_string(c.prompt_tokens) + " tokens) fills the model's " +
                                     std::to_string(model.max_context) + "-token context: no room to generate");
    }
  }
  PENUMBRA_RETURN_IF_ERROR(ValidatePromptLength(c.prompt_tokens, c.max_new_tokens, model));
  c.generated_bound = GeneratedTokensBound(c.prompt_tokens, c.max_new_tokens, model);
  return c;
}

rpc::WorkerGenerateRequest Coordinator::BuildGenerate(const std::string& tenant, const rpc::GenerateRequest& r,
                                                      const Checked& c) const {
  rpc::WorkerGenerateRequest g;
  for (const DocumentView& d : c.docs) {
    // A document after the first without its leading special tokens.
    const bool first = g.documents.empty();
    g.documents.push_back(
        transport::DocumentRef(first ? d.digest : d.digest_after_special, d.tokens - (first ? 0 : d.leading_special)));
  }
  g.prompt = c.question;
  g.cache_namespace = c.docs.empty() ? tenant : c.docs.front().tenant;
  g.max_new_tokens = c.max_new_tokens;
  g.sampling = r.sampling;
  g.deadline_ms = r.deadline_ms;
  g.tenant = tenant;
  // The request's pin, else its first document's.
  g.kv_policy = !r.kv_policy.empty() || c.docs.empty() ? r.kv_policy : c.docs.front().kv_policy;
  g.share_weight = 1.0;
  if (o_.tenants) {
    if (Result<tenants::TenantConfig> t = o_.tenants->Tenant(tenant); t.ok()) g.share_weight = t->weight;
  }
  return g;
}

Status Coordinator::SendGenerate(int w, const rpc::WorkerGenerateRequest& g, const std::vector<DocumentView>& docs,
                                 std::string* wid, bool* by_digest, bool with_ids) {
  const bool held = !docs.empty() &&
                    std::all_of(docs.begin(), docs.end(), [&](const DocumentView& d) { return docs_->Holds(d.id, w); });
  if (held && !with_ids) {
    Status s = workers_->Call(w, "generate", [&](rpc::WorkerClient& c) { c.Generate(*wid, g); });
    if (s.code() != StatusCode::kFailedPrecondition) {
      *by_digest = true;
      if (s.ok()) documents_by_digest_->Increment(static_cast<double>(docs.size()));
      return s;
    }
    // It does not hold one after all (evicted, restarted): sent again with the ids.
    for (const DocumentView& d : docs) docs_->RemoveWorker(d.id, w);
    document_resends_->Increment();
  }
  *by_digest = false;
  if (docs.empty()) return workers_->Call(w, "generate", [&](rpc::WorkerClient& c) { c.Generate(*wid, g); });
  rpc::WorkerGenerateRequest full = g;
  for (size_t i = 0; i < docs.size() && i < full.documents.size(); ++i) {
    const auto skip = static_cast<std::ptrdiff_t>(i == 0 ? 0 : docs[i].leading_special);
    full.documents[i].__set_ids(std::vector<int32_t>(docs[i].ids->begin() + skip, docs[i].ids->end()));
  }
  Status s = workers_->Call(w, "generate", [&](rpc::WorkerClient& c) { c.Generate(*wid, full); });
  if (s.ok()) documents_with_ids_->Increment(static_cast<double>(docs.size()));
  return s;
}

rpc::WorkerGenerateRequest Coordinator::Continuation(const Request& q) const {
  const int64_t made = static_cast<int64_t>(q.ids.size());
  rpc::WorkerGenerateRequest g = q.gen;
  g.prompt.insert(g.prompt.end(), q.ids.begin(), q.ids.end());
  g.max_new_tokens = static_cast<int32_t>(q.gen.max_new_tokens - made);
  g.draws_done = q.gen.draws_done + made;
  if (q.deadline) g.deadline_ms = std::max<int64_t>(1, Left(*q.deadline).count());
  return g;
}

Result<std::shared_ptr<Coordinator::Request>> Coordinator::Find(const std::string& tenant, const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->tenant != tenant) {
    return Status::NotFound("request '" + Excerpt(id, 40) + "' is unknown (or ended more than " +
                            std::to_string(std::chrono::duration_cast<std::chrono::seconds>(o_.keep_finished).count()) +
                            " s ago)");
  }
  return it->second;
}

Status Coordinator::Advance(Request& q, int64_t offset, milliseconds wait) {
  if (q.done || static_cast<int64_t>(q.ids.size()) > offset) return Status::OK();
  auto expire = [&] {
    if (q.deadline && !q.done && Clock::now() >= *q.deadline) {
      Finalize(q, "deadline",
               Status::DeadlineExceeded("the request's deadline passed after " + std::to_string(q.ids.size()) +
                                        " generated tokens"));
    }
  };
  expire();
  if (q.done) return Status::OK();
  if (q.deadline) wait = std::min(wait, Left(*q.deadline));
  // A worker the health checks find unreachable (not one that drains: it
  // finishes what it runs) has lost the request: it goes on elsewhere at
  // once, rather than after a poll to a silent link times out.
  auto unreachable = [&] {
    const WorkerState st = workers_->state(q.worker);
    return !st.healthy && st.error != "draining";
  };
  auto lost = [&](const std::string& why) {
    const std::string what = "worker " + workers_->state(q.worker).endpoint.name + " lost the request: " + why;
    if (!Resume(q, what)) Finalize(q, "error", Status::Unavailable(what));
    return Status::OK();
  };
  if (unreachable()) return lost(workers_->state(q.worker).error);
  rpc::TokenChunk ch;
  const int64_t from = static_cast<int64_t>(q.ids.size()) - q.base;  // the current worker's offset
  // One long poll of the worker for all of its generations (WorkerWatch);
  // a look without waiting asks directly. The worker answers within its
  // wait; the margin stays under a client's (10 s), so a silent worker is
  // noticed here first.
  Status s = wait.count() > 0
                 ? watches_[q.worker]->Wait(q.wid, from, wait, &ch)
                 : workers_->Call(
                       q.worker, "poll", [&](rpc::WorkerClient& c) { c.Poll(ch, q.wid, from, 0); }, kWorkerPollMargin);
  if (!s.ok()) {
    if (s.code() == StatusCode::kDeadlineExceeded) {
      workers_->CheckNow(q.worker);  // no answer in time: is the worker still there?
      if (unreachable()) return lost(s.message());
      expire();  // it is: nothing new in time
      return Status::OK();
    }
    return lost(s.message());
  }
  q.ids.insert(q.ids.end(), ch.ids.begin(), ch.ids.end());
  const int64_t prompt = q.usage.prompt_tokens;
  const double queued = q.usage.queue_seconds, ttft = q.usage.ttft_seconds;
  q.usage = ch.usage;
  q.usage.prompt_tokens = prompt;
  q.usage.generated_tokens = static_cast<int64_t>(q.ids.size());
  if (q.resumes > 0) {  // the first worker's timings are the request's
    if (queued >= 0) q.usage.queue_seconds = queued;
    if (ttft >= 0) q.usage.ttft_seconds = ttft;
  }
  if (!ch.ids.empty() || (ch.done && codec_)) {
    // Only the new ids are decoded (IncrementalText), and only the text they
    // added (with the end of the text before, where a stop string may start)
    // is searched.
    const size_t had = q.text.size();
    if (codec_ && q.detok.Append(*codec_, ch.ids).ok() && (!ch.done || q.detok.Finish(*codec_).ok())) {
      q.text.append(q.detok.text(), std::min(had, q.detok.text().size()), std::string::npos);
    }
    size_t longest = 0;
    for (const std::string& stop : q.stop) longest = std::max(longest, stop.size());
    const size_t from = had >= longest ? had - longest + 1 : 0;
    size_t cut = std::string::npos;
    for (const std::string& stop : q.stop) cut = std::min(cut, q.text.find(stop, from));
    if (cut != std::string::npos) {
      q.text.resize(cut);
      Finalize(q, "stop", Status::OK());  // Release cancels it on the worker
      return Status::OK();
    }
  }
  if (ch.done && q.by_digest && ch.__isset.error_code && ch.error_code == rpc::ErrorCode::FAILED_PRECONDITION &&
      static_cast<int64_t>(q.ids.size()) == q.base) {
    // The worker took the request by digest but no longer holds a document
    // (evicted while it waited): sent again to it with the ids.
    for (const DocumentView& d : q.docs) docs_->RemoveWorker(d.id, q.worker);
    document_resends_->Increment();
    (void)workers_->Call(q.worker, "release", [&](rpc::WorkerClient& c) { c.Release(q.wid); });
    std::string wid;
    bool by_digest = false;
    if (SendGenerate(q.worker, Continuation(q), q.docs, &wid, &by_digest, /*with_ids=*/true).ok()) {
      q.SetWhere(q.worker, wid);
      q.by_digest = false;
      for (const DocumentView& d : q.docs) docs_->AddWorker(d.id, q.worker);  // it captures them now
      JournalMove(q);
      return Status::OK();
    }
  }
  if (ch.done && ch.finish_reason == "error" && ch.__isset.error_code &&
      (ch.error_code == rpc::ErrorCode::UNAVAILABLE || ch.error_code == rpc::ErrorCode::DEADLINE_EXCEEDED) &&
      !workers_->state(q.worker).endpoint.group.empty()) {
    // A group that lost a rank fails its requests at their next step: each
    // goes on elsewhere (another group, or a single worker it fits) from
    // where it was, while the group is formed again.
    workers_->CheckNow(q.worker);
    return lost("its group " + workers_->state(q.worker).endpoint.group +
                " failed: " + (ch.__isset.error_message ? ch.error_message : ch.finish_reason));
  }
  if (ch.done) {
    Status err = Status::OK();
    if (ch.__isset.error_code) {
      rpc::PenumbraError e;
      e.code = ch.error_code;
      e.message = ch.__isset.error_message ? ch.error_message : ch.finish_reason;
      err = transport::FromRpcError(e);
    }
    Finalize(q, ch.finish_reason, err);
  }
  expire();
  return Status::OK();
}

bool Coordinator::Resume(Request& q, const std::string& why) {
  const int64_t made = static_cast<int64_t>(q.ids.size());
  const int64_t left = q.gen.max_new_tokens - made;
  if (q.resumes >= kMaxResumes || left < 1 || q.gen.max_new_tokens < 1) return false;
  if (q.deadline && Clock::now() >= *q.deadline) return false;
  // The same request with what it generated so far as part of its prompt
  // (the documents stay leading documents: another worker attaches them from
  // its cache or a value-store node), the rest of its budget, and its random
  // stream where it was.
  const rpc::WorkerGenerateRequest g = Continuation(q);
  const int dead = q.worker;
  std::vector<int> order;
  bool dead_serves = false;
  for (int w : Route(q.kv_policy, q.docs, q.usage.prompt_tokens + made)) {
    if (w == dead) {
      dead_serves = true;  // it serves again (it lost the generation, e.g. restarted): tried last
    } else {
      order.push_back(w);
    }
  }
  if (dead_serves) order.push_back(dead);
  for (int w : order) {
    std::string wid;
    bool by_digest = false;
    Status s = SendGenerate(w, g, q.docs, &wid, &by_digest);
    if (!s.ok()) continue;
    LOG(WARNING) << "request " << q.id << ": " << why << "; resumed on worker " << workers_->state(w).endpoint.name
                 << " after " << made << " tokens";
    if (dead >= 0) workers_->AddRouted(dead, -1);
    workers_->AddRouted(w, 1);
    for (const DocumentView& d : q.docs) docs_->AddWorker(d.id, w);
    q.SetWhere(w, wid);
    q.by_digest = by_digest;
    q.base = made;
    ++q.resumes;
    resumed_->Increment();
    JournalMove(q);
    return true;
  }
  return false;
}

void Coordinator::Finalize(Request& q, const std::string& reason, const Status& error) {
  if (q.done) return;
  q.done = true;
  q.finish_reason = reason;
  q.error = error;
  q.finished = Clock::now();
  // Forgotten on the worker (cancelled first if it still runs there).
  if (q.worker >= 0) {
    (void)workers_->Call(q.worker, "release", [&](rpc::WorkerClient& c) { c.Release(q.wid); });
    workers_->AddRouted(q.worker, -1);
  }
  q.sequence.Release();
  // The tokens reserved at admission and not generated go back to the
  // tenant's bucket.
  q.tokens.Settle(q.usage.generated_tokens);
  requests_total_->Add({{"tenant", q.tenant}, {"reason", reason}}).Increment();
  prompt_tokens_->Add({{"tenant", q.tenant}}).Increment(static_cast<double>(q.usage.prompt_tokens));
  cached_tokens_->Add({{"tenant", q.tenant}}).Increment(static_cast<double>(q.usage.cached_prompt_tokens));
  generated_tokens_->Add({{"tenant", q.tenant}}).Increment(static_cast<double>(q.usage.generated_tokens));
  const double total = Seconds(q.finished - q.created);
  duration_->Observe(total);
  if (q.usage.ttft_seconds >= 0) ttft_->Observe(q.usage.ttft_seconds);
  if (q.usage.generated_tokens > 1 && q.usage.ttft_seconds >= 0 && total > q.usage.ttft_seconds) {
    tpot_->Observe((total - q.usage.ttft_seconds) / static_cast<double>(q.usage.generated_tokens - 1));
  }
  std::unique_lock<std::mutex> jl(journal_mu_, std::defer_lock);
  if (journal_) jl.lock();
  TenantUsage u;
  {
    std::lock_guard<std::mutex> lk(mu_);
    --running_;
    TenantCounts& c = counts_[q.tenant];
    if (reason == "error" || reason == "deadline") ++c.failed;
    c.prompt += q.usage.prompt_tokens;
    c.cached += q.usage.cached_prompt_tokens;
    c.generated += q.usage.generated_tokens;
    u = TenantUsage{c.requests, c.failed, c.prompt, c.cached, c.generated};
    idle_cv_.notify_all();
  }
  if (journal_) {
    Status s = journal_->Finish(q.id, q.tenant, u);
    if (!s.ok()) {
      journal_errors_->Increment();
      LOG(ERROR) << "request " << q.id << ": its end is not journalled (a restart takes it up again; tenant "
                 << q.tenant << "'s usage since the last write is lost): " << s;
    }
  }
}

void Coordinator::ToChunk(const Request& q, int64_t offset, rpc::GenerateChunk* out) const {
  out->request_id = q.id;
  out->ids.assign(q.ids.begin() + offset, q.ids.end());
  out->text = q.text;
  if (!q.done) {
    // The streamed text only grows: an ending that may still become a stop
    // string, or a character whose bytes have not all come (decoded as
    // U+FFFD for now), waits for the next chunk.
    size_t keep = out->text.size();
    static const std::string kReplacement = "\xEF\xBF\xBD";
    if (keep >= 3 && out->text.compare(keep - 3, 3, kReplacement) == 0) keep -= 3;
    for (const std::string& stop : q.stop) {
      for (size_t n = std::min(stop.size() - 1, keep); n > 0; --n) {
        if (out->text.compare(keep - n, n, stop, 0, n) == 0) {
          keep -= n;
          break;
        }
      }
    }
    out->text.resize(keep);
  }
  out->offset = offset;
  out->done = q.done;
  out->finish_reason = q.finish_reason;
  if (!q.error.ok()) {
    const rpc::PenumbraError e = transport::ToRpcError(q.error);
    out->__set_error_code(e.code);
    out->__set_error_message(e.message);
  }
  out->usage = q.usage;
}

void Coordinator::Generate(std::string& out, const rpc::GenerateRequest& request) {
  out = OrThrow(DoGenerate(request))->id;
}

void Coordinator::Poll(rpc::GenerateChunk& out, const std::string& api_key, const std::string& request_id,
                       int64_t offset, int32_t wait_ms) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateWaitMs(wait_ms, o_.limits));
  Check(ValidateId("request_id", request_id, o_.limits));
  std::shared_ptr<Request> q = OrThrow(Find(tenant, request_id));
  std::lock_guard<std::mutex> lk(q->mu);
  q->last_poll = Clock::now();
  if (offset < 0) Throw(Status::InvalidArgument("offset must be >= 0, got " + std::to_string(offset)));
  // A reattached generation's tokens are polled again from its worker: an
  // offset past what is known here waits for them (up to wait_ms).
  if (q->recovered && offset > static_cast<int64_t>(q->ids.size()) && !q->done) {
    const Clock::time_point until = Clock::now() + milliseconds(wait_ms);
    while (!q->done && offset > static_cast<int64_t>(q->ids.size()) && Clock::now() < until) {
      Status s = Advance(*q, static_cast<int64_t>(q->ids.size()), Left(until));
      if (!s.ok()) Throw(s);
    }
  }
  if (q->recovered && !q->done && offset > static_cast<int64_t>(q->ids.size())) {
    // Not made again yet (it restarted on another worker): nothing new.
    ToChunk(*q, static_cast<int64_t>(q->ids.size()), &out);
    out.offset = offset;
    return;
  }
  if (offset > static_cast<int64_t>(q->ids.size())) {
    Throw(Status::InvalidArgument("offset " + std::to_string(offset) + " is outside [0, " +
                                  std::to_string(q->ids.size()) + "], the tokens made so far"));
  }
  Status s = Advance(*q, offset, milliseconds(wait_ms));
  if (!s.ok()) Throw(s);
  ToChunk(*q, offset, &out);
}

void Coordinator::Cancel(const std::string& api_key, const std::string& request_id) {
  const std::string tenant = OrThrow(Tenant(api_key));
  Check(ValidateId("request_id", request_id, o_.limits));
  std::shared_ptr<Request> q = OrThrow(Find(tenant, request_id));
  Status s;
  {
    std::lock_guard<std::mutex> lk(q->mu);
    if (q->done) return;
    s = CancelOnWorker(q->worker, q->wid);
  }
  if (!s.ok()) Throw(s);
}

Status Coordinator::CancelOnWorker(int w, const std::string& wid) {
  Status s = workers_->Call(w, "cancel", [&](rpc::WorkerClient& c) { c.Cancel(wid); });
  return s.code() == StatusCode::kNotFound ? Status::OK() : s;
}

void Coordinator::Complete(rpc::GenerateChunk& out, const rpc::GenerateRequest& request) {
  std::shared_ptr<Request> q = OrThrow(DoGenerate(request));
  std::lock_guard<std::mutex> lk(q->mu);
  while (!q->done) {
    // Short waits: a client that hangs up is noticed within one, and its
    // generation cancelled (nobody would read the answer).
    if (transport::CurrentPeerHungUp()) {
      hangups_->Increment();
      LOG(INFO) << "request " << q->id << ": the client of Complete closed its connection after " << q->ids.size()
                << " tokens; cancelled";
      (void)CancelOnWorker(q->worker, q->wid);
      Finalize(*q, "cancelled", Status::Cancelled("the client closed its connection"));
      Throw(Status::Cancelled("the client closed its connection"));
    }
    Status s = Advance(*q, static_cast<int64_t>(q->ids.size()), milliseconds(1000));
    if (!s.ok()) Throw(s);
  }
  if (q->finish_reason == "error" || q->finish_reason == "deadline") Throw(q->error);
  ToChunk(*q, 0, &out);
}

void Coordinator::DropExpired() {
  std::vector<std::shared_ptr<Request>> unpolled;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const Clock::time_point now = Clock::now();
    if (now - last_sweep_ < std::chrono::seconds(1)) return;
    last_sweep_ = now;
    for (auto it = requests_.begin(); it != requests_.end();) {
      Request& q = *it->second;
      std::unique_lock<std::mutex> ql(q.mu, std::try_to_lock);
      if (ql.owns_lock() && q.done && now - q.finished > o_.keep_finished) {
        ql.unlock();
        it = requests_.erase(it);
        continue;
      }
      if (ql.owns_lock() && !q.done) unpolled.push_back(it->second);
      ++it;
    }
  }
  // Streaming generations nobody polls any more are cancelled (a job's
  // items and Complete calls hold their mu while they wait: never here).
  for (auto& q : unpolled) {
    std::unique_lock<std::mutex> ql(q->mu, std::try_to_lock);
    if (!ql.owns_lock() || q->done || q->job_item || Clock::now() - q->last_poll <= o_.abandon_timeout) continue;
    abandoned_->Increment();
    LOG(INFO) << "request " << q->id << " (tenant " << q->tenant << "): not polled for "
              << std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - q->last_poll).count()
              << " s; cancelled";
    (void)CancelOnWorker(q->worker, q->wid);
    Finalize(*q, "cancelled",
             Status::Cancelled(
                 "no client polled the request for " +
                 std::to_string(std::chrono::duration_cast<std::chrono::seconds>(o_.abandon_timeout).count()) + " s"));
  }
  // Generations nobody polls still end on their worker: learn of it, so they
  // stop counting as running.
  for (auto& q : unpolled) {
    std::unique_lock<std::mutex> ql(q->mu, std::try_to_lock);
    if (ql.owns_lock()) (void)Advance(*q, static_cast<int64_t>(q->ids.size()), milliseconds(0));
  }
}

}  // namespace penumbra::coordinator
