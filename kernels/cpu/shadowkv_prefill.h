// CPU reference of the ShadowKV prefill kernels (see kernels/shadowkv_prefill.cuh
// for the contract): chunk landmarks and minimum cosine similarity, outlier
// chunk selection, and the outlier gather. f32 tensors throughout.
#pragma once

#include <cstdint>

namespace penumbra::kernels::cpu {

struct ChunkLandmarksArgs {
  const float* k = nullptr;  // post-RoPE key cache: token t of head h at k + h*k_head_stride + t*d
  int64_t k_head_stride = 0;
  int64_t first_token = 0;  // token of chunk 0's first key
  int n_chunks = 0, chunk_tokens = 0, hkv = 0, d = 0;
  float* landmarks = nullptr;  // chunk c of head h at landmarks + h*landmark_head_stride + c*S*d
  // Set instead of `landmarks`: fp8 records (kernels/landmark_format.h),
  // chunk c of head h at landmarks_fp8 + h*landmark_head_stride + c*(S*d + 16).
  uint8_t* landmarks_fp8 = nullptr;
  int64_t landmark_head_stride = 0;  // elements of the landmarks' type (bytes for fp8)
  float* min_cos = nullptr;          // chunk c of head h at min_cos[h*min_cos_head_stride + c]
  int64_t min_cos_head_stride = 0;
  int landmarks_per_chunk = 1;  // see the CUDA header
};
void ChunkLandmarks(const ChunkLandmarksArgs& a);

// Cosine similarity as the kernels define it: 1 when both vectors are zero, 0
// when exactly one is, dot/(|x||y|) otherwise (f32, norms from f32 sums).
float ChunkCosine(float dot, float xx, float yy);

// Per head, the `num_outliers` chunks with the lowest min_cos (NaN counts as
// lowest; ties go to the lower chunk index), written ascending to
// out[h*num_outliers + j]. Requires 0 <= num_outliers <= n_chunks.
void SelectOutlierChunks(const float* min_cos, int64_t min_cos_head_stride, int hkv, int n_chunks, int num_outliers,
                         int32_t* out);

struct GatherOutliersArgs {
  const float* k = nullptr;  // post-RoPE K cache, layout as ChunkLandmarksArgs::k
  const float* v = nullptr;  // V cache, same layout
  int64_t kv_head_stride = 0;
  int64_t first_token = 0;
  int chunk_tokens = 0, hkv = 0, d = 0;
  int n_chunks = 0;                   // chunks of this segment (mask entries written)
  const int32_t* outliers = nullptr;  // [hkv][num_outliers] ascending chunk indices
  int num_outliers = 0;
  float* att_k = nullptr;  // outlier j's rows at att_k + h*att_head_stride + j*chunk_tokens*d
  float* att_v = nullptr;
  int64_t att_head_stride = 0;
  uint8_t* excluded = nullptr;  // excluded[h*mask_head_stride + c] = 1 for outliers, 0 for other c < n_chunks
  int64_t mask_head_stride = 0;
};
void GatherOutliers(const GatherOutliersArgs& a);

}  // namespace penumbra::kernels::cpu
