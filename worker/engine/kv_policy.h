// KvPolicy: where a sequence's keys and values live and how attention reads
// them. The runtime owns the transformer; a policy owns everything from the
// QKV projection's output to the attention output:
//   RoPE -> store K/V -> (select) -> attention.
// Policies: "full" (exact KV cache on the device), "shadowkv" (low-rank
// pre-RoPE keys, landmarks, outliers on the device; values in a ValueStore)
// and "auto" (a policy per document: each sequence held under one of the
// other two, worker/engine/per_document_policy.h).
// "spindlekv" (worker/engine/spindlekv_policy.cc) evicts and shares
// codebook entries without offload; "specontext"
// (worker/engine/specontext_policy.h) selects from every layer's exact KV
// by a retrieval head run on the tokens before the layers.
//
// Call protocol, per sequence: AddSequence; then one or more prefills, each
// a contiguous run of the prompt (the first from 0, or from an attached
// prefix's end): PrefillTokens, then for each layer in order,
// PrefillAttention over the run's chunks in order, then FinishPrefillLayer;
// then decode steps: BeginDecodeStep(batch) ; DecodeTokens ; DecodeAttention
// for each layer ; FinishDecodeStep. RemoveSequence frees everything. Not thread-safe: one
// runtime thread drives a policy.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "storage/lazy_blob.h"
#include "worker/engine/backend.h"
#include "worker/engine/op_profiler.h"

namespace penumbra {

class Collective;
class FetchTurns;

// The exact keys and values of a prompt's first `tokens` tokens as the full
// policy holds them: [layers][hkv][head_stride] each, act dtype, device
// memory, keys with RoPE applied at positions 0..tokens-1.
struct ExactKv {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t tokens = 0;
  int64_t head_stride = 0;  // elements between heads (>= tokens * head_dim)
};

// The KV state of a prompt prefix, made by a policy from a prefilled sequence
// and attached to new sequences, which then skip the prefix's prefill (the
// document cache's unit: one or more leading segments of a prompt; see
// docs/architecture.md, "Prefix reuse"). Immutable once made; shared by
// reference (std::shared_ptr) between the cache and every sequence attached
// to it, so it lives while any of them holds it. It belongs to the policy (and
// backend) that made or imported it: attach it only there.
class KvPrefix {
 public:
  virtual ~KvPrefix() = default;
  virtual std::string policy() const = 0;          // the making policy's name()
  virtual int64_t tokens() const = 0;              // prefix length in tokens
  virtual size_t device_bytes() const = 0;         // device memory it holds
  virtual size_t host_bytes() const { return 0; }  // host memory it holds (values in DRAM)
  // Its state as named host byte blobs (what the persistent document cache
  // stores); ImportPrefix of the same policy and geometry inverts it.
  virtual Result<std::map<std::string, std::string>> Export() const = 0;
  // OK unless part of it, read lazily from the persistent store, failed a
  // check (then it must not be attached again: the runtime drops it).
  virtual Status health() const { return Status::OK(); }

  // ---- placement (worker/engine/value_tiers.h) ----
  // A prefix whose state lives partly in host memory (shadowkv's values) can
  // keep a copy of that part in spare device memory (tier 0), so sequences
  // attached to it read it there instead of over the host link. Placement is
  // not part of the prefix's content (what it attaches as is the same
  // wherever it is), so these are const; they are called only by the thread
  // that drives the policy owning the prefix, between steps (no kernel of
  // that policy in flight reads what Demote frees).
  // Device bytes a complete tier-0 copy takes (0: nothing to promote, e.g.
  // full's K/V, already on the device; or host state not complete yet).
  virtual size_t promotable_bytes() const { return 0; }
  // Device bytes of the tier-0 copy now (a promotion goes layer by layer).
  virtual size_t promoted_bytes() const { return 0; }
  // Copies one more part (a layer) to the device, at most `max_bytes`;
  // returns true once the copy is complete. ResourceExhausted when the
  // device has no room (nothing held by this call).
  virtual Result<bool> PromoteStep(size_t max_bytes) const { return true; }
  // Frees the tier-0 copy (readers go back to the host copy).
  virtual void Demote() const {}
  // Host-state rows the engine read from this prefix since the last call
  // (shadowkv: value chunks fetched by decode steps and continuations): the
  // tier manager's measure of how much a device copy would save.
  virtual int64_t TakeReads() const { return 0; }
  // Rows read from it so far (not reset by TakeReads).
  virtual int64_t total_reads() const { return 0; }
  // Its exact keys and values, when it holds them (the full policy's): the
  // source a per-document policy factors a ShadowKV form from.
  virtual bool exact_kv(ExactKv* out) const {
    (void)out;
    return false;
  }
};

// Model geometry and shared device tables a policy needs.

struct PolicyContext {
  Backend* backend = nullptr;
  FetchTurns* fetch_turns = nullptr;  // lanes' turns on the host link (null: none)
  int lane = 0;                       // this policy's lane in fetch_turns
  int num_layers = 0, hq = 0, hkv = 0, head_dim = 0;
  const float* inv_freq = nullptr;  // device [head_dim/2]
  float scale = 1.0f;               // 1/sqrt(head_dim)
};

struct PolicyStats {
  int64_t decode_steps = 0;
  int64_t selected_chunks = 0;  // sparse policies: chunks selected over all steps/layers/heads
  int64_t hit_chunks = 0;       // ... of which were already on the device
  // Continuations (prefills after a factored prompt) begun, by how they
  // attended to it.
  int64_t sparse_continuations = 0;
  int64_t dense_continuations = 0;
  // Sparse decode: sequence-layers whose chunks were scored, and of them
  // those in a group of sequences attached to one document (scored together
  // where the backend can: ShadowkvScoreArgs::one_prefix).
  int64_t scored_sequences = 0;
  int64_t one_prefix_sequences = 0;
  // Compressing policies without offload (spindlekv): the bytes of the
  // compressed state each layer of a first prefill became, and of the exact
  // K/V (f32) of the same tokens; their ratio is the paper's reserve ratio r
  // as measured (indices, magnitudes and codebooks included).
  int64_t kv_exact_bytes = 0;
  int64_t kv_kept_bytes = 0;
  std::map<std::string, double> prefill_op_ms;  // when profiling: per-op prefill milliseconds
  double hit_rate() const { return selected_chunks ? static_cast<double>(hit_chunks) / selected_chunks : 0.0; }
};

// Context parallel (docs/architecture.md, "Context parallel"): a sequence
// split into contiguous shards over the ranks of a group, each rank's policy
// holding one shard as a sequence of its own. Positions passed to the
// policy stay the whole sequence's (RoPE, the decode order); the shard's
// first token is at position_base.
struct ShardSpec {
  int64_t position_base = 0;
  // A shard that is not the last: decode steps attend to its tokens and store
  // nothing in it (the new tokens go to the last shard). prompt_len and
  // max_new_tokens then count only the shard's own tokens.
  bool closed = false;
  // The shard's part of the whole sequence's prompt, in (0, 1]: a sparse
  // policy whose shards select alone gives the shard this share of a budget
  // in tokens (a budget that is a fraction of the prompt is proportional
  // already); ShadowKV's global selection splits only its outliers by it.
  double share = 1.0;
  // The whole sequence's prompt tokens (0: unknown), and the group of ranks
  // holding its shards (null: none). A policy whose decode agrees across the
  // shards (ShadowKV's global top-k) exchanges through the group; every rank
  // makes the same calls for the same steps.
  int64_t sequence_tokens = 0;
  Collective* group = nullptr;
  // The whole sequence's tokens after its sharded span (the tail fed as
  // decode steps and the new tokens; 0: none or unknown): with
  // sequence_tokens, its capacity (specontext scales its retrieval head's
  // positions by it on every rank alike).
  int64_t sequence_new_tokens = 0;
  bool sharded() const { return position_base > 0 || closed || share != 1.0; }
};

// What a new sequence will hold (KvPolicy::AddSequence).
struct SequenceSpec {
  int64_t prompt_len = 0;
  int64_t max_new_tokens = 0;
  // Tokens of the sequence's first prefill (its first segment, or the
  // attached prefix): where a compressing policy factors the prompt; what
  // follows is prefilled as a continuation over that state. 0: the whole
  // prompt.
  int64_t first_prefill = 0;
  // A prefix made by this policy to start from (null: none): the sequence
  // holds its tokens as if prefilled and holds the prefix until removed;
  // prefill continues at position prefix->tokens() < prompt_len. A
  // context-parallel shard attaches a capture of the same shard (same
  // position_base; the document cache's keys name the group's shape) of
  // exactly prompt_len tokens: what follows comes as decode steps.
  std::shared_ptr<const KvPrefix> prefix;
  // A per-document policy ("auto"): the policy the sequence is held under,
  // "full" or "shadowkv"; empty: the policy's choice (an attached prefix's
  // own policy, else by the sequence's exact bytes). Other policies ignore
  // it.
  std::string form;
  // Context parallel: the shard of a longer sequence this one is (default:
  // a whole sequence). prompt_len counts from position_base: the shard's
  // tokens are positions [position_base, position_base + prompt_len).
  // Policies that cannot hold a shard refuse it with Unimplemented.
  ShardSpec shard;
};

// A document's move from one form of a per-document policy to another
// (KvPolicy::BeginMove), in steps the caller interleaves with its work.
class PrefixMove {
 public:
  virtual ~PrefixMove() = default;  // an unfinished move leaves nothing behind
  // One more part (a layer); true once the new form is made (result()).
  virtual Result<bool> Step() = 0;
  virtual std::shared_ptr<const KvPrefix> result() const = 0;
  virtual const std::shared_ptr<const KvPrefix>& from() const = 0;
  virtual double seconds() const = 0;  // spent in Step so far
};

// Memory one sequence takes: device (its KV state on the backend) and host
// (a value store's rows in pinned DRAM).
struct SequenceBytes {
  size_t device = 0, host = 0;
};

// Host memory a policy leaves free when it reserves a sequence's value rows
// (the process, the OS and the document cache need some).
inline constexpr size_t kHostMemoryKeptFree = size_t{8} << 30;

class KvPolicy {
 public:
  virtual ~KvPolicy() = default;
  virtual std::string name() const = 0;

  // Reserves device (and store) memory for a sequence that will hold up to
  // prompt_len + max_new_tokens tokens and attaches spec.prefix.
  // ResourceExhausted (or a prefix that does not fit: InvalidArgument) leaves
  // nothing behind.
  virtual Status AddSequence(int64_t seq, const SequenceSpec& spec) = 0;
  Status AddSequence(int64_t seq, int64_t prompt_len, int64_t max_new_tokens) {
    SequenceSpec spec;
    spec.prompt_len = prompt_len;
    spec.max_new_tokens = max_new_tokens;
    return AddSequence(seq, spec);
  }
  virtual void RemoveSequence(int64_t seq) = 0;

  // Prefill of tokens [start, start + n) of `seq` at `layer`.
  //   qkv: [n, (hq + 2*hkv) * d] f32 (bias added); positions: device [n];
  //   q_scratch: [n, hq*d] act dtype, the queries with RoPE applied on return;
  //   out: [n, hq*d] act dtype;
  //   lse: null, or [n, hq] f32 receiving each row's log-sum-exp over the
  //   keys it attended to (a context-parallel rank merges other ranks' keys in).
  virtual Status PrefillAttention(int layer, int64_t seq, const float* qkv, int n, int64_t start,
                                  const int32_t* positions, void* q_scratch, void* out, float* lse) = 0;
  // After the last prefill chunk of `layer` (prompt_len tokens in all).
  virtual Status FinishPrefillLayer(int layer, int64_t seq, int64_t prompt_len) = 0;

  // Decode: one new token per sequence in `seqs`, the token of seqs[i] at
  // positions[i] (== the number of tokens the sequence held before it).
  virtual Status BeginDecodeStep(const std::vector<int64_t>& seqs, const std::vector<int64_t>& positions) = 0;
  //   qkv: [batch, (hq + 2*hkv) * d] f32; q_scratch, out: [batch, hq*d] act dtype;
  //   lse: null, or [batch, hq] f32 as for PrefillAttention.
  virtual Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                                 float* lse) = 0;
  virtual Status FinishDecodeStep() = 0;
  // The tokens themselves, for policies that look at them before the first
  // layer (specontext's retrieval head); the default ignores them.
  // Prefill: the ids and positions (device [n]) of the run [start, start + n)
  // of `seq`, before its first PrefillAttention.
  virtual Status PrefillTokens(int64_t seq, const int32_t* ids, const int32_t* positions, int n, int64_t start) {
    (void)seq;
    (void)ids;
    (void)positions;
    (void)n;
    (void)start;
    return Status::OK();
  }
  // Decode: the step's ids and positions (device [batch], in
  // BeginDecodeStep's order), after BeginDecodeStep.
  virtual Status DecodeTokens(const int32_t* ids, const int32_t* positions) {
    (void)ids;
    (void)positions;
    return Status::OK();
  }
  // Called once after every decode step, successful or not (after
  // FinishDecodeStep, or after the op that failed): ends the step's
  // participation in cross-lane fetch turns (worker/engine/fetch_turns.h).
  virtual void EndDecodeStep() {}

  // Whether a run of `seq`'s prompt may be prefilled in several calls (at
  // prefill-chunk boundaries) with the same result as in one: true for the
  // exact cache; a compressing policy's state depends on where prefills end.
  virtual bool PrefillSplits(int64_t seq) const {
    (void)seq;
    return true;
  }
  // The policy `seq` is held under: name(), or for a per-document policy the
  // one it routes the sequence to. Empty when `seq` does not exist.
  virtual std::string FormOf(int64_t seq) const {
    (void)seq;
    return name();
  }
  // The forms a sequence or document can be held in: {name()}, or a
  // per-document policy's ({"full", "shadowkv"}).
  virtual std::vector<std::string> Forms() const { return {name()}; }

  // ---- Prefix reuse (default: Unimplemented for the policy) ----
  // A string naming every parameter that changes the KV state this policy
  // makes for given tokens (part of a prefix's cache key).
  virtual std::string StateFingerprint() const { return name(); }
  // The state of the first `tokens` tokens of `seq`, which has been
  // prefilled at least that far. The sequence is unchanged. A compressing
  // policy (shadowkv) captures only all that `seq` holds, right after a
  // prefill ended there (FailedPrecondition otherwise): its state at a
  // position depends on where prefills ended.
  // A context-parallel shard's `tokens` count its own tokens (from its
  // position_base), as its SequenceSpec::prompt_len does.
  virtual Result<std::shared_ptr<const KvPrefix>> CapturePrefix(int64_t seq, int64_t tokens) {
    return Status::Unimplemented("the " + name() + " KV policy cannot capture prompt prefixes yet");
  }
  // As CapturePrefix, for a sequence that ends there (a document's put): the
  // policy may move the sequence's state into the prefix instead of copying
  // it, after which the sequence may only be removed. The default copies.
  virtual Result<std::shared_ptr<const KvPrefix>> TakePrefix(int64_t seq, int64_t tokens) {
    return CapturePrefix(seq, tokens);
  }
  // Rebuilds a prefix from KvPrefix::Export's blobs. InvalidArgument (or
  // Corruption) naming the blob when they do not fit this policy's geometry.
  virtual Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) {
    return Status::Unimplemented("the " + name() + " KV policy cannot import prompt prefixes yet");
  }
  // Blobs of its exported prefixes this policy can read lazily (after the
  // import, as requests need them): e.g. a ShadowKV document's values.
  virtual std::vector<std::string> LazyBlobs() const { return {}; }
  // ImportPrefix from some of the blobs (`blobs`: at least the small ones)
  // and a reader of the stored segment (`lazy`): the policy reads the other
  // blobs from it, its LazyBlobs on demand (`read_threads` at once) and,
  // once a request has used the prefix, in the background.
  virtual Result<std::shared_ptr<const KvPrefix>> ImportPrefixLazy(const std::map<std::string, std::string>& blobs,
                                                                   std::shared_ptr<storage::BlobReader> lazy,
                                                                   int read_threads) {
    (void)lazy;
    (void)read_threads;
    return ImportPrefix(blobs);
  }
  // A prefix of this policy's own made from the exact keys and values of a
  // prompt (ExactKv; a per-document policy's move of a document from its
  // exact form), in steps: AddSequence(seq) with prompt_len = kv.tokens,
  // max_new_tokens 0, first_prefill = kv.tokens; FactorExactLayer for each
  // layer in order; then TakePrefix(seq, kv.tokens) and RemoveSequence.
  // The result is the state a prefill of those keys and values would make
  // (the keys' RoPE undone first: exact on f32 activations, one rounding of
  // the act dtype otherwise). Unimplemented where the policy cannot.
  virtual Status FactorExactLayer(int64_t seq, const ExactKv& kv, int layer) {
    (void)seq;
    (void)kv;
    (void)layer;
    return Status::Unimplemented("the " + name() + " KV policy cannot factor exact keys and values");
  }
  // ---- A policy per document (worker/engine/per_document_policy.h) ----
  // Device bytes the documents held in the exact form may take in all; 0: no
  // moves (a single-form policy).
  virtual size_t ExactBudgetBytes() const { return 0; }
  // Begins moving a document held in the exact form (`from`) to the compact
  // one. Unimplemented for a single-form policy.
  virtual Result<std::unique_ptr<PrefixMove>> BeginMove(std::shared_ptr<const KvPrefix> from) {
    (void)from;
    return Status::Unimplemented("the " + name() + " KV policy holds every document in one form");
  }
  // Benchmarks only: leaves `seq` as if a prompt of `length` tokens had been
  // prefilled, from random keys and values (through the policy's real
  // compression path where it has one), without running the model.
  virtual Status SynthesizeContext(int64_t seq, int64_t length, uint64_t seed) = 0;

  // Device bytes held for `seq` (memory reports).
  virtual size_t DeviceBytes(int64_t seq) const = 0;
  // What AddSequence would reserve for `spec` with nothing attached (no
  // prefix, a whole sequence); zeros where the policy cannot say.
  virtual SequenceBytes EstimateSequenceBytes(const SequenceSpec& spec) const { return {}; }
  virtual PolicyStats stats() const { return stats_; }
  // Profiling synchronizes after each prefill op to time it (slower).
  virtual void SetProfiling(bool on) {}
  // Decode ops lap into `profiler` (the runtime's timeline) while non-null.
  virtual void SetDecodeProfiler(OpProfiler* profiler) {}
  // Benchmarks: from the next decode step, keep this fraction of the previous
  // step's selection (< 0: off; see ShadowKvOptions::force_hit_rate).
  virtual Status SetForcedHitRate(double rate) {
    return Status::InvalidArgument("the " + name() + " KV policy has no forced hit rate");
  }

 protected:
  PolicyStats stats_;
};

// The prefix spec.prefix is, as the attaching policy's own Prefix type
// (`policy` names it in the error): InvalidArgument when another policy made
// it or it leaves nothing of the prompt to prefill.
template <typename Prefix>
Result<const Prefix*> AttachedPrefix(const SequenceSpec& spec, const std::string& policy) {
  const auto* p = dynamic_cast<const Prefix*>(spec.prefix.get());
  if (p == nullptr) {
    return Status::InvalidArgument("a " + spec.prefix->policy() + " prefix cannot attach to a " + policy + " sequence");
  }
  if (p->tokens() >= spec.prompt_len) {
    return Status::InvalidArgument("a prefix of " + std::to_string(p->tokens()) + " tokens leaves nothing of the " +
                                   std::to_string(spec.prompt_len) + "-token prompt to prefill");
  }
  return p;
}

// Exact KV cache: per sequence K and V as [layers][hkv][capacity][d].
std::unique_ptr<KvPolicy> MakeFullKvPolicy(const PolicyContext& ctx);

}  // namespace penumbra
