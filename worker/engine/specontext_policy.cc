// The SpeContext KV policy: see specontext_policy.h.
//
// Per sequence (capacity cap = prompt + new tokens; dtype T = act dtype):
//   head_k    [hkv][cap][dh] T   the retrieval head's K cache (RoPE applied)
//   k[l], v[l] [hkv][cap][d] T   layer l's exact keys (RoPE) and values:
//                                device memory for l < device_layers, pinned
//                                host memory (mapped) for the rest
//   att_k, att_v [layers][hkv][R][d] T, R = budget + local: rows [0, budget)
//                                the selection's slots, rows budget + p % local
//                                the local window's ring (position p)
//   slots     [hkv][budget] int32 token per slot (-1: empty), shared by the
//                                layers (the selection is the same for all)
// At a decode step with the new token at position p, tokens [0, p + 1 -
// local) are selectable and [p + 1 - local, p] are in the ring (row budget +
// p % local); a token leaves the ring as it becomes selectable, so no row is
// attended twice.
//
// A context-parallel shard (ShardSpec) holds positions [pos0, pos0 + its
// tokens): its rows, lengths and selection count from pos0 (token indices
// are local), RoPE, YaRN and the ring use the whole sequence's positions. A
// closed shard's tokens are all selectable and it attends to no ring (the
// last shard holds at least `local` tokens, so the window is its); a decode
// step writes the new token into a closed shard's spare row (capacity =
// its tokens + 1), never read. The shards agree on one top-k per step (the
// retrieval head's scores normalized over the whole sequence: ShadowKV's
// two exchanges, worker/engine/shadowkv/shard_exchange.h).
#include "worker/engine/specontext_policy.h"

#include <glog/logging.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <tuple>

#include "kernels/shadowkv_decode_args.h"
#include "worker/engine/collective.h"
#include "worker/engine/shadowkv/shard_exchange.h"
#include "worker/engine/specontext_prefix.h"

namespace penumbra {
namespace {

namespace kn = kernels;

class SpeContextPolicy final : public KvPolicy {
 public:
  SpeContextPolicy(const PolicyContext& ctx, const SpeContextOptions& o, std::shared_ptr<SpeContextHead> head)
      : ctx_(ctx),
        o_(o),
        head_(std::move(head)),
        es_(DTypeSize(ctx.backend->act_dtype())),
        exchange_(ctx_, *ctx_.backend) {}

  std::string name() const override { return "specontext"; }
  // A document's state is its exact keys and values and the head's keys:
  // the head and its position scaling name it, not the selection's options.
  std::string StateFingerprint() const override {
    std::ostringstream os;
    os << "specontext head=" << head_->identity() << " yarn=" << o_.yarn_factor;
    return os.str();
  }

  Status AddSequence(int64_t seq, const SequenceSpec& spec) override {
    if (seqs_.count(seq)) return Status::InvalidArgument("sequence " + std::to_string(seq) + " already exists");
    const ShardSpec& shard = spec.shard;
    if (spec.prompt_len < 1 || spec.max_new_tokens < 0) {
      return Status::InvalidArgument("specontext: a sequence of " + std::to_string(spec.prompt_len) + " + " +
                                     std::to_string(spec.max_new_tokens) + " tokens");
    }
    const SpeContextPrefix* p = nullptr;
    if (spec.prefix && !shard.sharded()) {
      PENUMBRA_ASSIGN_OR_RETURN(p, AttachedPrefix<SpeContextPrefix>(spec, "specontext"));
    } else if (spec.prefix) {
      // A shard attaches a capture of exactly its own tokens.
      p = dynamic_cast<const SpeContextPrefix*>(spec.prefix.get());
      if (p == nullptr || p->tokens() != spec.prompt_len) {
        return Status::InvalidArgument("a " + spec.prefix->policy() + " prefix of " +
                                       std::to_string(spec.prefix->tokens()) + " tokens cannot attach to a " +
                                       std::to_string(spec.prompt_len) + "-token specontext shard");
      }
    }
    if (p != nullptr && p->pos0_ != shard.position_base) {
      return Status::InvalidArgument("specontext: a document shard from position " + std::to_string(p->pos0_) +
                                     " attached at position " + std::to_string(shard.position_base));
    }
    if (shard.sharded()) {
      if (o_.observe > 0) {
        return Status::Unimplemented(
            "specontext.observe > 0 under context parallel (the observation window is the prompt's last queries)");
      }
      if (!shard.closed && spec.prompt_len < o_.local) {
        return Status::InvalidArgument("specontext: the last shard holds " + std::to_string(spec.prompt_len) +
                                       " tokens, fewer than the local window (" + std::to_string(o_.local) + ")");
      }
    }
    auto s = std::make_unique<Seq>();
    s->pos0 = shard.position_base;
    s->closed = shard.closed;
    s->group = shard.group;
    s->capacity = spec.prompt_len + std::max<int64_t>(spec.max_new_tokens, 1);
    if (s->capacity > MaxTokens()) {
      return Status::InvalidArgument("specontext: a sequence of " + std::to_string(s->capacity) + " tokens; at most " +
                                     std::to_string(MaxTokens()) + " with a budget of " + std::to_string(o_.budget) +
                                     " (the slot update's bitmap of every token)");
    }
    Backend& b = *ctx_.backend;
    if (p != nullptr) {
      s->base = s->length = p->tokens();
      s->prefix = std::static_pointer_cast<const SpeContextPrefix>(spec.prefix);
      s->factor = p->factor_;  // the document's keys were made at its factor
    } else if (shard.sharded() && shard.sequence_tokens > 0) {
      // Every rank scales by the whole sequence's capacity.
      s->factor = head_->Factor(shard.sequence_tokens + std::max<int64_t>(shard.sequence_new_tokens, 1));
    } else {
      s->factor = head_->Factor(s->capacity);
    }
    const int64_t own = s->own();
    const size_t fixed = FixedBytes(s->capacity, own), layer = LayerBytes(own);
    s->device_layers = o_.device_layers >= 0 ? std::min(o_.device_layers, ctx_.num_layers) : MemoryModel(fixed, layer);
    PENUMBRA_ASSIGN_OR_RETURN(s->head_k, b.Allocate(HeadKBytes(own)));
    PENUMBRA_ASSIGN_OR_RETURN(s->att_k, b.Allocate(AttBytes()));
    PENUMBRA_ASSIGN_OR_RETURN(s->att_v, b.Allocate(AttBytes()));
    PENUMBRA_ASSIGN_OR_RETURN(s->slots, b.Allocate(SlotBytes()));
    PENUMBRA_RETURN_IF_ERROR(b.Memset(s->slots.get(), 0xFF, SlotBytes()));
    if (o_.observe > 0) {
      PENUMBRA_ASSIGN_OR_RETURN(s->obs, b.Allocate(ObsBytes(s->capacity)));
      PENUMBRA_RETURN_IF_ERROR(b.Memset(s->obs.get(), 0, ObsBytes(s->capacity)));  // 0.0f: no floor
    }
    s->k.resize(ctx_.num_layers);
    s->v.resize(ctx_.num_layers);
    s->k_at.resize(ctx_.num_layers);
    s->v_at.resize(ctx_.num_layers);
    for (int l = 0; l < ctx_.num_layers; ++l) {
      const bool device = l < s->device_layers;
      for (auto [buf, at] : {std::pair{&s->k[l], &s->k_at[l]}, std::pair{&s->v[l], &s->v_at[l]}}) {
        PENUMBRA_ASSIGN_OR_RETURN(*buf, device ? b.Allocate(layer / 2) : b.AllocateHostLarge(layer / 2));
        *at = device ? buf->get() : const_cast<void*>(b.DeviceAddressOfHost(buf->get()));
      }
    }
    // An attached document's last `local` tokens fill the ring.
    for (int l = 0; p != nullptr && l < ctx_.num_layers; ++l) {
      PENUMBRA_RETURN_IF_ERROR(FillRing(*s, l, p->k_[l].get(), p->v_[l].get(), p->stride_, p->tokens()));
    }
    seqs_.emplace(seq, std::move(s));
    return Status::OK();
  }

  void RemoveSequence(int64_t seq) override {
    if (scratch_seq_ == seq) scratch_seq_ = -1;
    seqs_.erase(seq);
  }

  // ---- prefill: exact attention, one layer at a time in a device scratch ----

  Status PrefillTokens(int64_t seq, const int32_t* ids, const int32_t* positions, int n, int64_t global) override {
    Seq* s = Find(seq);
    if (s == nullptr) return Status::NotFound("specontext: no sequence " + std::to_string(seq));
    const int64_t start = global - s->pos0;  // rows count from the shard's first position
    if (start != s->length || start + n > s->capacity) {
      return Status::InvalidArgument("specontext: a prefill of [" + std::to_string(start) + ", " +
                                     std::to_string(start + n) + ") of a sequence holding " +
                                     std::to_string(s->length) + " of " + std::to_string(s->capacity));
    }
    // The head's keys of the run, kMaxRows tokens a call.
    for (int off = 0; off < n; off += SpeContextHead::kMaxRows) {
      const int m = std::min(n - off, SpeContextHead::kMaxRows);
      std::vector<void*> dst(m);
      for (int i = 0; i < m; ++i) dst[i] = HeadKRow(*s, start + off + i);
      PENUMBRA_ASSIGN_OR_RETURN(void* const* table, Upload(&ptr_buf_, &ptr_staging_, dst));
      PENUMBRA_RETURN_IF_ERROR(
          head_->Project(ids + off, positions + off, m, s->factor, nullptr, table, s->own() * head_->head_dim()));
    }
    if (o_.observe > 0) return ScoreObservation(*s, ids, positions, n, start);
    return Status::OK();
  }

  // lse: each row's log-sum-exp over the shard's own keys (context
  // parallel: the runtime merges the earlier shards' keys in).
  Status PrefillAttention(int layer, int64_t seq, const float* qkv, int n, int64_t global, const int32_t* positions,
                          void* q_scratch, void* out, float* lse) override {
    Seq* s = Find(seq);
    if (s == nullptr) return Status::NotFound("specontext: no sequence " + std::to_string(seq));
    const int64_t start = global - s->pos0;
    if (start < s->length || start + n > s->capacity) {
      return Status::InvalidArgument("specontext: prefill rows [" + std::to_string(start) + ", " +
                                     std::to_string(start + n) + ") of a sequence holding " +
                                     std::to_string(s->length));
    }
    PENUMBRA_RETURN_IF_ERROR(LoadScratch(*s, seq, layer, start));
    const int d = ctx_.head_dim;
    std::vector<void*> dst(2 * static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      dst[i] = ScratchRow(scratch_k_, start + i);
      dst[n + i] = ScratchRow(scratch_v_, start + i);
    }
    PENUMBRA_ASSIGN_OR_RETURN(void* const* table, Upload(&ptr_buf_, &ptr_staging_, dst));
    RopeStoreOp r;
    r.qkv = qkv;
    r.positions = positions;
    r.inv_freq = ctx_.inv_freq;
    r.n = n;
    r.hq = ctx_.hq;
    r.hkv = ctx_.hkv;
    r.d = d;
    r.q_out = q_scratch;
    r.k_dst = table;
    r.v_dst = table + n;
    r.head_stride = scratch_rows_ * d;
    ctx_.backend->RopeStore(r);
    PrefillAttentionOp a;
    a.q = q_scratch;
    a.k = scratch_k_.get();
    a.v = scratch_v_.get();
    a.out = out;
    a.head_stride = scratch_rows_ * d;
    a.q_start = static_cast<int>(start);
    a.nq = n;
    a.hq = ctx_.hq;
    a.hkv = ctx_.hkv;
    a.d = d;
    a.scale = ctx_.scale;
    a.lse = lse;
    ctx_.backend->PrefillAttention(a);
    scratch_end_ = std::max(scratch_end_, start + n);
    return Status::OK();
  }

  Status FinishPrefillLayer(int layer, int64_t seq, int64_t prompt_end) override {
    Seq* s = Find(seq);
    if (s == nullptr) return Status::NotFound("specontext: no sequence " + std::to_string(seq));
    const int64_t prompt_len = prompt_end - s->pos0;  // the shard's own tokens
    if (scratch_seq_ != seq || scratch_layer_ != layer || scratch_end_ != prompt_len) {
      return Status::Internal("specontext: layer " + std::to_string(layer) + " of sequence " + std::to_string(seq) +
                              " finished without its prefill");
    }
    Backend& b = *ctx_.backend;
    const size_t row = static_cast<size_t>(ctx_.head_dim) * es_;
    // The run's rows to the layer's store.
    const int64_t from = scratch_from_, rows = prompt_len - from;
    if (from < s->base) return Status::Internal("specontext: a prefill inside the attached document");
    if (rows > 0) {
      for (auto [dst, src] : {std::pair{&s->k[layer], &scratch_k_}, std::pair{&s->v[layer], &scratch_v_}}) {
        PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(dst->get()) + (from - s->base) * row, s->own() * row,
                                          static_cast<const char*>(src->get()) + from * row, scratch_rows_ * row,
                                          rows * row, ctx_.hkv));
      }
    }
    PENUMBRA_RETURN_IF_ERROR(FillRing(*s, layer, scratch_k_.get(), scratch_v_.get(), scratch_rows_, prompt_len));
    if (layer == ctx_.num_layers - 1) s->length = prompt_len;
    return Status::OK();
  }

  // ---- decode ----

  Status BeginDecodeStep(const std::vector<int64_t>& seqs, const std::vector<int64_t>& positions) override {
    step_.clear();
    step_pos_ = positions;
    if (seqs.size() != positions.size()) return Status::InvalidArgument("specontext: positions of another batch");
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq* s = Find(seqs[i]);
      if (s == nullptr) return Status::NotFound("specontext: no sequence " + std::to_string(seqs[i]));
      // A closed shard's new token is past its end (it stores nothing); the
      // last shard's (or a whole sequence's) is the next of its own.
      const int64_t local = positions[i] - s->pos0;
      const bool fits = s->closed ? local >= s->length : local == s->length && local < s->capacity;
      if (!fits) {
        return Status::InvalidArgument("specontext: sequence " + std::to_string(seqs[i]) + " decodes at " +
                                       std::to_string(positions[i]) + " holding " + std::to_string(s->length) + " of " +
                                       std::to_string(s->capacity) + " from position " + std::to_string(s->pos0));
      }
      step_.push_back(s);
    }
    exchange_group_ = step_.empty() ? nullptr : step_[0]->group;
    for (const Seq* s : step_) {
      if (s->group != exchange_group_) {
        return Status::Internal(
            "specontext: a decode step mixes shards of a context-parallel group with other sequences");
      }
    }
    // Groups: runs of sequences of one capacity, attached document length
    // and stride (their rows' strides) and shard kind.
    groups_.clear();
    const int B = static_cast<int>(step_.size());
    for (int i = 0; i < B;) {
      int j = i + 1;
      while (j < B && step_[j]->capacity == step_[i]->capacity && step_[j]->base == step_[i]->base &&
             step_[j]->shared_stride() == step_[i]->shared_stride() && step_[j]->closed == step_[i]->closed) {
        ++j;
      }
      groups_.push_back({i, j - i});
      i = j;
    }
    return UploadStepTables();
  }

  Status DecodeTokens(const int32_t* ids, const int32_t* positions) override {
    const int B = static_cast<int>(step_.size()), dh = head_->head_dim();
    if (B == 0) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(GrowStepBuffers(B));
    const size_t q_row = static_cast<size_t>(head_->heads()) * dh * es_;
    // The head: this step's query rows, and its key rows into the head's
    // cache (a closed shard's spare row).
    for (const Group& g : groups_) {
      const Seq& s0 = *step_[g.first];
      PENUMBRA_RETURN_IF_ERROR(head_->Project(ids + g.first, positions + g.first, g.count, s0.factor,
                                              static_cast<char*>(head_q_.get()) + g.first * q_row,
                                              Table(kHeadKDst) + g.first, s0.own() * dh));
    }
    if (exchange_group_ != nullptr) {
      PENUMBRA_RETURN_IF_ERROR(SelectAcrossShards());
    } else {
      for (const Group& g : groups_) PENUMBRA_RETURN_IF_ERROR(SelectGroup(g));
    }
    // The first layers' copies start now, on the side stream.
    for (int l = 0; l < std::min(ctx_.num_layers, Backend::kSideMarks); ++l) Prefetch(l);
    return Status::OK();
  }

  Status DecodeAttention(int layer, const float* qkv, const int32_t* positions, void* q_scratch, void* out,
                         float* lse) override {
    Backend& b = *ctx_.backend;
    const int d = ctx_.head_dim;
    const size_t qkv_row = static_cast<size_t>(ctx_.hq + 2 * ctx_.hkv) * d;
    const size_t q_row = static_cast<size_t>(ctx_.hq) * d * es_;
    for (const Group& g : groups_) {
      // The new token's key and value: into the layer's store and its ring row.
      for (int ring = 0; ring < 2; ++ring) {
        RopeStoreOp r;
        r.qkv = qkv + g.first * qkv_row;
        r.positions = positions + g.first;
        r.inv_freq = ctx_.inv_freq;
        r.n = g.count;
        r.hq = ctx_.hq;
        r.hkv = ctx_.hkv;
        r.d = d;
        r.q_out = static_cast<char*>(q_scratch) + g.first * q_row;
        r.k_dst = Table(ring ? kRingK : kStoreKDst, layer) + g.first;
        r.v_dst = Table(ring ? kRingV : kStoreVDst, layer) + g.first;
        r.head_stride = ring ? Rows() * d : step_[g.first]->own() * d;
        b.RopeStore(r);
      }
    }
    // The selected rows of this layer are in place once its copies are; the
    // copies of the layer kSideMarks ahead start (they take its mark).
    b.WaitSideMark(layer % Backend::kSideMarks);
    if (layer + Backend::kSideMarks < ctx_.num_layers) Prefetch(layer + Backend::kSideMarks);
    for (const Group& g : groups_) {
      DecodeAttentionOp a;
      a.q = static_cast<char*>(q_scratch) + g.first * q_row;
      a.k = reinterpret_cast<const void* const*>(Table(kAttK, layer) + g.first);
      a.v = reinterpret_cast<const void* const*>(Table(kAttV, layer) + g.first);
      a.lengths = Ints(kLength) + g.first;
      a.out = static_cast<char*>(out) + g.first * q_row;
      a.head_stride = Rows() * d;
      a.batch = g.count;
      a.hq = ctx_.hq;
      a.hkv = ctx_.hkv;
      a.d = d;
      a.max_length = static_cast<int>(Rows());
      a.scale = ctx_.scale;
      a.slot_maps = reinterpret_cast<const int32_t* const*>(Table(kSlots) + g.first);
      a.slot_row0 = 0;
      a.slot_count = o_.budget;
      a.slot_rows = 1;
      // Context parallel: the shard's part, merged by the runtime (-inf for
      // a shard that won nothing and attends to no ring).
      a.lse = lse != nullptr ? lse + static_cast<size_t>(g.first) * ctx_.hq : nullptr;
      PENUMBRA_RETURN_IF_ERROR(b.DecodeAttention(a));
    }
    return Status::OK();
  }

  Status FinishDecodeStep() override {
    const int B = static_cast<int>(step_.size()), H = ctx_.hkv, K = o_.budget;
    std::vector<int32_t> misses(static_cast<size_t>(B) * H), won;
    if (B > 0) {
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToHost(misses.data(), miss_count_.get(), misses.size() * 4));
    }
    if (B > 0 && exchange_group_ != nullptr) {  // a shard's selection: its winners
      won.resize(static_cast<size_t>(B) * H * K);
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToHost(won.data(), selection_.get(), won.size() * 4));
    }
    for (int i = 0; i < B; ++i) {
      for (int h = 0; h < H; ++h) {
        const size_t row = static_cast<size_t>(i) * H + h;
        const int64_t selected = won.empty() ? std::min<int64_t>(Selectable(i), K)
                                             : std::count_if(won.begin() + row * K, won.begin() + (row + 1) * K,
                                                             [](int32_t t) { return t >= 0; });
        stats_.selected_chunks += selected;
        stats_.hit_chunks += std::max<int64_t>(0, selected - misses[row]);
      }
      if (!step_[i]->closed) step_[i]->length = Local(i) + 1;
    }
    ++stats_.decode_steps;
    step_.clear();
    return Status::OK();
  }

  Status SynthesizeContext(int64_t seq, int64_t length, uint64_t seed) override {
    Seq* s = Find(seq);
    if (s == nullptr) return Status::NotFound("specontext: no sequence " + std::to_string(seq));
    if (s->length != 0 || s->base != 0 || length < 1 || length >= s->capacity) {
      return Status::InvalidArgument("specontext: a context of " + std::to_string(length) + " tokens");
    }
    Backend& b = *ctx_.backend;
    const DType t = b.act_dtype();
    const int64_t layer_elems = static_cast<int64_t>(ctx_.hkv) * s->capacity * ctx_.head_dim;
    b.FillRandomNormal(s->head_k.get(), t, HeadKBytes(s->capacity) / es_, 1.0f, seed);
    b.FillRandomNormal(s->att_k.get(), t, AttBytes() / es_, 1.0f, seed + 1);
    b.FillRandomNormal(s->att_v.get(), t, AttBytes() / es_, 1.0f, seed + 2);
    // Host layers are copies of one random device layer (a kernel writing
    // host memory would cross the link at a fraction of a copy's speed).
    PENUMBRA_RETURN_IF_ERROR(GrowScratch(s->capacity));
    scratch_seq_ = -1;
    b.FillRandomNormal(scratch_k_.get(), t, layer_elems, 1.0f, seed + 3);
    b.FillRandomNormal(scratch_v_.get(), t, layer_elems, 1.0f, seed + 4);
    for (int l = 0; l < ctx_.num_layers; ++l) {
      if (l < s->device_layers) {
        b.FillRandomNormal(s->k[l].get(), t, layer_elems, 1.0f, seed + 5 + 2 * l);
        b.FillRandomNormal(s->v[l].get(), t, layer_elems, 1.0f, seed + 6 + 2 * l);
      } else {
        PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
        PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(s->k[l].get(), scratch_k_.get(), layer_elems * es_));
        PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(s->v[l].get(), scratch_v_.get(), layer_elems * es_));
      }
    }
    s->length = length;
    return b.Synchronize();
  }

  // ---- documents ----

  // A copy of the first `tokens` tokens (any prefix of what the sequence
  // holds: its keys and values are exact): layers in pinned host memory, the
  // head's keys on the device.
  Result<std::shared_ptr<const KvPrefix>> CapturePrefix(int64_t seq, int64_t tokens) override {
    Seq* s = Find(seq);
    if (s == nullptr) return Status::NotFound("specontext: no sequence " + std::to_string(seq));
    if (tokens < 1 || tokens > s->length) {
      return Status::InvalidArgument("prefix of " + std::to_string(tokens) + " tokens: sequence " +
                                     std::to_string(seq) + " holds " + std::to_string(s->length));
    }
    Backend& b = *ctx_.backend;
    auto p = std::make_shared<SpeContextPrefix>(&b, Geometry(), tokens, tokens, s->factor, s->pos0);
    const size_t row = static_cast<size_t>(ctx_.head_dim) * es_, hrow = static_cast<size_t>(head_->head_dim()) * es_;
    // Rows [0, shared) from the attached document, [shared, tokens) the
    // sequence's own.
    const int64_t shared = std::min(tokens, s->base), own = tokens - shared;
    const SpeContextPrefix* d = s->prefix.get();
    PENUMBRA_ASSIGN_OR_RETURN(p->head_k_, b.Allocate(HeadKBytes(tokens)));
    if (shared > 0) {
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(p->head_k_.get(), tokens * hrow, d->head_k_.get(), d->tokens_ * hrow,
                                        shared * hrow, head_->kv_heads()));
    }
    if (own > 0) {
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(p->head_k_.get()) + shared * hrow, tokens * hrow,
                                        s->head_k.get(), s->own() * hrow, own * hrow, head_->kv_heads()));
    }
    for (int l = 0; l < ctx_.num_layers; ++l) {
      for (int which = 0; which < 2; ++which) {
        DeviceBuffer& dst = which ? p->v_[l] : p->k_[l];
        PENUMBRA_ASSIGN_OR_RETURN(dst, b.AllocateHostLarge(LayerBytes(tokens) / 2));
        (which ? p->v_at_[l] : p->k_at_[l]) = const_cast<void*>(b.DeviceAddressOfHost(dst.get()));
        if (shared > 0) {
          const DeviceBuffer& src = which ? d->v_[l] : d->k_[l];
          PENUMBRA_RETURN_IF_ERROR(
              b.Copy2D(dst.get(), tokens * row, src.get(), d->stride_ * row, shared * row, ctx_.hkv));
        }
        if (own > 0) {
          const DeviceBuffer& src = which ? s->v[l] : s->k[l];
          PENUMBRA_RETURN_IF_ERROR(b.Copy2D(static_cast<char*>(dst.get()) + shared * row, tokens * row, src.get(),
                                            s->own() * row, own * row, ctx_.hkv));
        }
      }
    }
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    return std::shared_ptr<const KvPrefix>(std::move(p));
  }
  // A document's put: the sequence's buffers become the document's (rows
  // past its tokens unused), which leaves the sequence to be removed.
  Result<std::shared_ptr<const KvPrefix>> TakePrefix(int64_t seq, int64_t tokens) override {
    Seq* s = Find(seq);
    if (s == nullptr || s->base > 0 || tokens != s->length) return CapturePrefix(seq, tokens);
    Backend& b = *ctx_.backend;
    auto p = std::make_shared<SpeContextPrefix>(&b, Geometry(), tokens, s->capacity, s->factor, s->pos0);
    // The head's keys compacted to `tokens` rows a head (a tenth of a layer's
    // bytes or less), the layers' buffers moved as they are.
    const size_t hrow = static_cast<size_t>(head_->head_dim()) * es_;
    PENUMBRA_ASSIGN_OR_RETURN(p->head_k_, b.Allocate(HeadKBytes(tokens)));
    PENUMBRA_RETURN_IF_ERROR(
        b.Copy2D(p->head_k_.get(), tokens * hrow, s->head_k.get(), s->own() * hrow, tokens * hrow, head_->kv_heads()));
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    for (int l = 0; l < ctx_.num_layers; ++l) {
      p->k_[l] = std::move(s->k[l]);
      p->v_[l] = std::move(s->v[l]);
      p->k_at_[l] = s->k_at[l];
      p->v_at_[l] = s->v_at[l];
      p->on_device_[l] = l < s->device_layers;
    }
    s->taken = true;
    if (scratch_seq_ == seq) scratch_seq_ = -1;
    return std::shared_ptr<const KvPrefix>(std::move(p));
  }
  Result<std::shared_ptr<const KvPrefix>> ImportPrefix(const std::map<std::string, std::string>& blobs) override {
    auto meta = blobs.find("meta");
    if (meta == blobs.end()) return Status::InvalidArgument("specontext document: no 'meta' blob");
    PENUMBRA_ASSIGN_OR_RETURN(const SpeContextPrefix::MetaFields f,
                              SpeContextPrefix::ParseMeta(Geometry(), meta->second));
    Backend& b = *ctx_.backend;
    const int64_t tokens = f.tokens;
    auto p = std::make_shared<SpeContextPrefix>(&b, Geometry(), tokens, tokens, f.factor, f.base);
    auto blob = [&](const std::string& name, size_t bytes) -> Result<const std::string*> {
      auto it = blobs.find(name);
      if (it == blobs.end()) return Status::InvalidArgument("specontext document: no '" + name + "' blob");
      if (it->second.size() != bytes) {
        return Status::Corruption("specontext document: blob '" + name + "' has " + std::to_string(it->second.size()) +
                                  " bytes, expected " + std::to_string(bytes));
      }
      return &it->second;
    };
    PENUMBRA_ASSIGN_OR_RETURN(const std::string* hk, blob("head_k", HeadKBytes(tokens)));
    PENUMBRA_ASSIGN_OR_RETURN(p->head_k_, b.Allocate(hk->size()));
    PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(p->head_k_.get(), hk->data(), hk->size()));
    for (int l = 0; l < ctx_.num_layers; ++l) {
      for (auto [name, dst, at] :
           {std::tuple{"k.", &p->k_[l], &p->k_at_[l]}, std::tuple{"v.", &p->v_[l], &p->v_at_[l]}}) {
        PENUMBRA_ASSIGN_OR_RETURN(const std::string* x, blob(name + std::to_string(l), LayerBytes(tokens) / 2));
        PENUMBRA_ASSIGN_OR_RETURN(*dst, b.AllocateHostLarge(x->size()));
        std::memcpy(dst->get(), x->data(), x->size());
        *at = const_cast<void*>(b.DeviceAddressOfHost(dst->get()));
      }
    }
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());  // the head's keys copied before the blobs go
    return std::shared_ptr<const KvPrefix>(std::move(p));
  }

  size_t DeviceBytes(int64_t seq) const override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return 0;
    const Seq& s = *it->second;
    return FixedBytes(s.capacity, s.own()) + static_cast<size_t>(s.device_layers) * LayerBytes(s.own());
  }
  SequenceBytes EstimateSequenceBytes(const SequenceSpec& spec) const override {
    const int64_t cap = spec.prompt_len + std::max<int64_t>(spec.max_new_tokens, 1);
    // The memory model moves layers to the device only where room is left:
    // the estimate is the offloaded form (or the configured split).
    const int dl = o_.device_layers >= 0 ? std::min(o_.device_layers, ctx_.num_layers) : 0;
    SequenceBytes out;
    out.device = FixedBytes(cap, cap) + static_cast<size_t>(dl) * LayerBytes(cap);
    out.host = static_cast<size_t>(ctx_.num_layers - dl) * LayerBytes(cap);
    return out;
  }
  Status SetForcedHitRate(double rate) override {
    forced_hit_rate_ = rate;
    return Status::OK();
  }

 private:
  struct Seq {
    // Rows [0, capacity) are positions pos0 + row; capacity and length count
    // rows (a whole sequence: pos0 = 0).
    int64_t capacity = 0, length = 0;
    // Context parallel (ShardSpec): the shard's first position, whether it is
    // closed (decode steps store nothing in it), its group (null: none, or
    // a shard made alone: it selects from its own tokens).
    int64_t pos0 = 0;
    bool closed = false;
    Collective* group = nullptr;
    // Tokens of the attached document (read in place; own buffers hold the
    // positions from base on: row p - base).
    int64_t base = 0;
    std::shared_ptr<const SpeContextPrefix> prefix;
    double factor = 1;  // the head's YaRN factor for this sequence
    int64_t own() const { return capacity - base; }
    int64_t shared_stride() const { return prefix ? prefix->stride_ : 0; }
    bool taken = false;  // its buffers became a document's (TakePrefix): only removal is left
    int device_layers = 0;
    // obs: [hkv][capacity] f32, the observation window's weights (the
    // floor of each step's scores) once has_obs.
    bool has_obs = false;
    DeviceBuffer head_k, att_k, att_v, slots, obs;
    std::vector<DeviceBuffer> k, v;
    std::vector<void*> k_at, v_at;  // the stores' device addresses
  };
  struct Group {
    int first = 0, count = 0;
  };
  // Step tables: per layer, then per step.
  enum LayerTable {
    kRingK,
    kRingV,
    kStoreKDst,
    kStoreVDst,
    kAttK,
    kAttV,
    kStoreK,
    kStoreV,
    kSharedK,
    kSharedV,
    kLayerTables
  };
  enum StepTable { kHeadKDst, kHeadK, kSharedHeadK, kSlots, kStepTables };
  enum StepInts { kSelectable, kLength, kStepInts };

  SpeContextPrefix::Geometry Geometry() const {
    SpeContextPrefix::Geometry g;
    g.layers = ctx_.num_layers;
    g.hkv = ctx_.hkv;
    g.d = ctx_.head_dim;
    g.head_hkv = head_->kv_heads();
    g.head_d = head_->head_dim();
    g.dtype = ctx_.backend->act_dtype();
    g.head = head_->identity();
    return g;
  }
  // Null for a sequence that does not exist or was taken (its buffers are
  // a document's: it is only removed).
  Seq* Find(int64_t seq) {
    auto it = seqs_.find(seq);
    return it == seqs_.end() || it->second->taken ? nullptr : it->second.get();
  }
  int64_t Rows() const { return static_cast<int64_t>(o_.budget) + o_.local; }
  // The longest sequence: the slot update keeps two bits per token and four
  // ints per slot of a KV head in a block's shared memory (227 KiB on
  // Hopper; kernels/shadowkv_slot_update.cuh), the CPU as the GPU.
  int64_t MaxTokens() const {
    constexpr int64_t kSharedWords = 227 * 1024 / 4;
    return std::max<int64_t>(0, (kSharedWords - 4 * static_cast<int64_t>(o_.budget)) / 2 * 32);
  }
  size_t HeadKBytes(int64_t rows) const {
    return static_cast<size_t>(head_->kv_heads()) * rows * head_->head_dim() * es_;
  }
  size_t AttBytes() const { return static_cast<size_t>(ctx_.num_layers) * ctx_.hkv * Rows() * ctx_.head_dim * es_; }
  size_t SlotBytes() const { return static_cast<size_t>(ctx_.hkv) * o_.budget * sizeof(int32_t); }
  size_t ObsBytes(int64_t cap) const {
    return o_.observe > 0 ? static_cast<size_t>(ctx_.hkv) * cap * sizeof(float) : 0;
  }
  size_t FixedBytes(int64_t cap, int64_t own) const {
    return HeadKBytes(own) + 2 * AttBytes() + SlotBytes() + ObsBytes(cap);
  }
  // K and V of one layer's `rows` rows.
  size_t LayerBytes(int64_t rows) const { return 2 * static_cast<size_t>(ctx_.hkv) * rows * ctx_.head_dim * es_; }
  // The paper's memory model, per sequence: as many layers on the device as
  // fit beside its fixed buffers while device_reserve_bytes stay free.
  int MemoryModel(size_t fixed, size_t layer) const {
    const size_t free = ctx_.backend->FreeMemoryBytes();
    const size_t keep = fixed + static_cast<size_t>(o_.device_reserve_bytes);
    if (free <= keep || layer == 0) return 0;
    return static_cast<int>(std::min<size_t>((free - keep) / layer, ctx_.num_layers));
  }
  // Step entry i's new token as a row of its sequence (a shard's rows count
  // from its first position).
  int64_t Local(int i) const { return step_pos_[i] - step_[i]->pos0; }
  // The row its new token is written to: a closed shard's spare row.
  int64_t WriteRow(int i) const { return step_[i]->closed ? step_[i]->length : Local(i); }
  // Its selectable tokens: [0, this): a closed shard's every token, else
  // those before the local window.
  int Selectable(int i) const {
    if (step_[i]->closed) return static_cast<int>(step_[i]->length);
    return static_cast<int>(std::max<int64_t>(0, Local(i) + 1 - o_.local));
  }
  // Rows its attention reads: the slots, then (not for a closed shard) the
  // ring's filled rows.
  int64_t AttendedRows(int i) const {
    if (step_[i]->closed) return o_.budget;
    return o_.budget + std::min<int64_t>(o_.local, Local(i) + 1);
  }
  void* HeadKRow(const Seq& s, int64_t p) const {
    return static_cast<char*>(s.head_k.get()) + (p - s.base) * head_->head_dim() * es_;
  }
  void* AttRow(const Seq& s, const DeviceBuffer& att, int layer, int64_t row) const {
    const size_t layer_elems = static_cast<size_t>(ctx_.hkv) * Rows() * ctx_.head_dim;
    return static_cast<char*>(att.get()) + (layer * layer_elems + row * ctx_.head_dim) * es_;
  }
  // Layer `layer`'s ring from the last `local` of the first `end` rows of
  // `k` and `v` ([hkv][stride] rows each): row p at ring row (pos0 + p) %
  // local, as decode steps write it.
  Status FillRing(const Seq& s, int layer, const void* k, const void* v, int64_t stride, int64_t end) {
    const size_t row = static_cast<size_t>(ctx_.head_dim) * es_;
    for (int64_t p = std::max<int64_t>(0, end - o_.local); p < end;) {
      const int64_t ring = (s.pos0 + p) % o_.local, run = std::min(end - p, o_.local - ring);
      for (auto [dst, src] : {std::pair{&s.att_k, k}, std::pair{&s.att_v, v}}) {
        PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(AttRow(s, *dst, layer, o_.budget + ring), Rows() * row,
                                                      static_cast<const char*>(src) + p * row, stride * row, run * row,
                                                      ctx_.hkv));
      }
      p += run;
    }
    return Status::OK();
  }
  void* ScratchRow(const DeviceBuffer& buf, int64_t p) const {
    return static_cast<char*>(buf.get()) + p * ctx_.head_dim * es_;
  }

  Status GrowScratch(int64_t rows) {
    if (rows <= scratch_rows_) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
    const size_t bytes = static_cast<size_t>(ctx_.hkv) * rows * ctx_.head_dim * es_;
    scratch_k_ = DeviceBuffer();
    scratch_v_ = DeviceBuffer();
    scratch_rows_ = 0;
    scratch_seq_ = -1;
    PENUMBRA_ASSIGN_OR_RETURN(scratch_k_, ctx_.backend->Allocate(bytes));
    PENUMBRA_ASSIGN_OR_RETURN(scratch_v_, ctx_.backend->Allocate(bytes));
    scratch_rows_ = rows;
    return Status::OK();
  }
  // Makes the scratch hold layer `layer` of `seq` up to `start` (its rows
  // before a continuation come from the store).
  Status LoadScratch(const Seq& s, int64_t seq, int layer, int64_t start) {
    if (scratch_seq_ == seq && scratch_layer_ == layer && scratch_end_ == start) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(GrowScratch(s.capacity));
    const size_t row = static_cast<size_t>(ctx_.head_dim) * es_;
    const int64_t shared = std::min(start, s.base);
    if (shared > 0) {  // the attached document's rows
      for (auto [dst, src] :
           {std::pair{&scratch_k_, &s.prefix->k_[layer]}, std::pair{&scratch_v_, &s.prefix->v_[layer]}}) {
        PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(dst->get(), scratch_rows_ * row, src->get(),
                                                      s.prefix->stride_ * row, shared * row, ctx_.hkv));
      }
    }
    if (start > s.base) {  // the sequence's own
      for (auto [dst, src] : {std::pair{&scratch_k_, &s.k[layer]}, std::pair{&scratch_v_, &s.v[layer]}}) {
        PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Copy2D(static_cast<char*>(dst->get()) + s.base * row,
                                                      scratch_rows_ * row, src->get(), s.own() * row,
                                                      (start - s.base) * row, ctx_.hkv));
      }
    }
    scratch_seq_ = seq;
    scratch_layer_ = layer;
    scratch_from_ = scratch_end_ = start;
    return Status::OK();
  }

  // Host `ptrs` into `buf` (grown; the previous users of the buffer are on
  // the same stream, before the copy).
  Result<void* const*> Upload(DeviceBuffer* buf, std::vector<void*>* staging, const std::vector<void*>& ptrs) {
    const size_t bytes = ptrs.size() * sizeof(void*);
    if (bytes > buf->bytes()) {
      PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(*buf, ctx_.backend->Allocate(bytes * 2));
    }
    *staging = ptrs;
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->CopyToDevice(buf->get(), staging->data(), bytes));
    return static_cast<void* const*>(buf->get());
  }

  // The step's pointer tables and ints, one upload.
  Status UploadStepTables() {
    const int B = static_cast<int>(step_.size()), L = ctx_.num_layers, d = ctx_.head_dim;
    const size_t row = static_cast<size_t>(d) * es_;
    std::vector<void*> t(static_cast<size_t>(B) * (kLayerTables * L + kStepTables) +
                         (static_cast<size_t>(B) * kStepInts * sizeof(int32_t) + sizeof(void*) - 1) / sizeof(void*));
    for (int i = 0; i < B; ++i) {
      Seq& s = *step_[i];
      const int64_t p = step_pos_[i], w = WriteRow(i);  // the ring by position, the stores by row
      for (int l = 0; l < L; ++l) {
        auto at = [&](int table) -> void*& { return t[(static_cast<size_t>(l) * kLayerTables + table) * B + i]; };
        at(kRingK) = AttRow(s, s.att_k, l, o_.budget + p % o_.local);
        at(kRingV) = AttRow(s, s.att_v, l, o_.budget + p % o_.local);
        at(kStoreKDst) = static_cast<char*>(s.k_at[l]) + (w - s.base) * row;
        at(kStoreVDst) = static_cast<char*>(s.v_at[l]) + (w - s.base) * row;
        at(kAttK) = AttRow(s, s.att_k, l, 0);
        at(kAttV) = AttRow(s, s.att_v, l, 0);
        at(kStoreK) = s.k_at[l];
        at(kStoreV) = s.v_at[l];
        at(kSharedK) = s.prefix ? s.prefix->k_at_[l] : nullptr;
        at(kSharedV) = s.prefix ? s.prefix->v_at_[l] : nullptr;
      }
      const size_t base = static_cast<size_t>(kLayerTables) * L * B;
      t[base + kHeadKDst * B + i] = HeadKRow(s, w);
      t[base + kHeadK * B + i] = s.head_k.get();
      t[base + kSharedHeadK * B + i] = s.prefix ? s.prefix->head_k_.get() : nullptr;
      t[base + kSlots * B + i] = s.slots.get();
    }
    auto* ints = reinterpret_cast<int32_t*>(t.data() + static_cast<size_t>(B) * (kLayerTables * L + kStepTables));
    for (int i = 0; i < B; ++i) {
      ints[kSelectable * B + i] = Selectable(i);
      ints[kLength * B + i] = static_cast<int32_t>(AttendedRows(i));
    }
    PENUMBRA_ASSIGN_OR_RETURN(step_table_, Upload(&step_buf_, &step_staging_, t));
    return Status::OK();
  }
  void* const* Table(LayerTable table, int layer) const {
    return step_table_ + (static_cast<size_t>(layer) * kLayerTables + table) * step_.size();
  }
  void* const* Table(StepTable table) const {
    return step_table_ + (static_cast<size_t>(kLayerTables) * ctx_.num_layers + table) * step_.size();
  }
  const int32_t* Ints(StepInts which) const {
    const size_t B = step_.size();
    return reinterpret_cast<const int32_t*>(step_table_ + B * (kLayerTables * ctx_.num_layers + kStepTables)) +
           which * B;
  }

  Status GrowStepBuffers(int B) {
    if (B <= step_cap_) return Status::OK();
    Backend& b = *ctx_.backend;
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    const size_t rows = static_cast<size_t>(B) * ctx_.hkv, K = o_.budget;
    PENUMBRA_ASSIGN_OR_RETURN(head_q_, b.Allocate(static_cast<size_t>(B) * head_->heads() * head_->head_dim() * es_));
    PENUMBRA_ASSIGN_OR_RETURN(selection_, b.Allocate(rows * K * sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(miss_count_, b.Allocate(rows * sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(miss_slot_, b.Allocate(rows * K * sizeof(int32_t)));
    PENUMBRA_ASSIGN_OR_RETURN(miss_token_, b.Allocate(rows * K * sizeof(int32_t)));
    step_cap_ = B;
    return Status::OK();
  }
  Status GrowScores(size_t floats) {
    if (floats * sizeof(float) <= scores_.bytes()) return Status::OK();
    PENUMBRA_RETURN_IF_ERROR(ctx_.backend->Synchronize());
    scores_ = DeviceBuffer();
    PENUMBRA_ASSIGN_OR_RETURN(scores_, ctx_.backend->Allocate(floats * sizeof(float)));
    return Status::OK();
  }

  // The head's attention weights of the run's last `observe` queries over
  // the sequence's tokens so far (softmax per query head, max over each
  // group, with successors; the max over the queries): the floor of later
  // steps' scores. kObsRows queries a scoring call.
  static constexpr int kObsRows = 8;
  Status ScoreObservation(Seq& s, const int32_t* ids, const int32_t* positions, int n, int64_t start) {
    Backend& b = *ctx_.backend;
    const int w = std::min(o_.observe, n), H = ctx_.hkv, dh = head_->head_dim();
    const int64_t end = start + n;
    const double factor = s.factor;
    const size_t q_row = static_cast<size_t>(head_->heads()) * dh * es_;
    if (obs_q_.bytes() < w * q_row) {
      PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(obs_q_, b.Allocate(w * q_row));
    }
    // Their queries (their key rows are written again, the same values).
    std::vector<void*> dst(w);
    for (int i = 0; i < w; ++i) dst[i] = HeadKRow(s, end - w + i);
    PENUMBRA_ASSIGN_OR_RETURN(void* const* table, Upload(&ptr_buf_, &ptr_staging_, dst));
    PENUMBRA_RETURN_IF_ERROR(
        head_->Project(ids + n - w, positions + n - w, w, factor, obs_q_.get(), table, s.own() * dh));
    // kObsRows entries naming this sequence's cache, as many naming its
    // document's, then their counts.
    const int rows = std::min(w, kObsRows);
    std::vector<void*> args(2 * rows + (rows + 1) / 2);
    for (int i = 0; i < rows; ++i) {
      args[i] = s.head_k.get();
      args[rows + i] = s.prefix ? s.prefix->head_k_.get() : nullptr;
    }
    auto* counts = reinterpret_cast<int32_t*>(args.data() + 2 * rows);
    for (int i = 0; i < rows; ++i) counts[i] = static_cast<int32_t>(end);
    PENUMBRA_ASSIGN_OR_RETURN(void* const* entries, Upload(&obs_args_, &obs_staging_, args));
    const int64_t stride = end + 1;
    PENUMBRA_RETURN_IF_ERROR(GrowScores(static_cast<size_t>(rows) * H * stride));
    for (int r0 = 0; r0 < w; r0 += rows) {
      const int m = std::min(rows, w - r0);
      kn::ShadowkvScoreArgs sc;
      sc.q = static_cast<char*>(obs_q_.get()) + r0 * q_row;
      sc.q_dtype = b.act_dtype();
      sc.landmarks = reinterpret_cast<const void* const*>(entries);
      sc.dtype = b.act_dtype();
      sc.shared_landmarks = reinterpret_cast<const void* const*>(entries + rows);
      sc.shared_chunks = static_cast<int>(s.base);
      sc.landmark_cap = static_cast<int>(s.own());
      sc.n_chunks = reinterpret_cast<const int32_t*>(entries + 2 * rows);
      sc.batch = m;
      sc.hq = head_->heads();
      sc.hkv = H;
      sc.d = dh;
      sc.chunk_cap = static_cast<int>(s.capacity);
      sc.max_chunks = static_cast<int>(end);
      sc.scale = head_->Scale(factor);
      sc.successors = o_.successors;
      sc.scores = scores_.as<float>();
      sc.score_stride = stride;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
      for (int h = 0; h < H; ++h) {
        kn::MaxRowsArgs mr;
        mr.in = scores_.as<float>() + static_cast<size_t>(h) * stride;
        mr.rows = m;
        mr.row_stride = H * stride;
        mr.cols = end;
        mr.out = s.obs.as<float>() + static_cast<size_t>(h) * s.capacity;
        mr.accumulate = r0 > 0;
        b.MaxRows(mr);
      }
    }
    s.has_obs = true;
    return Status::OK();
  }

  int MaxSelectable(const Group& g) const {
    int m = 0;
    for (int i = g.first; i < g.first + g.count; ++i) m = std::max(m, Selectable(i));
    return m;
  }
  // A group's scoring of the head's K cache (its selectable tokens), with
  // `max_sel` = MaxSelectable(g) > 0; the scores land in scores_ (grown).
  Result<kn::ShadowkvScoreArgs> ScoreArgsOf(const Group& g, int max_sel) {
    Backend& b = *ctx_.backend;
    const int B = static_cast<int>(step_.size()), H = ctx_.hkv, dh = head_->head_dim();
    const Seq& s0 = *step_[g.first];
    const size_t q_row = static_cast<size_t>(head_->heads()) * dh * es_;
    PENUMBRA_RETURN_IF_ERROR(GrowScores(static_cast<size_t>(B) * H * (max_sel + 1)));
    kn::ShadowkvScoreArgs sc;
    sc.q = static_cast<char*>(head_q_.get()) + g.first * q_row;
    sc.q_dtype = b.act_dtype();
    sc.landmarks = reinterpret_cast<const void* const*>(Table(kHeadK) + g.first);
    sc.dtype = b.act_dtype();
    sc.n_chunks = Ints(kSelectable) + g.first;
    sc.batch = g.count;
    sc.hq = head_->heads();
    sc.hkv = H;
    sc.d = dh;
    sc.chunk_cap = static_cast<int>(s0.capacity);
    sc.landmark_cap = static_cast<int>(s0.own());
    sc.shared_landmarks = reinterpret_cast<const void* const*>(Table(kSharedHeadK) + g.first);
    sc.shared_chunks = static_cast<int>(s0.base);
    sc.max_chunks = max_sel;
    sc.scale = head_->Scale(s0.factor);  // a group: one capacity, one document length
    sc.scores = scores_.as<float>();
    sc.score_stride = max_sel + 1;
    sc.successors = o_.successors;
    return sc;
  }
  // The slot update of a group from its selection ([count][hkv][budget]).
  kn::ShadowkvSlotUpdateArgs SlotUpdateOf(const Group& g, const int32_t* selection) const {
    const int H = ctx_.hkv, K = o_.budget;
    kn::ShadowkvSlotUpdateArgs su;
    su.selection = selection;
    su.selection_stride = K;
    su.slot_maps = reinterpret_cast<int32_t* const*>(Table(kSlots) + g.first);
    su.miss_count = miss_count_.as<int32_t>() + static_cast<size_t>(g.first) * H;
    su.miss_slot = miss_slot_.as<int32_t>() + static_cast<size_t>(g.first) * H * K;
    su.miss_chunk = miss_token_.as<int32_t>() + static_cast<size_t>(g.first) * H * K;
    su.batch = g.count;
    su.hkv = H;
    su.kslots = K;
    su.chunk_cap = static_cast<int>(step_[g.first]->capacity);
    su.force_keep = static_cast<float>(forced_hit_rate_);
    return su;
  }

  // A group's top `budget` tokens per KV head (floored by the observation
  // windows' weights where a sequence has them) and its slot update.
  Status SelectGroup(const Group& g) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, K = o_.budget;
    int32_t* selection = selection_.as<int32_t>() + static_cast<size_t>(g.first) * H * K;
    const int max_sel = MaxSelectable(g);
    bool floors = false;  // an observation window's weights to apply
    for (int i = g.first; i < g.first + g.count; ++i) floors = floors || step_[i]->has_obs;
    if (max_sel == 0) {
      PENUMBRA_RETURN_IF_ERROR(b.Memset(selection, 0xFF, static_cast<size_t>(g.count) * H * K * sizeof(int32_t)));
    } else {
      PENUMBRA_ASSIGN_OR_RETURN(kn::ShadowkvScoreArgs sc, ScoreArgsOf(g, max_sel));
      sc.selection = selection;
      sc.selection_stride = K;
      sc.select_k = K;
      if (!floors) {
        PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));  // scores and selection in one pass where fused
      } else {
        // The step's scores, floored by each sequence's observation
        // window's, then the top-k.
        sc.select_k = 0;
        PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
        const int64_t cap = step_[g.first]->capacity;
        for (int i = g.first; i < g.first + g.count; ++i) {
          if (!step_[i]->has_obs || Selectable(i) == 0) continue;
          for (int h = 0; h < H; ++h) {
            kn::MaxRowsArgs m;
            m.in = step_[i]->obs.as<float>() + static_cast<size_t>(h) * cap;
            m.rows = 1;
            m.row_stride = cap;
            m.cols = Selectable(i);
            m.out = scores_.as<float>() + (static_cast<size_t>(i - g.first) * H + h) * sc.score_stride;
            m.accumulate = true;
            b.MaxRows(m);
          }
        }
        sc.select_k = K;
        b.TopK(kn::ShadowkvSelectionTopK(sc));
      }
    }
    b.ShadowkvSlotUpdate(SlotUpdateOf(g, selection));
    return Status::OK();
  }

  // The shards of a context-parallel group agree on the whole sequence's
  // top `budget` per KV head (the step's sequences are all shards of it,
  // every rank runs the same groups of the same sequences):
  //  1. each group's softmax statistics of the head's logits over its own
  //     selectable tokens; one all-gather;
  //  2. each group's top `budget` of its own tokens, scored under the
  //     whole sequence's normalization (its proposals); one all-gather of
  //     the proposals' scores;
  //  3. every rank takes the same top `budget` of all proposals and keeps
  //     its own winners, then its slot update.
  // `successors` do not cross a shard's start: the first tokens of a shard
  // are not lifted by the previous shard's last ones (one place in each
  // shard boundary's `successors` tokens where the unsharded selection may
  // differ).
  Status SelectAcrossShards() {
    Backend& b = *ctx_.backend;
    const int B = static_cast<int>(step_.size()), H = ctx_.hkv, K = o_.budget, hq = head_->heads();
    ShadowKvShardExchange& x = exchange_;
    PENUMBRA_RETURN_IF_ERROR(x.Prepare(exchange_group_, B, hq, K));
    std::vector<kn::ShadowkvScoreArgs> args(groups_.size());
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const Group& g = groups_[gi];
      const int max_sel = MaxSelectable(g);
      if (max_sel == 0) continue;  // no statistics, no proposals (the buffers say so)
      PENUMBRA_ASSIGN_OR_RETURN(args[gi], ScoreArgsOf(g, max_sel));
      args[gi].workspace_part = static_cast<int>(gi);
    }
    // scores_ is the groups' shared scratch: sized for the largest before
    // any call reads it.
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      if (args[gi].max_chunks == 0) continue;
      kn::ShadowkvScoreArgs sc = args[gi];
      sc.scores = scores_.as<float>();
      sc.stats_out = x.stats_send() + static_cast<size_t>(groups_[gi].first) * hq * 2;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    PENUMBRA_RETURN_IF_ERROR(x.AllGatherStats());
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      if (args[gi].max_chunks == 0) continue;
      const size_t off = static_cast<size_t>(groups_[gi].first) * H * K;
      kn::ShadowkvScoreArgs sc = args[gi];
      sc.scores = scores_.as<float>();
      sc.stats_in = x.stats_recv() + static_cast<size_t>(groups_[gi].first) * hq * 2;
      sc.stats_parts = exchange_group_->world();
      sc.stats_part_stride = static_cast<int64_t>(x.stats());
      sc.selection = x.proposals() + off;
      sc.selection_stride = K;
      sc.select_k = K;
      sc.selection_scores = x.cand_send() + off;
      PENUMBRA_RETURN_IF_ERROR(b.ShadowkvScore(sc));
    }
    PENUMBRA_RETURN_IF_ERROR(x.AllGatherCandidates());
    for (const Group& g : groups_) {
      const size_t off = static_cast<size_t>(g.first) * H * K;
      int32_t* selection = selection_.as<int32_t>() + off;
      if (MaxSelectable(g) == 0) {
        // Nothing of its own to propose: it wins nothing.
        PENUMBRA_RETURN_IF_ERROR(b.Memset(selection, 0xFF, static_cast<size_t>(g.count) * H * K * sizeof(int32_t)));
        b.ShadowkvSlotUpdate(SlotUpdateOf(g, selection));
        continue;
      }
      kn::ShadowkvGlobalSelectArgs gs;
      gs.candidates = x.cand_recv() + off;
      gs.parts = exchange_group_->world();
      gs.rank = exchange_group_->rank();
      gs.part_stride = static_cast<int64_t>(x.cand());
      gs.rows = g.count * H;
      gs.cand_stride = K;
      gs.k = K;
      gs.proposals = x.proposals() + off;
      gs.winners = x.winners() + off;
      gs.selection = selection;
      gs.selection_stride = K;
      gs.selection_len = K;
      b.ShadowkvGlobalSelectAndSlotUpdate(gs, SlotUpdateOf(g, selection));
    }
    return Status::OK();
  }

  // Layer `layer`'s missing rows (keys and values) from its store into its
  // slots, on the side stream, marked layer % kSideMarks.
  void Prefetch(int layer) {
    Backend& b = *ctx_.backend;
    const int H = ctx_.hkv, K = o_.budget;
    b.ForkSide();
    for (const Group& g : groups_) {
      bool on_device = true;
      for (int i = g.first; i < g.first + g.count; ++i) on_device = on_device && layer < step_[i]->device_layers;
      for (int which = 0; which < 2; ++which) {
        kn::ShadowkvFetchVArgs f;
        f.value_store = reinterpret_cast<const void* const*>(Table(which ? kStoreV : kStoreK, layer) + g.first);
        const Seq& s0 = *step_[g.first];
        f.chunk_cap = static_cast<int>(s0.own());
        f.shared_store = reinterpret_cast<const void* const*>(Table(which ? kSharedV : kSharedK, layer) + g.first);
        f.shared_chunks = static_cast<int>(s0.base);
        f.shared_stride = static_cast<int>(s0.shared_stride());
        f.miss_count = miss_count_.as<int32_t>() + static_cast<size_t>(g.first) * H;
        f.miss_slot = miss_slot_.as<int32_t>() + static_cast<size_t>(g.first) * H * K;
        f.miss_chunk = miss_token_.as<int32_t>() + static_cast<size_t>(g.first) * H * K;
        f.miss_stride = K;
        f.att_v = Table(which ? kAttV : kAttK, layer) + g.first;
        f.att_head_stride = Rows() * ctx_.head_dim;
        f.outlier_rows = 0;
        f.dtype = b.act_dtype();
        f.batch = g.count;
        f.hkv = H;
        f.d = ctx_.head_dim;
        f.chunk_size = 1;
        f.max_misses = K;
        f.values_on_device = on_device;
        b.ShadowkvFetchV(f, /*staged=*/false);
      }
    }
    b.JoinSideLater(layer % Backend::kSideMarks);
  }

  PolicyContext ctx_;
  SpeContextOptions o_;
  std::shared_ptr<SpeContextHead> head_;
  size_t es_;
  std::map<int64_t, std::unique_ptr<Seq>> seqs_;
  double forced_hit_rate_ = -1;
  // Prefill: one layer of one sequence's keys and values, [hkv][rows][d].
  DeviceBuffer scratch_k_, scratch_v_;
  int64_t scratch_rows_ = 0;
  int64_t scratch_seq_ = -1, scratch_from_ = 0, scratch_end_ = 0;
  int scratch_layer_ = -1;
  DeviceBuffer ptr_buf_, obs_args_, obs_q_;
  std::vector<void*> ptr_staging_, obs_staging_;
  // The decode step.
  std::vector<Seq*> step_;
  std::vector<int64_t> step_pos_;
  std::vector<Group> groups_;
  DeviceBuffer step_buf_;
  std::vector<void*> step_staging_;
  void* const* step_table_ = nullptr;
  int step_cap_ = 0;
  DeviceBuffer head_q_, selection_, miss_count_, miss_slot_, miss_token_, scores_;
  // Context parallel: the step's group (null: none) and its exchange.
  Collective* exchange_group_ = nullptr;
  ShadowKvShardExchange exchange_;
};

}  // namespace

Result<std::unique_ptr<KvPolicy>> MakeSpeContextPolicy(const PolicyContext& ctx, const SpeContextOptions& options,
                                                       std::shared_ptr<SpeContextHead> head) {
  PENUMBRA_RETURN_IF_ERROR(SpeContextOptionTable().Validate(options));
  if (head == nullptr) return Status::InvalidArgument("specontext: no retrieval head");
  if (head->kv_heads() != ctx.hkv) {
    return Status::InvalidArgument("specontext: the retrieval head has " + std::to_string(head->kv_heads()) +
                                   " KV heads, the model " + std::to_string(ctx.hkv));
  }
  return std::unique_ptr<KvPolicy>(new SpeContextPolicy(ctx, options, std::move(head)));
}

}  // namespace penumbra
