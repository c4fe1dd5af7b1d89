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

}  // namespace

void LaunchTopK(const TopKArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.k <= 0) return;
  CHECK_LE(a.k, kTopKMaxK);
  CHECK_GE(a.out_stride, a.k);
  const int cached = std::min(std::max(a.max_count, 0), kTopKSharedKeys);
  const int smem = static_cast<int>(topk_block::SharedWords(cached) * sizeof(uint32_t));
  (void)AllowDynamicSharedMemory(reinterpret_cast<const void*>(&TopKKernel));
  TopKKernel<<<a.rows, kThreads, smem, stream>>>(a, cached);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
