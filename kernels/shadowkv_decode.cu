// ShadowKV decode kernels; see shadowkv_decode.cuh for the contracts, the
// parallelization and the expected memory traffic.
#include "kernels/shadowkv_decode.cuh"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <glog/logging.h>

#include "kernels/common.cuh"
#include "kernels/landmark_format.h"
#include "kernels/mma.cuh"
#include "kernels/topk.cuh"
#include "kernels/topk_block.cuh"
#include "kernels/cuda_check.h"

namespace penumbra::kernels {

namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

// 8 consecutive elements loaded with 16-byte loads, kept raw until used so that
// several loads can be in flight.
template <typename T> struct Raw8;
template <> struct Raw8<bf16> {
  uint4 v;
  __device__ __forceinline__ void Load(const bf16* p) { v = __ldg(reinterpret_cast<const uint4*>(p)); }
  __device__ __forceinline__ void Zero() { v = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void ToF32(float (&x)[8]) const {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = __uint_as_float(w[j] << 16);
      x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
};
template <> struct Raw8<float> {
  float4 lo, hi;
  __device__ __forceinline__ void Load(const float* p) {
    lo = __ldg(reinterpret_cast<const float4*>(p));
    hi = __ldg(reinterpret_cast<const float4*>(p + 4));
  }
  __device__ __forceinline__ void Zero() { lo = hi = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void ToF32(float (&x)[8]) const {
    x[0] = lo.x; x[1] = lo.y; x[2] = lo.z; x[3] = lo.w;
    x[4] = hi.x; x[5] = hi.y; x[6] = hi.z; x[7] = hi.w;
  }
};

// The landmark type of fp8 records (kernels/landmark_format.h): e4m3 codes.
struct Fp8 {};
template <typename T> struct LandmarkElem { using type = T; };
template <> struct LandmarkElem<Fp8> { using type = uint8_t; };

// An e4m3 code's value times 2^-120, exactly, by moving its fields into an
// f32's (a normal code's exponent field e, biased by 7, becomes an f32 field
// of e with bias 127; a subnormal code becomes an f32 subnormal): a shift and
// two masks instead of a conversion. Callers multiply by 2^120 once per
// row, folded into the record's scale (LandmarkRows::RowScale).
__device__ __forceinline__ float E4M3Raw(uint32_t b) {
  return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20));
}
template <> struct Raw8<Fp8> {
  uint2 v;
  __device__ __forceinline__ void Load(const uint8_t* p) { v = __ldg(reinterpret_cast<const uint2*>(p)); }
  __device__ __forceinline__ void Zero() { v = make_uint2(0, 0); }
  __device__ __forceinline__ void ToF32(float (&x)[8]) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[j] = E4M3Raw((v.x >> (8 * j)) & 0xffu);
      x[4 + j] = E4M3Raw((v.y >> (8 * j)) & 0xffu);
    }
  }
};
constexpr float kE4M3RawScale = 0x1p120f;  // undoes E4M3Raw's (and E4M3PairToBf16's) 2^-120

// ============================================================================
// 1. Scores
// ============================================================================
// Landmark row v of head h of sequence b (chunk v / landmarks_per_chunk):
// below the attached prefix's chunks from its landmarks (shared by its
// sequences), else from the sequence's own. Chunk records as in
// landmark_format.h (T = Fp8: e4m3 codes and a scale per record).
template <typename T>
struct LandmarkRows {
  using E = typename LandmarkElem<T>::type;
  static constexpr bool kFp8 = std::is_same_v<T, Fp8>;
  const E* shared;
  const E* own;
  int shared_chunks, d, shift, per_chunk;
  int64_t rec;  // elements per chunk record
  // row_shift: log2(landmarks_per_chunk) (ScoreWorkspace::shift).
  __device__ LandmarkRows(const ShadowkvScoreArgs& a, int b, int h, int row_shift)
      : shared_chunks(a.shared_chunks), d(a.d), shift(row_shift), per_chunk(a.landmarks_per_chunk),
        rec(LandmarkChunkElems(a.landmarks_per_chunk, a.d, kFp8)) {
    const int64_t cap = a.landmark_cap > 0 ? a.landmark_cap : a.chunk_cap;
    own = static_cast<const E*>(a.landmarks[b]) + h * cap * rec;
    shared = shared_chunks > 0 ? static_cast<const E*>(a.shared_landmarks[b]) + h * shared_chunks * rec : own;
  }
  __device__ const E* Record(int chunk) const {
    return chunk < shared_chunks ? shared + chunk * rec : own + (chunk - shared_chunks) * rec;
  }
  __device__ const E* Row(int v) const { return Record(v >> shift) + static_cast<int64_t>(v & (per_chunk - 1)) * d; }
  // What row v's products with its raw elements (Raw8::ToF32,
  // E4M3PairToBf16) are multiplied by: 1, or the record's scale * 2^120.
  __device__ float RowScale(int v) const {
    if constexpr (kFp8) {
      return __ldg(reinterpret_cast<const float*>(Record(v >> shift) + static_cast<int64_t>(per_chunk) * d)) *
             kE4M3RawScale;
    } else {
      return 1.0f;
    }
  }
};

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

constexpr int kScoreThreads = 256;
constexpr int kScoreSplit = 1024;  // chunks per phase-1 block of the SIMT kernel (its shared logits)
// Chunks per block of the tensor-core kernel. 512 rather than 1024: in the
// decode pipeline (124928 x 14, two lanes, forced 60%, chained launches) 595.7
// tok/s against 588.3; 256 measured 593.4 (docs/benchmarks.md, eighth session).
constexpr int kScoreMmaSplit = 512;
// The workspace holds the split statistics of the smaller of the two.
constexpr int kScoreMinSplit = kScoreMmaSplit < kScoreSplit ? kScoreMmaSplit : kScoreSplit;
constexpr int kScoreUnroll = 8;   // rows in flight per thread
constexpr int kScoreFinalPerThread = 4;

size_t AlignUp(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

// Phase 1 scores landmark rows: landmarks_per_chunk (S) per chunk, row v of
// chunk v >> shift; phase 2 scores chunks, each by its best row.
struct ScoreWorkspace {
  float* logits;   // [batch * hq][rows]
  float2* splits;  // [batch * hq][n_split] (max, sum exp) per split
  float2* merged;  // [batch * hq] (max, sum exp)
  int split;       // landmark rows per phase-1 block: kScoreMmaSplit or kScoreSplit
  int rows;        // logits per head: max_chunks * S
  int shift;       // log2(S)
};
int ScoreSplits(int max_rows, int split) { return std::max(1, (max_rows + split - 1) / split); }
int Log2(int s) {
  int l = 0;
  while ((1 << l) < s) ++l;
  return l;
}
ScoreWorkspace CarveScoreWorkspace(void* base, int batch, int hq, int max_chunks, int per_chunk, int split) {
  char* p = static_cast<char*>(base);
  ScoreWorkspace w{};
  w.split = split;
  w.rows = max_chunks * per_chunk;
  w.shift = Log2(per_chunk);
  w.logits = reinterpret_cast<float*>(p);
  p += AlignUp(sizeof(float) * static_cast<size_t>(batch) * hq * std::max(w.rows, 1));
  w.splits = reinterpret_cast<float2*>(p);
  p += AlignUp(sizeof(float2) * static_cast<size_t>(batch) * hq * ScoreSplits(w.rows, kScoreMinSplit));
  w.merged = reinterpret_cast<float2*>(p);
  return w;
}

// Phase 1: grid (split, kv head, sequence). A group of `tpr` lanes owns one
// landmark row (one 8-element vector per lane), the block walks the split's
// rows kScoreUnroll at a time.
template <typename T, int G>
__global__ void __launch_bounds__(kScoreThreads)
    ScoreLogitsKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int tpr, int n_split) {
  __shared__ float s_logit[G][kScoreSplit];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int n = a.n_chunks[b] << ws.shift;  // landmark rows
  const int c0 = split * ws.split;
  if (c0 >= n) return;  // the merge reads only splits below n
  const int c1 = min(n, c0 + ws.split);
  const int tid = threadIdx.x;
  const int lane_row = tid & (tpr - 1), row_in_pass = tid / tpr, rows_per_pass = kScoreThreads / tpr;
  const int nvec = a.d / 8;
  const bool active = lane_row < nvec;

  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t off = (static_cast<int64_t>(b) * a.hq + h * G + g) * a.d + lane_row * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) qr[g][j] = 0.0f;
    if (active) {
      if (a.q_dtype == DType::kF32) {
        Raw8<float> r;
        r.Load(static_cast<const float*>(a.q) + off);
        r.ToF32(qr[g]);
      } else {
        Raw8<bf16> r;
        r.Load(static_cast<const bf16*>(a.q) + off);
        r.ToF32(qr[g]);
      }
    }
  }
  const LandmarkRows<T> land(a, b, h, ws.shift);
  const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;

  for (int base = c0; base < c1; base += rows_per_pass * kScoreUnroll) {
    Raw8<T> raw[kScoreUnroll];
    bool ex[kScoreUnroll];
    float rs[kScoreUnroll];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      const int c = base + u * rows_per_pass + row_in_pass;
      if (active && c < c1) raw[u].Load(land.Row(c) + lane_row * 8);
      else raw[u].Zero();
      ex[u] = lane_row == 0 && c < c1 && excl && excl[c >> ws.shift];
      rs[u] = lane_row == 0 && c < c1 ? land.RowScale(c) : 1.0f;
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      float x[8];
      raw[u].ToF32(x);
      float dot[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(qr[g][j], x[j], s);
        dot[g] = s;
      }
      for (int o = tpr >> 1; o > 0; o >>= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
      }
      const int c = base + u * rows_per_pass + row_in_pass;
      if (lane_row == 0 && c < c1) {
#pragma unroll
        for (int g = 0; g < G; ++g) s_logit[g][c - c0] = ex[u] ? NegInf() : dot[g] * (rs[u] * a.scale);
      }
    }
  }
  __syncthreads();
  const int len = c1 - c0;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float* dst = ws.logits + (static_cast<int64_t>(b) * a.hq + h * G + g) * ws.rows + c0;
    for (int i = tid; i < len; i += kScoreThreads) dst[i] = s_logit[g][i];
  }
  const int warp = tid >> 5, lane = tid & 31;
  if (warp < G) {
    float m = NegInf();
    for (int i = lane; i < len; i += 32) m = fmaxf(m, s_logit[warp][i]);
    m = WarpMax(m);
    float s = 0.0f;
    if (m != NegInf())
      for (int i = lane; i < len; i += 32) s += expf(s_logit[warp][i] - m);
    s = WarpSum(s);
    if (lane == 0) ws.splits[(static_cast<int64_t>(b) * a.hq + h * G + warp) * n_split + split] = make_float2(m, s);
  }
}

// The (max, sum exp) of one query head's ns splits, reduced by one warp (the
// merge kernel and the score-and-select kernel share it, so both give the
// same bits).
__device__ __forceinline__ float2 MergeSplits(const float2* st, int ns, int lane) {
  float m = NegInf();
  for (int i = lane; i < ns; i += 32) m = fmaxf(m, st[i].x);
  m = WarpMax(m);
  float s = 0.0f;
  if (m != NegInf())
    for (int i = lane; i < ns; i += 32)
      if (st[i].x != NegInf()) s += st[i].y * expf(st[i].x - m);
  return make_float2(m, WarpSum(s));
}

// The second of two calls (stats_in): query head idx's (max, sum exp)
// combined over every shard's statistics, reduced by one warp (shared by the
// same two kernels as MergeSplits, for the same reason).
__device__ __forceinline__ float2 CombineParts(const ShadowkvScoreArgs& a, int64_t idx, int lane) {
  const float* st = a.stats_in + idx * 2;
  float m = NegInf();
  for (int p = lane; p < a.stats_parts; p += 32) m = fmaxf(m, st[p * a.stats_part_stride]);
  m = WarpMax(m);
  float s = 0.0f;
  if (m != NegInf()) {
    for (int p = lane; p < a.stats_parts; p += 32) {
      const float mp = st[p * a.stats_part_stride];
      if (mp != NegInf()) s += st[p * a.stats_part_stride + 1] * expf(mp - m);
    }
  }
  return make_float2(m, WarpSum(s));
}

// Phase 1.5: one warp per (sequence, query head) merges the split statistics
// (with stats_in: combines the parts' instead) into ws.merged, or into
// stats_out for the first of two calls.
__global__ void ScoreMergeKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int n_split) {
  const int idx = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (idx >= a.batch * a.hq) return;
  const int b = idx / a.hq;
  const int ns = ((a.n_chunks[b] << ws.shift) + ws.split - 1) / ws.split;
  const float2 ms = a.stats_in != nullptr ? CombineParts(a, idx, lane)
                                          : MergeSplits(ws.splits + static_cast<int64_t>(idx) * n_split, ns, lane);
  if (lane != 0) return;
  if (a.stats_out != nullptr) {
    a.stats_out[2 * static_cast<int64_t>(idx)] = ms.x;
    a.stats_out[2 * static_cast<int64_t>(idx) + 1] = ms.y;
  } else {
    ws.merged[idx] = ms;
  }
}

// A chunk's score (phase 2): max over the group of exp(logit - max) / sum;
// -inf when excluded.
__device__ __forceinline__ float GroupScore(int group, const float (&m)[8], const float (&s)[8], bool skip,
                                            const float (&lg)[8]) {
  float best = NegInf();
  if (!skip) {
#pragma unroll
    for (int g = 0; g < 8; ++g)
      if (g < group) best = fmaxf(best, expf(lg[g] - m[g]) / s[g]);
  }
  return best;
}

// A chunk's score from the group's logits (the fused selection's keys, and
// the unfused path with successors or several landmarks per chunk): the best
// of its landmark rows c * per_chunk ...
struct GroupScoreSource {
  const float* logits;  // the group's first head; head g at + g * stride
  int64_t stride;
  const uint8_t* excl;  // null: none excluded
  int group;
  int per_chunk;
  float m[8], s[8];
  __device__ __forceinline__ float operator()(int c) const {
    const bool skip = excl && excl[c];
    float best = NegInf();
    for (int j = 0; j < per_chunk; ++j) {
      const int64_t v = static_cast<int64_t>(c) * per_chunk + j;
      float lg[8];
#pragma unroll
      for (int g = 0; g < 8; ++g) lg[g] = g < group ? logits[g * stride + v] : 0.0f;
      best = fmaxf(best, GroupScore(group, m, s, skip, lg));
    }
    return best;
  }
};

// ShadowkvScoreArgs::successors: a selectable chunk's score is the best of
// its own and its `successors` predecessors' (an excluded chunk, -inf, stays
// so and passes nothing on).
template <class Src>
struct SuccessorScoreSource {
  Src base;
  int successors;
  __device__ __forceinline__ float operator()(int c) const {
    float best = base(c);
    if (best == NegInf()) return best;
    for (int j = 1; j <= successors && c - j >= 0; ++j) best = fmaxf(best, base(c - j));
    return best;
  }
};

// Phase 2: scores = max over the group of exp(logit - max) / sum.
__global__ void __launch_bounds__(kScoreThreads) ScoreFinalKernel(ShadowkvScoreArgs a, ScoreWorkspace ws) {
  const int h = blockIdx.y, b = blockIdx.z;
  const int group = a.hq / a.hkv;
  const int n = a.n_chunks[b];
  float m[8], s[8];
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    m[g] = 0.0f;
    s[g] = 1.0f;
    if (g < group) {
      const float2 v = ws.merged[static_cast<int64_t>(b) * a.hq + h * group + g];
      m[g] = v.x;
      s[g] = v.y;
    }
  }
  const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
  const float* logits = ws.logits + (static_cast<int64_t>(b) * a.hq + h * group) * ws.rows;
  float* out = a.scores + (static_cast<int64_t>(b) * a.hkv + h) * a.score_stride;
  if (a.successors > 0 || ws.shift > 0) {  // each chunk's score from several logits
    GroupScoreSource src{logits, ws.rows, excl, group, 1 << ws.shift, {}, {}};
#pragma unroll
    for (int g = 0; g < 8; ++g) src.m[g] = m[g], src.s[g] = s[g];
    const SuccessorScoreSource<GroupScoreSource> smoothed{src, a.successors};
    for (int j = 0; j < kScoreFinalPerThread; ++j) {
      const int c = (blockIdx.x * kScoreFinalPerThread + j) * kScoreThreads + threadIdx.x;
      if (c >= a.max_chunks) break;
      out[c] = c < n ? smoothed(c) : NegInf();
    }
    return;
  }
  // Every load first (predicated, independent), then the math: with the loads
  // inside the per-chunk branches a thread waited on one load at a time.
  float lg[kScoreFinalPerThread][8];
  bool skip[kScoreFinalPerThread];
#pragma unroll
  for (int j = 0; j < kScoreFinalPerThread; ++j) {
    const int c = (blockIdx.x * kScoreFinalPerThread + j) * kScoreThreads + threadIdx.x;
    skip[j] = c >= n || (excl && excl[c]);
#pragma unroll
    for (int g = 0; g < 8; ++g) lg[j][g] = g < group && c < n ? logits[static_cast<int64_t>(g) * ws.rows + c] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kScoreFinalPerThread; ++j) {
    const int c = (blockIdx.x * kScoreFinalPerThread + j) * kScoreThreads + threadIdx.x;
    if (c >= a.max_chunks) break;
    out[c] = GroupScore(group, m, s, skip[j], lg[j]);
  }
}

__device__ void SlotUpdateRow(const ShadowkvSlotUpdateArgs& a, int row, uint32_t* sm);  // section 3

// The selection of one row from `src`, then its selection_scores from the
// same functor (the same bits as the keys) and the slot update.
template <class Src>
__device__ __forceinline__ void SelectScoreUpdateRow(const Src& src, const ShadowkvScoreArgs& a, int row, int n,
                                                     uint32_t* smem, int cached_keys,
                                                     const ShadowkvSlotUpdateArgs& su, bool update) {
  int32_t* sel = a.selection + static_cast<int64_t>(row) * a.selection_stride;
  topk_block::SelectRow(src, n, a.select_k, /*smallest=*/false, /*skip_worst_inf=*/true, sel, smem, cached_keys);
  if (a.selection_scores == nullptr && !update) return;
  __syncthreads();  // the selection (global, written by other threads) and the shared memory, for what follows
  if (a.selection_scores != nullptr) {
    float* out = a.selection_scores + static_cast<int64_t>(row) * a.selection_stride;
    for (int64_t i = threadIdx.x; i < a.selection_stride; i += blockDim.x) {
      const int32_t c = i < a.select_k ? sel[i] : -1;
      out[i] = c >= 0 ? src(c) : NegInf();
    }
  }
  if (update) SlotUpdateRow(su, row, smem);
}

// Phase 1.5 + 2 + top-k in one launch (a selection was asked for and every
// row's chunks fit in shared memory): one block of topk_block::kThreads per
// row (sequence, KV head). Warp g merges query head g's split statistics,
// then the top-k computes each chunk's score from the group's logits exactly
// as ScoreFinalKernel does, keeps it in shared memory as a key and selects.
// With selection_scores, the selected chunks' scores are computed again by the
// same functor (the same bits as the keys). update: the row's slot update
// (section 3) follows in the same block, reading the selection the block just
// wrote.
__global__ void __launch_bounds__(topk_block::kThreads)
    ScoreSelectKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int n_split, int cached_keys,
                      ShadowkvSlotUpdateArgs su, bool update) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  extern __shared__ __align__(16) uint32_t sel_smem[];
  __shared__ float2 s_ms[8];
  const int row = blockIdx.x, b = row / a.hkv, h = row % a.hkv;
  const int group = a.hq / a.hkv, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = min(a.n_chunks[b], a.max_chunks);
  if (warp < group) {
    const int idx = b * a.hq + h * group + warp;
    const int ns = ((n << ws.shift) + ws.split - 1) / ws.split;
    const float2 ms = a.stats_in != nullptr ? CombineParts(a, idx, lane)
                                            : MergeSplits(ws.splits + static_cast<int64_t>(idx) * n_split, ns, lane);
    if (lane == 0) s_ms[warp] = ms;
  }
  __syncthreads();
  GroupScoreSource src;
  src.logits = ws.logits + (static_cast<int64_t>(b) * a.hq + h * group) * ws.rows;
  src.stride = ws.rows;
  src.excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
  src.group = group;
  src.per_chunk = 1 << ws.shift;
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    src.m[g] = g < group ? s_ms[g].x : 0.0f;
    src.s[g] = g < group ? s_ms[g].y : 1.0f;
  }
  if (a.successors > 0) {
    SelectScoreUpdateRow(SuccessorScoreSource<GroupScoreSource>{src, a.successors}, a, row, n, sel_smem, cached_keys,
                         su, update);
  } else {
    SelectScoreUpdateRow(src, a, row, n, sel_smem, cached_keys, su, update);
  }
}

// The unfused path's selection scores: one block per row reads the selected
// chunks' scores.
__global__ void SelectionScoresKernel(ShadowkvScoreArgs a) {
  const int64_t row = blockIdx.x;
  const int32_t* sel = a.selection + row * a.selection_stride;
  const float* scores = a.scores + row * a.score_stride;
  float* out = a.selection_scores + row * a.selection_stride;
  for (int64_t i = threadIdx.x; i < a.selection_stride; i += blockDim.x) {
    const int32_t c = i < a.select_k ? sel[i] : -1;
    out[i] = c >= 0 ? scores[c] : NegInf();
  }
}

// Phase 1 on tensor cores (bf16 q and landmarks, d in {64, 128}, group in
// {1, 2, 4, 8}): the QK^T half of the decode-attention kernel, with the same
// helpers (LoadPermutedQ/K, MmaPermutedQK in kernels/mma.cuh): S = Q . L^T with
// the group's query heads as rows (zero-padded), 4 warps each walking 2 x 16
// landmarks per iteration with its own (max, sum exp) per head, merged per
// block. Same outputs as ScoreLogitsKernel: logits and per-split statistics.
constexpr int kScoreMmaWarps = 4;
static_assert(kScoreMmaSplit % (kScoreMmaWarps * 32) == 0, "a split is whole passes of the block's warps");

template <int G, int D, bool F8>
__global__ void __launch_bounds__(kScoreMmaWarps * 32, 4)
    ScoreLogitsMmaKernel(ShadowkvScoreArgs a, ScoreWorkspace ws, int n_split) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  constexpr int kJ = D / 32;  // 16-byte loads per landmark row and lane
  __shared__ float s_m[kScoreMmaWarps][8], s_s[kScoreMmaWarps][8];
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int n = a.n_chunks[b] << ws.shift;  // landmark rows
  const int c0 = split * ws.split;
  if (c0 >= n) return;  // the merge reads only splits below n
  const int c1 = min(n, c0 + ws.split);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;

  uint32_t qa[D / 16][2];  // rows r + 8 are zero
  const bf16* q_row = static_cast<const bf16*>(a.q) + (static_cast<int64_t>(b) * a.hq + h * G + min(r, G - 1)) * D;
  if constexpr (F8) LoadPermutedQForFp8K<D>(q_row, r < G, c, qa);
  else LoadPermutedQ<D>(q_row, r < G, c, qa);
  const LandmarkRows<std::conditional_t<F8, Fp8, bf16>> land(a, b, h, ws.shift);
  const uint8_t* excl = a.excluded ? a.excluded[b] + static_cast<int64_t>(h) * a.chunk_cap : nullptr;
  float* logit_row = ws.logits + (static_cast<int64_t>(b) * a.hq + h * G + min(r, G - 1)) * ws.rows;
  float m_run = NegInf(), s_run = 0.0f;  // head r; s is this lane's partial sum

#pragma unroll 1
  for (int base = c0 + warp * 32; base < c1; base += kScoreMmaWarps * 32) {
    uint4 kr[4][kJ];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int row = base + 8 * nt + r;
      if constexpr (F8) LoadPermutedKFp8<D>(land.Row(min(row, c1 - 1)), row < c1, c, kr[nt]);
      else LoadPermutedK<D>(land.Row(min(row, c1 - 1)), row < c1, c, kr[nt]);
    }
    // fp8: the scales of this lane's 8 output rows (1 otherwise).
    float rs[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int chunk = base + 8 * nt + 2 * c + e;
        rs[nt][e] = F8 && chunk < c1 ? land.RowScale(chunk) : 1.0f;
      }
    // The exclusion flags of this lane's 8 output chunks, loaded beside the
    // landmarks (after the products their latency would add to every step).
    uint32_t ex = 0;  // bit 2 nt + e
    if (excl) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int chunk = base + 8 * nt + 2 * c + e;
          if (chunk < c1 && excl[chunk >> ws.shift]) ex |= 1u << (2 * nt + e);
        }
    }
    float x[4][2];
    float mx = NegInf();
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      MmaPermutedQK<D>(acc, qa, kr[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int chunk = base + 8 * nt + 2 * c + e;
        float v = NegInf();
        if (chunk < c1) {
          v = (ex >> (2 * nt + e)) & 1u ? NegInf() : acc[e] * (rs[nt][e] * a.scale);
          if (r < G) logit_row[chunk] = v;
        }
        x[nt][e] = v;
        mx = fmaxf(mx, v);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    if (m_new != NegInf()) {  // else every chunk so far is excluded: nothing to add
      s_run *= expf(m_run - m_new);  // 0 on the first finite max (s_run is 0 then)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) s_run += expf(x[nt][0] - m_new) + expf(x[nt][1] - m_new);
      m_run = m_new;
    }
  }
  s_run += __shfl_xor_sync(0xffffffffu, s_run, 1);
  s_run += __shfl_xor_sync(0xffffffffu, s_run, 2);
  if (c == 0) {
    s_m[warp][r] = m_run;
    s_s[warp][r] = s_run;
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float m = NegInf();
#pragma unroll
    for (int w = 0; w < kScoreMmaWarps; ++w) m = fmaxf(m, s_m[w][g]);
    float sum = 0.0f;
    if (m != NegInf()) {
#pragma unroll
      for (int w = 0; w < kScoreMmaWarps; ++w)
        if (s_m[w][g] != NegInf()) sum += s_s[w][g] * expf(s_m[w][g] - m);
    }
    ws.splits[(static_cast<int64_t>(b) * a.hq + h * G + g) * n_split + split] = make_float2(m, sum);
  }
}

template <int D, bool F8>
bool LaunchScoreLogitsMma(const ShadowkvScoreArgs& a, const ScoreWorkspace& ws, int n_split, cudaStream_t stream) {
  const dim3 grid(n_split, a.hkv, a.batch);
  const auto launch = [&](auto kernel) {
    LaunchChained(kernel, grid, kScoreMmaWarps * 32, 0, stream, a, ws, n_split);
    return true;
  };
  switch (a.hq / a.hkv) {
    case 1: return launch(ScoreLogitsMmaKernel<1, D, F8>);
    case 2: return launch(ScoreLogitsMmaKernel<2, D, F8>);
    case 4: return launch(ScoreLogitsMmaKernel<4, D, F8>);
    case 8: return launch(ScoreLogitsMmaKernel<8, D, F8>);
    default: return false;
  }
}

template <typename T>
void LaunchScoreLogits(const ShadowkvScoreArgs& a, const ScoreWorkspace& ws, int tpr, int n_split,
                       cudaStream_t stream) {
  const dim3 grid(n_split, a.hkv, a.batch);
  switch (a.hq / a.hkv) {
#define PENUMBRA_SCORE_CASE(G) \
  case G: ScoreLogitsKernel<T, G><<<grid, kScoreThreads, 0, stream>>>(a, ws, tpr, n_split); break;
    PENUMBRA_SCORE_CASE(1)
    PENUMBRA_SCORE_CASE(2)
    PENUMBRA_SCORE_CASE(3)
    PENUMBRA_SCORE_CASE(4)
    PENUMBRA_SCORE_CASE(5)
    PENUMBRA_SCORE_CASE(6)
    PENUMBRA_SCORE_CASE(7)
    PENUMBRA_SCORE_CASE(8)
#undef PENUMBRA_SCORE_CASE
    default: LOG(FATAL) << "ShadowkvScore: unsupported group size " << a.hq / a.hkv;
  }
}

// ============================================================================
// 2b. Global selection (context parallel)
// ============================================================================
// Candidate i of a row: part i / cand_stride's proposal i % cand_stride, so
// that top-k's ties to the lower index go to the lower part, then the lower i.
struct CandidateSource {
  const float* row0;  // part 0's proposal scores of the row
  int64_t part_stride;
  int cand_stride;
  __device__ __forceinline__ float operator()(int i) const {
    const int p = i / cand_stride;
    return row0[p * part_stride + (i - p * cand_stride)];
  }
};

// One block of topk_block::kThreads per row: the top-k over every part's
// proposals into the row's winners, then this rank's winners mapped to its
// chunk ids, then (update) the row's slot update, as in ScoreSelectKernel.
__global__ void __launch_bounds__(topk_block::kThreads)
    GlobalSelectKernel(ShadowkvGlobalSelectArgs a, int cached_keys, ShadowkvSlotUpdateArgs su, bool update) {
  ChainWait();  // launched chained: see LaunchChained
  ChainRelease();
  extern __shared__ __align__(16) uint32_t gsel_smem[];
  const int row = blockIdx.x;
  const CandidateSource src{a.candidates + static_cast<int64_t>(row) * a.cand_stride, a.part_stride, a.cand_stride};
  int32_t* win = a.winners + static_cast<int64_t>(row) * a.k;
  topk_block::SelectRow(src, a.parts * a.cand_stride, a.k, /*smallest=*/false, /*skip_worst_inf=*/true, win,
                        gsel_smem, cached_keys);
  __syncthreads();  // the winners (global, written by other threads)
  // The winners ascend, so this rank's, [lo, hi), are one run after the
  // `before` winners of lower ranks; `mine` of them.
  const int lo = a.rank * a.cand_stride, hi = lo + a.cand_stride;
  int before = 0, mine = 0;
  for (int i0 = 0; i0 < a.k; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    const int32_t w = i < a.k ? win[i] : -1;
    before += __syncthreads_count(w >= 0 && w < lo);
    mine += __syncthreads_count(w >= lo && w < hi);
  }
  int32_t* sel = a.selection + static_cast<int64_t>(row) * a.selection_stride;
  const int32_t* prop = a.proposals + static_cast<int64_t>(row) * a.cand_stride;
  for (int i = threadIdx.x; i < a.k; i += blockDim.x) {
    const int32_t w = win[i];
    if (w >= lo && w < hi && i - before < a.selection_len) sel[i - before] = prop[w - lo];
  }
  for (int j = mine + threadIdx.x; j < a.selection_len; j += blockDim.x) sel[j] = -1;
  if (!update) return;
  __syncthreads();  // the selection (global, written by other threads), for the slot update
  SlotUpdateRow(su, row, gsel_smem);
}

// ============================================================================
// 3. Slot update
// ============================================================================
constexpr int kSlotThreads = 256;

__device__ __forceinline__ bool TestBit(const uint32_t* bits, int c) { return (bits[c >> 5] >> (c & 31)) & 1u; }
__device__ __forceinline__ void SetBit(uint32_t* bits, int c) { atomicOr(&bits[c >> 5], 1u << (c & 31)); }

// Appends, in order, the entries src[i] (i < n) for which pred(src[i]) holds to
// dst starting at *count, while *count < limit. Run by one full warp.
template <typename Pred>
__device__ __forceinline__ void WarpAppend(const int32_t* src, int n, Pred pred, int32_t* dst, int& count,
                                           int limit, int lane) {
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
  int32_t* sel = prev + ks;                                       // [ks] final selection
  int32_t* free_list = sel + ks;                                  // [ks]
  int32_t* misses = free_list + ks;                               // [ks]
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
      WarpAppend(sel_in, ks, [&](int32_t c) { return valid(c) && !TestBit(prev_bits, c); }, sel, nsel, ks, lane);
      WarpAppend(sel_in, ks,
                 [&](int32_t c) { return valid(c) && TestBit(prev_bits, c) && !TestBit(sel_bits, c); }, sel,
                 nsel, ks, lane);
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
    WarpAppend(sel, nsel, [&](int32_t c) { return !TestBit(prev_bits, c); }, misses, nmiss, ks, lane);
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

__global__ void __launch_bounds__(kSlotThreads) SlotUpdateKernel(ShadowkvSlotUpdateArgs a) {
  extern __shared__ __align__(16) uint32_t sm[];
  SlotUpdateRow(a, blockIdx.x, sm);
}

size_t SlotUpdateSharedBytes(const ShadowkvSlotUpdateArgs& a) {
  const size_t words = (static_cast<size_t>(a.chunk_cap) + 31) / 32;
  return (2 * words + 4 * static_cast<size_t>(a.kslots)) * sizeof(uint32_t);
}

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
  float* As = smf;                   // [kSimtTokens][r]
  float* Xs = smf + kSimtTokens * r; // [kSimtTokens][d]
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
  bf16* Bs = reinterpret_cast<bf16*>(smem);                               // [kpad][b_stride]
  bf16* As = reinterpret_cast<bf16*>(smem + L.b_bytes);                  // [stages][64][a_stride]
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
  auto issue_a = [&](int tile, int stage, const int32_t* chunks) {
    const int rows_used = min(per_tile, count - tile * per_tile) * C;
    bf16* dst = As + static_cast<size_t>(stage) * kRebuildTileRows * L.a_stride;
    for (int idx = tid; idx < rows_used * vpr; idx += nthreads) {
      const int rr = idx / vpr, k0 = (idx - rr * vpr) * 8;
      const int64_t t = static_cast<int64_t>(chunks[rr / C]) * C + rr % C;
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
    const int buf = it & 1, stage = it % L.stages;
    // The next tile's lists, loaded now and stored after the products.
    int32_t nchunk = 0, nslot = 0;
    const bool has_next = next < ntiles;
    const int nm0 = next * per_tile, nn = has_next ? min(per_tile, count - nm0) : 0;
    if (tid < nn) {
      nchunk = mchunk[nm0 + tid];
      nslot = mslot[nm0 + tid];
    }
    CpAsyncWait<0>();
    __syncthreads();  // the tile's A (every thread's copies) and lists are visible

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
    if (tid < nn) {
      s_idx[(buf ^ 1) * 2 * kRebuildTileRows + tid] = nchunk;
      s_idx[(buf ^ 1) * 2 * kRebuildTileRows + kRebuildTileRows + tid] = nslot;
    }
    __syncthreads();  // every warp is done with this stage's A; the next lists are visible
    if (has_next) issue_a(next, (it + 1) % L.stages, s_idx + (buf ^ 1) * 2 * kRebuildTileRows);
    CpAsyncCommit();

    // RoPE at the true positions, in f32, from the accumulators.
    const int rows_used = min(per_tile, count - tile * per_tile) * C;
    const int32_t* chunks = s_idx + buf * 2 * kRebuildTileRows;
    const int32_t* slots = chunks + kRebuildTileRows;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int rr = 16 * wm + g + 8 * hr;
      if (rr >= rows_used) continue;
      const int mi = rr / C, i = rr - mi * C;
      const int64_t t = static_cast<int64_t>(chunks[mi]) * C + i;
      const float pos = static_cast<float>(static_cast<int32_t>(t) + offset);
      bf16* dst = K + (static_cast<int64_t>(slots[mi]) * C + i) * d;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        float s0, c0, s1, c1;
        sincosf(pos * freq[nt][0], &s0, &c0);
        sincosf(pos * freq[nt][1], &s1, &c1);
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

// ============================================================================
// 5./6. Value fetch / scatter
// ============================================================================
// The copy is PCIe-latency bound, not SM bound: a few SMs with enough 16-byte
// loads in flight (kFetchMaxBlocks x 256 threads x kFetchUnroll x 16 B = 1 MiB)
// saturate the link, and the rest of the GPU stays free for the K rebuild on
// the other stream and for other lanes' kernels. (One block per 8 misses, as
// before, filled every SM with threads waiting on PCIe.)
// The work is the misses only: each block first scans the per-row miss counts
// into a prefix in shared memory, then its threads copy vectors v, v + T, ...
// of the flattened [miss][vector] space, finding each miss's row by binary
// search. A step with few misses (a high hit rate) costs little more than the
// launch, where walking the [row][max_misses] space cost ~0.1 ms per layer.
// Width measured with two lanes at the natural hit rate (124928 x 14, H200):
// 16 blocks 54.9 ms per step, 32 blocks 51.5, 64 blocks 56.7.
constexpr int kFetchThreads = 256;
constexpr int kFetchUnroll = 8;     // 16-byte loads in flight per thread
constexpr int kFetchMaxBlocks = 32;

__global__ void __launch_bounds__(kFetchThreads) FetchVKernel(ShadowkvFetchVArgs a, int nvec, int elem_bytes) {
  extern __shared__ int32_t s_first[];  // [rows + 1]: first miss of each row in the flattened list
  using Scan = cub::BlockScan<int32_t, kFetchThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int rows = a.batch * a.hkv;
  {
    const int per = (rows + kFetchThreads - 1) / kFetchThreads;
    const int lo = min(rows, static_cast<int>(threadIdx.x) * per), hi = min(rows, lo + per);
    int32_t sum = 0;
    for (int r = lo; r < hi; ++r) sum += min(max(a.miss_count[r], 0), a.max_misses);
    int32_t off = 0;
    Scan(scan_tmp).ExclusiveSum(sum, off);
    for (int r = lo; r < hi; ++r) {
      s_first[r] = off;
      off += min(max(a.miss_count[r], 0), a.max_misses);
    }
    if (threadIdx.x == kFetchThreads - 1) s_first[rows] = off;  // its range is the last (or empty): off = total
  }
  __syncthreads();
  const int64_t total = static_cast<int64_t>(s_first[rows]) * nvec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFetchThreads;
  const int64_t chunk_bytes = static_cast<int64_t>(nvec) * 16;
  for (int64_t v0 = static_cast<int64_t>(blockIdx.x) * kFetchThreads + threadIdx.x; v0 < total;
       v0 += stride * kFetchUnroll) {
    uint4 buf[kFetchUnroll];
    uint4* dst[kFetchUnroll];
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u) {
      dst[u] = nullptr;
      const int64_t v = v0 + u * stride;
      if (v >= total) continue;
      const int item = static_cast<int>(v / nvec);
      const int vi = static_cast<int>(v - static_cast<int64_t>(item) * nvec);
      int lo = 0, hi = rows;  // the row with s_first[row] <= item < s_first[row + 1]
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s_first[mid] <= item) lo = mid; else hi = mid;
      }
      const int row = lo, m = item - s_first[row];
      const int b = row / a.hkv, h = row % a.hkv;
      const int64_t at = static_cast<int64_t>(row) * a.miss_stride + m;
      const char* src;
      if (a.staging) {
        const int64_t base = a.staging_offsets ? a.staging_offsets[row] : static_cast<int64_t>(row) * a.miss_stride;
        src = static_cast<const char*>(a.staging) + (base + m) * chunk_bytes;
      } else {
        const int64_t c = a.miss_chunk[at];
        if (c < a.shared_chunks) {
          src = static_cast<const char*>(a.shared_store[b]) + (static_cast<int64_t>(h) * a.shared_stride + c) * chunk_bytes;
        } else {
          src = static_cast<const char*>(a.value_store[b]) +
                (static_cast<int64_t>(h) * a.chunk_cap + c - a.shared_chunks) * chunk_bytes;
        }
      }
      const int64_t row0 = a.outlier_rows + static_cast<int64_t>(a.miss_slot[at]) * a.chunk_size;
      char* d = static_cast<char*>(a.att_v[b]) + (h * a.att_head_stride + row0 * a.d) * elem_bytes;
      buf[u] = __ldcs(reinterpret_cast<const uint4*>(src) + vi);
      dst[u] = reinterpret_cast<uint4*>(d) + vi;
    }
#pragma unroll
    for (int u = 0; u < kFetchUnroll; ++u)
      if (dst[u]) *dst[u] = buf[u];
  }
}

}  // namespace

// ---- launchers ----------------------------------------------------------------

size_t ShadowkvScoreWorkspaceBytes(int batch, int hq, int max_chunks, int landmarks_per_chunk) {
  const int rows = max_chunks * landmarks_per_chunk;
  return AlignUp(sizeof(float) * static_cast<size_t>(batch) * hq * std::max(rows, 1)) +
         AlignUp(sizeof(float2) * static_cast<size_t>(batch) * hq * ScoreSplits(rows, kScoreMinSplit)) +
         AlignUp(sizeof(float2) * static_cast<size_t>(batch) * hq);
}

void LaunchShadowkvScore(const ShadowkvScoreArgs& a, cudaStream_t stream, const ShadowkvSlotUpdateArgs* then_update) {
  CHECK(a.stats_out == nullptr || a.stats_in == nullptr) << "ShadowkvScore: stats_out and stats_in are two calls";
  CHECK(a.stats_out == nullptr || then_update == nullptr)
      << "ShadowkvScore: a statistics-only call (stats_out) selects nothing to update the slots with";
  if (a.stats_in != nullptr) {
    CHECK(a.stats_parts >= 1 && (a.stats_parts == 1 || a.stats_part_stride >= 2 * static_cast<int64_t>(a.batch) * a.hq))
        << "ShadowkvScore: stats_parts " << a.stats_parts << " stats_part_stride " << a.stats_part_stride;
  }
  if (then_update) {
    CHECK(a.select_k > 0 && then_update->selection == a.selection &&
          then_update->selection_stride == a.selection_stride && then_update->batch == a.batch &&
          then_update->hkv == a.hkv && then_update->kslots <= a.select_k)
        << "ShadowkvScore: the slot update must read this selection";
  }
  if (a.batch <= 0) return;
  // The first of two calls (stats_out) selects nothing.
  const bool with_selection = a.select_k > 0 && a.stats_out == nullptr;
  const bool with_selection_scores = with_selection && a.selection_scores != nullptr;
  constexpr int kMergeWarps = 4;
  const int merge_blocks = (a.batch * a.hq + kMergeWarps - 1) / kMergeWarps;
  if (a.max_chunks <= 0) {
    // No chunks: the statistics are (-inf, 0) (the merge reads no split); the
    // selection is still written (all -1, as the CPU backend's).
    if (a.stats_out != nullptr) {
      ScoreWorkspace none{};
      none.split = kScoreSplit;
      ScoreMergeKernel<<<merge_blocks, kMergeWarps * 32, 0, stream>>>(a, none, 0);
      PENUMBRA_CUDA_CHECK(cudaGetLastError());
      return;
    }
    if (with_selection) LaunchTopK(ShadowkvSelectionTopK(a), stream);
    if (with_selection_scores) {
      SelectionScoresKernel<<<a.batch * a.hkv, kScoreThreads, 0, stream>>>(a);
      PENUMBRA_CUDA_CHECK(cudaGetLastError());
    }
    if (then_update) LaunchShadowkvSlotUpdate(*then_update, stream);
    return;
  }
  CHECK(a.hkv > 0 && a.hq % a.hkv == 0 && a.hq / a.hkv <= 8) << "ShadowkvScore: hq " << a.hq << " hkv " << a.hkv;
  CHECK(a.d % 8 == 0 && a.d <= 256) << "ShadowkvScore: d " << a.d;
  CHECK_GE(a.score_stride, a.max_chunks);
  CHECK_LE(a.max_chunks, a.chunk_cap);
  const int per_chunk = a.landmarks_per_chunk;
  CHECK(per_chunk >= 1 && per_chunk <= 16 && (per_chunk & (per_chunk - 1)) == 0)
      << "ShadowkvScore: landmarks_per_chunk " << per_chunk << " (a power of two up to 16)";
  CHECK_GE(a.workspace_bytes, ShadowkvScoreWorkspaceBytes(a.batch, a.hq, a.max_chunks, per_chunk));
  if (with_selection) {
    CHECK(a.select_k <= kTopKMaxK && a.selection != nullptr && a.selection_stride >= a.select_k)
        << "ShadowkvScore: selection k " << a.select_k << " stride " << a.selection_stride;
  }
  int tpr = 1;
  while (tpr < a.d / 8) tpr <<= 1;
  const int group = a.hq / a.hkv;
  const bool fp8 = a.landmark_fp8;
  CHECK(!fp8 || a.d % 8 == 0) << "ShadowkvScore: fp8 landmarks need d % 8 == 0, got " << a.d;
  const bool mma_ok = (fp8 || a.dtype == DType::kBF16) && a.q_dtype == DType::kBF16 && (a.d == 128 || a.d == 64) &&
                      (group == 1 || group == 2 || group == 4 || group == 8);
  const int split = mma_ok ? kScoreMmaSplit : kScoreSplit;
  const ScoreWorkspace ws = CarveScoreWorkspace(a.workspace, a.batch, a.hq, a.max_chunks, per_chunk, split);
  const int n_split = ScoreSplits(ws.rows, split);
  // The second call (stats_in) reuses the logits the first left in the
  // workspace: same arguments, so the same split and layout.
  if (a.stats_in == nullptr) {
    if (mma_ok && fp8) {
      CHECK((a.d == 128 ? LaunchScoreLogitsMma<128, true>(a, ws, n_split, stream)
                        : LaunchScoreLogitsMma<64, true>(a, ws, n_split, stream)));
    } else if (mma_ok) {
      CHECK((a.d == 128 ? LaunchScoreLogitsMma<128, false>(a, ws, n_split, stream)
                        : LaunchScoreLogitsMma<64, false>(a, ws, n_split, stream)));
    } else if (fp8) {
      LaunchScoreLogits<Fp8>(a, ws, tpr, n_split, stream);
    } else if (a.dtype == DType::kF32) {
      LaunchScoreLogits<float>(a, ws, tpr, n_split, stream);
    } else {
      CHECK(a.dtype == DType::kBF16) << "ShadowkvScore: landmarks must be f32 or bf16";
      LaunchScoreLogits<bf16>(a, ws, tpr, n_split, stream);
    }
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
  }
  if (a.stats_out != nullptr) {
    ScoreMergeKernel<<<merge_blocks, kMergeWarps * 32, 0, stream>>>(a, ws, n_split);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (with_selection && a.max_chunks <= kTopKSharedKeys) {
    const int cached = a.max_chunks;
    size_t smem = topk_block::SharedWords(cached) * sizeof(uint32_t);
    if (then_update) smem = std::max(smem, SlotUpdateSharedBytes(*then_update));
    const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&ScoreSelectKernel));
    if (smem <= static_cast<size_t>(max_dynamic)) {
      LaunchChained(ScoreSelectKernel, a.batch * a.hkv, topk_block::kThreads, smem, stream, a, ws, n_split, cached,
                    then_update ? *then_update : ShadowkvSlotUpdateArgs{}, then_update != nullptr);
      PENUMBRA_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  ScoreMergeKernel<<<merge_blocks, kMergeWarps * 32, 0, stream>>>(a, ws, n_split);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
  const int per_block = kScoreThreads * kScoreFinalPerThread;
  const dim3 grid((a.max_chunks + per_block - 1) / per_block, a.hkv, a.batch);
  ScoreFinalKernel<<<grid, kScoreThreads, 0, stream>>>(a, ws);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
  if (with_selection) LaunchTopK(ShadowkvSelectionTopK(a), stream);
  if (with_selection_scores) {
    SelectionScoresKernel<<<a.batch * a.hkv, kScoreThreads, 0, stream>>>(a);
    PENUMBRA_CUDA_CHECK(cudaGetLastError());
  }
  if (then_update) LaunchShadowkvSlotUpdate(*then_update, stream);
}

__global__ void MaxRowsKernel(MaxRowsArgs a) {
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < a.cols; c += int64_t{gridDim.x} * blockDim.x) {
    float m = a.accumulate ? a.out[c] : -INFINITY;
    for (int r = 0; r < a.rows; ++r) m = fmaxf(m, a.in[r * a.row_stride + c]);
    a.out[c] = m;
  }
}

void LaunchMaxRows(const MaxRowsArgs& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.cols <= 0) return;
  CHECK_GE(a.row_stride, a.cols);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((a.cols + threads - 1) / threads, 4096);
  MaxRowsKernel<<<static_cast<int>(blocks), threads, 0, stream>>>(a);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

void LaunchShadowkvGlobalSelect(const ShadowkvGlobalSelectArgs& a, cudaStream_t stream,
                                const ShadowkvSlotUpdateArgs* then_update) {
  if (a.rows <= 0) return;
  CHECK(a.k >= 1 && a.k <= kTopKMaxK) << "ShadowkvGlobalSelect: k " << a.k;
  CHECK(a.parts >= 1 && a.rank >= 0 && a.rank < a.parts) << "ShadowkvGlobalSelect: rank " << a.rank << " of "
                                                        << a.parts << " parts";
  const int64_t n = static_cast<int64_t>(a.parts) * a.cand_stride;
  CHECK(a.cand_stride >= 0 && n <= std::numeric_limits<int32_t>::max())
      << "ShadowkvGlobalSelect: " << a.parts << " parts of " << a.cand_stride << " candidates";
  CHECK(a.parts == 1 || a.part_stride >= static_cast<int64_t>(a.rows) * a.cand_stride)
      << "ShadowkvGlobalSelect: part_stride " << a.part_stride;
  CHECK(a.selection_len >= 0 && a.selection_len <= a.selection_stride)
      << "ShadowkvGlobalSelect: selection_len " << a.selection_len << " stride " << a.selection_stride;
  CHECK(a.winners != nullptr && a.selection != nullptr && a.selection != a.proposals)
      << "ShadowkvGlobalSelect: winners and a selection apart from the proposals";
  if (then_update) {
    CHECK(then_update->selection == a.selection && then_update->selection_stride == a.selection_stride &&
          then_update->batch * then_update->hkv == a.rows && then_update->kslots <= a.selection_len)
        << "ShadowkvGlobalSelect: the slot update must read this selection";
  }
  const auto smem_for = [&](int cached_keys) {
    size_t smem = topk_block::SharedWords(cached_keys) * sizeof(uint32_t);
    if (then_update) smem = std::max(smem, SlotUpdateSharedBytes(*then_update));
    return smem;
  };
  const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&GlobalSelectKernel));
  int cached = n <= kTopKSharedKeys ? static_cast<int>(n) : 0;
  // Where the keys and the slot update's bitmaps do not fit together, the
  // top-k re-reads the candidates (L2) in every pass instead.
  if (smem_for(cached) > static_cast<size_t>(max_dynamic)) cached = 0;
  const size_t smem = smem_for(cached);
  CHECK_LE(smem, static_cast<size_t>(max_dynamic))
      << "ShadowkvGlobalSelect: the slot update needs too much shared memory";
  LaunchChained(GlobalSelectKernel, a.rows, topk_block::kThreads, smem, stream, a, cached,
                then_update ? *then_update : ShadowkvSlotUpdateArgs{}, then_update != nullptr);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

void LaunchShadowkvSlotUpdate(const ShadowkvSlotUpdateArgs& a, cudaStream_t stream) {
  const int rows = a.batch * a.hkv;
  if (rows <= 0 || a.kslots <= 0) return;
  CHECK_GE(a.selection_stride, a.kslots);
  const size_t smem = SlotUpdateSharedBytes(a);
  const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&SlotUpdateKernel));
  CHECK_LE(smem, static_cast<size_t>(max_dynamic)) << "ShadowkvSlotUpdate: chunk_cap " << a.chunk_cap
                                                   << " kslots " << a.kslots << " need too much shared memory";
  SlotUpdateKernel<<<rows, kSlotThreads, smem, stream>>>(a);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

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

void LaunchShadowkvFetchV(const ShadowkvFetchVArgs& a, cudaStream_t stream) {
  const int rows = a.batch * a.hkv;
  if (rows <= 0 || a.max_misses <= 0) return;
  CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF32) << "ShadowkvFetchV: dtype";
  const int elem_bytes = static_cast<int>(DTypeSize(a.dtype));
  CHECK_EQ(static_cast<int64_t>(a.chunk_size) * a.d * elem_bytes % 16, 0) << "ShadowkvFetchV: chunk bytes";
  CHECK_EQ(static_cast<int64_t>(a.d) * elem_bytes % 16, 0) << "ShadowkvFetchV: V rows must be 16-byte aligned";
  const int nvec = static_cast<int>(static_cast<int64_t>(a.chunk_size) * a.d * elem_bytes / 16);
  const int64_t total = static_cast<int64_t>(rows) * a.max_misses * nvec;
  const int64_t per_block = static_cast<int64_t>(kFetchThreads) * kFetchUnroll;
  const int max_blocks = a.max_blocks > 0 ? a.max_blocks : kFetchMaxBlocks;
  const int blocks = static_cast<int>(std::clamp<int64_t>((total + per_block - 1) / per_block, 1, max_blocks));
  const size_t smem = sizeof(int32_t) * (static_cast<size_t>(rows) + 1);
  const int max_dynamic = AllowDynamicSharedMemory(reinterpret_cast<const void*>(&FetchVKernel));
  CHECK_LE(smem, static_cast<size_t>(max_dynamic)) << "ShadowkvFetchV: " << rows << " rows (batch x hkv) is too many";
  FetchVKernel<<<blocks, kFetchThreads, smem, stream>>>(a, nvec, elem_bytes);
  PENUMBRA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace penumbra::kernels
