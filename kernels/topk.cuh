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
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/topk_args.h"  // TopKArgs, kTopKSharedKeys, kTopKMaxK

namespace penumbra::kernels {

void LaunchTopK(const TopKArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
