// ShadowKV decode, stages 5-6: the missed chunks' values fetched from the
// value store (zero copy) or scattered from a staging buffer. Contracts in
// shadowkv_decode.cuh.
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
#include "kernels/topk.cuh"
#include "kernels/topk_block.cuh"
#include "kernels/value_format.h"
#include "kernels/value_fp8.cuh"

namespace penumbra::kernels {

namespace {

// ============================================================================
// 5./6. Value fetch / scatter
// ============================================================================
// The copy is PCIe-latency bound, not SM bound: a few SMs with enough 16-byte
// loads in flight (kFetchMaxBlocks x 256 threads x kFetchUnroll x 16 B = 1 MiB)
// saturate the link, and the rest of the GPU stays free for the K rebuild on
// the other stream and for other lanes' kernels. (One block per 8 misses, as
// before, filled every SM with threads waiting on PCIe.)
// The work is the misses only: each block first scans the per-row miss counts
// into a prefix in shared memory, then its threads copy vectors v, v + T, ...
// of the flattened [miss][vector] space, finding each miss's row by binary
// search. A step with few misses (a high hit rate) costs little more than the
// launch, where walking the [row][max_misses] space cost ~0.1 ms per layer.
// Width measured with two lanes at the natural hit rate (124928 x 14, H200):
// 16 blocks 54.9 ms per step, 32 blocks 51.5, 64 blocks 56.7.
constexpr int kFetchThreads = 256;
constexpr int kFetchUnroll = 8;  // 16-byte loads in flight per thread
constexpr int kFetchMaxBlocks = 32;

using FetchScan = cub::BlockScan<int32_t, kFetchThreads>;

// s_first[r] = the first miss of row r in the flattened list of every row's
// misses; s_first[rows] = their total. Ends with __syncthreads.
__device__ __forceinline__ void ScanMisses(const ShadowkvFetchVArgs& a, int32_t* s_first,
                                           typename FetchScan::TempStorage& scan_tmp) {
  const int rows = a.batch * a.hkv;
  const int per = (rows + kFetchThreads - 1) / kFetchThreads;
  const int lo = min(rows, static_cast<int>(threadIdx.x) * per), hi = min(rows, lo + per);
  int32_t sum = 0;
  for (int r = lo; r < hi; ++r) sum += min(max(a.miss_count[r], 0), a.max_misses);
  int32_t off = 0;
  FetchScan(scan_tmp).ExclusiveSum(sum, off);
  for (int r = lo; r < hi; ++r) {
    s_first[r] = off;
    off += min(max(a.miss_count[r], 0), a.max_misses);
  }
  if (threadIdx.x == kFetchThreads - 1) s_first[rows] = off;  // its range is the last (or empty): off = total
  __syncthreads();
}

// Miss `item` of the flattened list: its row, the chunk row it reads
// (`chunk_bytes` a row) and the first V row of its slot.
struct MissAt {
  int b, h;
  const char* src;
  char* dst;  // V row of the slot's first token (elem_bytes elements)
};
__device__ __forceinline__ MissAt LocateMiss(const ShadowkvFetchVArgs& a, const int32_t* s_first, int item,
                                             int64_t chunk_bytes, int elem_bytes) {
  const int rows = a.batch * a.hkv;
  int lo = 0, hi = rows;  // the row with s_first[row] <= item < s_first[row + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (s_first[mid] <= item)
      lo = mid;
    else
      hi = mid;
  }
  const int row = lo, m = item - s_first[row];
  MissAt r;
  r.b = row / a.hkv;
  r.h = row % a.hkv;
  const int64_t at = static_cast<int64_t>(row) * a.miss_stride + m;
  if (a.staging) {
    const int64_t base = a.staging_offsets ? a.staging_offsets[row] : static_cast<int64_t>(row) * a.miss_stride;
    r.src = static_cast<const char*>(a.staging) + (base + m) * chunk_bytes;
  } else {
    const int64_t c = a.miss_chunk[at];
    if (c < a.shared_chunks) {
      r.src = static_cast<const char*>(a.shared_store[r.b]) +
              (static_cast<int64_t>(r.h) * a.shared_stride + c) * chunk_bytes;
    } else {
      r.src = static_cast<const char*>(a.value_store[r.b]) +
              (static_cast<int64_t>(r.h) * a.chunk_cap + c - a.shared_chunks) * chunk_bytes;
    }
  }
  const int64_t row0 = a.outlier_rows + static_cast<int64_t>(a.miss_slot[at]) * a.chunk_size;
  r.dst = static_cast<char*>(a.att_v[r.b]) + (r.h * a.att_head_stride + row0 * a.d) * elem_bytes;
  return r;
}

__global__ void __launch_bounds__(kFetchThreads) FetchVKernel(ShadowkvFetchVArgs a, int nvec, int elem_bytes) {
  extern __shared__ int32_t s_first[];  // [rows + 1]: first miss of each row in the flattened list
  __shared__ typename FetchScan::TempStorage scan_tmp;
  ScanMisses(a, s_first, scan_tmp);
  const int rows = a.batch * a.hkv;
  const int64_t total = static_cast<int64_t>(s_first[rows]) * nvec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFetchThreads;
  const int64_t chunk_bytes = static_cast<int64_t>(nvec) * 16;
  for (int64_t v0 = static_cast<int64_t>(blockIdx.x) * kFetchThreads + threadIdx.x; v0 < total;
       v0 += stride * kFetchUnroll) {
    uint4 buf[kFetchUnroll];
    uint4* dst[kFetchUnroll];
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u) {
      dst[u] = nullptr;
      const int64_t v = v0 + u * stride;
      if (v >= total) continue;
      const int item = static_cast<int>(v / nvec);
      const int vi = static_cast<int>(v - static_cast<int64_t>(item) * nvec);
      const MissAt m = LocateMiss(a, s_first, item, chunk_bytes, elem_bytes);
      buf[u] = __ldcs(reinterpret_cast<const uint4*>(m.src) + vi);
      dst[u] = reinterpret_cast<uint4*>(m.dst) + vi;
    }
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u)
      if (dst[u]) *dst[u] = buf[u];
  }
}

// Values in device memory (ShadowkvFetchVArgs::values_on_device): no link to
// keep busy, so the copy is bound by the SMs' instructions, and FetchVKernel's
// lookup of every 16-byte vector's miss (a binary search over the rows, two
// divisions, the miss lists' loads) costs more than the copy. Here a warp
// looks its miss up once and copies the chunk's vectors with its 32 lanes.
__global__ void __launch_bounds__(kFetchThreads) FetchVWarpKernel(ShadowkvFetchVArgs a, int nvec, int elem_bytes) {
  extern __shared__ int32_t s_first[];  // [rows + 1]: first miss of each row in the flattened list
  __shared__ typename FetchScan::TempStorage scan_tmp;
  ScanMisses(a, s_first, scan_tmp);
  const int total = s_first[a.batch * a.hkv];
  constexpr int kWarps = kFetchThreads / 32;
  const int lane = threadIdx.x & 31;
  const int64_t chunk_bytes = static_cast<int64_t>(nvec) * 16;
  for (int item = blockIdx.x * kWarps + static_cast<int>(threadIdx.x >> 5); item < total; item += gridDim.x * kWarps) {
    const MissAt m = LocateMiss(a, s_first, item, chunk_bytes, elem_bytes);
    const uint4* src = reinterpret_cast<const uint4*>(m.src);
    uint4* dst = reinterpret_cast<uint4*>(m.dst);
    for (int v0 = lane; v0 < nvec; v0 += 32 * kFetchUnroll) {
      uint4 buf[kFetchUnroll];
#pragma unroll
      for (int u = 0; u < kFetchUnroll; ++u)
        if (v0 + 32 * u < nvec) buf[u] = __ldcs(src + v0 + 32 * u);
#pragma unroll
      for (int u = 0; u < kFetchUnroll; ++u)
        if (v0 + 32 * u < nvec) dst[v0 + 32 * u] = buf[u];
    }
  }
}

// skip_shared (the attention reads the attached document's chunks in place):
// only the sequences' own chunks are copied, a few of the misses. No scan and
// no search: a warp takes 32 entries of the dense [row][max_misses] lists, a
// lane each (one load of the chunk id), and copies the own chunks among them
// one after another with its 32 lanes. Walking the compacted list with a
// search per miss, as FetchVWarpKernel does, to skip the document's chunks
// took as long as the key rebuild beside it at 64 x 124928 (H200).
__global__ void __launch_bounds__(kFetchThreads) FetchVOwnKernel(ShadowkvFetchVArgs a, int nvec, int elem_bytes) {
  constexpr int kWarps = kFetchThreads / 32;
  const int lane = threadIdx.x & 31;
  const int64_t total = static_cast<int64_t>(a.batch) * a.hkv * a.max_misses;
  const int64_t chunk_bytes = static_cast<int64_t>(nvec) * 16;
  for (int64_t e0 = (static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * 32; e0 < total;
       e0 += static_cast<int64_t>(gridDim.x) * kWarps * 32) {
    const int64_t e = e0 + lane;
    const char* src = nullptr;
    char* dst = nullptr;
    if (e < total) {
      const int row = static_cast<int>(e / a.max_misses),
                m = static_cast<int>(e - static_cast<int64_t>(row) * a.max_misses);
      const int64_t at = static_cast<int64_t>(row) * a.miss_stride + m;
      const int64_t c = m < min(max(a.miss_count[row], 0), a.miss_stride) ? a.miss_chunk[at] : -1;
      if (c >= a.shared_chunks) {
        const int b = row / a.hkv, h = row % a.hkv;
        src = static_cast<const char*>(a.value_store[b]) +
              (static_cast<int64_t>(h) * a.chunk_cap + c - a.shared_chunks) * chunk_bytes;
        const int64_t row0 = a.outlier_rows + static_cast<int64_t>(a.miss_slot[at]) * a.chunk_size;
        dst = static_cast<char*>(a.att_v[b]) + (h * a.att_head_stride + row0 * a.d) * elem_bytes;
      }
    }
    uint32_t todo = __ballot_sync(0xffffffffu, src != nullptr);
    while (todo != 0) {
      const int l = __ffs(todo) - 1;
      todo &= todo - 1;
      const uint4* s = reinterpret_cast<const uint4*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(src), l));
      uint4* d = reinterpret_cast<uint4*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dst), l));
      for (int v = lane; v < nvec; v += 32) d[v] = __ldcs(s + v);
    }
  }
}

// The same over fp8 rows (value_format.h): each thread loads 16 codes and
// their token's scale (the 8 threads of a token's vectors share one load's
// line), and writes 16 values of T: half the bytes cross the host link.
template <typename T>
__global__ void __launch_bounds__(kFetchThreads) FetchVFp8Kernel(ShadowkvFetchVArgs a, int nvec) {
  extern __shared__ int32_t s_first[];
  __shared__ typename FetchScan::TempStorage scan_tmp;
  ScanMisses(a, s_first, scan_tmp);
  const int rows = a.batch * a.hkv;
  const int64_t total = static_cast<int64_t>(s_first[rows]) * nvec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFetchThreads;
  const int64_t codes = static_cast<int64_t>(a.chunk_size) * a.d;
  const int64_t chunk_bytes = ValueRowBytesFp8(a.chunk_size, a.d);
  for (int64_t v0 = static_cast<int64_t>(blockIdx.x) * kFetchThreads + threadIdx.x; v0 < total;
       v0 += stride * kFetchUnroll) {
    uint4 buf[kFetchUnroll];
    float scale[kFetchUnroll];
    T* dst[kFetchUnroll];
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u) {
      dst[u] = nullptr;
      const int64_t v = v0 + u * stride;
      if (v >= total) continue;
      const int item = static_cast<int>(v / nvec);
      const int vi = static_cast<int>(v - static_cast<int64_t>(item) * nvec);
      const MissAt m = LocateMiss(a, s_first, item, chunk_bytes, static_cast<int>(sizeof(T)));
      buf[u] = __ldcs(reinterpret_cast<const uint4*>(m.src) + vi);
      scale[u] = __ldcs(reinterpret_cast<const float*>(m.src + codes) + (vi * 16) / a.d);
      dst[u] = reinterpret_cast<T*>(m.dst) + static_cast<int64_t>(vi) * 16;
    }
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u) {
      if (!dst[u]) continue;
      const uint8_t* c = reinterpret_cast<const uint8_t*>(&buf[u]);
      alignas(16) T out[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) out[k] = FromF32<T>(__fmul_rn(E4M3Value(c[k]), scale[u]));
#pragma unroll
      for (int k = 0; k < static_cast<int>(16 * sizeof(T) / 16); ++k) {
        reinterpret_cast<uint4*>(dst[u])[k] = reinterpret_cast<const uint4*>(out)[k];
      }
    }
  }
}

template <typename T>
void LaunchFetchVFp8(const ShadowkvFetchVArgs& a, int blocks, size_t smem, int nvec, cudaStream_t stream) {
  const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&FetchVFp8Kernel<T>));
  CHECK_LE(smem, static_cast<size_t>(max_dynamic)) << "ShadowkvFetchV: " << a.batch * a.hkv << " rows is too many";
  FetchVFp8Kernel<T><<<blocks, kFetchThreads, smem, stream>>>(a, nvec);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void LaunchShadowkvFetchV(const ShadowkvFetchVArgs& a, cudaStream_t stream) {
  const int rows = a.batch * a.hkv;
  if (rows <= 0 || a.max_misses <= 0) return;
  CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF32) << "ShadowkvFetchV: dtype";
  CHECK(!a.skip_shared || (a.values_on_device && !a.values_fp8 && a.staging == nullptr))
      << "ShadowkvFetchV: skip_shared is for bf16/f32 values in device memory";
  const int elem_bytes = static_cast<int>(DTypeSize(a.dtype));
  const int max_blocks = a.max_blocks > 0 ? a.max_blocks : kFetchMaxBlocks;
  const int64_t per_block = static_cast<int64_t>(kFetchThreads) * kFetchUnroll;
  const size_t smem = sizeof(int32_t) * (static_cast<size_t>(rows) + 1);
  if (a.values_fp8) {
    CHECK_EQ(a.d % 16, 0) << "ShadowkvFetchV: fp8 values need d % 16 == 0";
    const int nvec = a.chunk_size * a.d / 16;  // 16 codes a vector
    const int64_t total = static_cast<int64_t>(rows) * a.max_misses * nvec;
    const int blocks = static_cast<int>(std::clamp<int64_t>((total + per_block - 1) / per_block, 1, max_blocks));
    if (a.dtype == DType::kBF16) {
      LaunchFetchVFp8<__nv_bfloat16>(a, blocks, smem, nvec, stream);
    } else {
      LaunchFetchVFp8<float>(a, blocks, smem, nvec, stream);
    }
    return;
  }
  CHECK_EQ(static_cast<int64_t>(a.chunk_size) * a.d * elem_bytes % 16, 0) << "ShadowkvFetchV: chunk bytes";
  CHECK_EQ(static_cast<int64_t>(a.d) * elem_bytes % 16, 0) << "ShadowkvFetchV: V rows must be 16-byte aligned";
  const int nvec = static_cast<int>(static_cast<int64_t>(a.chunk_size) * a.d * elem_bytes / 16);
  const int64_t total = static_cast<int64_t>(rows) * a.max_misses * nvec;
  const int blocks = static_cast<int>(std::clamp<int64_t>((total + per_block - 1) / per_block, 1, max_blocks));
  if (a.skip_shared) {
    const int64_t warps = (static_cast<int64_t>(rows) * a.max_misses + 31) / 32;
    const int oblocks =
        static_cast<int>(std::clamp<int64_t>((warps + kFetchThreads / 32 - 1) / (kFetchThreads / 32), 1, max_blocks));
    FetchVOwnKernel<<<oblocks, kFetchThreads, 0, stream>>>(a, nvec, elem_bytes);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (a.values_on_device) {
    const int64_t warps = static_cast<int64_t>(rows) * a.max_misses;  // one per miss at most
    const int wblocks =
        static_cast<int>(std::clamp<int64_t>((warps + kFetchThreads / 32 - 1) / (kFetchThreads / 32), 1, max_blocks));
    const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&FetchVWarpKernel));
    CHECK_LE(smem, static_cast<size_t>(max_dynamic)) << "ShadowkvFetchV: " << rows << " rows (batch x hkv) is too many";
    FetchVWarpKernel<<<wblocks, kFetchThreads, smem, stream>>>(a, nvec, elem_bytes);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&FetchVKernel));
  CHECK_LE(smem, static_cast<size_t>(max_dynamic)) << "ShadowkvFetchV: " << rows << " rows (batch x hkv) is too many";
  FetchVKernel<<<blocks, kFetchThreads, smem, stream>>>(a, nvec, elem_bytes);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
