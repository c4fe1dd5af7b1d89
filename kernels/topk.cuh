// Row-wise top-k selection (indices of the k largest, or smallest, values of
// each row), deterministic: ties go to the lower index and the k indices are
// written in ascending index order.
//
// Algorithm: one block per row. Each value is mapped to a 32-bit key whose
// unsigned order is the wanted order (NaN ranks last in either mode); a
// radix select over four 8-bit digits (per-warp shared-memory histograms)
// finds the key T of the k-th element and how many elements equal to T are
// needed; a final pass in index order (warp ballots, one block-wide prefix over
// warp totals) writes every element with key > T plus the first needed ones
// with key == T. Rows of up to kTopKSharedKeys elements are loaded into shared
// memory as keys before the first pass (many loads in flight per thread);
// longer rows are re-read from global memory (L2) in each pass. Traffic: 1
// read of the row from DRAM, 4 more from shared memory or L2. Histogram
// updates are aggregated per warp and bin (__match_any_sync).
//
// Split path (TopKArgs::split_workspace, skip_worst_inf, rows longer than
// kTopKSharedKeys): a decode step's rows are few (batch x KV heads) and, at
// a million tokens a GPU, 131072 chunks long, so one block per row leaves
// most SMs idle and re-reads each row from L2 in every pass. Instead block
// (segment, row) selects the top-k of a segment of TopKSplitSegment(k)
// elements from shared memory, and one block per row then selects among
// the segments' k candidates each. Exact: an element among a row's top k
// has fewer than k elements ranked above it in its segment, so it is among
// its segment's candidates; the candidates keep the row's index order, so
// ties and the output order are the one-block selection's.
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/topk_args.h"  // TopKArgs, kTopKSharedKeys, kTopKMaxK

namespace penumbra::kernels {

void LaunchTopK(const TopKArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
