// SpindleKV attention on CUDA (arguments and semantics: spindlekv_args.h).
// Grid (sequence x KV head, split of its tokens); 4 warps a block, a warp
// 32 tokens at a time: each lane rebuilds one token's key (entry x magnitude,
// rotated) and scores it against the group's queries (the heads its mask
// marks), one warp max a query head updates the online softmax, then the
// lanes split the head's elements to add the tile's values. The warps'
// states merge in shared memory; with several splits a second kernel merges
// the splits' by log-sum-exp. Reads each held token's entries once for its
// whole group. Entry rows must be 16-byte aligned (d * element size is).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/spindlekv_args.h"

namespace penumbra::kernels {

// Whether the kernel takes this shape (d a multiple of 32 up to 256, at most
// 8 query heads per KV head).
bool SpindlekvAttentionSupported(int hq, int hkv, int d);
void LaunchSpindlekvAttention(const SpindlekvAttentionArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
