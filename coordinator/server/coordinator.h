// The coordinator: Penumbra's public API (transport/penumbra.thrift) in front
// of N workers. It authenticates (API key -> tenant, and the tenant's client
// certificate where it requires one), validates every request against its
// limits before any work proportional to it (validation.h), tokenizes,
// reserves a generation's tokens from its tenant's quota up front, keeps the
// document registry, routes each generation to the worker that holds its
// documents (else the least loaded healthy one of the asked KV policy; a
// worker that is full or gone is skipped for the next), streams tokens to
// clients by long polling (applying stop strings, which workers do not see),
// and counts everything for /metrics.
//
// What callers see of the service: Health (no key) says only whether it
// serves and the model's name; the workers (names, addresses, health, load)
// are in Stats for an admin tenant, or for everyone when the coordinator runs
// without authentication (a loopback development setup). Request ids are 128
// random bits and, like every id, scoped to their tenant (another tenant's is
// NOT_FOUND).
//
// Threading: Thrift runs each client connection on its own thread; every
// member is safe to call from any of them. A request's state has its own
// mutex: concurrent polls of one request are served one after another.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "common/status.h"
#include "coordinator/server/document_registry.h"
#include "coordinator/server/job_service.h"
#include "coordinator/server/request_journal.h"
#include "coordinator/server/tombstones.h"
#include "coordinator/server/validation.h"
#include "coordinator/server/worker_pool.h"
#include "coordinator/server/worker_watch.h"
#include "coordinator/tenants/tenants.h"
#include "coordinator/tokenizer/text_codec.h"
#include "gen-cpp/Penumbra.h"

namespace penumbra::coordinator {

struct CoordinatorOptions {
  // Tenants (configs/tenants.yaml): API keys stored hashed, quotas
  // (concurrent sequences, generated tokens per minute, stored document
  // bytes, jobs in flight). Set: every call is authenticated by it.
  std::shared_ptr<tenants::TenantRegistry> tenants;
  // Without `tenants`: API key -> tenant in plain text (a development
  // convenience, no quotas; keys of at least tenants::kMinApiKeyBytes). Both
  // empty: no authentication, every caller is tenant "default" (a local or
  // trusted deployment).
  std::map<std::string, std::string> api_keys;
  // Bounds on every call's inputs (validation.h: one comment and default each).
  RequestLimits limits;
  // Documents one tenant may hold. Default: 10000.
  int64_t max_documents_per_tenant = 10000;
  // Generations not yet finished, all tenants. Default: 4096.
  int64_t max_running_requests = 4096;
  // Puts with wait = false being factored at once, per tenant (each is a
  // thread here); past it RESOURCE_EXHAUSTED. Default: 16.
  int max_background_puts_per_tenant = 16;
  // How long an ended generation stays readable by Poll. Default: 10 min.
  std::chrono::milliseconds keep_finished{std::chrono::minutes(10)};
  // A put's deadline when it names none. Default: 30 min.
  std::chrono::milliseconds put_timeout{std::chrono::minutes(30)};
  // Placement (coordinator/server/placement.h): a worker reporting less free
  // device memory than this is tried after the others of its group.
  int64_t min_free_memory_bytes = int64_t{2} << 30;
  // Placement by length: a prompt (its documents and question) of this many
  // tokens or more goes to a formed context group first; shorter ones to
  // single workers first. Whatever the threshold, a prompt that fits no
  // single worker's free memory (its reported device bytes per token) goes
  // only to groups. 0: by memory alone. Default: 0.
  int64_t group_min_tokens = 0;
  // A streaming generation (Generate) nobody has polled for this long is
  // cancelled on its worker and ends "cancelled"; at most keep_finished.
  // Default: 120 s.
  std::chrono::milliseconds abandon_timeout{std::chrono::seconds(120)};
  Status Validate() const;
};

// Reads an API-key file (YAML: `keys: {KEY: TENANT, ...}`); errors name the
// file and the entry (never the key). Keys shorter than
// tenants::kMinApiKeyBytes are refused.
Result<std::map<std::string, std::string>> LoadApiKeys(const std::string& path);

class Coordinator : public rpc::PenumbraIf {
 public:
  // `codec` may be null (no tokenizer: requests carry token ids, answers
  // have no text, stop strings are refused).
  // `documents`: the document registry (DocumentRegistry::Open for one that
  // survives restarts); null: one in memory.
  Coordinator(const CoordinatorOptions& options, std::unique_ptr<TextCodec> codec, std::string model,
              WorkerPool* workers, std::unique_ptr<DocumentRegistry> documents = nullptr);
  ~Coordinator() override;  // waits for background puts

  // ---- the public API (transport/penumbra.thrift) ----
  // Documents (coordinator_documents.cc).
  void PutDocument(rpc::DocumentInfo& out, const rpc::PutDocumentRequest& request) override;
  void GetDocument(rpc::DocumentInfo& out, const std::string& api_key, const std::string& document_id,
                   int64_t deadline_ms) override;
  void ListDocuments(rpc::DocumentList& out, const rpc::ListDocumentsRequest& request) override;
  void DeleteDocument(const std::string& api_key, const std::string& document_id, int64_t deadline_ms) override;
  // Generations (coordinator_generations.cc).
  void Generate(std::string& out, const rpc::GenerateRequest& request) override;
  void Poll(rpc::GenerateChunk& out, const std::string& api_key, const std::string& request_id, int64_t offset,
            int32_t wait_ms) override;
  void Cancel(const std::string& api_key, const std::string& request_id) override;
  void Complete(rpc::GenerateChunk& out, const rpc::GenerateRequest& request) override;
  // Batch jobs (coordinator_jobs.cc).
  void SubmitJob(rpc::JobInfo& out, const rpc::SubmitJobRequest& request) override;
  void GetJob(rpc::JobInfo& out, const std::string& api_key, const std::string& job_id) override;
  void ListJobs(rpc::JobList& out, const std::string& api_key, const std::string& page_token,
                int32_t page_size) override;
  void GetJobResults(rpc::JobResults& out, const std::string& api_key, const std::string& job_id,
                     const std::string& after_custom_id, int32_t page_size) override;
  void CancelJob(rpc::JobInfo& out, const std::string& api_key, const std::string& job_id) override;
  void DeleteJob(const std::string& api_key, const std::string& job_id) override;
  // Health (coordinator.cc) and Stats (coordinator_metrics.cc).
  void Health(rpc::HealthResponse& out) override;
  void Stats(rpc::StatsResponse& out, const std::string& api_key) override;

  // ---- operating the service (coordinator_main.cc) ----
  // Batch jobs (coordinator_jobs.cc; off until started: the job calls are FAILED_PRECONDITION):
  // opens the job store at options.store.path, resumes unfinished jobs.
  Status StartJobs(JobServiceOptions options);
  JobService* jobs() const { return jobs_.get(); }

  // Requests owned under a lease (coordinator_journal.cc; docs/architecture.md,
  // "Ownership"): takes
  // the request journal (data_dir/requests) and continues what it holds --
  // the tenants' usage counters are reloaded; a generation its worker still
  // has is claimed (its tokens are polled again from offset 0), one its
  // worker lost starts again from the tokens journalled (seeded sampling
  // continues identically), a batch job's item is cancelled (its job runs it
  // again), and a generation a worker holds for this owner with no record is
  // cancelled. From then on every generation is journalled. Call once,
  // before serving. The workers' owner id is the journal's
  // (WorkerPoolOptions::owner_id).
  Status Recover(std::unique_ptr<RequestJournal> journal);

  // Tenants and keys (coordinator_api.cc).
  // Rereads the tenants (SIGHUP): see TenantRegistry::Reload.
  Status ReloadTenants(const tenants::TenantsConfig& config);
  // Replaces the plain API keys (SIGHUP, --api-keys): the calls authenticated
  // from now on use `keys`. FailedPrecondition when started without keys
  // (authentication is not turned on by a reload), InvalidArgument for an
  // empty set or a key CoordinatorOptions::Validate refuses; the old keys
  // stay on any error.
  Status ReloadApiKeys(std::map<std::string, std::string> keys);

  // Stops taking documents and generations (coordinator.cc; Unavailable) and waits until the
  // running generations are done, at most `max_wait`; true when they are.
  // When the wait expires, the generations left are cancelled on their
  // workers and end "drained" (a Complete waiting on one ends "cancelled").
  bool Drain(std::chrono::milliseconds max_wait);
  // The metrics (coordinator_metrics.cc).
  std::shared_ptr<prometheus::Registry> metrics() const { return registry_; }
  // Refreshes the gauges (before a scrape).
  void RefreshMetrics();

  // What the workers report about the model (and whether text can be encoded
  // here; coordinator_api.cc).
  ModelLimits model_limits() const;
  // The bounds every request is checked against.
  const RequestLimits& request_limits() const { return o_.limits; }
  // The model's name, as Health says it.
  const std::string& model_name() const { return model_; }
  // Whether `api_key` (with the caller's client certificate, CurrentPeer)
  // names a tenant: PermissionDenied when it does not (coordinator_api.cc).
  Status Authenticate(const std::string& api_key) const;
  // The tenant `api_key` names (as Authenticate checks it).
  Result<std::string> TenantOf(const std::string& api_key) const { return Tenant(api_key); }

 private:
  struct Request;  // one generation's state (coordinator_internal.h)
  // A generation checked and ready to build: its documents (looked up), its
  // question's tokens, the prompt's length and the tokens it may generate.
  struct Checked {
    std::vector<DocumentView> docs;
    std::vector<int32_t> question;
    int64_t prompt_tokens = 0;
    int32_t max_new_tokens = 0;  // the request's, or what the context leaves (fit_context)
    int64_t generated_bound = 0;
  };

  // ---- callers: authentication and inputs (coordinator_api.cc) ----
  // The caller's tenant (its key, and its client certificate when the tenant
  // requires one).
  Result<std::string> Tenant(const std::string& api_key) const;
  // Whether `tenant` may see the workers (Stats).
  bool SeesInternals(const std::string& tenant) const;
  // Text is tokenized with the template's special tokens only when it
  // `starts_prompt`; both have been validated (ValidateGenerateRequest or
  // ValidatePutDocumentRequest).
  Result<std::vector<int32_t>> TextOrIds(const std::string& what, const std::string* text,
                                         const std::vector<int32_t>* ids, bool starts_prompt,
                                         const ModelLimits& model) const;

  // ---- documents (coordinator_documents.cc) ----
  Result<rpc::DocumentInfo> DoPut(const rpc::PutDocumentRequest& r);
  void Factor(DocumentView doc, std::chrono::steady_clock::time_point deadline);
  rpc::DocumentInfo ToInfo(const DocumentView& d) const;
  // Asks worker w to drop a document's cached state (ForgetDocuments, by
  // the digest of `ids`).
  Status ForgetOn(int w, const std::string& id, const std::string& tenant,
                  const std::shared_ptr<const std::vector<int32_t>>& ids);

  // ---- generations: admission, placement, streaming, resume (coordinator_generations.cc) ----
  Result<std::shared_ptr<Request>> DoGenerate(const rpc::GenerateRequest& r);
  Result<std::shared_ptr<Request>> DoGenerateAs(const std::string& tenant, const rpc::GenerateRequest& r,
                                                bool job_item = false);
  // Checks r for `tenant` (validation, its documents, the prompt's length
  // against the context, counted before anything is concatenated); r itself
  // has passed ValidateGenerateRequest.
  Result<Checked> CheckGenerate(const std::string& tenant, const rpc::GenerateRequest& r,
                                const ModelLimits& model) const;
  // The worker's request: the documents named by digest (no ids: SendGenerate
  // adds them where needed), then the question.
  rpc::WorkerGenerateRequest BuildGenerate(const std::string& tenant, const rpc::GenerateRequest& r,
                                           const Checked& c) const;
  // Queues g on worker w (its handle in *wid): the documents by digest alone
  // where w is known to hold them all, else (or when w answers that it does
  // not hold one: FAILED_PRECONDITION) with their ids. *by_digest: whether
  // the request w took named them by digest alone.
  Status SendGenerate(int w, const rpc::WorkerGenerateRequest& g, const std::vector<DocumentView>& docs,
                      std::string* wid, bool* by_digest, bool with_ids = false);
  // What q's worker must run to go on from the tokens q has (q->mu held):
  // the request, its prompt extended by them, the rest of its budget and its
  // random stream where it was.
  rpc::WorkerGenerateRequest Continuation(const Request& q) const;
  // Candidate workers for a request of `kv_policy` over `docs` (holders of the
  // first document first, then the others by load).
  // The workers to try for a prompt of `tokens` tokens (documents and
  // question), in order: single workers and formed groups' rank 0 (never a
  // group's other ranks), by placement.h's order within each class; a
  // holder of the first document first; long prompts to groups first
  // (CoordinatorOptions::group_min_tokens, memory).
  std::vector<int> Route(const std::string& kv_policy, const std::vector<DocumentView>& docs, int64_t tokens = 0) const;
  Result<std::shared_ptr<Request>> Find(const std::string& tenant, const std::string& id);
  // Brings `q` up to date from its worker, waiting up to `wait` when it has
  // no tokens past `offset` (q->mu held).
  Status Advance(Request& q, int64_t offset, std::chrono::milliseconds wait);
  // Asks worker `w` to stop its generation `wid` (a request it no longer
  // has, NOT_FOUND, counts as stopped).
  Status CancelOnWorker(int w, const std::string& wid);
  // Ends q (q->mu held): releases it on its worker, counts it.
  void Finalize(Request& q, const std::string& reason, const Status& error);
  // q's worker was lost (q->mu held): q goes on on another worker from the
  // tokens it has (kMaxResumes times at most; its own worker last, when it
  // serves again). False when it cannot.
  bool Resume(Request& q, const std::string& why);
  static constexpr int kMaxResumes = 3;
  // What a poll of a worker may take beyond its wait.
  static constexpr std::chrono::milliseconds kWorkerPollMargin{3000};
  void ToChunk(const Request& q, int64_t offset, rpc::GenerateChunk* out) const;
  // Drops generations ended more than keep_finished ago and cancels abandoned
  // ones (at most once a second).
  void DropExpired();

  // ---- ownership: the request journal (coordinator_journal.cc) ----
  // q's journal record (q->mu held).
  JournalRecord ToRecord(const Request& q) const;
  // Journals q's move to another worker (q->mu held); a failure is logged.
  void JournalMove(const Request& q);

  // ---- batch jobs (coordinator_jobs.cc) ----
  // A job item: generates to the end (or until the coordinator stops).
  ItemOutcome RunItem(const std::string& tenant, const rpc::GenerateRequest& r, const std::atomic<bool>& cancel);
  Result<JobService*> Jobs() const;
  // The tenant's limit on jobs in flight (nullopt: none).
  std::optional<int64_t> JobQuota(const std::string& tenant) const;

  // ---- metrics (coordinator_metrics.cc) ----
  // Registers every metric below in registry_ (at construction).
  void RegisterMetrics();

  // ---- state ----
  CoordinatorOptions o_;
  // The plain API keys in use (o_.api_keys at start; ReloadApiKeys swaps them).
  mutable std::mutex api_keys_mu_;
  std::shared_ptr<const std::map<std::string, std::string>> api_keys_;  // guarded by api_keys_mu_
  std::unique_ptr<TextCodec> codec_;
  std::string model_;
  WorkerPool* workers_;
  std::unique_ptr<DocumentRegistry> docs_;

  mutable std::mutex mu_;  // requests_, draining_, counters below
  std::condition_variable idle_cv_;
  std::map<std::string, std::shared_ptr<Request>> requests_;
  int64_t running_ = 0;
  bool draining_ = false;
  std::chrono::steady_clock::time_point last_sweep_;
  struct TenantCounts {
    int64_t requests = 0, failed = 0, prompt = 0, cached = 0, generated = 0;
  };
  std::map<std::string, TenantCounts> counts_;
  // Background puts (wait = false); finished ones are joined at the next put.
  struct BackgroundPut {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
    std::string tenant;
  };
  std::vector<BackgroundPut> puts_;
  std::atomic<bool> stopping_{false};       // the destructor runs: job items stop waiting
  std::atomic<bool> drain_expired_{false};  // Drain cancelled what was left (job items are not answered)
  // Looks at the generations once a second (DropExpired): abandoned ones
  // are cancelled even when no call comes.
  std::mutex sweep_mu_;
  std::condition_variable sweep_cv_;
  std::thread sweeper_;
  std::unique_ptr<JobService> jobs_;
  // Null without a data directory. journal_mu_ orders the usage snapshots
  // written with the records (taken before mu_).
  std::unique_ptr<RequestJournal> journal_;
  std::mutex journal_mu_;

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_total_;
  prometheus::Counter* resumed_;
  // Documents sent to workers with generations: by digest alone, with their
  // ids; and requests sent again with the ids because the worker lacked one.
  prometheus::Counter *documents_by_digest_, *documents_with_ids_, *document_resends_;
  prometheus::Counter *reattached_, *orphans_cancelled_, *abandoned_, *drain_cancelled_, *hangups_, *journal_errors_;
  prometheus::Family<prometheus::Counter>*prompt_tokens_, *cached_tokens_, *generated_tokens_, *documents_put_,
      *quota_refusals_;  // by tenant
  prometheus::Histogram *ttft_, *tpot_, *duration_, *factor_;
  prometheus::Gauge *running_gauge_, *documents_gauge_;
  prometheus::Family<prometheus::Gauge>* worker_up_;
  prometheus::Family<prometheus::Gauge>* worker_routed_;
  prometheus::Family<prometheus::Gauge>* group_formed_;          // by group
  prometheus::Family<prometheus::Gauge>* group_formations_;      // by group (a gauge: the pool counts)
  prometheus::Family<prometheus::Counter>* store_write_errors_;  // by store
  prometheus::Family<prometheus::Gauge>* store_degraded_;        // by store
  prometheus::Gauge* tombstones_gauge_;
  // Deletes carried to the workers (after docs_ and workers_; stopped first).
  std::unique_ptr<TombstoneSweeper> tombstones_;
  // One long poll per worker for every generation waiting there (Advance);
  // destroyed first.
  std::vector<std::unique_ptr<WorkerWatch>> watches_;
};

}  // namespace penumbra::coordinator
