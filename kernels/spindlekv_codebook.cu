#include "kernels/spindlekv_codebook.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <glog/logging.h>

#include <cmath>
#include <cstdint>

#include "kernels/common.cuh"

namespace penumbra::kernels {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// ---- BuildCodebook ----------------------------------------------------------

constexpr int kBuildThreads = 1024;     // a thread per row of a block (blocks of up to 1024 rows)
constexpr int kTile = 128;              // Gram tiles of 128 x 128: a warp 4 rows, a lane 4 columns 32 apart
constexpr int kChunk = 32;              // elements of d staged per step of a tile
constexpr int kTileStride = kTile + 4;  // floats per staged k: float4-aligned rows
constexpr int kStageStride = 33;        // the norm staging's row stride: a lane reads its row conflict-free
constexpr int kWriteThreads = 256;
constexpr int kWriteWarps = kWriteThreads / 32;

// Dynamic shared memory of the block kernel for blocks padded to `bp` rows (a
// multiple of kTile): the rows' f64 norms and source indices, then a region
// used first to stage the norms' sums (a warp 32 rows of kChunk) and then for
// the adjacency bits ([bp / 32][bp] words: word w of row t at w * bp + t, so
// that a warp reading word w of its 32 rows hits 32 banks) and two staged
// tile chunks.
struct BuildSmem {
  size_t norms = 0, rowidx = 0, region = 0, adj = 0, tiles = 0, bytes = 0;
  __host__ __device__ explicit BuildSmem(int bp) {
    const size_t b = static_cast<size_t>(bp);
    rowidx = norms + b * sizeof(double);
    region = rowidx + b * sizeof(int32_t);
    adj = region;
    tiles = adj + b * (b / 32) * sizeof(uint32_t);
    const size_t tiles_bytes = 2 * static_cast<size_t>(kChunk) * kTileStride * sizeof(float);
    const size_t stage_bytes = (b / 32) * 32 * kStageStride * sizeof(float);
    bytes = region + (tiles - region + tiles_bytes > stage_bytes ? tiles - region + tiles_bytes : stage_bytes);
  }
};

struct Workspace {
  int32_t* offsets;  // [nblocks + 1]: the blocks' entry counts, then (after the scan) their first entries
  int32_t* chosen;   // [max_n]: at b0 + e, the block-local row that became the block's entry e
};

__device__ __forceinline__ Workspace ProblemWorkspace(const SpindlekvCodebookArgs& a, int p, int nblocks) {
  int32_t* ws = static_cast<int32_t*>(a.workspace);
  Workspace w;
  w.offsets = ws + static_cast<size_t>(p) * (nblocks + 1);
  w.chosen = ws + static_cast<size_t>(a.count) * (nblocks + 1) + static_cast<size_t>(p) * a.max_n;
  return w;
}

// Lane j's row's L2 norm (rows: each lane's source row index, `has` whether
// it has one), summed in f64 over c = 0..d-1 in order as the CPU's Norm does
// (each square is exact in f64, so only the order of the sum matters). The
// warp stages 32 rows a chunk at a time (coalesced reads) and each lane sums
// its row from `stage` (32 x kStageStride floats).
template <typename T>
__device__ __forceinline__ double WarpRowNorm(const T* x, int64_t stride, int32_t row, bool has, int d, float* stage,
                                              int lane) {
  double ss = 0.0;
  for (int k0 = 0; k0 < d; k0 += 32) {
#pragma unroll 8
    for (int r = 0; r < 32; ++r) {
      const int32_t rr = __shfl_sync(kFull, row, r);
      const bool rh = __shfl_sync(kFull, has, r);
      stage[r * kStageStride + lane] = rh ? ToF32(x[static_cast<int64_t>(rr) * stride + k0 + lane]) : 0.0f;
    }
    __syncwarp();
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const double v = stage[lane * kStageStride + c];
      ss += v * v;
    }
    __syncwarp();
  }
  return sqrt(ss);
}

// A chunk of kChunk elements of 128 rows of a tile: thread (warp, lane) holds
// element k0 + lane of the tile's rows warp + 32 m (coalesced reads).
template <typename T>
__device__ __forceinline__ void LoadChunk(const T* x, int64_t stride, const int32_t* rowidx, int tile, int B, int k0,
                                          int warp, int lane, float (&r)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int row = tile * kTile + warp + 32 * m;
    r[m] = row < B ? ToF32(x[static_cast<int64_t>(rowidx[row]) * stride + k0 + lane]) : 0.0f;
  }
}

// The chunk normalized as the CPU does (f32 of the f64 quotient; 0 for a row
// without a direction), stored transposed: S[k * kTileStride + row in tile].
__device__ __forceinline__ void StoreChunk(float* S, const float (&r)[4], const double* norms, const uint32_t* dirw,
                                           int tile, int warp, int lane) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int local = warp + 32 * m, row = tile * kTile + local;
    const bool dir = (dirw[row >> 5] >> (row & 31)) & 1u;
    S[lane * kTileStride + local] = dir ? static_cast<float>(static_cast<double>(r[m]) / norms[row]) : 0.0f;
  }
}

// Algorithm 1 on one block of rows: grid (block of rows, problem).
template <typename T>
__global__ void __launch_bounds__(kBuildThreads, 1)
    SpindlekvBlockGreedyKernel(SpindlekvCodebookArgs a, int bp, int nblocks) {
  const int p = blockIdx.y, blk = blockIdx.x;
  const SpindlekvCodebookProblem pr = a.problems[p];
  const int64_t b0 = static_cast<int64_t>(blk) * a.block;
  if (b0 >= pr.n) return;  // a shorter problem: none of its rows here
  const int B = static_cast<int>(pr.n - b0 < a.block ? pr.n - b0 : a.block);
  const int d = a.d, t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const T* x = static_cast<const T*>(pr.x);
  const int64_t stride = pr.row_stride;
  const Workspace ws = ProblemWorkspace(a, p, nblocks);

  extern __shared__ __align__(16) unsigned char smem[];
  const BuildSmem L(bp);
  double* norms = reinterpret_cast<double*>(smem + L.norms);
  int32_t* rowidx = reinterpret_cast<int32_t*>(smem + L.rowidx);
  uint32_t* adj = reinterpret_cast<uint32_t*>(smem + L.adj);
  float* As = reinterpret_cast<float*>(smem + L.tiles);
  float* Bs = As + kChunk * kTileStride;
  __shared__ uint32_t dirw[32];   // bit t: row t has a direction
  __shared__ uint32_t red[32];    // the warps' best keys
  __shared__ uint32_t taken[32];  // the rows taken out this round
  __shared__ int32_t alive_count[32];

  // Norms and magnitudes; a row has a direction when its norm is finite and positive.
  const bool valid = t < B;
  const int32_t row = valid ? pr.rows[b0 + t] : 0;
  double norm = 0.0;
  if (warp * 32 < B) {  // whole warps
    float* stage = reinterpret_cast<float*>(smem + L.region) + warp * 32 * kStageStride;
    norm = WarpRowNorm(x, stride, row, valid, d, stage, lane);
  }
  const bool dir = valid && isfinite(norm) && norm > 0.0;
  if (t < bp) {
    norms[t] = norm;
    rowidx[t] = row;
  }
  if (valid) pr.mags[b0 + t] = static_cast<float>(norm);
  const uint32_t dir_mask = __ballot_sync(kFull, dir);
  if (lane == 0) dirw[warp] = dir_mask;
  __syncthreads();  // the staging is done: its region becomes the bits and tiles

  // The graph: bit (i, j) when both rows have a direction and cos > theta
  // (i == j: set for every row with a direction). Tiles of the upper
  // triangle; each dot product a sequential sum over d of f32 products, no
  // FMA, as the CPU's Gram computes it, so the bit is the CPU's (and the
  // matrix exactly symmetric). The next chunk is read into registers while
  // the current one is multiplied.
  const int nt = (B + kTile - 1) / kTile, nw = nt * (kTile / 32);
  const float theta = pr.theta;
  for (int ti = 0; ti < nt; ++ti) {
    for (int tj = ti; tj < nt; ++tj) {
      const bool diag = ti == tj;
      float acc[4][4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
      }
      float ra[4], rb[4];
      LoadChunk(x, stride, rowidx, ti, B, 0, warp, lane, ra);
      if (!diag) LoadChunk(x, stride, rowidx, tj, B, 0, warp, lane, rb);
      for (int k0 = 0; k0 < d; k0 += kChunk) {
        __syncthreads();  // every thread is done with the previous chunk
        StoreChunk(As, ra, norms, dirw, ti, warp, lane);
        if (!diag) StoreChunk(Bs, rb, norms, dirw, tj, warp, lane);
        __syncthreads();
        if (k0 + kChunk < d) {
          LoadChunk(x, stride, rowidx, ti, B, k0 + kChunk, warp, lane, ra);
          if (!diag) LoadChunk(x, stride, rowidx, tj, B, k0 + kChunk, warp, lane, rb);
        }
        const float* Bsrc = diag ? As : Bs;
#pragma unroll 8
        for (int k = 0; k < kChunk; ++k) {
          const float4 a4 = *reinterpret_cast<const float4*>(&As[k * kTileStride + warp * 4]);
          const float av[4] = {a4.x, a4.y, a4.z, a4.w};
          float bv[4];
#pragma unroll
          for (int c = 0; c < 4; ++c) bv[c] = Bsrc[k * kTileStride + c * 32 + lane];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][c] = __fadd_rn(acc[r][c], __fmul_rn(av[r], bv[c]));
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = ti * kTile + warp * 4 + r;
        const bool di = (dirw[i >> 5] >> (i & 31)) & 1u;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = tj * kTile + c * 32 + lane;
          const bool dj = (dirw[j >> 5] >> (j & 31)) & 1u;
          const bool edge = i == j ? di : di && dj && acc[r][c] > theta;
          const uint32_t word = __ballot_sync(kFull, edge);
          if (lane == r * 4 + c) adj[(tj * (kTile / 32) + c) * bp + i] = word;
        }
      }
    }
  }
  __syncthreads();
  // The lower triangle's words (row block rb, word block wb < rb in an earlier
  // tile): the transpose of word rb of rows 32 wb .. 32 wb + 31.
  for (int q = warp; q < nw * nw; q += kBuildThreads / 32) {
    const int rb = q / nw, wb = q % nw;
    if (wb / (kTile / 32) >= rb / (kTile / 32)) continue;  // computed by a tile
    const uint32_t s = adj[rb * bp + wb * 32 + lane];
    uint32_t tr = 0;
#pragma unroll 8
    for (int l = 0; l < 32; ++l) {
      const uint32_t b = __ballot_sync(kFull, (s >> l) & 1u);
      if (lane == l) tr = b;
    }
    adj[wb * bp + rb * 32 + lane] = tr;
  }
  __syncthreads();

  // The greedy. Each thread keeps its row's state: alive, its degree (its
  // alive neighbours, itself included) and its reference. A round: the
  // block-wide argmax of (degree, lowest index) [barrier], the chosen row's
  // alive neighbours taken out [barrier], the alive rows' degrees dropped by
  // their neighbours taken out. The barriers also keep `red` and `taken`
  // from being rewritten while a thread still reads them.
  bool alive = dir;
  int deg = 0;
  if (alive) {
    for (int w = 0; w < nw; ++w) deg += __popc(adj[w * bp + t]);
  }
  int32_t ref = -1;
  int e = 0;  // entries chosen so far (the same in every thread)
  int32_t* chosen = ws.chosen + b0;
  for (;;) {
    const uint32_t key = alive ? (static_cast<uint32_t>(deg) << 10 | static_cast<uint32_t>(1023 - t)) : 0u;
    const uint32_t wmax = __reduce_max_sync(kFull, key);
    if (lane == 0) red[warp] = wmax;
    __syncthreads();
    uint32_t top = 0;
#pragma unroll 8
    for (int w = 0; w < 32; ++w) top = max(top, red[w]);
    if (top == 0) break;  // no row left
    const int best = 1023 - static_cast<int>(top & 1023u);
    if ((top >> 10) == 1) {
      // The highest degree is 1: every alive row is isolated and becomes its
      // own entry, in index order (what the remaining rounds would do).
      const uint32_t am = __ballot_sync(kFull, alive);
      if (lane == 0) alive_count[warp] = __popc(am);
      __syncthreads();
      int before = 0, total = 0;
      for (int w = 0; w < 32; ++w) {
        const int c = alive_count[w];
        total += c;
        before += w < warp ? c : 0;
      }
      if (alive) {
        ref = e + before + __popc(am & ((1u << lane) - 1u));
        chosen[ref] = t;
      }
      e += total;
      break;
    }
    const bool in = alive && ((adj[(best >> 5) * bp + t] >> (best & 31)) & 1u);  // symmetric: row best's bit t
    if (in) {
      ref = e;
      alive = false;
    }
    const uint32_t tw = __ballot_sync(kFull, in);
    if (lane == 0) taken[warp] = tw;
    if (t == 0) chosen[e] = best;
    ++e;
    __syncthreads();
    if (alive) {
      for (int w = 0; w < nw; ++w) {
        const uint32_t m = taken[w];
        if (m != 0u) deg -= __popc(adj[w * bp + t] & m);
      }
    }
  }
  if (valid) pr.refs[b0 + t] = ref;  // block-local; -1: no direction
  if (t == 0) ws.offsets[blk] = e;
}

// Per problem: the exclusive scan of its blocks' entry counts (in place,
// offsets[nb] the total) and the entry count; e_0 when no row had a direction.
template <typename TE>
__global__ void __launch_bounds__(1024) SpindlekvScanBlocksKernel(SpindlekvCodebookArgs a, int nblocks) {
  const int p = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const SpindlekvCodebookProblem pr = a.problems[p];
  const int nb = pr.n > 0 ? (pr.n - 1) / a.block + 1 : 0;
  int32_t* offsets = ProblemWorkspace(a, p, nblocks).offsets;
  __shared__ int32_t warp_sums[32];
  int32_t carry = 0;
  for (int base = 0; base < nb; base += blockDim.x) {
    const int i = base + t;
    const int32_t v = i < nb ? offsets[i] : 0;
    int32_t inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(kFull, inc, o);
      if (lane >= o) inc += y;
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    int32_t before = 0, total = 0;
    for (int w = 0; w < 32; ++w) {
      const int32_t c = warp_sums[w];
      total += c;
      before += w < warp ? c : 0;
    }
    if (i < nb) offsets[i] = carry + before + inc - v;
    carry += total;
    __syncthreads();
  }
  if (t == 0) {
    offsets[nb] = carry;
    *pr.entry_count = carry > 0 ? carry : (pr.n > 0 ? 1 : 0);
  }
  if (carry == 0 && pr.n > 0) {
    for (int c = t; c < a.d; c += blockDim.x) static_cast<TE*>(pr.entries)[c] = FromF32<TE>(c == 0 ? 1.0f : 0.0f);
  }
}

// Per (block of rows, problem): the block's entries at its offset (each
// chosen row normalized again exactly as for the graph, rounded to TE) and
// its references made global (zero rows: entry 0).
template <typename T, typename TE>
__global__ void __launch_bounds__(kWriteThreads) SpindlekvWriteEntriesKernel(SpindlekvCodebookArgs a, int nblocks) {
  const int p = blockIdx.y, blk = blockIdx.x;
  const SpindlekvCodebookProblem pr = a.problems[p];
  const int64_t b0 = static_cast<int64_t>(blk) * a.block;
  if (b0 >= pr.n) return;
  const int B = static_cast<int>(pr.n - b0 < a.block ? pr.n - b0 : a.block);
  const int d = a.d, t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const Workspace ws = ProblemWorkspace(a, p, nblocks);
  const int32_t off = ws.offsets[blk], count = ws.offsets[blk + 1] - off;
  for (int i = t; i < B; i += kWriteThreads) {
    const int32_t r = pr.refs[b0 + i];
    pr.refs[b0 + i] = r >= 0 ? off + r : 0;
  }
  const T* x = static_cast<const T*>(pr.x);
  const int64_t stride = pr.row_stride;
  TE* entries = static_cast<TE*>(pr.entries);
  __shared__ float stage[kWriteWarps][32 * kStageStride];
  for (int g0 = warp * 32; g0 < count; g0 += kWriteWarps * 32) {  // 32 entries a warp
    const bool has = g0 + lane < count;
    const int32_t row = has ? pr.rows[b0 + ws.chosen[b0 + g0 + lane]] : 0;
    const double norm = WarpRowNorm(x, stride, row, has, d, stage[warp], lane);
    for (int r = 0; r < 32 && g0 + r < count; ++r) {
      const int32_t rr = __shfl_sync(kFull, row, r);
      const double nr = __shfl_sync(kFull, norm, r);
      const T* src = x + static_cast<int64_t>(rr) * stride;
      TE* dst = entries + static_cast<int64_t>(off + g0 + r) * d;
      for (int c = lane; c < d; c += 32) {
        dst[c] = FromF32<TE>(static_cast<float>(static_cast<double>(ToF32(src[c])) / nr));
      }
    }
  }
}

template <typename T, typename TE>
void LaunchBuild(const SpindlekvCodebookArgs& a, cudaStream_t stream) {
  const int nblocks = a.max_n > 0 ? (a.max_n - 1) / a.block + 1 : 0;
  if (nblocks > 0) {
    const int rows = a.block < a.max_n ? a.block : a.max_n;
    const int bp = (rows + kTile - 1) / kTile * kTile;
    const size_t smem = BuildSmem(bp).bytes;
    const int allowed = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&SpindlekvBlockGreedyKernel<T>));
    CHECK_LE(smem, static_cast<size_t>(allowed)) << "spindlekv codebook: blocks of " << a.block << " rows";
    SpindlekvBlockGreedyKernel<T><<<dim3(nblocks, a.count), kBuildThreads, smem, stream>>>(a, bp, nblocks);
  }
  SpindlekvScanBlocksKernel<TE><<<a.count, 1024, 0, stream>>>(a, nblocks);
  if (nblocks > 0) {
    SpindlekvWriteEntriesKernel<T, TE><<<dim3(nblocks, a.count), kWriteThreads, 0, stream>>>(a, nblocks);
  }
}

template <typename T>
void LaunchBuildForEntries(const SpindlekvCodebookArgs& a, cudaStream_t stream) {
  PENUMBRA_DISPATCH_FLOAT(a.entry_dtype, TE, LaunchBuild<T, TE>(a, stream));
}

// ---- Merge ------------------------------------------------------------------

constexpr int kMergeThreads = 128;  // the decision: a norm and one entry to write
constexpr int kMergeBatch = 8;      // entries a warp reads and reduces together

// E consecutive elements at p as f32, in the widest loads their size allows
// (an entry row starts 16-byte aligned when the codebook does).
template <typename T, int E>
__device__ __forceinline__ void LoadElements(const T* p, float (&v)[E]) {
  constexpr int kBytes = E * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 w = reinterpret_cast<const uint4*>(p)[i];
      const T* h = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int j = 0; j < kPer; ++j) v[i * kPer + j] = ToF32(h[j]);
    }
  } else if constexpr (kBytes % 8 == 0) {
    constexpr int kPer = 8 / sizeof(T);
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      const uint2 w = reinterpret_cast<const uint2*>(p)[i];
      const T* h = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int j = 0; j < kPer; ++j) v[i * kPer + j] = ToF32(h[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = ToF32(p[j]);
  }
}

// p[k]: this lane's part of entry k's dot product. Returns the whole dot
// product of entry (lane >> 2) & 7 (the same value in the lanes of a quad):
// a reduce-scatter, each exchange halving the entries a lane carries, 9
// shuffles for the 8 entries where 8 plain reductions take 40.
__device__ __forceinline__ float ReduceEight(float (&p)[kMergeBatch], int lane) {
  const bool h16 = lane & 16, h8 = lane & 8, h4 = lane & 4;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // p[k]: entry 4 h16 + k
    const float send = h16 ? p[k] : p[k + 4], keep = h16 ? p[k + 4] : p[k];
    p[k] = keep + __shfl_xor_sync(kFull, send, 16);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // p[k]: entry 4 h16 + 2 h8 + k
    const float send = h8 ? p[k] : p[k + 2], keep = h8 ? p[k + 2] : p[k];
    p[k] = keep + __shfl_xor_sync(kFull, send, 8);
  }
  const float send = h4 ? p[0] : p[1], keep = h4 ? p[1] : p[0];
  float s = keep + __shfl_xor_sync(kFull, send, 4);  // entry 4 h16 + 2 h8 + h4
  s += __shfl_xor_sync(kFull, s, 2);
  s += __shfl_xor_sync(kFull, s, 1);
  return s;
}

// Whether candidate (v, i) beats (bv, bi): a higher similarity, or the same
// at a lower index; i < 0 is no candidate, and from none only a similarity
// above -inf is taken (as the CPU's strict comparison from -inf; NaN never).
__device__ __forceinline__ bool Better(float v, int i, float bv, int bi) {
  return i >= 0 && (v > bv || (v == bv && bi >= 0 && i < bi));
}

__device__ __forceinline__ void WarpArgmax(float* bv, int* bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, *bv, o);
    const int oi = __shfl_xor_sync(kFull, *bi, o);
    if (Better(ov, oi, *bv, *bi)) {
      *bv = ov;
      *bi = oi;
    }
  }
}

// A search's best: the similarity and the entry (-1: none).
struct MergeBest {
  float v;
  int i;
};

// The new row's f64 norm, summed in the CPU's order (element c in lane c / E
// of warp 0), and its unit vector into `unit` (zeros without a direction).
// Every thread of the block calls it; the caller syncs after.
template <int E>
__device__ __forceinline__ void RowUnit(const float* v, float* unit, double* row_norm) {
  const int lane = threadIdx.x & 31;
  if ((threadIdx.x >> 5) != 0) return;
  float xv[E];
#pragma unroll
  for (int j = 0; j < E; ++j) xv[j] = v[lane * E + j];
  double ss = 0.0;
  for (int l = 0; l < 32; ++l) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const double y = __shfl_sync(kFull, xv[j], l);
      ss += y * y;
    }
  }
  const double nrm = sqrt(ss);
  const bool dir = isfinite(nrm) && nrm > 0.0;
#pragma unroll
  for (int j = 0; j < E; ++j) unit[lane * E + j] = dir ? static_cast<float>(static_cast<double>(xv[j]) / nrm) : 0.0f;
  if (lane == 0) *row_norm = nrm;
}

constexpr int kSearchThreads = 256;
constexpr int kSearchWarps = kSearchThreads / 32;

// The search, split: block (2 g + kind, sequence i, split) finds the best of
// its share of KV head g's key (kind 0) or value (1) codebook, base entries
// first, for the new row, into workspace[((i hkv + g) 2 + kind) splits + split].
template <typename T, int E>
__global__ void __launch_bounds__(kSearchThreads) SpindlekvMergeSearchKernel(SpindlekvMergeArgs a) {
  constexpr int d = E * 32;
  const int g = blockIdx.x >> 1, kind = blockIdx.x & 1, i = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int slot = a.layer * a.hkv + g;
  const SpindlekvHead* head = a.seq_heads[i] + slot;
  const float* v = a.qkv + static_cast<int64_t>(i) * (a.hq + 2 * a.hkv) * d +
                   static_cast<int64_t>((kind == 0 ? a.hq : a.hq + a.hkv) + g) * d;
  const int32_t nb = kind == 0 ? head->key_base_entries : head->value_base_entries;
  const T* base = static_cast<const T*>(kind == 0 ? head->key_entries[0] : head->value_entries[0]);
  const T* own = static_cast<const T*>(kind == 0 ? head->key_entries[1] : head->value_entries[1]);
  const int32_t total = nb + a.seq_entries[i][2 * slot + kind];
  MergeBest* out =
      static_cast<MergeBest*>(a.workspace) + ((static_cast<int64_t>(i) * a.hkv + g) * 2 + kind) * splits + split;

  __shared__ float unit[d];
  __shared__ double row_norm;
  __shared__ MergeBest warp_best[kSearchWarps];
  RowUnit<E>(v, unit, &row_norm);
  __syncthreads();
  if (!(isfinite(row_norm) && row_norm > 0.0)) {  // a zero row searches nothing
    if (t == 0) *out = MergeBest{-INFINITY, -1};
    return;
  }
  float u[E];
#pragma unroll
  for (int j = 0; j < E; ++j) u[j] = unit[lane * E + j];
  // This split's entries: whole batches of 8.
  const int32_t first = a.window > 0 && a.window < total ? total - a.window : 0;
  const int32_t per = ((total - first + splits - 1) / splits + kMergeBatch - 1) / kMergeBatch * kMergeBatch;
  const int32_t lo = first + split * per, hi = min(total, lo + per);
  float bv = -INFINITY;
  int bi = -1;
  for (int32_t e0 = lo + warp * kMergeBatch; e0 < hi; e0 += kSearchWarps * kMergeBatch) {
    float part[kMergeBatch];
#pragma unroll
    for (int k = 0; k < kMergeBatch; ++k) {
      const int32_t e = e0 + k;
      part[k] = 0.0f;
      if (e < hi) {
        const T* ent = e < nb ? base + static_cast<int64_t>(e) * d : own + static_cast<int64_t>(e - nb) * d;
        float ev[E];
        LoadElements<T, E>(ent + lane * E, ev);
#pragma unroll
        for (int j = 0; j < E; ++j) part[k] = fmaf(ev[j], u[j], part[k]);
      }
    }
    const float s = ReduceEight(part, lane);
    const int32_t e = e0 + ((lane >> 2) & 7);
    if ((lane & 3) == 0 && e < hi && Better(s, e, bv, bi)) {
      bv = s;
      bi = e;
    }
  }
  WarpArgmax(&bv, &bi);
  if (lane == 0) warp_best[warp] = MergeBest{bv, bi};
  __syncthreads();
  if (warp == 0) {
    bv = lane < kSearchWarps ? warp_best[lane].v : -INFINITY;
    bi = lane < kSearchWarps ? warp_best[lane].i : -1;
    WarpArgmax(&bv, &bi);
    if (lane == 0) *out = MergeBest{bv, bi};
  }
}

// The decision, after the search: one block per (KV head g, sequence i),
// grid (hkv, batch). E = d / 32.
template <typename T, int E>
__global__ void __launch_bounds__(kMergeThreads) SpindlekvMergeKernel(SpindlekvMergeArgs a) {
  constexpr int d = E * 32;
  const int g = blockIdx.x, i = blockIdx.y;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int slot = a.layer * a.hkv + g;
  SpindlekvHead* head = a.seq_heads[i] + slot;
  int32_t* counts = a.seq_entries[i] + 2 * slot;
  const float* row = a.qkv + static_cast<int64_t>(i) * (a.hq + 2 * a.hkv) * d;

  __shared__ float unit[d];
  __shared__ double row_norm;
  __shared__ MergeBest best;
  __shared__ int32_t refs[2];
  __shared__ float mags[2];

  for (int kind = 0; kind < 2; ++kind) {  // keys, then values
    const float* v = row + static_cast<int64_t>((kind == 0 ? a.hq : a.hq + a.hkv) + g) * d;
    const float theta = kind == 0 ? a.key_theta : a.value_theta;
    const int32_t nb = kind == 0 ? head->key_base_entries : head->value_base_entries;
    // The own entries are const in the view (SpindlekvAttention reads them);
    // the memory is the policy's, writable, with room for every entry to come.
    T* own = static_cast<T*>(const_cast<void*>(kind == 0 ? head->key_entries[1] : head->value_entries[1]));
    const int32_t n_own = counts[kind];  // thread 0 rewrites it only after the barriers below
    RowUnit<E>(v, unit, &row_norm);
    if (warp == 0) {
      const MergeBest* parts =
          static_cast<const MergeBest*>(a.workspace) + ((static_cast<int64_t>(i) * a.hkv + g) * 2 + kind) * a.splits;
      float bv = -INFINITY;
      int bi = -1;
      for (int s = lane; s < a.splits; s += 32) {
        if (Better(parts[s].v, parts[s].i, bv, bi)) {
          bv = parts[s].v;
          bi = parts[s].i;
        }
      }
      WarpArgmax(&bv, &bi);
      if (lane == 0) best = MergeBest{bv, bi};
    }
    __syncthreads();
    const double nrm = row_norm;
    const bool dir = isfinite(nrm) && nrm > 0.0;
    int32_t ref = 0;
    bool add = false;
    if (!dir) {
      add = nb + n_own == 0;  // e_0, the entry of zero rows, when there is none
    } else if (best.i >= 0 && best.v > theta) {
      ref = best.i;
    } else {
      add = true;
    }
    if (add) {  // at the own part's count (the same decision in every thread)
      T* dst = own + static_cast<int64_t>(n_own) * d;
      for (int c = t; c < d; c += kMergeThreads) dst[c] = FromF32<T>(dir ? unit[c] : (c == 0 ? 1.0f : 0.0f));
      ref = nb + n_own;
      if (t == 0) counts[kind] = n_own + 1;
    }
    if (t == 0) {
      refs[kind] = ref;
      mags[kind] = static_cast<float>(nrm);
    }
    __syncthreads();  // `unit`, `row_norm` and `best` are the values' next
  }

  if (t == 0) {
    // The token joins the own part. Its arrays are const in the view too; the
    // policy sized them for every token the sequence will hold.
    SpindlekvTokens& tk = head->part[1];
    const int64_t at = tk.n;
    const int G = a.hq / a.hkv;
    const_cast<int32_t*>(tk.pos)[at] = a.positions[i];
    const_cast<int32_t*>(tk.kref)[at] = refs[0];
    const_cast<float*>(tk.kmag)[at] = mags[0];
    const_cast<int32_t*>(tk.vref)[at] = refs[1];
    const_cast<float*>(tk.vmag)[at] = mags[1];
    const_cast<uint32_t*>(tk.heads)[at] = G >= 32 ? ~0u : (1u << G) - 1u;
    tk.n = at + 1;
    if (a.gathered != nullptr) a.gathered[static_cast<int64_t>(i) * a.hkv + g] = *head;
  }
}

template <typename T, int E>
void LaunchMerge(const SpindlekvMergeArgs& a, const dim3& grid, cudaStream_t stream) {
  SpindlekvMergeSearchKernel<T, E><<<dim3(2 * a.hkv, a.batch, a.splits), kSearchThreads, 0, stream>>>(a);
  SpindlekvMergeKernel<T, E><<<grid, kMergeThreads, 0, stream>>>(a);
}

template <typename T>
void LaunchMergeForDim(const SpindlekvMergeArgs& a, cudaStream_t stream) {
  const dim3 grid(a.hkv, a.batch);
  switch (a.d / 32) {
    case 1:
      LaunchMerge<T, 1>(a, grid, stream);
      break;
    case 2:
      LaunchMerge<T, 2>(a, grid, stream);
      break;
    case 3:
      LaunchMerge<T, 3>(a, grid, stream);
      break;
    case 4:
      LaunchMerge<T, 4>(a, grid, stream);
      break;
    case 5:
      LaunchMerge<T, 5>(a, grid, stream);
      break;
    case 6:
      LaunchMerge<T, 6>(a, grid, stream);
      break;
    case 7:
      LaunchMerge<T, 7>(a, grid, stream);
      break;
    case 8:
      LaunchMerge<T, 8>(a, grid, stream);
      break;
    default:
      LOG(FATAL) << "spindlekv merge: head_dim " << a.d;
  }
}

bool FloatDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

bool SpindlekvCodebookSupported(int d, int block) {
  return d >= 32 && d <= 256 && d % 32 == 0 && block >= 1 && block <= kBuildThreads;
}

void LaunchSpindlekvBuildCodebook(const SpindlekvCodebookArgs& a, cudaStream_t stream) {
  CHECK(SpindlekvCodebookSupported(a.d, a.block)) << "spindlekv codebook: d " << a.d << " block " << a.block;
  CHECK(FloatDType(a.x_dtype) && FloatDType(a.entry_dtype)) << "spindlekv codebook: dtypes";
  CHECK_GE(a.max_n, 0);
  CHECK_LE(a.count, 65535) << "spindlekv codebook: problems in one launch";
  if (a.count <= 0) return;
  CHECK(a.workspace != nullptr) << "spindlekv codebook: no workspace";
  PENUMBRA_DISPATCH_FLOAT(a.x_dtype, T, LaunchBuildForEntries<T>(a, stream));
}

void LaunchSpindlekvMerge(const SpindlekvMergeArgs& a, cudaStream_t stream) {
  CHECK(SpindlekvCodebookSupported(a.d, 1)) << "spindlekv merge: d " << a.d;
  CHECK(FloatDType(a.entry_dtype)) << "spindlekv merge: entry dtype";
  CHECK(a.hkv > 0 && a.hq % a.hkv == 0) << "spindlekv merge: hq " << a.hq << " hkv " << a.hkv;
  CHECK_LE(a.batch, 65535) << "spindlekv merge: batch";
  CHECK(a.splits >= 1 && a.splits <= 65535 && a.workspace != nullptr) << "spindlekv merge: splits " << a.splits;
  if (a.batch <= 0) return;
  PENUMBRA_DISPATCH_FLOAT(a.entry_dtype, T, LaunchMergeForDim<T>(a, stream));
}

}  // namespace penumbra::kernels
