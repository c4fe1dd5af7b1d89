#include "worker/service/worker_server.h"

#include <cmath>
#include <functional>
#include <limits>

#include <glog/logging.h>

#include "common/crypto.h"

namespace penumbra::service {
namespace {

[[noreturn]] void Throw(const Status& s) { throw transport::ToRpcError(s); }

}  // namespace

Status WorkerLeaseOptions::Validate() const {
  if (lease < std::chrono::milliseconds(100) || lease > std::chrono::hours(24)) {
    return Status::InvalidArgument("lease must be in [100 ms, 24 h], got " + std::to_string(lease.count()) + " ms");
  }
  return Status::OK();
}

Status ValidateOwnerId(const std::string& owner_id) {
  if (owner_id.size() > 64 ||
      owner_id.find_first_not_of("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-") !=
          std::string::npos) {
    return Status::InvalidArgument("owner_id must be at most 64 characters of [0-9A-Za-z_-], got " +
                                   std::to_string(owner_id.size()) + " characters");
  }
  return Status::OK();
}

Status AppendDocuments(const std::vector<rpc::WorkerDocument>& documents, int64_t max_context, GenerationRequest* g) {
  // Sizes before anything is allocated: the documents' lengths are bounded
  // by the model's context (ids not sent read as 0s, allocated here).
  if (static_cast<int64_t>(documents.size()) > max_context) {
    return Status::InvalidArgument(std::to_string(documents.size()) + " documents: more than the model's " +
                                   std::to_string(max_context) + "-token context holds");
  }
  int64_t total = 0;
  bool sent = false;  // a document with ids came already
  for (size_t i = 0; i < documents.size(); ++i) {
    const rpc::WorkerDocument& d = documents[i];
    const std::string name = "documents[" + std::to_string(i) + "]";
    if (d.tokens <= 0 || d.tokens > max_context - total) {
      return Status::InvalidArgument(name + ".tokens must be in [1, " + std::to_string(max_context - total) +
                                     "] (the model's context), got " + std::to_string(d.tokens));
    }
    total += d.tokens;
    if (d.__isset.ids && static_cast<int64_t>(d.ids.size()) != d.tokens) {
      return Status::InvalidArgument(name + " has " + std::to_string(d.ids.size()) + " ids for " +
                                     std::to_string(d.tokens) + " tokens");
    }
    if (sent && !d.__isset.ids) {
      return Status::InvalidArgument(name +
                                     " has no ids after a document that has: the documents named by digest "
                                     "alone lead the prompt");
    }
    sent = sent || d.__isset.ids;
    Result<Hash128> digest = Hash128FromBytes(d.digest);
    if (!digest.ok()) return digest.status().WithContext(name + ".digest");
    g->document_digests.push_back(*digest);
  }
  g->prompt.reserve(static_cast<size_t>(total));
  for (const rpc::WorkerDocument& d : documents) {
    if (d.__isset.ids) {
      g->prompt.insert(g->prompt.end(), d.ids.begin(), d.ids.end());
    } else {
      g->prompt.resize(g->prompt.size() + static_cast<size_t>(d.tokens), 0);  // held: never read
      g->ids_from = static_cast<int64_t>(g->prompt.size());
    }
    g->document_ends.push_back(static_cast<int64_t>(g->prompt.size()));
  }
  return Status::OK();
}

Result<SubmitOptions> SubmitOptionsFromRpc(int64_t deadline_ms, double share_weight, const std::string& tenant,
                                           const std::string& owner_id) {
  PENUMBRA_RETURN_IF_ERROR(ValidateOwnerId(owner_id));
  if (deadline_ms < 0 || deadline_ms > WorkerHandler::kMaxDeadlineMs) {
    return Status::InvalidArgument("deadline_ms must be in [0, " + std::to_string(WorkerHandler::kMaxDeadlineMs) +
                                   "], got " + std::to_string(deadline_ms));
  }
  if (!(share_weight > 0) || share_weight > 1e6) {
    return Status::InvalidArgument("share_weight must be in (0, 1e6], got " + std::to_string(share_weight));
  }
  SubmitOptions o;
  o.share_weight = share_weight;
  o.tenant = tenant;
  if (deadline_ms > 0) o.deadline = Clock::now() + std::chrono::milliseconds(deadline_ms);
  return o;
}

Result<GenerationRequest> FromRpc(const rpc::WorkerGenerateRequest& r, int64_t max_context) {
  GenerationRequest g;
  PENUMBRA_RETURN_IF_ERROR(AppendDocuments(r.documents, max_context, &g));
  if (static_cast<int64_t>(r.prompt.size()) > max_context) {
    return Status::InvalidArgument("prompt of " + std::to_string(r.prompt.size()) + " tokens: more than the model's " +
                                   std::to_string(max_context) + "-token context");
  }
  g.prompt.insert(g.prompt.end(), r.prompt.begin(), r.prompt.end());
  g.cache_namespace = r.cache_namespace;
  g.max_new_tokens = r.max_new_tokens;
  // Doubles narrowed to the engine's floats: a value no float holds (NaN,
  // out of range) is refused here, the ranges themselves are
  // SamplingOptions::Validate's.
  auto as_float = [](double x, const char* name) -> Result<float> {
    if (!(std::abs(x) <= std::numeric_limits<float>::max())) {
      return Status::InvalidArgument(std::string("sampling.") + name + " must be a finite number, got " +
                                     std::to_string(x));
    }
    return static_cast<float>(x);
  };
  PENUMBRA_ASSIGN_OR_RETURN(g.sampling.temperature, as_float(r.sampling.temperature, "temperature"));
  PENUMBRA_ASSIGN_OR_RETURN(g.sampling.top_p, as_float(r.sampling.top_p, "top_p"));
  g.sampling.top_k = r.sampling.top_k;
  if (r.sampling.seed < 0) return Status::InvalidArgument("sampling.seed must be >= 0");
  g.sampling.seed = static_cast<uint64_t>(r.sampling.seed);
  g.stop_ids = r.stop_ids;
  g.draws_done = r.draws_done;
  g.kv_policy = r.kv_policy;
  return g;
}

Result<GenerationRequest> FromRpc(const rpc::WorkerPutRequest& r, int64_t max_context) {
  GenerationRequest g;
  if (r.documents.empty()) return Status::InvalidArgument("a put names no document");
  PENUMBRA_RETURN_IF_ERROR(AppendDocuments(r.documents, max_context, &g));
  g.cache_namespace = r.cache_namespace;
  g.kv_policy = r.kv_policy;
  g.max_new_tokens = 0;  // prefill only: factored into the document cache
  return g;
}

void ToRpc(const RequestUpdate& u, rpc::WorkerPutProgress* out) {
  out->done = u.done;
  out->finish_reason = u.finish_reason;
  if (!u.error.ok()) {
    const rpc::PenumbraError e = transport::ToRpcError(u.error);
    out->__set_error_code(e.code);
    out->__set_error_message(e.message);
  }
  out->factored_tokens = u.prefilled_tokens;
  out->tokens = u.prompt_tokens;
  out->cached_tokens = u.cached_prompt_tokens;
  out->queue_seconds = u.queue_seconds;
}

void ToRpc(const RequestUpdate& u, rpc::TokenChunk* out) {
  out->ids = u.ids;
  out->offset = u.offset;
  out->done = u.done;
  out->finish_reason = u.finish_reason;
  if (!u.error.ok()) {
    const rpc::PenumbraError e = transport::ToRpcError(u.error);
    out->__set_error_code(e.code);
    out->__set_error_message(e.message);
  }
  out->usage.prompt_tokens = u.prompt_tokens;
  out->usage.cached_prompt_tokens = u.cached_prompt_tokens;
  out->usage.generated_tokens = u.generated_tokens;
  out->usage.queue_seconds = u.queue_seconds;
  out->usage.ttft_seconds = u.ttft_seconds;
  out->usage.prefilled_tokens = u.prefilled_tokens;
}

namespace {

// The owner a handle is bound to: the verified peer, or no one in
// particular without TLS (a loopback development setup).
std::string Owner() {
  const transport::PeerIdentity& p = transport::CurrentPeer();
  return p.verified ? p.ToString() : "";
}

Status UnknownHandle(const std::string& handle) {
  // The handle is not echoed past its first characters (it is a capability).
  return Status::NotFound("request " + handle.substr(0, 8) + "... is unknown");
}

}  // namespace

Result<uint64_t> WorkerHandler::Lookup(const std::string& handle) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end() || it->second.owner != Owner()) return UnknownHandle(handle);
  return it->second.id;
}

void WorkerHandler::Forget(const std::string& handle) {
  std::lock_guard<std::mutex> lk(mu_);
  handles_.erase(handle);
}

void WorkerHandler::Sweep() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = handles_.begin(); it != handles_.end();) {
    it = s_->Contains(it->second.id) ? std::next(it) : handles_.erase(it);
  }
  since_sweep_ = 0;
}

WorkerHandler::WorkerHandler(Scheduler* scheduler, WorkerIdentity identity, WorkerLeaseOptions lease,
                             GroupMember* group)
    : s_(scheduler), id_(std::move(identity)), group_(group), lease_(lease) {
  lease_thread_ = std::thread([this] { LeaseLoop(); });
}

WorkerHandler::~WorkerHandler() {
  {
    std::lock_guard<std::mutex> lk(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (lease_thread_.joinable()) lease_thread_.join();
}

void WorkerHandler::LeaseLoop() {
  // Looks a few times per lease, so a generation outlives its owner by at
  // most the lease and a quarter of it.
  const auto period = std::max(std::chrono::milliseconds(25), lease_.lease / 4);
  std::unique_lock<std::mutex> lk(stop_mu_);
  while (!stop_cv_.wait_for(lk, period, [this] { return stop_; })) {
    lk.unlock();
    ExpireLeases(Clock::now());
    lk.lock();
  }
}

void WorkerHandler::RenewLocked(const std::string& lease) {
  if (!lease.empty()) renewed_[lease] = Clock::now();
}

void WorkerHandler::ExpireLeases(Clock::time_point now) {
  std::vector<std::pair<std::string, uint64_t>> ended;  // handle, scheduler id
  std::vector<std::string> owners;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = renewed_.begin(); it != renewed_.end();) {
      if (now - it->second <= lease_.lease) {
        ++it;
        continue;
      }
      owners.push_back(it->first);
      for (auto h = handles_.begin(); h != handles_.end();) {
        if (h->second.lease == it->first) {
          ended.emplace_back(h->first, h->second.id);
          h = handles_.erase(h);
        } else {
          ++h;
        }
      }
      it = renewed_.erase(it);
    }
  }
  int64_t cancelled = 0;
  for (const auto& [handle, id] : ended) {
    // Running ones are cancelled and forgotten when they end; finished
    // answers nobody will read are dropped.
    Result<RequestUpdate> u = s_->Poll(id, 0, std::chrono::milliseconds(0));
    if (u.ok() && !u->done) ++cancelled;
    (void)s_->Release(id);
  }
  lease_expired_ += cancelled;
  for (const std::string& o : owners) {
    const size_t nl = o.rfind('\n');
    LOG(WARNING) << "worker: the lease of owner " << o.substr(nl + 1) << " ("
                 << (o.substr(0, nl).empty() ? std::string("no certificate") : o.substr(0, nl)) << ") expired after "
                 << lease_.lease.count() << " ms without a renewal: " << cancelled << " generations cancelled, "
                 << ended.size() << " handles forgotten";
  }
}

void WorkerHandler::Renew(std::vector<std::string>& out, const std::string& owner_id) {
  Status s = ValidateOwnerId(owner_id);
  if (s.ok() && owner_id.empty()) s = Status::InvalidArgument("owner_id is empty");
  if (!s.ok()) Throw(s);
  const std::string owner = Owner(), lease = LeaseKey(owner, owner_id);
  out.clear();
  std::vector<std::pair<std::string, uint64_t>> mine;
  {
    std::lock_guard<std::mutex> lk(mu_);
    RenewLocked(lease);
    for (const auto& [handle, e] : handles_) {
      if (e.lease == lease) mine.emplace_back(handle, e.id);
    }
  }
  for (const auto& [handle, id] : mine) {
    if (s_->Contains(id)) out.push_back(handle);
  }
}

std::string WorkerHandler::Submit(Result<GenerationRequest> g, Result<SubmitOptions> o, const std::string& owner_id) {
  if (!g.ok()) Throw(g.status());
  if (!o.ok()) Throw(o.status());
  // The request against the model (ValidateGenerationRequest: ids, lengths,
  // documents and their digests, sampling) is the scheduler's check.
  Result<uint64_t> id = s_->Submit(std::move(*g), *o);
  if (!id.ok()) Throw(id.status());
  std::string handle = RandomHandle();
  bool sweep = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const std::string owner = Owner();
    handles_[handle] = Entry{*id, owner, LeaseKey(owner, owner_id)};
    RenewLocked(LeaseKey(owner, owner_id));
    sweep = ++since_sweep_ >= 1024;
  }
  if (sweep) Sweep();
  return handle;
}

namespace {

// Either request kind's own fields, as the control API defines them.
template <class R>
Result<SubmitOptions> OptionsOf(const R& r) {
  return SubmitOptionsFromRpc(r.deadline_ms, r.share_weight, r.tenant, r.owner_id);
}

}  // namespace

void WorkerHandler::CheckServing() const {
  if (group_ == nullptr) return;
  if (Status s = group_->Serving(); !s.ok()) Throw(s);
}

void WorkerHandler::Generate(std::string& handle, const rpc::WorkerGenerateRequest& request) {
  CheckServing();
  handle = Submit(FromRpc(request, id_.max_context), OptionsOf(request), request.owner_id);
}

void WorkerHandler::PutDocument(std::string& handle, const rpc::WorkerPutRequest& request) {
  CheckServing();
  handle = Submit(FromRpc(request, id_.max_context), OptionsOf(request), request.owner_id);
}

RequestUpdate WorkerHandler::Await(
    const std::string& handle, int32_t wait_ms,
    const std::function<Result<RequestUpdate>(uint64_t, std::chrono::milliseconds)>& wait) {
  if (wait_ms < 0 || wait_ms > kMaxWaitMs) {
    Throw(Status::InvalidArgument("wait_ms must be in [0, " + std::to_string(kMaxWaitMs) + "], got " +
                                  std::to_string(wait_ms)));
  }
  Result<uint64_t> id = Lookup(handle);
  if (!id.ok()) Throw(id.status());
  Result<RequestUpdate> u = wait(*id, std::chrono::milliseconds(wait_ms));
  if (!u.ok()) {
    if (u.status().code() == StatusCode::kNotFound) Forget(handle);
    Throw(u.status().code() == StatusCode::kNotFound ? UnknownHandle(handle) : u.status());
  }
  return std::move(*u);
}

void WorkerHandler::WaitPut(rpc::WorkerPutProgress& out, const std::string& handle, int64_t factored_tokens,
                            int32_t wait_ms) {
  ToRpc(Await(handle, wait_ms,
              [&](uint64_t id, std::chrono::milliseconds wait) { return s_->WaitProgress(id, factored_tokens, wait); }),
        &out);
}

void WorkerHandler::Poll(rpc::TokenChunk& out, const std::string& handle, int64_t offset, int32_t wait_ms) {
  if (offset < 0) Throw(Status::InvalidArgument("offset must be >= 0, got " + std::to_string(offset)));
  ToRpc(Await(handle, wait_ms, [&](uint64_t id, std::chrono::milliseconds wait) { return s_->Poll(id, offset, wait); }),
        &out);
}

void WorkerHandler::PollMany(std::vector<rpc::TokenChunk>& out, const std::vector<rpc::WorkerPollTarget>& targets,
                             int32_t wait_ms) {
  if (wait_ms < 0 || wait_ms > kMaxWaitMs) {
    Throw(Status::InvalidArgument("wait_ms must be in [0, " + std::to_string(kMaxWaitMs) + "], got " +
                                  std::to_string(wait_ms)));
  }
  if (targets.size() > kMaxPollTargets) {
    Throw(Status::InvalidArgument(std::to_string(targets.size()) + " targets: at most " +
                                  std::to_string(kMaxPollTargets)));
  }
  // Each target's own error goes in its chunk; the others are polled.
  std::vector<Status> errors(targets.size());
  std::vector<std::pair<uint64_t, int64_t>> polled;
  std::vector<size_t> where;
  for (size_t i = 0; i < targets.size(); ++i) {
    Result<uint64_t> id = Lookup(targets[i].handle);
    if (!id.ok()) {
      errors[i] = id.status();
    } else {
      polled.emplace_back(*id, targets[i].offset);
      where.push_back(i);
    }
  }
  std::vector<Result<RequestUpdate>> updates =
      polled.empty() ? std::vector<Result<RequestUpdate>>{} : s_->PollMany(polled, std::chrono::milliseconds(wait_ms));
  out.assign(targets.size(), rpc::TokenChunk());
  for (size_t k = 0; k < where.size(); ++k) {
    if (updates[k].ok()) {
      ToRpc(*updates[k], &out[where[k]]);
    } else {
      if (updates[k].status().code() == StatusCode::kNotFound) Forget(targets[where[k]].handle);
      errors[where[k]] = updates[k].status().code() == StatusCode::kNotFound ? UnknownHandle(targets[where[k]].handle)
                                                                             : updates[k].status();
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (errors[i].ok()) continue;
    const rpc::PenumbraError e = transport::ToRpcError(errors[i]);
    out[i].offset = targets[i].offset;
    out[i].done = false;  // not done, yet an error: the poll of it failed (PollMany's contract)
    out[i].__set_error_code(e.code);
    out[i].__set_error_message(e.message);
  }
}

void WorkerHandler::Cancel(const std::string& handle) {
  Result<uint64_t> id = Lookup(handle);
  if (!id.ok()) Throw(id.status());
  Status s = s_->Cancel(*id);
  if (s.code() == StatusCode::kNotFound) Forget(handle);
  if (!s.ok()) Throw(s.code() == StatusCode::kNotFound ? UnknownHandle(handle) : s);
}

void WorkerHandler::Release(const std::string& handle) {
  Result<uint64_t> id = Lookup(handle);
  if (!id.ok()) Throw(id.status());
  Status s = s_->Release(*id);
  Forget(handle);
  if (!s.ok()) Throw(s.code() == StatusCode::kNotFound ? UnknownHandle(handle) : s);
}

int32_t WorkerHandler::ForgetDocuments(const std::vector<rpc::WorkerDocument>& documents,
                                       const std::string& cache_namespace) {
  CheckServing();
  // Named by digest alone: the ids, when sent, are not needed.
  std::vector<rpc::WorkerDocument> refs = documents;
  for (rpc::WorkerDocument& d : refs) {
    d.ids.clear();
    d.__isset.ids = false;
  }
  GenerationRequest g;
  Status s =
      refs.empty() ? Status::InvalidArgument("no document to forget") : AppendDocuments(refs, id_.max_context, &g);
  if (!s.ok()) Throw(s);
  g.cache_namespace = cache_namespace;
  g.max_new_tokens = 0;
  int dropped = 0;
  s = s_->RunOnLoop([&](Runtime& rt) -> Status {
    PENUMBRA_RETURN_IF_ERROR(rt.Validate({g}));  // the checks of a put of these documents
    PENUMBRA_ASSIGN_OR_RETURN(dropped, rt.ForgetPrefixes(g));
    return Status::OK();
  });
  if (!s.ok()) Throw(s);
  return dropped;
}

void WorkerHandler::Health(rpc::WorkerHealth& out) {
  out.serving = s_->accepting();
  out.model = id_.model;
  out.backend = id_.backend;
  out.kv_policy = id_.kv_policy;
  out.kv_forms = id_.kv_forms;
  out.max_context = id_.max_context;
  out.vocab_size = id_.vocab_size;
  out.eos_ids = id_.eos_ids;
  out.device_bytes_per_token = id_.device_bytes_per_token;
  if (group_ != nullptr) {
    out.group = group_->State();
    out.__isset.group = true;
  }
}

void WorkerHandler::JoinGroup(std::string& rendezvous, const rpc::WorkerJoinGroup& join) {
  if (group_ == nullptr) Throw(Status::FailedPrecondition("this worker is in no group (no --group)"));
  Result<std::string> r = group_->Join(join);
  if (!r.ok()) Throw(r.status());
  rendezvous = std::move(*r);
}

void WorkerHandler::Stats(rpc::WorkerStats& out) {
  const SchedulerStats s = s_->stats();
  out.submitted = s.submitted;
  out.finished = s.finished;
  out.failed = s.failed;
  out.cancelled = s.cancelled;
  out.queued = s.queued;
  out.prefilling = s.prefilling;
  out.decoding = s.decoding;
  out.decode_steps = s.decode_steps;
  out.interleaved_decode_steps = s.interleaved_decode_steps;
  out.prompt_tokens = s.prompt_tokens;
  out.cached_prompt_tokens = s.cached_prompt_tokens;
  out.generated_tokens = s.generated_tokens;
  out.admission_waits = s.admission_waits;
  out.prefill_piece_max_seconds = s.prefill_piece_max_seconds;
  out.memory_free_bytes = s.memory_free_bytes;
  out.lease_expired = lease_expired();
  out.documents_stored = s.documents.stored;
  out.capacity_context_tokens = s.capacity.context_tokens;
  out.capacity_held = s.capacity.held;
  out.capacity_more = s.capacity.more;
  out.capacity_limit = s.capacity.limit;
  out.sequence_device_bytes = static_cast<int64_t>(s.capacity.per_sequence.device);
  out.sequence_host_bytes = static_cast<int64_t>(s.capacity.per_sequence.host);
  out.last_wait_reason = s.last_wait_reason;
  out.last_wait_batch = s.last_wait_batch;
}

Result<std::unique_ptr<WorkerServer>> WorkerServer::Start(Scheduler* scheduler, WorkerIdentity identity,
                                                          const transport::ThriftServerOptions& options,
                                                          WorkerLeaseOptions lease, GroupMember* group) {
  PENUMBRA_RETURN_IF_ERROR(lease.Validate());
  auto handler = std::make_shared<WorkerHandler>(scheduler, std::move(identity), lease, group);
  auto processor = std::make_shared<rpc::WorkerProcessor>(handler);
  auto w = std::unique_ptr<WorkerServer>(new WorkerServer());
  w->handler_ = handler;
  PENUMBRA_ASSIGN_OR_RETURN(w->server_, transport::ThriftServer::Start(processor, options));
  return w;
}

}  // namespace penumbra::service
