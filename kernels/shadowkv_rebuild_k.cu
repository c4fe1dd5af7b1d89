// ShadowKV decode, stage 4: the missed chunks' keys rebuilt from the low-rank
// factors (K = A*B + RoPE). Contracts in shadowkv_decode.cuh.
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

namespace penumbra::kernels {

namespace {

// Token t's A row of sequence b (see ShadowkvRebuildKArgs).
template <typename T>
struct ARows {
  const T* shared;
  const T* own;
  int64_t split;
  int r;
  __device__ ARows(const ShadowkvRebuildKArgs& a, int b)
      : split(static_cast<int64_t>(a.shared_chunks) * a.chunk_size), r(a.r) {
    own = static_cast<const T*>(a.a[b]);
    shared = split > 0 ? static_cast<const T*>(a.shared_a[b]) : own;
  }
  __device__ const T* Row(int64_t t) const { return t < split ? shared + t * r : own + (t - split) * r; }
};

// ============================================================================
// 4. Key rebuild
// ============================================================================
constexpr int kSimtThreads = 128;
constexpr int kSimtTokens = 8;  // tokens per inner tile of the SIMT path

// SIMT path: one block per miss; tiles of 8 tokens; A tile and the pre-RoPE
// result in shared memory (f32), B read through L1/L2.
template <typename T>
__global__ void __launch_bounds__(kSimtThreads) RebuildKSimtKernel(ShadowkvRebuildKArgs a) {
  extern __shared__ __align__(16) float smf[];
  const int r = a.r, d = a.d, C = a.chunk_size, half = a.d / 2;
  float* As = smf;                    // [kSimtTokens][r]
  float* Xs = smf + kSimtTokens * r;  // [kSimtTokens][d]
  const int row = blockIdx.y, m = blockIdx.x;
  if (m >= a.miss_count[row]) return;
  const int b = row / a.hkv, h = row % a.hkv;
  const int slot = a.miss_slot[static_cast<int64_t>(row) * a.miss_stride + m];
  const int chunk = a.miss_chunk[static_cast<int64_t>(row) * a.miss_stride + m];
  const ARows<T> A(a, b);
  const T* Bh = static_cast<const T*>(a.b[b]) + static_cast<int64_t>(h) * r * d;
  T* K = static_cast<T*>(a.att_k[b]) + h * a.att_head_stride +
         (static_cast<int64_t>(a.outlier_rows) + static_cast<int64_t>(slot) * C) * d;
  const int32_t offset = a.position_offset ? a.position_offset[b] : 0;
  const int tid = threadIdx.x;

  for (int i0 = 0; i0 < C; i0 += kSimtTokens) {
    const int nt = min(kSimtTokens, C - i0);
    const int64_t t0 = static_cast<int64_t>(chunk) * C + i0;
    for (int idx = tid; idx < kSimtTokens * r; idx += kSimtThreads) {
      const int u = idx / r, k = idx - u * r;
      As[idx] = u < nt ? ToF32(A.Row(t0 + u)[k]) : 0.0f;
    }
    __syncthreads();
    for (int j = tid; j < d; j += kSimtThreads) {
      float acc[kSimtTokens];
#pragma unroll
      for (int u = 0; u < kSimtTokens; ++u) acc[u] = 0.0f;
      for (int k = 0; k < r; ++k) {
        const float bv = ToF32(Bh[static_cast<int64_t>(k) * d + j]);
#pragma unroll
        for (int u = 0; u < kSimtTokens; ++u) acc[u] = fmaf(As[u * r + k], bv, acc[u]);
      }
#pragma unroll
      for (int u = 0; u < kSimtTokens; ++u) Xs[u * d + j] = acc[u];
    }
    __syncthreads();
    for (int idx = tid; idx < nt * half; idx += kSimtThreads) {
      const int u = idx / half, j = idx - u * half;
      const int32_t pos = static_cast<int32_t>(t0 + u) + offset;
      float sn, cs;
      sincosf(static_cast<float>(pos) * a.inv_freq[j], &sn, &cs);
      const float x1 = Xs[u * d + j], x2 = Xs[u * d + j + half];
      T* dst = K + static_cast<int64_t>(i0 + u) * d;
      dst[j] = FromF32<T>(x1 * cs - x2 * sn);
      dst[j + half] = FromF32<T>(x2 * cs + x1 * sn);
    }
    __syncthreads();
  }
}

// Tensor-core path (bf16, d % 64 == 0, r % 8 == 0). A block owns tiles of 64
// miss tokens of one (sequence, KV head) row, tiles blockIdx.x, + gridDim.x, ...
// Warps: 4 along the tile's rows (16 each) x d/64 along the columns; warp wn
// owns columns [32 wn, 32 wn + 32) and the same 32 columns of the upper half
// (+ d/2), so that RoPE's pairs (j, j + d/2) meet in one thread's accumulators
// and are rotated and stored straight from registers.
// Shared memory: B[h] as [kpad][d + 8] (k rows, zero past r; fragments by
// ldmatrix.trans), `stages` A tiles of [64][kpad + 8] gathered by cp.async
// (the next tile's gather is in flight while this one is multiplied and
// rotated), and the tile's (chunk, slot) lists, double-buffered. Both row
// strides are an odd number of 16-byte units, so ldmatrix is conflict-free.
// Measured before this layout (PENUMBRA_KERNEL_BENCH): one tile at a time with
// a shared-memory round trip for RoPE took ~8 us per tile, and its blocks
// held 56 SMs for ~100 us of every lane-layer at 124928 x 14.
constexpr int kRebuildTileRows = 64;
constexpr int kRebuildRowWarps = kRebuildTileRows / 16;

struct RebuildSmem {
  int kpad, a_stride, b_stride, stages;
  size_t b_bytes, a_bytes, idx_bytes;
  size_t total() const { return b_bytes + static_cast<size_t>(stages) * a_bytes + idx_bytes; }
};
RebuildSmem RebuildSmemLayout(int r, int d, int stages) {
  RebuildSmem s{};
  s.kpad = (r + 15) / 16 * 16;
  s.a_stride = s.kpad + 8;
  s.b_stride = d + 8;
  s.stages = stages;
  s.b_bytes = static_cast<size_t>(s.kpad) * s.b_stride * sizeof(bf16);
  s.a_bytes = static_cast<size_t>(kRebuildTileRows) * s.a_stride * sizeof(bf16);
  s.idx_bytes = 2 * 2 * kRebuildTileRows * sizeof(int32_t);
  return s;
}

__global__ void __launch_bounds__(512) RebuildKMmaKernel(ShadowkvRebuildKArgs a, RebuildSmem L) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  extern __shared__ __align__(16) unsigned char smem[];
  const int r = a.r, d = a.d, C = a.chunk_size, half = d / 2;
  const int kpad = L.kpad;
  bf16* Bs = reinterpret_cast<bf16*>(smem);                                              // [kpad][b_stride]
  bf16* As = reinterpret_cast<bf16*>(smem + L.b_bytes);                                  // [stages][64][a_stride]
  int32_t* s_idx = reinterpret_cast<int32_t*>(smem + L.b_bytes + L.stages * L.a_bytes);  // [2][chunk | slot][64]

  const int row = blockIdx.y;
  const int count = min(max(a.miss_count[row], 0), a.miss_stride);
  const int per_tile = kRebuildTileRows / C;
  const int ntiles = (count + per_tile - 1) / per_tile;
  if (static_cast<int>(blockIdx.x) >= ntiles) return;
  const int b = row / a.hkv, h = row % a.hkv;
  const ARows<bf16> A(a, b);
  const bf16* Bh = static_cast<const bf16*>(a.b[b]) + static_cast<int64_t>(h) * r * d;
  bf16* K = static_cast<bf16*>(a.att_k[b]) + h * a.att_head_stride + static_cast<int64_t>(a.outlier_rows) * d;
  const int32_t* mslot = a.miss_slot + static_cast<int64_t>(row) * a.miss_stride;
  const int32_t* mchunk = a.miss_chunk + static_cast<int64_t>(row) * a.miss_stride;
  const int32_t offset = a.position_offset ? a.position_offset[b] : 0;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int wm = warp % kRebuildRowWarps, wn = warp / kRebuildRowWarps;
  const int vpr = kpad / 8;  // 16-byte vectors per A row

  // Issues the cp.async gather of a tile's A rows (rows past the tile's tokens
  // are left as they are: their results are never stored; columns past r are
  // zero-filled so that 0 * garbage cannot make NaN).
  // Row rr of a tile is token rr % C of its chunk rr / C: shifts when C is a
  // power of two (the default 8), else divisions. The gather below walks
  // (row, vector) pairs by a fixed stride, so its row and column advance by
  // additions: run-time divisions in these loops were ~1/3 of the kernel's
  // instructions (the tile's 64 rows x r / 8 vectors, 5 a thread at r = 160).
  const int c_shift = (C & (C - 1)) == 0 ? __ffs(C) - 1 : -1;
  auto split_row = [&](int rr, int* mi, int* i) {
    *mi = c_shift >= 0 ? rr >> c_shift : rr / C;
    *i = rr - *mi * C;
  };
  const int step_rows = nthreads / vpr, step_cols = nthreads - step_rows * vpr;
  const int first_row = tid / vpr, first_col = tid - first_row * vpr;
  auto issue_a = [&](int tile, int stage, const int32_t* chunks) {
    const int rows_used = min(per_tile, count - tile * per_tile) * C;
    bf16* dst = As + static_cast<size_t>(stage) * kRebuildTileRows * L.a_stride;
    int rr = first_row, col = first_col;
    for (; rr < rows_used; rr += step_rows, col += step_cols) {
      if (col >= vpr) {
        col -= vpr;
        if (++rr >= rows_used) break;
      }
      const int k0 = col * 8;
      int mi, ti;
      split_row(rr, &mi, &ti);
      const int64_t t = static_cast<int64_t>(chunks[mi]) * C + ti;
      const bool in = k0 < r;
      const bf16* arow = A.Row(t);
      CpAsync16(SmemAddr(dst + rr * L.a_stride + k0), in ? arow + k0 : arow, in ? 16 : 0);
    }
  };
  auto load_idx = [&](int tile, int buf) {
    const int m0 = tile * per_tile, n = min(per_tile, count - m0);
    for (int i = tid; i < n; i += nthreads) {
      s_idx[buf * 2 * kRebuildTileRows + i] = mchunk[m0 + i];
      s_idx[buf * 2 * kRebuildTileRows + kRebuildTileRows + i] = mslot[m0 + i];
    }
  };

  // Prologue: B[h] (zero rows past r) and the first tile, one group.
  {
    const int vecs = d / 8;
    for (int idx = tid; idx < kpad * vecs; idx += nthreads) {
      const int k = idx / vecs, n0 = (idx - k * vecs) * 8;
      const bool in = k < r;
      CpAsync16(SmemAddr(Bs + k * L.b_stride + n0), in ? Bh + static_cast<int64_t>(k) * d + n0 : Bh, in ? 16 : 0);
    }
  }
  int tile = blockIdx.x;
  load_idx(tile, 0);
  __syncthreads();
  issue_a(tile, 0, s_idx);
  CpAsyncCommit();

  // This thread's frequencies: columns 32 wn + 8 nt + 2 t4 + e of the low half.
  float freq[4][2];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) freq[nt][e] = a.inv_freq[32 * wn + 8 * nt + 2 * t4 + e];

  for (int it = 0; tile < ntiles; ++it, tile += gridDim.x) {
    const int next = tile + gridDim.x;
    const int buf = it & 1, stage = L.stages > 1 ? buf : 0;  // one or two stages
    // The next tile's lists, loaded now and stored once every thread is past
    // the last tile's RoPE (which read that buffer).
    int32_t nchunk = 0, nslot = 0;
    const bool has_next = next < ntiles;
    const int nm0 = next * per_tile, nn = has_next ? min(per_tile, count - nm0) : 0;
    if (tid < nn) {
      nchunk = mchunk[nm0 + tid];
      nslot = mslot[nm0 + tid];
    }
    CpAsyncWait<0>();
    __syncthreads();  // the tile's A (every thread's copies) and lists are visible; the last tile is done
    if (tid < nn) {
      s_idx[(buf ^ 1) * 2 * kRebuildTileRows + tid] = nchunk;
      s_idx[(buf ^ 1) * 2 * kRebuildTileRows + kRebuildTileRows + tid] = nslot;
    }
    __syncthreads();  // the next lists are visible
    // Two stages: the next tile's gather goes into the other one now, in
    // flight through this tile's products, RoPE and stores (the other stage's
    // last reader, the last tile's products, is done).
    if (L.stages > 1) {
      if (has_next) issue_a(next, buf ^ 1, s_idx + (buf ^ 1) * 2 * kRebuildTileRows);
      CpAsyncCommit();
    }

    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    const bf16* At = As + static_cast<size_t>(stage) * kRebuildTileRows * L.a_stride;
    const uint32_t a_addr = SmemAddr(At + (16 * wm + (lane & 15)) * L.a_stride + (lane >> 4) * 8);
    const int bk = (lane & 7) + ((lane >> 3) & 1) * 8, bn = (lane >> 4) * 8;
    const uint32_t b_lo = SmemAddr(Bs + bk * L.b_stride + 32 * wn + bn);
    const uint32_t b_hi = b_lo + half * static_cast<uint32_t>(sizeof(bf16));
    for (int kk = 0; kk < kpad; kk += 16) {
      uint32_t af[4];
      LdMatrixX4(af, a_addr + kk * static_cast<uint32_t>(sizeof(bf16)));
      const uint32_t koff = static_cast<uint32_t>(kk) * L.b_stride * static_cast<uint32_t>(sizeof(bf16));
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        uint32_t bl[4], bh[4];
        LdMatrixX4Trans(bl, b_lo + koff + p * 16 * static_cast<uint32_t>(sizeof(bf16)));
        LdMatrixX4Trans(bh, b_hi + koff + p * 16 * static_cast<uint32_t>(sizeof(bf16)));
        MmaBf16(acc[2 * p], af, bl[0], bl[1]);
        MmaBf16(acc[2 * p + 1], af, bl[2], bl[3]);
        MmaBf16(acc[4 + 2 * p], af, bh[0], bh[1]);
        MmaBf16(acc[4 + 2 * p + 1], af, bh[2], bh[3]);
      }
    }
    if (L.stages == 1) {
      __syncthreads();  // every warp is done with the one stage's A
      if (has_next) issue_a(next, 0, s_idx + (buf ^ 1) * 2 * kRebuildTileRows);
      CpAsyncCommit();
    }

    // RoPE at the true positions, in f32, from the accumulators.
    const int rows_used = min(per_tile, count - tile * per_tile) * C;
    const int32_t* chunks = s_idx + buf * 2 * kRebuildTileRows;
    const int32_t* slots = chunks + kRebuildTileRows;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int rr = 16 * wm + g + 8 * hr;
      if (rr >= rows_used) continue;
      int mi, i;
      split_row(rr, &mi, &i);
      const int64_t t = static_cast<int64_t>(chunks[mi]) * C + i;
      const float pos = static_cast<float>(static_cast<int32_t>(t) + offset);
      bf16* dst = K + (static_cast<int64_t>(slots[mi]) * C + i) * d;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        float s0, c0, s1, c1;
        RopeSinCos(pos * freq[nt][0], &s0, &c0);
        RopeSinCos(pos * freq[nt][1], &s1, &c1);
        const float x1a = acc[nt][2 * hr], x1b = acc[nt][2 * hr + 1];
        const float x2a = acc[4 + nt][2 * hr], x2b = acc[4 + nt][2 * hr + 1];
        const int j = 32 * wn + 8 * nt + 2 * t4;
        *reinterpret_cast<__nv_bfloat162*>(dst + j) = __floats2bfloat162_rn(x1a * c0 - x2a * s0, x1b * c1 - x2b * s1);
        *reinterpret_cast<__nv_bfloat162*>(dst + j + half) =
            __floats2bfloat162_rn(x2a * c0 + x1a * s0, x2b * c1 + x1b * s1);
      }
    }
  }
}

}  // namespace

void LaunchShadowkvRebuildK(const ShadowkvRebuildKArgs& a, cudaStream_t stream) {
  const int rows = a.batch * a.hkv;
  if (rows <= 0 || a.max_misses <= 0) return;
  CHECK(a.d % 2 == 0 && a.d <= 512) << "ShadowkvRebuildK: d " << a.d;
  CHECK(a.r >= 1 && a.r <= kShadowkvMaxRebuildRank) << "ShadowkvRebuildK: r " << a.r;
  CHECK(a.chunk_size >= 1 && a.chunk_size <= 64) << "ShadowkvRebuildK: chunk_size " << a.chunk_size;
  CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF32) << "ShadowkvRebuildK: dtype";
  bool mma = a.algo != RebuildKAlgo::kSimt && a.dtype == DType::kBF16 && a.d % 64 == 0 && a.r % 8 == 0;
  RebuildSmem layout{};
  if (mma) {
    const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&RebuildKMmaKernel));
    // Two A stages where they fit (the next tile's gather in flight), else one.
    layout = RebuildSmemLayout(a.r, a.d, 2);
    if (layout.total() > static_cast<size_t>(max_dynamic)) layout = RebuildSmemLayout(a.r, a.d, 1);
    mma = layout.total() <= static_cast<size_t>(max_dynamic);
  }
  if (mma) {
    const int per_tile = kRebuildTileRows / a.chunk_size;
    const int max_tiles = (a.max_misses + per_tile - 1) / per_tile;
    const int sms = DeviceSmCount();
    // About half the SMs (at least one block per row), not more: the rebuild
    // is launched right after the slot update, beside the value fetch on the
    // side stream, and its blocks take SMs the other lane's chain needs, while
    // the rebuild itself has the whole fetch (~280 us) to finish. Measured with
    // penumbra-bench --kernel-trace at 124928 x 14, two lanes (7 x 8 = 56 rows),
    // forced 60%, with the previous (one tile at a time) kernel: 4 blocks per
    // SM (560) held every SM ~55 us after each slot update, delaying the fetch
    // and the other lane (497.0 tok/s); one per SM (168) gave 518.9 and 514.4;
    // 56 blocks (this rule) 530.6 in the same call as the last. Other row
    // counts follow the rule unmeasured.
    const int splits = std::clamp(sms / (2 * rows), 1, max_tiles);
    const dim3 grid(splits, rows);
    const int threads = kRebuildRowWarps * (a.d / 64) * 32;
    LaunchChained(RebuildKMmaKernel, grid, threads, layout.total(), stream, a, layout);
  } else {
    const size_t smem = static_cast<size_t>(kSimtTokens) * (a.r + a.d) * sizeof(float);
    const dim3 grid(a.max_misses, rows);
    if (a.dtype == DType::kF32) {
      AllowDynamicSharedMemory(reinterpret_cast<const void*>(&RebuildKSimtKernel<float>));
      RebuildKSimtKernel<float><<<grid, kSimtThreads, smem, stream>>>(a);
    } else {
      AllowDynamicSharedMemory(reinterpret_cast<const void*>(&RebuildKSimtKernel<bf16>));
      RebuildKSimtKernel<bf16><<<grid, kSimtThreads, smem, stream>>>(a);
    }
  }
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
