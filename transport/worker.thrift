// The control API: the coordinator (or a test, or `penumbra`'s local mode)
// to one worker process. Requests are token ids (the coordinator tokenizes)
// and documents named by digest (their ids sent only when the worker lacks
// them); the worker batches them continuously (worker/service/scheduler.h).
include "common.thrift"

namespace cpp penumbra.rpc
namespace py penumbra.rpc.worker

// A document of a request, named by its content digest: its ids are sent
// only when the worker may lack it. The worker finds a document it holds (in
// memory, on its disk or on a value-store node) by the digest alone.
struct WorkerDocument {
  // DocumentDigest (common/crypto.h) of its ids as they stand in the
  // prompt: 16 bytes.
  1: binary digest,
  2: i64 tokens,             // its length, > 0
  // Absent: the worker must hold it, else the request fails with
  // FAILED_PRECONDITION (at Generate or when polled) and the caller sends it
  // again with the ids. Present: checked against the digest.
  3: optional list<i32> ids,
}

// A question: its documents, then its own tokens.
struct WorkerGenerateRequest {
  // The prompt's tokens after its documents (the question; a resumed
  // request's generated tokens too). Non-empty.
  1: list<i32> prompt,
  // 2: the whole prompt's document ends (before documents were named by digest).
  // The documents that lead the prompt, in order: the document cache's unit
  // (reused across requests of one namespace). Those without ids come first.
  12: list<WorkerDocument> documents,
  3: string cache_namespace,
  4: i32 max_new_tokens = 16,
  5: common.SamplingOptions sampling,
  6: list<i32> stop_ids,
  // Milliseconds from the worker's receipt after which the request ends with
  // DEADLINE_EXCEEDED (0: none).
  7: i64 deadline_ms = 0,
  // The tenant's (cache_namespace's) fair share of admission, > 0: under
  // load, tenants' waiting requests are admitted in proportion to it.
  8: double share_weight = 1.0,
  // Whose request it is, for the fair share ("": cache_namespace). Differs
  // from cache_namespace when the documents are a corpus another tenant
  // publishes to this one.
  9: string tenant = "",
  // Random draws the request's sampling stream has made already: a request
  // resumed on another worker (its prompt then ends with the tokens
  // generated so far) continues the same stream, so seeded sampling gives
  // what it would have given without the move. At most the prompt's length
  // (each draw made one of its tokens).
  10: i64 draws_done = 0,
  // The coordinator instance that owns the generation (its owner id: random,
  // kept in its data directory so a restart is the same owner; at most 64
  // characters of [0-9A-Za-z_-]). The generation lives as long as its owner
  // renews its lease (Renew): an owner silent past the worker's lease has
  // its generations cancelled and forgotten. "": no owner, no lease (a test
  // or a local caller that polls to the end itself).
  11: string owner_id = "",
  // On a worker whose KV policy is "auto" (a policy per document): "full" or
  // "shadowkv" holds the request under that policy; "": the worker's choice.
  // A worker of one policy refuses any other than its own.
  13: string kv_policy = "",
}

// A worker's place in a context group (one sequence sharded over the
// group's ranks: docs/architecture.md, "Worker groups"), as it reports it.
struct WorkerGroupState {
  1: string name,         // the group's name (its --group)
  2: i32 rank,
  3: i32 world,
  // "unformed" (never joined), "forming" (joining), "formed" (serving:
  // rank 0 takes requests for the whole group), "broken" (a rank was lost:
  // the group must be formed again).
  4: string state,
  5: i64 epoch,           // the formation it is in (JoinGroup's), 0 before the first
  6: string error,        // why it is broken, or why the last join failed
}

struct WorkerHealth {
  1: bool serving,        // false while draining
  2: string model,        // the model directory
  3: string backend,      // e.g. "cpu", "cuda:0 NVIDIA H100 80GB HBM3"
  4: string kv_policy,    // "full", "shadowkv", "spindlekv", "specontext" or "auto" (a form per document: kv_forms)
  5: i64 max_context,     // the model's max_position_embeddings
  6: i32 vocab_size,
  7: list<i32> eos_ids,   // the model's end-of-text ids
  // A member of a context group (absent: a single worker).
  8: optional WorkerGroupState group,
  // Device bytes one token of context takes under this worker's KV policy
  // (an estimate: the coordinator places a document on a group when it
  // would not fit one worker's free memory). 0: not known.
  9: i64 device_bytes_per_token = 0,
  // The policies a request or document pinned to one of them is held under
  // here: [kv_policy], or auto's forms ("full", "shadowkv", and "spindlekv"
  // where the backend runs it). Empty from a worker that predates it.
  10: list<string> kv_forms,
}

// The coordinator forming a group: every rank is told the group's epoch
// and secret; rank 0 first (rendezvous ""), which listens and answers
// where; then the others with that rendezvous.
struct WorkerJoinGroup {
  1: string name,          // must be this worker's --group
  2: i64 epoch,            // > the formation it is in
  3: i32 world,            // must be this worker's --group-world
  4: i32 rank,             // must be this worker's --group-rank
  5: string rendezvous,    // "" on rank 0 (it listens); HOST:PORT for the others
  6: string secret,        // the formation's secret (hex, >= 32 digits): every rank proves it holds it
}

struct WorkerStats {
  1: i64 submitted,
  2: i64 finished,
  3: i64 failed,
  4: i64 cancelled,
  5: i64 queued,
  6: i64 prefilling,
  7: i64 decoding,
  8: i64 decode_steps,
  9: i64 interleaved_decode_steps,
  10: i64 prompt_tokens,
  11: i64 cached_prompt_tokens,
  12: i64 generated_tokens,
  13: i64 admission_waits,
  14: double prefill_piece_max_seconds,  // the longest prefill piece (the running batch waited that long)
  // Free memory of the worker's device (host RAM on a CPU worker), sampled
  // about once a second; -1 not known yet. The coordinator places by it.
  15: i64 memory_free_bytes = -1,
  // Generations cancelled because their owner's lease expired (Renew).
  16: i64 lease_expired = 0,
  // Documents written to the persistent tier (disk or value-store node):
  // background writes that have finished. Refreshed about once a second.
  17: i64 documents_stored = 0,
  // How many sequences of capacity_context_tokens (prompt + new tokens; the
  // model's max_position_embeddings unless --capacity-context) the worker
  // holds and how many more fit beside them now, and what stops the next
  // one: "device memory", "host memory" or "max_batch" ("unknown": the KV
  // policy gives no estimate). One such sequence's device and host bytes
  // (the policy's estimate). Sampled about once a second.
  18: i64 capacity_context_tokens = 0,
  19: i64 capacity_held = 0,
  20: i64 capacity_more = 0,
  21: string capacity_limit = "",
  22: i64 sequence_device_bytes = 0,
  23: i64 sequence_host_bytes = 0,
  // Why the last admission that had to wait did not fit (the engine's
  // message, or "max_batch N"), and the decoding batch then; "" / 0 before any.
  24: string last_wait_reason = "",
  25: i64 last_wait_batch = 0,
}

// A document put: its state factored into the document cache (memory, and
// the persistent tier when the worker has one), nothing generated.
struct WorkerPutRequest {
  // The document(s), each with its ids: the last is factored after the ones
  // before (which are attached when held, factored too otherwise).
  1: list<WorkerDocument> documents,
  2: string cache_namespace,
  3: i64 deadline_ms = 0,        // as WorkerGenerateRequest's
  4: double share_weight = 1.0,  // as WorkerGenerateRequest's
  5: string tenant = "",         // as WorkerGenerateRequest's
  6: string owner_id = "",       // as WorkerGenerateRequest's
  7: string kv_policy = "",      // as WorkerGenerateRequest's: the document held under it
}

// A put's state, as WaitPut returns it.
struct WorkerPutProgress {
  1: bool done,
  // Once done: "prefilled" (factored), "cancelled", "deadline" or "error".
  2: string finish_reason,
  3: optional common.ErrorCode error_code,
  4: optional string error_message,
  5: i64 factored_tokens,        // the documents' tokens in so far (attached or factored)
  6: i64 tokens,                 // all of the documents' tokens
  7: i64 cached_tokens,          // of them, attached from the document cache (already held)
  8: double queue_seconds,       // submitted -> admitted; < 0 until admitted
}

// One generation of a PollMany: its handle and the offset its caller has.
struct WorkerPollTarget {
  1: string handle,
  2: i64 offset,
}

// Every call needs the caller's certificate of role coordinator when the
// worker runs with TLS (mutual TLS; docs/operations.md, "Security").
service Worker {
  // Queues a request; returns its handle: 128 random bits as 32 hex digits,
  // known only to the caller that made it (another caller's Poll, Cancel or
  // Release of it is NOT_FOUND). INVALID_ARGUMENT for a bad request,
  // RESOURCE_EXHAUSTED (retry_after_ms) when the queue is full, UNAVAILABLE
  // while draining.
  string Generate(1: WorkerGenerateRequest request) throws (1: common.PenumbraError error),
  // Tokens from `offset`, waiting up to wait_ms (<= 60000) for more or the end.
  common.TokenChunk Poll(1: string request_id, 2: i64 offset, 3: i32 wait_ms)
      throws (1: common.PenumbraError error),
  // Long polls several generations at once (a coordinator's one poll of
  // this worker for all of its streams): returns when any target has tokens
  // past its offset or has ended, or after wait_ms (<= 60000); one chunk per
  // target, in order. A target whose own poll fails (not this caller's:
  // NOT_FOUND; an offset past its tokens: INVALID_ARGUMENT) gets a chunk
  // with that error_code and done false, which no generation's chunk has (a
  // generation's error ends it: done). At most 4096 targets.
  list<common.TokenChunk> PollMany(1: list<WorkerPollTarget> targets, 2: i32 wait_ms)
      throws (1: common.PenumbraError error),
  void Cancel(1: string request_id) throws (1: common.PenumbraError error),
  // Forgets a request: a finished one at once, a running one is cancelled
  // and forgotten when it ends. A draining worker waits (a while) until the
  // answers of its finished requests are released before it exits.
  void Release(1: string request_id) throws (1: common.PenumbraError error),
  // Queues a document put; returns its handle (as Generate's: Poll's
  // errors, Cancel and Release apply to it). Errors as Generate's.
  string PutDocument(1: WorkerPutRequest request) throws (1: common.PenumbraError error),
  // A put's progress: returns when it is done or has more than
  // `factored_tokens` tokens in, else after wait_ms (<= 60000): one long
  // poll per step of progress.
  WorkerPutProgress WaitPut(1: string handle, 2: i64 factored_tokens, 3: i32 wait_ms)
      throws (1: common.PenumbraError error),
  // Drops the cached state (every tier: memory, disk, value-store node) of
  // a chain of documents (ids not needed): a deleted document. Returns the
  // entries dropped. An error (e.g. UNAVAILABLE: a store node down) when
  // stored state may be left: the document is not known to be forgotten;
  // ask again.
  i32 ForgetDocuments(1: list<WorkerDocument> documents, 2: string cache_namespace)
      throws (1: common.PenumbraError error),
  // Renews the lease of owner `owner_id` (of the calling certificate) on
  // this worker's generations and returns the handles this caller's
  // generations of that owner have here (running or finished, not yet
  // released): a restarted coordinator claims the ones it journalled and
  // cancels the others. INVALID_ARGUMENT for a malformed owner id.
  list<string> Renew(1: string owner_id) throws (1: common.PenumbraError error),
  WorkerHealth Health(),
  // Joins (or re-forms) the context group this worker is a member of
  // (--group): returns at once with the rendezvous (rank 0: where it
  // listens) while the join goes on; Health's group.state says when it is
  // formed. INVALID_ARGUMENT when name, world or rank are not this
  // worker's, or the epoch is not newer; FAILED_PRECONDITION for a worker
  // in no group.
  string JoinGroup(1: WorkerJoinGroup join) throws (1: common.PenumbraError error),
  WorkerStats Stats(),
}
