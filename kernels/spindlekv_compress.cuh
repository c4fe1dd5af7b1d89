// SpindleKV's compression on CUDA (arguments and semantics:
// spindlekv_compress_args.h; the host math they match:
// worker/engine/spindlekv_math.h).
//
// WindowScores, per query head and 128-token tile of keys: the tile's logits
// against the window rows (scale * q.k, f32, 32 rows by 128 keys a block,
// each thread 4 rows by 4 keys, d in chunks of 32 staged through shared
// memory). Pass 1 keeps each row's max and sum of exp over its visible keys
// (t <= q_pos), per block of tiles, and a merge makes them the row's; pass 2
// computes the logits again and sums each key's probabilities over the rows;
// pass 3 averages over the pooling window. Each pass reads the keys once per
// query head (the G heads of a group run side by side and share them in L2),
// about 2 * hq * w * n * d multiply-adds in all.
//
// Select, per query head: the threshold of its top `keep` by a radix select
// (one block, 8 bits a pass, at most 8 passes over the context) on a 64-bit
// key, the score's order-preserving bits above (NaN lowest) and the inverted
// index below, so that every key is distinct and the `keep` largest keys are
// exactly TopKIndices' tokens. Then per KV head one block walks the n tokens
// in order: each token's mask (bit j when query head j's key reaches its
// threshold, every bit in the window), and a block-wide scan compacts the held
// tokens ascending.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/spindlekv_compress_args.h"

namespace penumbra::kernels {

// Whether the window-score kernel takes this head size: any d >= 1 (the
// channels are staged 32 at a time, so a multiple of 32 wastes nothing).
bool SpindlekvWindowScoresSupported(int d);
void LaunchSpindlekvWindowScores(const SpindlekvWindowScoresArgs& a, cudaStream_t stream);

// Takes hq a multiple of hkv with at most 32 query heads a KV head, and n
// below 2^31.
void LaunchSpindlekvSelect(const SpindlekvSelectArgs& a, cudaStream_t stream);

}  // namespace penumbra::kernels
