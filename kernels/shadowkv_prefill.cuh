// ShadowKV prefill, after the layer's full attention (paper Algorithm 1):
//
// 1. LaunchChunkLandmarks: for each KV head and each C-token chunk of the
//    segment's post-RoPE keys, the landmark L = mean of the chunk's keys (f32
//    math, stored as landmark_dtype) and min_cos = min over the chunk's keys of
//    cos(L, key) in f32 (the mean used is the f32 one, before rounding).
//    Cosine: 1 when both vectors are zero, 0 when exactly one is.
//    One warp per (head, chunk), 8 warps per block; reads K once (the second
//    pass over the chunk hits L1/L2), writes hkv*n_chunks*(d+1) values. With
//    landmarks_per_chunk = S > 1 the landmarks are the means of the chunk's
//    S runs of C/S keys instead (hkv*n_chunks*(S*d+1) values). With
//    landmark_fp8 each chunk's S rows are one e4m3 record with its scale
//    (kernels/landmark_format.h; a second pass over the runs encodes them
//    once their largest value is known).
// 2. LaunchSelectOutlierChunks: per KV head, the O chunks with the lowest
//    min_cos (NaN counts as lowest, -0 == +0, ties to the lower chunk index),
//    written in ascending chunk order. One 1024-thread block per head: a 4-pass
//    8-bit radix select on order-preserving keys finds the O-th smallest value,
//    then a block scan in index order emits the chosen chunks. Reads min_cos
//    5 times (n_chunks floats per head, up to ~131K: L2-resident).
// 3. LaunchGatherOutliers: copies the outlier chunks' exact post-RoPE K and V
//    rows into the attention buffer rows [h][j*C .. (j+1)*C) for the j-th
//    outlier (ascending), and writes the excluded-chunk mask (1 for outliers,
//    0 for the segment's other chunks). One block per (outlier, head) copies
//    2*C*d elements; one block per head writes the mask.
//
// All launchers take device pointers, do not allocate or synchronize, and
// expect validated arguments (checked one layer up).
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/shadowkv_prefill_args.h"  // ChunkLandmarksArgs, SelectOutliersArgs, GatherOutliersArgs

namespace penumbra::kernels {

void LaunchChunkLandmarks(const ChunkLandmarksArgs& args, cudaStream_t stream);
void LaunchSelectOutlierChunks(const SelectOutliersArgs& args, cudaStream_t stream);
void LaunchGatherOutliers(const GatherOutliersArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
