// Row-wise top-k by radix select; see topk.cuh for the algorithm.
#include "kernels/topk.cuh"

#include <algorithm>

#include <glog/logging.h>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/topk_block.cuh"

namespace penumbra::kernels {

namespace {

using topk_block::kThreads;

struct RowValues {
  const float* v;
  __device__ __forceinline__ float operator()(int i) const { return v[i]; }
};

__global__ void __launch_bounds__(kThreads) TopKKernel(TopKArgs a, int cached_keys) {
  extern __shared__ __align__(16) uint32_t smem[];
  const int row = blockIdx.x;
  int n = a.counts ? a.counts[row / a.rows_per_count] : a.uniform_count;
  n = max(0, min(n, static_cast<int>(a.stride)));
  topk_block::SelectRow(RowValues{a.values + static_cast<int64_t>(row) * a.stride}, n, a.k, a.smallest,
                        a.skip_worst_inf, a.out + static_cast<int64_t>(row) * a.out_stride, smem, cached_keys);
}

// The split path's first pass: block (part, row) selects the top-k of its
// segment of the row into the row's candidates [part * k, part * k + k)
// (ascending row indices, then -1; skipped values never taken).
__global__ void __launch_bounds__(kThreads) TopKSegmentKernel(TopKArgs a, int segment, int parts) {
  extern __shared__ __align__(16) uint32_t smem[];
  const int part = blockIdx.x, row = blockIdx.y;
  int n = a.counts ? a.counts[row / a.rows_per_count] : a.uniform_count;
  n = max(0, min(n, static_cast<int>(a.stride)));
  const int begin = part * segment;
  const int len = max(0, min(segment, n - begin));
  int32_t* cand = a.split_workspace + (static_cast<int64_t>(row) * parts + part) * a.k;
  topk_block::SelectRow(RowValues{a.values + static_cast<int64_t>(row) * a.stride + begin}, len, a.k, a.smallest,
                        /*skip_worst_inf=*/true, cand, smem, segment);
  __syncthreads();  // the selection's writes are visible to the whole block
  for (int j = threadIdx.x; j < a.k; j += kThreads) {
    if (cand[j] >= 0) cand[j] += begin;
  }
}

// A candidate's value: the row's value at the index a segment selected, NaN
// (never taken under skip_worst_inf) for an empty slot.
struct CandidateValues {
  const float* v;
  const int32_t* cand;
  __device__ __forceinline__ float operator()(int i) const {
    const int32_t c = cand[i];
    return c < 0 ? __int_as_float(0x7fc00000) : v[c];
  }
};

// The split path's second pass: one block per row selects among the row's
// parts * k candidates. The candidates' positions increase with their row
// indices (segments in order, each ascending, empty slots skipped), so
// lowest position first is lowest index first and ascending positions are
// ascending indices: the output is the one-block selection's.
__global__ void __launch_bounds__(kThreads) TopKCandidatesKernel(TopKArgs a, int parts, int cached_keys) {
  extern __shared__ __align__(16) uint32_t smem[];
  const int row = blockIdx.x;
  const int32_t* cand = a.split_workspace + static_cast<int64_t>(row) * parts * a.k;
  int32_t* out = a.out + static_cast<int64_t>(row) * a.out_stride;
  topk_block::SelectRow(CandidateValues{a.values + static_cast<int64_t>(row) * a.stride, cand}, parts * a.k, a.k,
                        a.smallest, /*skip_worst_inf=*/true, out, smem, cached_keys);
  __syncthreads();
  for (int j = threadIdx.x; j < a.k; j += kThreads) {
    const int32_t p = out[j];
    if (p >= 0) out[j] = cand[p];
  }
}

}  // namespace

void LaunchTopK(const TopKArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.k <= 0) return;
  CHECK_LE(a.k, kTopKMaxK);
  CHECK_GE(a.out_stride, a.k);
  const int parts = TopKSplitParts(a.max_count, a.k);
  const int64_t need = TopKSplitWorkspaceInts(a.rows, a.max_count, a.k);
  if (a.skip_worst_inf && parts > 1 && a.split_workspace != nullptr && a.split_workspace_ints >= need &&
      a.rows <= 65535) {
    // Few long rows (a decode step's batch x KV heads over a long context)
    // fill few SMs one block per row, and rows beyond the shared-memory keys
    // re-read L2 in every pass: segments select in parallel from shared
    // memory, then one pass per row over their candidates.
    const int segment = TopKSplitSegment(a.k);
    const int seg_smem = static_cast<int>(topk_block::SharedWords(segment) * sizeof(uint32_t));
    (void)AllowDynamicSharedMemory(reinterpret_cast<const void*>(&TopKSegmentKernel));
    TopKSegmentKernel<<<dim3(parts, a.rows), kThreads, seg_smem, stream>>>(a, segment, parts);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
    const int cand_cached = std::min(parts * a.k, kTopKSharedKeys);
    const int cand_smem = static_cast<int>(topk_block::SharedWords(cand_cached) * sizeof(uint32_t));
    (void)AllowDynamicSharedMemory(reinterpret_cast<const void*>(&TopKCandidatesKernel));
    TopKCandidatesKernel<<<a.rows, kThreads, cand_smem, stream>>>(a, parts, cand_cached);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int cached = std::min(std::max(a.max_count, 0), kTopKSharedKeys);
  const int smem = static_cast<int>(topk_block::SharedWords(cached) * sizeof(uint32_t));
  (void)AllowDynamicSharedMemory(reinterpret_cast<const void*>(&TopKKernel));
  TopKKernel<<<a.rows, kThreads, smem, stream>>>(a, cached);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
