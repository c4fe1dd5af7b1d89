// ShadowKV decode, stage 3: the slot update alone (the score kernels fuse it
// after their selection). Contracts in shadowkv_decode.cuh.
#include "kernels/shadowkv_decode.cuh"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <glog/logging.h>
#include <cub/block/block_scan.cuh>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/landmark_format.h"
#include "kernels/mma.cuh"
#include "kernels/shadowkv_decode_common.cuh"
#include "kernels/shadowkv_slot_update.cuh"
#include "kernels/topk.cuh"
#include "kernels/topk_block.cuh"

namespace penumbra::kernels {

namespace {

__global__ void __launch_bounds__(kSlotThreads) SlotUpdateKernel(ShadowkvSlotUpdateArgs a) {
  extern __shared__ __align__(16) uint32_t sm[];
  SlotUpdateRow(a, blockIdx.x, sm);
}

}  // namespace

void LaunchShadowkvSlotUpdate(const ShadowkvSlotUpdateArgs& a, cudaStream_t stream) {
  const int rows = a.batch * a.hkv;
  if (rows <= 0 || a.kslots <= 0) return;
  CHECK_GE(a.selection_stride, a.kslots);
  const size_t smem = SlotUpdateSharedBytes(a);
  const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&SlotUpdateKernel));
  CHECK_LE(smem, static_cast<size_t>(max_dynamic))
      << "ShadowkvSlotUpdate: chunk_cap " << a.chunk_cap << " kslots " << a.kslots << " need too much shared memory";
  SlotUpdateKernel<<<rows, kSlotThreads, smem, stream>>>(a);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
