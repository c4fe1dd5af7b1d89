// Row-wise top-k by radix select; see topk.cuh for the algorithm.
#include "kernels/topk.cuh"

#include <algorithm>
#include <mutex>
#include <set>
#include <utility>

#include <glog/logging.h>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"

namespace penumbra::kernels {

namespace {

constexpr int kThreads = 1024;  // one block per row: the rows of a decode step (batch x KV heads) fill few SMs
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;

__device__ __forceinline__ uint32_t Key(float v, bool smallest, bool skip) {
  if (isnan(v)) return 0u;
  if (skip && v == (smallest ? INFINITY : -INFINITY)) return 0u;
  const uint32_t u = __float_as_uint(v);
  const uint32_t key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return smallest ? ~key : key;
}

// Dynamic shared memory: hist[kWarps][kBins] u32, then (optionally) the row's
// keys.
__global__ void __launch_bounds__(kThreads) TopKKernel(TopKArgs a, int cached_keys) {
  extern __shared__ __align__(16) uint32_t smem[];
  uint32_t* hist = smem;                     // [kWarps][kBins]
  uint32_t* keys = smem + kWarps * kBins;    // [cached_keys]
  __shared__ uint32_t total[kBins];
  __shared__ int sel_bin, sel_above;
  __shared__ int warp_gt[kWarps], warp_eq[kWarps];

  const int row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int n = a.counts ? a.counts[row / a.rows_per_count] : a.uniform_count;
  n = max(0, min(n, static_cast<int>(a.stride)));
  const float* v = a.values + static_cast<int64_t>(row) * a.stride;
  int32_t* out = a.out + static_cast<int64_t>(row) * a.out_stride;
  const int k = a.k;

  if (n == 0 || (k >= n && !a.skip_worst_inf)) {
    for (int i = tid; i < k; i += kThreads) out[i] = i < n ? i : -1;
    return;
  }
  const int k_sel = min(k, n);
  const bool cached = n <= cached_keys;

  if (cached) {
    // The row's keys into shared memory first, kPreload loads in flight per
    // thread: the histogram passes below synchronize their warps on every
    // element, which serialized the first pass on one global load at a time.
    constexpr int kPreload = 8;
    for (int i0 = 0; i0 < n; i0 += kThreads * kPreload) {
      float x[kPreload];
#pragma unroll
      for (int u = 0; u < kPreload; ++u) {
        const int i = i0 + u * kThreads + tid;
        x[u] = i < n ? v[i] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kPreload; ++u) {
        const int i = i0 + u * kThreads + tid;
        if (i < n) keys[i] = Key(x[u], a.smallest, a.skip_worst_inf);
      }
    }
    __syncthreads();
  }
  uint32_t prefix = 0, prefix_mask = 0;
  int k_rem = k_sel;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < kWarps * kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
    uint32_t* my_hist = hist + warp * kBins;
    // Every lane runs the same number of iterations so that the warp-wide
    // ballot and match are legal.
    for (int i0 = 0; i0 < n; i0 += kThreads) {
      const int i = i0 + tid;
      uint32_t key = 0;
      bool cand = false;
      if (i < n) {
        key = cached ? keys[i] : Key(v[i], a.smallest, a.skip_worst_inf);
        cand = (key & prefix_mask) == prefix;
      }
      const uint32_t bin = (key >> shift) & 0xffu;
      if (__ballot_sync(0xffffffffu, cand) == 0) continue;
      // One atomic per distinct bin of the warp (scores crowd into few bins,
      // and same-address atomics serialize).
      const unsigned peers = __match_any_sync(0xffffffffu, cand ? bin : 0x100u);
      if (cand && lane == __ffs(peers) - 1) atomicAdd(&my_hist[bin], static_cast<uint32_t>(__popc(peers)));
    }
    __syncthreads();
    for (int b = tid; b < kBins; b += kThreads) {
      uint32_t s = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += hist[w * kBins + b];
      total[b] = s;
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l owns bins [8l, 8l + 8); find the bin holding the k_rem-th
      // largest key among the candidates.
      uint32_t local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) local += total[lane * 8 + j];
      // above = sum of `local` over lanes > lane (suffix scan).
      uint32_t incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_down_sync(0xffffffffu, incl, o);
        if (lane + o < 32) incl += y;
      }
      uint32_t cum = incl - local;
      for (int j = 7; j >= 0; --j) {
        const uint32_t c = total[lane * 8 + j];
        if (cum < static_cast<uint32_t>(k_rem) && cum + c >= static_cast<uint32_t>(k_rem)) {
          sel_bin = lane * 8 + j;
          sel_above = static_cast<int>(cum);
        }
        cum += c;
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sel_bin) << shift;
    prefix_mask |= 0xffu << shift;
    k_rem -= sel_above;
    __syncthreads();  // sel_bin / sel_above are rewritten by the next pass
  }
  const uint32_t thresh = prefix;
  // Elements equal to thresh to take, lowest index first (none when thresh is
  // the key of skipped values).
  const int need_eq = a.skip_worst_inf && thresh == 0 ? 0 : k_rem;
  const int taken = k_sel - k_rem + need_eq;
  for (int i = taken + tid; i < k; i += kThreads) out[i] = -1;

  // Output in index order: warp w owns a contiguous strip of the row.
  const int strip = ((n + kWarps - 1) / kWarps + 31) & ~31;
  const int begin = min(n, warp * strip), end = min(n, begin + strip);
  int gt = 0, eq = 0;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    uint32_t key = 0;
    if (i < end) key = cached ? keys[i] : Key(v[i], a.smallest, a.skip_worst_inf);
    gt += __popc(__ballot_sync(0xffffffffu, i < end && key > thresh));
    eq += __popc(__ballot_sync(0xffffffffu, i < end && key == thresh));
  }
  if (lane == 0) {
    warp_gt[warp] = gt;
    warp_eq[warp] = eq;
  }
  __syncthreads();
  int eq_before = 0, sel_before = 0;
  for (int w = 0; w < warp; ++w) {
    sel_before += warp_gt[w] + min(warp_eq[w], max(0, need_eq - eq_before));
    eq_before += warp_eq[w];
  }
  const unsigned lower = (1u << lane) - 1u;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    uint32_t key = 0;
    if (i < end) key = cached ? keys[i] : Key(v[i], a.smallest, a.skip_worst_inf);
    const bool is_eq = i < end && key == thresh;
    const unsigned eq_mask = __ballot_sync(0xffffffffu, is_eq);
    const bool take = (i < end && key > thresh) || (is_eq && eq_before + __popc(eq_mask & lower) < need_eq);
    const unsigned take_mask = __ballot_sync(0xffffffffu, take);
    if (take) out[sel_before + __popc(take_mask & lower)] = i;
    sel_before += __popc(take_mask);
    eq_before += __popc(eq_mask);
  }
}

// Raises a kernel's dynamic shared-memory limit to the device maximum, once per
// (kernel, device); not stream-ordered, costs nothing after the first call.
void AllowSharedMemory(const void* kernel) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  PENUMBRA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert({kernel, dev}).second) return;
  int optin = 0;
  PENUMBRA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes attr{};
  PENUMBRA_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  PENUMBRA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           optin - static_cast<int>(attr.sharedSizeBytes)));
}

}  // namespace

void LaunchTopK(const TopKArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.k <= 0) return;
  CHECK_LE(a.k, kTopKMaxK);
  CHECK_GE(a.out_stride, a.k);
  const int cached = std::min(std::max(a.max_count, 0), kTopKSharedKeys);
  const int smem = static_cast<int>((kWarps * kBins + cached) * sizeof(uint32_t));
  AllowSharedMemory(reinterpret_cast<const void*>(&TopKKernel));
  TopKKernel<<<a.rows, kThreads, smem, stream>>>(a, cached);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
