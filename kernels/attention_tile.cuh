// Device helpers shared by the tensor-core attention kernels (prefill and
// prefix attention): online softmax over m16n8 accumulator tiles in the log2
// domain, P packed as bf16 A fragments, masking.
//
// Both tensor-core paths keep a 16-row slice of S and O per warp in the m16n8
// accumulator layout (lane = 4 g + t4): x[i][e] is row g + 8 (e / 2), column
// 8 i + 2 t4 + e % 2.
#pragma once
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/mma.cuh"
#include "kernels/wgmma.cuh"

namespace penumbra::kernels::attention_tile {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Scales S into the log2 domain and, when need_mask, masks keys past each
// row's position (pos_g: absolute position of row g; key0: the tile's first key).
template <int NB>
__device__ __forceinline__ void ScaleAndMask(float (&s)[NB][4], float scale_log2, bool need_mask, int key0, int t4,
                                             int pos_g) {
#pragma unroll
  for (int i = 0; i < NB; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[i][e] * scale_log2;
      if (need_mask && key0 + i * 8 + 2 * t4 + (e & 1) > pos_g + (e >> 1) * 8) x = -INFINITY;
      s[i][e] = x;
    }
  }
}

// Scales S into the log2 domain and, when need_mask, masks keys at or past
// key_limit for every row (no causal mask: prefix attention).
template <int NB>
__device__ __forceinline__ void ScaleAndMaskFrom(float (&s)[NB][4], float scale_log2, bool need_mask, int key0, int t4,
                                                 int key_limit) {
#pragma unroll
  for (int i = 0; i < NB; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[i][e] * scale_log2;
      if (need_mask && key0 + i * 8 + 2 * t4 + (e & 1) >= key_limit) x = -INFINITY;
      s[i][e] = x;
    }
  }
}

// Online softmax over one tile for rows g (e = 0, 1) and g + 8 (e = 2, 3): S
// becomes P = exp2(S - running max), O and the per-thread partial sums are
// rescaled. Key 0 is visible to every row and tile 0 always runs, so the
// running max is finite after the first tile.
template <int NB, int NO>
__device__ __forceinline__ void OnlineSoftmax(float (&s)[NB][4], float (&o)[NO][4], float (&row_m)[2],
                                              float (&row_l)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_m[h];
#pragma unroll
    for (int i = 0; i < NB; ++i) mx = fmaxf(mx, fmaxf(s[i][2 * h], s[i][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float alpha = exp2f(row_m[h] - mx);
    row_m[h] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      s[i][2 * h] = exp2f(s[i][2 * h] - mx);
      s[i][2 * h + 1] = exp2f(s[i][2 * h + 1] - mx);
      sum += s[i][2 * h] + s[i][2 * h + 1];
    }
    row_l[h] = row_l[h] * alpha + sum;
#pragma unroll
    for (int i = 0; i < NO; ++i) {
      o[i][2 * h] *= alpha;
      o[i][2 * h + 1] *= alpha;
    }
  }
}

// P's bf16 A fragment for k16 step kk (accumulator blocks 2 kk and 2 kk + 1):
// the accumulator layout is the A-fragment layout.
template <int NB>
__device__ __forceinline__ void PackP(const float (&s)[NB][4], int kk, uint32_t (&a)[4]) {
  a[0] = PackBf16(s[2 * kk][0], s[2 * kk][1]);
  a[1] = PackBf16(s[2 * kk][2], s[2 * kk][3]);
  a[2] = PackBf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = PackBf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// One K/V tile of the warpgroup-MMA attention loop (Hopper) for a
// warpgroup's 64 query rows: S[64 x 128] = Q K^T with Q (q_wg: this
// warpgroup's rows of a QRows x D tile) and K (k_s: a 128 x D tile) in shared
// memory, both K-major with the 128-byte swizzle; scale_mask(s) scales S into
// the log2 domain and masks it; online softmax; O[64 x D] += P V with P from
// registers and V (v_s) MN-major. Used by the prefill and prefix kernels;
// instantiated only in their sm_90a code.
template <int D, int QRows, typename ScaleMask>
__device__ __forceinline__ void WgmmaAttendTile(uint32_t q_wg, uint32_t k_s, uint32_t v_s, float (&o)[D / 8][4],
                                                float (&row_m)[2], float (&row_l)[2], ScaleMask scale_mask) {
  constexpr int kBN = 128;  // keys per tile
  float s[kBN / 8][4];
  WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t col = static_cast<uint32_t>(kk & 3) * 32u;  // k16 step inside a column block
    const uint64_t da = Sw128Desc(q_wg + (kk >> 2) * QRows * 128 + col, 0, 1024);
    const uint64_t db = Sw128Desc(k_s + (kk >> 2) * kBN * 128 + col, 0, 1024);
    WgmmaSS64x128(s, da, db, kk > 0 ? 1 : 0);
  }
  WgmmaCommit();
  WgmmaWait<0>();
  WgmmaFenceOperands(s);
  scale_mask(s);
  OnlineSoftmax(s, o, row_m, row_l);
  // O += P V: P as bf16 A fragments, k16 step kk = accumulator blocks 2 kk, 2 kk + 1.
  uint32_t p[kBN / 16][4];
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) PackP(s, kk, p[kk]);
  WgmmaFenceOperands(o);
  WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) {
    const uint64_t dv = Sw128Desc(v_s + kk * 16 * 128, kBN * 128, 1024);
    if constexpr (D == 128)
      WgmmaRS64x128T(o, p[kk], dv, 1);
    else
      WgmmaRS64x64T(o, p[kk], dv, 1);
  }
  WgmmaCommit();
  WgmmaWait<0>();
  WgmmaFenceOperands(o);
}

}  // namespace penumbra::kernels::attention_tile
