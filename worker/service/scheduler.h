// Scheduler: continuous batching over one Runtime (one engine lane).
//
// Requests are submitted from any thread and run on the scheduler's own
// thread, the only one that touches the runtime. One loop: between two decode
// steps of the running batch it admits waiting requests (first come, first
// served) and prefills one piece of the oldest admitted prompt (at most
// prefill_tokens_per_step tokens where the policy allows splitting, else
// that much work of one segment, a few of its layers), so a long prompt does not stall everyone's decoding for its
// whole prefill, and requests join and leave the batch between steps. Admission is the policy's own memory check
// (KvPolicy::AddSequence: device memory, host memory for the value store): a request that does not fit waits until a
// running one finishes, and one that cannot fit even alone finishes with
// ResourceExhausted. Nothing a request does can stop the loop: its errors end
// that request (or, for a failed decode step, the requests of that step).
//
// Stored documents are looked up off the loop: a queued request whose
// leading segments are not in memory waits "fetching" while a store I/O
// thread reads the longest of them the persistent store holds
// (Runtime::FetchStoredPrefixes; a store node's calls have deadlines and a
// circuit breaker), and the batch keeps decoding; admission then imports
// what was read, or, when the store failed or did not answer, prefills the
// request from its tokens. A slow or dead store costs the requests that need
// it their reuse, never the others' decoding.
//
// Clients read tokens as they are made by polling with an offset (Poll waits
// up to wait_ms for tokens past the offset or for the end), can cancel, and
// get usage with every answer: prompt tokens, of which attached from the
// document cache, generated tokens, time to first token.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "worker/engine/runtime.h"

namespace penumbra::service {

struct SchedulerOptions {
  // Sequences decoding together at most (<= the runtime's max_batch). Default: 64.
  int max_batch = 64;
  // Prompt tokens prefilled between two decode steps (rounded down to whole
  // prefill chunks; a policy that cannot split a prefill by tokens runs that
  // much work of a segment: tokens x layers / the segment's tokens layers of
  // it, at least one).
  // Default: 4096.
  int64_t prefill_tokens_per_step = 4096;
  // Requests waiting for admission at most; Submit beyond it is
  // ResourceExhausted. Default: 1024.
  int max_queue = 1024;
  // A finished request's answer is kept for polling this long, then dropped
  // (Release drops it at once). Default: 10 minutes.
  std::chrono::milliseconds keep_finished{std::chrono::minutes(10)};
  // Fair share of the batch between tenants (requests' cache namespaces): a
  // tenant that sent a request within this window counts as active, and
  // while two or more are active each may hold at most
  // ceil(max_batch x its weight / the active tenants' weights) of the
  // batch's sequences, so a flooding tenant leaves the others' share free
  // (there is no preemption: a share taken while the others were idle is
  // given back as its requests end). 0: no caps (admission order alone is
  // fair). Default: 10 s.
  std::chrono::milliseconds share_window{std::chrono::seconds(10)};
  // Threads reading stored documents for queued requests (off the loop).
  // Default: 4.
  int store_fetch_threads = 4;
  // The sequence length (prompt + new tokens) SchedulerStats::capacity is
  // counted at. 0: the model's max_position_embeddings. Default: 0.
  int64_t capacity_context_tokens = 0;
  // InvalidArgument naming the field.
  Status Validate() const;
};

using Clock = std::chrono::steady_clock;

struct SubmitOptions {
  // The request is cancelled with DeadlineExceeded if it has not finished by
  // then (none: no deadline).
  std::optional<Clock::time_point> deadline;
  // The fair share of admission of the request's tenant (its
  // cache_namespace), > 0. Default: 1.
  double share_weight = 1.0;
  // Whose request it is, for the fair share ("": the request's
  // cache_namespace). Default: "".
  std::string tenant;
};

// What a poll returns: the tokens from the asked offset on, and the state.
struct RequestUpdate {
  std::vector<int32_t> ids;  // generated ids from `offset`
  int64_t offset = 0;        // the offset asked for
  bool done = false;
  // "stop", "length", "prefilled" (max_new_tokens 0), "cancelled", "deadline"
  // or "error" once done.
  std::string finish_reason;
  Status error;  // why, for "error" and "deadline"
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // of them, attached from the document cache
  int64_t generated_tokens = 0;      // all so far
  double queue_seconds = 0;          // submitted -> admitted
  double ttft_seconds = -1;          // submitted -> first token; < 0 until then
  int64_t prefilled_tokens = 0;      // prompt tokens in the sequence so far
};

struct SchedulerStats {
  int64_t submitted = 0, finished = 0, failed = 0, cancelled = 0;
  int64_t queued = 0, prefilling = 0, decoding = 0;  // now
  int64_t fetching = 0;                              // now: queued requests whose stored documents are being read
  int64_t decode_steps = 0;
  // Decode steps taken while a prompt was part-way through its prefill.
  int64_t interleaved_decode_steps = 0;
  int64_t prefill_pieces = 0;
  // The longest prefill piece: the longest the running batch waited for one.
  double prefill_piece_max_seconds = 0;
  int64_t prompt_tokens = 0, cached_prompt_tokens = 0, generated_tokens = 0;
  // Admissions deferred because the request did not fit next to the running ones.
  int64_t admission_waits = 0;
  // Free memory of the runtime's device (host RAM on the CPU backend),
  // sampled by the loop about once a second (the coordinator places requests
  // by it); -1 before the first sample.
  int64_t memory_free_bytes = -1;
  // How many sequences of capacity_context_tokens the worker holds and how
  // many more fit beside them, and what stops the next (Runtime::Capacity,
  // capped by max_batch too), sampled with memory_free_bytes.
  BatchCapacity capacity;
  // Why the last admission that had to wait did not fit (the runtime's
  // ResourceExhausted message, or "max_batch N"), and the decoding batch
  // then; empty / 0 before any.
  std::string last_wait_reason;
  int64_t last_wait_batch = 0;
  // The document cache, as of the loop's last step.
  struct Documents {
    int64_t cached = 0;                            // documents in memory (tier 1)
    int64_t device_bytes = 0, host_bytes = 0;      // ... their device state and host values
    int64_t tier0_bytes = 0, tier0_documents = 0;  // copies of hot documents' values on the device
    int64_t tier0_promotions = 0, tier0_demotions = 0;
    int64_t store_hits = 0, store_corruptions = 0;  // read back from disk; found damaged (recomputed)
    int64_t store_fetch_failures = 0;               // lookups the store did not answer (prefilled instead)
    int64_t stored = 0;                             // written to the persistent tier (background writes done)
    // kv_policy auto: tier 1's documents and bytes by the policy holding
    // them, and the moves from the exact form to ShadowKV.
    std::map<std::string, DocumentFormUsage> by_policy;
    int64_t moves = 0, move_failures = 0;
    double move_seconds = 0;
  } documents;
};

class Scheduler {
 public:
  // Starts the loop thread. `runtime` is used only from it from now on.
  static Result<std::unique_ptr<Scheduler>> Create(Runtime* runtime, const SchedulerOptions& options);
  ~Scheduler();  // Stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates the request (prompt, ids, lengths, sampling) and queues it.
  // InvalidArgument for a bad request, ResourceExhausted when the queue is
  // full, Unavailable while draining.
  Result<uint64_t> Submit(GenerationRequest request, const SubmitOptions& options = {});
  // Tokens from `offset` (<= the number generated so far) and the state;
  // waits up to `wait` for more tokens or the end. NotFound for an unknown
  // (or released) id, InvalidArgument for an offset past the tokens made.
  Result<RequestUpdate> Poll(uint64_t id, int64_t offset, std::chrono::milliseconds wait);
  // Ends a queued or running request ("cancelled"); a finished one is left
  // as it is. NotFound for an unknown id.
  Status Cancel(uint64_t id);
  // Forgets a request: a finished one at once (its answer was read), a
  // queued or running one is cancelled and forgotten when it ends.
  Status Release(uint64_t id);
  // Whether the scheduler still has request `id` (queued, running, or a
  // finished answer not yet released or expired).
  bool Contains(uint64_t id) const;
  // Polls several requests at once: waits up to `wait` until any has tokens
  // past its offset or is done; then each one's update from its offset (or
  // its error: NotFound, InvalidArgument for an offset past its tokens).
  std::vector<Result<RequestUpdate>> PollMany(const std::vector<std::pair<uint64_t, int64_t>>& targets,
                                              std::chrono::milliseconds wait);
  // The request's state once it is done or has more than `prefilled_above`
  // prompt tokens in, or after `wait`: a put's progress, one wake-up per
  // prefill piece. NotFound for an unknown id.
  Result<RequestUpdate> WaitProgress(uint64_t id, int64_t prefilled_above, std::chrono::milliseconds wait);
  // Blocks until the request is done; its whole answer.
  Result<RequestUpdate> Wait(uint64_t id);
  // Runs `task` on the loop thread between two steps (the only thread that
  // may touch the runtime) and returns what it returned: maintenance such as
  // dropping a deleted document's cached state. Unavailable once stopped.
  Status RunOnLoop(std::function<Status(Runtime&)> task);
  // Stops admitting new requests (Submit: Unavailable) and waits until every
  // queued and running request has finished, at most `max_wait`; true when
  // they all have (the rest go on; destroying the scheduler cancels them).
  bool Drain(std::chrono::milliseconds max_wait = std::chrono::milliseconds::max());
  // Waits until every finished request has been released (its answer read
  // by the coordinator) or dropped, at most `max_wait`: a draining worker
  // keeps answering polls until then. True when none is left.
  bool WaitReleased(std::chrono::milliseconds max_wait);
  // Ends every queued and running request ("cancelled"; pollers wake) and
  // joins the loop; Submit is Unavailable from then on. Polls, Wait and
  // Release keep working on the answers.
  void Stop();
  // False once draining or stopped.
  bool accepting() const;
  SchedulerStats stats() const;

 private:
  struct Request {
    uint64_t id = 0;
    GenerationRequest req;
    SubmitOptions opts;
    Clock::time_point submitted, admitted;
    // Written by the loop under mu_, read by pollers.
    std::vector<int32_t> ids;
    bool done = false;
    bool cancel = false;
    bool release_when_done = false;
    std::string finish_reason;
    Status error;
    int64_t cached_prompt_tokens = 0;
    double ttft_seconds = -1;
    int64_t prefilled = 0;  // prompt tokens in (a copy of prefill.at for pollers)
    Clock::time_point finished;
    // The loop's own.
    int64_t seq = -1;
    bool added = false;   // the runtime holds its sequence
    bool waited = false;  // admission was deferred once (counted once)
    std::mt19937_64 rng;
    Runtime::PrefillState prefill;
    // Its stored documents (under mu_): to look up, being read, or read
    // (prefetched: what BeginPrefill imports; the loop's once kReady).
    enum class Fetch { kUnplanned, kFetching, kReady } fetch = Fetch::kUnplanned;
    std::shared_ptr<PrefetchedDocuments> prefetched;
  };

  Scheduler(Runtime* runtime, const SchedulerOptions& options);
  void Loop();
  // One iteration's parts (loop thread; mu_ not held while the runtime runs).
  // Plans the lookups of newly queued requests and hands those that need
  // the store to the I/O threads.
  void StartFetches();
  void FetchLoop();   // an I/O thread
  void BindThread();  // the loop's and the I/O threads' first call
  void Admit();
  void PrefillOne();
  void DecodeOnce();
  // The document cache's figures (on the loop thread, which owns the runtime).
  SchedulerStats::Documents DocumentSnapshot() const;
  // SchedulerStats::capacity now (the loop's thread, mu_ not held).
  BatchCapacity CapacityNow();
  // Ends the cancelled and the expired among the queued and running.
  void Reap();
  // Appends a token (under mu_); true when the request is done with it.
  bool Emit(Request& r, int32_t id);
  // Ends `r` (under mu_) and frees its sequence.
  void Finish(Request& r, const std::string& reason, Status error);
  RequestUpdate Snapshot(const Request& r, int64_t offset) const;
  void DropExpiredAnswers(Clock::time_point now);  // under mu_
  bool HasWork() const;                            // under mu_
  // The queued request to admit next (under mu_; null when none may be):
  // the earliest of the tenant whose share of admissions is the most behind,
  // among the tenants under their cap of the batch (share_window).
  std::shared_ptr<Request> NextByShare(Clock::time_point now) const;
  void ChargeShare(const Request& r);  // under mu_: r was admitted
  static const std::string& ShareKey(const Request& r) {
    return r.opts.tenant.empty() ? r.req.cache_namespace : r.opts.tenant;
  }
  void RunTasks();  // loop thread

  Runtime* rt_;
  SchedulerOptions o_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the loop waits for requests
  std::condition_variable done_cv_;  // pollers wait for tokens and ends
  std::map<uint64_t, std::shared_ptr<Request>> requests_;
  std::deque<std::shared_ptr<Request>> queue_;  // waiting for admission, in arrival order
  // Fair share between tenants (start-time fair queuing on admissions): a
  // tenant's virtual time advances by 1 / its weight per admission; the
  // waiting tenant with the smallest is admitted next, and one that was idle
  // comes back at share_now_ (no credit for idling).
  std::map<std::string, double> share_time_;
  double share_now_ = 0;
  struct TenantActivity {
    Clock::time_point last;  // its latest Submit
    double weight = 1.0;
  };
  std::map<std::string, TenantActivity> activity_;   // guarded by mu_
  std::deque<std::shared_ptr<Request>> prefilling_;  // admitted, prompt part-way in
  std::vector<std::shared_ptr<Request>> decoding_;
  std::deque<std::packaged_task<Status(Runtime&)>> tasks_;
  uint64_t next_id_ = 1;
  int64_t next_seq_ = 0;
  bool stop_ = false, draining_ = false;
  SchedulerStats stats_;
  // Store I/O: jobs (a request's lookups) for the fetch threads.
  std::mutex io_mu_;
  std::condition_variable io_cv_;
  std::deque<std::function<void()>> io_jobs_;  // guarded by io_mu_
  bool io_stop_ = false;                       // guarded by io_mu_
  std::vector<std::thread> io_threads_;
  Clock::time_point memory_sampled_{};  // the loop's last SchedulerStats::memory_free_bytes
  std::thread thread_;
};

}  // namespace penumbra::service
