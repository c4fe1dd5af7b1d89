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
#include <future>
#include <limits>
#include <map>

#include <span>
#include <sstream>

#include "kernels/landmark_format.h"
#include "kernels/value_format.h"
#include "storage/dram_value_store.h"
#include "worker/engine/backend_host_allocator.h"
#include "worker/engine/collective.h"
#include "worker/engine/engine.h"
#include "worker/engine/shadowkv/compressor.h"
#include "worker/engine/shadowkv/decode_step.h"
#include "worker/engine/shadowkv/layout.h"
#include "worker/engine/shadowkv/prefix_io.h"
#include "worker/engine/shadowkv/shard_exchange.h"
#include "worker/engine/shadowkv_prefix.h"

namespace penumbra {
namespace {

namespace kn = kernels;

class ShadowKvPolicy final : public KvPolicy {
  using Seq = ShadowKvSeq;

 public:
  ShadowKvPolicy(const PolicyContext& ctx, const ShadowKvOptions& o)
      : ctx_(ctx),
        o_(o),
        lay_(ctx_, o_),
        es_(lay_.es()),
        host_alloc_(ctx.backend),
        store_(&host_alloc_, storage::DramValueStoreOptions{}),
        comp_(lay_, *ctx.backend),
        prefix_io_(lay_, *ctx.backend, store_, host_alloc_),
        step_(lay_, *ctx.backend),
        exchange_(ctx_, *ctx.backend) {}

  std::string name() const override { return "shadowkv"; }

  Status AddSequence(int64_t id, const SequenceSpec& spec) override {
    if (seqs_.count(id)) return Status::InvalidArgument("sequence " + std::to_string(id) + " already exists");
    const ShadowKvPrefix* prefix = nullptr;
    if (spec.prefix) {
      prefix = dynamic_cast<const ShadowKvPrefix*>(spec.prefix.get());
      if (prefix == nullptr) {
        return Status::InvalidArgument("a " + spec.prefix->policy() + " prefix cannot attach to a shadowkv sequence");
      }
      // A context-parallel shard attaches its own capture: every token of it
      // (what follows comes as decode steps).
      if (spec.shard.sharded() && prefix->tokens() != spec.prompt_len) {
        return Status::InvalidArgument("a context-parallel shard of " + std::to_string(spec.prompt_len) +
                                       " tokens attaches a prefix of exactly its tokens, not " +
                                       std::to_string(prefix->tokens()));
      }
      if (!spec.shard.sharded() && prefix->tokens() >= spec.prompt_len) {
        return Status::InvalidArgument("a prefix of " + std::to_string(prefix->tokens()) +
                                       " tokens leaves nothing of the " + std::to_string(spec.prompt_len) +
                                       "-token prompt to prefill");
      }
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
      return Status::InvalidArgument(
          "shadowkv: a budget of " + std::to_string(s.kslots) + " chunks (" +
          std::to_string(int64_t{s.kslots} * o_.chunk_size) + " tokens) for this prompt is more than the " +
          std::to_string(kShadowKvMaxSelectedChunks) + " a selection takes (lower shadowkv.budget_fraction)");
    }
    if (s.global_k > kn::kTopKMaxK) {
      return Status::InvalidArgument("shadowkv: a global selection over the shards of " + std::to_string(s.global_k) +
                                     " chunks is more than " + std::to_string(kn::kTopKMaxK) + " (lower the budget)");
    }
    if (prefix) PENUMBRA_RETURN_IF_ERROR(prefix_io_.Fit(*prefix, s));
    const storage::SegmentLayout segment = lay_.ValueSegment(s);
    if (s.sparse) {
      const size_t host_need = segment.total_bytes();
      const size_t host_free = ctx_.backend->FreeHostBytes();
      if (host_free > 0 && host_need + kHostMemoryKeptFree > host_free) {
        return Status::ResourceExhausted("shadowkv: the value store needs " + std::to_string(host_need >> 20) +
                                         " MiB of host memory and only " + std::to_string(host_free >> 20) +
                                         " MiB are available (8 GiB kept free)");
      }
    }
    // The attention rows; sparse: A rows, landmarks, B, P, marks, slots, local pre-RoPE keys.
    PENUMBRA_RETURN_IF_ERROR(lay_.Allocate(&s));
    if (s.sparse) {
      // Reserved now, each layer pinned when the prefill reaches it
      // (EnsureStoreLayer): a long prompt's 8 GB are not pinned all at once
      // while the running batch waits.
      PENUMBRA_ASSIGN_OR_RETURN(s.segment, store_.ReserveSegment(segment));
      s.store_dev.assign(static_cast<size_t>(segment.layers), nullptr);
      s.store_host.assign(static_cast<size_t>(segment.layers), nullptr);
    }
    if (prefix) {
      Status st = prefix_io_.Attach(*prefix, s);
      if (!st.ok()) {
        if (s.segment) (void)store_.DropSegment(s.segment);
        return st;
      }
      s.prefix = std::static_pointer_cast<const ShadowKvPrefix>(spec.prefix);
    }
    seqs_.emplace(id, std::move(s));
    return Status::OK();
  }

  // A new sequence's geometry (ShadowKvLayout::Shape).
  void Shape(const SequenceSpec& spec, Seq* out) const { lay_.Shape(spec, out); }

  void RemoveSequence(int64_t id) override {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    (void)ctx_.backend->Synchronize();  // kernels may still read its buffers
    if (it->second.segment) {
      // Its puts and pinning in flight end first (they write into the segment).
      comp_.ForgetPuts(it->second.segment);
      if (pin_.done.valid() && pin_.segment == it->second.segment) (void)pin_.done.get();
      (void)store_.DropSegment(it->second.segment);
    }
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
          const bool sparse =
              o_.continuation == "sparse" || (o_.continuation == "auto" && n <= o_.continuation_auto_max_tokens);
          if (layer == 0) ++(sparse ? stats_.sparse_continuations : stats_.dense_continuations);
          if (sparse) {
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
      kbase = comp_.tmp_k().get();
      vbase = comp_.tmp_v().get();
      stride = comp_.tmp_cap() * d;
    }
    PENUMBRA_RETURN_IF_ERROR(StoreTokens(qkv, positions, n, row0, q_scratch, kbase, vbase, stride,
                                         s.sparse ? comp_.tmp_prek().as<float>() + row0 * D : nullptr));
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
      // The prompt's values, put by helper threads, are all in the store.
      if (s.segment) PENUMBRA_RETURN_IF_ERROR(comp_.DrainPuts(s.segment));
      s.compressed = true;
      ReleaseTempIfLarge();
      // A prefix read lazily from disk: its first request is answered; the
      // rest of its values now come in the background.
      if (s.prefix) s.prefix->StartValueRestore();
    }
    return Status::OK();
  }

  // Tokens the sequence holds (after its last prefill or decode step).
  int64_t Held(const Seq& s) const { return lay_.Held(s); }

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
              static_cast<char*>(comp_.tmp_k().get()) + (h * comp_.tmp_cap() + static_cast<int64_t>(c) * C) * d * es_,
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
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(comp_.tmp_k().get(), comp_.tmp_cap() * d * es_, Row(s.att_k, s, layer, 0),
                                        s.att_cap * d * es_, w, H));
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(comp_.tmp_v().get(), comp_.tmp_cap() * d * es_, Row(s.att_v, s, layer, 0),
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
    const void* ptrs[5] = {ALayer(s, layer), Row2(s.b, layer, static_cast<int64_t>(H) * o_.rank * d),
                           comp_.tmp_k().get(), comp_.tmp_v().get(), s.store_dev[layer]};
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
    rk.att_head_stride = comp_.tmp_cap() * d;
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
    fv.att_head_stride = comp_.tmp_cap() * d;
    fv.outlier_rows = first_row;
    fv.batch = 1;
    fv.hkv = H;
    fv.d = d;
    fv.chunk_size = C;
    fv.max_misses = per_head;
    fv.max_blocks = kRestoreFetchBlocks;
    fv.values_fp8 = o_.value_fp8();
    if (host_chunks != nullptr) {
      const size_t cb = lay_.value_row_bytes(), n = static_cast<size_t>(H) * per_head;
      if (stage_v_.bytes() < n * cb) {
        PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
        PENUMBRA_ASSIGN_OR_RETURN(stage_v_, b.AllocateHost(n * cb));
      }
      for (size_t i = 0; i < n; ++i) {
        PENUMBRA_RETURN_IF_ERROR(
            CopyChunkToHost(s, layer, static_cast<int>(i / per_head), host_chunks[i], stage_v_.as<char>() + i * cb));
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
    const size_t cb = lay_.value_row_bytes();
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
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(comp_.tmp_k().get()) + row * d * es_,
                                      comp_.tmp_cap() * d * es_, Row(s.att_k, s, layer, LocalRow0(s)),
                                      s.att_cap * d * es_, w, H));
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(comp_.tmp_v().get()) + row * d * es_,
                                      comp_.tmp_cap() * d * es_, Row(s.att_v, s, layer, LocalRow0(s)),
                                      s.att_cap * d * es_, w, H));
    return b.CopyDeviceToDevice(comp_.tmp_prek().as<float>() + row * D,
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
    // The landmark tables name the sequence this many times: the backend's
    // row-by-row path (shapes its kernels do not cover) scores that many rows
    // per call.
    constexpr int kRowsPerScore = 64;
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
    PENUMBRA_RETURN_IF_ERROR(grow(&cont_max_, static_cast<size_t>(n) * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(grow(&cont_sel_, static_cast<size_t>(H) * k * sizeof(int32_t)));
    auto* tab = static_cast<void* const*>(cont_tab_.get());
    // Every query row of the piece over the sequence's landmarks: per chunk
    // the highest softmax probability any row and head gives it.
    kn::ShadowkvQueryScoresArgs qs;
    kn::ShadowkvScoreArgs& sc = qs.score;
    sc.q = q;
    sc.landmarks = reinterpret_cast<const void* const*>(tab);
    sc.excluded = reinterpret_cast<const uint8_t* const*>(tab + rb);
    sc.shared_landmarks = reinterpret_cast<const void* const*>(tab + 2 * rb);
    sc.n_chunks = reinterpret_cast<const int32_t*>(tab + 3 * rb);
    sc.batch = rb;
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
    qs.rows = rows;
    qs.best = cont_max_.as<float>();
    PENUMBRA_RETURN_IF_ERROR(b.ShadowkvQueryScores(qs));
    std::vector<float> score(static_cast<size_t>(n));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(score.data(), cont_max_.get(), score.size() * sizeof(float)));
    // The k + O best (ties: the lower chunk), then per head the first k of
    // them that are not its outliers (it has O: k of them always remain).
    const int O = s.outliers, want = std::min(n, k + O);
    std::vector<int32_t> order(static_cast<size_t>(n));
    for (int c = 0; c < n; ++c) order[c] = c;
    std::partial_sort(order.begin(), order.begin() + want, order.end(),
                      [&](int32_t x, int32_t y) { return score[x] > score[y] || (score[x] == score[y] && x < y); });
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
      cl.k = comp_.tmp_k().get();
      cl.k_head_stride = comp_.tmp_cap() * d;
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
      pk.keys = comp_.tmp_prek().as<float>() + row0 * D;
      pk.n = k * C;
      pk.D = D;
      pk.rank = o_.rank;
      pk.proj = s.p.as<float>() + static_cast<int64_t>(layer) * D * o_.rank;
      pk.a_out =
          static_cast<char*>(ALayer(s, layer)) + static_cast<int64_t>(first - s.shared_chunks) * C * o_.rank * es_;
      b.ProjectKeys(pk);
      PENUMBRA_RETURN_IF_ERROR(
          OffloadValues(s, layer, comp_.tmp_v().get(), comp_.tmp_cap() * d, row0, k, first - s.shared_chunks));
    }
    const int64_t tail0 = static_cast<int64_t>(total) * C, tail = end - tail0;
    const int64_t trow = tail0 + s.cont_shift;  // its row in the temporaries
    if (tail > s.local_cap) return Status::Internal("shadowkv: local rows overflow");
    const size_t w = tail * d * es_;
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(Row(s.att_k, s, layer, LocalRow0(s)), s.att_cap * d * es_,
                                      static_cast<char*>(comp_.tmp_k().get()) + trow * d * es_,
                                      comp_.tmp_cap() * d * es_, w, H));
    PENUMBRA_RETURN_IF_ERROR(b.Copy2D(Row(s.att_v, s, layer, LocalRow0(s)), s.att_cap * d * es_,
                                      static_cast<char*>(comp_.tmp_v().get()) + trow * d * es_,
                                      comp_.tmp_cap() * d * es_, w, H));
    PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(s.prek.as<float>() + static_cast<int64_t>(layer) * s.local_cap * D,
                                                  comp_.tmp_prek().as<float>() + trow * D, tail * D * sizeof(float)));
    if (layer == ctx_.num_layers - 1) {
      s.n_chunks = total;
      s.local_count = tail;
    }
    return Status::OK();
  }

  // Algorithm 1 for one layer of one sequence, from the temporaries.
  Status CompressPrompt(Seq& s, int layer, int64_t S) {
    Backend& b = *ctx_.backend;
    const int C = o_.chunk_size, d = ctx_.head_dim;
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
    PENUMBRA_RETURN_IF_ERROR(comp_.Factor(s, layer, S));
    lap("svd");
    comp_.Landmarks(s, layer, n_chunks);
    lap("landmarks");
    PENUMBRA_RETURN_IF_ERROR(comp_.Outliers(s, layer, n_chunks));
    lap("outliers");
    // Values of every chunk to the store (outliers too: never selected, and
    // it keeps each head's chunks one contiguous run); the store's put runs
    // beside the next layers (drained at the last one).
    PENUMBRA_RETURN_IF_ERROR(EnsureStoreLayer(s, layer));
    PENUMBRA_RETURN_IF_ERROR(
        comp_.OffloadValuesAsync(store_, s, layer, comp_.tmp_v().get(), comp_.tmp_cap() * d, 0, n_chunks, 0));
    lap("offload");
    // The tail becomes the local rows (exact K/V and pre-RoPE keys).
    const int64_t tail0 = static_cast<int64_t>(n_chunks) * C, tail = S - tail0;
    CHECK_LE(tail, s.local_cap);
    PENUMBRA_RETURN_IF_ERROR(comp_.TailToLocal(s, layer, tail0, tail));
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
    return comp_.OffloadValues(store_, &stage_, s, layer, src, head_stride, src_row, n, store_first);
  }

  // ----------------------------------------------------------------- decode

  Status BeginDecodeStep(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions) override {
    const int L = ctx_.num_layers, B = static_cast<int>(ids.size());
    std::vector<Seq*> seqs;
    seqs.reserve(static_cast<size_t>(B));
    for (int i = 0; i < B; ++i) {
      Seq& s = Get(ids[i]);
      // A closed shard holds fixed tokens before every decode position.
      if (!s.closed) {
        CHECK_EQ(positions[i], s.pos0 + s.n_chunks * int64_t{o_.chunk_size} + s.local_count)
            << "sequence " << s.id << " decoded out of order";
      }
      CHECK_LT(s.local_count, s.local_cap) << "sequence " << s.id << " is full";
      for (int l = 0; l < L; ++l) PENUMBRA_RETURN_IF_ERROR(EnsureStoreLayer(s, l));
      // Decided once per step: the pointer tables hold the prefix's device
      // address only once its values are complete (pinned).
      s.values_staged = s.prefix && !s.prefix->values_complete();
      seqs.push_back(&s);
    }
    // Groups, the uploaded pointer tables and ints, the selection workspaces.
    PENUMBRA_RETURN_IF_ERROR(step_.Begin(seqs));
    // A context-parallel group's global selection: its exchange buffers.
    xgroup_ = ShadowKvShardExchange::GroupOf(step_.seqs());
    if (xgroup_ != nullptr) PENUMBRA_RETURN_IF_ERROR(exchange_.Prepare(xgroup_, step_.seqs()));
    // Only a step that fetches values takes part in the lanes' fetch turns
    // (EndDecodeStep ends it on every path).
    if (ctx_.fetch_turns && step_.max_k() > 0) ctx_.fetch_turns->StepBegin(ctx_.lane);
    return Status::OK();
  }

  Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                         float* lse) override {
    if (xgroup_ != nullptr) return DecodeAttentionGlobal(layer, qkv, positions, q_scratch, out, lse);
    Backend& b = *ctx_.backend;
    const std::vector<std::pair<int, int>>& groups = step_.groups();
    // With micro-batches, every group's selection is issued first (its value
    // fetch left running on the side stream as mark gi), then the attentions,
    // each waiting only for its own group's fetch.
    // (Not while an attached prefix's values are still read from disk: its
    // groups take the staging path, whose one host buffer the groups share.)
    bool restoring = false;
    for (const Seq* q : step_.seqs()) restoring = restoring || q->values_staged;
    const bool pipelined = o_.micro_batches > 1 && groups.size() > 1 &&
                           groups.size() <= static_cast<size_t>(Backend::kSideMarks) && o_.value_fetch == "zero_copy" &&
                           !restoring;
    std::vector<DecodeAttentionOp>& attention = pending_attention_;  // reused: no allocation per layer
    attention.clear();
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto [g0, gn] = groups[gi];
      const void* q = RopeStoreGroup(layer, g0, gn, qkv, positions, q_scratch);
      bool in_place = false;
      if (step_.seq(g0).sparse) {
        PENUMBRA_ASSIGN_OR_RETURN(in_place, PrepareValuesInPlace(layer, g0, gn));
        PENUMBRA_RETURN_IF_ERROR(Select(layer, g0, gn, q, pipelined ? static_cast<int>(gi) : -1, in_place));
      }
      const DecodeAttentionOp a = step_.AttentionOf(layer, g0, gn, q, out, lse, /*mask_slots=*/false, in_place);
      if (pipelined) {
        attention.push_back(a);
      } else {
        PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(a));
        Lap("sparse_attention");
      }
    }
    for (size_t gi = 0; gi < attention.size(); ++gi) {
      if (step_.seq(groups[gi].first).sparse) b.WaitSideMark(static_cast<int>(gi));
      PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(attention[gi]));
      Lap("sparse_attention");
    }
    return Status::OK();
  }

  // The global selection over the shards of a context-parallel group (the
  // step's sequences are all shards of it; every rank runs the same groups of
  // the same sequences; ShadowKvShardExchange says what they send). Per
  // layer, for the whole step:
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
    const std::vector<std::pair<int, int>>& groups = step_.groups();
    ShadowKvShardExchange& x = exchange_;
    const int xk = x.width();
    std::vector<const void*>& q = group_q_;
    q.assign(groups.size(), nullptr);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto [g0, gn] = groups[gi];
      q[gi] = RopeStoreGroup(layer, g0, gn, qkv, positions, q_scratch);
      if (!step_.seq(g0).sparse) continue;
      kn::ShadowkvScoreArgs sc = step_.ScoreArgsOf(layer, g0, gn, q[gi]);
      sc.stats_out = x.stats_send() + static_cast<size_t>(g0) * hq * 2;
      sc.workspace_part = static_cast<int>(gi);
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    PENUMBRA_RETURN_IF_ERROR(x.AllGatherStats());
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto [g0, gn] = groups[gi];
      if (!step_.seq(g0).sparse) continue;
      const size_t off = static_cast<size_t>(g0) * H * xk;
      kn::ShadowkvScoreArgs sc = step_.ScoreArgsOf(layer, g0, gn, q[gi]);
      sc.stats_in = x.stats_recv() + static_cast<size_t>(g0) * hq * 2;
      sc.stats_parts = W;
      sc.stats_part_stride = static_cast<int64_t>(x.stats());
      sc.workspace_part = static_cast<int>(gi);
      sc.selection = x.proposals() + off;
      sc.selection_stride = xk;
      sc.selection_scores = x.cand_send() + off;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    Lap("score_topk");
    PENUMBRA_RETURN_IF_ERROR(x.AllGatherCandidates());
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto [g0, gn] = groups[gi];
      const Seq& s0 = step_.seq(g0);
      if (s0.sparse) {
        const size_t off = static_cast<size_t>(g0) * H * xk;
        kn::ShadowkvGlobalSelectArgs gs;
        gs.candidates = x.cand_recv() + off;
        gs.parts = W;
        gs.rank = xgroup_->rank();
        gs.part_stride = static_cast<int64_t>(x.cand());
        gs.rows = gn * H;
        gs.cand_stride = xk;
        gs.k = s0.global_k;
        gs.proposals = x.proposals() + off;
        gs.winners = x.winners() + off;
        gs.selection = x.selection() + off;
        gs.selection_stride = xk;
        gs.selection_len = s0.kslots;
        b.ShadowkvGlobalSelectAndSlotUpdate(gs, step_.SlotUpdateOf(layer, g0, gn, x.selection() + off, xk));
        Lap("global_select_slot_update");
        PENUMBRA_RETURN_IF_ERROR(FetchMisses(layer, g0, gn, /*mark=*/-1, /*in_place=*/false));
      }
      PENUMBRA_RETURN_IF_ERROR(
          b.DecodeAttention(step_.AttentionOf(layer, g0, gn, q[gi], out, lse, /*mask_slots=*/true)));
      Lap("sparse_attention");
    }
    return Status::OK();
  }

  // RoPE of a group's new tokens, their K/V into the attention rows; returns
  // the rotated queries.
  const void* RopeStoreGroup(int layer, int g0, int gn, const float* qkv, const int32_t* positions, void* q_scratch) {
    const RopeStoreOp r = step_.RopeStoreOf(layer, g0, gn, qkv, positions, q_scratch);
    ctx_.backend->RopeStore(r);
    Lap("rope_store");
    return r.q_out;
  }

  // Algorithm 2's selection and sparse KV reconstruction for one group.
  // mark >= 0: the value fetch is left running as side mark `mark` (the
  // caller waits for it before the group's attention); else joined here.
  Status Select(int layer, int g0, int gn, const void* q, int mark, bool in_place) {
    const kn::ShadowkvScoreArgs sc = step_.ScoreArgsOf(layer, g0, gn, q);
    stats_.scored_sequences += gn;
    if (sc.one_prefix) stats_.one_prefix_sequences += gn;
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->ShadowkvScoreAndSlotUpdate(
        sc, step_.SlotUpdateOf(layer, g0, gn, sc.selection,
                               sc.selection_stride)));  // one launch after the logits on the GPU
    Lap("score_topk_slot_update");
    return FetchMisses(layer, g0, gn, mark, in_place);
  }

  // Whether group [g0, g0 + gn)'s attention reads its attached prefix's
  // values in place at `layer` (DecodeAttentionOp::slot_values): every
  // sequence attached to a prefix whose values of the layer are in device
  // memory (tier 0), not being read from disk, in bf16/f32 (not fp8), the
  // zero-copy fetch, outside a context-parallel group. Then the value fetch
  // copies only the sequences' own chunks: at 64 questions over one document
  // it copied every selected chunk of the document into each question's
  // rows. A sequence that read in place at this layer last step and does not
  // now has its slot map cleared (every chunk a miss: its rows of the
  // prefix's chunks were never written).
  Result<bool> PrepareValuesInPlace(int layer, int g0, int gn) {
    bool in_place = xgroup_ == nullptr && !o_.value_fp8() && o_.value_fetch == "zero_copy";
    for (int i = g0; i < g0 + gn && in_place; ++i) {
      const Seq& q = step_.seq(i);
      in_place = q.sparse && q.shared_chunks > 0 && q.prefix && !q.values_staged && q.prefix->values_on_device(layer);
    }
    const size_t l = static_cast<size_t>(layer);
    for (int i = g0; i < g0 + gn; ++i) {
      Seq& q = step_.seq(i);
      if (q.values_read_in_place.size() <= l) q.values_read_in_place.resize(static_cast<size_t>(ctx_.num_layers), 0);
      if (!in_place && q.values_read_in_place[l]) {
        const size_t per_layer = static_cast<size_t>(ctx_.hkv) * q.kslots;
        PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Memset(q.slots.as<int32_t>() + l * per_layer, 0xff,
                                                      per_layer * sizeof(int32_t)));  // -1: empty
      }
      q.values_read_in_place[l] = in_place ? 1 : 0;
    }
    return in_place;
  }

  // The slot update's misses: V from the store on the side stream (in_place:
  // the sequences' own chunks only), K rebuilt on the main one.
  Status FetchMisses(int layer, int g0, int gn, int mark, bool in_place) {
    Backend& b = *ctx_.backend;
    b.ForkSide();
    // Lanes take turns on the host link: wait for the previous lane's fetch.
    if (ctx_.fetch_turns) {
      if (auto turn = ctx_.fetch_turns->Await(ctx_.lane, layer)) b.WaitFetchDone(*turn->backend, turn->layer);
    }
    kn::ShadowkvFetchVArgs fv = step_.FetchVOf(layer, g0, gn);
    bool lazy = false;      // an attached prefix's values still being read from disk: through the host
    bool on_device = true;  // every sequence's document values in device memory (tier 0)
    for (int i = g0; i < g0 + gn; ++i) {
      const Seq& q = step_.seq(i);
      lazy = lazy || q.values_staged;
      on_device = on_device && q.prefix && q.prefix->values_on_device(layer);
    }
    // From device memory the fetch is not bound by the host link: as many
    // blocks as the restore's.
    if (on_device) {
      fv.max_blocks = kRestoreFetchBlocks;
      fv.values_on_device = true;
      fv.skip_shared = in_place;
    }
    if (o_.value_fetch == "staging" || lazy) {
      PENUMBRA_RETURN_IF_ERROR(StageValues(layer, g0, gn, fv.miss_count, fv.miss_chunk, &fv));
      b.ShadowkvFetchV(fv, /*staged=*/true);
    } else {
      b.ShadowkvFetchV(fv, /*staged=*/false);
    }
    if (ctx_.fetch_turns) {
      b.RecordFetchDone(layer);
      ctx_.fetch_turns->Issued(ctx_.lane, layer);
    }
    b.ShadowkvRebuildK(step_.RebuildKOf(layer, g0, gn));
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
    const int H = ctx_.hkv, K = step_.seq(g0).kslots;
    const int rows = gn * H;
    std::vector<int32_t> counts(rows), chunks(static_cast<size_t>(rows) * K);
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(counts.data(), mcount, rows * 4));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(chunks.data(), mchunk, chunks.size() * 4));
    const size_t chunk_bytes = lay_.value_row_bytes();
    std::vector<int32_t> offsets(rows);
    size_t total = 0;
    for (int r = 0; r < rows; ++r) {
      offsets[r] = static_cast<int32_t>(total);
      total += counts[r];
    }
    // An attached prefix's values read lazily from disk: the missed ones now.
    for (int i = 0; i < gn; ++i) {
      Seq& s = step_.seq(g0 + i);
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
        PENUMBRA_RETURN_IF_ERROR(CopyChunkToHost(step_.seq(g0 + r / H), layer, r % H, c,
                                                 stage_v_.as<char>() + (offsets[r] + j) * chunk_bytes));
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
    const int B = step_.batch(), H = ctx_.hkv, L = ctx_.num_layers;
    ++stats_.decode_steps;
    if (step_.max_k() > 0) {
      std::vector<int32_t> counts(static_cast<size_t>(L) * B * H);
      const int32_t* mc = step_.MissCountsAll();
      PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(counts.data(), mc, counts.size() * 4));
      for (int l = 0; l < L; ++l) {
        for (int i = 0; i < B; ++i) {
          Seq& s = step_.seq(i);
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
    for (Seq* s : step_.seqs()) {
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
    // fp8 values: each row encoded here (a chunk per sequence every C steps;
    // the prefill's offload encodes on the device).
    std::vector<float> wide(o_.value_fp8() ? static_cast<size_t>(C) * d : 0);
    std::vector<uint8_t> coded(o_.value_fp8() ? lay_.value_row_bytes() : 0);
    for (size_t k = 0; k < due.size(); ++k) {
      Seq& s = *due[k];
      for (int l = 0; l < L; ++l) {
        for (int h = 0; h < H; ++h) {
          const char* src = stage_.as<char>() + k * per_seq + (static_cast<size_t>(l) * H + h) * row;
          if (o_.value_fp8()) {
            ConvertToF32(src, ctx_.backend->act_dtype(), wide.data(), wide.size());
            kn::EncodeValueRowFp8(wide.data(), C, d, coded.data());
            src = reinterpret_cast<const char*>(coded.data());
          }
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
  bool PrefillSplits(int64_t seq) const override {
    (void)seq;
    return false;
  }

  std::string StateFingerprint() const override {
    std::ostringstream os;
    os << "shadowkv v1 rank=" << o_.rank << " chunk=" << o_.chunk_size << " budget=" << o_.budget_tokens
       << " budget_fraction=" << o_.budget_fraction << " outliers=" << o_.outlier_chunks
       << " outlier_fraction=" << o_.outlier_fraction << " window=" << o_.local_window
       << " min_prompt=" << o_.min_prompt_tokens << " continuation=" << o_.continuation << ":"
       << o_.continuation_budget_tokens;
    if (o_.continuation == "auto") os << ":" << o_.continuation_auto_max_tokens;
    if (o_.landmarks_per_chunk != 1) os << " landmarks_per_chunk=" << o_.landmarks_per_chunk;
    if (o_.landmark_fp8()) os << " landmark_format=fp8";
    if (o_.value_fp8()) os << " value_format=fp8";
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
    PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ShadowKvPrefix> p, prefix_io_.Capture(it->second, tokens, take));
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
                              prefix_io_.Import(blobs, std::move(lazy), read_threads));
    return std::shared_ptr<const KvPrefix>(std::move(p));
  }

  // ------------------------------------------------------- exact -> factored

  // Layer `layer` of a prompt given as the full policy's exact keys and
  // values (KvPolicy::FactorExactLayer): the rows go through StoreTokens as
  // a first prefill's do (RoPE, the temporaries, the pre-RoPE keys), from
  // qkv rows rebuilt from the exact cache (queries zero, keys with their
  // RoPE undone by a rotation at the negated positions), and the layer is
  // compressed as FinishPrefillLayer compresses it. No attention is run.
  Status FactorExactLayer(int64_t id, const ExactKv& kv, int layer) override {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Status::NotFound("sequence " + std::to_string(id) + " does not exist");
    Seq& s = it->second;
    if (s.pos0 != 0 || s.prefix || s.compressed || kv.tokens != s.first_prefill || kv.tokens < 1) {
      return Status::InvalidArgument("shadowkv: exact keys and values of " + std::to_string(kv.tokens) +
                                     " tokens are factored into a new whole sequence of exactly that prompt");
    }
    if (layer < 0 || layer >= ctx_.num_layers || kv.head_stride < kv.tokens * ctx_.head_dim) {
      return Status::InvalidArgument("shadowkv: FactorExactLayer: layer " + std::to_string(layer) + " or head stride " +
                                     std::to_string(kv.head_stride) + " out of range");
    }
    PENUMBRA_RETURN_IF_ERROR(EnsureStoreLayer(s, layer));
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, d = ctx_.head_dim, hq = ctx_.hq, D = H * d;
    const int64_t row = static_cast<int64_t>(hq + 2 * H) * d;  // a qkv row, floats
    const int R = static_cast<int>(std::min<int64_t>(4096, kv.tokens));
    if (s.sparse) PENUMBRA_RETURN_IF_ERROR(EnsureTemp(s.token_cap));
    void* kbase = s.sparse ? comp_.tmp_k().get() : Row(s.att_k, s, layer, LocalRow0(s));
    void* vbase = s.sparse ? comp_.tmp_v().get() : Row(s.att_v, s, layer, LocalRow0(s));
    const int64_t stride = s.sparse ? comp_.tmp_cap() * d : s.att_cap * d;
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer qkv, b.Allocate(static_cast<size_t>(R) * row * sizeof(float)));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer rows, b.Allocate(static_cast<size_t>(R) * D * es_));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer unroped, b.Allocate(static_cast<size_t>(R) * D * es_ * 2));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer f32, b.Allocate(static_cast<size_t>(R) * D * sizeof(float)));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer q, b.Allocate(static_cast<size_t>(R) * hq * d * es_));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer pos, b.Allocate(static_cast<size_t>(R) * 2 * sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer ptrs, b.Allocate(static_cast<size_t>(R) * 2 * sizeof(void*)));
    PENUMBRA_RETURN_IF_ERROR(b.Memset(qkv.get(), 0, qkv.bytes()));
    // The undoing rotation writes token i's keys (and, unused, its values)
    // as [H][d] rows of `unroped`.
    std::vector<void*> dst(2 * static_cast<size_t>(R));
    for (int i = 0; i < R; ++i) {
      dst[i] = static_cast<char*>(unroped.get()) + static_cast<size_t>(i) * D * es_;
      dst[R + i] = static_cast<char*>(unroped.get()) + (static_cast<size_t>(R) + i) * D * es_;
    }
    PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(ptrs.get(), dst.data(), dst.size() * sizeof(void*)));
    const size_t layer_elems = static_cast<size_t>(H) * kv.head_stride;
    std::vector<int32_t> p(2 * static_cast<size_t>(R));
    for (int64_t start = 0; start < kv.tokens; start += R) {
      const int n = static_cast<int>(std::min<int64_t>(R, kv.tokens - start));
      for (int i = 0; i < n; ++i) {
        p[i] = static_cast<int32_t>(start + i);
        p[R + i] = -p[i];
      }
      PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(pos.get(), p.data(), p.size() * sizeof(int32_t)));
      // Exact [H][T][d] rows of this piece -> token-major [n][H][d] -> f32
      // into the qkv rows' key (first) and value (second) columns.
      for (int which = 0; which < 2; ++which) {
        const char* src = static_cast<const char*>(which == 0 ? kv.k : kv.v) +
                          (layer * layer_elems + static_cast<size_t>(start) * d) * es_;
        for (int h = 0; h < H; ++h) {
          PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(rows.get()) + static_cast<size_t>(h) * d * es_, D * es_,
                                            src + static_cast<size_t>(h) * kv.head_stride * es_, d * es_, d * es_, n));
        }
        b.Convert(rows.get(), b.act_dtype(), f32.get(), DType::kF32, static_cast<int64_t>(n) * D);
        float* col = qkv.as<float>() + static_cast<int64_t>(hq + which * H) * d;
        PENUMBRA_RETURN_IF_ERROR(
            b.Copy2D(col, row * sizeof(float), f32.get(), D * sizeof(float), D * sizeof(float), n));
      }
      // The keys' RoPE undone: rotated at -position.
      RopeStoreOp un;
      un.qkv = qkv.as<float>();
      un.positions = pos.as<int32_t>() + R;
      un.inv_freq = ctx_.inv_freq;
      un.n = n;
      un.hq = hq;
      un.hkv = H;
      un.d = d;
      un.q_out = q.get();
      un.k_dst = static_cast<void* const*>(ptrs.get());
      un.v_dst = static_cast<void* const*>(ptrs.get()) + R;
      un.head_stride = d;
      b.RopeStore(un);
      b.Convert(unroped.get(), b.act_dtype(), f32.get(), DType::kF32, static_cast<int64_t>(n) * D);
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(qkv.as<float>() + static_cast<int64_t>(hq) * d, row * sizeof(float), f32.get(),
                                        D * sizeof(float), D * sizeof(float), n));
      PENUMBRA_RETURN_IF_ERROR(StoreTokens(qkv.as<float>(), pos.as<int32_t>(), n, start, q.get(), kbase, vbase, stride,
                                           s.sparse ? comp_.tmp_prek().as<float>() + start * D : nullptr));
      if (!s.sparse) s.local_count = std::max<int64_t>(s.local_count, start + n);
    }
    // The temporaries are read by the compression below (same stream); the
    // scratch is freed after the stream is done with it.
    PENUMBRA_RETURN_IF_ERROR(FinishPrefillLayer(layer, id, kv.tokens));
    return b.Synchronize();
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
        PENUMBRA_RETURN_IF_ERROR(StoreTokens(qkv.as<float>(), pos.as<int32_t>(), n, start, q.get(), comp_.tmp_k().get(),
                                             comp_.tmp_v().get(), comp_.tmp_cap() * d,
                                             comp_.tmp_prek().as<float>() + start * H * d));
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
    return s.att_k.bytes() + s.att_v.bytes() + s.a.bytes() + s.b.bytes() + s.p.bytes() + s.lm.bytes() + s.excl.bytes() +
           s.slots.bytes() + s.prek.bytes();
  }

  SequenceBytes EstimateSequenceBytes(const SequenceSpec& spec) const override { return lay_.Bytes(spec); }

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
  // Thread blocks of the value fetch that restores a whole layer's values
  // for a continuation prefill (no decode to share the SMs with).
  static constexpr int kRestoreFetchBlocks = 1024;

  // The store's memory of `layer` of s (pinned on CUDA: its values are
  // written or read from here on), allocated on first use; the next layer's is then allocated on a helper thread while
  // this one is computed (pinning a layer of a 124928-token sequence takes ~0.1 s, in which no kernel would be
  // launched).
  Status EnsureStoreLayer(Seq& s, int layer) {
    if (s.segment == 0) return Status::OK();
    if (s.store_host[static_cast<size_t>(layer)] == nullptr) {
      const bool pinned = pin_.done.valid() && pin_.segment == s.segment && pin_.layer == layer;
      Result<const void*> base = pinned ? pin_.done.get() : store_.AllocateLayer(s.segment, layer);
      PENUMBRA_RETURN_IF_ERROR(base.status());
      s.store_host[static_cast<size_t>(layer)] = *base;
      s.store_dev[static_cast<size_t>(layer)] = ctx_.backend->DeviceAddressOfHost(*base);
    }
    const int next = layer + 1;
    if (next < ctx_.num_layers && s.store_host[static_cast<size_t>(next)] == nullptr) {
      if (pin_.done.valid() && pin_.segment == s.segment && pin_.layer == next) return Status::OK();  // under way
      if (pin_.done.valid()) (void)pin_.done.get();  // another's: the segment keeps it (AllocateLayer is idempotent)
      Backend* b = ctx_.backend;
      storage::DramValueStore* store = &store_;
      const storage::SegmentId segment = s.segment;
      pin_.segment = segment;
      pin_.layer = next;
      pin_.done = std::async(std::launch::async, [b, store, segment, next]() -> Result<const void*> {
        PENUMBRA_RETURN_IF_ERROR(b->BindThread());
        return store->AllocateLayer(segment, next);
      });
    }
    return Status::OK();
  }
  Seq& Get(int64_t id) {
    auto it = seqs_.find(id);
    CHECK(it != seqs_.end()) << "unknown sequence " << id;
    return it->second;
  }
  // Geometry (ShadowKvLayout).
  int64_t AttLayer(const Seq& s) const { return lay_.AttLayer(s); }
  int64_t LmHead(const Seq& s) const { return lay_.LmHead(s); }
  int64_t LocalRow0(const Seq& s) const { return lay_.LocalRow0(s); }
  void* Row(const DeviceBuffer& buf, const Seq& s, int layer, int64_t row) const {
    return lay_.Row(buf, s, layer, row);
  }
  void* ALayer(const Seq& s, int layer) const { return lay_.ALayer(s, layer); }
  void* LmLayer(const Seq& s, int layer) const { return lay_.LmLayer(s, layer); }
  void* LmChunk(const Seq& s, int layer, int chunk) const { return lay_.LmChunk(s, layer, chunk); }
  void* Row2(const DeviceBuffer& buf, int layer, int64_t per_layer) const { return lay_.Row2(buf, layer, per_layer); }

  Status Upload(DeviceBuffer* dst, const void* src, size_t bytes) {
    return ShadowKvUpload(*ctx_.backend, dst, src, bytes);
  }

  Status StoreTokens(const float* qkv, const int32_t* positions, int n, int64_t start, void* q_out, void* kbase,
                     void* vbase, int64_t stride, float* pre_rope) {
    return comp_.StoreTokens(qkv, positions, n, start, q_out, kbase, vbase, stride, pre_rope);
  }
  Status EnsureTemp(int64_t tokens) { return comp_.EnsureTemp(tokens); }
  void ReleaseTempIfLarge() { comp_.ReleaseTempIfLarge(); }
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
  ShadowKvLayout lay_;  // geometry: reads ctx_ and o_
  size_t es_;
  BackendHostAllocator host_alloc_;
  storage::DramValueStore store_;
  std::map<int64_t, Seq> seqs_;
  // Algorithm 1 and the prefill temporaries (one layer of one prompt); its
  // puts in flight end when it does (before store_, declared earlier).
  ShadowKvCompressor comp_;
  // EnsureStoreLayer's allocation of the next layer, on a helper thread
  // (ends, when destroyed, before store_).
  struct Pin {
    storage::SegmentId segment = 0;
    int layer = -1;
    std::future<Result<const void*>> done;
  };
  Pin pin_;
  // Document capture, import and attach.
  ShadowKvPrefixIo prefix_io_;
  DeviceBuffer mincos_scratch_, shift_, stage_off_;
  DeviceBuffer iota_lists_, rebuild_ptrs_;  // continuation rebuilds: IotaLists(iota_k_); pointer table
  int iota_k_ = -1;
  // sparse continuations: score tables, the best score per chunk, the selection
  DeviceBuffer cont_tab_, cont_max_, cont_sel_;
  std::vector<int32_t> cont_sel_host_;
  DeviceBuffer stage_, stage_v_;
  // The decode step under way: its sequences, tables, selection arguments
  // and workspaces; with a context-parallel group's global selection
  // (xgroup_ set: this step's sequences are its shards), the exchange.
  ShadowKvDecodeStep step_;
  ShadowKvShardExchange exchange_;
  Collective* xgroup_ = nullptr;
  std::vector<DecodeAttentionOp> pending_attention_;  // DecodeAttention's, with micro-batches
  std::vector<const void*> group_q_;
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
