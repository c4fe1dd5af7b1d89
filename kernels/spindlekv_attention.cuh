// SpindleKV attention on CUDA (arguments and semantics: spindlekv_args.h).
// Grid (sequence x KV head, split of its tokens); 4 warps a block, a warp a
// token at a time: each lane rebuilds d/32 elements of the token's key
// (entry x magnitude; RoPE's rotate-half partner from lane ^ 16) and value,
// and every query head of the group the token's mask marks takes it into
// its online softmax (lane-partial dot products reduced over the warp). The
// warps' states merge in shared memory; with several splits a second kernel
// merges the splits' by log-sum-exp. Reads each held token's entries once for
// its whole group.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/spindlekv_args.h"

namespace penumbra::kernels {

// Whether the kernel takes this shape (d a multiple of 32 up to 256, at most
// 8 query heads per KV head).
bool SpindlekvAttentionSupported(int hq, int hkv, int d);
void LaunchSpindlekvAttention(const SpindlekvAttentionArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
