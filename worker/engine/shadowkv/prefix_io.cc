#include "worker/engine/shadowkv/prefix_io.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

namespace penumbra {
namespace {

// Runs f(0..n-1) on up to 8 threads.
void ParallelFor(int n, const std::function<void(int)>& f) {
  const int threads = std::max(1, std::min<int>(n, std::min(8u, std::max(1u, std::thread::hardware_concurrency()))));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int i = t; i < n; i += threads) f(i);
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace

ShadowKvPrefixGeometry ShadowKvPrefixIo::Geometry() const {
  const PolicyContext& ctx = lay_.ctx();
  const ShadowKvOptions& o = lay_.options();
  ShadowKvPrefixGeometry g;
  g.layers = ctx.num_layers;
  g.hkv = ctx.hkv;
  g.head_dim = ctx.head_dim;
  g.rank = o.rank;
  g.chunk_size = o.chunk_size;
  g.landmarks_per_chunk = o.landmarks_per_chunk;
  g.landmark_fp8 = o.landmark_fp8();
  g.value_fp8 = o.value_fp8();
  g.dtype = backend_.act_dtype();
  return g;
}

Result<std::shared_ptr<ShadowKvPrefix>> ShadowKvPrefixIo::Capture(ShadowKvSeq& s, int64_t tokens, bool take) {
  const std::string id = std::to_string(s.id);
  if (s.taken) return Status::FailedPrecondition("sequence " + id + " was taken into a prefix");
  if (s.sparse && !s.compressed) return Status::FailedPrecondition("sequence " + id + " is not prefilled");
  if (tokens != lay_.Held(s) || tokens < 1) {
    return Status::FailedPrecondition("shadowkv captures all that sequence " + id + " holds (" +
                                      std::to_string(lay_.Held(s)) + " tokens), not " + std::to_string(tokens));
  }
  Backend& b = backend_;
  const PolicyContext& ctx = lay_.ctx();
  const int L = ctx.num_layers, H = ctx.hkv, d = ctx.head_dim, r = lay_.options().rank, C = lay_.options().chunk_size,
            D = H * d;
  const size_t es = lay_.es();
  ShadowKvPrefixGeometry g = Geometry();
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
  const size_t LH = static_cast<size_t>(L) * H, att_pitch = s.att_cap * d * es;
  auto copy2d = [&](const DeviceBuffer& dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                    size_t height) -> Status {
    if (width == 0 || height == 0) return Status::OK();
    return b.Copy2D(dst.get(), dpitch, src, spitch, width, height);
  };
  if (s.sparse) {
    const size_t arow = static_cast<size_t>(n) * C * r * es;
    // A rows and landmarks: the attached prefix's chunks, then the sequence's own.
    const int sh = s.shared_chunks;
    // Landmarks: one record of landmarks_per_chunk rows per chunk.
    const size_t lrow = static_cast<size_t>(lay_.lm_rec_bytes());
    const size_t ash = static_cast<size_t>(sh) * C * r * es, lsh = static_cast<size_t>(sh) * lrow;
    if (sh > 0) {
      PENUMBRA_RETURN_IF_ERROR(copy2d(p->a, arow, s.prefix->a.get(), ash, ash, L));
      PENUMBRA_RETURN_IF_ERROR(copy2d(p->lm, n * lrow, s.prefix->lm.get(), lsh, lsh, LH));
    }
    if (n > sh) {
      PENUMBRA_RETURN_IF_ERROR(b.Copy2D(p->a.as<char>() + ash, arow, s.a.get(), s.a_rows * r * es, arow - ash, L));
      PENUMBRA_RETURN_IF_ERROR(
          b.Copy2D(p->lm.as<char>() + lsh, n * lrow, s.lm.get(), s.lm_cap * lrow, n * lrow - lsh, LH));
    }
    PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(p->b.get(), s.b.get(), p->b.bytes()));
    PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(p->p.get(), s.p.get(), p->p.bytes()));
    PENUMBRA_RETURN_IF_ERROR(copy2d(p->excl, n, s.excl.get(), s.chunk_cap, n, LH));
    const size_t orow = static_cast<size_t>(s.outliers) * C * d * es;
    PENUMBRA_RETURN_IF_ERROR(copy2d(p->out_k, orow, s.att_k.get(), att_pitch, orow, LH));
    PENUMBRA_RETURN_IF_ERROR(copy2d(p->out_v, orow, s.att_v.get(), att_pitch, orow, LH));
    const size_t prow = s.local_count * D * sizeof(float);
    PENUMBRA_RETURN_IF_ERROR(copy2d(p->tail_prek, prow, s.prek.get(), s.local_cap * D * sizeof(float), prow, L));
    p->outlier_ids = s.outlier_ids;
  }
  const size_t trow = s.local_count * d * es;
  PENUMBRA_RETURN_IF_ERROR(copy2d(p->tail_k, trow, lay_.Row(s.att_k, s, 0, lay_.LocalRow0(s)), att_pitch, trow, LH));
  PENUMBRA_RETURN_IF_ERROR(copy2d(p->tail_v, trow, lay_.Row(s.att_v, s, 0, lay_.LocalRow0(s)), att_pitch, trow, LH));
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
    // head) one run [n][row]; layers copied in parallel.
    const size_t cb = lay_.value_row_bytes(), own_cap = s.chunk_cap - s.shared_chunks;
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
  return p;
}

Result<std::shared_ptr<ShadowKvPrefix>> ShadowKvPrefixIo::Import(const std::map<std::string, std::string>& blobs,
                                                                 std::shared_ptr<storage::BlobReader> lazy,
                                                                 int read_threads) const {
  PENUMBRA_ASSIGN_OR_RETURN(std::shared_ptr<ShadowKvPrefix> p,
                            ShadowKvPrefix::Import(blobs, Geometry(), &backend_, std::move(lazy), read_threads));
  // What this layout's options make of a first prefill of that length.
  const ShadowKvPrefixGeometry& g = p->geometry();
  ShadowKvSeq probe;
  SequenceSpec spec;
  spec.prompt_len = g.tokens + 1;
  spec.first_prefill = g.factored;
  lay_.Shape(spec, &probe);
  auto differs = [&] { return probe.sparse != g.sparse || (g.sparse && probe.outliers != g.outliers); };
  if (differs()) {
    // A closed context-parallel shard's capture (no local window).
    spec.shard.closed = true;
    lay_.Shape(spec, &probe);
  }
  if (differs()) {
    return Status::Corruption("shadowkv prefix: '" + g.Meta() + "' is not what this policy's options make");
  }
  return p;
}

Status ShadowKvPrefixIo::Fit(const ShadowKvPrefix& p, ShadowKvSeq& s) const {
  const ShadowKvOptions& o = lay_.options();
  const ShadowKvPrefixGeometry& g = p.geometry();
  if (g.sparse != s.sparse || g.outliers != s.outliers || g.tail > s.local_cap ||
      (s.sparse && g.n_chunks >= s.chunk_cap) ||
      (s.sparse && (g.landmarks_per_chunk != o.landmarks_per_chunk || g.landmark_fp8 != o.landmark_fp8() ||
                    g.value_fp8 != o.value_fp8()))) {
    return Status::InvalidArgument("the shadowkv prefix (" + g.Meta() +
                                   ") does not fit this policy's options for a sequence of " +
                                   std::to_string(s.token_cap) + " tokens");
  }
  s.shared_chunks = g.n_chunks;
  s.shared_stride = p.value_stride();
  return Status::OK();
}

Status ShadowKvPrefixIo::Attach(const ShadowKvPrefix& p, ShadowKvSeq& s) {
  Backend& b = backend_;
  const ShadowKvPrefixGeometry& g = p.geometry();
  const PolicyContext& ctx = lay_.ctx();
  const int L = ctx.num_layers, H = ctx.hkv, d = ctx.head_dim, C = lay_.options().chunk_size, D = H * d;
  const size_t es = lay_.es();
  const int n = g.n_chunks;
  const size_t LH = static_cast<size_t>(L) * H, att_pitch = s.att_cap * d * es;
  auto copy2d = [&](void* dst, size_t dpitch, const DeviceBuffer& src, size_t spitch, size_t width,
                    size_t height) -> Status {
    if (width == 0 || height == 0) return Status::OK();
    return b.Copy2D(dst, dpitch, src.get(), spitch, width, height);
  };
  if (s.sparse) {
    PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(s.b.get(), p.b.get(), p.b.bytes()));
    PENUMBRA_RETURN_IF_ERROR(b.CopyDeviceToDevice(s.p.get(), p.p.get(), p.p.bytes()));
    PENUMBRA_RETURN_IF_ERROR(copy2d(s.excl.get(), s.chunk_cap, p.excl, n, n, LH));
    const size_t orow = static_cast<size_t>(g.outliers) * C * d * es;
    PENUMBRA_RETURN_IF_ERROR(copy2d(s.att_k.get(), att_pitch, p.out_k, orow, orow, LH));
    PENUMBRA_RETURN_IF_ERROR(copy2d(s.att_v.get(), att_pitch, p.out_v, orow, orow, LH));
    const size_t prow = g.tail * D * sizeof(float);
    PENUMBRA_RETURN_IF_ERROR(copy2d(s.prek.get(), s.local_cap * D * sizeof(float), p.tail_prek, prow, prow, L));
    s.outlier_ids = p.outlier_ids;
    s.n_chunks = n;
    s.compressed = true;
  }
  const size_t trow = g.tail * d * es;
  PENUMBRA_RETURN_IF_ERROR(copy2d(lay_.Row(s.att_k, s, 0, lay_.LocalRow0(s)), att_pitch, p.tail_k, trow, trow, LH));
  PENUMBRA_RETURN_IF_ERROR(copy2d(lay_.Row(s.att_v, s, 0, lay_.LocalRow0(s)), att_pitch, p.tail_v, trow, trow, LH));
  s.local_count = g.tail;
  return Status::OK();
}

}  // namespace penumbra
