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
};

}  // namespace penumbra::kernels
