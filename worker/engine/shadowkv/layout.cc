#include "worker/engine/shadowkv/layout.h"

#include <algorithm>
#include <cmath>

#include "kernels/landmark_format.h"
#include "kernels/value_format.h"

namespace penumbra {

namespace kn = kernels;

ShadowKvLayout::ShadowKvLayout(const PolicyContext& ctx, const ShadowKvOptions& options)
    : ctx_(ctx),
      o_(options),
      es_(DTypeSize(ctx.backend->act_dtype())),
      lm_rec_(kn::LandmarkChunkElems(options.landmarks_per_chunk, ctx.head_dim, options.landmark_fp8())),
      lm_rec_bytes_(kn::LandmarkChunkBytes(options.landmarks_per_chunk, ctx.head_dim, options.landmark_fp8(), es_)),
      value_row_bytes_(
          static_cast<size_t>(kn::ValueRowBytes(options.value_fp8(), options.chunk_size, ctx.head_dim, es_))) {}

void ShadowKvLayout::Shape(const SequenceSpec& spec, ShadowKvSeq* out) const {
  ShadowKvSeq& s = *out;
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
    want_outliers =
        static_cast<int64_t>(std::ceil(o_.outlier_fraction * static_cast<double>(std::max<int64_t>(first_chunks, 0))));
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
  s.att_cap = static_cast<int64_t>(s.outliers + s.kslots) * C + s.local_cap;
}

std::vector<ShadowKvLayout::Sized> ShadowKvLayout::Sizes(ShadowKvSeq& s) const {
  const size_t L = ctx_.num_layers, H = ctx_.hkv, d = ctx_.head_dim, r = o_.rank, D = H * d;
  std::vector<Sized> out = {{&s.att_k, AttLayer(s) * L * es_}, {&s.att_v, AttLayer(s) * L * es_}};
  if (!s.sparse) return out;
  // A rows and landmarks of the chunks this sequence makes; an attached
  // prefix's are read in place from the prefix.
  s.a_rows = s.token_cap - static_cast<int64_t>(s.shared_chunks) * o_.chunk_size;
  s.lm_cap = s.chunk_cap - s.shared_chunks;
  out.push_back({&s.a, L * s.a_rows * r * es_});
  out.push_back({&s.b, L * H * r * d * es_});
  out.push_back({&s.p, L * D * r * sizeof(float)});
  out.push_back({&s.lm, L * H * s.lm_cap * lm_rec_bytes_});
  out.push_back({&s.excl, L * H * s.chunk_cap});
  out.push_back({&s.slots, L * H * s.kslots * sizeof(int32_t)});
  out.push_back({&s.prek, L * s.local_cap * D * sizeof(float)});
  return out;
}

Status ShadowKvLayout::Allocate(ShadowKvSeq* out) const {
  ShadowKvSeq& s = *out;
  Backend& b = *ctx_.backend;
  for (const Sized& z : Sizes(s)) {
    PENUMBRA_ASSIGN_OR_RETURN(*z.buf, b.Allocate(z.bytes));
  }
  if (!s.sparse) return Status::OK();
  PENUMBRA_RETURN_IF_ERROR(b.Memset(s.excl.get(), 0, s.excl.bytes()));
  return b.Memset(s.slots.get(), 0xff, s.slots.bytes());
}

SequenceBytes ShadowKvLayout::Bytes(const SequenceSpec& spec) const {
  ShadowKvSeq s;
  Shape(spec, &s);
  SequenceBytes out;
  for (const Sized& z : Sizes(s)) out.device += ctx_.backend->AllocatedBytes(z.bytes);
  if (s.sparse) out.host = storage::DramValueStore::SegmentHostBytes(ValueSegment(s));
  return out;
}

storage::SegmentLayout ShadowKvLayout::ValueSegment(const ShadowKvSeq& s) const {
  storage::SegmentLayout seg{ctx_.num_layers, ctx_.hkv,      s.chunk_cap - s.shared_chunks,
                             o_.chunk_size,   ctx_.head_dim, ctx_.backend->act_dtype()};
  if (o_.value_fp8()) seg.row_bytes = value_row_bytes_;  // else the dtype's C*d elements
  return seg;
}

Status ShadowKvUpload(Backend& backend, DeviceBuffer* dst, const void* src, size_t bytes) {
  if (dst->bytes() < bytes) {
    PENUMBRA_RETURN_IF_ERROR(backend.Synchronize());
    PENUMBRA_ASSIGN_OR_RETURN(*dst, backend.Allocate(std::max<size_t>(bytes * 2, 4096)));
  }
  return backend.CopyToDevice(dst->get(), src, bytes);
}

}  // namespace penumbra
