#include "worker/service/scheduler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include <glog/logging.h>

#include "worker/engine/document_keys.h"

namespace penumbra::service {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// How long the idle loop sleeps between looks at deadlines and kept answers.
constexpr std::chrono::milliseconds kIdleTick{50};
// How often the loop samples its device's free memory (a query of the
// driver: not on every step).
constexpr std::chrono::seconds kMemorySampleEvery{1};

}  // namespace

Status SchedulerOptions::Validate() const {
  if (max_batch < 1)
    return Status::InvalidArgument("scheduler.max_batch must be >= 1, got " + std::to_string(max_batch));
  if (prefill_tokens_per_step < 1) {
    return Status::InvalidArgument("scheduler.prefill_tokens_per_step must be >= 1, got " +
                                   std::to_string(prefill_tokens_per_step));
  }
  if (max_queue < 1)
    return Status::InvalidArgument("scheduler.max_queue must be >= 1, got " + std::to_string(max_queue));
  if (keep_finished.count() < 0) return Status::InvalidArgument("scheduler.keep_finished must be >= 0");
  if (share_window.count() < 0) return Status::InvalidArgument("scheduler.share_window must be >= 0");
  if (capacity_context_tokens < 0 || capacity_context_tokens > (int64_t{1} << 31)) {
    return Status::InvalidArgument("scheduler.capacity_context_tokens must be in [0, 2^31], got " +
                                   std::to_string(capacity_context_tokens));
  }
  if (store_fetch_threads < 1 || store_fetch_threads > 256) {
    return Status::InvalidArgument("scheduler.store_fetch_threads must be in [1, 256], got " +
                                   std::to_string(store_fetch_threads));
  }
  return Status::OK();
}

Result<std::unique_ptr<Scheduler>> Scheduler::Create(Runtime* runtime, const SchedulerOptions& options) {
  PENUMBRA_RETURN_IF_ERROR(options.Validate());
  if (runtime == nullptr) return Status::InvalidArgument("scheduler: no runtime");
  return std::unique_ptr<Scheduler>(new Scheduler(runtime, options));
}

Scheduler::Scheduler(Runtime* runtime, const SchedulerOptions& options) : rt_(runtime), o_(options) {
  for (int i = 0; i < o_.store_fetch_threads; ++i) io_threads_.emplace_back([this] { FetchLoop(); });
  thread_ = std::thread([this] { Loop(); });
}

void Scheduler::FetchLoop() {
  BindThread();
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> l(io_mu_);
      io_cv_.wait(l, [&] { return io_stop_ || !io_jobs_.empty(); });
      if (io_stop_) return;  // the requests waiting are cancelled by Stop
      job = std::move(io_jobs_.front());
      io_jobs_.pop_front();
    }
    job();
  }
}

void Scheduler::StartFetches() {
  std::vector<std::shared_ptr<Request>> plan;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& r : queue_) {
      if (r->fetch == Request::Fetch::kUnplanned) plan.push_back(r);
    }
  }
  if (plan.empty()) return;
  std::vector<std::vector<StoreLookup>> lookups(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) lookups[i] = rt_->StoreLookups(plan[i]->req);  // the runtime's thread
  std::vector<std::function<void()>> jobs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < plan.size(); ++i) {
      const std::shared_ptr<Request>& r = plan[i];
      r->prefetched = std::make_shared<PrefetchedDocuments>();
      if (lookups[i].empty() || r->done) {
        r->fetch = Request::Fetch::kReady;
        continue;
      }
      r->fetch = Request::Fetch::kFetching;
      // The job writes into its own reference (Finish may drop the request's).
      jobs.push_back([this, r, pf = r->prefetched, l = std::move(lookups[i])] {
        PrefetchedDocuments p = rt_->FetchStoredPrefixes(l);  // the store only: thread-safe
        if (p.failures > 0) {
          LOG(WARNING) << "scheduler: request " << r->id << ": its stored document was not read (prefilled "
                       << "instead): " << p.last_failure;
        }
        {
          std::lock_guard<std::mutex> lk(mu_);
          *pf = std::move(p);
          r->fetch = Request::Fetch::kReady;
        }
        work_cv_.notify_all();
      });
    }
  }
  if (jobs.empty()) return;
  {
    std::lock_guard<std::mutex> l(io_mu_);
    for (auto& j : jobs) io_jobs_.push_back(std::move(j));
  }
  io_cv_.notify_all();
}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    // A read in flight ends by its deadline; the jobs not started are dropped.
    std::lock_guard<std::mutex> l(io_mu_);
    io_stop_ = true;
    io_jobs_.clear();
  }
  io_cv_.notify_all();
  for (auto& t : io_threads_) {
    if (t.joinable()) t.join();
  }
  // The loop has stopped: the runtime is this thread's now.
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& t : tasks_) t(*rt_);  // their callers are waiting
  tasks_.clear();
  for (auto* list : {&queue_, &prefilling_}) {
    for (auto& r : *list) Finish(*r, "cancelled", Status::Cancelled("the worker stopped"));
    list->clear();
  }
  for (auto& r : decoding_) Finish(*r, "cancelled", Status::Cancelled("the worker stopped"));
  decoding_.clear();
  done_cv_.notify_all();
}

Result<uint64_t> Scheduler::Submit(GenerationRequest request, const SubmitOptions& options) {
  PENUMBRA_RETURN_IF_ERROR(rt_->Validate({request}));  // reads the model's config and the policy's forms only
  // The documents' digests once, here (off the loop), not at each lookup.
  if (request.document_digests.empty() && !request.document_ends.empty()) {
    request.document_digests = DocumentDigests(request.prompt, request.document_ends);
  }
  auto r = std::make_shared<Request>();
  r->req = std::move(request);
  r->opts = options;
  r->submitted = Clock::now();
  r->rng.seed(r->req.sampling.seed);
  r->rng.discard(static_cast<unsigned long long>(std::max<int64_t>(0, r->req.draws_done)));  // one per token
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ || draining_) return Status::Unavailable("the scheduler is draining: not accepting requests");
    if (static_cast<int>(queue_.size()) >= o_.max_queue) {
      return Status::ResourceExhausted("the scheduler's queue is full (" + std::to_string(o_.max_queue) +
                                       " requests waiting); retry later");
    }
    r->id = next_id_++;
    requests_[r->id] = r;
    queue_.push_back(r);
    TenantActivity& a = activity_[ShareKey(*r)];
    a.last = r->submitted;
    a.weight = r->opts.share_weight;
    if (activity_.size() > 4096) {  // namespaces long idle are forgotten
      std::erase_if(activity_, [&](const auto& kv) { return r->submitted - kv.second.last > o_.share_window; });
    }
    ++stats_.submitted;
  }
  work_cv_.notify_all();
  return r->id;
}

Result<RequestUpdate> Scheduler::Poll(uint64_t id, int64_t offset, std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return Status::NotFound("request " + std::to_string(id) + " is unknown");
  std::shared_ptr<Request> r = it->second;
  if (offset < 0 || offset > static_cast<int64_t>(r->ids.size())) {
    return Status::InvalidArgument("offset " + std::to_string(offset) + " is past the " +
                                   std::to_string(r->ids.size()) + " tokens made so far");
  }
  done_cv_.wait_for(lk, wait, [&] { return r->done || static_cast<int64_t>(r->ids.size()) > offset; });
  return Snapshot(*r, offset);
}

std::vector<Result<RequestUpdate>> Scheduler::PollMany(const std::vector<std::pair<uint64_t, int64_t>>& targets,
                                                       std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] {
    for (const auto& [id, offset] : targets) {
      auto it = requests_.find(id);
      if (it == requests_.end() || it->second->done || static_cast<int64_t>(it->second->ids.size()) != offset) {
        return true;  // unknown, ended, tokens past the offset (or an offset past them: an error to report)
      }
    }
    return false;
  };
  done_cv_.wait_for(lk, wait, ready);
  std::vector<Result<RequestUpdate>> out;
  out.reserve(targets.size());
  for (const auto& [id, offset] : targets) {
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      out.emplace_back(Status::NotFound("request " + std::to_string(id) + " is unknown"));
    } else if (offset < 0 || offset > static_cast<int64_t>(it->second->ids.size())) {
      out.emplace_back(Status::InvalidArgument("offset " + std::to_string(offset) + " is past the " +
                                               std::to_string(it->second->ids.size()) + " tokens made so far"));
    } else {
      out.emplace_back(Snapshot(*it->second, offset));
    }
  }
  return out;
}

Result<RequestUpdate> Scheduler::WaitProgress(uint64_t id, int64_t prefilled_above, std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return Status::NotFound("request " + std::to_string(id) + " is unknown");
  std::shared_ptr<Request> r = it->second;
  done_cv_.wait_for(lk, wait, [&] { return r->done || r->prefilled > prefilled_above; });
  return Snapshot(*r, static_cast<int64_t>(r->ids.size()));
}

Result<RequestUpdate> Scheduler::Wait(uint64_t id) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return Status::NotFound("request " + std::to_string(id) + " is unknown");
  std::shared_ptr<Request> r = it->second;
  done_cv_.wait(lk, [&] { return r->done; });
  return Snapshot(*r, 0);
}

Status Scheduler::Cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return Status::NotFound("request " + std::to_string(id) + " is unknown");
    Request& r = *it->second;
    if (r.done) return Status::OK();
    auto q = std::find(queue_.begin(), queue_.end(), it->second);
    if (q != queue_.end()) {  // never admitted: ended here
      queue_.erase(q);
      Finish(r, "cancelled", Status::Cancelled("cancelled by the client"));
      return Status::OK();
    }
    r.cancel = true;  // running: the loop ends it between two steps
  }
  work_cv_.notify_all();
  return Status::OK();
}

Status Scheduler::Release(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return Status::NotFound("request " + std::to_string(id) + " is unknown");
  if (!it->second->done) {
    // Running: cancelled, and forgotten when it ends.
    it->second->cancel = true;
    it->second->release_when_done = true;
    work_cv_.notify_all();
    return Status::OK();
  }
  requests_.erase(it);
  done_cv_.notify_all();
  return Status::OK();
}

bool Scheduler::Contains(uint64_t id) const {
  std::lock_guard<std::mutex> lk(mu_);
  return requests_.count(id) > 0;
}

bool Scheduler::WaitReleased(std::chrono::milliseconds max_wait) {
  std::unique_lock<std::mutex> lk(mu_);
  return done_cv_.wait_for(lk, max_wait, [&] { return requests_.empty(); });
}

bool Scheduler::Drain(std::chrono::milliseconds max_wait) {
  std::unique_lock<std::mutex> lk(mu_);
  draining_ = true;
  auto idle = [&] { return queue_.empty() && prefilling_.empty() && decoding_.empty(); };
  if (max_wait == std::chrono::milliseconds::max()) {
    done_cv_.wait(lk, idle);
    return true;
  }
  return done_cv_.wait_for(lk, max_wait, idle);
}

bool Scheduler::accepting() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !stop_ && !draining_;
}

SchedulerStats::Documents Scheduler::DocumentSnapshot() const {
  SchedulerStats::Documents d;
  const RunStats rs = rt_->stats();
  if (const DocumentMemoryTier* c = rt_->prefix_cache()) {
    d.cached = static_cast<int64_t>(c->entries());
    d.device_bytes = static_cast<int64_t>(c->bytes());
    d.host_bytes = static_cast<int64_t>(c->host_bytes());
  }
  d.tier0_bytes = static_cast<int64_t>(rs.tiers.promoted_bytes);
  d.tier0_documents = rs.tiers.documents;
  d.tier0_promotions = rs.tiers.promotions;
  d.tier0_demotions = rs.tiers.demotions;
  d.store_hits = rs.prefix_store_hits;
  d.store_corruptions = rs.prefix_store_corruptions;
  d.store_fetch_failures = rs.prefix_store_fetch_failures;
  d.stored = rs.prefix_stores;
  d.by_policy = rs.documents_by_policy;
  d.moves = rs.document_moves;
  d.move_failures = rs.document_move_failures;
  d.move_seconds = rs.document_move_seconds;
  return d;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  SchedulerStats s = stats_;
  s.queued = static_cast<int64_t>(queue_.size());
  s.prefilling = static_cast<int64_t>(prefilling_.size());
  s.decoding = static_cast<int64_t>(decoding_.size());
  s.fetching =
      std::count_if(queue_.begin(), queue_.end(), [](const auto& r) { return r->fetch == Request::Fetch::kFetching; });
  return s;
}

bool Scheduler::HasWork() const {
  // A request being fetched is not the loop's work until its read ends.
  const bool admissible =
      std::any_of(queue_.begin(), queue_.end(), [](const auto& r) { return r->fetch != Request::Fetch::kFetching; });
  return admissible || !prefilling_.empty() || !decoding_.empty() || !tasks_.empty();
}

Status Scheduler::RunOnLoop(std::function<Status(Runtime&)> task) {
  std::packaged_task<Status(Runtime&)> t(std::move(task));
  std::future<Status> f = t.get_future();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return Status::Unavailable("the scheduler has stopped");
    tasks_.push_back(std::move(t));
  }
  work_cv_.notify_all();
  return f.get();
}

void Scheduler::RunTasks() {
  for (;;) {
    std::packaged_task<Status(Runtime&)> t;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (tasks_.empty()) return;
      t = std::move(tasks_.front());
      tasks_.pop_front();
    }
    t(*rt_);
  }
}

void Scheduler::BindThread() {
  // The runtime's device for this thread's calls (a worker on a second GPU
  // would otherwise allocate on the first).
  if (Status s = rt_->backend().BindThread(); !s.ok()) LOG(ERROR) << "scheduler: " << s;
}

void Scheduler::Loop() {
  BindThread();
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait_for(lk, kIdleTick, [&] { return stop_ || HasWork(); });
    if (stop_) return;
    if (Clock::now() - memory_sampled_ >= kMemorySampleEvery) {
      lk.unlock();  // the loop is the runtime's only thread
      const size_t free = rt_->backend().FreeMemoryBytes();
      // Idle too: the document cache's figures move by themselves (the
      // persistent tier's background writes finish after their requests).
      const SchedulerStats::Documents docs = DocumentSnapshot();
      const BatchCapacity capacity = CapacityNow();
      lk.lock();
      stats_.documents = docs;
      stats_.capacity = capacity;
      memory_sampled_ = Clock::now();
      stats_.memory_free_bytes = static_cast<int64_t>(std::min<size_t>(free, std::numeric_limits<int64_t>::max()));
      if (stop_) return;
    }
    DropExpiredAnswers(Clock::now());
    if (!HasWork()) continue;
    lk.unlock();
    RunTasks();
    Reap();
    StartFetches();
    Admit();
    PrefillOne();
    DecodeOnce();
    lk.lock();
  }
}

void Scheduler::Reap() {
  std::lock_guard<std::mutex> lk(mu_);
  const Clock::time_point now = Clock::now();
  auto ended = [&](Request& r) {
    if (r.cancel) {
      Finish(r, "cancelled", Status::Cancelled("cancelled by the client"));
      return true;
    }
    if (r.opts.deadline && now >= *r.opts.deadline) {
      Finish(r, "deadline",
             Status::DeadlineExceeded("the request's deadline passed after " + std::to_string(r.ids.size()) +
                                      " generated tokens"));
      return true;
    }
    return false;
  };
  auto reap = [&](auto& list) {
    list.erase(std::remove_if(list.begin(), list.end(), [&](const std::shared_ptr<Request>& r) { return ended(*r); }),
               list.end());
  };
  reap(queue_);
  reap(prefilling_);
  reap(decoding_);
}

BatchCapacity Scheduler::CapacityNow() {
  int64_t held = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    held = static_cast<int64_t>(prefilling_.size() + decoding_.size());
  }
  const int64_t tokens =
      o_.capacity_context_tokens > 0 ? o_.capacity_context_tokens : rt_->config().max_position_embeddings;
  // One new token: the length is the whole sequence's.
  return rt_->Capacity(std::max<int64_t>(tokens - 1, 1), 1, held, o_.max_batch);
}

void Scheduler::Admit() {
  std::shared_ptr<Request> r;
  std::shared_ptr<PrefetchedDocuments> prefetched;  // r's, held while the runtime imports it
  {
    std::lock_guard<std::mutex> lk(mu_);
    // One prompt in prefill at a time (by fair share between tenants, first
    // come first served within one); the next is admitted when it is in.
    if (queue_.empty() || !prefilling_.empty()) return;
    const int max_batch = std::min(o_.max_batch, rt_->max_batch());
    if (static_cast<int>(decoding_.size()) >= max_batch) {
      if (stats_.last_wait_batch != max_batch || stats_.last_wait_reason.rfind("max_batch", 0) != 0) {
        stats_.last_wait_reason = "max_batch " + std::to_string(max_batch);
        stats_.last_wait_batch = max_batch;
      }
      return;
    }
    r = NextByShare(Clock::now());
    if (!r) return;  // every waiting tenant is at its share of the batch
    prefetched = r->prefetched;
  }
  // Never null here (planned before it was ready); an empty one keeps the
  // store off the loop regardless.
  if (!prefetched) prefetched = std::make_shared<PrefetchedDocuments>();
  r->seq = next_seq_++;
  GenerationResult admitted;
  const Clock::time_point t0 = Clock::now();
  Status s = rt_->BeginPrefill(r->seq, r->req, &r->prefill, &admitted, prefetched.get());
  const double took = Seconds(Clock::now() - t0);
  if (took > 0.5) {
    // Memory for a long prompt (the value store's pinned host rows) is
    // reserved here, while the running batch waits.
    LOG(INFO) << "scheduler: admitting request " << r->id << " (" << r->req.prompt.size() << " tokens) took " << took
              << " s";
  }
  std::lock_guard<std::mutex> lk(mu_);
  // The lock was not held while the runtime worked: a client may have
  // cancelled r meanwhile (Cancel ends a queued request and takes it out of
  // the queue), so r is looked up, never assumed to be the queue's front.
  auto it = std::find(queue_.begin(), queue_.end(), r);
  if (it == queue_.end() || r->done) {
    if (s.ok()) rt_->RemoveSequence(r->seq);
    return;
  }
  if (s.ok()) {
    queue_.erase(it);
    ChargeShare(*r);
    r->admitted = Clock::now();
    r->cached_prompt_tokens = admitted.cached_prompt_tokens;
    r->prefilled = r->prefill.at;
    r->added = true;
    r->prefetched.reset();  // read and imported (or not needed): its memory goes
    stats_.prompt_tokens += static_cast<int64_t>(r->req.prompt.size());
    stats_.cached_prompt_tokens += admitted.cached_prompt_tokens;
    prefilling_.push_back(r);
    if (r->prefilled > 0) done_cv_.notify_all();  // progress: documents attached (WaitProgress)
    return;
  }
  if (s.code() == StatusCode::kResourceExhausted && !decoding_.empty()) {
    // Does not fit next to the running sequences: waits for one to finish.
    if (!r->waited) {
      r->waited = true;
      ++stats_.admission_waits;
      stats_.last_wait_reason = s.message();
      stats_.last_wait_batch = static_cast<int64_t>(decoding_.size());
    }
    return;
  }
  // Cannot fit even alone, or a request the runtime refuses: it ends here.
  queue_.erase(it);
  Finish(*r, "error", s);
}

std::shared_ptr<Scheduler::Request> Scheduler::NextByShare(Clock::time_point now) const {
  // Sequences each tenant holds (admitted, prefilling or decoding).
  std::map<std::string, int> held;
  for (const auto* list : {&prefilling_}) {
    for (const auto& r : *list) ++held[ShareKey(*r)];
  }
  for (const auto& r : decoding_) ++held[ShareKey(*r)];
  // The active tenants and their weights: a request held or waiting, or one
  // sent within the window.
  std::map<std::string, double> active;
  if (o_.share_window.count() > 0) {
    for (const auto& [tenant, a] : activity_) {
      if (held.count(tenant) || now - a.last <= o_.share_window) active[tenant] = a.weight;
    }
    for (const auto& r : queue_) active[ShareKey(*r)] = r->opts.share_weight;
  }
  double total = 0;
  for (const auto& [tenant, w] : active) total += w;
  const int batch = std::min(o_.max_batch, rt_->max_batch());
  auto under_cap = [&](const std::string& tenant) {
    if (active.size() < 2) return true;
    const double w = active.count(tenant) ? active.at(tenant) : 1.0;
    const int cap = std::max(1, static_cast<int>(std::ceil(batch * w / total - 1e-9)));
    auto h = held.find(tenant);
    return h == held.end() || h->second < cap;
  };
  std::shared_ptr<Request> best;
  double best_start = 0;
  for (const std::shared_ptr<Request>& r : queue_) {
    if (r->fetch != Request::Fetch::kReady) continue;  // its stored documents are being read
    if (!under_cap(ShareKey(*r))) continue;
    auto t = share_time_.find(ShareKey(*r));
    const double start = std::max(t == share_time_.end() ? 0.0 : t->second, share_now_);
    if (!best || start < best_start) {  // ties: the earlier arrival
      best = r;
      best_start = start;
    }
  }
  return best;
}

void Scheduler::ChargeShare(const Request& r) {
  double& t = share_time_[ShareKey(r)];
  const double start = std::max(t, share_now_);
  share_now_ = start;
  t = start + 1.0 / std::max(r.opts.share_weight, 1e-6);
}

void Scheduler::PrefillOne() {
  std::shared_ptr<Request> r;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (prefilling_.empty()) return;
    r = prefilling_.front();
  }
  const Clock::time_point t0 = Clock::now();
  const int64_t from = r->prefill.at;
  Result<bool> done = rt_->PrefillStep(r->seq, r->req, &r->prefill, o_.prefill_tokens_per_step);
  const double piece = Seconds(Clock::now() - t0);
  if (piece > 0.5) {
    // How long the running batch waited: worth seeing in the log.
    LOG(INFO) << "scheduler: a prefill piece of request " << r->id << " took " << piece << " s (tokens " << from
              << " -> " << r->prefill.at << " of " << r->req.prompt.size()
              << (r->prefill.partial ? ", layer " + std::to_string(r->prefill.partial->layer) : std::string()) << ")";
  }
  int32_t id = 0;
  Status sampled = Status::OK();
  const bool prefill_only = r->req.max_new_tokens == 0;
  if (done.ok() && *done && !prefill_only) {
    sampled = rt_->backend().Sample(rt_->LastLogits(), 1, rt_->config().vocab_size,
                                    {SamplingDraw(r->req.sampling, r->rng)}, &id);
  }
  const SchedulerStats::Documents docs = DocumentSnapshot();
  std::lock_guard<std::mutex> lk(mu_);
  stats_.documents = docs;
  ++stats_.prefill_pieces;
  stats_.prefill_piece_max_seconds = std::max(stats_.prefill_piece_max_seconds, piece);
  r->prefilled = r->prefill.at;
  if (done.ok() && !*done) {
    done_cv_.notify_all();  // progress (WaitProgress)
    return;
  }
  prefilling_.pop_front();
  if (!done.ok() || !sampled.ok()) {
    Finish(*r, "error", done.ok() ? sampled : done.status());
    return;
  }
  r->ttft_seconds = Seconds(Clock::now() - r->submitted);
  if (prefill_only) {
    Finish(*r, "prefilled", Status::OK());
  } else if (!Emit(*r, id)) {
    decoding_.push_back(r);
  }
  done_cv_.notify_all();
}

void Scheduler::DecodeOnce() {
  std::vector<std::shared_ptr<Request>> batch;
  bool interleaved = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    batch = decoding_;
    interleaved = !prefilling_.empty() && prefilling_.front()->prefill.in_progress(
                                              static_cast<int64_t>(prefilling_.front()->req.prompt.size()));
  }
  if (batch.empty()) return;
  // Questions about one document side by side: a policy scores the sequences
  // attached to one prefix together where they form a run (ShadowKV's
  // one-prefix scores on the GPU); a sequence's tokens do not depend on its
  // place in the batch. Stable: admission order within a document. Under a
  // policy per document each form's sequences form one run first (the
  // policy then passes each its rows in place).
  std::stable_sort(batch.begin(), batch.end(), [](const auto& x, const auto& y) {
    if (x->prefill.form != y->prefill.form) return x->prefill.form < y->prefill.form;
    return std::less<const KvPrefix*>()(x->prefill.attached.get(), y->prefill.attached.get());
  });
  // Only this thread writes a running request's ids: read without the lock.
  std::vector<int64_t> seqs, positions;
  std::vector<int32_t> tokens;
  std::vector<SampleParams> params;
  for (const auto& r : batch) {
    seqs.push_back(r->seq);
    tokens.push_back(r->ids.back());
    positions.push_back(static_cast<int64_t>(r->req.prompt.size() + r->ids.size()) - 1);
    params.push_back(SamplingDraw(r->req.sampling, r->rng));
  }
  Result<const float*> logits = rt_->DecodeStep(seqs, tokens, positions);
  std::vector<int32_t> ids(batch.size());
  Status sampled = logits.ok() ? rt_->backend().Sample(*logits, static_cast<int>(batch.size()),
                                                       rt_->config().vocab_size, params, ids.data())
                               : logits.status();
  const SchedulerStats::Documents docs = DocumentSnapshot();
  std::lock_guard<std::mutex> lk(mu_);
  stats_.documents = docs;
  ++stats_.decode_steps;
  if (interleaved) ++stats_.interleaved_decode_steps;
  if (!sampled.ok()) {
    // The step failed for all of them; the loop goes on with the others.
    LOG(WARNING) << "scheduler: a decode step of " << batch.size() << " sequences failed: " << sampled;
    for (auto& r : batch) Finish(*r, "error", sampled);
    decoding_.erase(
        std::remove_if(decoding_.begin(), decoding_.end(), [](const std::shared_ptr<Request>& r) { return r->done; }),
        decoding_.end());
    return;
  }
  for (size_t i = 0; i < batch.size(); ++i) Emit(*batch[i], ids[i]);
  done_cv_.notify_all();
  decoding_.erase(
      std::remove_if(decoding_.begin(), decoding_.end(), [](const std::shared_ptr<Request>& r) { return r->done; }),
      decoding_.end());
}

bool Scheduler::Emit(Request& r, int32_t id) {
  // Pollers are woken by the caller, once per step (not once per token).
  r.ids.push_back(id);
  ++stats_.generated_tokens;
  for (int32_t s : r.req.stop_ids) {
    if (s == id) {
      Finish(r, "stop", Status::OK());
      return true;
    }
  }
  if (static_cast<int>(r.ids.size()) >= r.req.max_new_tokens) {
    Finish(r, "length", Status::OK());
    return true;
  }
  return false;
}

void Scheduler::Finish(Request& r, const std::string& reason, Status error) {
  if (r.done) return;
  r.done = true;
  r.finish_reason = reason;
  r.error = std::move(error);
  r.finished = Clock::now();
  r.prefetched.reset();  // what was read for it, if never admitted
  if (r.added) {
    rt_->RemoveSequence(r.seq);
    r.added = false;
  }
  ++stats_.finished;
  if (r.release_when_done) requests_.erase(r.id);
  if (reason == "cancelled") ++stats_.cancelled;
  if (reason == "error" || reason == "deadline") ++stats_.failed;
  done_cv_.notify_all();
}

RequestUpdate Scheduler::Snapshot(const Request& r, int64_t offset) const {
  RequestUpdate u;
  u.offset = offset;
  u.ids.assign(r.ids.begin() + offset, r.ids.end());
  u.done = r.done;
  u.finish_reason = r.finish_reason;
  u.error = r.error;
  u.prompt_tokens = static_cast<int64_t>(r.req.prompt.size());
  u.cached_prompt_tokens = r.cached_prompt_tokens;
  u.generated_tokens = static_cast<int64_t>(r.ids.size());
  u.queue_seconds = r.admitted.time_since_epoch().count() > 0 ? Seconds(r.admitted - r.submitted) : -1;
  u.ttft_seconds = r.ttft_seconds;
  u.prefilled_tokens = r.prefilled;
  return u;
}

void Scheduler::DropExpiredAnswers(Clock::time_point now) {
  for (auto it = requests_.begin(); it != requests_.end();) {
    if (it->second->done && now - it->second->finished > o_.keep_finished) {
      it = requests_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace penumbra::service
