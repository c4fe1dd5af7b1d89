// Arguments of the row-wise top-k kernel (kernels/topk.cuh holds the
// algorithm and the launcher). Plain C++, no CUDA headers: the engine's op
// table (worker/engine/backend.h) carries these, CPU-only builds included.
#pragma once
#include <cstddef>
#include <cstdint>

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
  int max_count = 0;      // host-side upper bound of every count (sizes shared memory)
  int k = 0;              // 1..kTopKMaxK
  bool smallest = false;  // false: k largest; true: k smallest
  // Never select NaN nor the worst infinity (-inf when largest, +inf when
  // smallest), e.g. chunks a score marked unselectable; rows with fewer than k
  // other elements get -1 after their selection.
  bool skip_worst_inf = false;
  // [rows, out_stride] int32: the min(k, count) selected indices ascending,
  // then -1 up to k (fewer with skip_worst_inf).
  int32_t* out = nullptr;
  int64_t out_stride = 0;  // >= k
  // Optional device workspace of TopKSplitWorkspaceInts(rows, max_count, k)
  // int32s. With it, rows longer than kTopKSharedKeys are cut into
  // segments that select in parallel and a second pass selects among their
  // candidates (kernels/topk.cuh), with the same output; without it (or for
  // shorter rows, or without skip_worst_inf) one block selects each row.
  int32_t* split_workspace = nullptr;
  int64_t split_workspace_ints = 0;
};

// The split path's segment length for k: long enough that the candidates
// (k per segment) are at most an eighth of the row, short enough that a
// segment's keys stay in shared memory.
inline constexpr int TopKSplitSegment(int k) { return k * 8 > 8192 ? k * 8 : 8192; }
// Segments of a row of max_count elements on the split path; 1: no split.
inline constexpr int TopKSplitParts(int max_count, int k) {
  return max_count > kTopKSharedKeys && k > 0 ? (max_count + TopKSplitSegment(k) - 1) / TopKSplitSegment(k) : 1;
}
// Workspace the split path needs (0: it does not split these rows).
inline constexpr int64_t TopKSplitWorkspaceInts(int rows, int max_count, int k) {
  const int parts = TopKSplitParts(max_count, k);
  return parts > 1 ? static_cast<int64_t>(rows) * parts * k : 0;
}
// An upper bound of TopKSplitWorkspaceInts over every k <= kTopKMaxK, per
// row (parts * k <= max_count / 8 + k): what a caller sizing its workspace
// before it knows k reserves.
inline constexpr int64_t TopKSplitWorkspaceIntsPerRow(int max_count) {
  return max_count > kTopKSharedKeys ? static_cast<int64_t>(max_count) / 8 + kTopKMaxK : 0;
}

}  // namespace penumbra::kernels
