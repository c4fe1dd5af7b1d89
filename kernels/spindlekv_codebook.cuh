// SpindleKV's codebooks on CUDA (arguments and semantics:
// spindlekv_compress_args.h): BuildCodebook turns a first prefill's held keys
// or values into a codebook per (KV head, keys or values) problem, Merge adds
// a decode step's new key and value to each (sequence, KV head)'s codebooks.
//
// BuildCodebook, three kernels:
//   1. one block of 1024 threads per (problem, block of rows), a thread per
//      row: the rows' f64 norms (summed in order, as the CPU does), their
//      cosine graph as a bit matrix in shared memory (a Gram matrix of the
//      normalized rows in 128 x 128 tiles, upper triangle, each dot product
//      a sequential f32 sum without FMA so it equals the CPU's bit for bit;
//      the lower triangle by 32 x 32 bit transposes), then the greedy: per
//      round a block-wide argmax of (degree, lowest index), the chosen row's
//      remaining neighbours taken out and the remaining rows' degrees
//      dropped by popcount; once the highest degree is 1 every remaining row
//      is its own entry, in index order, in one scan. Writes block-local
//      references, magnitudes, and the chosen rows and their count to the
//      workspace.
//   2. one block per problem: the exclusive scan of its blocks' counts, the
//      entry count (e_0 when every row is zero).
//   3. one block per (problem, block of rows): the block's entries (the
//      chosen rows normalized again, rounded to the entry dtype) at its
//      offset, its references shifted by it (zero rows: entry 0).
// Per block of B rows: B x d elements read about (B / 128 + 1) times from L2
// for the Gram tiles, B^2 d / 2 multiply-adds, B^2 bits of shared memory.
//
// Merge, in two kernels. The search: `splits` blocks per (sequence, KV head,
// keys or values) share the two-part codebook's entries, each reading its
// share once (a warp eight consecutive entries at a time, a lane d / 32
// elements of each, the eight dot products reduced together) against the new
// row's unit vector, and writes its best (ties: the lowest index) to the
// workspace. The decision: one block per (sequence, KV head) takes the best of
// the splits' for keys then values, then the reference or a new entry, and
// appends the token to the sequence's own part.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/spindlekv_compress_args.h"

namespace penumbra::kernels {

// Whether the kernels take this shape: d a multiple of 32 up to 256, blocks
// of 1 to 1024 rows (Merge ignores `block`).
bool SpindlekvCodebookSupported(int d, int block);

// a.workspace: SpindlekvCodebookWorkspaceBytes(a) bytes.
void LaunchSpindlekvBuildCodebook(const SpindlekvCodebookArgs& a, cudaStream_t stream);
void LaunchSpindlekvMerge(const SpindlekvMergeArgs& a, cudaStream_t stream);

}  // namespace penumbra::kernels
