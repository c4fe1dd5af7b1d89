// Device code shared by the attention kernels (prefill and prefix
// attention): online softmax over m16n8 accumulator tiles in the log2 domain,
// P packed as bf16 A fragments, masking, one warpgroup-MMA tile, the
// warpgroup-MMA main loop (WgmmaAttentionLoop) and the generic kernels' row
// loop (GenericAttendRow). The kernels differ only in which query rows a
// block owns, which keys it reads, the mask and where the result goes; those
// are the loops' arguments.
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

// ---- the warpgroup-MMA main loop ------------------------------------------------
//
// A block of 2 warpgroups (kWgThreads) owns kWgBM = 128 query rows, warpgroup
// w rows 64 w .. 64 w + 63. Dynamic shared memory (WgmmaAttentionSmemBytes):
// the Q tile (kWgBM x D), then kWgStages stages of [K tile | V tile] (kWgBN
// keys x D each), all bf16 with the 128-byte swizzle, 1024-byte aligned. K/V
// tiles stream through the stages with cp.async (all 256 threads load, one
// barrier per tile, tile j + 2 loading while tile j computes).
constexpr int kWgBM = 128;  // query rows per block (2 warpgroups x 64)
constexpr int kWgBN = 128;  // keys per tile
constexpr int kWgThreads = 256;
constexpr int kWgStages = 3;

template <int D>
constexpr int WgmmaAttentionSmemBytes() {
  return kWgBM * D * 2 + kWgStages * 2 * kWgBN * D * 2 + 1024;  // + 1024 to align the tiles
}

// The main loop of a block, called by all its threads. smem_addr: the
// dynamic shared memory's address (SmemAddr). load_q(q_s) issues this
// thread's cp.async part of the Q tile at q_s (rows in the kernel's own order,
// Sw128Offset(r, chunk, kWgBM)); the loop commits it. Keys: rows 0 .. n_keys-1
// (n_keys >= 1) of kb and vb, D bf16 each (rows past n_keys read as zero).
// Tile j (first key key0 = j * kWgBN) is skipped by a warpgroup where
// skip_tile(key0) (uniform over the warpgroup), else runs with the functor
// tile_mask(key0) returns (called before the tile's MMAs) scaling S into the
// log2 domain and masking it. On return o, row_m, row_l hold this thread's
// part of its warpgroup's rows as WgmmaAttendTile leaves them (O
// unnormalized, max in the log2 domain, per-thread partial sums). Only for
// sm_90a code.
template <int D, typename LoadQ, typename SkipTile, typename TileMask>
__device__ __forceinline__ void WgmmaAttentionLoop(uint32_t smem_addr, const __nv_bfloat16* kb, const __nv_bfloat16* vb,
                                                   int n_keys, LoadQ load_q, SkipTile skip_tile, TileMask tile_mask,
                                                   float (&o)[D / 8][4], float (&row_m)[2], float (&row_l)[2]) {
  static_assert(D == 64 || D == 128, "wgmma path is for d in {64, 128}");
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr uint32_t kQBytes = kWgBM * D * 2;
  constexpr uint32_t kTileBytes = kWgBN * D * 2;
  constexpr uint32_t kStageBytes = 2 * kTileBytes;    // K tile, then V tile
  const uint32_t q_s = (smem_addr + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
  const uint32_t stage0 = q_s + kQBytes;
  const int tid = threadIdx.x, wg = tid >> 7;
  const int n_tiles = (n_keys + kWgBN - 1) / kWgBN;

  load_q(q_s);
  CpAsyncCommit();
  auto load_tile = [&](int j, int stage) {
    const uint32_t dst = stage0 + stage * kStageBytes;
#pragma unroll
    for (int i = 0; i < kWgBN * kChunks / kWgThreads; ++i) {
      const int c = tid + i * kWgThreads;
      const int r = c / kChunks, ch = c % kChunks;
      const int key = j * kWgBN + r;
      const bool ok = key < n_keys;
      const int64_t off = static_cast<int64_t>(ok ? key : 0) * D + ch * 8;
      CpAsync16(dst + Sw128Offset(r, ch, kWgBN), kb + off, ok ? 16 : 0);
      CpAsync16(dst + kTileBytes + Sw128Offset(r, ch, kWgBN), vb + off, ok ? 16 : 0);
    }
  };
  // Tiles 0 and 1 into stages 0 and 1. One commit group per tile (empty past
  // the end) keeps the wait counts uniform.
  load_tile(0, 0);
  CpAsyncCommit();
  if (n_tiles > 1) load_tile(1, 1);
  CpAsyncCommit();

#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  row_m[0] = row_m[1] = -INFINITY;
  row_l[0] = row_l[1] = 0.0f;                 // per-thread partial sums; quad-reduced by the caller
  const uint32_t q_wg = q_s + wg * 64 * 128;  // this warpgroup's 64 rows, column block 0

  int stage = 0;  // j % kWgStages
  for (int j = 0; j < n_tiles; ++j) {
    const uint32_t k_s = stage0 + stage * kStageBytes;
    const uint32_t v_s = k_s + kTileBytes;
    CpAsyncWait<1>();         // this thread's part of tile j (and Q) has landed
    FenceProxyAsyncShared();  // ... and is visible to the tensor cores
    // Tile j is visible to all, and both warpgroups are done with tile j-1's
    // stage (their wgmma waited), which tile j + 2 now overwrites.
    __syncthreads();
    const int refill = stage == 0 ? kWgStages - 1 : stage - 1;
    if (j + 2 < n_tiles) load_tile(j + 2, refill);
    CpAsyncCommit();
    stage = stage == kWgStages - 1 ? 0 : stage + 1;

    const int key0 = j * kWgBN;
    if (skip_tile(key0)) continue;  // uniform over the warpgroup
    WgmmaAttendTile<D, kWgBM>(q_wg, k_s, v_s, o, row_m, row_l, tile_mask(key0));
  }
}

// ---- the generic kernels' row loop -----------------------------------------------

// One warp's pass over keys key_begin .. key_end-1 (at least one) for one
// query row: qs [d] holds the row scaled by scale*log2(e), os [d] the output
// accumulator (zero on entry; unnormalized O on exit), ps [32] scratch, all
// in shared memory; kb / vb the KV head's rows of d elements. Keys 32 at a time
// (one per lane), online softmax in the log2 domain, f32 accumulation. Returns
// the running max (log2 domain) in m and the sum in l (every lane).
template <typename T>
__device__ __forceinline__ void GenericAttendRow(const float* qs, float* os, float* ps, const T* kb, const T* vb, int d,
                                                 int key_begin, int key_end, int lane, float& m, float& l) {
  m = -INFINITY;
  l = 0.0f;
  for (int c = key_begin; c < key_end; c += 32) {
    const int key = c + lane;
    float s = -INFINITY;
    if (key < key_end) {
      const T* kr = kb + static_cast<int64_t>(key) * d;
      float acc = 0.0f;
      for (int e = 0; e < d; ++e) acc += qs[e] * ToF32(kr[e]);
      s = acc;
    }
    const float m_new = fmaxf(m, WarpMax(s));  // finite: key c is always valid
    const float alpha = exp2f(m - m_new);
    const float p = key < key_end ? exp2f(s - m_new) : 0.0f;
    l = l * alpha + WarpSum(p);
    m = m_new;
    ps[lane] = p;
    __syncwarp();
    const int cnt = min(32, key_end - c);
    for (int e = lane; e < d; e += 32) {
      float acc = os[e] * alpha;
      const T* vc = vb + static_cast<int64_t>(c) * d + e;
      for (int jj = 0; jj < cnt; ++jj) acc += ps[jj] * ToF32(vc[static_cast<int64_t>(jj) * d]);
      os[e] = acc;
    }
    __syncwarp();
  }
}

}  // namespace penumbra::kernels::attention_tile
