// Penumbra's public API: application services, the `penumbra` CLI and the
// Python client to the coordinator (penumbra-coordinator). Framed binary
// protocol; frames and strings are bounded by the server's limits.
//
// Every call that acts for a caller carries its API key (the tenant: a
// tenant sees only its own documents and requests, and its documents are
// cached in its own namespace; a tenant may also require a TLS client
// certificate of its own) and a deadline in milliseconds (0: the server's
// default; at most a week). Errors are PenumbraErrors with a typed code (see
// common.thrift): fix the request, retry after retry_after_ms, or give up.
//
// Every input is bounded (the coordinator's RequestLimits, flags of
// penumbra-coordinator; coordinator/server/validation.h): a call past a
// bound is INVALID_ARGUMENT naming the field and the limit, checked before
// any work proportional to the input. Ids (documents, requests, jobs) and
// page tokens are at most 256 bytes; another tenant's id is NOT_FOUND, as an
// id that does not exist.
include "common.thrift"

namespace cpp penumbra.rpc
namespace py penumbra.rpc.api

enum DocumentState {
  FACTORING = 1,  // being prefilled into the document cache
  READY = 2,      // usable by generate
  FAILED = 3,     // factoring failed: see error
}

struct DocumentInfo {
  1: string id,
  2: string name,
  3: i64 tokens,
  4: DocumentState state,
  5: i64 created_unix_ms,
  6: string worker,              // the worker that holds its cached state
  7: optional string error,      // FAILED: why
  8: double factor_seconds = -1, // put -> ready; < 0 until then
  9: i64 factored_tokens,        // FACTORING: tokens prefilled so far (progress)
  10: string kv_policy = "",     // the put's pin ("full", "shadowkv", "spindlekv", "specontext"; "": none)
}

// A document: text (tokenized by the coordinator with the model's tokenizer)
// or token ids; exactly one of them.
struct PutDocumentRequest {
  1: string api_key,
  2: string name,                // 1..256 bytes
  3: optional string text,
  4: optional list<i32> token_ids,
  // true: return when the document is READY (or FAILED); false: return at
  // once (FACTORING) and poll GetDocument.
  5: bool wait = true,
  6: i64 deadline_ms = 0,
  // "full", "shadowkv", "spindlekv" or "specontext": the document is factored on workers
  // of that KV policy (or of "auto" holding that form) and held there under it, and its questions are held
  // under it unless they pin another (GenerateRequest.kv_policy); "": the
  // workers' choice.
  7: string kv_policy = "",
}

struct ListDocumentsRequest {
  1: string api_key,
  2: string page_token = "",     // "" for the first page; then next_page_token
  3: i32 page_size = 100,        // 1..1000
  4: i64 deadline_ms = 0,
}

struct DocumentList {
  1: list<DocumentInfo> documents,  // by id
  2: string next_page_token,        // "" on the last page
}

struct GenerateRequest {
  1: string api_key,
  // Documents (by id, in order) the request's text follows; they are
  // attached from the document cache, not prefilled again. At most 64, each
  // once; the documents, the question and max_new_tokens fit the model's
  // context.
  2: list<string> document_ids,
  // The request's own text (a question), or its token ids: exactly one.
  3: optional string text,
  4: optional list<i32> token_ids,
  // With a tenant quota of generated tokens per minute, this many (less what
  // the context leaves) are reserved when the request is admitted and the
  // unused part is given back when it ends: more than the quota holds is
  // INVALID_ARGUMENT, more than it holds now RESOURCE_EXHAUSTED.
  5: i32 max_new_tokens = 256,
  6: common.SamplingOptions sampling,
  // Generation ends when the text contains one of these (the answer's text
  // stops before it) or at one of these ids (kept); the model's end-of-text
  // ids always stop it unless ignore_eos. At most 16 stop strings of 1..256
  // bytes; at most 1000 stop ids, in the vocabulary.
  7: list<string> stop,
  8: list<i32> stop_ids,
  9: bool ignore_eos = false,
  // "full", "shadowkv", "spindlekv" or "specontext" to run only under that policy: on
  // workers of that policy, or of "auto" (a policy per document) holding
  // that form (WorkerHealth.kv_forms), held under it; "": any.
  10: string kv_policy = "",
  11: i64 deadline_ms = 0,
  // true: max_new_tokens is only an upper bound; the generation may use what
  // the model's context leaves after the prompt (it stops there, "length")
  // instead of the request being refused when the two do not fit. (The
  // OpenAI API's max_tokens left out.)
  12: bool fit_context = false,
  // false: `text` is tokenized as it is, without the tokenizer's special
  // tokens where the prompt starts (a chat template writes its own BOS).
  13: bool add_special_tokens = true,
  // true (and no document_ids): the prompt's leading tokens that are
  // documents the tenant has put (READY) are attached from the document
  // cache instead of prefilled -- as if named in document_ids -- and counted
  // in usage.cached_prompt_tokens. Matched by their tokens, the longest
  // first, several in a row. (The OpenAI API sets it: prompt caching there
  // is automatic.)
  14: bool reuse_documents = false,
}

// The answer so far, from an offset (tokens).
struct GenerateChunk {
  1: list<i32> ids,              // generated ids from `offset`
  2: string text,                // the answer's whole text so far (stop strings cut)
  3: i64 offset,
  4: bool done,
  5: string finish_reason,       // once done: stop, length, cancelled, deadline, error
  6: optional common.ErrorCode error_code,
  7: optional string error_message,
  8: common.Usage usage,
  9: string request_id,
}

// A worker, as Stats shows it to an admin tenant (or to every caller of a
// coordinator without authentication).
struct WorkerStatus {
  1: string name,
  2: string address,             // host:port
  3: bool healthy,
  4: string kv_policy,
  5: string backend,
  6: i64 running,                // requests queued or running there
  7: i64 documents,              // documents it holds
  8: optional string error,      // why not healthy
  // A rank of a context group (absent: a single worker): the group's name,
  // this worker's rank, and the group's state ("formed": it takes requests
  // through its rank 0; else why not).
  9: optional string group,
  10: optional i32 group_rank,
  11: optional string group_state,
  // Its batch capacity (WorkerStats' capacity_* fields): sequences of
  // capacity_context_tokens it holds plus those that fit beside them now,
  // what stops the next one, and why its last waiting admission waited.
  12: optional i64 capacity_context_tokens,
  13: optional i64 capacity_sequences,
  14: optional string capacity_limit,
  15: optional string last_wait_reason,
}

// Public (no key): nothing about the deployment's hosts or paths.
struct HealthResponse {
  1: bool serving,               // false while draining or with no healthy worker
  2: string model,               // the model's name (its directory's name, not its path)
  3: list<WorkerStatus> workers, // always empty: the workers are in Stats, for an admin tenant
}

struct StatsResponse {
  1: i64 requests,
  2: i64 requests_failed,
  3: i64 requests_running,
  4: i64 documents,              // this tenant's
  5: i64 prompt_tokens,
  6: i64 cached_prompt_tokens,
  7: i64 generated_tokens,
  8: list<WorkerStatus> workers, // an admin tenant's (tenants file: admin: true) or without authentication; else empty
}

// ---- batch jobs --------------------------------------------------------------
// A job: many generations submitted at once, run in the background (items
// over the same document are routed to the worker that holds it and batch
// there), results fetched later. Durable: a coordinator restarted (even after
// kill -9) resumes every unfinished job, and each item's result is recorded
// exactly once. Needs a coordinator with a data directory.

enum JobStatus {
  VALIDATING = 1,
  IN_PROGRESS = 2,
  FINALIZING = 3,
  COMPLETED = 4,   // every item has a result (some may have failed)
  FAILED = 5,
  CANCELLING = 6,  // cancelled while items were running; CANCELLED once none is
  CANCELLED = 7,
  EXPIRED = 8,     // its completion window passed: unfinished items failed with "expired"
}

struct JobItem {
  1: string custom_id,          // the caller's name for it: unique in the job, 1..256 bytes
  // What to generate, as for Generate (its api_key and deadline_ms are not
  // used: the job's key and window apply).
  2: GenerateRequest request,
}

struct SubmitJobRequest {
  1: string api_key,
  2: list<JobItem> items,         // 1..50000
  3: i64 completion_window_s = 0, // 0: 24 hours; at most a week
  4: string metadata = "",        // kept with the job, returned as given; at most 16 KiB
  5: i64 deadline_ms = 0,
}

struct JobInfo {
  1: string id,
  2: JobStatus status,
  3: i64 created_unix_s,
  4: i64 expires_unix_s,
  5: i64 finished_unix_s,         // 0 until final
  6: i64 total,
  7: i64 pending,
  8: i64 running,
  9: i64 completed,               // items that succeeded
  10: i64 failed,
  11: i64 cancelled,
  12: string metadata,
}

struct JobList {
  1: list<JobInfo> jobs,          // oldest first
  2: string next_page_token,      // "" on the last page
}

struct JobItemResult {
  1: string custom_id,
  2: bool ok,
  3: string state,                // succeeded, failed, cancelled
  4: string text,                 // the answer (ok)
  5: list<i32> ids,               // its token ids (ok)
  6: string finish_reason,        // stop, length (ok)
  7: optional common.ErrorCode error_code,
  8: string error,                // why not ok
  9: common.Usage usage,
}

struct JobResults {
  1: list<JobItemResult> results, // finished items, by custom_id (bytewise)
  2: string next_after,           // pass as after_custom_id for the next page; "" on the last
}

service Penumbra {
  DocumentInfo PutDocument(1: PutDocumentRequest request) throws (1: common.PenumbraError error),
  DocumentInfo GetDocument(1: string api_key, 2: string document_id, 3: i64 deadline_ms)
      throws (1: common.PenumbraError error),
  DocumentList ListDocuments(1: ListDocumentsRequest request) throws (1: common.PenumbraError error),
  void DeleteDocument(1: string api_key, 2: string document_id, 3: i64 deadline_ms)
      throws (1: common.PenumbraError error),

  // Starts a generation; returns its request id. Tokens by Poll.
  string Generate(1: GenerateRequest request) throws (1: common.PenumbraError error),
  // The answer from `offset`, waiting up to wait_ms (0..60000) for more
  // tokens or the end (long polling).
  GenerateChunk Poll(1: string api_key, 2: string request_id, 3: i64 offset, 4: i32 wait_ms)
      throws (1: common.PenumbraError error),
  void Cancel(1: string api_key, 2: string request_id) throws (1: common.PenumbraError error),
  // Generate, wait for the end, return the whole answer (blocking).
  GenerateChunk Complete(1: GenerateRequest request) throws (1: common.PenumbraError error),

  JobInfo SubmitJob(1: SubmitJobRequest request) throws (1: common.PenumbraError error),
  JobInfo GetJob(1: string api_key, 2: string job_id) throws (1: common.PenumbraError error),
  JobList ListJobs(1: string api_key, 2: string page_token, 3: i32 page_size) throws (1: common.PenumbraError error),
  JobResults GetJobResults(1: string api_key, 2: string job_id, 3: string after_custom_id, 4: i32 page_size)
      throws (1: common.PenumbraError error),
  JobInfo CancelJob(1: string api_key, 2: string job_id) throws (1: common.PenumbraError error),
  // A finished job and its results; FAILED_PRECONDITION while it runs.
  void DeleteJob(1: string api_key, 2: string job_id) throws (1: common.PenumbraError error),

  HealthResponse Health(),
  StatsResponse Stats(1: string api_key) throws (1: common.PenumbraError error),
}
