// SpindleKV's window scores and selection; spindlekv_compress.cuh says the
// algorithm, spindlekv_compress_args.h the contract.
#include "kernels/spindlekv_compress.cuh"

#include <cuda_bf16.h>
#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/common.cuh"

namespace penumbra::kernels {
namespace {

// ---- window scores ----------------------------------------------------------

constexpr int kScoreThreads = 256;  // 8 warps
constexpr int kTileKeys = 128;      // keys a block: 4 a lane
constexpr int kRowChunk = 32;       // window rows at a time: 4 a warp
constexpr int kDimChunk = 32;       // channels staged in shared memory at a time

// A block's staging: a chunk of the window rows' queries and of the tile's
// keys, both channel-major so that a warp reads 32 consecutive keys and one
// float4 of its 4 rows per channel, and each row's causal limit and softmax
// statistics.
struct __align__(16) TileSmem {
  float q[kDimChunk][kRowChunk + 4];  // row stride 144 bytes: float4-aligned
  float k[kDimChunk][kTileKeys + 1];  // the odd stride makes the transposing stores conflict-free
  int64_t last[kRowChunk];            // the last key each row sees (-1: none)
  float max[kRowChunk], inv_sum[kRowChunk];
};

// l[r][i] = q(row r0 + 4 * warp + r) . k(t0 + lane + 32 * i) over all d
// channels, unscaled; rows past w and keys past n read as zeros. Also fills
// s.last (and, given the rows' stats [hq][w][2], s.max and s.inv_sum) for
// rows r0 .. r0 + 31. Every thread of the block must call it; it leaves s
// readable (after its last barrier, nothing in s is written again until the
// next call's first barrier).
template <typename T>
__device__ __forceinline__ void TileDots(const SpindlekvWindowScoresArgs& a, int h, const T* keys, int64_t t0, int r0,
                                         const float* stats, TileSmem& s, float (&l)[4][4]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* q = static_cast<const T*>(a.q);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int i = 0; i < 4; ++i) l[r][i] = 0.0f;
  }
  for (int c0 = 0; c0 < a.d; c0 += kDimChunk) {
    __syncthreads();  // the block is done reading the previous chunk (and the previous call's row data)
    if (c0 == 0 && tid < kRowChunk) {
      const int b = r0 + tid;
      s.last[tid] = b < a.w ? min(static_cast<int64_t>(a.q_pos[b]), a.n - 1) : -1;
      if (stats != nullptr) {
        const int64_t at = (static_cast<int64_t>(h) * a.w + b) * 2;
        s.max[tid] = b < a.w ? stats[at] : -INFINITY;
        s.inv_sum[tid] = b < a.w ? 1.0f / stats[at + 1] : 0.0f;
      }
    }
    for (int e = tid; e < kRowChunk * kDimChunk; e += kScoreThreads) {
      const int r = e / kDimChunk, c = e % kDimChunk, b = r0 + r;
      float v = 0.0f;
      if (b < a.w && c0 + c < a.d) v = ToF32(q[(static_cast<int64_t>(b) * a.hq + h) * a.d + c0 + c]);
      s.q[c][r] = v;
    }
    for (int e = tid; e < kTileKeys * kDimChunk; e += kScoreThreads) {
      const int t = e / kDimChunk, c = e % kDimChunk;
      float v = 0.0f;
      if (t0 + t < a.n && c0 + c < a.d) v = ToF32(keys[(t0 + t) * a.d + c0 + c]);
      s.k[c][t] = v;
    }
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < kDimChunk; ++c) {
      const float4 qv = *reinterpret_cast<const float4*>(&s.q[c][warp * 4]);
      const float qr[4] = {qv.x, qv.y, qv.z, qv.w};
      float kv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) kv[i] = s.k[c][lane + 32 * i];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) l[r][i] = fmaf(qr[r], kv[i], l[r][i]);
      }
    }
  }
}

// (M, S) <- the softmax statistics of both sets: M the max, S the sum of
// exp(x - M). A part with m == -inf (nothing seen) must be left out by the
// caller: its exp(m - M) could be exp(-inf + inf).
__device__ __forceinline__ void MergeStats(float& M, float& S, float m, float s) {
  if (m > M) {
    S = S * expf(M - m) + s;
    M = m;
  } else {
    S += s * expf(m - M);
  }
}

// Pass 1: block (part p, query head j of KV head g) at (p * G + j, g) takes
// tiles p, p + parts, ... and writes each window row's max and sum of exp
// over its visible keys in those tiles to partial[((h * w + b) * parts + p) * 2].
template <typename T>
__global__ void __launch_bounds__(kScoreThreads)
    WindowStatsKernel(SpindlekvWindowScoresArgs a, int64_t parts, float* partial) {
  __shared__ TileSmem s;
  const int G = a.hq / a.hkv, j = static_cast<int>(blockIdx.x % G), g = blockIdx.y, h = g * G + j;
  const int64_t p = blockIdx.x / G, tiles = (a.n + kTileKeys - 1) / kTileKeys;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* keys = static_cast<const T*>(a.k) + static_cast<int64_t>(g) * a.head_stride;
  for (int r0 = 0; r0 < a.w; r0 += kRowChunk) {
    // This warp's rows r0 + 4 * warp + r; the same in every lane.
    float M[4], S[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) M[r] = -INFINITY, S[r] = 0.0f;
    for (int64_t tile = p; tile < tiles; tile += parts) {
      const int64_t t0 = tile * kTileKeys;
      float l[4][4];
      TileDots<T>(a, h, keys, t0, r0, nullptr, s, l);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t last = s.last[warp * 4 + r];
        float x[4], m = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // Invisible keys read as -inf, which exp takes to 0; fmaxf passes over NaN as the host's std::max does.
          x[i] = t0 + lane + 32 * i <= last ? a.scale * l[r][i] : -INFINITY;
          m = fmaxf(m, x[i]);
        }
        m = WarpMax(m);
        if (m == -INFINITY) continue;  // the same in every lane
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) sum += expf(x[i] - m);
        MergeStats(M[r], S[r], m, WarpSum(sum));
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int b = r0 + warp * 4 + r;
        if (b >= a.w) continue;
        float* out = partial + ((static_cast<int64_t>(h) * a.w + b) * parts + p) * 2;
        out[0] = M[r];
        out[1] = S[r];
      }
    }
  }
}

// Pass 1's merge: a warp per (query head, window row) folds the parts'
// statistics into stats[(h * w + b) * 2].
__global__ void WindowStatsMergeKernel(const float* partial, int64_t parts, int64_t rows, float* stats) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // the same in every lane
  float M = -INFINITY, S = 0.0f;
  for (int64_t p = lane; p < parts; p += 32) {
    const float m = partial[(row * parts + p) * 2];
    if (m != -INFINITY) MergeStats(M, S, m, partial[(row * parts + p) * 2 + 1]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m = __shfl_xor_sync(0xffffffffu, M, o), s = __shfl_xor_sync(0xffffffffu, S, o);
    if (m != -INFINITY) MergeStats(M, S, m, s);
  }
  if (lane == 0) {
    stats[row * 2] = M;
    stats[row * 2 + 1] = S;
  }
}

// Pass 2: block (tile, query head j of KV head g) at (tile * G + j, g) writes
// dst[h * n + t] = the sum over window rows of each key's probability (rows
// with a non-finite max add nothing, as on the host).
template <typename T>
__global__ void __launch_bounds__(kScoreThreads)
    WindowProbsKernel(SpindlekvWindowScoresArgs a, const float* stats, float* dst) {
  __shared__ TileSmem s;
  __shared__ float red[kScoreThreads / 32][kTileKeys];
  const int G = a.hq / a.hkv, j = static_cast<int>(blockIdx.x % G), g = blockIdx.y, h = g * G + j;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x / G) * kTileKeys;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* keys = static_cast<const T*>(a.k) + static_cast<int64_t>(g) * a.head_stride;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int r0 = 0; r0 < a.w; r0 += kRowChunk) {
    float l[4][4];
    TileDots<T>(a, h, keys, t0, r0, stats, s, l);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = warp * 4 + r;
      const float m = s.max[row], inv = s.inv_sum[row];
      if (!isfinite(m)) continue;  // also rows past w (-inf)
      const int64_t last = s.last[row];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (t0 + lane + 32 * i <= last) acc[i] += expf(a.scale * l[r][i] - m) * inv;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) red[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (threadIdx.x < kTileKeys) {
    const int64_t t = t0 + threadIdx.x;
    if (t < a.n) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kScoreThreads / 32; ++w) sum += red[w][threadIdx.x];
      dst[static_cast<int64_t>(h) * a.n + t] = sum;
    }
  }
}

// Pass 3: out[h][t] = the mean of src[h][lo..hi], the window of `half` keys
// each side clipped at the ends, summed in f64 like the host's prefix sums.
// Neighbouring threads read neighbouring keys, so the window's overlap is
// served from L1.
__global__ void WindowPoolKernel(const float* src, int64_t n, int64_t half, float* out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const float* row = src + static_cast<int64_t>(blockIdx.y) * n;
  const int64_t lo = t - half > 0 ? t - half : 0, hi = t + half < n - 1 ? t + half : n - 1;
  double sum = 0.0;
  for (int64_t u = lo; u <= hi; ++u) sum += row[u];
  out[static_cast<int64_t>(blockIdx.y) * n + t] = static_cast<float>(sum / static_cast<double>(hi - lo + 1));
}

template <typename T>
void LaunchWindowScores(const SpindlekvWindowScoresArgs& a, cudaStream_t stream) {
  const int G = a.hq / a.hkv;
  const int64_t tiles = (a.n + kTileKeys - 1) / kTileKeys;
  float* stats = a.workspace;
  float* unpooled = a.workspace + static_cast<int64_t>(a.hq) * a.w * 2;
  if (a.w > 0) {
    // Pass 1's parts: a tile each while their statistics fit the unpooled
    // buffer (w * parts * 2 <= n floats a head; it is free until pass 2);
    // with one part the block's statistics are the row's and go straight to
    // stats.
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(tiles, a.n / (2 * static_cast<int64_t>(a.w))));
    float* partial = parts > 1 ? unpooled : stats;
    WindowStatsKernel<T>
        <<<dim3(static_cast<unsigned>(parts * G), a.hkv), kScoreThreads, 0, stream>>>(a, parts, partial);
    if (parts > 1) {
      const int64_t rows = static_cast<int64_t>(a.hq) * a.w, per_block = 8;
      WindowStatsMergeKernel<<<static_cast<unsigned>((rows + per_block - 1) / per_block), per_block * 32, 0, stream>>>(
          partial, parts, rows, stats);
    }
  }
  float* dst = a.pool > 1 ? unpooled : a.out;
  WindowProbsKernel<T><<<dim3(static_cast<unsigned>(tiles * G), a.hkv), kScoreThreads, 0, stream>>>(a, stats, dst);
  if (a.pool > 1) {
    constexpr int kPoolThreads = 256;
    const dim3 grid(static_cast<unsigned>((a.n + kPoolThreads - 1) / kPoolThreads), a.hq);
    WindowPoolKernel<<<grid, kPoolThreads, 0, stream>>>(unpooled, a.n, a.pool / 2, a.out);
  }
}

// ---- select -----------------------------------------------------------------

constexpr int kSelectThreads = 1024;  // 32 warps: the block scan's second level is one warp
constexpr int kCompactItems = 4;      // consecutive tokens a thread in the compaction

// How a KV head's context tokens are chosen.
enum class Choice { kRanked, kAll, kNone };

// A token's rank key: larger is better. The score's bits mapped to an
// unsigned order (negatives flipped; -0 taken as +0 since they compare
// equal; NaN 0, below -inf's 0x007fffff), then the inverted index so that
// of equal scores the lower index ranks higher. No two tokens share a key.
__device__ __forceinline__ uint64_t RankKey(float v, uint32_t t) {
  uint32_t u = __float_as_uint(v);
  if ((u << 1) == 0) u = 0;
  const uint32_t order = isnan(v) ? 0u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return static_cast<uint64_t>(order) << 32 | (0xffffffffu - t);
}

// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ uint32_t WarpInclusiveSum(uint32_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Block (query head h): thresholds[h] = the keep-th largest rank key of
// scores[h][0..context), 1 <= keep < context. A radix select from the top
// byte down: each pass counts, among the keys that share the bytes chosen so
// far, each value of the next byte, and picks the byte where the keep-th
// lies. It stops as soon as every key under the chosen bytes is kept; then
// the threshold is those bytes followed by zeros, and "key >= threshold"
// picks exactly the top keep.
__global__ void __launch_bounds__(kSelectThreads)
    SelectThresholdKernel(const float* scores, int64_t n, int32_t context, int32_t keep, uint64_t* thresholds) {
  __shared__ uint32_t hist[256];
  __shared__ uint64_t s_prefix;
  __shared__ uint32_t s_need;
  __shared__ bool s_done;
  const int tid = threadIdx.x, lane = tid & 31;
  const float* row = scores + static_cast<int64_t>(blockIdx.x) * n;
  uint64_t prefix = 0;   // the chosen bytes: bits [shift + 8, 64) of the threshold
  uint32_t need = keep;  // keys still to take among those under prefix (>= 1)
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kSelectThreads) hist[i] = 0;
    __syncthreads();
    for (int64_t base = 0; base < context; base += kSelectThreads) {
      const int64_t t = base + tid;
      uint32_t bin = 256;  // none
      if (t < context) {
        const uint64_t key = RankKey(row[t], static_cast<uint32_t>(t));
        if (shift == 56 || key >> (shift + 8) == prefix) bin = static_cast<uint32_t>(key >> shift) & 255u;
      }
      // Most keys of a pass share few bins: one atomic per bin and warp.
      const uint32_t peers = __match_any_sync(0xffffffffu, bin);
      if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {
      // Lane l holds bins 255 - 8l down to 248 - 8l, so lanes in order walk the bins from the top.
      uint32_t c[8], local = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        c[k] = hist[255 - 8 * lane - k];
        local += c[k];
      }
      const uint32_t incl = WarpInclusiveSum(local);
      uint32_t above = incl - local;
      if (above < need && need <= incl) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          if (above + c[k] >= need) {
            s_prefix = prefix << 8 | static_cast<uint64_t>(255 - 8 * lane - k);
            s_need = need - above;
            s_done = c[k] == need - above;
            break;
          }
          above += c[k];
        }
      }
    }
    __syncthreads();
    prefix = s_prefix;
    need = s_need;
    // Keys are distinct, so by the last byte the chosen bin holds one key and need is 1: done.
    if (s_done) {
      if (tid == 0) thresholds[blockIdx.x] = prefix << shift;
      return;
    }
  }
}

// Block-wide exclusive prefix sum of v (every thread of a kSelectThreads
// block calls it); *total gets the block's sum. s_warp is 33 words of shared
// memory, free again when it returns.
__device__ __forceinline__ uint32_t BlockExclusiveSum(uint32_t v, uint32_t* total, uint32_t* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t incl = WarpInclusiveSum(v);
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t x = s_warp[lane], xi = WarpInclusiveSum(x);
    __syncwarp();
    s_warp[lane] = xi - x;
    if (lane == 31) s_warp[32] = xi;
  }
  __syncthreads();
  const uint32_t excl = s_warp[warp] + incl - v;
  *total = s_warp[32];
  __syncthreads();
  return excl;
}

// Block (KV head g): walks tokens 0..n-1 in order, kCompactItems consecutive
// tokens a thread, and appends each held token's position and mask.
__global__ void __launch_bounds__(kSelectThreads)
    SelectCompactKernel(SpindlekvSelectArgs a, int32_t context, Choice choice, const uint64_t* thresholds) {
  __shared__ uint64_t s_thr[32];
  __shared__ uint32_t s_warp[33];
  const int g = blockIdx.x, G = a.hq / a.hkv;
  const uint32_t full = G == 32 ? 0xffffffffu : (1u << G) - 1u;
  if (static_cast<int>(threadIdx.x) < G && choice == Choice::kRanked) {
    s_thr[threadIdx.x] = thresholds[g * G + threadIdx.x];
  }
  __syncthreads();
  const int64_t n = a.n;
  const float* scores = choice == Choice::kRanked ? a.scores + static_cast<int64_t>(g) * G * n : nullptr;
  int32_t* pos = a.pos + static_cast<int64_t>(g) * n;
  uint32_t* heads = a.heads + static_cast<int64_t>(g) * n;
  uint32_t held = 0;
  for (int64_t base = 0; base < n; base += static_cast<int64_t>(kSelectThreads) * kCompactItems) {
    const int64_t t0 = base + static_cast<int64_t>(threadIdx.x) * kCompactItems;
    uint32_t mask[kCompactItems], count = 0;
#pragma unroll
    for (int i = 0; i < kCompactItems; ++i) {
      const int64_t t = t0 + i;
      uint32_t m = 0;
      if (t < n) {
        if (t >= context || choice == Choice::kAll) {
          m = full;
        } else if (choice == Choice::kRanked) {
          for (int j = 0; j < G; ++j) {
            if (RankKey(scores[j * n + t], static_cast<uint32_t>(t)) >= s_thr[j]) m |= 1u << j;
          }
        }
      }
      mask[i] = m;
      count += m != 0;
    }
    uint32_t total;
    uint32_t at = held + BlockExclusiveSum(count, &total, s_warp);
#pragma unroll
    for (int i = 0; i < kCompactItems; ++i) {
      if (mask[i] == 0) continue;
      pos[at] = static_cast<int32_t>(t0 + i);
      heads[at] = mask[i];
      ++at;
    }
    held += total;
  }
  if (threadIdx.x == 0) a.held[g] = static_cast<int32_t>(held);
}

}  // namespace

bool SpindlekvWindowScoresSupported(int d) { return d >= 1; }

void LaunchSpindlekvWindowScores(const SpindlekvWindowScoresArgs& a, cudaStream_t stream) {
  CHECK(SpindlekvWindowScoresSupported(a.d)) << "spindlekv window scores: d " << a.d;
  CHECK(a.hkv > 0 && a.hq % a.hkv == 0) << "spindlekv window scores: hq " << a.hq << " hkv " << a.hkv;
  CHECK(a.dtype == DType::kF32 || a.dtype == DType::kBF16 || a.dtype == DType::kF16)
      << "spindlekv window scores: dtype " << static_cast<int>(a.dtype);
  CHECK_GE(a.w, 0);
  if (a.n <= 0 || a.hq == 0) return;
  CHECK(a.workspace != nullptr) << "spindlekv window scores: no workspace";
  PENUMBRA_DISPATCH_FLOAT(a.dtype, T, LaunchWindowScores<T>(a, stream));
}

void LaunchSpindlekvSelect(const SpindlekvSelectArgs& a, cudaStream_t stream) {
  CHECK(a.hkv > 0 && a.hq % a.hkv == 0 && a.hq / a.hkv <= 32) << "spindlekv select: hq " << a.hq << " hkv " << a.hkv;
  CHECK_LT(a.n, int64_t{std::numeric_limits<int32_t>::max()}) << "spindlekv select: n " << a.n;
  const int64_t n = std::max<int64_t>(a.n, 0), context = std::clamp<int64_t>(a.context, 0, n);
  Choice choice = Choice::kRanked;
  if (a.keep >= context) {
    choice = Choice::kAll;
  } else if (a.keep <= 0) {
    choice = Choice::kNone;
  }
  auto* thresholds = static_cast<uint64_t*>(a.workspace);
  if (choice == Choice::kRanked) {
    CHECK(a.scores != nullptr && a.workspace != nullptr) << "spindlekv select: no scores or workspace";
    SelectThresholdKernel<<<a.hq, kSelectThreads, 0, stream>>>(a.scores, n, static_cast<int32_t>(context),
                                                               static_cast<int32_t>(a.keep), thresholds);
  }
  SelectCompactKernel<<<a.hkv, kSelectThreads, 0, stream>>>(a, static_cast<int32_t>(context), choice, thresholds);
}

}  // namespace penumbra::kernels
