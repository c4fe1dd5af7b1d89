#include "worker/engine/shadowkv/compressor.h"

#include <string>
#include <vector>

namespace penumbra {

namespace kn = kernels;

Status ShadowKvCompressor::EnsureTemp(int64_t tokens) {
  if (tmp_cap_ >= tokens) return Status::OK();
  Backend& b = backend_;
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  tmp_k_.Reset();
  tmp_v_.Reset();
  tmp_prek_.Reset();
  const int H = lay_.ctx().hkv, d = lay_.ctx().head_dim;
  const size_t kv = static_cast<size_t>(H) * tokens * d * lay_.es();
  PENUMBRA_ASSIGN_OR_RETURN(tmp_k_, b.Allocate(kv));
  PENUMBRA_ASSIGN_OR_RETURN(tmp_v_, b.Allocate(kv));
  PENUMBRA_ASSIGN_OR_RETURN(tmp_prek_, b.Allocate(static_cast<size_t>(tokens) * H * d * sizeof(float)));
  const int64_t chunks = tokens / lay_.options().chunk_size + 1;
  PENUMBRA_ASSIGN_OR_RETURN(tmp_cos_, b.Allocate(static_cast<size_t>(H) * chunks * sizeof(float)));
  // Outlier ids: at most one per chunk, whichever of outlier_chunks / outlier_fraction applies.
  PENUMBRA_ASSIGN_OR_RETURN(tmp_outl_, b.Allocate(static_cast<size_t>(H) * (chunks + 1) * sizeof(int32_t)));
  tmp_cap_ = tokens;
  return Status::OK();
}

void ShadowKvCompressor::ReleaseTempIfLarge() {
  if (tmp_k_.bytes() > (size_t{256} << 20)) {
    (void)backend_.Synchronize();
    tmp_k_.Reset();
    tmp_v_.Reset();
    tmp_prek_.Reset();
    tmp_cap_ = 0;
  }
}

Status ShadowKvCompressor::StoreTokens(const float* qkv, const int32_t* positions, int n, int64_t start, void* q_out,
                                       void* kbase, void* vbase, int64_t stride, float* pre_rope) {
  const PolicyContext& ctx = lay_.ctx();
  const int d = ctx.head_dim;
  const size_t es = lay_.es();
  std::vector<void*> ptrs(2 * static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    ptrs[i] = static_cast<char*>(kbase) + (start + i) * d * es;
    ptrs[n + i] = static_cast<char*>(vbase) + (start + i) * d * es;
  }
  PENUMBRA_RETURN_IF_ERROR(ShadowKvUpload(backend_, &ptr_buf_, ptrs.data(), ptrs.size() * sizeof(void*)));
  RopeStoreOp r;
  r.qkv = qkv;
  r.positions = positions;
  r.inv_freq = ctx.inv_freq;
  r.n = n;
  r.hq = ctx.hq;
  r.hkv = ctx.hkv;
  r.d = d;
  r.q_out = q_out;
  r.k_dst = static_cast<void* const*>(ptr_buf_.get());
  r.v_dst = static_cast<void* const*>(ptr_buf_.get()) + n;
  r.head_stride = stride;
  r.pre_rope_k_out = pre_rope;
  backend_.RopeStore(r);
  return Status::OK();
}

Status ShadowKvCompressor::Factor(ShadowKvSeq& s, int layer, int64_t S) {
  const int H = lay_.ctx().hkv, d = lay_.ctx().head_dim, r = lay_.options().rank, D = H * d;
  // SVD of the pre-RoPE keys of the prompt (one segment).
  kn::LowRankArgs lr;
  lr.keys = tmp_prek_.get();
  lr.S = S;
  lr.hkv = H;
  lr.d = d;
  lr.rank = r;
  lr.a_out = lay_.ALayer(s, layer);
  lr.b_out = lay_.Row2(s.b, layer, static_cast<int64_t>(H) * r * d);
  lr.proj_out = s.p.as<float>() + static_cast<int64_t>(layer) * D * r;
  return backend_.LowRankFactor(lr);
}

void ShadowKvCompressor::Landmarks(ShadowKvSeq& s, int layer, int n_chunks) {
  const ShadowKvOptions& o = lay_.options();
  // Landmarks and min cosine similarity per chunk.
  kn::ChunkLandmarksArgs cl;
  cl.k = tmp_k_.get();
  cl.k_head_stride = tmp_cap_ * lay_.ctx().head_dim;
  cl.first_token = 0;
  cl.n_chunks = n_chunks;
  cl.chunk_tokens = o.chunk_size;
  cl.hkv = lay_.ctx().hkv;
  cl.d = lay_.ctx().head_dim;
  cl.landmarks = lay_.LmLayer(s, layer);
  cl.landmark_head_stride = lay_.LmHead(s);
  cl.landmarks_per_chunk = o.landmarks_per_chunk;
  cl.landmark_fp8 = o.landmark_fp8();
  cl.min_cos = tmp_cos_.as<float>();
  cl.min_cos_head_stride = s.chunk_cap;
  backend_.ChunkLandmarks(cl);
}

Status ShadowKvCompressor::Outliers(ShadowKvSeq& s, int layer, int n_chunks) {
  Backend& b = backend_;
  const int H = lay_.ctx().hkv, d = lay_.ctx().head_dim, C = lay_.options().chunk_size;
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
    go.att_k = lay_.Row(s.att_k, s, layer, 0);
    go.att_v = lay_.Row(s.att_v, s, layer, 0);
    go.att_head_stride = s.att_cap * d;
    go.excluded = excl;
    go.mask_head_stride = s.chunk_cap;
    b.GatherOutliers(go);
    // Their chunk ids on the host too (a continuation's rebuild puts the
    // exact keys back at their places).
    if (s.outlier_ids.empty()) s.outlier_ids.resize(static_cast<size_t>(lay_.ctx().num_layers) * H * s.outliers);
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(s.outlier_ids.data() + static_cast<size_t>(layer) * H * s.outliers,
                                          tmp_outl_.get(), static_cast<size_t>(H) * s.outliers * sizeof(int32_t)));
  }
  return Status::OK();
}

Status ShadowKvCompressor::TailToLocal(ShadowKvSeq& s, int layer, int64_t tail0, int64_t tail) {
  if (tail > s.local_cap) {
    return Status::Internal("shadowkv: a prompt tail of " + std::to_string(tail) + " tokens > local_cap " +
                            std::to_string(s.local_cap));
  }
  if (tail <= 0) return Status::OK();  // a closed shard's prompt may be whole chunks
  Backend& b = backend_;
  const int H = lay_.ctx().hkv, d = lay_.ctx().head_dim, D = H * d;
  const size_t es = lay_.es();
  PENUMBRA_RETURN_IF_ERROR(b.Copy2D(lay_.Row(s.att_k, s, layer, lay_.LocalRow0(s)), s.att_cap * d * es,
                                    static_cast<char*>(tmp_k_.get()) + tail0 * d * es, tmp_cap_ * d * es, tail * d * es,
                                    H));
  PENUMBRA_RETURN_IF_ERROR(b.Copy2D(lay_.Row(s.att_v, s, layer, lay_.LocalRow0(s)), s.att_cap * d * es,
                                    static_cast<char*>(tmp_v_.get()) + tail0 * d * es, tmp_cap_ * d * es, tail * d * es,
                                    H));
  return b.CopyDeviceToDevice(s.prek.as<float>() + static_cast<int64_t>(layer) * s.local_cap * D,
                              tmp_prek_.as<float>() + tail0 * D, tail * D * sizeof(float));
}

Result<size_t> ShadowKvCompressor::StageValues(DeviceBuffer* stage, const void* src, int64_t head_stride,
                                               int64_t src_row, int n) {
  Backend& b = backend_;
  const int C = lay_.options().chunk_size, H = lay_.ctx().hkv, d = lay_.ctx().head_dim;
  const size_t es = lay_.es();
  // A head's n rows as the store keeps them (fp8: encoded on the device first).
  const size_t row = static_cast<size_t>(n) * lay_.value_row_bytes();
  if (stage->bytes() < row * H) {
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    PENUMBRA_ASSIGN_OR_RETURN(*stage, b.AllocateHost(row * H));
  }
  if (lay_.options().value_fp8()) {
    if (fp8_tmp_.bytes() < row * H) {
      PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
      PENUMBRA_ASSIGN_OR_RETURN(fp8_tmp_, b.Allocate(row * H));
    }
    for (int h = 0; h < H; ++h) {
      b.EncodeValuesFp8(static_cast<const char*>(src) + (h * head_stride + src_row * d) * es, n, C, d,
                        fp8_tmp_.as<char>() + h * row);
    }
    PENUMBRA_RETURN_IF_ERROR(b.CopyToHost(stage->get(), fp8_tmp_.get(), row * H));
  } else {
    const size_t wide = static_cast<size_t>(n) * C * d * es;
    PENUMBRA_RETURN_IF_ERROR(
        b.Copy2D(stage->get(), wide, static_cast<const char*>(src) + src_row * d * es, head_stride * es, wide, H));
  }
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  return row;
}

Status ShadowKvCompressor::OffloadValues(storage::DramValueStore& store, DeviceBuffer* stage, ShadowKvSeq& s, int layer,
                                         const void* src, int64_t head_stride, int64_t src_row, int n,
                                         int store_first) {
  PENUMBRA_ASSIGN_OR_RETURN(const size_t row, StageValues(stage, src, head_stride, src_row, n));
  for (int h = 0; h < lay_.ctx().hkv; ++h) {
    PENUMBRA_RETURN_IF_ERROR(store.PutChunks(s.segment, layer, h, store_first, n, stage->as<char>() + h * row));
  }
  return Status::OK();
}

void ShadowKvCompressor::Collect(Put& p) {
  if (!p.done.valid()) return;
  Status st = p.done.get();
  if (!st.ok()) put_errors_.emplace(p.segment, std::move(st));  // the first one stays
}

Status ShadowKvCompressor::OffloadValuesAsync(storage::DramValueStore& store, ShadowKvSeq& s, int layer,
                                              const void* src, int64_t head_stride, int64_t src_row, int n,
                                              int store_first) {
  Put& p = puts_[next_put_];
  next_put_ ^= 1;
  Collect(p);  // its staging buffer is free once its last put is done
  if (auto it = put_errors_.find(s.segment); it != put_errors_.end()) return it->second;
  PENUMBRA_ASSIGN_OR_RETURN(const size_t row, StageValues(&p.stage, src, head_stride, src_row, n));
  p.segment = s.segment;
  const char* rows = p.stage.as<char>();
  const int H = lay_.ctx().hkv;
  const storage::SegmentId segment = s.segment;
  p.done = std::async(std::launch::async, [&store, segment, layer, H, store_first, n, rows, row]() -> Status {
    for (int h = 0; h < H; ++h) {
      PENUMBRA_RETURN_IF_ERROR(store.PutChunks(segment, layer, h, store_first, n, rows + h * row));
    }
    return Status::OK();
  });
  return Status::OK();
}

Status ShadowKvCompressor::DrainPuts(storage::SegmentId segment) {
  for (Put& p : puts_) Collect(p);
  auto it = put_errors_.find(segment);
  if (it == put_errors_.end()) return Status::OK();
  Status st = std::move(it->second);
  put_errors_.erase(it);
  return st;
}

void ShadowKvCompressor::ForgetPuts(storage::SegmentId segment) {
  for (Put& p : puts_) Collect(p);
  put_errors_.erase(segment);
}

}  // namespace penumbra
