// The ShadowKV slot update of one row, shared by its own kernel
// (shadowkv_slot_update.cu) and the kernels that fuse it after a selection
// (shadowkv_score.cu). Internal to those files.
#pragma once

#include <cstdint>

#include "kernels/shadowkv_decode_common.cuh"

namespace penumbra::kernels {
namespace {
// ============================================================================
// 3. Slot update
// ============================================================================
constexpr int kSlotThreads = 256;

__device__ __forceinline__ bool TestBit(const uint32_t* bits, int c) { return (bits[c >> 5] >> (c & 31)) & 1u; }
__device__ __forceinline__ void SetBit(uint32_t* bits, int c) { atomicOr(&bits[c >> 5], 1u << (c & 31)); }

// Appends, in order, the entries src[i] (i < n) for which pred(src[i]) holds to
// dst starting at *count, while *count < limit. Run by one full warp.
template <typename Pred>
__device__ __forceinline__ void WarpAppend(const int32_t* src, int n, Pred pred, int32_t* dst, int& count, int limit,
                                           int lane) {
  const unsigned lower = (1u << lane) - 1u;
  for (int base = 0; base < n && count < limit; base += 32) {
    const int i = base + lane;
    const int32_t c = i < n ? src[i] : -1;
    const bool ok = i < n && pred(c);
    const unsigned mask = __ballot_sync(0xffffffffu, ok);
    const int pos = count + __popc(mask & lower);
    if (ok && pos < limit) dst[pos] = c;
    count = min(limit, count + __popc(mask));
  }
}

// One row's slot update by the whole block (any blockDim.x that is a multiple
// of 32); `sm`: SlotUpdateSharedBytes() of dynamic shared memory.
__device__ void SlotUpdateRow(const ShadowkvSlotUpdateArgs& a, int row, uint32_t* sm) {
  const int nthreads = blockDim.x;
  const int ks = a.kslots, cap = a.chunk_cap;
  const int words = (cap + 31) / 32;
  uint32_t* prev_bits = sm;
  uint32_t* sel_bits = sm + words;
  int32_t* prev = reinterpret_cast<int32_t*>(sel_bits + words);  // [ks] previous map
  int32_t* sel = prev + ks;                                      // [ks] final selection
  int32_t* free_list = sel + ks;                                 // [ks]
  int32_t* misses = free_list + ks;                              // [ks]
  __shared__ int s_nsel, s_nfree, s_nmiss;

  const int b = row / a.hkv, h = row % a.hkv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int32_t* map = a.slot_maps[b] + static_cast<int64_t>(h) * ks;
  const int32_t* sel_in = a.selection + static_cast<int64_t>(row) * a.selection_stride;
  auto valid = [cap](int32_t c) { return c >= 0 && c < cap; };

  for (int i = tid; i < 2 * words; i += nthreads) sm[i] = 0;
  for (int s = tid; s < ks; s += nthreads) prev[s] = map[s];
  __syncthreads();
  for (int s = tid; s < ks; s += nthreads)
    if (valid(prev[s])) SetBit(prev_bits, prev[s]);
  __syncthreads();

  if (warp == 0) {
    int nsel = 0;
    if (a.force_keep < 0.0f) {
      WarpAppend(sel_in, ks, valid, sel, nsel, ks, lane);
    } else {
      const int keep = min(ks, static_cast<int>(floor(static_cast<double>(a.force_keep) * ks + 0.5)));
      WarpAppend(prev, ks, valid, sel, nsel, keep, lane);
      __syncwarp();
      for (int i = lane; i < nsel; i += 32) SetBit(sel_bits, sel[i]);
      __syncwarp();
      WarpAppend(
          sel_in, ks, [&](int32_t c) { return valid(c) && !TestBit(prev_bits, c); }, sel, nsel, ks, lane);
      WarpAppend(
          sel_in, ks, [&](int32_t c) { return valid(c) && TestBit(prev_bits, c) && !TestBit(sel_bits, c); }, sel, nsel,
          ks, lane);
    }
    if (lane == 0) s_nsel = nsel;
  }
  __syncthreads();
  const int nsel = s_nsel;
  for (int i = tid; i < nsel; i += nthreads) SetBit(sel_bits, sel[i]);
  __syncthreads();

  if (warp == 0) {
    int nfree = 0, nmiss = 0;
    // Free slots, ascending: those whose chunk is not in the new selection.
    const unsigned lower = (1u << lane) - 1u;
    for (int base = 0; base < ks; base += 32) {
      const int s = base + lane;
      const bool is_free = s < ks && !(valid(prev[s]) && TestBit(sel_bits, prev[s]));
      const unsigned mask = __ballot_sync(0xffffffffu, is_free);
      if (is_free) free_list[nfree + __popc(mask & lower)] = s;
      nfree += __popc(mask);
    }
    // Misses, in selection order: selected chunks not in the previous map.
    WarpAppend(
        sel, nsel, [&](int32_t c) { return !TestBit(prev_bits, c); }, misses, nmiss, ks, lane);
    if (lane == 0) {
      s_nfree = nfree;
      s_nmiss = nmiss;
    }
  }
  __syncthreads();
  const int nfree = s_nfree, nmiss = s_nmiss;
  int32_t* mslot = a.miss_slot + static_cast<int64_t>(row) * ks;
  int32_t* mchunk = a.miss_chunk + static_cast<int64_t>(row) * ks;
  for (int i = tid; i < ks; i += nthreads) {
    mslot[i] = i < nmiss ? free_list[i] : -1;
    mchunk[i] = i < nmiss ? misses[i] : -1;
  }
  for (int i = tid; i < nfree; i += nthreads) map[free_list[i]] = i < nmiss ? misses[i] : -1;
  if (tid == 0) a.miss_count[row] = nmiss;
}

inline size_t SlotUpdateSharedBytes(const ShadowkvSlotUpdateArgs& a) {
  const size_t words = (static_cast<size_t>(a.chunk_cap) + 31) / 32;
  return (2 * words + 4 * static_cast<size_t>(a.kslots)) * sizeof(uint32_t);
}

}  // namespace
}  // namespace penumbra::kernels
