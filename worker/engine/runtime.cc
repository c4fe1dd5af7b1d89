#include "worker/engine/runtime.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <utility>

#include "common/crypto.h"
#include "common/kv_policies.h"

namespace penumbra {
namespace {

// Led mode's op records (Runtime::LeadGroup): the op, the sequence, then the
// op's fields, host byte order (the ranks are one build on one kind of host).
enum class GroupOp : uint8_t { kNoop = 0, kStop, kBegin, kStep, kDecode, kRemove, kForget };

struct OpWriter {
  OpWriter(GroupOp op, int64_t seq) {
    Pod(static_cast<uint8_t>(op));
    Pod(seq);
  }
  template <typename T>
  void Pod(const T& v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  template <typename T>
  void Vec(const std::vector<T>& v) {
    Pod(static_cast<uint64_t>(v.size()));
    if (!v.empty()) out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  // The fields a follower's steps read (sampling is the leader's alone).
  void Request(const GenerationRequest& q) {
    Vec(q.prompt);
    Vec(q.document_ends);
    Vec(q.document_digests);
    Pod(q.ids_from);
    Pod(q.max_new_tokens);
    Pod(static_cast<uint64_t>(q.cache_namespace.size()));
    out.append(q.cache_namespace);
  }
  std::string out;
};

struct OpReader {
  explicit OpReader(const std::string& in) : in(in) {}
  template <typename T>
  T Pod() {
    T v{};
    if (at + sizeof(T) > in.size()) {
      ok = false;
      return v;
    }
    std::memcpy(&v, in.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  template <typename T>
  std::vector<T> Vec() {
    const auto n = Pod<uint64_t>();
    if (!ok || n > (in.size() - at) / sizeof(T)) {
      ok = false;
      return {};
    }
    std::vector<T> v(n);
    if (n > 0) std::memcpy(v.data(), in.data() + at, n * sizeof(T));  // (an empty vector's data() may be null)
    at += n * sizeof(T);
    return v;
  }
  GenerationRequest Request() {
    GenerationRequest q;
    q.prompt = Vec<int32_t>();
    q.document_ends = Vec<int64_t>();
    q.document_digests = Vec<Hash128>();
    q.ids_from = Pod<int64_t>();
    q.max_new_tokens = Pod<int>();
    const auto n = Pod<uint64_t>();
    if (!ok || n > in.size() - at) {
      ok = false;
      return q;
    }
    q.cache_namespace = in.substr(at, n);
    at += n;
    return q;
  }
  const std::string& in;
  size_t at = 0;
  bool ok = true;
};

}  // namespace

float NextUniform(std::mt19937_64& rng) { return static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f); }

SampleParams SamplingDraw(const SamplingOptions& s, std::mt19937_64& rng) {
  return SampleParams{s.temperature, s.top_k, s.top_p, NextUniform(rng)};
}

Result<std::unique_ptr<PolicyContextHolder>> MakePolicyContext(Backend* backend, const ModelConfig& config) {
  auto h = std::make_unique<PolicyContextHolder>();
  std::vector<float> inv = config.RopeInvFreq();
  PENUMBRA_ASSIGN_OR_RETURN(h->inv_freq, backend->Allocate(inv.size() * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(backend->CopyToDevice(h->inv_freq.get(), inv.data(), inv.size() * sizeof(float)));
  PENUMBRA_RETURN_IF_ERROR(backend->Synchronize());
  h->ctx.backend = backend;
  h->ctx.num_layers = config.num_layers;
  h->ctx.hq = config.num_heads;
  h->ctx.hkv = config.num_kv_heads;
  h->ctx.head_dim = config.head_dim;
  h->ctx.inv_freq = h->inv_freq.as<float>();
  h->ctx.scale = 1.0f / std::sqrt(static_cast<float>(config.head_dim));
  return h;
}

Runtime::Runtime(const RuntimeOptions& o, const PolicyContext& ctx, const ModelWeights* w, std::unique_ptr<KvPolicy> p)
    : options_(o),
      backend_(ctx.backend),
      inv_freq_(ctx.inv_freq),
      attn_scale_(ctx.scale),
      weights_(w),
      policy_(std::move(p)) {}

Result<std::unique_ptr<Runtime>> Runtime::Create(const RuntimeOptions& options, const PolicyContext& ctx,
                                                 const ModelWeights* weights, std::unique_ptr<KvPolicy> policy) {
  Backend* backend = ctx.backend;
  if (options.prefill_chunk < 1) return Status::InvalidArgument("prefill_chunk must be >= 1");
  if (options.cp_balance_round_rows < 1) return Status::InvalidArgument("cp_balance_round_rows must be >= 1");
  if (options.max_batch < 1) return Status::InvalidArgument("max_batch must be >= 1");
  std::unique_ptr<Runtime> rt(new Runtime(options, ctx, weights, std::move(policy)));
  PENUMBRA_RETURN_IF_ERROR(rt->AllocateScratch(std::max(options.prefill_chunk, options.max_batch)));
  if (options.prefix_cache_bytes > 0) {
    PENUMBRA_RETURN_IF_ERROR(options.tiers.Validate());
    DocumentCacheOptions d;
    d.memory_bytes = options.prefix_cache_bytes;
    d.memory_host_bytes = options.prefix_cache_host_bytes > 0 ? options.prefix_cache_host_bytes : SIZE_MAX;
    d.memory_low_watermark = options.prefix_cache_low_watermark;
    d.queue_bytes = options.prefix_store_queue_bytes;
    d.lazy_reads = options.prefix_store_lazy_reads;
    d.lazy_block_bytes = options.prefix_store_lazy_block_bytes;
    d.lazy_threads = options.prefix_store_lazy_threads;
    d.eager_blob_bytes = options.prefix_store_eager_blob_bytes;
    d.fetch_whole = options.prefix_store_fetch_whole;
    d.drain_ms = options.prefix_store_drain_ms;
    d.key_secret = options.document_key_secret;
    d.dtype = DTypeName(backend->act_dtype());
    rt->cache_ = std::make_unique<DocumentCache>(
        d, rt->policy_.get(), std::make_unique<ValueTiers>(options.tiers, backend->device() == Device::kCPU, [backend] {
          return backend->FreeMemoryBytes();
        }));
  }
  return rt;
}

Status Runtime::AllocateScratch(int rows) {
  const ModelConfig& c = config();
  const size_t es = DTypeSize(backend_->act_dtype());
  const size_t R = static_cast<size_t>(rows);
  const size_t qd = static_cast<size_t>(c.num_heads) * c.head_dim;
  const size_t qkvd = static_cast<size_t>(c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  const size_t batch = static_cast<size_t>(options_.max_batch);
  PENUMBRA_ASSIGN_OR_RETURN(x_, backend_->Allocate(batch * c.hidden_size * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(h_, backend_->Allocate(R * c.hidden_size * es));
  PENUMBRA_ASSIGN_OR_RETURN(qkv_, backend_->Allocate(R * qkvd * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(q_, backend_->Allocate(R * qd * es));
  PENUMBRA_ASSIGN_OR_RETURN(attn_, backend_->Allocate(R * qd * es));
  PENUMBRA_ASSIGN_OR_RETURN(gu_, backend_->Allocate(R * 2 * c.intermediate_size * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(ffn_, backend_->Allocate(R * c.intermediate_size * es));
  PENUMBRA_ASSIGN_OR_RETURN(logits_, backend_->Allocate(batch * c.vocab_size * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(ids_, backend_->Allocate(R * sizeof(int32_t)));
  PENUMBRA_ASSIGN_OR_RETURN(pos_, backend_->Allocate(R * sizeof(int32_t)));
  scratch_rows_ = rows;
  return Status::OK();
}

Status SamplingOptions::Validate() const {
  auto bad = [](const char* field, const char* range, double v) {
    std::ostringstream os;
    os << field << " must be in " << range << ", got " << v;
    return Status::InvalidArgument(os.str());
  };
  // Written so that NaN fails every check.
  if (!(temperature >= 0 && temperature <= kMaxTemperature)) return bad("temperature", "[0, 100]", temperature);
  if (!(top_p > 0 && top_p <= 1)) return bad("top_p", "(0, 1]", top_p);
  if (top_k < 0) return bad("top_k", "[0, 2147483647]", top_k);
  return Status::OK();
}

Status ValidateGenerationRequest(const GenerationRequest& q, const ModelConfig& c) {
  // Sizes before contents: each loop below is bounded by a limit checked first.
  if (q.prompt.empty()) return Status::InvalidArgument("the prompt is empty");
  // 0: prefill only (a document put): the last segment may end with the prompt.
  if (q.max_new_tokens < 0) return Status::InvalidArgument("max_new_tokens must be >= 0");
  const int64_t total = static_cast<int64_t>(q.prompt.size()) + q.max_new_tokens;
  if (total > c.max_position_embeddings) {
    return Status::InvalidArgument("prompt (" + std::to_string(q.prompt.size()) + " tokens) + max_new_tokens (" +
                                   std::to_string(q.max_new_tokens) + ") exceeds the model's " +
                                   std::to_string(c.max_position_embeddings) + "-token context");
  }
  if (c.use_sliding_window && c.sliding_window > 0 && total > c.sliding_window) {
    return Status::InvalidArgument("this model uses sliding-window attention (window " +
                                   std::to_string(c.sliding_window) +
                                   ") and sequences longer than the window are not supported yet");
  }
  for (size_t i = 0; i < q.prompt.size(); ++i) {
    if (q.prompt[i] < 0 || q.prompt[i] >= c.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(q.prompt[i]) + " at prompt position " +
                                     std::to_string(i) + " is outside the vocabulary [0, " +
                                     std::to_string(c.vocab_size) + ")");
    }
  }
  PENUMBRA_RETURN_IF_ERROR(q.sampling.Validate());
  if (!q.kv_policy.empty() && !IsKvPolicyPin(q.kv_policy)) {
    return Status::InvalidArgument("kv_policy must be empty, " + std::string(KvPolicyPins()) + ", got \"" +
                                   q.kv_policy.substr(0, 32) + "\"");
  }
  if (q.document_ends.size() > q.prompt.size()) {
    return Status::InvalidArgument(std::to_string(q.document_ends.size()) + " document ends for a prompt of " +
                                   std::to_string(q.prompt.size()) + " tokens");
  }
  for (size_t i = 0; i < q.document_ends.size(); ++i) {
    const int64_t e = q.document_ends[i], prev = i ? q.document_ends[i - 1] : 0;
    const int64_t limit = static_cast<int64_t>(q.prompt.size()) - (q.max_new_tokens > 0 ? 1 : 0);
    if (e <= prev || e > limit) {
      return Status::InvalidArgument(
          "document end " + std::to_string(e) + " (index " + std::to_string(i) + ") must be above " +
          std::to_string(prev) + (q.max_new_tokens > 0 ? " and below the prompt's " : " and at most the prompt's ") +
          std::to_string(q.prompt.size()) + " tokens");
    }
  }
  if (!q.document_digests.empty() && q.document_digests.size() != q.document_ends.size()) {
    return Status::InvalidArgument(std::to_string(q.document_digests.size()) + " document digests for " +
                                   std::to_string(q.document_ends.size()) + " documents: one each, or none");
  }
  if (q.ids_from != 0) {
    if (std::find(q.document_ends.begin(), q.document_ends.end(), q.ids_from) == q.document_ends.end()) {
      return Status::InvalidArgument("ids_from " + std::to_string(q.ids_from) +
                                     " must be 0 or the end of one of the prompt's documents");
    }
    if (q.document_digests.empty()) {
      return Status::InvalidArgument("ids_from " + std::to_string(q.ids_from) +
                                     ": the documents whose ids are not sent need their digests");
    }
  }
  // The ids that were sent must be the documents the digests name.
  for (size_t i = 0, begin = 0; i < q.document_digests.size(); begin = q.document_ends[i++]) {
    if (q.document_ends[i] <= q.ids_from) continue;
    const Hash128 d = DocumentDigest(q.prompt.data() + begin, static_cast<size_t>(q.document_ends[i]) - begin);
    if (!(d == q.document_digests[i])) {
      return Status::InvalidArgument("document " + std::to_string(i) + "'s ids do not match its digest");
    }
  }
  // Each draw made one generated token, now part of the prompt: more is
  // not a resumed request (and would cost a linear skip of the stream).
  if (q.draws_done < 0 || q.draws_done > static_cast<int64_t>(q.prompt.size())) {
    return Status::InvalidArgument("draws_done must be in [0, the prompt's " + std::to_string(q.prompt.size()) +
                                   " tokens], got " + std::to_string(q.draws_done));
  }
  if (static_cast<int64_t>(q.stop_ids.size()) > GenerationRequest::kMaxStopIds) {
    return Status::InvalidArgument(std::to_string(q.stop_ids.size()) + " stop ids: at most " +
                                   std::to_string(GenerationRequest::kMaxStopIds));
  }
  for (int32_t id : q.stop_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return Status::InvalidArgument("stop id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                     std::to_string(c.vocab_size) + ")");
    }
  }
  return Status::OK();
}

BatchCapacity Runtime::Capacity(int64_t prompt_tokens, int64_t max_new_tokens, int64_t held, int max_batch) {
  BatchCapacity c;
  c.context_tokens = prompt_tokens + max_new_tokens;
  c.held = held;
  SequenceSpec spec;
  spec.prompt_len = prompt_tokens;
  spec.max_new_tokens = max_new_tokens;
  c.per_sequence = policy_->EstimateSequenceBytes(spec);
  auto less_kept = [](size_t free, size_t kept) { return free > kept ? free - kept : 0; };
  const bool one_pool = backend_->device() != Device::kCUDA;  // the CPU backend's "device" memory is host memory
  const size_t host_free = backend_->FreeHostBytes();
  c.host_available_bytes = less_kept(host_free, kHostMemoryKeptFree);
  // Tier 0's copies of hot documents' values are spare memory an admission
  // takes back (DocumentCache::FreeDeviceFor): counted as free.
  const size_t reclaimable = cache_ ? cache_->stats().tiers.promoted_bytes : 0;
  c.device_available_bytes =
      one_pool ? c.host_available_bytes : less_kept(backend_->FreeMemoryBytes() + reclaimable, kDeviceMemoryKeptFree);
  const int64_t by_batch = std::max<int64_t>(0, std::min(max_batch, options_.max_batch) - held);
  int64_t by_device = by_batch, by_host = by_batch;
  const SequenceBytes& b = c.per_sequence;
  if (one_pool) {
    if (b.device + b.host > 0) by_host = static_cast<int64_t>(c.host_available_bytes / (b.device + b.host));
  } else {
    if (b.device > 0) by_device = static_cast<int64_t>(c.device_available_bytes / b.device);
    if (b.host > 0) by_host = static_cast<int64_t>(c.host_available_bytes / b.host);
  }
  if (b.device + b.host == 0) {
    c.limit = "unknown";
    return c;
  }
  c.more = std::min({by_batch, by_device, by_host});
  c.limit = c.more == by_device && by_device < by_batch ? "device memory"
            : c.more == by_host && by_host < by_batch   ? "host memory"
                                                        : "max_batch";
  return c;
}

Status Runtime::Validate(const std::vector<GenerationRequest>& requests) const {
  for (size_t r = 0; r < requests.size(); ++r) {
    Status s = ValidateGenerationRequest(requests[r], config());
    if (s.ok() && !requests[r].kv_policy.empty()) {
      const std::vector<std::string> forms = policy_->Forms();
      if (std::find(forms.begin(), forms.end(), requests[r].kv_policy) == forms.end()) {
        s = Status::InvalidArgument("kv_policy " + requests[r].kv_policy + ": this worker's KV policy is " +
                                    policy_->name());
      }
    }
    // A batch's messages name the request; a single request's do not.
    if (!s.ok() && requests.size() > 1) return Status(s.code(), "request " + std::to_string(r) + ": " + s.message());
    PENUMBRA_RETURN_IF_ERROR(s);
  }
  return Status::OK();
}

Status Runtime::AddSequence(int64_t seq, int64_t prompt_len, int64_t max_new_tokens) {
  if (cp_ == nullptr) return policy_->AddSequence(seq, prompt_len, max_new_tokens);
  return AddShard(seq, prompt_len, 0, max_new_tokens, nullptr);
}

Status Runtime::AddShard(int64_t seq, int64_t span, int64_t tail, int64_t max_new_tokens,
                         std::shared_ptr<const KvPrefix> prefix) {
  const int rank = cp_->rank(), world = cp_->world();
  if (span < world) {
    return Status::InvalidArgument("context parallel: a " + std::to_string(span) + "-token span cannot be split over " +
                                   std::to_string(world) + " ranks");
  }
  const Shard sh = ShardOf(span, rank, world);
  SequenceSpec spec;
  spec.prompt_len = sh.end - sh.begin;
  // The tail and the new tokens are the last rank's.
  spec.max_new_tokens = rank == world - 1 ? tail + max_new_tokens : 0;
  spec.prefix = std::move(prefix);
  spec.shard.position_base = sh.begin;
  spec.shard.closed = rank < world - 1;
  spec.shard.share = static_cast<double>(sh.end - sh.begin) / static_cast<double>(span);
  spec.shard.sequence_tokens = span;
  spec.shard.sequence_new_tokens = tail + max_new_tokens;
  spec.shard.group = cp_;
  return policy_->AddSequence(seq, spec);
}

Runtime::Shard Runtime::ShardOf(int64_t tokens, int rank, int world) {
  const int64_t align = tokens >= int64_t{64} * world ? 64 : 1;
  auto bound = [&](int i) -> int64_t { return i >= world ? tokens : tokens * i / world / align * align; };
  return Shard{bound(rank), bound(rank + 1)};
}

Status Runtime::SetContextGroup(Collective* group) {
  StopHeartbeat();
  leading_ = false;
  {
    std::lock_guard<std::mutex> lk(health_mu_);
    health_ = Status::OK();
  }
  cp_ = group != nullptr && group->world() > 1 ? group : nullptr;
  if (cache_) {
    if (cp_ != nullptr) {
      cache_->SetShard(cp_->rank(), cp_->world());
    } else {
      cache_->SetShard(0, 1);
    }
  }
  if (cp_ == nullptr) return Status::OK();
  const ModelConfig& c = config();
  const size_t W = static_cast<size_t>(cp_->world());
  const size_t rows = static_cast<size_t>(std::max(options_.prefill_chunk, options_.max_batch)) * c.num_heads;
  const size_t batch_rows = static_cast<size_t>(options_.max_batch) * c.num_heads;
  const size_t part = batch_rows * (c.head_dim * DTypeSize(backend_->act_dtype()) + sizeof(float));
  PENUMBRA_ASSIGN_OR_RETURN(cp_lse_, backend_->Allocate(rows * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(cp_part_, backend_->Allocate(part));
  PENUMBRA_ASSIGN_OR_RETURN(cp_parts_, backend_->Allocate(W * part));
  std::vector<int32_t> iota(static_cast<size_t>(options_.prefill_chunk));
  for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int32_t>(i);
  PENUMBRA_ASSIGN_OR_RETURN(cp_iota_, backend_->Allocate(iota.size() * sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(backend_->CopyToDevice(cp_iota_.get(), iota.data(), iota.size() * sizeof(int32_t)));
  return backend_->Synchronize();
}

float* Runtime::RankPartLse(int rows) const {
  return reinterpret_cast<float*>(cp_part_.as<char>() +
                                  static_cast<size_t>(rows) * config().head_dim * DTypeSize(backend_->act_dtype()));
}

Status Runtime::MergeRanks(int rows) {
  const size_t es = DTypeSize(backend_->act_dtype());
  const int d = config().head_dim;
  // A part is the output rows then their log-sum-exps (d even: the floats
  // stay aligned), so one all-gather per layer carries both.
  const size_t out_bytes = static_cast<size_t>(rows) * d * es;
  const size_t part = out_bytes + static_cast<size_t>(rows) * sizeof(float);
  PENUMBRA_RETURN_IF_ERROR(cp_->AllGather(cp_part_.get(), cp_parts_.get(), part));
  Backend::MergeParts m;
  m.x = cp_parts_.get();
  m.x_part_stride = static_cast<int64_t>(part / es);
  m.lse = reinterpret_cast<const float*>(cp_parts_.as<char>() + out_bytes);
  m.lse_part_stride = static_cast<int64_t>(part / sizeof(float));
  m.parts = cp_->world();
  m.rows = rows;
  m.d = d;
  m.out = attn_.get();
  backend_->MergeAttentionParts(m);
  return Status::OK();
}

// A context-parallel prefill's exchange buffers, bytes. A rank's block of
// the per-layer all-gather: its K rows then its V rows ([hkv][smax][d] each,
// `head` bytes a head), then the Q of the rows it hands over ([rows][hq][d],
// balanced prefill). A rank's block of a balanced round's all-gather: one
// slot per rank, each `round` rows' attention outputs ([rows][hq][d],
// out_bytes) then their log-sum-exps ([rows][hq] f32).
struct Runtime::ExchangeLayout {
  int64_t shard_rows = 0, handed = 0, round = 0;  // MaxShardRows, MaxHandedRows, BalanceRoundRows (0: not balanced)
  size_t head = 0, kv = 0, block = 0;
  size_t out_bytes = 0, slot = 0, rank_block = 0;
};

Runtime::ExchangeLayout Runtime::LayoutFor(int64_t prompt_end) const {
  const ModelConfig& c = config();
  const size_t es = DTypeSize(backend_->act_dtype());
  ExchangeLayout x;
  x.shard_rows = MaxShardRows(prompt_end);
  x.handed = MaxHandedRows(prompt_end);
  x.round = x.handed > 0 ? BalanceRoundRows(prompt_end) : 0;
  const size_t row = static_cast<size_t>(c.num_heads) * c.head_dim * es;
  x.head = static_cast<size_t>(x.shard_rows) * c.head_dim * es;
  x.kv = 2 * static_cast<size_t>(c.num_kv_heads) * x.head;
  x.block = x.kv + static_cast<size_t>(x.handed) * row;
  x.out_bytes = static_cast<size_t>(x.round) * row;
  x.slot = x.out_bytes + static_cast<size_t>(x.round) * c.num_heads * sizeof(float);
  x.rank_block = static_cast<size_t>(cp_->world()) * x.slot;
  return x;
}

int64_t Runtime::KeptRows(int64_t prompt_end, int j) const {
  const Shard sh = ShardOf(prompt_end, j, cp_->world());
  const int64_t rows = sh.end - sh.begin;
  if (!options_.cp_prefill_balance || j == 0) return rows;
  // Half, at a multiple of 64: rank j then attends to the earlier keys for
  // half its rows and, over its own keys, for half of each later rank's.
  return (rows / 2) & ~int64_t{63};
}

int64_t Runtime::MaxHandedRows(int64_t prompt_end) const {
  int64_t most = 0;
  for (int j = 1; j < cp_->world(); ++j) {
    const Shard sh = ShardOf(prompt_end, j, cp_->world());
    most = std::max(most, sh.end - sh.begin - KeptRows(prompt_end, j));
  }
  return most;
}

int64_t Runtime::BalanceRoundRows(int64_t prompt_end) const {
  return std::max<int64_t>(1, std::min<int64_t>(options_.cp_balance_round_rows, MaxHandedRows(prompt_end)));
}

int64_t Runtime::MaxShardRows(int64_t prompt_end) const {
  int64_t rows = 0;
  for (int j = 0; j < cp_->world(); ++j) {
    const Shard sh = ShardOf(prompt_end, j, cp_->world());
    rows = std::max(rows, sh.end - sh.begin);
  }
  return rows;
}

Status Runtime::PrepareKeyExchange(const PartialPrefill& p) {
  const ModelConfig& c = config();
  // The prefill's exchanges follow these options: every rank must run the
  // same (a mismatch would hang the exchange until the group's timeout).
  const size_t W = static_cast<size_t>(cp_->world());
  const int32_t mine[2] = {options_.cp_prefill_balance ? 1 : 0, options_.cp_balance_round_rows};
  std::vector<int32_t> all(2 * W);
  PENUMBRA_RETURN_IF_ERROR(cp_->AllGatherHost(mine, all.data(), sizeof(mine)));
  for (size_t r = 0; r < W; ++r) {
    if (all[2 * r] != mine[0] || all[2 * r + 1] != mine[1]) {
      return Status::InvalidArgument(
          "context group: rank " + std::to_string(r) + " runs cp_prefill_balance " + std::to_string(all[2 * r]) +
          ", cp_balance_round_rows " + std::to_string(all[2 * r + 1]) + "; rank " + std::to_string(cp_->rank()) +
          " runs " + std::to_string(mine[0]) + ", " + std::to_string(mine[1]) + " (every rank must run the same)");
    }
  }
  const int hkv = c.num_kv_heads, d = c.head_dim;
  const size_t es = DTypeSize(backend_->act_dtype());
  const int64_t S = p.end - p.start;
  const ExchangeLayout x = LayoutFor(p.prompt_end);
  const size_t head = x.head;
  PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());  // the previous prefill's kernels may read these
  if (cp_kv_.bytes() < x.block || cp_kv_all_.bytes() < x.block * cp_->world()) {
    cp_kv_ = DeviceBuffer();
    cp_kv_all_ = DeviceBuffer();
    PENUMBRA_ASSIGN_OR_RETURN(cp_kv_, backend_->Allocate(x.block));
    PENUMBRA_ASSIGN_OR_RETURN(cp_kv_all_, backend_->Allocate(x.block * cp_->world()));
  }
  if (x.handed > 0 && cp_handed_.bytes() < x.rank_block * cp_->world()) {
    cp_handed_ = DeviceBuffer();
    PENUMBRA_ASSIGN_OR_RETURN(cp_handed_, backend_->Allocate(x.rank_block * cp_->world()));
  }
  // RopeStore's destinations: token i's K at row i of head 0 (heads a rank's
  // most rows apart), its V a block of K later.
  std::vector<void*> ptrs(2 * static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) {
    ptrs[i] = cp_kv_.as<char>() + i * d * es;
    ptrs[S + i] = cp_kv_.as<char>() + hkv * head + i * d * es;
  }
  if (cp_kv_ptrs_.bytes() < ptrs.size() * sizeof(void*)) {
    PENUMBRA_ASSIGN_OR_RETURN(cp_kv_ptrs_, backend_->Allocate(ptrs.size() * sizeof(void*)));
  }
  return backend_->CopyToDevice(cp_kv_ptrs_.get(), ptrs.data(), ptrs.size() * sizeof(void*));
}

Status Runtime::GatherEarlierKeys(PartialPrefill* p, int l) {
  const ModelConfig& c = config();
  const LayerWeights& L = weights_->layers()[l];
  const int W = cp_->world(), rank = cp_->rank(), hkv = c.num_kv_heads, d = c.head_dim, H = c.hidden_size;
  const size_t es = DTypeSize(backend_->act_dtype());
  const int64_t S = p->end - p->start;
  const ExchangeLayout x = LayoutFor(p->prompt_end);
  const int64_t smax = x.shard_rows, kept = KeptRows(p->prompt_end, rank);
  const size_t head = x.head, block = x.block;
  // This rank's keys and values of layer l (the QKV projection once more:
  // the attention of every rank's first chunk needs every earlier rank's),
  // and the queries of the rows it hands over (balanced prefill), whose
  // attention over their keys the earlier ranks compute.
  const int chunk = options_.prefill_chunk;
  for (const auto& [from, to] : {std::pair<int64_t, int64_t>{0, kept}, std::pair<int64_t, int64_t>{kept, S}}) {
    for (int64_t off = from; off < to; off += chunk) {
      const int n = static_cast<int>(std::min<int64_t>(chunk, to - off));
      backend_->RmsNorm(p->x.as<float>() + off * H, L.attn_norm, weights_->dtype(), n, H,
                        static_cast<float>(c.rms_norm_eps), h_.get());
      backend_->Linear(h_.get(), L.qkv, n, qkv_.as<float>(), false);
      RopeStoreOp r;
      r.qkv = qkv_.as<float>();
      r.positions = p->pos.as<int32_t>() + off;
      r.inv_freq = inv_freq_;
      r.n = n;
      r.hq = c.num_heads;
      r.hkv = hkv;
      r.d = d;
      r.q_out =
          off < kept ? q_.get() : cp_kv_.as<char>() + x.kv + static_cast<size_t>(off - kept) * c.num_heads * d * es;
      r.k_dst = cp_kv_ptrs_.as<void*>() + off;
      r.v_dst = cp_kv_ptrs_.as<void*>() + S + off;
      r.head_stride = smax * d;
      backend_->RopeStore(r);
    }
  }
  PENUMBRA_RETURN_IF_ERROR(cp_->AllGather(cp_kv_.get(), cp_kv_all_.get(), block));
  if (rank == 0 || kept == 0) return Status::OK();  // no row here attends to the earlier keys
  // The earlier ranks' rows, position order, one [hkv][p->start][d] block each for K and V.
  const size_t want = static_cast<size_t>(hkv) * p->start * d * es;
  if (cp_prefix_k_.bytes() < want) {
    PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());
    PENUMBRA_ASSIGN_OR_RETURN(cp_prefix_k_, backend_->Allocate(want));
    PENUMBRA_ASSIGN_OR_RETURN(cp_prefix_v_, backend_->Allocate(want));
  }
  const size_t dpitch = static_cast<size_t>(p->start) * d * es;
  for (int j = 0; j < rank; ++j) {
    const Shard sh = ShardOf(p->prompt_end, j, W);
    const char* src = cp_kv_all_.as<char>() + j * block;
    const size_t width = static_cast<size_t>(sh.end - sh.begin) * d * es, at = static_cast<size_t>(sh.begin) * d * es;
    PENUMBRA_RETURN_IF_ERROR(backend_->Copy2D(cp_prefix_k_.as<char>() + at, dpitch, src, head, width, hkv));
    PENUMBRA_RETURN_IF_ERROR(
        backend_->Copy2D(cp_prefix_v_.as<char>() + at, dpitch, src + hkv * head, head, width, hkv));
  }
  return Status::OK();
}

void Runtime::RemoveSequence(int64_t seq) {
  if (leading_) {
    std::lock_guard<std::mutex> lk(lead_mu_);
    OpWriter w(GroupOp::kRemove, seq);
    Status s = SendOp(std::move(w.out));  // a broken group: the followers drop theirs when they stop
    if (!s.ok()) LOG(WARNING) << "context group: removing sequence " << seq << ": " << s;
  }
  policy_->RemoveSequence(seq);
}

void Runtime::Mlp(const LayerWeights& L, float* x, int n) {
  const ModelConfig& c = config();
  backend_->RmsNorm(x, L.mlp_norm, weights_->dtype(), n, c.hidden_size, static_cast<float>(c.rms_norm_eps), h_.get());
  backend_->LinearSwiGLU(h_.get(), L.gate_up, n, gu_.as<float>(), ffn_.get());
  backend_->Linear(ffn_.get(), L.down, n, x, true);
}

Status Runtime::Prefill(int64_t seq, const std::vector<int32_t>& prompt, std::vector<float>* logits_out, int64_t start,
                        int64_t end) {
  const int64_t total = end < 0 ? static_cast<int64_t>(prompt.size()) : end;
  CHECK(start >= 0 && start < total && total <= static_cast<int64_t>(prompt.size()))
      << "prefill of [" << start << ", " << total << ") of a " << prompt.size() << "-token prompt";
  if (cp_ != nullptr) {
    // Each rank prefills its shard's rows (AddSequence gave it that shard).
    if (start != 0) return Status::Unimplemented("context parallel: a prompt is prefilled in one call, from 0");
    const Shard sh = ShardOf(total, cp_->rank(), cp_->world());
    PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<PartialPrefill> p, StartPrefill(prompt, sh.begin, sh.end));
    p->prompt_end = total;
    PENUMBRA_RETURN_IF_ERROR(PrepareKeyExchange(*p));
    PENUMBRA_RETURN_IF_ERROR(PrefillLayers(seq, p.get(), config().num_layers));
    return FinishPrefill(p.get(), logits_out);
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<PartialPrefill> p, StartPrefill(prompt, start, total));
  PENUMBRA_RETURN_IF_ERROR(PrefillLayers(seq, p.get(), config().num_layers));
  return FinishPrefill(p.get(), logits_out);
}

Result<std::unique_ptr<Runtime::PartialPrefill>> Runtime::StartPrefill(const std::vector<int32_t>& prompt,
                                                                       int64_t start, int64_t end) {
  const double t0 = NowSeconds();
  auto p = std::make_unique<PartialPrefill>();
  p->start = start;
  p->end = end;
  const int64_t S = end - start;  // rows computed here
  const int H = config().hidden_size;
  // The hidden states of the rows computed stay on the device across layers.
  PENUMBRA_ASSIGN_OR_RETURN(p->x, backend_->Allocate(static_cast<size_t>(S) * H * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(p->ids, backend_->Allocate(static_cast<size_t>(S) * sizeof(int32_t)));
  PENUMBRA_ASSIGN_OR_RETURN(p->pos, backend_->Allocate(static_cast<size_t>(S) * sizeof(int32_t)));
  std::vector<int32_t> positions(S);
  for (int64_t i = 0; i < S; ++i) positions[i] = static_cast<int32_t>(start + i);
  PENUMBRA_RETURN_IF_ERROR(backend_->CopyToDevice(p->ids.get(), prompt.data() + start, S * sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(backend_->CopyToDevice(p->pos.get(), positions.data(), S * sizeof(int32_t)));
  backend_->Embedding(weights_->embed(), weights_->dtype(), p->ids.as<int32_t>(), static_cast<int>(S), H,
                      p->x.as<float>());
  p->seconds += NowSeconds() - t0;
  return p;
}

Status Runtime::PrefillLayers(int64_t seq, PartialPrefill* p, int layers) {
  const double t0 = NowSeconds();
  const int stop = std::min(config().num_layers, p->layer + layers);
  if (p->layer == 0 && stop > 0) {
    PENUMBRA_RETURN_IF_ERROR(policy_->PrefillTokens(seq, p->ids.as<int32_t>(), p->pos.as<int32_t>(),
                                                    static_cast<int>(p->end - p->start), p->start));
  }
  for (; p->layer < stop; ++p->layer) {
    const int l = p->layer;
    if (cp_ == nullptr) {
      PENUMBRA_RETURN_IF_ERROR(PrefillLayer(seq, p, l));
      continue;
    }
    // Context parallel: the rows attend to the earlier ranks' keys as well;
    // a rank's failure in the layer (an allocation, a pinned value layer) is
    // every rank's at its end, so that all stop at the same exchange.
    Status local = GatherEarlierKeys(p, l);
    if (MaxHandedRows(p->prompt_end) > 0) {
      if (local.ok()) local = PrefillRows(seq, p, l, 0, KeptRows(p->prompt_end, cp_->rank()));
      PrefillHandedRows(seq, p, l, &local);
      if (local.ok()) local = policy_->FinishPrefillLayer(l, seq, p->end);
    } else if (local.ok()) {
      local = PrefillLayer(seq, p, l);
    }
    PENUMBRA_RETURN_IF_ERROR(Agree(local));
  }
  p->seconds += NowSeconds() - t0;
  return Status::OK();
}

Status Runtime::PrefillLayer(int64_t seq, PartialPrefill* p, int l) {
  PENUMBRA_RETURN_IF_ERROR(PrefillRows(seq, p, l, 0, p->end - p->start));
  return policy_->FinishPrefillLayer(l, seq, p->end);
}

Status Runtime::PrefillRows(int64_t seq, PartialPrefill* p, int l, int64_t begin, int64_t end,
                            const std::function<Status(int64_t off, int n)>& combine) {
  const ModelConfig& c = config();
  const int H = c.hidden_size;
  const int chunk = options_.prefill_chunk;
  const LayerWeights& L = weights_->layers()[l];
  const bool earlier = !combine && cp_ != nullptr && cp_->rank() > 0;
  for (int64_t off = begin; off < end; off += chunk) {
    const int n = static_cast<int>(std::min<int64_t>(chunk, end - off));
    float* xs = p->x.as<float>() + off * H;
    backend_->RmsNorm(xs, L.attn_norm, weights_->dtype(), n, H, static_cast<float>(c.rms_norm_eps), h_.get());
    backend_->Linear(h_.get(), L.qkv, n, qkv_.as<float>(), false);
    PENUMBRA_RETURN_IF_ERROR(policy_->PrefillAttention(l, seq, qkv_.as<float>(), n, p->start + off,
                                                       p->pos.as<int32_t>() + off, q_.get(), attn_.get(),
                                                       earlier || combine ? cp_lse_.as<float>() : nullptr));
    if (combine) {
      PENUMBRA_RETURN_IF_ERROR(combine(off, n));
    } else if (earlier) {
      PrefixAttentionOp a;
      a.q = q_.get();
      a.rows = cp_iota_.as<int32_t>();
      a.n = n;
      a.k = cp_prefix_k_.get();
      a.v = cp_prefix_v_.get();
      a.head_stride = p->start * c.head_dim;
      a.keys = static_cast<int>(p->start);
      a.out = attn_.get();
      a.own_lse = cp_lse_.as<float>();
      a.hq = c.num_heads;
      a.hkv = c.num_kv_heads;
      a.d = c.head_dim;
      a.scale = attn_scale_;
      PENUMBRA_RETURN_IF_ERROR(backend_->PrefixAttention(a));
    }
    backend_->Linear(attn_.get(), L.o, n, xs, true);
    Mlp(L, xs, n);
  }
  return Status::OK();
}

void Runtime::PrefillHandedRows(int64_t seq, PartialPrefill* p, int l, Status* local) {
  const ModelConfig& c = config();
  const int W = cp_->world(), rank = cp_->rank(), hq = c.num_heads, hkv = c.num_kv_heads, d = c.head_dim;
  const int chunk = options_.prefill_chunk;
  const size_t es = DTypeSize(backend_->act_dtype());
  const size_t row = static_cast<size_t>(hq) * d * es;  // one row's attention output (or query)
  const int64_t S = p->end - p->start, kept = KeptRows(p->prompt_end, rank);
  const ExchangeLayout x = LayoutFor(p->prompt_end);
  char* parts = cp_handed_.as<char>();
  char* mine = parts + rank * x.rank_block;
  const auto keep_first = [local](const Status& s) {
    if (local->ok() && !s.ok()) *local = s;
  };
  for (int64_t r0 = 0; r0 < x.handed; r0 += x.round) {
    // This rank's part of each later rank's handed rows of the round: their
    // attention over this rank's keys (all before theirs: no mask), with its
    // log-sum-exp, into slot j of this rank's block.
    for (int j = rank + 1; j < W && local->ok(); ++j) {
      const Shard sj = ShardOf(p->prompt_end, j, W);
      const int64_t n = std::clamp<int64_t>(sj.end - sj.begin - KeptRows(p->prompt_end, j) - r0, 0, x.round);
      const char* q = cp_kv_all_.as<char>() + j * x.block + x.kv + static_cast<size_t>(r0) * row;
      char* out = mine + j * x.slot;
      float* lse = reinterpret_cast<float*>(out + x.out_bytes);
      for (int64_t c0 = 0; c0 < n && local->ok(); c0 += chunk) {
        PrefixAttentionOp a;
        a.q = q + static_cast<size_t>(c0) * row;
        a.rows = cp_iota_.as<int32_t>();
        a.n = static_cast<int>(std::min<int64_t>(chunk, n - c0));
        a.k = cp_kv_.get();
        a.v = cp_kv_.as<char>() + hkv * x.head;
        a.head_stride = x.shard_rows * d;
        a.keys = static_cast<int>(S);
        a.out = out + static_cast<size_t>(c0) * row;
        a.lse_out = lse + c0 * hq;
        a.hq = hq;
        a.hkv = hkv;
        a.d = d;
        a.scale = attn_scale_;
        keep_first(backend_->PrefixAttention(a));
      }
    }
    // Every rank's parts, a failed rank's too (the layer's agreement then
    // fails everywhere; a failed exchange breaks the group: every later
    // call fails).
    Status gathered = cp_->AllGather(mine, parts, x.rank_block);
    if (!gathered.ok()) return keep_first(gathered);
    if (!local->ok()) continue;
    // This rank's handed rows of the round: each chunk's attention over its
    // own rows goes to its own slot of its own block, beside the earlier
    // ranks' parts of the same rows (slot `rank` of their blocks), then one
    // merge of the rank + 1 parts.
    const int64_t b0 = kept + r0, b1 = std::min(S, kept + r0 + x.round);
    char* slot = parts + rank * x.slot;  // block 0's; block r's is rank_block further
    keep_first(PrefillRows(seq, p, l, b0, b1, [&](int64_t off, int n) -> Status {
      const size_t t = static_cast<size_t>(off - b0);
      char* own = mine + rank * x.slot;
      PENUMBRA_RETURN_IF_ERROR(backend_->CopyDeviceToDevice(own + t * row, attn_.get(), n * row));
      PENUMBRA_RETURN_IF_ERROR(backend_->CopyDeviceToDevice(own + x.out_bytes + t * hq * sizeof(float), cp_lse_.get(),
                                                            static_cast<size_t>(n) * hq * sizeof(float)));
      Backend::MergeParts m;
      m.x = slot + t * row;
      m.x_part_stride = static_cast<int64_t>(x.rank_block / es);
      m.lse = reinterpret_cast<const float*>(slot + x.out_bytes) + t * hq;
      m.lse_part_stride = static_cast<int64_t>(x.rank_block / sizeof(float));
      m.parts = rank + 1;
      m.rows = n * hq;
      m.d = d;
      m.out = attn_.get();
      backend_->MergeAttentionParts(m);
      return Status::OK();
    }));
  }
}

Status Runtime::FinishPrefill(PartialPrefill* p, std::vector<float>* logits_out) {
  const ModelConfig& c = config();
  const double t0 = NowSeconds();
  CHECK_EQ(p->layer, c.num_layers) << "the prefill has layers left";
  const int64_t S = p->end - p->start;
  const int H = c.hidden_size;
  backend_->RmsNorm(p->x.as<float>() + (S - 1) * H, weights_->final_norm(), weights_->dtype(), 1, H,
                    static_cast<float>(c.rms_norm_eps), h_.get());
  backend_->Linear(h_.get(), weights_->lm_head(), 1, logits_.as<float>(), false);
  // Context parallel: the prompt's last row is the last rank's.
  if (cp_ != nullptr) {
    PENUMBRA_RETURN_IF_ERROR(
        cp_->Broadcast(logits_.get(), static_cast<size_t>(c.vocab_size) * sizeof(float), cp_->world() - 1));
  }
  if (logits_out) {
    logits_out->resize(c.vocab_size);
    PENUMBRA_RETURN_IF_ERROR(backend_->CopyToHost(logits_out->data(), logits_.get(), c.vocab_size * sizeof(float)));
  }
  PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());
  stats_.prefill_seconds += p->seconds + (NowSeconds() - t0);
  stats_.prompt_tokens += S;
  return Status::OK();
}

std::vector<Hash128> Runtime::RequestKeys(const GenerationRequest& q) const {
  return cache_->Keys(q.cache_namespace,
                      q.document_digests.empty() ? DocumentDigests(q.prompt, q.document_ends) : q.document_digests,
                      q.document_ends);
}

Result<int> Runtime::ForgetPrefixes(const GenerationRequest& q) {
  if (cp_ != nullptr) {
    if (!leading_) return GroupForget(q);
    std::lock_guard<std::mutex> lk(lead_mu_);
    OpWriter w(GroupOp::kForget, 0);
    w.Request(q);
    PENUMBRA_RETURN_IF_ERROR(SendOp(std::move(w.out)));
    return GroupForget(q);
  }
  if (!cache_ || q.document_ends.empty()) return 0;
  return cache_->Forget(RequestKeys(q));
}

Status Runtime::BeginPrefill(int64_t seq, const GenerationRequest& q, PrefillState* st, GenerationResult* result,
                             PrefetchedDocuments* prefetched) {
  if (cp_ == nullptr) return BeginPrefillImpl(seq, q, st, result, /*reuse=*/true, prefetched);
  // The scheduler's prefetch is empty under a group (StoreLookups): each
  // rank reads its own shard in GroupBegin.
  if (prefetched && cache_) cache_->CountPrefetch(prefetched);
  if (!leading_) return GroupBegin(seq, q, st, result);
  std::lock_guard<std::mutex> lk(lead_mu_);
  OpWriter w(GroupOp::kBegin, seq);
  w.Request(q);
  PENUMBRA_RETURN_IF_ERROR(SendOp(std::move(w.out)));
  return GroupBegin(seq, q, st, result);
}

std::vector<StoreLookup> Runtime::StoreLookups(const GenerationRequest& q) {
  if (!cache_ || !cache_->persistent() || q.document_ends.empty() || cp_ != nullptr) return {};
  return cache_->Lookups(RequestKeys(q), q.document_ends);
}

PrefetchedDocuments Runtime::FetchStoredPrefixes(const std::vector<StoreLookup>& lookups) const {
  return cache_ ? cache_->Fetch(lookups) : PrefetchedDocuments{};
}

Status Runtime::BeginPrefillImpl(int64_t seq, const GenerationRequest& q, PrefillState* st, GenerationResult* result,
                                 bool reuse, PrefetchedDocuments* prefetched) {
  const int64_t P = static_cast<int64_t>(q.prompt.size());
  if (prefetched && cache_) cache_->CountPrefetch(prefetched);  // counted once
  *st = PrefillState{};
  std::shared_ptr<const KvPrefix> hit;
  int64_t start = 0;
  if (cache_ && !q.document_ends.empty() && reuse) {
    st->keys = RequestKeys(q);
    // Memory, then the persistent tier (prefetched, or read here).
    DocumentCache::Found found = cache_->FindLongest(st->keys, q.document_ends, prefetched);
    // A request pinned to another form than the document's prefills its
    // own (and captures nothing over the document's key).
    if (found.state && !q.kv_policy.empty() && found.state->policy() != q.kv_policy) found.state = nullptr;
    if (found.state) {
      hit = std::move(found.state);
      start = q.document_ends[found.index];
      st->attached_segment = found.index;
    }
  }
  if (start < q.ids_from) {
    // Ids not sent for a document this worker does not hold (evicted, never
    // seen, its store unreachable): the sender sends them.
    size_t i = 0;
    while (i + 1 < q.document_ends.size() && q.document_ends[i] <= start) ++i;
    return Status::FailedPrecondition(
        "document " + std::to_string(i) + " (prompt tokens [" + std::to_string(i ? q.document_ends[i - 1] : 0) + ", " +
        std::to_string(q.document_ends[i]) + ")) is not held by this worker and its ids were not sent");
  }
  SequenceSpec spec;
  spec.prompt_len = P;
  spec.max_new_tokens = q.max_new_tokens;
  spec.first_prefill = q.document_ends.empty() ? 0 : q.document_ends[0];
  spec.prefix = hit;
  spec.form = q.kv_policy;
  Status added = policy_->AddSequence(seq, spec);
  if (!added.ok() && hit && added.code() == StatusCode::kInvalidArgument) {
    // A prefix this sequence cannot take (the cache key's fence makes this
    // unexpected): computed instead.
    LOG(WARNING) << "prefix not attached, prefilled instead: " << added;
    spec.prefix = nullptr;
    start = 0;
    added = policy_->AddSequence(seq, spec);
  }
  if (cache_ && cache_->FreeDeviceFor(added)) added = policy_->AddSequence(seq, spec);
  PENUMBRA_RETURN_IF_ERROR(added);
  stats_.prompt_tokens += start;
  stats_.cached_prompt_tokens += start;
  result->cached_prompt_tokens = start;
  st->result = result;
  st->attached = start > 0 ? hit : nullptr;
  st->form = policy_->FormOf(seq);
  st->at = start;
  st->capture = !st->keys.empty();
  return Status::OK();
}

Result<bool> Runtime::PrefillStep(int64_t seq, const GenerationRequest& q, PrefillState* st, int64_t max_tokens) {
  if (cp_ != nullptr) {
    if (!leading_) return GroupStep(seq, q, st, max_tokens);
    std::lock_guard<std::mutex> lk(lead_mu_);
    OpWriter w(GroupOp::kStep, seq);
    w.Pod(max_tokens);
    PENUMBRA_RETURN_IF_ERROR(SendOp(std::move(w.out)));
    return GroupStep(seq, q, st, max_tokens);
  }
  PlaceDocuments();
  Result<bool> r = PrefillStepImpl(seq, q, st, max_tokens);
  if (r.ok() || !st->attached || st->attached->health().ok()) return r;
  // The attached prefix failed a check while its values were read from disk
  // (nothing of it reached attention): dropped, and the request prefilled
  // from its first token instead.
  cache_->DropDamaged(st->keys[st->attached_segment], st->attached->health());
  const int64_t start = st->result->cached_prompt_tokens;
  stats_.prompt_tokens -= start;
  stats_.cached_prompt_tokens -= start;
  policy_->RemoveSequence(seq);
  // Without the cache (nothing captured either: a reader of the damaged
  // segment may still hold it on disk for a moment).
  PENUMBRA_RETURN_IF_ERROR(BeginPrefillImpl(seq, q, st, st->result, /*reuse=*/false));
  return PrefillStepImpl(seq, q, st, max_tokens);
}

Result<bool> Runtime::PrefillStepImpl(int64_t seq, const GenerationRequest& q, PrefillState* st, int64_t max_tokens) {
  const int64_t P = static_cast<int64_t>(q.prompt.size());
  CHECK_LT(st->at, P) << "the prompt is already prefilled";
  // One prefill per segment at least, so that the state at each segment's
  // end is the same whether it was computed here or attached (a compressing
  // policy factors the first segment and continues over it); each new
  // leading segment is captured as soon as it is prefilled.
  size_t seg = 0;
  while (seg < q.document_ends.size() && q.document_ends[seg] <= st->at) ++seg;
  const int64_t boundary = seg < q.document_ends.size() ? q.document_ends[seg] : P;
  int64_t end = boundary;
  if (policy_->PrefillSplits(seq)) {
    // Whole prefill chunks: the same rows per chunk as one unsplit prefill.
    const int64_t chunk = options_.prefill_chunk;
    const int64_t piece = std::max<int64_t>(chunk, max_tokens / chunk * chunk);
    end = st->at + std::min(piece, boundary - st->at);  // (no overflow with max_tokens near INT64_MAX)
    PENUMBRA_RETURN_IF_ERROR(Prefill(seq, q.prompt, nullptr, st->at, end));
  } else {
    // The segment whole, a few layers per step: max_tokens tokens' worth of
    // work through every layer (at least one layer).
    const int L = config().num_layers;
    if (!st->partial) {
      PENUMBRA_ASSIGN_OR_RETURN(st->partial, StartPrefill(q.prompt, st->at, end));
    }
    const int64_t rows = end - st->at;
    // (max_tokens * L row-layers; no overflow: max_tokens < rows there.)
    const int64_t layers = max_tokens >= rows ? L : std::clamp<int64_t>(max_tokens * L / rows, 1, L);
    PENUMBRA_RETURN_IF_ERROR(PrefillLayers(seq, st->partial.get(), static_cast<int>(layers)));
    if (st->partial->layer < L) return false;
    Status finished = FinishPrefill(st->partial.get(), nullptr);
    st->partial.reset();
    PENUMBRA_RETURN_IF_ERROR(finished);
  }
  st->at = end;
  if (end == boundary && seg < q.document_ends.size() && st->capture) {
    PENUMBRA_RETURN_IF_ERROR(CaptureSegment(seq, q, st, seg, end));
  }
  return st->at == P;
}

Status Runtime::CaptureSegment(int64_t seq, const GenerationRequest& q, PrefillState* st, size_t seg, int64_t end) {
  if (cache_->Holds(st->keys[seg])) return Status::OK();
  const double t0 = NowSeconds();
  // A prefill-only request (a document's put) ends here: its state moves
  // into the prefix rather than being copied.
  const bool last = end == static_cast<int64_t>(q.prompt.size()) && q.max_new_tokens == 0;
  Result<std::shared_ptr<const KvPrefix>> p = last ? policy_->TakePrefix(seq, end) : policy_->CapturePrefix(seq, end);
  if (cache_->FreeDeviceFor(p.status())) p = last ? policy_->TakePrefix(seq, end) : policy_->CapturePrefix(seq, end);
  const double captured = NowSeconds() - t0;
  if (captured > 0.2) LOG(INFO) << "captured a " << end << "-token prefix in " << captured << " s";
  if (!p.ok() && p.status().code() == StatusCode::kUnimplemented) {
    st->capture = false;  // this policy cannot: no reuse
    return Status::OK();
  }
  PENUMBRA_RETURN_IF_ERROR(p.status());
  cache_->Capture(st->keys[seg], q.cache_namespace, end, std::move(*p), /*pinned=*/!q.kv_policy.empty());
  return Status::OK();
}

Status Runtime::AddAndPrefill(int64_t seq, const GenerationRequest& q, GenerationResult* result) {
  PrefillState st;
  PENUMBRA_RETURN_IF_ERROR(BeginPrefill(seq, q, &st, result));
  for (;;) {
    PENUMBRA_ASSIGN_OR_RETURN(bool done, PrefillStep(seq, q, &st, std::numeric_limits<int64_t>::max()));
    if (done) return Status::OK();
  }
}

void Runtime::SetPrefixStore(storage::DocumentStore* store, std::string model_identity) {
  if (cache_) cache_->SetPersistentTier(store, std::move(model_identity));
}

RunStats Runtime::stats() const {
  RunStats s = stats_;
  if (!cache_) return s;
  const DocumentCacheStats d = cache_->stats();
  s.prefix_store_hits = d.store_hits;
  s.prefix_store_corruptions = d.store_corruptions;
  s.prefix_store_errors = d.store_errors;
  s.prefix_stores = d.stores;
  s.prefix_store_skipped = d.store_skipped;
  s.prefix_store_write_seconds = d.store_write_seconds;
  s.prefix_store_read_seconds = d.store_read_seconds;
  s.prefix_import_seconds = d.import_seconds;
  s.prefix_store_read_bytes = d.store_read_bytes;
  s.prefix_store_fetch_failures = d.fetch_failures;
  s.tiers = d.tiers;
  s.document_moves = d.moves;
  s.document_move_seconds = d.move_seconds;
  s.document_move_failures = d.move_failures;
  s.documents_by_policy = d.by_policy;
  return s;
}

Result<const float*> Runtime::DecodeStep(const std::vector<int64_t>& seqs, const std::vector<int32_t>& tokens,
                                         const std::vector<int64_t>& positions) {
  if (cp_ != nullptr) {
    if (!leading_) return GroupDecode(seqs, tokens, positions);
    std::lock_guard<std::mutex> lk(lead_mu_);
    OpWriter w(GroupOp::kDecode, 0);
    w.Vec(seqs);
    w.Vec(tokens);
    w.Vec(positions);
    PENUMBRA_RETURN_IF_ERROR(SendOp(std::move(w.out)));
    return GroupDecode(seqs, tokens, positions);
  }
  PlaceDocuments();
  Result<const float*> r = DecodeStepImpl(seqs, tokens, positions);
  policy_->EndDecodeStep();  // on every path
  return r;
}

Result<const float*> Runtime::DecodeStepImpl(const std::vector<int64_t>& seqs, const std::vector<int32_t>& tokens,
                                             const std::vector<int64_t>& positions) {
  const ModelConfig& c = config();
  const int B = static_cast<int>(seqs.size());
  CHECK_LE(B, options_.max_batch);
  CHECK_EQ(tokens.size(), seqs.size());
  const int H = c.hidden_size;
  auto lap = [this](const char* op) {
    if (profiler_) profiler_->Lap(op);
  };
  if (profiler_) profiler_->Start();
  std::vector<int32_t> pos32(positions.begin(), positions.end());
  PENUMBRA_RETURN_IF_ERROR(backend_->CopyToDevice(ids_.get(), tokens.data(), B * sizeof(int32_t)));
  PENUMBRA_RETURN_IF_ERROR(backend_->CopyToDevice(pos_.get(), pos32.data(), B * sizeof(int32_t)));
  backend_->Embedding(weights_->embed(), weights_->dtype(), ids_.as<int32_t>(), B, H, x_.as<float>());
  PENUMBRA_RETURN_IF_ERROR(policy_->BeginDecodeStep(seqs, positions));
  PENUMBRA_RETURN_IF_ERROR(policy_->DecodeTokens(ids_.as<int32_t>(), pos_.as<int32_t>()));
  lap("begin_step");
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = weights_->layers()[l];
    backend_->RmsNorm(x_.as<float>(), L.attn_norm, weights_->dtype(), B, H, static_cast<float>(c.rms_norm_eps),
                      h_.get());
    backend_->Linear(h_.get(), L.qkv, B, qkv_.as<float>(), false);
    lap("qkv_projection");
    // Context parallel: the policy's part goes to this rank's message.
    PENUMBRA_RETURN_IF_ERROR(policy_->DecodeAttention(l, qkv_.as<float>(), pos_.as<int32_t>(), q_.get(),
                                                      cp_ != nullptr ? RankPart() : attn_.get(),
                                                      cp_ != nullptr ? RankPartLse(B * c.num_heads) : nullptr));
    lap("attention");  // what the policy did not lap itself
    if (cp_ != nullptr) {
      PENUMBRA_RETURN_IF_ERROR(MergeRanks(B * c.num_heads));
      lap("context_parallel_merge");
    }
    backend_->Linear(attn_.get(), L.o, B, x_.as<float>(), true);
    Mlp(L, x_.as<float>(), B);
    lap("o_projection_mlp");
  }
  backend_->RmsNorm(x_.as<float>(), weights_->final_norm(), weights_->dtype(), B, H, static_cast<float>(c.rms_norm_eps),
                    h_.get());
  backend_->Linear(h_.get(), weights_->lm_head(), B, logits_.as<float>(), false);
  lap("lm_head");
  PENUMBRA_RETURN_IF_ERROR(policy_->FinishDecodeStep());
  lap("finish_step");
  return logits_.as<float>();
}

Result<std::vector<GenerationResult>> Runtime::Generate(const std::vector<GenerationRequest>& requests) {
  if (leading_) return Status::FailedPrecondition("Generate: this runtime leads a context group (StopGroup first)");
  PENUMBRA_RETURN_IF_ERROR(Validate(requests));
  const ModelConfig& c = config();
  std::vector<GenerationResult> results(requests.size());
  for (size_t wave = 0; wave < requests.size(); wave += options_.max_batch) {
    const size_t end = std::min(requests.size(), wave + options_.max_batch);
    struct Active {
      size_t r;
      int64_t seq;
      std::mt19937_64 rng;
    };
    std::vector<Active> active;
    std::vector<int32_t> last(end - wave);
    auto params_of = [&](Active& a) {
      const SamplingOptions& s = requests[a.r].sampling;
      return SamplingDraw(s, a.rng);
    };
    auto emit = [&](Active& a, int32_t id) -> bool {  // true when the sequence is done
      GenerationResult& g = results[a.r];
      g.ids.push_back(id);
      last[a.r - wave] = id;
      for (int32_t s : requests[a.r].stop_ids) {
        if (s == id) {
          g.finish_reason = "stop";
          return true;
        }
      }
      if (static_cast<int>(g.ids.size()) >= requests[a.r].max_new_tokens) {
        g.finish_reason = "length";
        return true;
      }
      return false;
    };
    // Prefill each request, sampling its first token.
    for (size_t r = wave; r < end; ++r) {
      const GenerationRequest& q = requests[r];
      Active a{r, static_cast<int64_t>(r), std::mt19937_64(q.sampling.seed)};
      a.rng.discard(static_cast<unsigned long long>(std::max<int64_t>(0, q.draws_done)));
      // Context parallel: the group's steps (this rank's shard of the span, then the tail).
      Status s = cp_ == nullptr ? AddAndPrefill(a.seq, q, &results[r]) : GroupPrefill(a.seq, q, &results[r]);
      if (!s.ok()) {
        for (auto& x : active) policy_->RemoveSequence(x.seq);
        policy_->RemoveSequence(a.seq);
        return s;
      }
      if (q.max_new_tokens == 0) {  // prefill only
        results[r].finish_reason = "prefilled";
        policy_->RemoveSequence(a.seq);
        continue;
      }
      int32_t id = 0;
      PENUMBRA_RETURN_IF_ERROR(backend_->Sample(logits_.as<float>(), 1, c.vocab_size, {params_of(a)}, &id));
      if (cp_ != nullptr) PENUMBRA_RETURN_IF_ERROR(cp_->BroadcastHost(&id, sizeof(id), 0));  // rank 0's token
      ++stats_.generated_tokens;
      if (emit(a, id)) {
        policy_->RemoveSequence(a.seq);
      } else {
        active.push_back(a);
      }
    }
    // Decode the survivors together.
    const double t0 = NowSeconds();
    while (!active.empty()) {
      std::vector<int64_t> seqs, positions;
      std::vector<int32_t> tokens;
      std::vector<SampleParams> params;
      for (Active& a : active) {
        seqs.push_back(a.seq);
        tokens.push_back(last[a.r - wave]);
        positions.push_back(static_cast<int64_t>(requests[a.r].prompt.size() + results[a.r].ids.size()) - 1);
        params.push_back(params_of(a));
      }
      auto logits = DecodeStep(seqs, tokens, positions);
      if (!logits.ok()) {
        for (auto& x : active) policy_->RemoveSequence(x.seq);
        return logits.status();
      }
      std::vector<int32_t> ids(active.size());
      PENUMBRA_RETURN_IF_ERROR(
          backend_->Sample(*logits, static_cast<int>(active.size()), c.vocab_size, params, ids.data()));
      if (cp_ != nullptr) PENUMBRA_RETURN_IF_ERROR(cp_->BroadcastHost(ids.data(), ids.size() * sizeof(int32_t), 0));
      stats_.generated_tokens += static_cast<int64_t>(active.size());
      std::vector<Active> still;
      for (size_t i = 0; i < active.size(); ++i) {
        if (emit(active[i], ids[i])) {
          policy_->RemoveSequence(active[i].seq);
        } else {
          still.push_back(active[i]);
        }
      }
      active = std::move(still);
    }
    stats_.decode_seconds += NowSeconds() - t0;
  }
  return results;
}

// ---- Context parallel steps ----

// Prefill tokens whose work one tail token (a decode step of the group) is
// taken to cost (GroupStep).
constexpr int64_t kTailTokenCost = 128;

int64_t Runtime::SpanOf(const GenerationRequest& q) {
  return q.document_ends.empty() ? static_cast<int64_t>(q.prompt.size()) : q.document_ends.back();
}

Status Runtime::GroupHealth() const {
  std::lock_guard<std::mutex> lk(health_mu_);
  return health_;
}

Status Runtime::Broken(const Status& why) {
  std::lock_guard<std::mutex> lk(health_mu_);
  if (health_.ok()) {
    health_ = why.ok() ? Status::Internal("context group: broken") : why;
    LOG(WARNING) << "context group rank " << cp_->rank() << ": the group failed: " << health_;
  }
  return health_;
}

Status Runtime::Agree(const Status& local, int64_t* count) {
  // Each rank's code, its count and the start of its message.
  struct Outcome {
    int32_t code = 0;
    int32_t pad = 0;
    int64_t count = 0;
    char message[240] = {};
  };
  static_assert(sizeof(Outcome) == 256);
  const int world = cp_->world();
  Outcome mine;
  mine.code = static_cast<int32_t>(local.code());
  mine.count = count ? *count : 0;
  std::strncpy(mine.message, local.message().c_str(), sizeof(mine.message) - 1);
  std::vector<Outcome> all(static_cast<size_t>(world));
  Status g = cp_->AllGatherHost(&mine, all.data(), sizeof(Outcome));
  if (!g.ok()) return Broken(g);
  int64_t total = 0;
  for (int j = 0; j < world; ++j) {
    const Outcome& o = all[static_cast<size_t>(j)];
    if (o.code != 0) {
      const std::string text(o.message, strnlen(o.message, sizeof(o.message)));
      return Status(static_cast<StatusCode>(o.code), "context group rank " + std::to_string(j) + ": " + text);
    }
    total += o.count;
  }
  if (count) *count = total;
  return Status::OK();
}

Status Runtime::GroupBegin(int64_t seq, const GenerationRequest& q, PrefillState* st, GenerationResult* result) {
  PENUMBRA_RETURN_IF_ERROR(GroupHealth());
  *st = PrefillState{};
  const int rank = cp_->rank(), world = cp_->world();
  const int64_t P = static_cast<int64_t>(q.prompt.size()), D = SpanOf(q);
  const Shard sh = ShardOf(D, rank, world);
  // This rank's shard of the whole documents: memory, then its persistent tier.
  std::shared_ptr<const KvPrefix> hit;
  if (cache_ && !q.document_ends.empty()) {
    st->keys = RequestKeys(q);
    hit = cache_->FindLongest({st->keys.back()}, {sh.end - sh.begin}, nullptr).state;
  }
  // Attached only when every rank holds its shard.
  const uint8_t held = hit ? 1 : 0;
  std::vector<uint8_t> all(static_cast<size_t>(world));
  Status g = cp_->AllGatherHost(&held, all.data(), 1);
  if (!g.ok()) return Broken(g);
  const auto missing = std::find(all.begin(), all.end(), uint8_t{0});
  const bool attach = !q.document_ends.empty() && cache_ && missing == all.end();
  if (!attach && q.ids_from > 0) {
    return Status::FailedPrecondition("the documents (prompt tokens [0, " + std::to_string(D) +
                                      ")) are not held by context group rank " + std::to_string(missing - all.begin()) +
                                      " and their ids were not sent");
  }
  Status added = AddShard(seq, D, P - D, q.max_new_tokens, attach ? hit : nullptr);
  if (cache_ && cache_->FreeDeviceFor(added)) added = AddShard(seq, D, P - D, q.max_new_tokens, attach ? hit : nullptr);
  Status agreed = Agree(added);
  if (!agreed.ok()) {
    if (added.ok()) policy_->RemoveSequence(seq);
    return agreed;
  }
  const int64_t start = attach ? D : 0;
  stats_.prompt_tokens += start;
  stats_.cached_prompt_tokens += start;
  result->cached_prompt_tokens = start;
  st->result = result;
  st->attached = attach ? hit : nullptr;
  st->attached_segment = q.document_ends.empty() ? 0 : q.document_ends.size() - 1;
  st->at = start;
  st->capture = !st->keys.empty() && !attach;
  return Status::OK();
}

Status Runtime::GroupSpanStep(int64_t seq, const GenerationRequest& q, PrefillState* st, int64_t max_tokens) {
  const int L = config().num_layers;
  const int64_t D = SpanOf(q);
  const Shard sh = ShardOf(D, cp_->rank(), cp_->world());
  Status prepared;
  if (!st->partial) {
    Result<std::unique_ptr<PartialPrefill>> p = StartPrefill(q.prompt, sh.begin, sh.end);
    prepared = p.status();
    if (p.ok()) {
      st->partial = std::move(*p);
      st->partial->prompt_end = D;
    }
  }
  // Every step (another prefill's may have run in between): the exchange's
  // buffers for this one. Agreed before the first layer's exchange (an
  // allocation may fail here).
  if (prepared.ok()) prepared = PrepareKeyExchange(*st->partial);
  PENUMBRA_RETURN_IF_ERROR(Agree(prepared));
  // The same layers on every rank: the span's work, not this shard's.
  const int64_t layers = max_tokens >= D ? L : std::clamp<int64_t>(max_tokens * L / D, 1, L);
  PENUMBRA_RETURN_IF_ERROR(PrefillLayers(seq, st->partial.get(), static_cast<int>(layers)));
  if (st->partial->layer < L) return Status::OK();
  Status finished = FinishPrefill(st->partial.get(), nullptr);
  st->partial.reset();
  PENUMBRA_RETURN_IF_ERROR(finished);
  st->at = D;
  if (st->capture && cache_) PENUMBRA_RETURN_IF_ERROR(CaptureShard(seq, q, st, sh.end - sh.begin));
  return Status::OK();
}

Result<bool> Runtime::GroupStep(int64_t seq, const GenerationRequest& q, PrefillState* st, int64_t max_tokens) {
  PENUMBRA_RETURN_IF_ERROR(GroupHealth());
  const int64_t P = static_cast<int64_t>(q.prompt.size()), D = SpanOf(q);
  CHECK_LT(st->at, P) << "the prompt is already prefilled";
  PlaceDocuments();
  Status local;
  if (st->at < D) {
    local = GroupSpanStep(seq, q, st, max_tokens);
  } else if (q.max_new_tokens == 0) {
    st->at = P;  // a put: nothing reads the tail's state
  } else {
    // The tail: one token per decode step of this sequence alone (the last
    // rank stores them). A token costs about one decode step of the group,
    // the time of some kTailTokenCost prefill tokens: max_tokens /
    // kTailTokenCost of them per call (at least one), so that the running
    // batch's steps go on between.
    const int64_t n = std::clamp<int64_t>(max_tokens / kTailTokenCost, 1, P - st->at);
    const double t0 = NowSeconds();
    for (int64_t i = 0; i < n && local.ok(); ++i) {
      Result<const float*> r = DecodeStepImpl({seq}, {q.prompt[static_cast<size_t>(st->at)]}, {st->at});
      policy_->EndDecodeStep();
      local = r.status();
      if (local.ok()) ++st->at;
    }
    stats_.prefill_seconds += NowSeconds() - t0;
    if (local.ok()) stats_.prompt_tokens += n;
  }
  PENUMBRA_RETURN_IF_ERROR(Agree(local));
  return st->at == P;
}

Status Runtime::CaptureShard(int64_t seq, const GenerationRequest& q, PrefillState* st, int64_t own_tokens) {
  const Hash128& key = st->keys.back();
  if (cache_->Holds(key)) return Status::OK();
  // A prefill-only request (a document's put) ends here: moved, not copied.
  const bool last = SpanOf(q) == static_cast<int64_t>(q.prompt.size()) && q.max_new_tokens == 0;
  auto capture = [&] { return last ? policy_->TakePrefix(seq, own_tokens) : policy_->CapturePrefix(seq, own_tokens); };
  Result<std::shared_ptr<const KvPrefix>> p = capture();
  if (cache_->FreeDeviceFor(p.status())) p = capture();
  if (!p.ok() && p.status().code() == StatusCode::kUnimplemented) {
    st->capture = false;  // this policy cannot: no reuse
    return Status::OK();
  }
  PENUMBRA_RETURN_IF_ERROR(p.status());
  cache_->Capture(key, q.cache_namespace, own_tokens, std::move(*p));
  return Status::OK();
}

Result<const float*> Runtime::GroupDecode(const std::vector<int64_t>& seqs, const std::vector<int32_t>& tokens,
                                          const std::vector<int64_t>& positions) {
  PENUMBRA_RETURN_IF_ERROR(GroupHealth());
  PlaceDocuments();
  Result<const float*> r = DecodeStepImpl(seqs, tokens, positions);
  policy_->EndDecodeStep();
  PENUMBRA_RETURN_IF_ERROR(Agree(r.status()));
  return r;
}

Result<int> Runtime::GroupForget(const GenerationRequest& q) {
  PENUMBRA_RETURN_IF_ERROR(GroupHealth());
  Result<int> local = 0;
  if (cache_ && !q.document_ends.empty()) local = cache_->Forget(RequestKeys(q));
  int64_t count = local.ok() ? *local : 0;
  PENUMBRA_RETURN_IF_ERROR(Agree(local.status(), &count));
  return static_cast<int>(count);
}

Status Runtime::GroupPrefill(int64_t seq, const GenerationRequest& q, GenerationResult* result) {
  PrefillState st;
  PENUMBRA_RETURN_IF_ERROR(GroupBegin(seq, q, &st, result));
  for (;;) {
    Result<bool> done = GroupStep(seq, q, &st, std::numeric_limits<int64_t>::max());
    if (!done.ok()) {
      policy_->RemoveSequence(seq);
      return done.status();
    }
    if (*done) return Status::OK();
  }
}

// ---- Led mode ----

Status Runtime::LeadGroup() {
  if (cp_ == nullptr || cp_->rank() != 0) {
    return Status::FailedPrecondition("LeadGroup: only rank 0 of a context group leads it");
  }
  if (leading_) return Status::FailedPrecondition("LeadGroup: already leading");
  PENUMBRA_RETURN_IF_ERROR(GroupHealth());
  {
    std::lock_guard<std::mutex> lk(lead_mu_);
    last_op_ = std::chrono::steady_clock::now();
  }
  {
    std::lock_guard<std::mutex> lk(hb_mu_);
    hb_stop_ = false;
  }
  leading_ = true;
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  return Status::OK();
}

Status Runtime::StopGroup() {
  if (!leading_) return Status::FailedPrecondition("StopGroup: this runtime does not lead a context group");
  StopHeartbeat();
  std::lock_guard<std::mutex> lk(lead_mu_);
  leading_ = false;
  return SendOp(OpWriter(GroupOp::kStop, 0).out);
}

void Runtime::StopHeartbeat() {
  {
    std::lock_guard<std::mutex> lk(hb_mu_);
    hb_stop_ = true;
  }
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

Runtime::~Runtime() { StopHeartbeat(); }

void Runtime::HeartbeatLoop() {
  const auto every = std::chrono::milliseconds(std::max<int64_t>(1, options_.group_heartbeat_ms));
  std::unique_lock<std::mutex> lk(hb_mu_);
  while (!hb_stop_) {
    hb_cv_.wait_for(lk, every / 2, [this] { return hb_stop_; });
    if (hb_stop_) return;
    lk.unlock();
    {
      // An op in flight keeps the followers busy already.
      std::unique_lock<std::mutex> op(lead_mu_, std::try_to_lock);
      if (op.owns_lock() && GroupHealth().ok() && std::chrono::steady_clock::now() - last_op_ >= every) {
        (void)SendOp(OpWriter(GroupOp::kNoop, 0).out);  // a failure is the group's health
      }
    }
    lk.lock();
  }
}

Status Runtime::SendOp(std::string record) {
  PENUMBRA_RETURN_IF_ERROR(GroupHealth());
  uint64_t n = record.size();
  Status s = cp_->BroadcastHost(&n, sizeof(n), 0);
  if (s.ok()) s = cp_->BroadcastHost(record.data(), record.size(), 0);
  if (!s.ok()) return Broken(s);
  last_op_ = std::chrono::steady_clock::now();
  return Status::OK();
}

Status Runtime::FollowGroup() {
  if (cp_ == nullptr || cp_->rank() == 0) {
    return Status::FailedPrecondition("FollowGroup: only ranks > 0 of a context group follow its leader");
  }
  Status out;
  for (;;) {
    Status health = GroupHealth();
    if (!health.ok()) {
      out = health;
      break;
    }
    uint64_t n = 0;
    Status s = cp_->BroadcastHost(&n, sizeof(n), 0);
    std::string record;
    if (s.ok() && n > (uint64_t{1} << 32))
      s = Status::Corruption("context group: an op of " + std::to_string(n) + " bytes");
    if (s.ok()) {
      record.resize(n);
      s = cp_->BroadcastHost(record.data(), n, 0);
    }
    if (!s.ok()) {
      out = Broken(s);
      break;
    }
    bool stop = false;
    Status ran = RunOp(record, &stop);
    if (stop) break;
    if (!ran.ok()) VLOG(1) << "context group: a led op failed here and on every rank: " << ran;
  }
  for (auto& [seq, f] : followed_) policy_->RemoveSequence(seq);
  followed_.clear();
  return out;
}

Status Runtime::RunOp(const std::string& record, bool* stop) {
  OpReader r(record);
  const auto op = static_cast<GroupOp>(r.Pod<uint8_t>());
  const auto seq = r.Pod<int64_t>();
  if (!r.ok) return Broken(Status::Corruption("context group: a truncated op"));
  auto unknown = [&] {
    return Broken(Status::Internal("context group: sequence " + std::to_string(seq) + " is unknown here"));
  };
  switch (op) {
    case GroupOp::kNoop:
      return Status::OK();
    case GroupOp::kStop:
      *stop = true;
      return Status::OK();
    case GroupOp::kBegin: {
      auto f = std::make_unique<Followed>();
      f->req = r.Request();
      if (!r.ok) return Broken(Status::Corruption("context group: a truncated request"));
      if (followed_.count(seq))
        return Broken(Status::Internal("context group: sequence " + std::to_string(seq) + " exists"));
      Status s = GroupBegin(seq, f->req, &f->state, &f->result);
      if (s.ok()) followed_.emplace(seq, std::move(f));
      return s;
    }
    case GroupOp::kStep: {
      const auto max_tokens = r.Pod<int64_t>();
      auto it = followed_.find(seq);
      if (!r.ok || it == followed_.end()) return unknown();
      return GroupStep(seq, it->second->req, &it->second->state, max_tokens).status();
    }
    case GroupOp::kDecode: {
      const auto seqs = r.Vec<int64_t>();
      const auto tokens = r.Vec<int32_t>();
      const auto positions = r.Vec<int64_t>();
      if (!r.ok || seqs.size() != tokens.size() || seqs.size() != positions.size()) {
        return Broken(Status::Corruption("context group: a truncated decode step"));
      }
      for (int64_t s : seqs) {
        if (!followed_.count(s)) {
          return Broken(Status::Internal("context group: sequence " + std::to_string(s) + " is unknown here"));
        }
      }
      return GroupDecode(seqs, tokens, positions).status();
    }
    case GroupOp::kRemove:
      followed_.erase(seq);
      policy_->RemoveSequence(seq);
      return Status::OK();
    case GroupOp::kForget: {
      const GenerationRequest q = r.Request();
      if (!r.ok) return Broken(Status::Corruption("context group: a truncated request"));
      return GroupForget(q).status();
    }
  }
  return Broken(Status::Corruption("context group: unknown op " + std::to_string(static_cast<int>(op))));
}

}  // namespace penumbra
