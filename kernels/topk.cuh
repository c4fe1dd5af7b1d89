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
#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace penumbra::kernels {

// Rows up to this many elements keep their keys in shared memory.
inline constexpr int kTopKSharedKeys = 32768;
// Largest supported k.
inline constexpr int kTopKMaxK = 4096;

struct TopKArgs {
  const float* values = nullptr;  // [rows, stride] f32
  int64_t stride = 0;             // elements between rows (>= every row's count)
  int rows = 0;
  // Per-row element count: counts[row / rows_per_count] when counts is not
  // null (device array, e.g. one count per sequence for rows = batch * heads),
  // otherwise uniform_count. Elements [count, stride) of a row are ignored.
  const int32_t* counts = nullptr;
  int rows_per_count = 1;
  int uniform_count = 0;
  int max_count = 0;  // host-side upper bound of every count (sizes shared memory)
  int k = 0;          // 1..kTopKMaxK
  bool smallest = false;  // false: k largest; true: k smallest
  // Never select NaN nor the worst infinity (-inf when largest, +inf when
  // smallest), e.g. chunks a score marked unselectable; rows with fewer than k
  // other elements get -1 after their selection.
  bool skip_worst_inf = false;
  // [rows, out_stride] int32: the min(k, count) selected indices ascending,
  // then -1 up to k (fewer with skip_worst_inf).
  int32_t* out = nullptr;
  int64_t out_stride = 0;  // >= k
};

void LaunchTopK(const TopKArgs& args, cudaStream_t stream);

}  // namespace penumbra::kernels
