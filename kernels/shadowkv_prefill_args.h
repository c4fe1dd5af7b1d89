// Arguments of the ShadowKV prefill kernels (kernels/shadowkv_prefill.cuh
// holds the algorithm and the launchers). Plain C++, no CUDA headers: the
// engine's op table (worker/engine/backend.h) carries these, CPU-only builds
// included.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace penumbra::kernels {

struct ChunkLandmarksArgs {
  const void* k = nullptr;        // post-RoPE K cache: token t of head h at k + h*k_head_stride + t*d
  DType kv_dtype = DType::kBF16;  // kF32 or kBF16
  int64_t k_head_stride = 0;      // elements
  int64_t first_token = 0;        // token of chunk 0's first key
  int n_chunks = 0, chunk_tokens = 0, hkv = 0, d = 0;  // d <= 256
  // Chunk c of head h's record (kernels/landmark_format.h) at landmarks +
  // h*landmark_head_stride + c*LandmarkChunkElems(landmarks_per_chunk, d,
  // landmark_fp8) elements of the landmark type (bytes for fp8).
  void* landmarks = nullptr;
  DType landmark_dtype = DType::kBF16;  // kF32 or kBF16; ignored with landmark_fp8
  bool landmark_fp8 = false;            // e4m3 codes and a scale per record (landmark_format.h)
  int64_t landmark_head_stride = 0;     // elements of the landmark type
  float* min_cos = nullptr;             // chunk c of head h at min_cos[h*min_cos_head_stride + c]
  int64_t min_cos_head_stride = 0;
  // `batch` independent problems in one launch (e.g. every layer of a
  // sequence): problem i reads k + i*k_batch_stride and writes landmarks +
  // i*landmark_batch_stride and min_cos + i*min_cos_batch_stride (elements).
  int batch = 1;
  int64_t k_batch_stride = 0, landmark_batch_stride = 0, min_cos_batch_stride = 0;
  // > 1 (a power of two dividing chunk_tokens): each chunk has this many
  // landmarks, the means of its consecutive runs of chunk_tokens /
  // landmarks_per_chunk keys, at rows c * landmarks_per_chunk + j (so
  // landmark_head_stride covers that many rows per chunk). min_cos is still
  // over the chunk's own mean (the outlier criterion does not change).
  int landmarks_per_chunk = 1;
};

struct SelectOutliersArgs {
  const float* min_cos = nullptr;  // as ChunkLandmarksArgs::min_cos
  int64_t min_cos_head_stride = 0;
  int hkv = 0, n_chunks = 0;
  int num_outliers = 0;    // 0 <= num_outliers <= n_chunks
  int32_t* out = nullptr;  // [hkv][num_outliers] ascending chunk indices
};

struct GatherOutliersArgs {
  const void* k = nullptr;        // post-RoPE K cache, layout as ChunkLandmarksArgs::k
  const void* v = nullptr;        // V cache, same layout
  DType kv_dtype = DType::kBF16;  // of k, v, att_k, att_v (kF32 or kBF16)
  int64_t kv_head_stride = 0;     // elements
  int64_t first_token = 0;
  int chunk_tokens = 0, hkv = 0, d = 0;
  int n_chunks = 0;                   // chunks of this segment (mask entries written)
  const int32_t* outliers = nullptr;  // [hkv][num_outliers] ascending (LaunchSelectOutlierChunks)
  int num_outliers = 0;
  void* att_k = nullptr;  // outlier j of head h at att_k + h*att_head_stride + j*chunk_tokens*d
  void* att_v = nullptr;
  int64_t att_head_stride = 0;   // elements
  uint8_t* excluded = nullptr;   // excluded[h*mask_head_stride + c], c < n_chunks
  int64_t mask_head_stride = 0;  // typically the chunk capacity
};

}  // namespace penumbra::kernels
