#include "worker/engine/shadowkv/decode_step.h"

#include <algorithm>
#include <cstring>

namespace penumbra {

namespace kn = kernels;

Status ShadowKvDecodeStep::Begin(const std::vector<ShadowKvSeq*>& seqs) {
  const PolicyContext& ctx = lay_.ctx();
  const ShadowKvOptions& o = lay_.options();
  const int L = ctx.num_layers, B = static_cast<int>(seqs.size());
  seqs_ = seqs;
  groups_.clear();
  // Groups: runs of sequences with equal geometry share kernel launches.
  for (int i = 0; i < B;) {
    int j = i + 1;
    while (j < B && ShadowKvLayout::SameGeometry(*seqs_[i], *seqs_[j])) ++j;
    // Micro-batches (o.micro_batches > 1): a sparse group split into
    // near-equal parts whose selection, value fetch and attention are
    // pipelined in the policy's DecodeAttention.
    const int parts = seqs_[i]->sparse ? std::min(o.micro_batches, j - i) : 1;
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
      ShadowKvSeq& s = *seqs_[i];
      row[kNewK * B + i] = lay_.Row(s.att_k, s, l, lay_.LocalRow0(s) + s.local_count);
      row[kNewV * B + i] = lay_.Row(s.att_v, s, l, lay_.LocalRow0(s) + s.local_count);
      row[kAttK * B + i] = lay_.Row(s.att_k, s, l, 0);
      row[kAttV * B + i] = lay_.Row(s.att_v, s, l, 0);
      if (s.sparse) {
        row[kLandmarks * B + i] = lay_.LmLayer(s, l);
        row[kExcluded * B + i] = s.excl.as<uint8_t>() + static_cast<int64_t>(l) * ctx.hkv * s.chunk_cap;
        row[kSlots * B + i] = s.slots.as<int32_t>() + static_cast<int64_t>(l) * ctx.hkv * s.kslots;
        row[kA * B + i] = lay_.ALayer(s, l);
        row[kB * B + i] = lay_.Row2(s.b, l, static_cast<int64_t>(ctx.hkv) * o.rank * ctx.head_dim);
        row[kValues * B + i] = s.store_dev[l];
        row[kNewPreK * B + i] =
            s.prek.as<float>() + (static_cast<int64_t>(l) * s.local_cap + s.local_count) * ctx.hkv * ctx.head_dim;
        row[kSharedValues * B + i] = s.prefix ? s.prefix->values_device(l) : nullptr;
        row[kSharedLandmarks * B + i] = s.prefix ? s.prefix->lm_layer(l) : nullptr;
        row[kSharedA * B + i] = s.prefix ? s.prefix->a_layer(l) : nullptr;
      }
    }
  }
  // Per sequence: attention length (a closed shard's new row is not
  // attended), chunk count, first position (the rebuilt keys' RoPE offset).
  std::vector<int32_t> ints(static_cast<size_t>(kInts) * B);
  offsets_ = false;
  for (int i = 0; i < B; ++i) {
    ShadowKvSeq& s = *seqs_[i];
    ints[kLength * B + i] =
        static_cast<int32_t>((s.outliers + s.kslots) * int64_t{o.chunk_size} + s.local_count + (s.closed ? 0 : 1));
    ints[kChunks * B + i] = s.n_chunks;
    ints[kPosition0 * B + i] = static_cast<int32_t>(s.pos0);
    offsets_ = offsets_ || s.pos0 != 0;
  }
  std::vector<uint8_t> blob(t.size() * sizeof(void*) + ints.size() * 4);
  std::memcpy(blob.data(), t.data(), t.size() * sizeof(void*));
  std::memcpy(blob.data() + t.size() * sizeof(void*), ints.data(), ints.size() * 4);
  PENUMBRA_RETURN_IF_ERROR(ShadowKvUpload(backend_, &step_buf_, blob.data(), blob.size()));
  batch_ = B;
  // Miss lists and per-layer miss counts (for the hit rate).
  int max_k = 0;
  for (ShadowKvSeq* s : seqs_) max_k = std::max(max_k, s->kslots);
  const size_t rows = static_cast<size_t>(B) * ctx.hkv;
  max_k_ = max_k;
  if (max_k > 0) {
    const size_t need = rows * max_k * 4 * 3 + rows * 4 * (L + 1);
    if (miss_buf_.bytes() < need) {
      PENUMBRA_ASSIGN_OR_RETURN(miss_buf_, backend_.Allocate(need * 2));
    }
    int max_chunks = 0;
    for (ShadowKvSeq* s : seqs_) max_chunks = std::max(max_chunks, s->n_chunks);
    const size_t sneed = rows * static_cast<size_t>(max_chunks + 1) * sizeof(float);
    if (score_buf_.bytes() < sneed) {
      PENUMBRA_ASSIGN_OR_RETURN(score_buf_, backend_.Allocate(sneed * 2));
    }
    max_chunks_ = max_chunks;
  }
  return Status::OK();
}

void* const* ShadowKvDecodeStep::Tables(int layer) const {
  auto* base = static_cast<void* const*>(step_buf_.get());
  return base + static_cast<size_t>(layer) * kTables * batch_;
}

const int32_t* ShadowKvDecodeStep::Ints() const {
  auto* base = static_cast<void* const*>(step_buf_.get());
  return reinterpret_cast<const int32_t*>(base + static_cast<size_t>(lay_.ctx().num_layers) * kTables * batch_);
}

int32_t* ShadowKvDecodeStep::MissSlots(int g0) const {
  return miss_buf_.as<int32_t>() + static_cast<size_t>(batch_) * lay_.ctx().hkv * max_k_ +
         static_cast<size_t>(g0) * lay_.ctx().hkv * seqs_[g0]->kslots;
}

int32_t* ShadowKvDecodeStep::MissChunks(int g0) const {
  return MissSlots(g0) + static_cast<size_t>(batch_) * lay_.ctx().hkv * max_k_;
}

const int32_t* ShadowKvDecodeStep::MissCountsAll() const {
  return miss_buf_.as<int32_t>() + 3 * static_cast<size_t>(batch_) * lay_.ctx().hkv * max_k_;
}

int32_t* ShadowKvDecodeStep::MissCounts(int layer, int g0) const {
  return miss_buf_.as<int32_t>() + 3 * static_cast<size_t>(batch_) * lay_.ctx().hkv * max_k_ +
         static_cast<size_t>(layer) * batch_ * lay_.ctx().hkv + static_cast<size_t>(g0) * lay_.ctx().hkv;
}

RopeStoreOp ShadowKvDecodeStep::RopeStoreOf(int layer, int g0, int gn, const float* qkv, const int32_t* positions,
                                            void* q_scratch) const {
  const PolicyContext& ctx = lay_.ctx();
  const int B = batch_, H = ctx.hkv, d = ctx.head_dim;
  void* const* tab = Tables(layer);
  const ShadowKvSeq& s0 = *seqs_[g0];
  const size_t qkv_row = static_cast<size_t>(ctx.hq + 2 * H) * d;
  RopeStoreOp r;
  r.qkv = qkv + g0 * qkv_row;
  r.positions = positions + g0;
  r.inv_freq = ctx.inv_freq;
  r.n = gn;
  r.hq = ctx.hq;
  r.hkv = H;
  r.d = d;
  r.q_out = static_cast<char*>(q_scratch) + g0 * static_cast<size_t>(ctx.hq) * d * lay_.es();
  r.k_dst = tab + kNewK * B + g0;
  r.v_dst = tab + kNewV * B + g0;
  r.head_stride = s0.att_cap * d;
  r.pre_rope_k_out = nullptr;
  // New tokens' pre-RoPE keys straight into each sequence's local
  // pre-RoPE rows (for the A.1 projection when their chunk completes).
  r.pre_rope_k_dst = s0.sparse ? reinterpret_cast<float* const*>(tab + kNewPreK * B + g0) : nullptr;
  return r;
}

DecodeAttentionOp ShadowKvDecodeStep::AttentionOf(int layer, int g0, int gn, const void* q, void* out, float* lse,
                                                  bool mask_slots, bool values_in_place) const {
  const PolicyContext& ctx = lay_.ctx();
  const int B = batch_, d = ctx.head_dim;
  void* const* tab = Tables(layer);
  const ShadowKvSeq& s0 = *seqs_[g0];
  DecodeAttentionOp a;
  a.q = q;
  a.k = reinterpret_cast<const void* const*>(tab + kAttK * B + g0);
  a.v = reinterpret_cast<const void* const*>(tab + kAttV * B + g0);
  a.lengths = Ints() + kLength * B + g0;
  a.out = static_cast<char*>(out) + g0 * static_cast<size_t>(ctx.hq) * d * lay_.es();
  a.head_stride = s0.att_cap * d;
  a.batch = gn;
  a.hq = ctx.hq;
  a.hkv = ctx.hkv;
  a.d = d;
  a.max_length = static_cast<int>(s0.att_cap);
  a.scale = ctx.scale;
  a.lse = lse != nullptr ? lse + static_cast<size_t>(g0) * ctx.hq : nullptr;
  if ((mask_slots || values_in_place) && s0.sparse) {
    a.slot_maps = reinterpret_cast<const int32_t* const*>(tab + kSlots * B + g0);
    a.slot_row0 = s0.outliers * lay_.options().chunk_size;
    a.slot_count = s0.kslots;
    a.slot_rows = lay_.options().chunk_size;
    if (values_in_place) {
      a.slot_values = reinterpret_cast<const void* const*>(tab + kSharedValues * B + g0);
      a.slot_values_stride = s0.shared_stride;
      a.slot_values_chunks = s0.shared_chunks;
    }
  }
  return a;
}

kn::ShadowkvScoreArgs ShadowKvDecodeStep::ScoreArgsOf(int layer, int g0, int gn, const void* q) const {
  const PolicyContext& ctx = lay_.ctx();
  const ShadowKvOptions& o = lay_.options();
  const int B = batch_, H = ctx.hkv, K = seqs_[g0]->kslots;
  void* const* tab = Tables(layer);
  const ShadowKvSeq& s0 = *seqs_[g0];
  int max_chunks = 0;
  for (int i = g0; i < g0 + gn; ++i) max_chunks = std::max(max_chunks, seqs_[i]->n_chunks);
  kn::ShadowkvScoreArgs sc;
  sc.q = q;
  sc.landmarks = reinterpret_cast<const void* const*>(tab + kLandmarks * B + g0);
  sc.excluded = reinterpret_cast<const uint8_t* const*>(tab + kExcluded * B + g0);
  sc.n_chunks = Ints() + kChunks * B + g0;
  sc.batch = gn;
  sc.hq = ctx.hq;
  sc.hkv = H;
  sc.d = ctx.head_dim;
  sc.chunk_cap = s0.chunk_cap;
  sc.landmark_cap = s0.lm_cap;
  sc.landmarks_per_chunk = o.landmarks_per_chunk;
  sc.landmark_fp8 = o.landmark_fp8();
  sc.shared_landmarks = reinterpret_cast<const void* const*>(tab + kSharedLandmarks * B + g0);
  sc.shared_chunks = s0.shared_chunks;
  sc.max_chunks = max_chunks;
  sc.scale = ctx.scale;
  sc.successors = o.successor_chunks;
  sc.scores = score_buf_.as<float>();
  sc.score_stride = max_chunks_ + 1;
  sc.select_k = K;  // the top-k, fused with the scores' last phases on the GPU
  sc.selection = miss_buf_.as<int32_t>() + static_cast<size_t>(g0) * H * K;
  sc.selection_stride = K;
  // Questions about one document: its landmarks scored for all of them at once.
  bool one_prefix = gn >= 2 && s0.prefix != nullptr && s0.shared_chunks > 0;
  for (int i = g0 + 1; i < g0 + gn && one_prefix; ++i)
    one_prefix = seqs_[i]->prefix == s0.prefix && seqs_[i]->shared_chunks == s0.shared_chunks;
  sc.one_prefix = one_prefix;
  return sc;
}

kn::ShadowkvSlotUpdateArgs ShadowKvDecodeStep::SlotUpdateOf(int layer, int g0, int gn, const int32_t* selection,
                                                            int64_t stride) const {
  const ShadowKvSeq& s0 = *seqs_[g0];
  kn::ShadowkvSlotUpdateArgs su;
  su.selection = selection;
  su.selection_stride = stride;
  su.slot_maps = reinterpret_cast<int32_t* const*>(Tables(layer) + kSlots * batch_ + g0);
  su.miss_count = MissCounts(layer, g0);
  su.miss_slot = MissSlots(g0);
  su.miss_chunk = MissChunks(g0);
  su.batch = gn;
  su.hkv = lay_.ctx().hkv;
  su.kslots = s0.kslots;
  su.chunk_cap = s0.chunk_cap;
  su.force_keep = static_cast<float>(lay_.options().force_hit_rate);
  return su;
}

kn::ShadowkvFetchVArgs ShadowKvDecodeStep::FetchVOf(int layer, int g0, int gn) const {
  const PolicyContext& ctx = lay_.ctx();
  const ShadowKvOptions& o = lay_.options();
  const ShadowKvSeq& s0 = *seqs_[g0];
  const int B = batch_, H = ctx.hkv, d = ctx.head_dim, C = o.chunk_size, K = s0.kslots;
  void* const* tab = Tables(layer);
  kn::ShadowkvFetchVArgs fv;
  fv.value_store = reinterpret_cast<const void* const*>(tab + kValues * B + g0);
  fv.chunk_cap = s0.chunk_cap - s0.shared_chunks;
  fv.shared_store = reinterpret_cast<const void* const*>(tab + kSharedValues * B + g0);
  fv.shared_chunks = s0.shared_chunks;
  fv.shared_stride = s0.shared_stride;
  fv.miss_count = MissCounts(layer, g0);
  fv.miss_slot = MissSlots(g0);
  fv.miss_chunk = MissChunks(g0);
  fv.miss_stride = K;
  fv.att_v = tab + kAttV * B + g0;
  fv.att_head_stride = s0.att_cap * d;
  fv.outlier_rows = s0.outliers * C;
  fv.batch = gn;
  fv.hkv = H;
  fv.d = d;
  fv.chunk_size = C;
  fv.max_misses = K;
  fv.max_blocks = o.fetch_blocks;
  fv.values_fp8 = o.value_fp8();
  return fv;
}

kn::ShadowkvRebuildKArgs ShadowKvDecodeStep::RebuildKOf(int layer, int g0, int gn) const {
  const PolicyContext& ctx = lay_.ctx();
  const ShadowKvOptions& o = lay_.options();
  const ShadowKvSeq& s0 = *seqs_[g0];
  const int B = batch_, H = ctx.hkv, d = ctx.head_dim, C = o.chunk_size, K = s0.kslots;
  void* const* tab = Tables(layer);
  kn::ShadowkvRebuildKArgs rk;
  rk.a = reinterpret_cast<const void* const*>(tab + kA * B + g0);
  rk.shared_a = reinterpret_cast<const void* const*>(tab + kSharedA * B + g0);
  rk.shared_chunks = s0.shared_chunks;
  rk.b = reinterpret_cast<const void* const*>(tab + kB * B + g0);
  rk.inv_freq = ctx.inv_freq;
  rk.position_offset = offsets_ ? Ints() + kPosition0 * B + g0 : nullptr;  // shards: their first positions
  rk.miss_count = MissCounts(layer, g0);
  rk.miss_slot = MissSlots(g0);
  rk.miss_chunk = MissChunks(g0);
  rk.miss_stride = K;
  rk.att_k = tab + kAttK * B + g0;
  rk.att_head_stride = s0.att_cap * d;
  rk.outlier_rows = s0.outliers * C;
  rk.batch = gn;
  rk.hkv = H;
  rk.d = d;
  rk.r = o.rank;
  rk.chunk_size = C;
  rk.max_misses = K;
  return rk;
}

}  // namespace penumbra
