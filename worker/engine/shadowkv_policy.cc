// ShadowKV KV policy (seed 000, Algorithms 1-2, appendix A.1 "ShadowKV+").
//
// Per sequence and layer, on the device:
//   A  [token_cap][r]            low-rank coordinates of pre-RoPE keys
//   B  [hkv][r][d]               singular values folded in (Algorithm 1)
//   P  [hkv*d][r] f32            projection for new tokens' keys (A.1)
//   L  [hkv][chunk_cap] records  landmarks: mean post-RoPE key of each of a chunk's
//                                S = landmarks_per_chunk runs of C/S keys (S = 1: the paper),
//                                S rows of d per chunk (model dtype, or fp8 codes and a scale:
//                                kernels/landmark_format.h)
//   X  [hkv][chunk_cap] u8       1 = outlier chunk (excluded from selection)
//   att K/V [hkv][att_cap][d]    rows: O*C outlier rows | kslots*C slot rows | local rows
//   slot map [hkv][kslots]       chunk held by each slot (-1 empty)
//   pre-RoPE keys of the local rows [local_cap][hkv*d] f32 (for A.1 projection)
// and in the value store (pinned host DRAM, zero-copy readable): every
// chunk's values, [layer][hkv][chunk_cap][C*d].
//
// Prefill is layer-major: each layer's exact K/V for the whole prompt live in
// a temporary buffer while that layer runs full attention; FinishPrefillLayer
// then factors the pre-RoPE keys (SVD via Gram + eigensolver), builds
// landmarks, picks outliers, copies outliers and the local window into the
// attention buffer and writes values to the store, and the temporary is reused
// by the next layer.
//
// Decode per layer: score landmarks, top-k chunks per KV head, compare with
// the slot map (hits stay), rebuild K = A·B + RoPE for misses on the main
// stream while the side stream fetches their V from the store, then attention
// over outliers + slots + local rows. When the local rows reach
// local_window + C, the oldest C tokens become a chunk: landmark, projected
// A rows, values to the store (all layers at once), and the local rows shift.
//
// Prompts shorter than min_prompt_tokens (or too short to select from) keep
// every token in the local rows: exact attention through the same path.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include <functional>
#include <span>
#include <sstream>
#include <thread>

#include "kernels/landmark_format.h"
#include "storage/dram_value_store.h"
#include "worker/engine/shadowkv_prefix.h"
#include "worker/engine/backend_host_allocator.h"
#include "worker/engine/collective.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

namespace kn = kernels;


class ShadowKvPolicy final : public KvPolicy {
  struct Seq;

 public:
  ShadowKvPolicy(const PolicyContext& ctx, const ShadowKvOptions& o)
      : ctx_(ctx), o_(o), es_(DTypeSize(ctx.backend->act_dtype())),
        lm_rec_(kn::LandmarkChunkElems(o.landmarks_per_chunk, ctx.head_dim, o.landmark_fp8())),
        lm_rec_bytes_(kn::LandmarkChunkBytes(o.landmarks_per_chunk, ctx.head_dim, o.landmark_fp8(), es_)),
        host_alloc_(ctx.backend),
        store_(&host_alloc_, storage::DramValueStoreOptions{}) {}

  std::string name() const override { return "shadowkv"; }

  Status AddSequence(int64_t id, const SequenceSpec& spec) override {
    if (seqs_.count(id)) return Status::InvalidArgument("sequence " + std::to_string(id) + " already exists");
    const ShadowKvPrefix* prefix = nullptr;
    if (spec.prefix) {
      prefix = dynamic_cast<const ShadowKvPrefix*>(spec.prefix.get());
      if (prefix == nullptr) {
        return Status::InvalidArgument("a " + spec.prefix->policy() + " prefix cannot attach to a shadowkv sequence");
      }
      if (prefix->tokens() >= spec.prompt_len) {
        return Status::InvalidArgument("a prefix of " + std::to_string(prefix->tokens()) +
                                       " tokens leaves nothing of the " + std::to_string(spec.prompt_len) +
                                       "-token prompt to prefill");
      }
    }
    if (spec.shard.sharded() && spec.prefix) {
      return Status::Unimplemented("shadowkv: a context-parallel shard cannot attach a prefix");
    }
    if (!(spec.shard.share > 0 && spec.shard.share <= 1)) {
      return Status::InvalidArgument("shadowkv: a shard's share of its sequence must be in (0, 1]");
    }
    Seq s;
    s.id = id;
    s.pos0 = spec.shard.position_base;
    s.closed = spec.shard.closed;
    SequenceSpec shape = spec;
    if (prefix) shape.first_prefill = prefix->geometry().factored;
    Shape(shape, &s);
    // A budget that is a fraction of the prompt grows with it (the fixed one
    // is checked when the engine starts): the request is refused, the engine
    // keeps serving.
    if (s.sparse && s.kslots > kShadowKvMaxSelectedChunks) {
      return Status::InvalidArgument("shadowkv: a budget of " + std::to_string(s.kslots) + " chunks (" +
                                     std::to_string(int64_t{s.kslots} * o_.chunk_size) +
                                     " tokens) for this prompt is more than the " +
                                     std::to_string(kShadowKvMaxSelectedChunks) +
                                     " a selection takes (lower shadowkv.budget_fraction)");
    }
    if (s.global_k > kn::kTopKMaxK) {
      return Status::InvalidArgument("shadowkv: a global selection over the shards of " +
                                     std::to_string(s.global_k) + " chunks is more than " +
                                     std::to_string(kn::kTopKMaxK) + " (lower the budget)");
    }
    const int C = o_.chunk_size;
    if (prefix) {
      const ShadowKvPrefixGeometry& g = prefix->geometry();
      if (g.sparse != s.sparse || g.outliers != s.outliers || g.tail > s.local_cap ||
          (s.sparse && g.n_chunks >= s.chunk_cap) ||
          (s.sparse && (g.landmarks_per_chunk != o_.landmarks_per_chunk || g.landmark_fp8 != o_.landmark_fp8()))) {
        return Status::InvalidArgument("the shadowkv prefix (" + g.Meta() +
                                       ") does not fit this policy's options for a sequence of " +
                                       std::to_string(s.token_cap) + " tokens");
      }
      s.shared_chunks = g.n_chunks;
      s.shared_stride = prefix->value_stride();
    }
    s.att_cap = static_cast<int64_t>(s.outliers + s.kslots) * C + s.local_cap;
    const int L = ctx_.num_layers, H = ctx_.hkv, d = ctx_.head_dim, r = o_.rank, D = H * d;
    auto alloc = [&](DeviceBuffer* b, size_t bytes) -> Status {
      PENUMBRA_ASSIGN_OR_RETURN(*b, ctx_.backend->Allocate(bytes));
      return Status::OK();
    };
    PENUMBRA_RETURN_IF_ERROR(alloc(&s.att_k, AttLayer(s) * L * es_));
    PENUMBRA_RETURN_IF_ERROR(alloc(&s.att_v, AttLayer(s) * L * es_));
    if (s.sparse) {
      // The store holds the chunks this sequence makes; an attached prefix's
      // are read in place from the prefix.
      const int own_chunks = s.chunk_cap - s.shared_chunks;
      const size_t host_need = static_cast<size_t>(L) * H * own_chunks * C * d * es_;
      const size_t host_free = ctx_.backend->FreeHostBytes();
      if (host_free > 0 && host_need + (size_t{8} << 30) > host_free) {
        return Status::ResourceExhausted("shadowkv: the value store needs " + std::to_string(host_need >> 20) +
                                         " MiB of host memory and only " + std::to_string(host_free >> 20) +
                                         " MiB are available (8 GiB kept free)");
      }
      // A rows and landmarks of the chunks this sequence makes; an attached
      // prefix's are read in place from the prefix.
      s.a_rows = s.token_cap - static_cast<int64_t>(s.shared_chunks) * C;
      s.lm_cap = s.chunk_cap - s.shared_chunks;
      PENUMBRA_RETURN_IF_ERROR(alloc(&s.a, static_cast<size_t>(L) * s.a_rows * r * es_));
      PENUMBRA_RETURN_IF_ERROR(alloc(&s.b, static_cast<size_t>(L) * H * r * d * es_));
      PENUMBRA_RETURN_IF_ERROR(alloc(&s.p, static_cast<size_t>(L) * D * r * sizeof(float)));
      PENUMBRA_RETURN_IF_ERROR(alloc(&s.lm, static_cast<size_t>(L) * H * s.lm_cap * lm_rec_bytes_));
      PENUMBRA_RETURN_IF_ERROR(alloc(&s.excl, static_cast<size_t>(L) * H * s.chunk_cap));
      PENUMBRA_RETURN_IF_ERROR(alloc(&s.slots, static_cast<size_t>(L) * H * s.kslots * sizeof(int32_t)));
      PENUMBRA_RETURN_IF_ERROR(alloc(&s.prek, static_cast<size_t>(L) * s.local_cap * D * sizeof(float)));
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Memset(s.excl.get(), 0, s.excl.bytes()));
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Memset(s.slots.get(), 0xff, s.slots.bytes()));
      storage::SegmentLayout lay{L, H, own_chunks, C, d, ctx_.backend->act_dtype()};
      // Reserved now, each layer pinned when the prefill reaches it
      // (EnsureStoreLayer): a long prompt's 8 GB are not pinned all at once
      // while the running batch waits.
      PENUMBRA_ASSIGN_OR_RETURN(s.segment, store_.ReserveSegment(lay));
      s.store_dev.assign(static_cast<size_t>(L), nullptr);
      s.store_host.assign(static_cast<size_t>(L), nullptr);
    }
    if (prefix) {
      Status st = AttachState(s, *prefix);
      if (!st.ok()) {
        if (s.segment) (void)store_.DropSegment(s.segment);
        return st;
      }
      s.prefix = std::static_pointer_cast<const ShadowKvPrefix>(spec.prefix);
    }
    seqs_.emplace(id, std::move(s));
    return Status::OK();
  }

  // A new sequence's geometry (outliers, slots, capacities). It follows
  // from the tokens of the first prefill alone (where the keys are
  // factored), so every sequence that starts with the same document,
  // attached or prefilled, has the same outliers and budget.
  void Shape(const SequenceSpec& spec, Seq* out) const {
    Seq& s = *out;
    // A closed shard (context parallel) keeps one spare row: decode steps'
    // RopeStore writes the new token's K/V there, never attended to.
    s.token_cap = spec.prompt_len + (spec.shard.closed ? 1 : spec.max_new_tokens);
    s.first_prefill = spec.first_prefill > 0 ? std::min(spec.first_prefill, spec.prompt_len) : spec.prompt_len;
    const int64_t F = s.first_prefill;
    const int C = o_.chunk_size;
    // Context parallel with a global selection: the budget, the sparse
    // decision and the exchange width are the whole sequence's, the same on
    // every rank.
    const bool global = spec.shard.group != nullptr && o_.shard_selection == "global";
    const int64_t whole = global && spec.shard.sequence_tokens > 0 ? spec.shard.sequence_tokens : F;
    int64_t budget = o_.budget_tokens;
    if (o_.budget_fraction > 0) budget = static_cast<int64_t>(std::ceil(o_.budget_fraction * whole / C)) * C;
    // Local selection: a shard's share of its whole sequence's budget, at
    // least one chunk.
    if (!global && spec.shard.share < 1.0 && o_.budget_fraction <= 0) {
      budget = std::max<int64_t>(C, static_cast<int64_t>(std::llround(spec.shard.share * budget / C)) * C);
    }
    // The local window is the sequence's most recent tokens: a closed shard
    // (all but the last) has none, its whole prompt is chunks.
    s.window = spec.shard.closed ? 0 : o_.local_window;
    const int64_t first_chunks = (F - s.window) / C;
    int64_t want_outliers = o_.outlier_chunks;
    if (global) want_outliers = std::llround(spec.shard.share * o_.outlier_chunks);  // the sequence's, split
    if (o_.outlier_fraction > 0) {
      want_outliers = static_cast<int64_t>(std::ceil(o_.outlier_fraction * static_cast<double>(std::max<int64_t>(first_chunks, 0))));
    }
    s.outliers = static_cast<int>(std::min<int64_t>(want_outliers, std::max<int64_t>(first_chunks - budget / C, 0)));
    s.kslots = static_cast<int>(std::min<int64_t>(budget / C, first_chunks - s.outliers));
    s.sparse = whole >= o_.min_prompt_tokens && s.kslots >= 1;
    // The shards exchange when the whole sequence is sparse (every rank
    // decides alike; a shard too short to select from takes part with no
    // proposals).
    const bool exchange = global && whole >= o_.min_prompt_tokens;
    s.global_k = exchange ? static_cast<int>(std::min<int64_t>(budget / C, int64_t{1} << 30)) : 0;
    s.group = exchange ? spec.shard.group : nullptr;
    if (!s.sparse) {
      s.outliers = 0;
      s.kslots = 0;
      s.local_cap = s.token_cap;
    } else {
      s.local_cap = o_.local_window + 2 * C;  // prompt tail (< W + C) plus one chunk of growth
      s.chunk_cap = static_cast<int>((s.token_cap + C - 1) / C);
    }
  }

  void RemoveSequence(int64_t id) override {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    (void)ctx_.backend->Synchronize();  // kernels may still read its buffers
    if (it->second.segment) (void)store_.DropSegment(it->second.segment);
    seqs_.erase(it);
  }

  // ---------------------------------------------------------------- prefill

  Status PrefillAttention(int layer, int64_t id, const float* qkv, int n, int64_t global_start,
                          const int32_t* positions, void* q_scratch, void* out, float* lse) override {
    Seq& s = Get(id);
    // A shard's rows count from its first position (positions, for RoPE,
    // stay the whole sequence's).
    const int64_t start = global_start - s.pos0;
    if (start < 0) return Status::InvalidArgument("shadowkv: a prefill before the shard's first position");
    if (s.pos0 > 0 && s.compressed) {
      return Status::Unimplemented("shadowkv: a context-parallel shard takes one prefill (no continuation)");
    }
    PENUMBRA_RETURN_IF_ERROR(EnsureStoreLayer(s, layer));
    Backend& b = *ctx_.backend;
    const int d = ctx_.head_dim, H = ctx_.hkv, D = H * d;
    // Dense sequences prefill straight into their local rows; sparse ones
    // into the per-layer temporary (whole prompt, exact).
    void* kbase;
    void* vbase;
    int64_t stride;
    int64_t row0 = start;  // the temporaries' row of token `start`
    if (!s.sparse) {
      kbase = Row(s.att_k, s, layer, LocalRow0(s));
      vbase = Row(s.att_v, s, layer, LocalRow0(s));
      stride = s.att_cap * d;
    } else {
      if (!s.compressed) {
        if (start == 0) PENUMBRA_RETURN_IF_ERROR(EnsureTemp(s.token_cap));
      } else {
        // A continuation: the first piece of each layer rebuilds what the
        // sequence holds into the temporaries (dense: every chunk, row t =
        // token t; sparse: the outliers, the chunks the piece's queries
        // select and the local rows, in decode's row order, so token t is
        // row t + cont_shift), and the new tokens attend to all of it.
        const int64_t held = Held(s);
        if (start < held) {
          return Status::InvalidArgument("sequence " + std::to_string(id) + " holds " + std::to_string(held) +
                                         " tokens; a prefill cannot start at " + std::to_string(start));
        }
        if (start == held) {
          s.cont_k = 0;
          s.cont_shift = 0;
          if (o_.continuation == "sparse") {
            const int want = o_.continuation_budget_tokens > 0
                                 ? static_cast<int>(o_.continuation_budget_tokens / o_.chunk_size)
                                 : s.kslots;
            s.cont_k = std::max(1, std::min(want, s.n_chunks - s.outliers));
            s.cont_shift = static_cast<int64_t>(s.outliers + s.cont_k - s.n_chunks) * o_.chunk_size;
          }
          PENUMBRA_RETURN_IF_ERROR(EnsureTemp(s.token_cap + s.cont_shift));
          if (s.cont_k == 0) PENUMBRA_RETURN_IF_ERROR(RebuildIntoTemp(s, layer));
        }
        row0 = start + s.cont_shift;
      }
      kbase = tmp_k_.get();
      vbase = tmp_v_.get();
      stride = tmp_cap_ * d;
    }
    PENUMBRA_RETURN_IF_ERROR(StoreTokens(qkv, positions, n, row0, q_scratch, kbase, vbase, stride,
                                         s.sparse ? tmp_prek_.as<float>() + row0 * D : nullptr));
    if (s.sparse && s.compressed && s.cont_k > 0 && start == Held(s)) {
      PENUMBRA_RETURN_IF_ERROR(SelectForContinuation(s, layer, q_scratch, n));
      PENUMBRA_RETURN_IF_ERROR(RebuildSelectedIntoTemp(s, layer));
    }
    PrefillAttentionOp a;
    a.q = q_scratch;
    a.k = kbase;
    a.v = vbase;
    a.out = out;
    a.head_stride = stride;
    a.q_start = static_cast<int>(row0);
    a.nq = n;
    a.hq = ctx_.hq;
    a.hkv = H;
    a.d = d;
    a.scale = ctx_.scale;
    a.lse = lse;
    b.PrefillAttention(a);
    if (!s.sparse) s.local_count = std::max<int64_t>(s.local_count, start + n);
    return Status::OK();
  }

  Status FinishPrefillLayer(int layer, int64_t id, int64_t prompt_end) override {
    Seq& s = Get(id);
    const int64_t prompt_len = prompt_end - s.pos0;  // the shard's own tokens
    if (!s.sparse) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(EnsureStoreLayer(s, layer));
    if (!s.compressed) {
      if (prompt_len != s.first_prefill) {
        return Status::InvalidArgument("sequence " + std::to_string(id) + ": its first prefill must end at " +
                                       std::to_string(s.first_prefill) + " tokens (AddSequence's first_prefill), not " +
                                       std::to_string(prompt_len));
      }
      PENUMBRA_RETURN_IF_ERROR(CompressPrompt(s, layer, prompt_len));
    } else {
      PENUMBRA_RETURN_IF_ERROR(ContinuePrompt(s, layer, prompt_len));
    }
    if (layer == ctx_.num_layers - 1) {
      s.compressed = true;
      ReleaseTempIfLarge();
      // A prefix read lazily from disk: its first request is answered; the
      // rest of its values now come in the background.
      if (s.prefix) s.prefix->StartValueRestore();
    }
    return Status::OK();
  }

  // Tokens the sequence holds (after its last prefill or decode step).
  int64_t Held(const Seq& s) const { return static_cast<int64_t>(s.n_chunks) * o_.chunk_size + s.local_count; }

  // Rebuilds layer `layer` of a compressed sequence into the prefill
  // temporaries for a dense continuation: every chunk's K from its low-rank
  // factors (the outliers' exact K over them), every chunk's values from the
  // store, the local rows' exact K/V and pre-RoPE keys after them. Row t of
  // the temporaries is then token t, as in a first prefill.
  Status RebuildIntoTemp(Seq& s, int layer) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, C = o_.chunk_size, n = s.n_chunks;
    if (n > 0) {
      // One "miss" per chunk into row chunk*C: slot = chunk, no outlier rows.
      PENUMBRA_ASSIGN_OR_RETURN(const int32_t* count, IotaLists(n));
      const int32_t* iota = count + H;
      if (s.prefix) {
        PENUMBRA_RETURN_IF_ERROR(s.prefix->EnsureAllValues());  // read lazily from disk
        s.prefix->NoteReads(static_cast<int64_t>(s.shared_chunks) * H);
      }
      PENUMBRA_RETURN_IF_ERROR(GatherChunksIntoTemp(s, layer, count, iota, iota, n, /*first_row=*/0));
      // The outliers' exact keys over their rebuilt ones.
      const size_t crow = static_cast<size_t>(C) * d * es_;
      for (int h = 0; h < H; ++h) {
        for (int j = 0; j < s.outliers; ++j) {
          const int c = s.outlier_ids[(static_cast<size_t>(layer) * H + h) * s.outliers + j];
          PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(
              static_cast<char*>(tmp_k_.get()) + (h * tmp_cap_ + static_cast<int64_t>(c) * C) * d * es_,
              static_cast<char*>(Row(s.att_k, s, layer, 0)) + (h * s.att_cap + static_cast<int64_t>(j) * C) * d * es_,
              crow));
        }
      }
    }
    return CopyLocalIntoTemp(s, layer, static_cast<int64_t>(n) * C);
  }

  // The sparse continuation's rebuild of layer `layer`, in decode's row
  // order: the outliers' exact K/V (rows [0, O*C)), the chunks
  // SelectForContinuation chose (K rebuilt, values from the store; rows
  // O*C + j*C), the local rows after them.
  Status RebuildSelectedIntoTemp(Seq& s, int layer) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, C = o_.chunk_size, O = s.outliers, k = s.cont_k;
    if (O > 0) {
      const size_t w = static_cast<size_t>(O) * C * d * es_;
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(tmp_k_.get(), tmp_cap_ * d * es_, Row(s.att_k, s, layer, 0),
                                        s.att_cap * d * es_, w, H));
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(tmp_v_.get(), tmp_cap_ * d * es_, Row(s.att_v, s, layer, 0),
                                        s.att_cap * d * es_, w, H));
    }
    // Values read lazily from disk: the selected chunks' now, ahead of the
    // background restore, and through the host (not pinned yet).
    const bool staged = s.prefix && !s.prefix->values_complete();
    if (staged) PENUMBRA_RETURN_IF_ERROR(s.prefix->EnsureValues(layer, cont_sel_host_.data(), k));
    if (s.prefix) s.prefix->NoteReads(static_cast<int64_t>(k) * H);
    PENUMBRA_ASSIGN_OR_RETURN(const int32_t* count, IotaLists(k));  // slot j: the j-th selected chunk
    PENUMBRA_RETURN_IF_ERROR(GatherChunksIntoTemp(s, layer, count, count + H, cont_sel_.as<int32_t>(), k,
                                                  static_cast<int64_t>(O) * C,
                                                  staged ? cont_sel_host_.data() : nullptr));
    return CopyLocalIntoTemp(s, layer, static_cast<int64_t>(O + k) * C);
  }

  // Device lists for a continuation's rebuild: per head the count k, then
  // per head 0..k-1 (kept while k stays the same).
  Result<const int32_t*> IotaLists(int k) {
    const int H = ctx_.hkv;
    if (iota_k_ != k) {
      std::vector<int32_t> lists(static_cast<size_t>(H) * (1 + k));
      for (int h = 0; h < H; ++h) {
        lists[h] = k;
        for (int j = 0; j < k; ++j) lists[H + static_cast<size_t>(h) * k + j] = j;
      }
      PENUMBRA_RETURN_IF_ERROR(Upload(&iota_lists_, lists.data(), lists.size() * sizeof(int32_t)));
      iota_k_ = k;
    }
    return iota_lists_.as<int32_t>();
  }

  // Rebuilt K and fetched values of per-head chunk lists (count[h] chunks
  // chunk[h * per_head + j] into rows first_row + slot[h * per_head + j] * C
  // of the temporaries). host_chunks (the same lists on the host, every
  // head's count per_head): the values go through pinned staging on the
  // host instead of being read in place (an attached prefix's values not
  // yet pinned).
  Status GatherChunksIntoTemp(Seq& s, int layer, const int32_t* count, const int32_t* slot, const int32_t* chunk,
                              int per_head, int64_t first_row, const int32_t* host_chunks = nullptr) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, C = o_.chunk_size;
    const void* ptrs[5] = {ALayer(s, layer), Row2(s.b, layer, static_cast<int64_t>(H) * o_.rank * d), tmp_k_.get(),
                           tmp_v_.get(), s.store_dev[layer]};
    std::vector<const void*> table(std::begin(ptrs), std::end(ptrs));
    table.push_back(s.prefix ? s.prefix->values_device(layer) : nullptr);
    table.push_back(s.prefix ? s.prefix->a_layer(layer) : nullptr);
    PENUMBRA_RETURN_IF_ERROR(Upload(&rebuild_ptrs_, table.data(), table.size() * sizeof(void*)));
    auto* dev = static_cast<void* const*>(rebuild_ptrs_.get());
    kn::ShadowkvRebuildKArgs rk;
    rk.a = reinterpret_cast<const void* const*>(dev + 0);
    rk.shared_a = reinterpret_cast<const void* const*>(dev + 6);
    rk.shared_chunks = s.shared_chunks;
    rk.b = reinterpret_cast<const void* const*>(dev + 1);
    rk.inv_freq = ctx_.inv_freq;
    rk.miss_count = count;
    rk.miss_slot = slot;
    rk.miss_chunk = chunk;
    rk.miss_stride = per_head;
    rk.att_k = dev + 2;
    rk.att_head_stride = tmp_cap_ * d;
    rk.outlier_rows = first_row;
    rk.batch = 1;
    rk.hkv = H;
    rk.d = d;
    rk.r = o_.rank;
    rk.chunk_size = C;
    rk.max_misses = per_head;
    b.ShadowkvRebuildK(rk);
    kn::ShadowkvFetchVArgs fv;
    fv.value_store = reinterpret_cast<const void* const*>(dev + 4);
    fv.chunk_cap = s.chunk_cap - s.shared_chunks;
    fv.shared_store = reinterpret_cast<const void* const*>(dev + 5);
    fv.shared_chunks = s.shared_chunks;
    fv.shared_stride = s.shared_stride;
    fv.miss_count = count;
    fv.miss_slot = slot;
    fv.miss_chunk = chunk;
    fv.miss_stride = per_head;
    fv.att_v = dev + 3;
    fv.att_head_stride = tmp_cap_ * d;
    fv.outlier_rows = first_row;
    fv.batch = 1;
    fv.hkv = H;
    fv.d = d;
    fv.chunk_size = C;
    fv.max_misses = per_head;
    fv.max_blocks = kRestoreFetchBlocks;
    if (host_chunks != nullptr) {
      const size_t cb = static_cast<size_t>(C) * d * es_, n = static_cast<size_t>(H) * per_head;
      if (stage_v_.bytes() < n * cb) {
        PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
        PENUMBRA_ASSIGN_OR_RETURN(stage_v_, b.AllocateHost(n * cb));
      }
      for (size_t i = 0; i < n; ++i) {
        PENUMBRA_RETURN_IF_ERROR(CopyChunkToHost(s, layer, static_cast<int>(i / per_head), host_chunks[i],
                                                 stage_v_.as<char>() + i * cb));
      }
      fv.staging = b.DeviceAddressOfHost(stage_v_.get());  // row h's chunks at h * per_head
      b.ShadowkvFetchV(fv, /*staged=*/true);
    } else {
      b.ShadowkvFetchV(fv, /*staged=*/false);
    }
    return Status::OK();
  }

  // Chunk c of head h of `layer` of s (an attached prefix's, from its host
  // values, or one of s's own, checked by the store) into host memory.
  Status CopyChunkToHost(Seq& s, int layer, int h, int c, char* dst) {
    const size_t cb = static_cast<size_t>(o_.chunk_size) * ctx_.head_dim * es_;
    if (c < s.shared_chunks) {
      std::memcpy(dst, s.prefix->values_host(layer) + (static_cast<size_t>(h) * s.shared_stride + c) * cb, cb);
      return Status::OK();
    }
    const storage::ChunkRef ref{h, c - s.shared_chunks};
    return store_.GatherChunks(s.segment, layer, std::span(&ref, 1), dst);
  }

  // The local rows' exact K/V and pre-RoPE keys into the temporaries from row `row`.
  Status CopyLocalIntoTemp(Seq& s, int layer, int64_t row) {
    if (s.local_count == 0) return Status::OK();
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, D = H * d;
    const size_t w = s.local_count * d * es_;
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(tmp_k_.get()) + row * d * es_, tmp_cap_ * d * es_,
                                      Row(s.att_k, s, layer, LocalRow0(s)), s.att_cap * d * es_, w, H));
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(tmp_v_.get()) + row * d * es_, tmp_cap_ * d * es_,
                                      Row(s.att_v, s, layer, LocalRow0(s)), s.att_cap * d * es_, w, H));
    return b.CopyDeviceToDevice(tmp_prek_.as<float>() + row * D,
                                s.prek.as<float>() + static_cast<int64_t>(layer) * s.local_cap * D,
                                s.local_count * D * sizeof(float));
  }

  // A sparse continuation's selection at `layer`: cont_k chunks per KV
  // head, chosen together. A chunk's score is the maximum, over the piece's
  // `rows` query rows (q: [rows][hq][d], after RoPE) and over the heads, of
  // decode's score (ShadowkvScore: the group's maximum of the softmax over
  // the landmarks); each head takes the best-scoring chunks that are not its
  // own outliers. One list for every head (up to their outliers) is what
  // lets values stored chunk-major (ShadowKvPrefix, format v2) be read from
  // disk one chunk of all heads per read. Into cont_sel_host_ and cont_sel_
  // ([hkv][cont_k], ascending).
  Status SelectForContinuation(Seq& s, int layer, const void* q, int rows) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, n = s.n_chunks, k = s.cont_k;
    constexpr int kRowsPerScore = 64;  // rows scored per launch (bounds the scores' scratch)
    const int rb = std::min(rows, kRowsPerScore);
    std::vector<const void*> t(3 * static_cast<size_t>(rb));
    for (int i = 0; i < rb; ++i) {
      t[i] = LmLayer(s, layer);
      t[rb + i] = s.excl.as<uint8_t>() + static_cast<int64_t>(layer) * H * s.chunk_cap;
      t[2 * rb + i] = s.prefix ? s.prefix->lm_layer(layer) : nullptr;
    }
    std::vector<uint8_t> blob(t.size() * sizeof(void*) + static_cast<size_t>(rb) * 4);
    std::memcpy(blob.data(), t.data(), t.size() * sizeof(void*));
    std::vector<int32_t> counts(static_cast<size_t>(rb), n);
    std::memcpy(blob.data() + t.size() * sizeof(void*), counts.data(), counts.size() * 4);
    PENUMBRA_RETURN_IF_ERROR(Upload(&cont_tab_, blob.data(), blob.size()));
    auto grow = [&](DeviceBuffer* buf, size_t bytes) -> Status {
      if (buf->bytes() >= bytes) return Status::OK();
      PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(*buf, b.Allocate(bytes));
      return Status::OK();
    };
    const size_t per_row = static_cast<size_t>(H) * n;
    PENUMBRA_RETURN_IF_ERROR(grow(&cont_scores_, per_row * rb * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(grow(&cont_max_, static_cast<size_t>(n) * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(grow(&cont_sel_, static_cast<size_t>(H) * k * sizeof(int32_t)));
    auto* tab = static_cast<void* const*>(cont_tab_.get());
    for (int r0 = 0; r0 < rows; r0 += rb) {
      const int nr = std::min(rb, rows - r0);
      kn::ShadowkvScoreArgs sc;
      sc.q = static_cast<const char*>(q) + static_cast<size_t>(r0) * ctx_.hq * d * es_;
      sc.landmarks = reinterpret_cast<const void* const*>(tab);
      sc.excluded = reinterpret_cast<const uint8_t* const*>(tab + rb);
      sc.shared_landmarks = reinterpret_cast<const void* const*>(tab + 2 * rb);
      sc.n_chunks = reinterpret_cast<const int32_t*>(tab + 3 * rb);
      sc.batch = nr;
      sc.hq = ctx_.hq;
      sc.hkv = H;
      sc.d = d;
      sc.chunk_cap = s.chunk_cap;
      sc.landmark_cap = s.lm_cap;
      sc.landmarks_per_chunk = o_.landmarks_per_chunk;
      sc.landmark_fp8 = o_.landmark_fp8();
      sc.shared_chunks = s.shared_chunks;
      sc.max_chunks = n;
      sc.scale = ctx_.scale;
      sc.scores = cont_scores_.as<float>();
      sc.score_stride = n;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
      kn::MaxRowsArgs mr;  // over the rows and the heads: scores are [row][head][chunk]
      mr.in = cont_scores_.as<float>();
      mr.rows = nr * H;
      mr.row_stride = n;
      mr.cols = n;
      mr.out = cont_max_.as<float>();
      mr.accumulate = r0 > 0;
      b.MaxRows(mr);
    }
    std::vector<float> score(static_cast<size_t>(n));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(score.data(), cont_max_.get(), score.size() * sizeof(float)));
    // The k + O best (ties: the lower chunk), then per head the first k of
    // them that are not its outliers (it has O: k of them always remain).
    const int O = s.outliers, want = std::min(n, k + O);
    std::vector<int32_t> order(static_cast<size_t>(n));
    for (int c = 0; c < n; ++c) order[c] = c;
    std::partial_sort(order.begin(), order.begin() + want, order.end(), [&](int32_t x, int32_t y) {
      return score[x] > score[y] || (score[x] == score[y] && x < y);
    });
    cont_sel_host_.assign(static_cast<size_t>(H) * k, 0);
    for (int h = 0; h < H; ++h) {
      const int32_t* outl = s.outlier_ids.data() + (static_cast<size_t>(layer) * H + h) * O;
      int32_t* dst = cont_sel_host_.data() + static_cast<size_t>(h) * k;
      int taken = 0;
      for (int i = 0; i < want && taken < k; ++i) {
        if (!std::binary_search(outl, outl + O, order[i])) dst[taken++] = order[i];
      }
      if (taken != k) return Status::Internal("shadowkv: a continuation selected too few chunks");
      std::sort(dst, dst + k);
    }
    return Upload(&cont_sel_, cont_sel_host_.data(), cont_sel_host_.size() * sizeof(int32_t));
  }

  // The end of a continuation prefill at `layer` (tokens [Held(s), end) are
  // in the temporaries after the rebuilt ones): the completed chunks become
  // selectable as decode's do (ShadowKV+, A.1: landmarks, A rows projected
  // with the first prefill's P, values to the store), the rest become the
  // local rows. The counts change after the last layer.
  Status ContinuePrompt(Seq& s, int layer, int64_t end) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, C = o_.chunk_size, D = H * d;
    const int first = s.n_chunks;
    const int total = static_cast<int>(std::max<int64_t>((end - o_.local_window) / C, first));
    const int k = total - first;
    const int64_t row0 = static_cast<int64_t>(first) * C + s.cont_shift;  // the temporaries' row of chunk `first`
    if (total > s.chunk_cap) return Status::Internal("shadowkv: chunk capacity exceeded");
    if (k > 0) {
      PENUMBRA_ASSIGN_OR_RETURN(float* min_cos, MinCosScratch(H * k));  // written, not needed
      kn::ChunkLandmarksArgs cl;
      cl.k = tmp_k_.get();
      cl.k_head_stride = tmp_cap_ * d;
      cl.first_token = row0;
      cl.n_chunks = k;
      cl.chunk_tokens = C;
      cl.hkv = H;
      cl.d = d;
      cl.landmarks = LmChunk(s, layer, first);
      cl.landmark_head_stride = LmHead(s);
      cl.landmarks_per_chunk = o_.landmarks_per_chunk;
      cl.landmark_fp8 = o_.landmark_fp8();
      cl.min_cos = min_cos;
      cl.min_cos_head_stride = k;
      b.ChunkLandmarks(cl);
      kn::ProjectKeysArgs pk;
      pk.keys = tmp_prek_.as<float>() + row0 * D;
      pk.n = k * C;
      pk.D = D;
      pk.rank = o_.rank;
      pk.proj = s.p.as<float>() + static_cast<int64_t>(layer) * D * o_.rank;
      pk.a_out = static_cast<char*>(ALayer(s, layer)) +
                 static_cast<int64_t>(first - s.shared_chunks) * C * o_.rank * es_;
      b.ProjectKeys(pk);
      PENUMBRA_RETURN_IF_ERROR(
          OffloadValues(s, layer, tmp_v_.get(), tmp_cap_ * d, row0, k, first - s.shared_chunks));
    }
    const int64_t tail0 = static_cast<int64_t>(total) * C, tail = end - tail0;
    const int64_t trow = tail0 + s.cont_shift;  // its row in the temporaries
    if (tail > s.local_cap) return Status::Internal("shadowkv: local rows overflow");
    const size_t w = tail * d * es_;
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(Row(s.att_k, s, layer, LocalRow0(s)), s.att_cap * d * es_,
                                      static_cast<char*>(tmp_k_.get()) + trow * d * es_, tmp_cap_ * d * es_, w, H));
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(Row(s.att_v, s, layer, LocalRow0(s)), s.att_cap * d * es_,
                                      static_cast<char*>(tmp_v_.get()) + trow * d * es_, tmp_cap_ * d * es_, w, H));
    PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(s.prek.as<float>() + static_cast<int64_t>(layer) * s.local_cap * D,
                                                  tmp_prek_.as<float>() + trow * D, tail * D * sizeof(float)));
    if (layer == ctx_.num_layers - 1) {
      s.n_chunks = total;
      s.local_count = tail;
    }
    return Status::OK();
  }

  // Algorithm 1 for one layer of one sequence, from the temporaries.
  Status CompressPrompt(Seq& s, int layer, int64_t S) {
    Backend& b = *ctx_.backend;
    const int C = o_.chunk_size, H = ctx_.hkv, d = ctx_.head_dim, r = o_.rank, D = H * d;
    const int n_chunks = static_cast<int>((S - s.window) / C);
    double t = NowSeconds();
    auto lap = [&](const char* op) {
      if (!profile_) return;
      (void)b.Synchronize();
      const double now = NowSeconds();
      prefill_ms_[op] += (now - t) * 1e3;
      t = now;
    };
    if (profile_) (void)b.Synchronize(), t = NowSeconds();
    // SVD of the pre-RoPE keys of the prompt (one segment).
    kn::LowRankArgs lr;
    lr.keys = tmp_prek_.get();
    lr.S = S;
    lr.hkv = H;
    lr.d = d;
    lr.rank = r;
    lr.a_out = ALayer(s, layer);
    lr.b_out = Row2(s.b, layer, static_cast<int64_t>(H) * r * d);
    lr.proj_out = s.p.as<float>() + static_cast<int64_t>(layer) * D * r;
    PENUMBRA_RETURN_IF_ERROR(b.LowRankFactor(lr));
    lap("svd");
    // Landmarks and min cosine similarity per chunk.
    kn::ChunkLandmarksArgs cl;
    cl.k = tmp_k_.get();
    cl.k_head_stride = tmp_cap_ * d;
    cl.first_token = 0;
    cl.n_chunks = n_chunks;
    cl.chunk_tokens = C;
    cl.hkv = H;
    cl.d = d;
    cl.landmarks = LmLayer(s, layer);
    cl.landmark_head_stride = LmHead(s);
    cl.landmarks_per_chunk = o_.landmarks_per_chunk;
    cl.landmark_fp8 = o_.landmark_fp8();
    cl.min_cos = tmp_cos_.as<float>();
    cl.min_cos_head_stride = s.chunk_cap;
    b.ChunkLandmarks(cl);
    lap("landmarks");
    // Outliers: lowest min-cosine chunks per head, exact K/V into rows [0, O*C).
    uint8_t* excl = s.excl.as<uint8_t>() + static_cast<int64_t>(layer) * H * s.chunk_cap;
    if (s.outliers > 0) {
      kn::SelectOutliersArgs so;
      so.min_cos = tmp_cos_.as<float>();
      so.min_cos_head_stride = s.chunk_cap;
      so.hkv = H;
      so.n_chunks = n_chunks;
      so.num_outliers = s.outliers;
      so.out = tmp_outl_.as<int32_t>();
      b.SelectOutlierChunks(so);
      kn::GatherOutliersArgs go;
      go.k = tmp_k_.get();
      go.v = tmp_v_.get();
      go.kv_head_stride = tmp_cap_ * d;
      go.first_token = 0;
      go.chunk_tokens = C;
      go.hkv = H;
      go.d = d;
      go.n_chunks = n_chunks;
      go.outliers = tmp_outl_.as<int32_t>();
      go.num_outliers = s.outliers;
      go.att_k = Row(s.att_k, s, layer, 0);
      go.att_v = Row(s.att_v, s, layer, 0);
      go.att_head_stride = s.att_cap * d;
      go.excluded = excl;
      go.mask_head_stride = s.chunk_cap;
      b.GatherOutliers(go);
      // Their chunk ids on the host too (a continuation's rebuild puts the
      // exact keys back at their places).
      if (s.outlier_ids.empty()) s.outlier_ids.resize(static_cast<size_t>(ctx_.num_layers) * H * s.outliers);
      PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(s.outlier_ids.data() + static_cast<size_t>(layer) * H * s.outliers,
                                            tmp_outl_.get(), static_cast<size_t>(H) * s.outliers * sizeof(int32_t)));
    }
    lap("outliers");
    // Values of every chunk to the store (outliers too: never selected, and
    // it keeps each head's chunks one contiguous run).
    PENUMBRA_RETURN_IF_ERROR(OffloadValues(s, layer, tmp_v_.get(), tmp_cap_ * d, 0, n_chunks, 0));
    lap("offload");
    // The tail becomes the local rows (exact K/V and pre-RoPE keys).
    const int64_t tail0 = static_cast<int64_t>(n_chunks) * C, tail = S - tail0;
    CHECK_LE(tail, s.local_cap);
    if (tail > 0) {  // a closed shard's prompt may be whole chunks
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(Row(s.att_k, s, layer, LocalRow0(s)), s.att_cap * d * es_,
                                        static_cast<char*>(tmp_k_.get()) + tail0 * d * es_, tmp_cap_ * d * es_,
                                        tail * d * es_, H));
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(Row(s.att_v, s, layer, LocalRow0(s)), s.att_cap * d * es_,
                                        static_cast<char*>(tmp_v_.get()) + tail0 * d * es_, tmp_cap_ * d * es_,
                                        tail * d * es_, H));
      PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(s.prek.as<float>() + static_cast<int64_t>(layer) * s.local_cap * D,
                                                    tmp_prek_.as<float>() + tail0 * D, tail * D * sizeof(float)));
    }
    lap("local");
    s.n_chunks = n_chunks;
    s.local_count = tail;
    return Status::OK();
  }

  // Writes n value chunks of every head of `layer` from a device buffer laid
  // out [hkv][head_stride] rows of d (starting at row src_row) to store
  // chunks [store_first, store_first + n), through a pinned staging buffer.
  Status OffloadValues(Seq& s, int layer, const void* src, int64_t head_stride, int64_t src_row, int n,
                       int store_first) {
    PENUMBRA_RETURN_IF_ERROR(EnsureStoreLayer(s, layer));
    Backend& b = *ctx_.backend;
    const int C = o_.chunk_size, H = ctx_.hkv, d = ctx_.head_dim;
    const size_t row = static_cast<size_t>(n) * C * d * es_;
    if (stage_.bytes() < row * H) {
      PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(stage_, b.AllocateHost(row * H));
    }
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(stage_.get(), row, static_cast<const char*>(src) + src_row * d * es_,
                                      head_stride * es_, row, H));
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    for (int h = 0; h < H; ++h) {
      PENUMBRA_RETURN_IF_ERROR(store_.PutChunks(s.segment, layer, h, store_first, n, stage_.as<char>() + h * row));
    }
    return Status::OK();
  }

  // ----------------------------------------------------------------- decode

  Status BeginDecodeStep(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions) override {
    const int L = ctx_.num_layers, B = static_cast<int>(ids.size());
    step_.clear();
    groups_.clear();
    for (int i = 0; i < B; ++i) {
      Seq& s = Get(ids[i]);
      // A closed shard holds fixed tokens before every decode position.
      if (!s.closed) {
        CHECK_EQ(positions[i], s.pos0 + s.n_chunks * int64_t{o_.chunk_size} + s.local_count)
            << "sequence " << s.id << " decoded out of order";
      }
      CHECK_LT(s.local_count, s.local_cap) << "sequence " << s.id << " is full";
      for (int l = 0; l < L; ++l) PENUMBRA_RETURN_IF_ERROR(EnsureStoreLayer(s, l));
      // Decided once per step: the pointer tables below hold the prefix's
      // device address only once its values are complete (pinned).
      s.values_staged = s.prefix && !s.prefix->values_complete();
      step_.push_back(&s);
    }
    // Groups: runs of sequences with equal geometry share kernel launches.
    for (int i = 0; i < B;) {
      int j = i + 1;
      while (j < B && SameGeometry(*step_[i], *step_[j])) ++j;
      // Micro-batches (o_.micro_batches > 1): a sparse group split into
      // near-equal parts whose selection, value fetch and attention are
      // pipelined in DecodeAttention.
      const int parts = step_[i]->sparse ? std::min(o_.micro_batches, j - i) : 1;
      for (int p = 0; p < parts; ++p) {
        const int a = i + (j - i) * p / parts, e = i + (j - i) * (p + 1) / parts;
        groups_.push_back({a, e - a});
      }
      i = j;
    }
    // One upload per step: per layer and sequence the pointer tables, then
    // per sequence the attention lengths and chunk counts.
    const size_t per_layer = static_cast<size_t>(kTables) * B;
    std::vector<const void*> t(per_layer * L);
    for (int l = 0; l < L; ++l) {
      const void** row = &t[per_layer * l];
      for (int i = 0; i < B; ++i) {
        Seq& s = *step_[i];
        row[0 * B + i] = Row(s.att_k, s, l, LocalRow0(s) + s.local_count);  // new K slot
        row[1 * B + i] = Row(s.att_v, s, l, LocalRow0(s) + s.local_count);
        row[2 * B + i] = Row(s.att_k, s, l, 0);
        row[3 * B + i] = Row(s.att_v, s, l, 0);
        if (s.sparse) {
          row[4 * B + i] = LmLayer(s, l);
          row[5 * B + i] = s.excl.as<uint8_t>() + static_cast<int64_t>(l) * ctx_.hkv * s.chunk_cap;
          row[6 * B + i] = s.slots.as<int32_t>() + static_cast<int64_t>(l) * ctx_.hkv * s.kslots;
          row[7 * B + i] = ALayer(s, l);
          row[8 * B + i] = Row2(s.b, l, static_cast<int64_t>(ctx_.hkv) * o_.rank * ctx_.head_dim);
          row[9 * B + i] = s.store_dev[l];
          row[10 * B + i] = s.prek.as<float>() + (static_cast<int64_t>(l) * s.local_cap + s.local_count) * ctx_.hkv *
                                                     ctx_.head_dim;  // new token's pre-RoPE key row
          row[11 * B + i] = s.prefix ? s.prefix->values_device(l) : nullptr;  // an attached prefix's values,
          row[12 * B + i] = s.prefix ? s.prefix->lm_layer(l) : nullptr;      // landmarks
          row[13 * B + i] = s.prefix ? s.prefix->a_layer(l) : nullptr;       // and A rows
        }
      }
    }
    // Per sequence: attention length (a closed shard's new row is not
    // attended), chunk count, first position (the rebuilt keys' RoPE offset).
    std::vector<int32_t> ints(3 * B);
    step_offsets_ = false;
    for (int i = 0; i < B; ++i) {
      Seq& s = *step_[i];
      ints[i] = static_cast<int32_t>((s.outliers + s.kslots) * int64_t{o_.chunk_size} + s.local_count +
                                     (s.closed ? 0 : 1));
      ints[B + i] = s.n_chunks;
      ints[2 * B + i] = static_cast<int32_t>(s.pos0);
      step_offsets_ = step_offsets_ || s.pos0 != 0;
    }
    std::vector<uint8_t> blob(t.size() * sizeof(void*) + ints.size() * 4);
    std::memcpy(blob.data(), t.data(), t.size() * sizeof(void*));
    std::memcpy(blob.data() + t.size() * sizeof(void*), ints.data(), ints.size() * 4);
    PENUMBRA_RETURN_IF_ERROR(Upload(&step_buf_, blob.data(), blob.size()));
    step_batch_ = B;
    // Miss lists and per-layer miss counts (for the hit rate).
    int max_k = 0;
    for (Seq* s : step_) max_k = std::max(max_k, s->kslots);
    const size_t rows = static_cast<size_t>(B) * ctx_.hkv;
    step_max_k_ = max_k;
    if (max_k > 0) {
      const size_t need = rows * max_k * 4 * 3 + rows * 4 * (L + 1);
      if (miss_buf_.bytes() < need) {
        PENUMBRA_ASSIGN_OR_RETURN(miss_buf_, ctx_.backend->Allocate(need * 2));
      }
      int max_chunks = 0;
      for (Seq* s : step_) max_chunks = std::max(max_chunks, s->n_chunks);
      const size_t sneed = rows * static_cast<size_t>(max_chunks + 1) * sizeof(float);
      if (score_buf_.bytes() < sneed) {
        PENUMBRA_ASSIGN_OR_RETURN(score_buf_, ctx_.backend->Allocate(sneed * 2));
      }
      step_max_chunks_ = max_chunks;
    }
    // A context-parallel group's global selection: its exchange buffers.
    xgroup_ = nullptr;
    for (const Seq* s : step_) xgroup_ = s->group != nullptr ? s->group : xgroup_;
    if (xgroup_ != nullptr) PENUMBRA_RETURN_IF_ERROR(PrepareExchange());
    // Only a step that fetches values takes part in the lanes' fetch turns
    // (EndDecodeStep ends it on every path).
    if (ctx_.fetch_turns && step_max_k_ > 0) ctx_.fetch_turns->StepBegin(ctx_.lane);
    return Status::OK();
  }

  Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                         float* lse) override {
    if (xgroup_ != nullptr) return DecodeAttentionGlobal(layer, qkv, positions, q_scratch, out, lse);
    Backend& b = *ctx_.backend;
    // With micro-batches, every group's selection is issued first (its value
    // fetch left running on the side stream as mark gi), then the attentions,
    // each waiting only for its own group's fetch.
    // (Not while an attached prefix's values are still read from disk: its
    // groups take the staging path, whose one host buffer the groups share.)
    bool restoring = false;
    for (const Seq* q : step_) restoring = restoring || q->values_staged;
    const bool pipelined = o_.micro_batches > 1 && groups_.size() > 1 &&
                           groups_.size() <= static_cast<size_t>(Backend::kSideMarks) &&
                           o_.value_fetch == "zero_copy" && !restoring;
    std::vector<DecodeAttentionOp>& attention = pending_attention_;  // reused: no allocation per layer
    attention.clear();
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const auto [g0, gn] = groups_[gi];
      const void* q = RopeStoreGroup(layer, g0, gn, qkv, positions, q_scratch);
      if (step_[g0]->sparse) {
        PENUMBRA_RETURN_IF_ERROR(Select(layer, g0, gn, q, pipelined ? static_cast<int>(gi) : -1));
      }
      const DecodeAttentionOp a = AttentionOf(layer, g0, gn, q, out, lse, /*mask_slots=*/false);
      if (pipelined) {
        attention.push_back(a);
      } else {
        PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(a));
        Lap("sparse_attention");
      }
    }
    for (size_t gi = 0; gi < attention.size(); ++gi) {
      if (step_[groups_[gi].first]->sparse) b.WaitSideMark(static_cast<int>(gi));
      PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(attention[gi]));
      Lap("sparse_attention");
    }
    return Status::OK();
  }

  // The global selection over the shards of a context-parallel group (the
  // step's sequences are all shards of it; every rank runs the same groups of
  // the same sequences). Per layer, for the whole step:
  //  1. each group's scores of its own chunks, only their softmax statistics
  //     kept (stats_out; the logits stay in the group's score workspace);
  //  2. one all-gather of the statistics: every shard normalizes its scores
  //     over the whole sequence;
  //  3. each group's top-k of its own chunks under that normalization (the
  //     shard's proposals, with their scores);
  //  4. one all-gather of the proposals' scores;
  //  5. each group's global top-k of every shard's proposals (the same on
  //     every rank), this shard keeping its winners, then the slot update,
  //     the misses' values and keys, and attention over outliers + live
  //     slots + local rows (empty slots masked: a shard may win fewer chunks
  //     than it has slots).
  Status DecodeAttentionGlobal(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                               float* lse) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, hq = ctx_.hq, W = xgroup_->world();
    std::vector<const void*>& q = group_q_;
    q.assign(groups_.size(), nullptr);
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const auto [g0, gn] = groups_[gi];
      q[gi] = RopeStoreGroup(layer, g0, gn, qkv, positions, q_scratch);
      if (!step_[g0]->sparse) continue;
      kn::ShadowkvScoreArgs sc = ScoreArgsOf(layer, g0, gn, q[gi]);
      sc.stats_out = x_.stats_send + static_cast<size_t>(g0) * hq * 2;
      sc.workspace_part = static_cast<int>(gi);
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    PENUMBRA_RETURN_IF_ERROR(xgroup_->AllGather(x_.stats_send, x_.stats_recv, x_.stats * sizeof(float)));
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const auto [g0, gn] = groups_[gi];
      if (!step_[g0]->sparse) continue;
      const size_t off = static_cast<size_t>(g0) * H * xk_;
      kn::ShadowkvScoreArgs sc = ScoreArgsOf(layer, g0, gn, q[gi]);
      sc.stats_in = x_.stats_recv + static_cast<size_t>(g0) * hq * 2;
      sc.stats_parts = W;
      sc.stats_part_stride = static_cast<int64_t>(x_.stats);
      sc.workspace_part = static_cast<int>(gi);
      sc.selection = x_.proposals + off;
      sc.selection_stride = xk_;
      sc.selection_scores = x_.cand_send + off;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    Lap("score_topk");
    PENUMBRA_RETURN_IF_ERROR(xgroup_->AllGather(x_.cand_send, x_.cand_recv, x_.cand * sizeof(float)));
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const auto [g0, gn] = groups_[gi];
      const Seq& s0 = *step_[g0];
      if (s0.sparse) {
        const size_t off = static_cast<size_t>(g0) * H * xk_;
        kn::ShadowkvGlobalSelectArgs gs;
        gs.candidates = x_.cand_recv + off;
        gs.parts = W;
        gs.rank = xgroup_->rank();
        gs.part_stride = static_cast<int64_t>(x_.cand);
        gs.rows = gn * H;
        gs.cand_stride = xk_;
        gs.k = s0.global_k;
        gs.proposals = x_.proposals + off;
        gs.winners = x_.winners + off;
        gs.selection = x_.selection + off;
        gs.selection_stride = xk_;
        gs.selection_len = s0.kslots;
        b.ShadowkvGlobalSelectAndSlotUpdate(gs, SlotUpdateOf(layer, g0, gn, x_.selection + off, xk_));
        Lap("global_select_slot_update");
        PENUMBRA_RETURN_IF_ERROR(FetchMisses(layer, g0, gn, /*mark=*/-1));
      }
      PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(AttentionOf(layer, g0, gn, q[gi], out, lse, /*mask_slots=*/true)));
      Lap("sparse_attention");
    }
    return Status::OK();
  }

  // The step's exchange buffers for a global selection (xgroup_ set): per
  // sequence, query head statistics and KV head proposals (xk_ wide). Rows a
  // sparse group never writes (a shard too short to be sparse) hold "no
  // statistics" and "no proposal" for the whole step.
  Status PrepareExchange() {
    const int B = static_cast<int>(step_.size()), H = ctx_.hkv, hq = ctx_.hq, W = xgroup_->world();
    xk_ = 0;
    for (const Seq* s : step_) {
      // Beside the group's shards only dense sequences (too short to select
      // from), whose rows propose nothing.
      if (s->group != xgroup_ && !(s->group == nullptr && !s->sparse)) {
        return Status::Internal("shadowkv: a decode step mixes shards of a context-parallel group with other sequences");
      }
      xk_ = std::max(xk_, s->global_k);
    }
    const size_t stats = static_cast<size_t>(B) * hq * 2, cand = static_cast<size_t>(B) * H * xk_;
    const size_t bytes = sizeof(float) * (stats * (1 + W) + cand * (1 + W)) + sizeof(int32_t) * 3 * cand;
    if (x_buf_.bytes() < bytes) {
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(x_buf_, ctx_.backend->Allocate(bytes * 2));
    }
    x_.stats = stats;
    x_.cand = cand;
    x_.stats_send = x_buf_.as<float>();
    x_.stats_recv = x_.stats_send + stats;
    x_.cand_send = x_.stats_recv + stats * W;
    x_.cand_recv = x_.cand_send + cand;
    x_.proposals = reinterpret_cast<int32_t*>(x_.cand_recv + cand * W);
    x_.winners = x_.proposals + cand;
    x_.selection = x_.winners + cand;
    constexpr float kNone = -std::numeric_limits<float>::infinity();
    std::vector<float> init(stats);
    for (size_t i = 0; i < stats; i += 2) init[i] = kNone, init[i + 1] = 0.0f;
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToDevice(x_.stats_send, init.data(), stats * sizeof(float)));
    init.assign(cand, kNone);
    return ctx_.backend->CopyToDevice(x_.cand_send, init.data(), cand * sizeof(float));
  }

  // The step's pointer table of `layer` and the per-sequence ints after the
  // tables (attention lengths, chunk counts, first positions).
  void* const* StepTable(int layer) const {
    auto* base = static_cast<void* const*>(step_buf_.get());
    return base + static_cast<size_t>(layer) * kTables * step_batch_;
  }
  const int32_t* StepInts() const {
    auto* base = static_cast<void* const*>(step_buf_.get());
    return reinterpret_cast<const int32_t*>(base + static_cast<size_t>(ctx_.num_layers) * kTables * step_batch_);
  }

  // RoPE of a group's new tokens, their K/V into the attention rows; returns
  // the rotated queries.
  const void* RopeStoreGroup(int layer, int g0, int gn, const float* qkv, const int32_t* positions, void* q_scratch) {
    const int B = step_batch_, H = ctx_.hkv, d = ctx_.head_dim;
    void* const* tab = StepTable(layer);
    const Seq& s0 = *step_[g0];
    const size_t qkv_row = static_cast<size_t>(ctx_.hq + 2 * H) * d;
    RopeStoreOp r;
    r.qkv = qkv + g0 * qkv_row;
    r.positions = positions + g0;
    r.inv_freq = ctx_.inv_freq;
    r.n = gn;
    r.hq = ctx_.hq;
    r.hkv = H;
    r.d = d;
    r.q_out = static_cast<char*>(q_scratch) + g0 * static_cast<size_t>(ctx_.hq) * d * es_;
    r.k_dst = tab + 0 * B + g0;
    r.v_dst = tab + 1 * B + g0;
    r.head_stride = s0.att_cap * d;
    r.pre_rope_k_out = nullptr;
    // New tokens' pre-RoPE keys straight into each sequence's local
    // pre-RoPE rows (for the A.1 projection when their chunk completes).
    r.pre_rope_k_dst = s0.sparse ? reinterpret_cast<float* const*>(tab + 10 * B + g0) : nullptr;
    ctx_.backend->RopeStore(r);
    Lap("rope_store");
    return r.q_out;
  }

  // A group's attention over its rows; mask_slots: empty slots not attended.
  DecodeAttentionOp AttentionOf(int layer, int g0, int gn, const void* q, void* out, float* lse, bool mask_slots) const {
    const int B = step_batch_, d = ctx_.head_dim;
    void* const* tab = StepTable(layer);
    const Seq& s0 = *step_[g0];
    DecodeAttentionOp a;
    a.q = q;
    a.k = reinterpret_cast<const void* const*>(tab + 2 * B + g0);
    a.v = reinterpret_cast<const void* const*>(tab + 3 * B + g0);
    a.lengths = StepInts() + g0;
    a.out = static_cast<char*>(out) + g0 * static_cast<size_t>(ctx_.hq) * d * es_;
    a.head_stride = s0.att_cap * d;
    a.batch = gn;
    a.hq = ctx_.hq;
    a.hkv = ctx_.hkv;
    a.d = d;
    a.max_length = static_cast<int>(s0.att_cap);
    a.scale = ctx_.scale;
    a.lse = lse != nullptr ? lse + static_cast<size_t>(g0) * ctx_.hq : nullptr;
    if (mask_slots && s0.sparse) {
      a.slot_maps = reinterpret_cast<const int32_t* const*>(tab + 6 * B + g0);
      a.slot_row0 = s0.outliers * o_.chunk_size;
      a.slot_count = s0.kslots;
      a.slot_rows = o_.chunk_size;
    }
    return a;
  }

  // A sparse group's chunk scores (Algorithm 2), selecting s0.kslots chunks
  // into the step's selection rows.
  kn::ShadowkvScoreArgs ScoreArgsOf(int layer, int g0, int gn, const void* q) const {
    const int B = step_batch_, H = ctx_.hkv, K = step_[g0]->kslots;
    void* const* tab = StepTable(layer);
    const Seq& s0 = *step_[g0];
    int max_chunks = 0;
    for (int i = g0; i < g0 + gn; ++i) max_chunks = std::max(max_chunks, step_[i]->n_chunks);
    kn::ShadowkvScoreArgs sc;
    sc.q = q;
    sc.landmarks = reinterpret_cast<const void* const*>(tab + 4 * B + g0);
    sc.excluded = reinterpret_cast<const uint8_t* const*>(tab + 5 * B + g0);
    sc.n_chunks = StepInts() + B + g0;
    sc.batch = gn;
    sc.hq = ctx_.hq;
    sc.hkv = H;
    sc.d = ctx_.head_dim;
    sc.chunk_cap = s0.chunk_cap;
    sc.landmark_cap = s0.lm_cap;
    sc.landmarks_per_chunk = o_.landmarks_per_chunk;
    sc.landmark_fp8 = o_.landmark_fp8();
    sc.shared_landmarks = reinterpret_cast<const void* const*>(tab + 12 * B + g0);
    sc.shared_chunks = s0.shared_chunks;
    sc.max_chunks = max_chunks;
    sc.scale = ctx_.scale;
    sc.successors = o_.successor_chunks;
    sc.scores = score_buf_.as<float>();
    sc.score_stride = step_max_chunks_ + 1;
    sc.select_k = K;  // the top-k, fused with the scores' last phases on the GPU
    sc.selection = miss_buf_.as<int32_t>() + static_cast<size_t>(g0) * H * K;
    sc.selection_stride = K;
    return sc;
  }

  // The miss lists of a group (step rows, stride kslots) and the slot update
  // of `selection` into them.
  int32_t* MissSlots(int g0) const {
    return miss_buf_.as<int32_t>() + static_cast<size_t>(step_batch_) * ctx_.hkv * step_max_k_ +
           static_cast<size_t>(g0) * ctx_.hkv * step_[g0]->kslots;
  }
  int32_t* MissChunks(int g0) const {
    return MissSlots(g0) + static_cast<size_t>(step_batch_) * ctx_.hkv * step_max_k_;
  }
  int32_t* MissCounts(int layer, int g0) const {
    return miss_buf_.as<int32_t>() + 3 * static_cast<size_t>(step_batch_) * ctx_.hkv * step_max_k_ +
           static_cast<size_t>(layer) * step_batch_ * ctx_.hkv + static_cast<size_t>(g0) * ctx_.hkv;
  }
  kn::ShadowkvSlotUpdateArgs SlotUpdateOf(int layer, int g0, int gn, const int32_t* selection, int64_t stride) const {
    const Seq& s0 = *step_[g0];
    kn::ShadowkvSlotUpdateArgs su;
    su.selection = selection;
    su.selection_stride = stride;
    su.slot_maps = reinterpret_cast<int32_t* const*>(StepTable(layer) + 6 * step_batch_ + g0);
    su.miss_count = MissCounts(layer, g0);
    su.miss_slot = MissSlots(g0);
    su.miss_chunk = MissChunks(g0);
    su.batch = gn;
    su.hkv = ctx_.hkv;
    su.kslots = s0.kslots;
    su.chunk_cap = s0.chunk_cap;
    su.force_keep = static_cast<float>(o_.force_hit_rate);
    return su;
  }

  // Algorithm 2's selection and sparse KV reconstruction for one group.
  // mark >= 0: the value fetch is left running as side mark `mark` (the
  // caller waits for it before the group's attention); else joined here.
  Status Select(int layer, int g0, int gn, const void* q, int mark) {
    const kn::ShadowkvScoreArgs sc = ScoreArgsOf(layer, g0, gn, q);
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->ShadowkvScoreAndSlotUpdate(
        sc, SlotUpdateOf(layer, g0, gn, sc.selection, sc.selection_stride)));  // one launch after the logits on the GPU
    Lap("score_topk_slot_update");
    return FetchMisses(layer, g0, gn, mark);
  }

  // The slot update's misses: V from the store on the side stream, K rebuilt
  // on the main one.
  Status FetchMisses(int layer, int g0, int gn, int mark) {
    Backend& b = *ctx_.backend;
    Seq& s0 = *step_[g0];
    const int B = step_batch_, H = ctx_.hkv, d = ctx_.head_dim, C = o_.chunk_size, K = s0.kslots;
    void* const* tab = StepTable(layer);
    const int32_t* nchunks = StepInts() + B;
    const int32_t* mcount = MissCounts(layer, g0);
    const int32_t* mslot = MissSlots(g0);
    const int32_t* mchunk = MissChunks(g0);
    b.ForkSide();
    // Lanes take turns on the host link: wait for the previous lane's fetch.
    if (ctx_.fetch_turns) {
      if (auto turn = ctx_.fetch_turns->Await(ctx_.lane, layer)) b.WaitFetchDone(*turn->backend, turn->layer);
    }
    kn::ShadowkvFetchVArgs fv;
    fv.value_store = reinterpret_cast<const void* const*>(tab + 9 * B + g0);
    fv.chunk_cap = s0.chunk_cap - s0.shared_chunks;
    fv.shared_store = reinterpret_cast<const void* const*>(tab + 11 * B + g0);
    fv.shared_chunks = s0.shared_chunks;
    fv.shared_stride = s0.shared_stride;
    fv.miss_count = mcount;
    fv.miss_slot = mslot;
    fv.miss_chunk = mchunk;
    fv.miss_stride = K;
    fv.att_v = tab + 3 * B + g0;
    fv.att_head_stride = s0.att_cap * d;
    fv.outlier_rows = s0.outliers * C;
    fv.batch = gn;
    fv.hkv = H;
    fv.d = d;
    fv.chunk_size = C;
    fv.max_misses = K;
    fv.max_blocks = o_.fetch_blocks;
    bool lazy = false;  // an attached prefix's values still being read from disk: through the host
    bool on_device = true;  // every sequence's document values in device memory (tier 0)
    for (int i = g0; i < g0 + gn; ++i) {
      const Seq& q = *step_[i];
      lazy = lazy || q.values_staged;
      on_device = on_device && q.prefix && q.prefix->values_on_device(layer);
    }
    // From device memory the fetch is not bound by the host link: as many
    // blocks as the restore's.
    if (on_device) fv.max_blocks = kRestoreFetchBlocks;
    if (o_.value_fetch == "staging" || lazy) {
      PENUMBRA_RETURN_IF_ERROR(StageValues(layer, g0, gn, mcount, mchunk, &fv));
      b.ShadowkvFetchV(fv, /*staged=*/true);
    } else {
      b.ShadowkvFetchV(fv, /*staged=*/false);
    }
    if (ctx_.fetch_turns) {
      b.RecordFetchDone(layer);
      ctx_.fetch_turns->Issued(ctx_.lane, layer);
    }
    kn::ShadowkvRebuildKArgs rk;
    rk.a = reinterpret_cast<const void* const*>(tab + 7 * B + g0);
    rk.shared_a = reinterpret_cast<const void* const*>(tab + 13 * B + g0);
    rk.shared_chunks = s0.shared_chunks;
    rk.b = reinterpret_cast<const void* const*>(tab + 8 * B + g0);
    rk.inv_freq = ctx_.inv_freq;
    rk.position_offset = step_offsets_ ? nchunks + B + g0 : nullptr;  // shards: their first positions
    rk.miss_count = mcount;
    rk.miss_slot = mslot;
    rk.miss_chunk = mchunk;
    rk.miss_stride = K;
    rk.att_k = tab + 2 * B + g0;
    rk.att_head_stride = s0.att_cap * d;
    rk.outlier_rows = s0.outliers * C;
    rk.batch = gn;
    rk.hkv = H;
    rk.d = d;
    rk.r = o_.rank;
    rk.chunk_size = C;
    rk.max_misses = K;
    b.ShadowkvRebuildK(rk);
    if (mark >= 0) {
      b.JoinSideLater(mark);
    } else {
      b.JoinSide();
      Lap("value_fetch_k_rebuild");  // both streams (the main one waits for the side)
    }
    return Status::OK();
  }

  // The staging variant: miss lists to the host, CPU gathers the chunks from
  // the store (checksums verified) into pinned memory, the device scatters.
  Status StageValues(int layer, int g0, int gn, const int32_t* mcount, const int32_t* mchunk,
                     kn::ShadowkvFetchVArgs* fv) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, K = step_[g0]->kslots, C = o_.chunk_size, d = ctx_.head_dim;
    const int rows = gn * H;
    std::vector<int32_t> counts(rows), chunks(static_cast<size_t>(rows) * K);
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(counts.data(), mcount, rows * 4));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(chunks.data(), mchunk, chunks.size() * 4));
    const size_t chunk_bytes = static_cast<size_t>(C) * d * es_;
    std::vector<int32_t> offsets(rows);
    size_t total = 0;
    for (int r = 0; r < rows; ++r) {
      offsets[r] = static_cast<int32_t>(total);
      total += counts[r];
    }
    // An attached prefix's values read lazily from disk: the missed ones now.
    for (int i = 0; i < gn; ++i) {
      Seq& s = *step_[g0 + i];
      if (!s.values_staged) continue;
      std::vector<int32_t> want(static_cast<size_t>(H) * K, -1);
      for (int h = 0; h < H; ++h) {
        const size_t r = static_cast<size_t>(i) * H + h;
        for (int j = 0; j < counts[r]; ++j) want[static_cast<size_t>(h) * K + j] = chunks[r * K + j];
      }
      PENUMBRA_RETURN_IF_ERROR(s.prefix->EnsureValues(layer, want.data(), K));
    }
    if (stage_v_.bytes() < std::max<size_t>(total, 1) * chunk_bytes) {
      PENUMBRA_ASSIGN_OR_RETURN(stage_v_, b.AllocateHost(static_cast<size_t>(rows) * K * chunk_bytes));
    }
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < counts[r]; ++j) {
        const int c = chunks[static_cast<size_t>(r) * K + j];
        PENUMBRA_RETURN_IF_ERROR(
            CopyChunkToHost(*step_[g0 + r / H], layer, r % H, c, stage_v_.as<char>() + (offsets[r] + j) * chunk_bytes));
      }
    }
    PENUMBRA_RETURN_IF_ERROR(Upload(&stage_off_, offsets.data(), offsets.size() * 4));
    fv->staging = b.DeviceAddressOfHost(stage_v_.get());
    fv->staging_offsets = stage_off_.as<int32_t>();
    return Status::OK();
  }

  void EndDecodeStep() override {
    if (ctx_.fetch_turns) ctx_.fetch_turns->StepEnd(ctx_.lane);
  }

  Status FinishDecodeStep() override {
    Backend& b = *ctx_.backend;
    const int B = step_batch_, H = ctx_.hkv, L = ctx_.num_layers;
    ++stats_.decode_steps;
    if (step_max_k_ > 0) {
      std::vector<int32_t> counts(static_cast<size_t>(L) * B * H);
      const int32_t* mc = miss_buf_.as<int32_t>() + 3 * static_cast<size_t>(B) * H * step_max_k_;
      PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(counts.data(), mc, counts.size() * 4));
      for (int l = 0; l < L; ++l) {
        for (int i = 0; i < B; ++i) {
          Seq& s = *step_[i];
          // Under a global selection a shard's live slots vary per step and
          // head (not counted on the host): no hit rate.
          if (!s.sparse || s.global_k > 0) continue;
          int64_t misses = 0;
          for (int h = 0; h < H; ++h) {
            const int32_t miss = counts[(static_cast<size_t>(l) * B + i) * H + h];
            stats_.selected_chunks += s.kslots;
            stats_.hit_chunks += s.kslots - miss;
            misses += miss;
          }
          // The tier manager's heat: chunks fetched, nearly all from the
          // attached document (a sequence's own chunks are its generated
          // tokens').
          if (s.prefix) s.prefix->NoteReads(misses);
        }
      }
    }
    std::vector<Seq*> due;
    for (Seq* s : step_) {
      if (s->closed) continue;  // its new row is overwritten by the next step
      ++s->local_count;
      if (s->sparse && s->local_count >= o_.local_window + o_.chunk_size) due.push_back(s);
    }
    if (!due.empty()) PENUMBRA_RETURN_IF_ERROR(CompressOldest(due));
    return Status::OK();
  }

  // ShadowKV+ (A.1): the oldest C local tokens of each sequence in `due`
  // become a selectable chunk. All sequences' landmarks, projections and
  // value copies are issued first, then one synchronization, the store puts,
  // and only then the local rows shift and the counts change, so a failed put
  // leaves every sequence as it was.
  Status CompressOldest(const std::vector<Seq*>& due) {
    Backend& b = *ctx_.backend;
    const int L = ctx_.num_layers, H = ctx_.hkv, d = ctx_.head_dim, C = o_.chunk_size, D = H * d;
    const size_t row = static_cast<size_t>(C) * d * es_, per_seq = static_cast<size_t>(L) * H * row;
    for (Seq* s : due) {
      if (s->n_chunks >= s->chunk_cap) return Status::Internal("shadowkv: chunk capacity exceeded");
    }
    if (stage_.bytes() < per_seq * due.size()) {
      PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(stage_, b.AllocateHost(per_seq * due.size()));
    }
    PENUMBRA_ASSIGN_OR_RETURN(float* min_cos, MinCosScratch(L * H));  // written, not needed here
    for (size_t k = 0; k < due.size(); ++k) {
      Seq& s = *due[k];
      const int c = s.n_chunks;
      // One launch per kernel for all layers (the layers are the batch).
      kn::ChunkLandmarksArgs cl;
      cl.k = Row(s.att_k, s, 0, LocalRow0(s));
      cl.k_head_stride = s.att_cap * d;
      cl.first_token = 0;
      cl.n_chunks = 1;
      cl.chunk_tokens = C;
      cl.hkv = H;
      cl.d = d;
      cl.landmarks = LmChunk(s, 0, c);
      cl.landmark_head_stride = LmHead(s);
      cl.landmarks_per_chunk = o_.landmarks_per_chunk;
      cl.landmark_fp8 = o_.landmark_fp8();
      cl.min_cos = min_cos;
      cl.min_cos_head_stride = 1;
      cl.batch = L;
      cl.k_batch_stride = AttLayer(s);
      cl.landmark_batch_stride = static_cast<int64_t>(H) * LmHead(s);
      cl.min_cos_batch_stride = H;
      b.ChunkLandmarks(cl);
      kn::ProjectKeysArgs pk;
      pk.keys = s.prek.as<float>();
      pk.n = C;
      pk.D = D;
      pk.rank = o_.rank;
      pk.proj = s.p.as<float>();
      pk.a_out = static_cast<char*>(s.a.get()) + static_cast<int64_t>(c - s.shared_chunks) * C * o_.rank * es_;
      pk.batch = L;
      pk.keys_batch_stride = s.local_cap * D;
      pk.proj_batch_stride = static_cast<int64_t>(D) * o_.rank;
      pk.a_batch_stride = s.a_rows * o_.rank;
      b.ProjectKeys(pk);
      // The chunk's values of every layer and head in one 2-D copy (the local
      // rows of all layers and heads share one pitch).
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(stage_.as<char>() + k * per_seq, row, Row(s.att_v, s, 0, LocalRow0(s)),
                                        s.att_cap * d * es_, row, static_cast<size_t>(L) * H));
    }
    Lap("chunk_compress");
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    for (size_t k = 0; k < due.size(); ++k) {
      Seq& s = *due[k];
      for (int l = 0; l < L; ++l) {
        for (int h = 0; h < H; ++h) {
          const char* src = stage_.as<char>() + k * per_seq + (static_cast<size_t>(l) * H + h) * row;
          PENUMBRA_RETURN_IF_ERROR(store_.PutChunks(s.segment, l, h, s.n_chunks - s.shared_chunks, 1, src));
        }
      }
    }
    Lap("chunk_value_put");
    for (Seq* sp : due) {
      Seq& s = *sp;
      // Shift the local rows down by C (all layers and heads in one 2-D copy
      // each, through a scratch since the ranges overlap).
      const int64_t keep = s.local_count - C;
      if (keep > 0) {
        const size_t w = keep * d * es_, pitch = s.att_cap * d * es_;
        const size_t hrows = static_cast<size_t>(L) * H;
        PENUMBRA_RETURN_IF_ERROR(
            EnsureShiftScratch(hrows * std::max(w, static_cast<size_t>(keep) * D * sizeof(float) / H + 1)));
        for (DeviceBuffer* buf : {&s.att_k, &s.att_v}) {
          char* src = static_cast<char*>(Row(*buf, s, 0, LocalRow0(s) + C));
          char* dst = static_cast<char*>(Row(*buf, s, 0, LocalRow0(s)));
          PENUMBRA_RETURN_IF_ERROR(b.Copy2D(shift_.get(), w, src, pitch, w, hrows));
          PENUMBRA_RETURN_IF_ERROR(b.Copy2D(dst, pitch, shift_.get(), w, w, hrows));
        }
        const size_t pw = keep * D * sizeof(float), ppitch = s.local_cap * D * sizeof(float);
        PENUMBRA_RETURN_IF_ERROR(b.Copy2D(shift_.get(), pw, s.prek.as<float>() + C * D, ppitch, pw, L));
        PENUMBRA_RETURN_IF_ERROR(b.Copy2D(s.prek.get(), ppitch, shift_.get(), pw, pw, L));
      }
      s.local_count = keep;
      s.n_chunks += 1;
    }
    Lap("chunk_shift");
    return Status::OK();
  }

  // ----------------------------------------------------------- prefix reuse

  // Where a prefill ends shapes the state (the first one is factored, later
  // ones become chunks), so a run is prefilled in one call.
  bool PrefillSplits() const override { return false; }

  std::string StateFingerprint() const override {
    std::ostringstream os;
    os << "shadowkv v1 rank=" << o_.rank << " chunk=" << o_.chunk_size << " budget=" << o_.budget_tokens
       << " budget_fraction=" << o_.budget_fraction << " outliers=" << o_.outlier_chunks
       << " outlier_fraction=" << o_.outlier_fraction << " window=" << o_.local_window
       << " min_prompt=" << o_.min_prompt_tokens << " continuation=" << o_.continuation << ":"
       << o_.continuation_budget_tokens;
    if (o_.landmarks_per_chunk != 1) os << " landmarks_per_chunk=" << o_.landmarks_per_chunk;
    if (o_.landmark_fp8()) os << " landmark_format=fp8";
    return os.str();
  }

  Result<std::shared_ptr<const KvPrefix>> CapturePrefix(int64_t id, int64_t tokens) override {
    return Capture(id, tokens, false);
  }

  // The values move with the state when the sequence holds them all in its
  // own store (nothing attached): the store's segment becomes the prefix's
  // value buffer, rows strided by the segment's capacity. A 124K-token
  // document's 8 GB are then neither allocated nor copied a second time.
  Result<std::shared_ptr<const KvPrefix>> TakePrefix(int64_t id, int64_t tokens) override {
    return Capture(id, tokens, true);
  }

  Result<std::shared_ptr<const KvPrefix>> Capture(int64_t id, int64_t tokens, bool take) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Status::NotFound("sequence " + std::to_string(id) + " does not exist");
    Seq& s = it->second;
    if (s.taken) return Status::FailedPrecondition("sequence " + std::to_string(id) + " was taken into a prefix");
    if (s.pos0 > 0 || s.closed) {
      return Status::Unimplemented("shadowkv: a context-parallel shard cannot be captured as a prefix");
    }
    if (s.sparse && !s.compressed) return Status::FailedPrecondition("sequence " + std::to_string(id) + " is not prefilled");
    if (tokens != Held(s) || tokens < 1) {
      return Status::FailedPrecondition("shadowkv captures all that sequence " + std::to_string(id) + " holds (" +
                                        std::to_string(Held(s)) + " tokens), not " + std::to_string(tokens));
    }
    Backend& b = *ctx_.backend;
    const int L = ctx_.num_layers, H = ctx_.hkv, d = ctx_.head_dim, r = o_.rank, C = o_.chunk_size, D = H * d;
    ShadowKvPrefixGeometry g = PrefixGeometry();
    g.tokens = tokens;
    g.factored = s.first_prefill;
    g.sparse = s.sparse;
    g.n_chunks = s.n_chunks;
    g.outliers = s.outliers;
    g.tail = s.local_count;
    const int n = s.n_chunks;
    if (s.prefix) PENUMBRA_RETURN_IF_ERROR(s.prefix->EnsureAllValues());  // copied below
    const bool move_values = take && s.sparse && s.shared_chunks == 0 && n > 0;
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ShadowKvPrefix> p, ShadowKvPrefix::Allocate(g, &b, !move_values));
    const size_t LH = static_cast<size_t>(L) * H, att_pitch = s.att_cap * d * es_;
    auto copy2d = [&](const DeviceBuffer& dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                      size_t height) -> Status {
      if (width == 0 || height == 0) return Status::OK();
      return b.Copy2D(dst.get(), dpitch, src, spitch, width, height);
    };
    if (s.sparse) {
      const size_t arow = static_cast<size_t>(n) * C * r * es_;
      // A rows and landmarks: the attached prefix's chunks, then the sequence's own.
      const int sh = s.shared_chunks;
      // Landmarks: one record of landmarks_per_chunk rows per chunk.
      const size_t lrow = static_cast<size_t>(lm_rec_bytes_);
      const size_t ash = static_cast<size_t>(sh) * C * r * es_, lsh = static_cast<size_t>(sh) * lrow;
      if (sh > 0) {
        PENUMBRA_RETURN_IF_ERROR(copy2d(p->a, arow, s.prefix->a.get(), ash, ash, L));
        PENUMBRA_RETURN_IF_ERROR(copy2d(p->lm, n * lrow, s.prefix->lm.get(), lsh, lsh, LH));
      }
      if (n > sh) {
        PENUMBRA_RETURN_IF_ERROR(b.Copy2D(p->a.as<char>() + ash, arow, s.a.get(), s.a_rows * r * es_, arow - ash, L));
        PENUMBRA_RETURN_IF_ERROR(
            b.Copy2D(p->lm.as<char>() + lsh, n * lrow, s.lm.get(), s.lm_cap * lrow, n * lrow - lsh, LH));
      }
      PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(p->b.get(), s.b.get(), p->b.bytes()));
      PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(p->p.get(), s.p.get(), p->p.bytes()));
      PENUMBRA_RETURN_IF_ERROR(copy2d(p->excl, n, s.excl.get(), s.chunk_cap, n, LH));
      const size_t orow = static_cast<size_t>(s.outliers) * C * d * es_;
      PENUMBRA_RETURN_IF_ERROR(copy2d(p->out_k, orow, s.att_k.get(), att_pitch, orow, LH));
      PENUMBRA_RETURN_IF_ERROR(copy2d(p->out_v, orow, s.att_v.get(), att_pitch, orow, LH));
      const size_t prow = s.local_count * D * sizeof(float);
      PENUMBRA_RETURN_IF_ERROR(copy2d(p->tail_prek, prow, s.prek.get(), s.local_cap * D * sizeof(float), prow, L));
      p->outlier_ids = s.outlier_ids;
    }
    const size_t trow = s.local_count * d * es_;
    PENUMBRA_RETURN_IF_ERROR(copy2d(p->tail_k, trow, Row(s.att_k, s, 0, LocalRow0(s)), att_pitch, trow, LH));
    PENUMBRA_RETURN_IF_ERROR(copy2d(p->tail_v, trow, Row(s.att_v, s, 0, LocalRow0(s)), att_pitch, trow, LH));
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    if (move_values) {
      PENUMBRA_ASSIGN_OR_RETURN(std::vector<void*> bases, store_.DetachSegment(s.segment));
      s.segment = 0;
      s.store_dev.clear();
      s.store_host.clear();
      s.taken = true;
      std::vector<DeviceBuffer> layers;
      for (void* base : bases) layers.push_back(base ? host_alloc_.Take(base) : DeviceBuffer());
      PENUMBRA_RETURN_IF_ERROR(p->AdoptValues(std::move(layers), s.chunk_cap));
    } else if (n > 0) {
      // Values: the attached prefix's chunks, then the store's, per (layer,
      // head) one run [n][C*d]; layers copied in parallel.
      const size_t cb = static_cast<size_t>(C) * d * es_, own_cap = s.chunk_cap - s.shared_chunks;
      auto copy_layer = [&](int l) {
        char* dst = const_cast<char*>(p->values_host(l));
        for (int h = 0; h < H; ++h) {
          char* row = dst + static_cast<size_t>(h) * n * cb;
          if (s.shared_chunks > 0) {
            std::memcpy(row, s.prefix->values_host(l) + static_cast<size_t>(h) * s.shared_stride * cb,
                        s.shared_chunks * cb);
          }
          std::memcpy(row + s.shared_chunks * cb, static_cast<const char*>(s.store_host[l]) + h * own_cap * cb,
                      (n - s.shared_chunks) * cb);
        }
      };
      ParallelFor(L, copy_layer);
    }
    return std::shared_ptr<const KvPrefix>(std::move(p));
  }

  Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) override {
    return ImportPrefixLazy(blobs, nullptr, 0);
  }
  std::vector<std::string> LazyBlobs() const override { return {"values"}; }
  Result<std::shared_ptr<const KvPrefix>> ImportPrefixLazy(const std::map<std::string, std::string>& blobs,
                                                           std::shared_ptr<storage::BlobReader> lazy,
                                                           int read_threads) override {
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ShadowKvPrefix> p,
                              ShadowKvPrefix::Import(blobs, PrefixGeometry(), ctx_.backend, std::move(lazy),
                                                     read_threads));
    // What this policy's options make of a first prefill of that length.
    const ShadowKvPrefixGeometry& g = p->geometry();
    Seq probe;
    SequenceSpec spec;
    spec.prompt_len = g.tokens + 1;
    spec.first_prefill = g.factored;
    Shape(spec, &probe);
    if (probe.sparse != g.sparse || (g.sparse && probe.outliers != g.outliers)) {
      return Status::Corruption("shadowkv prefix: '" + g.Meta() + "' is not what this policy's options make");
    }
    return std::shared_ptr<const KvPrefix>(std::move(p));
  }

  // Copies a prefix's small device state (b, p, exclusion mask, outlier and
  // local rows) into the fresh sequence `s` (shaped for it by AddSequence);
  // its A rows, landmarks and values are read in place.
  Status AttachState(Seq& s, const ShadowKvPrefix& p) {
    Backend& b = *ctx_.backend;
    const ShadowKvPrefixGeometry& g = p.geometry();
    const int L = ctx_.num_layers, H = ctx_.hkv, d = ctx_.head_dim, C = o_.chunk_size, D = H * d;
    const int n = g.n_chunks;
    const size_t LH = static_cast<size_t>(L) * H, att_pitch = s.att_cap * d * es_;
    auto copy2d = [&](void* dst, size_t dpitch, const DeviceBuffer& src, size_t spitch, size_t width,
                      size_t height) -> Status {
      if (width == 0 || height == 0) return Status::OK();
      return b.Copy2D(dst, dpitch, src.get(), spitch, width, height);
    };
    if (s.sparse) {
      PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(s.b.get(), p.b.get(), p.b.bytes()));
      PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(s.p.get(), p.p.get(), p.p.bytes()));
      PENUMBRA_RETURN_IF_ERROR(copy2d(s.excl.get(), s.chunk_cap, p.excl, n, n, LH));
      const size_t orow = static_cast<size_t>(g.outliers) * C * d * es_;
      PENUMBRA_RETURN_IF_ERROR(copy2d(s.att_k.get(), att_pitch, p.out_k, orow, orow, LH));
      PENUMBRA_RETURN_IF_ERROR(copy2d(s.att_v.get(), att_pitch, p.out_v, orow, orow, LH));
      const size_t prow = g.tail * D * sizeof(float);
      PENUMBRA_RETURN_IF_ERROR(copy2d(s.prek.get(), s.local_cap * D * sizeof(float), p.tail_prek, prow, prow, L));
      s.outlier_ids = p.outlier_ids;
      s.n_chunks = n;
      s.compressed = true;
    }
    const size_t trow = g.tail * d * es_;
    PENUMBRA_RETURN_IF_ERROR(copy2d(Row(s.att_k, s, 0, LocalRow0(s)), att_pitch, p.tail_k, trow, trow, LH));
    PENUMBRA_RETURN_IF_ERROR(copy2d(Row(s.att_v, s, 0, LocalRow0(s)), att_pitch, p.tail_v, trow, trow, LH));
    s.local_count = g.tail;
    return Status::OK();
  }

  // The geometry fields every prefix of this policy shares.
  ShadowKvPrefixGeometry PrefixGeometry() const {
    ShadowKvPrefixGeometry g;
    g.layers = ctx_.num_layers;
    g.hkv = ctx_.hkv;
    g.head_dim = ctx_.head_dim;
    g.rank = o_.rank;
    g.chunk_size = o_.chunk_size;
    g.landmarks_per_chunk = o_.landmarks_per_chunk;
    g.landmark_fp8 = o_.landmark_fp8();
    g.dtype = ctx_.backend->act_dtype();
    return g;
  }

  // Runs f(0..n-1) on up to 8 threads.
  static void ParallelFor(int n, const std::function<void(int)>& f) {
    const int threads = std::max(1, std::min<int>(n, std::min(8u, std::max(1u, std::thread::hardware_concurrency()))));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (int i = t; i < n; i += threads) f(i);
      });
    }
    for (auto& th : pool) th.join();
  }

  // ------------------------------------------------------------- benchmarks

  Status SynthesizeContext(int64_t id, int64_t length, uint64_t seed) override {
    Seq& s = Get(id);
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, hq = ctx_.hq;
    const int64_t qkv_row = static_cast<int64_t>(hq + 2 * H) * d;
    const int chunk = 8192;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer qkv, b.Allocate(static_cast<size_t>(chunk) * qkv_row * sizeof(float)));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer q, b.Allocate(static_cast<size_t>(chunk) * hq * d * es_));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer pos, b.Allocate(static_cast<size_t>(chunk) * 4));
    std::vector<int32_t> p(chunk);
    for (int l = 0; l < ctx_.num_layers; ++l) {
      if (!s.sparse) break;
      if (l == 0) PENUMBRA_RETURN_IF_ERROR(EnsureTemp(s.token_cap));
      for (int64_t start = 0; start < length; start += chunk) {
        const int n = static_cast<int>(std::min<int64_t>(chunk, length - start));
        for (int i = 0; i < n; ++i) p[i] = static_cast<int32_t>(s.pos0 + start + i);  // a shard's positions
        PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(pos.get(), p.data(), n * 4));
        b.FillRandomNormal(qkv.get(), DType::kF32, n * qkv_row, 1.0f, seed * 1000003 + l * 7919 + start);
        PENUMBRA_RETURN_IF_ERROR(StoreTokens(qkv.as<float>(), pos.as<int32_t>(), n, start, q.get(), tmp_k_.get(),
                                             tmp_v_.get(), tmp_cap_ * d, tmp_prek_.as<float>() + start * H * d));
      }
      PENUMBRA_RETURN_IF_ERROR(CompressPrompt(s, l, length));
    }
    if (!s.sparse) {
      const int64_t n = AttLayer(s) * ctx_.num_layers;
      b.FillRandomNormal(s.att_k.get(), b.act_dtype(), n, 1.0f, seed * 2 + 1);
      b.FillRandomNormal(s.att_v.get(), b.act_dtype(), n, 1.0f, seed * 2 + 2);
      s.local_count = length;
    }
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    ReleaseTempIfLarge();
    s.compressed = s.sparse;
    return Status::OK();
  }

  size_t DeviceBytes(int64_t id) const override {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return 0;
    const Seq& s = it->second;
    return s.att_k.bytes() + s.att_v.bytes() + s.a.bytes() + s.b.bytes() + s.p.bytes() + s.lm.bytes() +
           s.excl.bytes() + s.slots.bytes() + s.prek.bytes();
  }

  PolicyStats stats() const override {
    PolicyStats st = stats_;
    st.prefill_op_ms = prefill_ms_;
    return st;
  }
  void SetProfiling(bool on) override { profile_ = on; }
  void SetDecodeProfiler(OpProfiler* profiler) override { prof_ = profiler; }
  Status SetForcedHitRate(double rate) override {
    if (!(rate <= 1.0)) return Status::InvalidArgument("forced hit rate must be <= 1 (negative: off)");
    o_.force_hit_rate = rate;
    return Status::OK();
  }
  void Lap(const char* op) {
    if (prof_) prof_->Lap(op);
  }

 private:
  static constexpr int kTables = 14;
  // Thread blocks of the value fetch that restores a whole layer's values
  // for a continuation prefill (no decode to share the SMs with).
  static constexpr int kRestoreFetchBlocks = 1024;

  struct Seq {
    int64_t id = 0;
    bool sparse = false;
    bool compressed = false;    // its first prefill is factored (later prefills continue it)
    bool taken = false;         // its values moved into a prefix (TakePrefix): it may only be removed
    int64_t first_prefill = 0;  // tokens of the first prefill (sets sparse, outliers, kslots)
    // Context parallel (ShardSpec): the shard's first position; closed: no
    // decode token is stored in it.
    int64_t pos0 = 0;
    bool closed = false;
    int window = 0;  // the local window: o_.local_window, 0 for a closed shard
    // A global selection over the shards (ShadowKvOptions::shard_selection):
    // the whole sequence's budget in chunks (0: the shard selects alone) and
    // the group exchanging the proposals.
    int global_k = 0;
    Collective* group = nullptr;
    std::vector<int32_t> outlier_ids;  // [layers][hkv][outliers] ascending chunk ids
    // An attached prefix: its values are this sequence's chunks [0, shared_chunks),
    // read in place; the store segment holds chunks from shared_chunks on.
    std::shared_ptr<const ShadowKvPrefix> prefix;
    int shared_chunks = 0;
    int shared_stride = 0;  // the prefix's value rows from one head to the next (>= shared_chunks)
    int64_t token_cap = 0;
    int outliers = 0, kslots = 0, chunk_cap = 0, n_chunks = 0;
    int64_t local_cap = 0, local_count = 0, att_cap = 0;
    int64_t a_rows = 0;  // A rows held per layer (the tokens after shared_chunks' chunks)
    int lm_cap = 0;      // chunks whose landmarks are held per head (from shared_chunks on; LmHead elements)
    // The continuation prefill under way: chunks a sparse one selected per
    // head (0: dense), and the temporaries' row of token t minus t.
    int cont_k = 0;
    int64_t cont_shift = 0;
    // This decode step reads the attached prefix's values through the host
    // (they are still being read from disk; set by BeginDecodeStep).
    bool values_staged = false;
    DeviceBuffer att_k, att_v, a, b, p, lm, excl, slots, prek;
    storage::SegmentId segment = 0;
    std::vector<const void*> store_dev, store_host;
  };


  // Pins the store's `layer` for s when it is not yet (its values are
  // written or read from here on).
  Status EnsureStoreLayer(Seq& s, int layer) {
    if (s.segment == 0 || s.store_host[static_cast<size_t>(layer)] != nullptr) return Status::OK();
    PENUMBRA_ASSIGN_OR_RETURN(const void* base, store_.AllocateLayer(s.segment, layer));
    s.store_host[static_cast<size_t>(layer)] = base;
    s.store_dev[static_cast<size_t>(layer)] = ctx_.backend->DeviceAddressOfHost(base);
    return Status::OK();
  }
  Seq& Get(int64_t id) {
    auto it = seqs_.find(id);
    CHECK(it != seqs_.end()) << "unknown sequence " << id;
    return it->second;
  }
  static bool SameGeometry(const Seq& a, const Seq& b) {
    return a.sparse == b.sparse && a.att_cap == b.att_cap && a.kslots == b.kslots && a.chunk_cap == b.chunk_cap &&
           a.outliers == b.outliers && a.shared_chunks == b.shared_chunks &&
           a.shared_stride == b.shared_stride && a.global_k == b.global_k;
  }
  int64_t AttLayer(const Seq& s) const { return static_cast<int64_t>(ctx_.hkv) * s.att_cap * ctx_.head_dim; }
  // Landmark elements (bytes for fp8) held per head: a record
  // (kernels/landmark_format.h) for each chunk from shared_chunks on.
  int64_t LmHead(const Seq& s) const { return static_cast<int64_t>(s.lm_cap) * lm_rec_; }
  int64_t LocalRow0(const Seq& s) const { return static_cast<int64_t>(s.outliers + s.kslots) * o_.chunk_size; }
  void* Row(const DeviceBuffer& buf, const Seq& s, int layer, int64_t row) const {
    return static_cast<char*>(buf.get()) + (layer * AttLayer(s) + row * ctx_.head_dim) * es_;
  }
  void* ALayer(const Seq& s, int layer) const { return Row2(s.a, layer, s.a_rows * o_.rank); }
  void* LmLayer(const Seq& s, int layer) const {
    return static_cast<char*>(s.lm.get()) + static_cast<int64_t>(layer) * ctx_.hkv * s.lm_cap * lm_rec_bytes_;
  }
  // Head 0's record of chunk `chunk` (>= shared_chunks) at `layer`.
  void* LmChunk(const Seq& s, int layer, int chunk) const {
    return static_cast<char*>(LmLayer(s, layer)) + (chunk - s.shared_chunks) * lm_rec_bytes_;
  }
  void* Row2(const DeviceBuffer& buf, int layer, int64_t per_layer) const {
    return static_cast<char*>(buf.get()) + layer * per_layer * es_;
  }

  Status Upload(DeviceBuffer* dst, const void* src, size_t bytes) {
    if (dst->bytes() < bytes) {
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(*dst, ctx_.backend->Allocate(std::max<size_t>(bytes * 2, 4096)));
    }
    return ctx_.backend->CopyToDevice(dst->get(), src, bytes);
  }

  // RoPE + store for tokens [start, start + n) into K/V bases laid out
  // [hkv][stride] (row t at +t*d); queries to q_out; pre-RoPE keys to
  // pre_rope (may be null).
  Status StoreTokens(const float* qkv, const int32_t* positions, int n, int64_t start, void* q_out, void* kbase,
                     void* vbase, int64_t stride, float* pre_rope) {
    const int d = ctx_.head_dim;
    std::vector<void*> ptrs(2 * static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      ptrs[i] = static_cast<char*>(kbase) + (start + i) * d * es_;
      ptrs[n + i] = static_cast<char*>(vbase) + (start + i) * d * es_;
    }
    PENUMBRA_RETURN_IF_ERROR(Upload(&ptr_buf_, ptrs.data(), ptrs.size() * sizeof(void*)));
    RopeStoreOp r;
    r.qkv = qkv;
    r.positions = positions;
    r.inv_freq = ctx_.inv_freq;
    r.n = n;
    r.hq = ctx_.hq;
    r.hkv = ctx_.hkv;
    r.d = d;
    r.q_out = q_out;
    r.k_dst = static_cast<void* const*>(ptr_buf_.get());
    r.v_dst = static_cast<void* const*>(ptr_buf_.get()) + n;
    r.head_stride = stride;
    r.pre_rope_k_out = pre_rope;
    ctx_.backend->RopeStore(r);
    return Status::OK();
  }

  Status EnsureTemp(int64_t tokens) {
    if (tmp_cap_ >= tokens) return Status::OK();
    Backend& b = *ctx_.backend;
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    tmp_k_.Reset();
    tmp_v_.Reset();
    tmp_prek_.Reset();
    const int H = ctx_.hkv, d = ctx_.head_dim;
    const size_t kv = static_cast<size_t>(H) * tokens * d * es_;
    PENUMBRA_ASSIGN_OR_RETURN(tmp_k_, b.Allocate(kv));
    PENUMBRA_ASSIGN_OR_RETURN(tmp_v_, b.Allocate(kv));
    PENUMBRA_ASSIGN_OR_RETURN(tmp_prek_, b.Allocate(static_cast<size_t>(tokens) * H * d * sizeof(float)));
    const int64_t chunks = tokens / o_.chunk_size + 1;
    PENUMBRA_ASSIGN_OR_RETURN(tmp_cos_, b.Allocate(static_cast<size_t>(H) * chunks * sizeof(float)));
    // Outlier ids: at most one per chunk, whichever of outlier_chunks / outlier_fraction applies.
    PENUMBRA_ASSIGN_OR_RETURN(tmp_outl_, b.Allocate(static_cast<size_t>(H) * (chunks + 1) * sizeof(int32_t)));
    tmp_cap_ = tokens;
    return Status::OK();
  }
  // Keeps the prefill temporaries for the next prompt unless they are large.
  void ReleaseTempIfLarge() {
    if (tmp_k_.bytes() > (size_t{256} << 20)) {
      (void)ctx_.backend->Synchronize();
      tmp_k_.Reset();
      tmp_v_.Reset();
      tmp_prek_.Reset();
      tmp_cap_ = 0;
    }
  }
  Result<float*> MinCosScratch(int n) {
    if (mincos_scratch_.bytes() < n * sizeof(float)) {
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());  // the old scratch may still be in use
      PENUMBRA_ASSIGN_OR_RETURN(mincos_scratch_, ctx_.backend->Allocate(n * sizeof(float) * 2));
    }
    return mincos_scratch_.as<float>();
  }
  Status EnsureShiftScratch(size_t bytes) {
    if (shift_.bytes() >= bytes) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
    PENUMBRA_ASSIGN_OR_RETURN(shift_, ctx_.backend->Allocate(bytes * 2));
    return Status::OK();
  }

  PolicyContext ctx_;
  ShadowKvOptions o_;
  size_t es_;
  int64_t lm_rec_;        // landmark elements (bytes for fp8) per chunk record: the kernels' strides
  int64_t lm_rec_bytes_;  // bytes per chunk record: the buffers' sizes and offsets
  BackendHostAllocator host_alloc_;
  storage::DramValueStore store_;
  std::map<int64_t, Seq> seqs_;
  // prefill temporaries (one layer of one prompt)
  DeviceBuffer tmp_k_, tmp_v_, tmp_prek_, tmp_cos_, tmp_outl_;
  int64_t tmp_cap_ = 0;
  DeviceBuffer ptr_buf_, step_buf_, miss_buf_, score_buf_, mincos_scratch_, shift_, stage_off_;
  DeviceBuffer iota_lists_, rebuild_ptrs_;  // continuation rebuilds: IotaLists(iota_k_); pointer table
  int iota_k_ = -1;
  // sparse continuations: score tables, scores, their maximum per chunk, the selection
  DeviceBuffer cont_tab_, cont_scores_, cont_max_, cont_sel_;
  std::vector<int32_t> cont_sel_host_;
  DeviceBuffer stage_, stage_v_;
  std::vector<Seq*> step_;
  std::vector<std::pair<int, int>> groups_;
  std::vector<DecodeAttentionOp> pending_attention_;
  // A global selection over a context-parallel group's shards (this step's
  // sequences are shards of xgroup_; null: none): the exchange buffers
  // (PrepareExchange), the proposals per row (xk_) and each group's queries.
  Collective* xgroup_ = nullptr;
  DeviceBuffer x_buf_;
  int xk_ = 0;
  // x_buf_ carved for the step: per sequence, query heads' (max, sum) sent
  // and received (stats floats per rank), KV heads' proposal scores sent and
  // received (cand per rank), the proposals' chunk ids, the global top-k's
  // winners and this rank's selection (cand each).
  struct Exchange {
    size_t stats = 0, cand = 0;
    float *stats_send = nullptr, *stats_recv = nullptr, *cand_send = nullptr, *cand_recv = nullptr;
    int32_t *proposals = nullptr, *winners = nullptr, *selection = nullptr;
  } x_;
  std::vector<const void*> group_q_;
  bool step_offsets_ = false;  // a sequence of this step is a shard after position 0  // DecodeAttention's, with micro-batches
  int step_batch_ = 0, step_max_k_ = 0, step_max_chunks_ = 0;
  bool profile_ = false;
  OpProfiler* prof_ = nullptr;  // decode laps (runtime's timeline), when profiling
  std::map<std::string, double> prefill_ms_;
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeShadowKvPolicy(const PolicyContext& ctx, const ShadowKvOptions& options) {
  PENUMBRA_RETURN_IF_ERROR(ValidateShadowKvOptions(options, ctx.hkv, ctx.head_dim));
  PENUMBRA_RETURN_IF_ERROR(ValidateShadowKvOnDevice(options, ctx.hq, ctx.hkv, ctx.head_dim,
                                                    ctx.backend ? ctx.backend->device() : Device::kCPU));
  return std::unique_ptr<KvPolicy>(new ShadowKvPolicy(ctx, options));
}

}  // namespace penumbra
