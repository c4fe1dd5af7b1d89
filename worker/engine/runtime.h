// Runtime: a decoder-only transformer (Llama, Qwen2, Mistral) over a Backend
// and a KvPolicy. Prefill is chunked and layer-major (all of a prompt's chunks
// go through layer l before layer l+1, so a policy can compress layer l as
// soon as it is done); decode runs a batch of sequences of different lengths,
// one token each per step, dropping sequences as they finish.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "storage/segment_store.h"
#include "worker/engine/backend.h"
#include "worker/engine/collective.h"
#include "worker/engine/document_cache.h"
#include "worker/engine/kv_policy.h"
#include "worker/engine/model_weights.h"

namespace penumbra {

struct SamplingOptions {
  static constexpr float kMaxTemperature = 100.0f;
  float temperature = 0.0f;  // in [0, kMaxTemperature]; 0: greedy. Default: 0.
  int top_k = 0;             // >= 0; 0: off. Default: 0.
  float top_p = 1.0f;        // in (0, 1]; 1: off. Default: 1.
  uint64_t seed = 0;         // seeds this request's random draws. Default: 0.
  // InvalidArgument naming the field, its range and the value.
  Status Validate() const;
};

// A uniform in [0, 1) from 24 random bits: identical on every platform.
float NextUniform(std::mt19937_64& rng);
// One token's sampling parameters for a request whose random stream is `rng`
// (seeded with SamplingOptions::seed): every runner of a request (Generate,
// the scheduler) draws the same sequence, so seeded sampling repeats.
SampleParams SamplingDraw(const SamplingOptions& s, std::mt19937_64& rng);

struct GenerationRequest {
  std::vector<int32_t> prompt;
  // 0: prefill only (a document put): the prompt's segments are prefilled and
  // captured, nothing is generated ("prefilled"), and the last segment may end
  // with the prompt.
  int max_new_tokens = 16;
  SamplingOptions sampling;
  static constexpr int64_t kMaxStopIds = 1024;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these (at most kMaxStopIds)
  // Segments of the prompt for prefix reuse: the exclusive ends of its leading
  // segments (documents), ascending, each < prompt.size(); what follows the
  // last is the request's own text. With a prefix cache (RuntimeOptions::
  // prefix_cache_bytes) the longest cached run of leading segments is
  // attached instead of prefilled, and the leading segments prefilled here are
  // captured for the next request. Empty: no reuse.
  std::vector<int64_t> document_ends;
  // One per document_ends entry, or none: each document's content digest
  // (DocumentDigest, common/crypto.h, of its ids as they stand in the
  // prompt), from which its cache key is chained. Empty: computed from the
  // prompt. Given with the ids too, they must match (InvalidArgument).
  std::vector<Hash128> document_digests;
  // The prompt's ids before this position were not sent (they read as 0):
  // the documents ending there or before must be in the document cache
  // (memory or the persistent tier), found by their digests, or the request
  // fails with FailedPrecondition naming the first one missing (the sender
  // then sends it again with its ids). 0 (every id given) or one of
  // document_ends, with document_digests. Default: 0.
  int64_t ids_from = 0;
  // Prefixes are shared only between requests of one namespace (a tenant).
  std::string cache_namespace;
  // The KV policy to hold this request under, on a worker whose policy is
  // "auto" (a policy per document): "full" or "shadowkv"; a put pinned so
  // keeps its document in that form (the cache does not move it). Empty:
  // the worker's choice. On a worker of one policy it must be empty or that
  // policy (Runtime::Validate). Default: empty.
  std::string kv_policy;
  // Draws of the sampling stream (one per generated token) made already:
  // skipped. A request resumed on another worker, its prompt then ending
  // with the tokens generated so far, continues its stream. Default: 0.
  int64_t draws_done = 0;
};

// The checks every request passes before any work (Runtime::Validate runs
// them for each request): a non-empty prompt within the model's context with
// max_new_tokens (>= 0; 0: prefill only), its ids and the stop ids
// (at most GenerationRequest::kMaxStopIds) in the vocabulary, the sampling
// options, document ends ascending inside the prompt, the documents'
// digests (one per document, matching the ids that were sent) and ids_from,
// draws_done within the prompt, kv_policy empty, "full" or "shadowkv". Sizes are checked before contents. A pure
// function of the request and the model's configuration (no weights): the worker API's fuzzer runs it. InvalidArgument
// naming the field and the limit.
Status ValidateGenerationRequest(const GenerationRequest& request, const ModelConfig& config);

struct GenerationResult {
  std::vector<int32_t> ids;          // generated ids (the stop id included when hit)
  std::string finish_reason;         // "stop", "length" or "prefilled" (max_new_tokens 0)
  int64_t cached_prompt_tokens = 0;  // leading prompt tokens attached from the prefix cache
};

struct RuntimeOptions {
  int prefill_chunk = 4096;       // tokens per prefill chunk. Default: 4096.
  int max_batch = 256;            // sequences decoded together at most. Default: 256.
  size_t prefix_cache_bytes = 0;  // device bytes for captured prompt prefixes; 0: no prefix reuse. Default: 0.
  // Host bytes for them (a shadowkv prefix's values); 0: bounded only by the
  // device bytes. Default: 0.
  size_t prefix_cache_host_bytes = 0;
  // An insert that must evict evicts down to this fraction of the
  // capacities (DocumentMemoryTier). Default: 1 (only what is needed).
  double prefix_cache_low_watermark = 1.0;
  // Host bytes of captured prefixes waiting to be written to the persistent
  // store; a capture beyond it is not stored. Default: 16 GiB.
  size_t prefix_store_queue_bytes = size_t{16} << 30;
  // The blobs a policy can read lazily (KvPolicy::LazyBlobs: a ShadowKV
  // document's values) are stored in blocks of prefix_store_lazy_block_bytes
  // and, when a stored prefix is imported, read on demand (the chunks a
  // request selects, first) and then in the background, by
  // prefix_store_lazy_threads threads, instead of before the first token.
  // Defaults: true, 16 KiB, 32.
  bool prefix_store_lazy_reads = true;
  size_t prefix_store_lazy_block_bytes = 16384;
  int prefix_store_lazy_threads = 32;
  // With lazy reads, blobs up to this size are read whole first; larger ones
  // the policy reads from the segment straight into their destination
  // (tests set it to 0 to take that path with small models). Default: 16 MiB.
  uint64_t prefix_store_eager_blob_bytes = uint64_t{16} << 20;
  // A stored prefix the scheduler fetches ahead of admission (off the decode
  // loop: Runtime::FetchStoredPrefixes) is read whole, its lazily read blobs
  // too, so that no value is read from the store during a decode step: a
  // store node that stops answering then cannot stall the batch. The worker
  // sets it with store nodes (--store-node); a local store keeps lazy reads.
  // Default: false.
  bool prefix_store_fetch_whole = false;
  // Waiting for the queued writes to the store before a document's state is
  // forgotten (ForgetPrefixes) takes at most this. Default: 10 s.
  int64_t prefix_store_drain_ms = 10000;
  // A deployment secret (32 bytes: ClusterSecret::Derive("document-keys"))
  // that keys the document cache's keys (DocumentKeys: HMAC-SHA256 under
  // it), so that nobody without it can compute or guess a document's key;
  // empty: an unkeyed HMAC chain. Never logged. Default: empty.
  std::string document_key_secret;
  // The per-document policy (kv_policy auto, worker/engine/per_document_policy.h):
  // device bytes the documents and sequences held in the exact form by
  // choice may take; the document cache moves the least recently used
  // exact documents beyond it to ShadowKV. 0: half of prefix_cache_bytes.
  // Default: 0.
  size_t auto_exact_bytes = 0;
  // Tier 0: hot cached documents' host-resident state (shadowkv values) in
  // spare device memory (worker/engine/value_tiers.h). Default: off.
  TierOptions tiers;
  // Led mode (Runtime::LeadGroup): the leader sends the followers an empty
  // op after this long without one, so that an idle group's exchanges stay
  // within the collective's timeout. Default: 1000 ms.
  int64_t group_heartbeat_ms = 1000;
  // Context parallel prefill, balanced (docs/architecture.md, "Context
  // parallel"): every rank but the first hands the attention of the second
  // half of its shard's rows over each earlier rank's keys to that rank, so
  // that every rank does the same attention work (without it the last rank
  // does 2W - 1 times the first's). The exchange goes in rounds of at most
  // cp_balance_round_rows rows (its buffers: world^2 rounds' outputs). Every
  // rank of a group must agree on both (SetContextGroup checks). Defaults:
  // true, 8192.
  bool cp_prefill_balance = true;
  int cp_balance_round_rows = 8192;
};

struct RunStats {
  double prefill_seconds = 0;
  double decode_seconds = 0;
  int64_t prompt_tokens = 0;         // all prompt tokens, prefilled or attached
  int64_t cached_prompt_tokens = 0;  // ... of which were attached from the prefix cache
  int64_t generated_tokens = 0;
  int64_t prefix_store_hits = 0;          // prefixes imported from the persistent store
  int64_t prefix_store_corruptions = 0;   // stored prefixes found damaged (dropped, recomputed)
  int64_t prefix_store_errors = 0;        // stores that failed (the request went on)
  int64_t prefix_stores = 0;              // prefixes written to the persistent store
  int64_t prefix_store_skipped = 0;       // not stored: the write queue was full
  double prefix_store_write_seconds = 0;  // writing them (on the writer thread)
  double prefix_store_read_seconds = 0;   // reading stored prefixes (checked) from disk
  double prefix_import_seconds = 0;       // ... and importing them into the policy (to the device)
  int64_t prefix_store_read_bytes = 0;
  // Prefetched lookups the store did not answer (node down, slow or its
  // breaker open): the requests prefilled instead.
  int64_t prefix_store_fetch_failures = 0;
  TierStats tiers;  // tier 0 (device copies of hot documents' values)
  // kv_policy auto: documents moved from the exact form to ShadowKV, the
  // time it took (the lane's thread) and moves that failed; the memory
  // tier's documents and bytes by the policy holding them.
  int64_t document_moves = 0;
  double document_move_seconds = 0;
  int64_t document_move_failures = 0;
  std::map<std::string, DocumentFormUsage> documents_by_policy;
};

// How many more sequences of one length fit beside those a runtime holds,
// and what stops the next one (Runtime::Capacity).
struct BatchCapacity {
  int64_t context_tokens = 0;  // prompt + new tokens of the sequences counted
  int64_t held = 0;            // sequences held now (the caller's count)
  int64_t more = 0;            // of them that fit now beside those held
  // What stops the one after: "device memory", "host memory", "max_batch",
  // or "unknown" (the policy gives no estimate: `more` is then 0).
  std::string limit;
  SequenceBytes per_sequence;         // KvPolicy::EstimateSequenceBytes
  size_t device_available_bytes = 0;  // free now (tier 0's copies included), less kDeviceMemoryKeptFree
  size_t host_available_bytes = 0;    // free now, less kHostMemoryKeptFree
  int64_t sequences() const { return held + more; }
};

// Device memory the capacity estimate leaves free for a decode step's
// activations and workspaces (penumbra-bench decode fills the device to the
// same margin).
inline constexpr size_t kDeviceMemoryKeptFree = size_t{4} << 30;

class Runtime {
 public:
  // The policy must have been built with `ctx` (MakePolicyContext for this
  // model and backend), which outlives the runtime: its backend, RoPE table
  // and attention scale are the runtime's too.
  static Result<std::unique_ptr<Runtime>> Create(const RuntimeOptions& options, const PolicyContext& ctx,
                                                 const ModelWeights* weights, std::unique_ptr<KvPolicy> policy);

  // Validates every request (ValidateGenerationRequest against this model's
  // configuration; a batch's errors name the request) before doing any work.
  Status Validate(const std::vector<GenerationRequest>& requests) const;
  Result<std::vector<GenerationResult>> Generate(const std::vector<GenerationRequest>& requests);

  // A request's prefill in steps, for continuous batching (the scheduler
  // runs decode steps of other sequences between them). BeginPrefill
  // validates nothing (see Validate), attaches the longest cached run of
  // leading segments and reserves the sequence (ResourceExhausted when it
  // does not fit now: nothing is left behind); PrefillStep prefills the next
  // piece, never past a segment's end and, where the policy allows splitting
  // (KvPolicy::PrefillSplits), at most max_tokens (rounded down to whole
  // prefill chunks, so the result is the same as one unsplit prefill); where
  // it does not, the segment goes in a few layers per step (the work of
  // max_tokens tokens through every layer, at least one layer; the same ops
  // in the same order as one unsplit prefill), the rows' hidden states kept
  // in the state between steps,
  // capturing each leading segment it completes; it returns true when the
  // whole prompt is in, the last row's logits then in LastLogits() until the
  // next runtime call. Generate uses the same steps. Under a context group:
  // SetContextGroup (the sharded span, the tail, the ranks' agreement).
  // A prefill of prompt rows [start, end) part-way through the model's layers
  // (layer-major: the rows' hidden states stay on the device between steps).
  struct PartialPrefill {
    DeviceBuffer x, ids, pos;
    int64_t start = 0, end = 0;
    int layer = 0;  // the next layer to run
    double seconds = 0;
    int64_t prompt_end = 0;  // context parallel: the end of the whole prefill (all ranks' rows)
  };
  struct PrefillState {
    int64_t at = 0;                            // prompt tokens the sequence holds
    std::vector<Hash128> keys;                 // the leading segments' cache keys (empty: no reuse)
    bool capture = false;                      // capture the segments completed here
    std::shared_ptr<const KvPrefix> attached;  // the prefix the sequence started from (null: none)
    std::string form;                          // the policy the sequence is held under (KvPolicy::FormOf)
    size_t attached_segment = 0;               // ... the index of its last segment
    GenerationResult* result = nullptr;        // BeginPrefill's
    // A policy that cannot split a prefill by tokens (ShadowKV factors a
    // segment whole) is split by layers instead: the segment in progress.
    std::unique_ptr<PartialPrefill> partial;
    // Part-way through the prompt (some of it in, or a segment between layers).
    bool in_progress(int64_t prompt_len) const { return partial != nullptr || (at > 0 && at < prompt_len); }
  };
  // With `prefetched` (the scheduler's: what FetchStoredPrefixes read off
  // the loop thread) the persistent store is not asked anything here: a
  // prefix not in memory is `prefetched->found` or prefilled. Without it the
  // store is read here (Generate). `prefetched->found` is moved out.
  Status BeginPrefill(int64_t seq, const GenerationRequest& r, PrefillState* state, GenerationResult* result,
                      PrefetchedDocuments* prefetched = nullptr);
  // The stored prefixes BeginPrefill would look up for `r`, longest first:
  // its leading segments longer than the longest held in memory; empty
  // without a persistent store or segments (DocumentCache::Lookups). The
  // runtime's thread.
  std::vector<StoreLookup> StoreLookups(const GenerationRequest& r);
  // Reads the longest of `lookups` the store holds (whole when
  // prefix_store_fetch_whole), touching nothing of the runtime but the
  // store: any thread (the scheduler's store I/O threads). The store's
  // failures are counted in the result, never returned; a damaged stored
  // copy is queued for erasure (DocumentCache::Fetch).
  PrefetchedDocuments FetchStoredPrefixes(const std::vector<StoreLookup>& lookups) const;
  // A step that fails because the attached prefix failed a check while it
  // was read lazily drops that prefix (cache and store) and starts the
  // request over without it.
  Result<bool> PrefillStep(int64_t seq, const GenerationRequest& r, PrefillState* state, int64_t max_tokens);
  // Drops the cached state of `r`'s leading segments (each one the prompt's
  // document_ends name) from the prefix cache and the persistent store, so a
  // deleted document is not served again; sequences attached now keep their
  // reference until they end. Returns the entries dropped (cache and store);
  // an error when the store could not erase (or look up) a segment that may
  // be there (a node down, a full disk): then the document is not known to
  // be forgotten, and the caller asks again (the coordinator's tombstones).
  // DocumentCache::Forget over the request's keys.
  Result<int> ForgetPrefixes(const GenerationRequest& r);
  // Device logits [vocab] of the last prefilled row.
  const float* LastLogits() const { return logits_.as<float>(); }

  // ---- Context parallel (docs/architecture.md, "Context parallel") ----
  // Makes this runtime rank group->rank() of a group whose ranks each hold a
  // contiguous shard of every sequence (ShardOf): the ranks make the same
  // calls with the same arguments (SPMD: Generate, or BeginPrefill,
  // PrefillStep, DecodeStep, RemoveSequence and ForgetPrefixes; or the
  // lower-level AddSequence, Prefill and DecodeStep); each prefills only its
  // shard's rows, attending to the earlier shards' keys of each layer
  // (gathered from their ranks), and each decode step's attention is every
  // rank's part over its own shard, merged exactly by log-sum-exp; the new
  // tokens are stored by the last rank. Every rank computes the same logits;
  // the tokens sampled by rank 0 are everybody's.
  // A request's sharded span is [0, D), D = document_ends.back() (the whole
  // prompt without documents); the tail [D, P) is the last rank's, fed one
  // token per step through the decode path (its last token's logits are
  // LastLogits()). PrefillStep prefills the span a few layers per step
  // (every rank the same layers: max_tokens x layers / D of them, at least
  // one), then the tail (max_tokens / 128 tokens per step, at least one: a
  // tail token costs a decode step of the group, about what 128 prefill
  // tokens do; a put, max_new_tokens 0, skips the tail).
  // With the document cache each rank captures its own shard of the whole
  // documents (the last document's key, under a fence naming rank and
  // world: DocumentCache::SetShard) when the span is in; BeginPrefill looks
  // up every rank's shard (memory, then the persistent tier, here: the
  // scheduler's StoreLookups are empty) and one all-gather decides: attach
  // when every rank holds its shard (cached_prompt_tokens = D), else every
  // rank prefills from the ids, or, with ids_from > 0, every rank fails
  // with the same FailedPrecondition. A step that fails on any rank fails on
  // every rank, naming it (an all-gather of the ranks' statuses after the
  // local work; a prefill step's at each layer too); the sequence is then
  // removed by the caller (BeginPrefill leaves nothing). A decode step that
  // fails on a rank part-way through its layers' exchanges breaks the group
  // (GroupHealth). group outlives the runtime; null: none. May be called
  // again with a new group once every sequence is removed (the document
  // cache stays: its shards are found again under the same rank and world).
  Status SetContextGroup(Collective* group);
  struct Shard {
    int64_t begin = 0, end = 0;  // prompt positions [begin, end)
  };
  // Rank `rank`'s shard of a prompt of `tokens` tokens: near-equal
  // contiguous parts, boundaries at multiples of 64 tokens where each part
  // still gets some.
  static Shard ShardOf(int64_t tokens, int rank, int world);
  Collective* context_group() const { return cp_; }

  // ---- Led mode: the service's group (one scheduler, on rank 0) ----
  // Rank 0: from now on each call of BeginPrefill, PrefillStep, DecodeStep,
  // RemoveSequence and ForgetPrefixes is first sent to the followers (its
  // op, the request's fields, the step's arguments and the sampled tokens)
  // and then run here, the followers running the same call with states of
  // their own; the caller (the scheduler) sees no difference. An idle
  // leader sends an empty op every group_heartbeat_ms. Generate is refused
  // while leading. FailedPrecondition without a group or on another rank.
  Status LeadGroup();
  // Ranks > 0: runs the leader's calls until it calls StopGroup (OK) or the
  // group fails (its error); every sequence it holds is then removed.
  // Followers never sample: the tokens come with the decode steps.
  Status FollowGroup();
  // Rank 0, after its caller's last call (the scheduler stopped): ends led
  // mode and the followers' FollowGroup.
  Status StopGroup();
  // OK, or the group's first failure (a peer gone, a deadline): every later
  // group call fails at once with it, until SetContextGroup.
  Status GroupHealth() const;
  ~Runtime();

  // Lower-level steps (benchmarks, tests). Under a context group,
  // AddSequence adds this rank's shard of the sequence.
  Status AddSequence(int64_t seq, int64_t prompt_len, int64_t max_new_tokens);
  void RemoveSequence(int64_t seq);
  // Prefills prompt[start, end) into `seq`, whose first `start` tokens are
  // already there (attached or prefilled before; 0: none); end < 0 means
  // prompt.size(). Writes the last row's logits to logits_out (host, vocab
  // floats) when non-null. A sequence's first prefill must end at its
  // SequenceSpec::first_prefill.
  Status Prefill(int64_t seq, const std::vector<int32_t>& prompt, std::vector<float>* logits_out, int64_t start = 0,
                 int64_t end = -1);
  // One decode step: tokens[i] is fed to seqs[i] at positions[i]; returns
  // logits [batch, vocab] on the device (valid until the next call).
  Result<const float*> DecodeStep(const std::vector<int64_t>& seqs, const std::vector<int32_t>& tokens,
                                  const std::vector<int64_t>& positions);

  KvPolicy& policy() { return *policy_; }
  Backend& backend() { return *backend_; }
  // While non-null, DecodeStep and the policy's decode ops lap into
  // `profiler` (synchronizing after each op; slower). Not owned.
  void SetDecodeProfiler(OpProfiler* profiler) {
    profiler_ = profiler;
    policy_->SetDecodeProfiler(profiler);
  }
  const ModelConfig& config() const { return weights_->config(); }
  int max_batch() const { return options_.max_batch; }
  // How many more whole sequences of prompt_tokens + max_new_tokens fit now
  // beside the `held` the caller counts (the scheduler: admitted ones), by
  // the policy's estimate of a sequence's bytes against the memory free now
  // (device; host for a value store; one pool on the CPU backend, whose
  // "device" memory is host memory), and at most max_batch - held
  // (max_batch: the caller's batch limit, capped at max_batch()). The
  // runtime's thread, or any thread while it is idle.
  BatchCapacity Capacity(int64_t prompt_tokens, int64_t max_new_tokens, int64_t held,
                         int max_batch = std::numeric_limits<int>::max());
  // The document cache's counters (DocumentCache::stats) are folded in at
  // each call.
  RunStats stats() const;
  // Blocks until every queued write to the persistent store has finished, at
  // most `max_wait`; true when they all have.
  bool DrainPrefixStores(std::chrono::milliseconds max_wait = std::chrono::milliseconds::max()) {
    return cache_ ? cache_->Drain(max_wait) : true;
  }
  // The document cache (all its tiers); null when prefix reuse is off.
  DocumentCache* document_cache() { return cache_.get(); }
  // Its memory tier; null when prefix reuse is off.
  DocumentMemoryTier* prefix_cache() { return cache_ ? &cache_->memory() : nullptr; }
  // One placement step of the cached documents over the tiers (ValueTiers:
  // tier 0 copies of hot documents' values; DocumentCache::Place). Every
  // prefill and decode step runs one first; a caller may run more between
  // steps (an idle worker).
  void PlaceDocuments() {
    if (cache_) cache_->Place();
  }
  // The persistent tier behind the memory tier (not owned; shared by the
  // engine's lanes) and the model's identity, part of every key
  // (DocumentCache::SetPersistentTier). Captured documents are written to it
  // in the background (DocumentWriter). Nothing without prefix reuse.
  void SetPrefixStore(storage::DocumentStore* store, std::string model_identity);

 private:
  // Prefill's three parts: the rows' embeddings, `layers` more layers, and the
  // last row's logits (then the stats).
  Result<std::unique_ptr<PartialPrefill>> StartPrefill(const std::vector<int32_t>& prompt, int64_t start, int64_t end);
  // Context parallel: each layer ends with the ranks' agreement (Agree).
  Status PrefillLayers(int64_t seq, PartialPrefill* p, int layers);
  // Layer l of every row (PrefillLayers' body).
  Status PrefillLayer(int64_t seq, PartialPrefill* p, int l);
  // Layer l of rows [begin, end) of the prefill, no exchange. Each chunk's
  // own attention (attn_; its log-sum-exps in cp_lse_ under a context
  // group) goes through combine(off, n) before the output projection when
  // given; without it a rank > 0 of a context group merges the earlier
  // ranks' keys (cp_prefix_k_/v_).
  Status PrefillRows(int64_t seq, PartialPrefill* p, int l, int64_t begin, int64_t end,
                     const std::function<Status(int64_t off, int n)>& combine = {});
  Status FinishPrefill(PartialPrefill* p, std::vector<float>* logits_out);
  // Context parallel, prefill: the most rows any rank holds of a prompt of
  // `prompt_end` tokens; the exchange's buffers and RopeStore pointer table
  // for a prefill (once, before its first layer); then, per layer, the K/V of
  // every rank's rows gathered, the earlier ranks' in cp_prefix_k_/v_
  // ([hkv][p->start][d]).
  int64_t MaxShardRows(int64_t prompt_end) const;
  // Balanced prefill (RuntimeOptions::cp_prefill_balance): the rows of rank
  // j's shard that attend to the earlier ranks' keys on rank j (the first
  // ones; the rest, "handed over", get that attention from each earlier rank
  // over its own keys), the most rows any rank hands over (0: not balanced),
  // and the rows of one round of the exchange.
  int64_t KeptRows(int64_t prompt_end, int j) const;
  int64_t MaxHandedRows(int64_t prompt_end) const;
  int64_t BalanceRoundRows(int64_t prompt_end) const;
  // The prefill's exchange buffers for a prompt of prompt_end tokens
  // (defined in runtime.cc).
  struct ExchangeLayout;
  ExchangeLayout LayoutFor(int64_t prompt_end) const;
  // The handed-over rows of layer l, round by round: this rank's part of the
  // later ranks' rows (over its own keys), one all-gather of every rank's
  // parts, then its own handed rows merged with the earlier ranks' parts.
  // Every rank makes every round's all-gather even after a local failure
  // (*local), so that all reach the layer's agreement.
  void PrefillHandedRows(int64_t seq, PartialPrefill* p, int l, Status* local);
  Status PrepareKeyExchange(const PartialPrefill& p);
  Status GatherEarlierKeys(PartialPrefill* p, int l);
  // Context parallel, decode: where this rank's attention part of `rows`
  // rows goes (its output, then its log-sum-exps: one message per layer),
  // and the merge of every rank's part into attn_.
  void* RankPart() const { return cp_part_.get(); }
  float* RankPartLse(int rows) const;
  Status MergeRanks(int rows);
  // Captures segment `seg` of `r` (ending at `end`) into the document cache
  // (memory and the persistent tier) unless present.
  Status CaptureSegment(int64_t seq, const GenerationRequest& r, PrefillState* st, size_t seg, int64_t end);
  // The cache keys of `r`'s leading documents (DocumentCache::Keys over its
  // digests, computed from the prompt when it has none).
  std::vector<Hash128> RequestKeys(const GenerationRequest& r) const;
  // Adds request `r`'s sequence `seq`, attaches its longest cached prefix,
  // prefills the rest and captures its new leading segments.
  Status AddAndPrefill(int64_t seq, const GenerationRequest& r, GenerationResult* result);
  Result<const float*> DecodeStepImpl(const std::vector<int64_t>& seqs, const std::vector<int32_t>& tokens,
                                      const std::vector<int64_t>& positions);
  Runtime(const RuntimeOptions& o, const PolicyContext& ctx, const ModelWeights* w, std::unique_ptr<KvPolicy> p);
  Status AllocateScratch(int rows);
  // One transformer layer's MLP and attention residual updates for rows of x.
  void Mlp(const LayerWeights& L, float* x, int n);

  RuntimeOptions options_;
  Backend* backend_;
  const float* inv_freq_;  // the policy context's device RoPE table
  float attn_scale_;       // ... and 1/sqrt(head_dim)
  const ModelWeights* weights_;
  std::unique_ptr<KvPolicy> policy_;
  int scratch_rows_ = 0;
  DeviceBuffer x_, h_, qkv_, q_, attn_, gu_, ffn_, logits_, ids_, pos_;
  RunStats stats_;
  OpProfiler* profiler_ = nullptr;
  Collective* cp_ = nullptr;  // context group (null: none)
  // Context parallel scratch: prefill rows' own log-sum-exps [rows][hq];
  // decode: this rank's part (RankPart) and every rank's, gathered; prefill:
  // this rank's layer K/V [2][hkv][rows][d] with its RopeStore pointer
  // table, all ranks' gathered, the earlier ranks' K and V contiguous, row
  // indices 0..n-1.
  DeviceBuffer cp_lse_, cp_part_, cp_parts_, cp_kv_, cp_kv_ptrs_, cp_kv_all_, cp_prefix_k_, cp_prefix_v_, cp_iota_;
  DeviceBuffer cp_handed_;  // balanced prefill: every rank's round parts, [world][world] slots
  Result<bool> PrefillStepImpl(int64_t seq, const GenerationRequest& r, PrefillState* state, int64_t max_tokens);
  // ---- Context parallel steps (every rank the same call) ----
  // The sharded span's end, D (SetContextGroup).
  static int64_t SpanOf(const GenerationRequest& r);
  // This rank's shard of a span of D tokens, followed by `tail` tokens
  // (fed as decode steps), from `prefix` (its shard's capture; null: none).
  Status AddShard(int64_t seq, int64_t span, int64_t tail, int64_t max_new_tokens,
                  std::shared_ptr<const KvPrefix> prefix);
  Status GroupBegin(int64_t seq, const GenerationRequest& r, PrefillState* state, GenerationResult* result);
  Result<bool> GroupStep(int64_t seq, const GenerationRequest& r, PrefillState* state, int64_t max_tokens);
  Status GroupSpanStep(int64_t seq, const GenerationRequest& r, PrefillState* state, int64_t max_tokens);
  Result<const float*> GroupDecode(const std::vector<int64_t>& seqs, const std::vector<int32_t>& tokens,
                                   const std::vector<int64_t>& positions);
  Result<int> GroupForget(const GenerationRequest& r);
  // BeginPrefill and every PrefillStep, to the end (Generate).
  Status GroupPrefill(int64_t seq, const GenerationRequest& r, GenerationResult* result);
  // Captures this rank's shard of `r`'s documents (own_tokens of it).
  Status CaptureShard(int64_t seq, const GenerationRequest& r, PrefillState* st, int64_t own_tokens);
  // Every rank's outcome of a step: OK when all succeeded, else the first
  // failing rank's (its code and text, the same on every rank). `count`
  // (may be null) is summed over the ranks.
  Status Agree(const Status& local, int64_t* count = nullptr);
  // Records the group's first failure; returns it.
  Status Broken(const Status& why);
  // Led mode: the leader sends an op record (and the heartbeat's empty
  // ones); a follower receives and runs one.
  Status SendOp(std::string record);
  Status RunOp(const std::string& record, bool* stop);
  void HeartbeatLoop();
  void StopHeartbeat();
  struct Followed {
    GenerationRequest req;
    PrefillState state;
    GenerationResult result;
  };
  std::map<int64_t, std::unique_ptr<Followed>> followed_;  // a follower's sequences
  std::atomic<bool> leading_{false};
  std::mutex lead_mu_;  // the leader's ops (each sent, then run) and heartbeats, one at a time
  std::chrono::steady_clock::time_point last_op_;  // under lead_mu_
  std::thread heartbeat_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;  // under hb_mu_
  mutable std::mutex health_mu_;
  Status health_;  // under health_mu_
  // reuse false: no prefix looked up nor captured.
  Status BeginPrefillImpl(int64_t seq, const GenerationRequest& r, PrefillState* state, GenerationResult* result,
                          bool reuse, PrefetchedDocuments* prefetched = nullptr);
  // Declared after the policy it uses: destroyed first (its writes drained).
  std::unique_ptr<DocumentCache> cache_;
};

// Builds the policy context (device RoPE table included) for a model.
struct PolicyContextHolder {
  PolicyContext ctx;
  DeviceBuffer inv_freq;
};
Result<std::unique_ptr<PolicyContextHolder>> MakePolicyContext(Backend* backend, const ModelConfig& config);

}  // namespace penumbra
