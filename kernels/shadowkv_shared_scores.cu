// ShadowKV decode: the chunk scores of a batch of sequences attached to one
// prefix (ShadowkvScoreArgs::one_prefix, contract in shadowkv_decode_args.h),
// each landmark row of the prefix read once per 128 query-head rows instead of
// once per sequence.
//
// Per sequence the scores are ShadowkvScore's:
//   scores[b][h][c] = max over the query heads g of KV head h and chunk c's
//                     landmark rows v of exp(q_bg . L[v] * scale - lse_bg),
// lse_bg the log of the softmax denominator of query head g of sequence b
// over its selectable landmark rows (the prefix's, then its own).
//
// The query-head rows of a KV head, rho = b * G + g (G = hq / hkv), are the M
// dimension of m16n8k16 tiles (16 / G sequences per tile):
//   pass 1: grid (tile of 128 landmark rows, KV head, block of 128 rows); a
//           block stages its rows' queries in shared memory; a warp keeps its
//           32 landmark rows' B fragments in registers and walks the block's
//           rows 16 at a time, writing per row and tile (max, sum exp);
//   merge:  one warp per row: lse;
//   pass 2: the same products, logit - lse, the maximum over a sequence's G
//           rows and over a chunk's landmark rows, exp, into scores.
// A tile wholly inside the prefix is loaded once for every row of the block;
// a tile holding a sequence's own chunks (its question, generated tokens) is
// loaded per sequence, its G rows alone in an MMA tile (these tiles are few).
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

constexpr int kSsWarps = 4;
constexpr int kSsTile = kSsWarps * 32;  // landmark rows per block
constexpr int kSsRowBlock = 128;        // query-head rows per block
static_assert(kSsTile % 16 == 0, "a chunk's landmark rows (<= 16) lie in one warp's 32");

struct SsWorkspace {
  float2* parts;  // [hkv][R][tiles]: (max, sum exp) of a tile's logits
  float* lse;     // [hkv][R]
  int R, tiles, row_blocks, shift, shared_rows;
};

struct SsSizes {
  int R, tiles, row_blocks;
  size_t parts, lse;
};
SsSizes Sizes(const ShadowkvScoreArgs& a, int shift) {
  SsSizes s{};
  s.R = a.batch * (a.hq / a.hkv);
  s.tiles = ((a.max_chunks << shift) + kSsTile - 1) / kSsTile;
  s.row_blocks = (s.R + kSsRowBlock - 1) / kSsRowBlock;
  s.parts = AlignUp(sizeof(float2) * static_cast<size_t>(a.hkv) * s.R * std::max(s.tiles, 1));
  s.lse = AlignUp(sizeof(float) * static_cast<size_t>(a.hkv) * s.R);
  return s;
}

// Query rows staged in shared memory, 8 bf16 of padding per row so that the
// eight rows a fragment load reads at once fall in different banks.
template <int D>
constexpr int kQStride = D + 8;

// LoadPermutedQ / LoadPermutedQForFp8K (kernels/mma.cuh) from a shared-memory row.
template <int D, bool F8>
__device__ __forceinline__ void LoadQFragments(const bf16* row, bool valid, int c, uint32_t (&qa)[D / 16][2]) {
#pragma unroll
  for (int j = 0; j < D / 32; ++j) {
    const bf16* p = F8 ? row + 64 * (j >> 1) + 16 * c + 8 * (j & 1) : row + 32 * j + 8 * c;
    const uint4 u = valid ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
    qa[2 * j][0] = u.x;
    qa[2 * j][1] = u.y;
    qa[2 * j + 1][0] = u.z;
    qa[2 * j + 1][1] = u.w;
  }
}

template <int D>
struct SsShared {
  bf16 q[kSsRowBlock][kQStride<D>];
  union {
    float2 part[kSsWarps][kSsRowBlock];  // pass 1: per warp, each row's statistics
    float val[kSsWarps][16][33];         // pass 2: per warp, a tile's sequences x its 32 landmark rows
  };
};

// G: query heads per KV head; kSecond: pass 2 (else pass 1). Both compile-time
// so that the row and sequence arithmetic is shifts (as run-time divisions
// they made this kernel bound by its integer instructions).
template <int D, bool F8, int G, bool kSecond>
__global__ void __launch_bounds__(kSsWarps * 32, 4) SharedScoresKernel(ShadowkvScoreArgs a, SsWorkspace ws) {
  static_assert(G >= 1 && G <= 8 && (G & (G - 1)) == 0, "a power of two: 16 / G sequences per MMA tile");
  __shared__ SsShared<D> sm;
  constexpr int kJ = D / 32;
  constexpr bool second = kSecond;
  const int tile = blockIdx.x, h = blockIdx.y, rb = blockIdx.z;
  const int R = ws.R, shift = ws.shift, per_chunk = 1 << shift;
  const int v0 = tile * kSsTile;
  const int rho_block = rb * kSsRowBlock, rho_end = min(R, rho_block + kSsRowBlock);
  const int b_lo = rho_block / G, b_hi = (rho_end + G - 1) / G;  // the block's sequences
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;
  const int base = v0 + warp * 32;
  const bool shared_tile = v0 + kSsTile <= ws.shared_rows;

  // Pass 2's output of one MMA tile: x[half][nt][e] are rows rho_a (half 0)
  // and rho_a + 8's products with this warp's landmark rows; the maximum over
  // each sequence's G rows and each chunk's rows, exp, into scores.
  auto emit = [&](float(&x)[2][4][2], int rho_a, int seqs_in_tile) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rho = rho_a + 8 * half;
      const float l = rho < rho_end ? ws.lse[static_cast<int64_t>(h) * R + rho] : NegInf();
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = l == NegInf() ? NegInf() : x[half][nt][e] - l;
#pragma unroll
          for (int o = 4; o < 4 * G; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
          if (r % G == 0) sm.val[warp][(r + 8 * half) / G][8 * nt + 2 * c + e] = v;
        }
    }
    __syncwarp();
    const int cshift = 5 - shift;  // chunks per warp: 1 << cshift
    const int rho0 = rho_a - r;    // the tile's first row
    for (int p = lane; p < seqs_in_tile << cshift; p += 32) {
      const int sl = p >> cshift, ch = p & ((1 << cshift) - 1);
      const int b = rho0 / G + sl;
      const int chunk = (base >> shift) + ch;
      if (rho0 + sl * G >= rho_end || chunk >= a.max_chunks) continue;
      float m = NegInf();
      for (int j = 0; j < per_chunk; ++j) m = fmaxf(m, sm.val[warp][sl][(ch << shift) + j]);
      a.scores[(static_cast<int64_t>(b) * a.hkv + h) * a.score_stride + chunk] = m == NegInf() ? NegInf() : __expf(m);
    }
    __syncwarp();
  };

  // One MMA tile: rows [rho0, rho0 + 16) (valid below rho_stop) against the
  // warp's fragments kr, scaled by rs where `counts` has the column.
  auto products = [&](const uint4(&kr)[4][kJ], const float(&rs)[4][2], uint32_t counts, int rho0, int rho_stop,
                      float(&x)[2][4][2]) {
    const int ra = rho0 + r, rbw = rho0 + r + 8;
    uint32_t qa[D / 16][2], qb[D / 16][2];
    LoadQFragments<D, F8>(sm.q[min(ra, rho_end - 1) - rho_block], ra < rho_stop, c, qa);
    LoadQFragments<D, F8>(sm.q[min(rbw, rho_end - 1) - rho_block], rbw < rho_stop, c, qb);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      MmaPermutedQK16<D>(acc, qa, qb, kr[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = (counts >> (2 * nt + e)) & 1u;
        x[0][nt][e] = ok && ra < rho_stop ? acc[e] * rs[nt][e] : NegInf();
        x[1][nt][e] = ok && rbw < rho_stop ? acc[2 + e] * rs[nt][e] : NegInf();
      }
    }
  };
  // Pass 1's output of one MMA tile: each row's (max, sum exp) over the
  // warp's 32 landmark rows into sm.part.
  auto stats = [&](const float(&x)[2][4][2], int rho0, int rho_stop) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = NegInf();
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) m = fmaxf(m, fmaxf(x[half][nt][0], x[half][nt][1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      float sum = 0.0f;
      if (m != NegInf()) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) sum += __expf(x[half][nt][0] - m) + __expf(x[half][nt][1] - m);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int rho = rho0 + r + 8 * half;
      if (c == 0 && rho < rho_stop) sm.part[warp][rho - rho_block] = make_float2(m, sum);
    }
  };
  // The warp's landmark rows of sequence b (rows at or past n zeros), their
  // scales and which count (selectable, below n).
  auto load = [&](int b, int n, uint4(&kr)[4][kJ], float(&rs)[4][2]) -> uint32_t {
    const LandmarkRows<std::conditional_t<F8, Fp8, bf16>> land(a, b, h, shift);
    const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
    LoadLandmarkFragments<D, F8>(land, base, n, r, c, kr);
    uint32_t counts = 0;  // bit 2 nt + e
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int v = base + 8 * nt + 2 * c + e;
        const bool ok = v < n && !(excl && excl[v >> shift]);
        rs[nt][e] = ok ? land.RowScale(v) * a.scale : 0.0f;
        counts |= ok ? 1u << (2 * nt + e) : 0u;
      }
    return counts;
  };
  auto rows_of = [&](int b) { return min(a.n_chunks[b], a.max_chunks) << shift; };

  // The block's query rows (row rho: sequence rho / G, query head h G + rho %
  // G), copied asynchronously while the warp's landmark rows load.
  for (int i = threadIdx.x; i < (rho_end - rho_block) * (D / 8); i += blockDim.x) {
    const int row = i / (D / 8), part = i % (D / 8);
    const int rho = rho_block + row, b = rho / G;
    const bf16* src = static_cast<const bf16*>(a.q) + (static_cast<int64_t>(b) * a.hq + h * G + (rho - b * G)) * D;
    CpAsync16(SmemAddr(&sm.q[row][8 * part]), src + 8 * part, 16);
  }
  CpAsyncCommit();
  uint4 kr[4][kJ];
  float rs[4][2];
  float x[2][4][2];
  // The prefix's rows: the same for every sequence of the block (one_prefix).
  const uint32_t shared_counts = shared_tile ? load(b_lo, ws.shared_rows, kr, rs) : 0u;
  CpAsyncWait<0>();
  __syncthreads();
  if (shared_tile) {
#pragma unroll 1
    for (int rho0 = rho_block; rho0 < rho_end; rho0 += 16) {
      products(kr, rs, shared_counts, rho0, rho_end, x);
      if constexpr (second)
        emit(x, rho0 + r, 16 / G);
      else
        stats(x, rho0, rho_end);
    }
  } else {
    // Rows of each sequence's own: one sequence per MMA tile.
#pragma unroll 1
    for (int b = b_lo; b < b_hi; ++b) {
      const int n = rows_of(b);
      const int rho0 = b * G;
      if (v0 >= n) {
        // Past the sequence's chunks: -inf below max_chunks (pass 2), no statistics.
        if constexpr (second) {
          for (int ch = lane; ch < (32 >> shift); ch += 32) {
            const int chunk = (base >> shift) + ch;
            if (chunk < a.max_chunks)
              a.scores[(static_cast<int64_t>(b) * a.hkv + h) * a.score_stride + chunk] = NegInf();
          }
        }
        continue;
      }
      const uint32_t counts = load(b, n, kr, rs);
      products(kr, rs, counts, rho0, rho0 + G, x);
      if constexpr (second)
        emit(x, rho0 + r, 1);
      else
        stats(x, rho0, rho0 + G);
    }
  }
  if constexpr (second) return;
  __syncthreads();
  for (int i = threadIdx.x; i < rho_end - rho_block; i += blockDim.x) {
    const int rho = rho_block + i;
    if (!shared_tile && v0 >= rows_of(rho / G)) continue;  // no warp scored this row here
    float m = NegInf();
    for (int w = 0; w < kSsWarps; ++w) m = fmaxf(m, sm.part[w][i].x);
    float sum = 0.0f;
    if (m != NegInf()) {
      for (int w = 0; w < kSsWarps; ++w) {
        const float2 p = sm.part[w][i];
        if (p.x != NegInf()) sum += p.y * expf(p.x - m);
      }
    }
    ws.parts[(static_cast<int64_t>(h) * R + rho) * ws.tiles + tile] = make_float2(m, sum);
  }
}

// One warp per (KV head, row): lse = max + log(sum exp) over the tiles that
// hold the row's sequence's landmark rows (pass 1 wrote those).
__global__ void SharedScoresMergeKernel(ShadowkvScoreArgs a, SsWorkspace ws) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (w >= a.hkv * ws.R) return;
  const int rho = w % ws.R, b = rho / (a.hq / a.hkv);
  const int n = min(a.n_chunks[b], a.max_chunks) << ws.shift;
  const int tiles_used = (n + kSsTile - 1) / kSsTile;
  const float2* p = ws.parts + static_cast<int64_t>(w) * ws.tiles;
  float m = NegInf();
  for (int t = lane; t < tiles_used; t += 32) m = fmaxf(m, p[t].x);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float sum = 0.0f;
  if (m != NegInf()) {
    for (int t = lane; t < tiles_used; t += 32)
      if (p[t].x != NegInf()) sum += p[t].y * expf(p[t].x - m);
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) ws.lse[w] = m != NegInf() && sum > 0.0f ? m + logf(sum) : NegInf();
}

template <int D, bool F8, int G>
void LaunchG(const ShadowkvScoreArgs& a, const SsWorkspace& ws, cudaStream_t stream) {
  const dim3 grid(ws.tiles, a.hkv, ws.row_blocks);
  SharedScoresKernel<D, F8, G, false><<<grid, kSsWarps * 32, 0, stream>>>(a, ws);
  const int rows_total = a.hkv * ws.R;
  SharedScoresMergeKernel<<<(rows_total * 32 + 255) / 256, 256, 0, stream>>>(a, ws);
  SharedScoresKernel<D, F8, G, true><<<grid, kSsWarps * 32, 0, stream>>>(a, ws);
}

template <int D, bool F8>
void Launch(const ShadowkvScoreArgs& a, const SsWorkspace& ws, cudaStream_t stream) {
  switch (a.hq / a.hkv) {
    case 1:
      return LaunchG<D, F8, 1>(a, ws, stream);
    case 2:
      return LaunchG<D, F8, 2>(a, ws, stream);
    case 4:
      return LaunchG<D, F8, 4>(a, ws, stream);
    default:
      return LaunchG<D, F8, 8>(a, ws, stream);
  }
}

}  // namespace

size_t ShadowkvSharedScoresWorkspaceBytes(const ShadowkvScoreArgs& a) {
  int shift = 0;
  while ((1 << shift) < std::max(1, a.landmarks_per_chunk)) ++shift;
  const SsSizes s = Sizes(a, shift);
  return s.parts + s.lse;
}

bool LaunchShadowkvSharedScores(const ShadowkvScoreArgs& a, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream) {
  const int per_chunk = std::max(1, a.landmarks_per_chunk);
  const bool fp8 = a.landmark_fp8;
  const int G = a.hkv > 0 ? a.hq / a.hkv : 0;
  const bool shape_ok = a.q_dtype == DType::kBF16 && (fp8 || a.dtype == DType::kBF16) && (a.d == 64 || a.d == 128) &&
                        G >= 1 && G <= 8 && a.hq == G * a.hkv && (G & (G - 1)) == 0 && per_chunk <= 16 &&
                        (per_chunk & (per_chunk - 1)) == 0;
  if (!shape_ok || a.batch <= 0 || a.max_chunks <= 0 || a.shared_chunks <= 0) return false;
  if (workspace_bytes < ShadowkvSharedScoresWorkspaceBytes(a)) return false;
  int shift = 0;
  while ((1 << shift) < per_chunk) ++shift;
  const SsSizes z = Sizes(a, shift);
  char* w = static_cast<char*>(workspace);
  SsWorkspace ws;
  ws.parts = reinterpret_cast<float2*>(w);
  ws.lse = reinterpret_cast<float*>(w + z.parts);
  ws.R = z.R;
  ws.tiles = z.tiles;
  ws.row_blocks = z.row_blocks;
  ws.shift = shift;
  ws.shared_rows = std::min(a.shared_chunks, a.max_chunks) << shift;
  if (a.d == 128) {
    fp8 ? Launch<128, true>(a, ws, stream) : Launch<128, false>(a, ws, stream);
  } else {
    fp8 ? Launch<64, true>(a, ws, stream) : Launch<64, false>(a, ws, stream);
  }
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
  return true;
}

}  // namespace penumbra::kernels
