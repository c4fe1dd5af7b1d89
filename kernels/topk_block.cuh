// Block-wide top-k of one row by radix select, shared by the generic top-k
// kernel (kernels/topk.cu) and kernels that compute a row's values on the fly
// (the ShadowKV score-and-select kernel). See topk.cuh for the algorithm and
// its contract. Header-only; included by .cu files only.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace penumbra::kernels::topk_block {

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

// Selects the k largest (smallest) of the row's n values src(0..n-1) into
// out[0..k), ascending indices then -1, with blockDim.x == kThreads. `src` is
// called once per element when n <= cached_keys (the keys are kept in
// shared memory) and up to six times otherwise: it must be cheap and return
// the same value every time. `smem` is the kernel's dynamic shared memory:
// SharedWords(cached_keys) words.
inline constexpr size_t SharedWords(int cached_keys) { return static_cast<size_t>(kWarps) * kBins + cached_keys; }

template <class Src>
__device__ __forceinline__ void SelectRow(const Src& src, int n, int k, bool smallest, bool skip_worst_inf,
                                          int32_t* out, uint32_t* smem, int cached_keys) {
  uint32_t* hist = smem;                   // [kWarps][kBins]
  uint32_t* keys = smem + kWarps * kBins;  // [cached_keys]
  __shared__ uint32_t total[kBins];
  __shared__ int sel_bin, sel_above;
  __shared__ int warp_gt[kWarps], warp_eq[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  if (n == 0 || (k >= n && !skip_worst_inf)) {
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
        x[u] = i < n ? src(i) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kPreload; ++u) {
        const int i = i0 + u * kThreads + tid;
        if (i < n) keys[i] = Key(x[u], smallest, skip_worst_inf);
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
        key = cached ? keys[i] : Key(src(i), smallest, skip_worst_inf);
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
  const int need_eq = skip_worst_inf && thresh == 0 ? 0 : k_rem;
  const int taken = k_sel - k_rem + need_eq;
  for (int i = taken + tid; i < k; i += kThreads) out[i] = -1;

  // Output in index order: warp w owns a contiguous strip of the row.
  const int strip = ((n + kWarps - 1) / kWarps + 31) & ~31;
  const int begin = min(n, warp * strip), end = min(n, begin + strip);
  int gt = 0, eq = 0;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    uint32_t key = 0;
    if (i < end) key = cached ? keys[i] : Key(src(i), smallest, skip_worst_inf);
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
    if (i < end) key = cached ? keys[i] : Key(src(i), smallest, skip_worst_inf);
    const bool is_eq = i < end && key == thresh;
    const unsigned eq_mask = __ballot_sync(0xffffffffu, is_eq);
    const bool take = (i < end && key > thresh) || (is_eq && eq_before + __popc(eq_mask & lower) < need_eq);
    const unsigned take_mask = __ballot_sync(0xffffffffu, take);
    if (take) out[sel_before + __popc(take_mask & lower)] = i;
    sel_before += __popc(take_mask);
    eq_before += __popc(eq_mask);
  }
}

}  // namespace penumbra::kernels::topk_block
