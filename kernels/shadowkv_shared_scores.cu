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
//   products: grid (tile of 128 landmark rows, KV head, block of 128 rows); a
//           block stages its rows' queries in shared memory; a warp keeps its
//           32 landmark rows' B fragments in registers and walks the block's
//           rows 16 at a time, writing per row and tile (max, sum exp) and
//           per row and chunk the maximum logit over the chunk's landmark
//           rows (cmax, f32);
//   merge:  one warp per row: lse;
//   combine: per sequence, KV head and chunk, the maximum over the sequence's
//           G rows of cmax - lse, exp, into scores (memory-bound: cmax is
//           hq * 4 bytes per sequence and chunk).
// Subtracting lse after the maximum over a chunk's rows gives the same bits
// as before it (x -> x - lse rounds monotonically). An earlier form computed
// the products twice (a second pass after the merge, subtracting lse per
// logit): traced at 64 x 124928 on an H200, that pass took 10.8 ms of a
// 52 ms step.
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
  float* cmax;    // [hkv][R][max_chunks]: a row's maximum logit over each chunk's landmark rows
  int R, tiles, row_blocks, shift, shared_rows;
};

// The workspace's parts; hkv * R = batch * hq.
struct SsSizes {
  int tiles;
  size_t parts, lse, cmax;
};
SsSizes Sizes(int batch, int hq, int max_chunks, int shift) {
  SsSizes s{};
  const size_t rows = static_cast<size_t>(batch) * hq;
  s.tiles = ((max_chunks << shift) + kSsTile - 1) / kSsTile;
  s.parts = AlignUp(sizeof(float2) * rows * std::max(s.tiles, 1));
  s.lse = AlignUp(sizeof(float) * rows);
  s.cmax = AlignUp(sizeof(float) * rows * std::max(max_chunks, 1));
  return s;
}
int ShiftOf(int landmarks_per_chunk) {
  int shift = 0;
  while ((1 << shift) < std::max(1, landmarks_per_chunk)) ++shift;
  return shift;
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
  float2 part[kSsWarps][kSsRowBlock];  // per warp, each row's statistics
  float val[kSsWarps][16][33];         // per warp, an MMA tile's rows x its 32 landmark rows
};

constexpr float kLog2E = 1.4426950408889634f;

// An MMA tile holds 16 / G sequences' G query heads. Its row (r, half) (the
// lane's rows r = lane / 4 and r + 8) is head TileHead of sequence TileSeq,
// chosen so that a lane's two rows are two heads of one sequence: the maximum
// over a sequence's heads is then one in-lane max and log2(G / 2) shuffles.
template <int G>
struct TileRows {
  static constexpr int kSeqs = 16 / G;  // sequences per tile
  static constexpr int kSeqShift = kSeqs == 16 ? 4 : kSeqs == 8 ? 3 : kSeqs == 4 ? 2 : 1;
  __device__ static int Seq(int r, int half) { return G == 1 ? r + 8 * half : r & (kSeqs - 1); }
  __device__ static int Head(int r, int half) { return G == 1 ? 0 : (r >> kSeqShift) + (G / 2) * half; }
};

// G: query heads per KV head, compile-time so that the row and sequence
// arithmetic is shifts (as run-time divisions they made this kernel bound by
// its integer instructions). The statistics are in base 2 (logits times
// log2 e, folded into each landmark row's scale), so that each logit costs
// one FFMA (scale, and -inf where it does not count) and one ex2. kShift:
// log2 of the landmark rows per chunk when compiled for it (the default 4
// rows: the chunk maxima's loops unrolled), -1 to read it from ws.
template <int D, bool F8, int G, int kShift>
__global__ void __launch_bounds__(kSsWarps * 32, 4) SharedScoresKernel(ShadowkvScoreArgs a, SsWorkspace ws) {
  static_assert(G >= 1 && G <= 8 && (G & (G - 1)) == 0, "a power of two: 16 / G sequences per MMA tile");
  using Rows = TileRows<G>;
  constexpr int kSeqs = Rows::kSeqs;
  __shared__ SsShared<D> sm;
  constexpr int kJ = D / 32;
  const int tile = blockIdx.x, h = blockIdx.y, rb = blockIdx.z;
  const int R = ws.R, shift = kShift >= 0 ? kShift : ws.shift, per_chunk = 1 << shift;
  const int v0 = tile * kSsTile;
  const int rho_block = rb * kSsRowBlock, rho_end = min(R, rho_block + kSsRowBlock);
  const int b_lo = rho_block / G, b_hi = rho_end / G;  // the block's sequences (R and blocks hold whole ones)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;
  const int base = v0 + warp * 32;
  const bool shared_tile = v0 + kSsTile <= ws.shared_rows;

  // One MMA tile: sequences [b0, b0 + n) of the block (at most kSeqs; query
  // rows at block row (b - b_lo) G + head) against the warp's fragments kr:
  // x = product * rs + bias (bias -inf where the column does not count).
  auto products = [&](const uint4(&kr)[4][kJ], const float(&rs)[4][2], const float(&bias)[4][2], int b0, int n,
                      float(&x)[2][4][2]) {
    uint32_t q[2][D / 16][2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int sq = Rows::Seq(r, half);
      const int row = min((b0 - b_lo + sq) * G + Rows::Head(r, half), kSsRowBlock - 1);
      LoadQFragments<D, F8>(sm.q[row], sq < n, c, q[half]);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      MmaPermutedQK16<D>(acc, q[0], q[1], kr[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        x[0][nt][e] = fmaf(acc[e], rs[nt][e], bias[nt][e]);
        x[1][nt][e] = fmaf(acc[2 + e], rs[nt][e], bias[nt][e]);
      }
    }
  };
  // Each valid row's (max, sum 2^(x - max)) over the warp's 32 landmark rows
  // into sm.part (block rows), and its maximum over each chunk's landmark
  // rows into cmax (staged in sm.val so that a chunk's rows, spread over a
  // quad's lanes and tiles, meet in one lane, and so that a row's chunks are
  // stored together).
  auto stats = [&](const float(&x)[2][4][2], int b0, int n) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 st = RowQuadStats<true>(x[half]);
      const int sq = Rows::Seq(r, half), tr = sq * G + Rows::Head(r, half);
      if (c == 0 && sq < n) sm.part[warp][(b0 - b_lo) * G + tr] = st;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) sm.val[warp][tr][8 * nt + 2 * c + e] = x[half][nt][e];
    }
    __syncwarp();
    const int cshift = 5 - shift;  // chunks per warp: 1 << cshift
    float* out = ws.cmax + (static_cast<int64_t>(h) * R + static_cast<int64_t>(b0) * G) * a.max_chunks;
    for (int p = lane; p < (n * G) << cshift; p += 32) {
      const int tr = p >> cshift, ch = p & ((1 << cshift) - 1);
      const int chunk = (base >> shift) + ch;
      if (chunk >= a.max_chunks) continue;
      float m = NegInf();
#pragma unroll 4
      for (int j = 0; j < per_chunk; ++j) m = fmaxf(m, sm.val[warp][tr][(ch << shift) + j]);
      out[static_cast<int64_t>(tr) * a.max_chunks + chunk] = m;
    }
    __syncwarp();
  };
  // The warp's landmark rows of sequence b (rows at or past n zeros), each
  // column's scale (times log2 e) and bias (0 where the row is selectable
  // and below n, else -inf).
  auto load = [&](int b, int n, uint4(&kr)[4][kJ], float(&rs)[4][2], float(&bias)[4][2]) {
    const LandmarkRows<std::conditional_t<F8, Fp8, bf16>> land(a, b, h, shift);
    const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
    LoadLandmarkFragments<D, F8>(land, base, n, r, c, kr);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int v = base + 8 * nt + 2 * c + e;
        const bool ok = v < n && !(excl && excl[v >> shift]);
        rs[nt][e] = ok ? land.RowScale(v) * (a.scale * kLog2E) : 0.0f;
        bias[nt][e] = ok ? 0.0f : NegInf();
      }
  };
  auto rows_of = [&](int b) { return min(a.n_chunks[b], a.max_chunks) << shift; };

  // The block's query rows (block row (b - b_lo) G + g: sequence b, query
  // head h G + g), copied asynchronously while the warp's landmark rows load.
  for (int i = threadIdx.x; i < (rho_end - rho_block) * (D / 8); i += blockDim.x) {
    const int row = i / (D / 8), part = i % (D / 8);
    const int rho = rho_block + row, b = rho / G;
    const bf16* src = static_cast<const bf16*>(a.q) + (static_cast<int64_t>(b) * a.hq + h * G + (rho - b * G)) * D;
    CpAsync16(SmemAddr(&sm.q[row][8 * part]), src + 8 * part, 16);
  }
  CpAsyncCommit();
  uint4 kr[4][kJ];
  float rs[4][2], bias[4][2];
  float x[2][4][2];
  // The prefix's rows: the same for every sequence of the block (one_prefix).
  if (shared_tile) load(b_lo, ws.shared_rows, kr, rs, bias);
  CpAsyncWait<0>();
  __syncthreads();
  if (shared_tile) {
#pragma unroll 1
    for (int b0 = b_lo; b0 < b_hi; b0 += kSeqs) {
      const int n = min(kSeqs, b_hi - b0);
      products(kr, rs, bias, b0, n, x);
      stats(x, b0, n);
    }
  } else {
    // Rows of each sequence's own: one sequence per MMA tile.
#pragma unroll 1
    for (int b = b_lo; b < b_hi; ++b) {
      const int n = rows_of(b);
      if (v0 >= n) continue;  // past the sequence's chunks: the combine writes -inf
      load(b, n, kr, rs, bias);
      products(kr, rs, bias, b, 1, x);
      stats(x, b, 1);
    }
  }
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
        if (p.x != NegInf()) sum += p.y * Ex2(p.x - m);
      }
    }
    ws.parts[(static_cast<int64_t>(h) * R + rho) * ws.tiles + tile] = make_float2(m, sum);
  }
}

// One warp per (KV head, row): lse = max + log2(sum 2^...) over the tiles
// that hold the row's sequence's landmark rows (pass 1 wrote those), base 2.
__global__ void SharedScoresMergeKernel(ShadowkvScoreArgs a, SsWorkspace ws) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (w >= a.hkv * ws.R) return;
  const int rho = w % ws.R, b = rho / (a.hq / a.hkv);
  const int n = min(a.n_chunks[b], a.max_chunks) << ws.shift;
  const int tiles_used = (n + kSsTile - 1) / kSsTile;
  const float lse = WarpPartsLse<true>(ws.parts + static_cast<int64_t>(w) * ws.tiles, tiles_used, lane);
  if (lane == 0) ws.lse[w] = lse;
}

// One thread per (sequence, KV head, chunk below max_chunks): the maximum
// over the sequence's G rows of cmax - lse (-inf for a row without
// statistics, and for chunks past the sequence's), 2^that into scores.
template <int G>
__global__ void SharedScoresCombineKernel(ShadowkvScoreArgs a, SsWorkspace ws) {
  const int chunk = blockIdx.x * blockDim.x + threadIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  if (chunk >= a.max_chunks) return;
  float m = NegInf();
  if (chunk < min(a.n_chunks[b], a.max_chunks)) {
    const int64_t w0 = static_cast<int64_t>(h) * ws.R + static_cast<int64_t>(b) * G;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float l = ws.lse[w0 + g];
      if (l != NegInf()) m = fmaxf(m, ws.cmax[(w0 + g) * a.max_chunks + chunk] - l);
    }
  }
  a.scores[(static_cast<int64_t>(b) * a.hkv + h) * a.score_stride + chunk] = m == NegInf() ? NegInf() : Ex2(m);
}

template <int D, bool F8, int G>
void LaunchG(const ShadowkvScoreArgs& a, const SsWorkspace& ws, cudaStream_t stream) {
  const dim3 grid(ws.tiles, a.hkv, ws.row_blocks);
  if (ws.shift == 2) {
    SharedScoresKernel<D, F8, G, 2><<<grid, kSsWarps * 32, 0, stream>>>(a, ws);
  } else {
    SharedScoresKernel<D, F8, G, -1><<<grid, kSsWarps * 32, 0, stream>>>(a, ws);
  }
  const int rows_total = a.hkv * ws.R;
  SharedScoresMergeKernel<<<(rows_total * 32 + 255) / 256, 256, 0, stream>>>(a, ws);
  constexpr int kCombineThreads = 256;
  const dim3 combine((a.max_chunks + kCombineThreads - 1) / kCombineThreads, a.hkv, a.batch);
  SharedScoresCombineKernel<G><<<combine, kCombineThreads, 0, stream>>>(a, ws);
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

size_t ShadowkvSharedScoresWorkspaceBytes(int batch, int hq, int max_chunks, int landmarks_per_chunk) {
  const SsSizes s = Sizes(batch, hq, max_chunks, ShiftOf(landmarks_per_chunk));
  return s.parts + s.lse + s.cmax;
}

bool ShadowkvSharedScoresCovers(const ShadowkvScoreArgs& a) {
  const int per_chunk = std::max(1, a.landmarks_per_chunk);
  const int G = a.hkv > 0 ? a.hq / a.hkv : 0;
  const bool shape_ok = a.q_dtype == DType::kBF16 && (a.landmark_fp8 || a.dtype == DType::kBF16) &&
                        (a.d == 64 || a.d == 128) && G >= 1 && G <= 8 && a.hq == G * a.hkv && (G & (G - 1)) == 0 &&
                        per_chunk <= 16 && (per_chunk & (per_chunk - 1)) == 0;
  return shape_ok && a.batch > 0 && a.batch <= 65535 && a.max_chunks > 0 && a.shared_chunks > 0;
}

bool LaunchShadowkvSharedScores(const ShadowkvScoreArgs& a, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream) {
  const int per_chunk = std::max(1, a.landmarks_per_chunk);
  const bool fp8 = a.landmark_fp8;
  const int G = a.hkv > 0 ? a.hq / a.hkv : 0;
  if (!ShadowkvSharedScoresCovers(a) ||
      workspace_bytes < ShadowkvSharedScoresWorkspaceBytes(a.batch, a.hq, a.max_chunks, a.landmarks_per_chunk))
    return false;
  const int shift = ShiftOf(per_chunk);
  const SsSizes z = Sizes(a.batch, a.hq, a.max_chunks, shift);
  char* w = static_cast<char*>(workspace);
  SsWorkspace ws;
  ws.parts = reinterpret_cast<float2*>(w);
  ws.lse = reinterpret_cast<float*>(w + z.parts);
  ws.cmax = reinterpret_cast<float*>(w + z.parts + z.lse);
  ws.R = a.batch * G;
  ws.tiles = z.tiles;
  ws.row_blocks = (ws.R + kSsRowBlock - 1) / kSsRowBlock;
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
