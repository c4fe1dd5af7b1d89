// ShadowKV: a sparse continuation's chunk scores, every query row of a
// prefill piece over the landmarks of the one sequence it continues (contract
// in shadowkv_decode_args.h, ShadowkvQueryScoresArgs).
//
// The row-by-row path (ShadowkvScore with one batch entry per query row)
// reads every landmark row once per query row: 64 rows of a question over a
// 124928-token document read 64 MB of fp8 landmarks 64 times per layer. Here
// the query heads of a KV head are the M dimension of the tensor-core tiles:
//   pass 1: grid (landmark tile of 128 rows, KV head, block of 128 query-head
//           rows); a warp keeps its 32 landmark rows' B fragments in registers
//           and walks the block's query rows 16 at a time (m16n8k16, the two
//           halves of the A fragment two query rows), writing per query-head
//           row and tile (max, sum exp) of the scaled logits;
//   merge:  one warp per query-head row: the log of its softmax denominator;
//   pass 2: the same products again, logit - lse, the maximum over the
//           block's rows per landmark row, then per chunk (its landmark rows
//           lie in one tile), into a [row block][KV head][chunk] partial;
//   final:  best[c] = exp(max over the partials), -inf where none counts.
// Each pass reads the landmarks once per block of 128 query-head rows.
#include <algorithm>

#include <cuda_bf16.h>
#include <glog/logging.h>

#include "kernels/common.cuh"
#include "kernels/cuda_check.h"
#include "kernels/landmark_format.h"
#include "kernels/mma.cuh"
#include "kernels/shadowkv_decode.cuh"
#include "kernels/shadowkv_decode_common.cuh"

namespace penumbra::kernels {

namespace {

constexpr int kQsWarps = 4;
constexpr int kQsTile = kQsWarps * 32;  // landmark rows per block
constexpr int kQsRowBlock = 128;        // query-head rows per block
// Query rows per pass (a longer piece runs several, the later ones taking the
// maximum with the earlier ones' scores): bounds the workspace.
constexpr int kQsMaxRows = 512;
static_assert(kQsTile % 16 == 0, "a chunk's landmark rows (<= 16) lie in one tile");

struct QsWorkspace {
  float2* parts;  // [hkv][R][tiles]: (max, sum exp) of a tile's logits
  float* lse;     // [hkv][R]
  float* best;    // [row_blocks][hkv][max_chunks]: max of logit - lse
  int R, tiles, row_blocks;
};

struct QsSizes {
  int R, tiles, row_blocks;
  size_t parts, lse, best;
};
QsSizes Sizes(int rows, int hq, int hkv, int max_chunks, int per_chunk) {
  QsSizes s{};
  s.R = rows * (hq / std::max(hkv, 1));
  s.tiles = (max_chunks * per_chunk + kQsTile - 1) / kQsTile;
  s.row_blocks = (s.R + kQsRowBlock - 1) / kQsRowBlock;
  s.parts = AlignUp(sizeof(float2) * static_cast<size_t>(hkv) * s.R * std::max(s.tiles, 1));
  s.lse = AlignUp(sizeof(float) * static_cast<size_t>(hkv) * s.R);
  s.best = sizeof(float) * static_cast<size_t>(s.row_blocks) * hkv * std::max(max_chunks, 1);
  return s;
}

// Query-head row rho of KV head h: query row rho / G, query head h G + rho % G.
__device__ __forceinline__ const bf16* QueryRow(const ShadowkvQueryScoresArgs& a, int h, int G, int rho) {
  const int i = rho / G;
  return static_cast<const bf16*>(a.score.q) +
         (static_cast<int64_t>(i) * a.score.hq + h * G + (rho - i * G)) * a.score.d;
}

template <int D, bool F8>
__global__ void __launch_bounds__(kQsWarps * 32)
    QueryScoresKernel(ShadowkvQueryScoresArgs a, QsWorkspace ws, int shift, bool second) {
  constexpr int kJ = D / 32;
  __shared__ float2 s_part[kQsWarps][kQsRowBlock];
  __shared__ float s_col[kQsTile];
  const ShadowkvScoreArgs& s = a.score;
  const int tile = blockIdx.x, h = blockIdx.y, rb = blockIdx.z;
  const int G = s.hq / s.hkv, R = ws.R;
  const int n_chunks = min(s.n_chunks[0], s.max_chunks);
  const int n = n_chunks << shift;  // landmark rows
  const int v0 = tile * kQsTile;
  if (v0 >= n) return;  // nothing reads this tile's outputs
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;
  const LandmarkRows<std::conditional_t<F8, Fp8, bf16>> land(s, 0, h, shift);
  const uint8_t* excl = s.excluded ? s.excluded[0] + static_cast<int64_t>(h) * s.chunk_cap : nullptr;

  // This warp's 32 landmark rows: B fragments, and per output column (this
  // lane's 8) the factor its products take, 0 where the row does not count.
  const int base = v0 + warp * 32;
  uint4 kr[4][kJ];
  LoadLandmarkFragments<D, F8>(land, base, n, r, c, kr);
  float rs[4][2];
  uint32_t counts = 0;  // bit 2 nt + e
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int v = base + 8 * nt + 2 * c + e;
      const bool ok = v < n && !(excl && excl[v >> shift]);
      rs[nt][e] = ok ? land.RowScale(v) * s.scale : 0.0f;
      counts |= ok ? 1u << (2 * nt + e) : 0u;
    }

  float col[4][2];  // pass 2: max over the block's rows of logit - lse
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) col[nt][0] = col[nt][1] = NegInf();
  const int rho_block = rb * kQsRowBlock;
#pragma unroll 1
  for (int t = 0; t < kQsRowBlock / 16; ++t) {
    const int rho0 = rho_block + 16 * t;
    if (rho0 >= R) break;
    const int ra = rho0 + r, rbw = rho0 + r + 8;
    uint32_t qa[D / 16][2], qb[D / 16][2];
    if constexpr (F8) {
      LoadPermutedQForFp8K<D>(QueryRow(a, h, G, min(ra, R - 1)), ra < R, c, qa);
      LoadPermutedQForFp8K<D>(QueryRow(a, h, G, min(rbw, R - 1)), rbw < R, c, qb);
    } else {
      LoadPermutedQ<D>(QueryRow(a, h, G, min(ra, R - 1)), ra < R, c, qa);
      LoadPermutedQ<D>(QueryRow(a, h, G, min(rbw, R - 1)), rbw < R, c, qb);
    }
    float x[2][4][2];  // [row a | row b][nt][e]
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      MmaPermutedQK16<D>(acc, qa, qb, kr[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = (counts >> (2 * nt + e)) & 1u;
        x[0][nt][e] = ok ? acc[e] * rs[nt][e] : NegInf();
        x[1][nt][e] = ok ? acc[2 + e] * rs[nt][e] : NegInf();
      }
    }
    if (!second) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float2 st = RowQuadStats<false>(x[half]);
        if (c == 0) s_part[warp][16 * t + r + 8 * half] = st;
      }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int rho = half == 0 ? ra : rbw;
        const float l = rho < R ? ws.lse[static_cast<int64_t>(h) * R + rho] : NegInf();
        if (l == NegInf()) continue;  // no selectable row for this head, or past the rows
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) col[nt][e] = fmaxf(col[nt][e], x[half][nt][e] - l);
      }
    }
  }

  if (!second) {
    __syncthreads();
    const int rho = rho_block + static_cast<int>(threadIdx.x);
    if (threadIdx.x < kQsRowBlock && rho < R) {
      float m = NegInf();
      for (int w = 0; w < kQsWarps; ++w) m = fmaxf(m, s_part[w][threadIdx.x].x);
      float sum = 0.0f;
      if (m != NegInf()) {
        for (int w = 0; w < kQsWarps; ++w) {
          const float2 p = s_part[w][threadIdx.x];
          if (p.x != NegInf()) sum += p.y * expf(p.x - m);
        }
      }
      ws.parts[(static_cast<int64_t>(h) * R + rho) * ws.tiles + tile] = make_float2(m, sum);
    }
    return;
  }
  // Per landmark row: the maximum over the lanes holding other query rows.
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = col[nt][e];
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
      if (r == 0) s_col[warp * 32 + 8 * nt + 2 * c + e] = v;
    }
  __syncthreads();
  // Per chunk of the tile: the best of its landmark rows.
  const int per_chunk = 1 << shift;
  const int chunk = (v0 >> shift) + static_cast<int>(threadIdx.x);
  if (static_cast<int>(threadIdx.x) < (kQsTile >> shift) && chunk < n_chunks) {
    float m = NegInf();
    for (int j = 0; j < per_chunk; ++j) m = fmaxf(m, s_col[(threadIdx.x << shift) + j]);
    ws.best[(static_cast<int64_t>(rb) * s.hkv + h) * s.max_chunks + chunk] = m;
  }
}

// One warp per (KV head, query-head row): lse = max + log(sum exp) over the
// tiles that hold landmark rows (pass 1 wrote no others).
__global__ void QueryScoresMergeKernel(ShadowkvQueryScoresArgs a, QsWorkspace ws, int shift) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (w >= a.score.hkv * ws.R) return;
  const int n = min(a.score.n_chunks[0], a.score.max_chunks) << shift;
  const int tiles_used = (n + kQsTile - 1) / kQsTile;
  const float lse = WarpPartsLse<false>(ws.parts + static_cast<int64_t>(w) * ws.tiles, tiles_used, lane);
  if (lane == 0) ws.lse[w] = lse;
}

// best[c] = exp(max over the partials), -inf where none counts or c >= n
// (accumulate: the maximum of that and best[c]).
__global__ void QueryScoresFinalKernel(ShadowkvQueryScoresArgs a, QsWorkspace ws, bool accumulate) {
  const int cidx = blockIdx.x * blockDim.x + threadIdx.x;
  const ShadowkvScoreArgs& s = a.score;
  if (cidx >= s.max_chunks) return;
  const int n_chunks = min(s.n_chunks[0], s.max_chunks);
  float m = NegInf();
  if (cidx < n_chunks) {
    const int parts = ws.row_blocks * s.hkv;
    for (int p = 0; p < parts; ++p) m = fmaxf(m, ws.best[static_cast<int64_t>(p) * s.max_chunks + cidx]);
  }
  const float v = m == NegInf() ? NegInf() : expf(m);
  a.best[cidx] = accumulate ? fmaxf(a.best[cidx], v) : v;
}

template <int D, bool F8>
void Launch(const ShadowkvQueryScoresArgs& a, const QsWorkspace& ws, int shift, bool accumulate, cudaStream_t stream) {
  const dim3 grid(ws.tiles, a.score.hkv, ws.row_blocks);
  QueryScoresKernel<D, F8><<<grid, kQsWarps * 32, 0, stream>>>(a, ws, shift, false);
  const int rows_total = a.score.hkv * ws.R;
  QueryScoresMergeKernel<<<(rows_total * 32 + 255) / 256, 256, 0, stream>>>(a, ws, shift);
  QueryScoresKernel<D, F8><<<grid, kQsWarps * 32, 0, stream>>>(a, ws, shift, true);
  QueryScoresFinalKernel<<<(a.score.max_chunks + 255) / 256, 256, 0, stream>>>(a, ws, accumulate);
}

}  // namespace

size_t ShadowkvQueryScoresWorkspaceBytes(int rows, int hq, int hkv, int max_chunks, int landmarks_per_chunk) {
  const QsSizes s = Sizes(std::min(rows, kQsMaxRows), hq, hkv, max_chunks, landmarks_per_chunk);
  return s.parts + s.lse + s.best;
}

bool LaunchShadowkvQueryScores(const ShadowkvQueryScoresArgs& a, cudaStream_t stream) {
  const ShadowkvScoreArgs& s = a.score;
  const int per_chunk = std::max(1, s.landmarks_per_chunk);
  const bool fp8 = s.landmark_fp8;
  const bool shape_ok = s.q_dtype == DType::kBF16 && (fp8 || s.dtype == DType::kBF16) && (s.d == 64 || s.d == 128) &&
                        s.hkv > 0 && s.hq % s.hkv == 0 && per_chunk <= 16 && (per_chunk & (per_chunk - 1)) == 0;
  if (!shape_ok) return false;
  if (a.rows <= 0 || s.max_chunks <= 0) {
    if (s.max_chunks > 0) {
      const QsWorkspace none{};  // no partials: every chunk -inf
      QueryScoresFinalKernel<<<(s.max_chunks + 255) / 256, 256, 0, stream>>>(a, none, false);
      PENUMBRA_CUDA_CHECK(cudaGetLastError());
    }
    return true;
  }
  int shift = 0;
  while ((1 << shift) < per_chunk) ++shift;
  const size_t q_row = static_cast<size_t>(s.hq) * s.d * sizeof(bf16);
  for (int r0 = 0; r0 < a.rows; r0 += kQsMaxRows) {
    ShadowkvQueryScoresArgs part = a;
    part.rows = std::min(kQsMaxRows, a.rows - r0);
    part.score.q = static_cast<const char*>(s.q) + static_cast<size_t>(r0) * q_row;
    const QsSizes z = Sizes(part.rows, s.hq, s.hkv, s.max_chunks, per_chunk);
    CHECK_GE(a.workspace_bytes, z.parts + z.lse + z.best) << "ShadowkvQueryScores: workspace";
    char* w = static_cast<char*>(a.workspace);
    QsWorkspace ws;
    ws.parts = reinterpret_cast<float2*>(w);
    ws.lse = reinterpret_cast<float*>(w + z.parts);
    ws.best = reinterpret_cast<float*>(w + z.parts + z.lse);
    ws.R = z.R;
    ws.tiles = z.tiles;
    ws.row_blocks = z.row_blocks;
    const bool acc = r0 > 0;
    if (s.d == 128) {
      fp8 ? Launch<128, true>(part, ws, shift, acc, stream) : Launch<128, false>(part, ws, shift, acc, stream);
    } else {
      fp8 ? Launch<64, true>(part, ws, shift, acc, stream) : Launch<64, false>(part, ws, shift, acc, stream);
    }
  }
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
  return true;
}

}  // namespace penumbra::kernels
